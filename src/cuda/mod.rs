//! The CUDA backend: device tensors, run-time compiled kernels and the GPU forward.
//!
//! Nothing here needs a CUDA toolkit to build: the driver (`libcuda.so.1`), NVRTC
//! (`libnvrtc.so`) and cuBLAS are loaded when first used, and their absence is a typed error
//! ([`crate::Error::NoCudaDriver`], [`crate::Error::NoCudaDevice`], [`crate::Error::NoNvrtc`]),
//! never a panic. Kernels are CUDA C++ sources embedded in the crate ([`kernel_sources`]),
//! compiled for the device's architecture on first use and cached in memory and on disk
//! (see [`compile`]).

pub mod compile;
pub(crate) mod device;
pub(crate) mod forward;
pub(crate) mod standard;
pub(crate) mod storage;

pub use compile::{
    CompileRecord, KernelSource, cache_dir, compile_ptx, compile_records, measure_compile,
    nvrtc_version,
};
pub use device::device_count;

/// Every kernel variant flashattn can launch (the forward kernels and the standard attention's),
/// so that a test can compile them all with NVRTC.
pub fn kernel_sources() -> Vec<KernelSource> {
    let mut all = forward::kernel_sources();
    all.extend(standard::kernel_sources());
    all
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
