//! Where the command computes: checking the device is there, moving inputs to it and results
//! back, and waiting for it.
//!
//! A GPU needs the CUDA driver, the GPU itself and NVRTC (kernels are compiled at run time);
//! each missing piece is a message and exit status 2, never a panic. A build without the `cuda`
//! feature refuses `--device cuda` the same way.

use flashattn::{Device, Tensor};

use super::inputs::Inputs;
use super::{CliResult, fail};

/// Checks that `device` can run attention, before any work starts.
pub fn ensure_available(device: Device) -> CliResult<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => cuda_available(device, ordinal),
    }
}

#[cfg(feature = "cuda")]
fn cuda_available(device: Device, ordinal: usize) -> CliResult<()> {
    let hint = "use --device cpu";
    match flashattn::cuda::device_count() {
        Ok(n) if ordinal < n => {}
        Ok(n) => {
            return Err(fail(format!(
                "--device {device}: this machine has {n} CUDA device(s); {hint}"
            )));
        }
        Err(e) => return Err(fail(format!("--device {device}: {e}; {hint}"))),
    }
    flashattn::cuda::nvrtc_version()
        .map(drop)
        .map_err(|e| fail(format!("--device {device}: {e}; {hint}")))
}

#[cfg(not(feature = "cuda"))]
fn cuda_available(device: Device, _ordinal: usize) -> CliResult<()> {
    Err(fail(format!(
        "--device {device}: this binary was built without the `cuda` feature; use --device cpu"
    )))
}

/// Device memory of one call on a GPU, from its memory pool: started before the call, read after
/// its results were waited for while they are still held.
pub struct MemoryProbe {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ordinal: usize,
}

impl MemoryProbe {
    /// Waits for queued work (so freed memory is back in the pool) and starts a new peak; `None`
    /// when the GPU's memory cannot be measured.
    pub fn start(ordinal: usize) -> Option<Self> {
        #[cfg(feature = "cuda")]
        {
            flashattn::cuda::synchronize(ordinal).ok()?;
            flashattn::cuda::reset_memory_peak(ordinal).ok()?;
            Some(MemoryProbe { ordinal })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            None
        }
    }

    /// The peak in use since [`MemoryProbe::start`] beyond what is in use now (the results).
    pub fn extra_while_results_held(self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        {
            flashattn::cuda::synchronize(self.ordinal).ok()?;
            let m = flashattn::cuda::memory_use(self.ordinal).ok()?;
            Some(m.peak.saturating_sub(m.current))
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }
}

/// A tensor moved to `device` (the tensor itself when it is there already).
pub fn to_device(t: &Tensor, device: Device) -> CliResult<Tensor> {
    Ok(t.to_device(device)?)
}

/// The inputs of a configuration, moved to `device`.
pub fn upload(x: &Inputs, device: Device) -> CliResult<Inputs> {
    let mut p = x.p.clone();
    if let Some(s) = &p.alibi_slopes {
        p.alibi_slopes = Some(to_device(s, device)?);
    }
    if let Some(b) = &p.bias {
        p.bias = Some(to_device(b, device)?);
    }
    if let Some(t) = &p.rel_bias {
        p.rel_bias = Some(to_device(t, device)?);
    }
    Ok(Inputs {
        q: to_device(&x.q, device)?,
        k: to_device(&x.k, device)?,
        v: to_device(&x.v, device)?,
        dout: to_device(&x.dout, device)?,
        p,
    })
}

/// A result tensor in host memory (a copy back from the GPU, which waits for the work queued
/// before it).
pub fn download(t: &Tensor) -> CliResult<Tensor> {
    to_device(t, Device::Cpu)
}

/// Waits until the work queued on GPU `ordinal` has finished.
pub fn synchronize(ordinal: usize) -> CliResult<()> {
    #[cfg(feature = "cuda")]
    flashattn::cuda::synchronize(ordinal)?;
    #[cfg(not(feature = "cuda"))]
    let _ = ordinal;
    Ok(())
}

/// The compile and load times of every kernel variant this process used on the GPU, as lines of
/// text: how its first use went (compiled by NVRTC, or loaded from the disk cache), and, for the
/// variants `flashattn::cuda::kernel_sources()` lists, a fresh NVRTC compile followed by a load
/// from the disk cache, whatever the caches held before. Empty on the CPU.
#[cfg(feature = "cuda")]
pub fn compile_report(device: Device) -> CliResult<Vec<String>> {
    let Device::Cuda(ordinal) = device else {
        return Ok(Vec::new());
    };
    let mut firsts: Vec<flashattn::cuda::CompileRecord> = Vec::new();
    for r in flashattn::cuda::compile_records() {
        if !firsts.iter().any(|f| f.name == r.name && f.arch == r.arch) {
            firsts.push(r);
        }
    }
    let sources = flashattn::cuda::kernel_sources();
    let mut lines = Vec::new();
    for first in firsts {
        let used = match first.compile_ms {
            Some(c) => format!(
                "first use: NVRTC compile {c:.1} ms + load {:.1} ms",
                first.load_ms
            ),
            None => format!(
                "first use: loaded from the disk cache in {:.1} ms",
                first.load_ms
            ),
        };
        let measured = match sources.iter().find(|s| s.name == first.name) {
            Some(src) => {
                let (fresh, cached) = flashattn::cuda::measure_compile(ordinal, src)?;
                format!(
                    "; measured again: compile {:.1} ms + load {:.1} ms, cached load {:.1} ms",
                    fresh.compile_ms.unwrap_or(0.0),
                    fresh.load_ms,
                    cached.load_ms
                )
            }
            None => String::new(),
        };
        lines.push(format!("{} ({}): {used}{measured}", first.name, first.arch));
    }
    Ok(lines)
}

/// The compile and cached-load time of every kernel variant used (none without CUDA).
#[cfg(not(feature = "cuda"))]
pub fn compile_report(_device: Device) -> CliResult<Vec<String>> {
    Ok(Vec::new())
}
