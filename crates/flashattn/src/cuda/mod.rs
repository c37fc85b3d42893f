//! The CUDA backend: device tensors, run-time compiled kernels, the GPU forward and backward.
//!
//! Nothing here needs a CUDA toolkit to build: the driver (`libcuda.so.1`), NVRTC
//! (`libnvrtc.so`) and cuBLAS are loaded when first used, and their absence is a typed error
//! ([`crate::Error::NoCudaDriver`], [`crate::Error::NoCudaDevice`], [`crate::Error::NoNvrtc`]),
//! never a panic. Kernels are CUDA C++ sources embedded in the crate ([`kernel_sources`]),
//! compiled for the device's architecture on first use and cached in memory and on disk
//! (see [`compile`]).

pub(crate) mod backward;
pub(crate) mod blas;
pub mod compile;
pub(crate) mod device;
mod diagonal;
mod disk_cache;
mod foreign;
pub(crate) mod forward;
pub(crate) mod params;
pub(crate) mod rope;
pub(crate) mod standard;
pub(crate) mod storage;
pub(crate) mod tensor_map;
pub(crate) mod tile_config;

pub use compile::{
    CompileRecord, KernelSource, cache_dir, check_syntax, compile_ptx, compile_records,
    measure_compile, nvrtc_version, ptxas_report,
};
pub use device::{MemoryUse, device_count, memory_use, reset_memory_peak};
pub use foreign::{DeviceMemory, on_stream};
pub(crate) use storage::upload;

use crate::backend::{Backend, BackwardInputs};
use crate::outputs::{ForwardOutput, Gradients};
use crate::problem::Problem;
use crate::tensor::Tensor;

/// The GPU backend: the forward and the backward.
pub(crate) struct Cuda;

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn forward(
        &self,
        p: &Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> crate::Result<ForwardOutput> {
        forward::forward(p, q, k, v)
    }

    fn forward_into(
        &self,
        p: &Problem,
        qkv: (&Tensor, &Tensor, &Tensor),
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> crate::Result<()> {
        forward::forward_into(p, qkv, out, lse)
    }

    fn backward(&self, p: &Problem, x: BackwardInputs<'_>) -> crate::Result<Gradients> {
        backward::backward(p, x)
    }

    fn backward_into(
        &self,
        p: &Problem,
        x: BackwardInputs<'_>,
        g: &mut Gradients,
    ) -> crate::Result<()> {
        backward::backward_into(p, x, g)
    }
}

/// Every kernel variant flashattn can launch (the forward and backward kernels, the standard
/// attention's, the fused layer's rotation and linear attention's),
/// so that a test can compile them all with NVRTC.
pub fn kernel_sources() -> Vec<KernelSource> {
    let mut all = forward::kernel_sources();
    all.extend(backward::kernel_sources());
    all.extend(standard::kernel_sources());
    all.extend(rope::kernel_sources());
    all.extend(crate::linear::cuda::kernel_sources());
    all
}

/// Test support: forgets every loaded kernel, so that the next use of each goes to the disk cache
/// (or NVRTC) again, as in a new process.
#[doc(hidden)]
pub fn forget_loaded_kernels() {
    forward::forget_launchable();
    backward::forget_launchable();
    compile::forget_functions();
}

/// True when a CUDA driver and at least one GPU are present.
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// A description of GPU `ordinal`: name, compute capability, the architecture kernels are
/// compiled for, and the SM count.
pub fn device_info(ordinal: usize) -> crate::Result<String> {
    let g = device::gpu(ordinal)?;
    Ok(format!(
        "{} (compute capability {}.{}, {}, {} SMs, {} KiB shared memory per block)",
        g.name,
        g.compute_capability.0,
        g.compute_capability.1,
        g.arch,
        g.sm_count,
        g.max_shared_per_block / 1024
    ))
}

/// Test support: allocates `bytes` on GPU `ordinal`, fills them with 0xFF (NaN in every dtype)
/// and frees them, so that the stream-ordered allocator hands poisoned memory to the next
/// allocations (outputs are also poisoned when allocated; this catches any path that is not).
#[doc(hidden)]
pub fn poison_free_memory(ordinal: usize, bytes: usize) -> crate::Result<()> {
    let gpu = device::gpu(ordinal)?;
    let s = storage::CudaStorage::alloc_poisoned(&gpu, crate::DType::F32, bytes.div_ceil(4))?;
    drop(s);
    gpu.synchronize()
}

/// Waits until all work flashattn queued on GPU `ordinal` has finished; reports a failed kernel.
pub fn synchronize(ordinal: usize) -> crate::Result<()> {
    device::gpu(ordinal)?.synchronize()
}

/// Device time of `f` on GPU `ordinal`, in milliseconds, by CUDA events recorded on flashattn's
/// stream around each call: `warmup` untimed calls, then one sample per timed call. `f` must
/// queue its work on flashattn's stream (every flashattn call does) and need not synchronize.
pub fn time_ms(
    ordinal: usize,
    warmup: usize,
    samples: usize,
    mut f: impl FnMut() -> crate::Result<()>,
) -> crate::Result<Vec<f64>> {
    use cudarc::driver::sys::CUevent_flags;
    let gpu = device::gpu(ordinal)?;
    for _ in 0..warmup {
        f()?;
    }
    gpu.synchronize()?;
    let event = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(device::Gpu::err("creating an event"))
    };
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let (start, end) = (event()?, event()?);
        start
            .record(&gpu.stream)
            .map_err(device::Gpu::err("recording an event"))?;
        f()?;
        end.record(&gpu.stream)
            .map_err(device::Gpu::err("recording an event"))?;
        end.synchronize()
            .map_err(device::Gpu::err("waiting for an event"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(device::Gpu::err("reading an event"))?;
        times.push(f64::from(ms));
    }
    Ok(times)
}
