//! Timing one call of a method, and its extra memory.
//!
//! * CPU: [`CPU_WARM_UP`] untimed runs, then `repeats` timed runs; the fastest is kept. The
//!   counting allocator records each run's peak of heap bytes beyond what its results hold.
//! * GPU: kernels run asynchronously, so a run is over only when the GPU is synchronized: after
//!   an untimed run (compiling the kernels) and one synchronized run to size the batches, each of
//!   `repeats` batches queues enough back-to-back calls for about 50 ms and synchronizes; the
//!   fastest batch's time per call is kept. The sizing run also
//!   measures device memory: the peak in use in the GPU's memory pool (which serves every
//!   flashattn allocation) beyond what its results still hold.

use std::time::Instant;

use flashattn::{Device, Tensor};

use super::{CliResult, device, memory};

/// A GPU batch aims at this many seconds.
const GPU_BATCH_SECONDS: f64 = 0.05;
/// The most calls one GPU batch queues.
const GPU_MAX_BATCH: usize = 200;

/// How the extra memory figure was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra {
    /// Peak of host heap bytes during the call beyond its results (the counting allocator).
    Measured(u64),
    /// Peak of device memory in use in the GPU's memory pool during the call beyond its results.
    Device(u64),
    /// What the method allocates on the device by design (its own formula), not measured.
    Planned(u64),
    /// Nothing known (a GPU without a memory pool).
    Unknown,
}

impl Extra {
    /// The bytes, when known.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Extra::Measured(b) | Extra::Device(b) | Extra::Planned(b) => Some(b),
            Extra::Unknown => None,
        }
    }

    /// What the figure is, for scripts: `measured`, `planned` or `null`.
    pub fn source(self) -> Option<&'static str> {
        match self {
            Extra::Measured(_) => Some("measured host heap peak"),
            Extra::Device(_) => Some("measured device memory pool peak"),
            Extra::Planned(_) => Some("planned device allocation"),
            Extra::Unknown => None,
        }
    }
}

/// One method's figures.
#[derive(Clone, Copy, Debug)]
pub struct Measurement {
    /// Fastest run, milliseconds.
    pub time_ms: f64,
    /// FLOP rate of the fastest run, GFLOP/s.
    pub gflops: f64,
    /// Memory beyond inputs and outputs.
    pub extra: Extra,
}

fn bytes_of(ts: &[Tensor]) -> u64 {
    ts.iter()
        .map(|t| (t.numel() * t.dtype().size_in_bytes()) as u64)
        .sum()
}

/// Times `call` on `dev` (see the module docs); `flops` is the work of one call.
pub fn measure(
    dev: Device,
    repeats: u32,
    flops: f64,
    call: impl FnMut() -> CliResult<Vec<Tensor>>,
) -> CliResult<Measurement> {
    let (secs, extra) = match dev {
        Device::Cpu => cpu(repeats, call)?,
        Device::Cuda(ordinal) => gpu(ordinal, repeats, call)?,
    };
    Ok(Measurement {
        time_ms: secs * 1e3,
        gflops: flops / secs / 1e9,
        extra,
    })
}

/// Untimed CPU runs before the timed ones. A call runs on its caller's thread and the pool
/// threads that join it, which differ from call to call; each thread keeps its tile buffers
/// for its next call, so with one run a thread's buffers could first be allocated (and counted
/// as extra memory) in a timed run.
const CPU_WARM_UP: usize = 3;

fn cpu(repeats: u32, mut call: impl FnMut() -> CliResult<Vec<Tensor>>) -> CliResult<(f64, Extra)> {
    for _ in 0..CPU_WARM_UP {
        drop(call()?);
    }
    let (mut best, mut extra) = (f64::INFINITY, 0u64);
    for _ in 0..repeats {
        let start = Instant::now();
        let (outs, peak) = memory::peak_during(&mut call);
        let secs = start.elapsed().as_secs_f64();
        let outs = outs?;
        best = best.min(secs);
        extra = extra.max((peak as u64).saturating_sub(bytes_of(&outs)));
    }
    Ok((best, Extra::Measured(extra)))
}

fn gpu(
    ordinal: usize,
    repeats: u32,
    mut call: impl FnMut() -> CliResult<Vec<Tensor>>,
) -> CliResult<(f64, Extra)> {
    // A batch is waited for by synchronizing, not by reading a result back: that would time its
    // download too, and a result of 32 MiB or more lands in fresh host pages each time.
    drop(call()?);
    device::synchronize(ordinal)?;
    let probe = device::MemoryProbe::start(ordinal);
    let start = Instant::now();
    let outs = call()?;
    device::synchronize(ordinal)?;
    let one = start.elapsed().as_secs_f64().max(1e-6);
    let extra = probe
        .and_then(|p| p.extra_while_results_held())
        .map_or(Extra::Unknown, Extra::Device);
    drop(outs);
    let batch = ((GPU_BATCH_SECONDS / one) as usize).clamp(1, GPU_MAX_BATCH);
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let start = Instant::now();
        for _ in 0..batch {
            drop(call()?);
        }
        device::synchronize(ordinal)?;
        best = best.min(start.elapsed().as_secs_f64() / batch as f64);
    }
    Ok((best, extra))
}

/// A warning when other processes keep the CPUs busy (the 1-minute load average of
/// `/proc/loadavg` above half the CPU count): wall-clock times will be inflated.
pub fn load_note() -> Option<String> {
    let load: f64 = std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (load > cpus as f64 * 0.5).then(|| {
        format!(
            "the load average is {load:.1} on {cpus} CPUs before the run: other processes are \
             running, so times may be inflated"
        )
    })
}
