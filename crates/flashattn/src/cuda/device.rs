//! Device discovery: one [`Gpu`] per ordinal (its cudarc context, the stream every flashattn
//! call on it uses, and the architecture kernels are compiled for), created on first use.
//!
//! The driver library is loaded at run time. cudarc panics when it cannot load a library, so its
//! presence is checked first and its absence becomes [`Error::NoCudaDriver`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::error::{Error, Result};

/// One GPU as flashattn uses it: every buffer and launch of flashattn on this device is ordered on
/// `stream`, so no event tracking between streams is needed.
pub(crate) struct Gpu {
    /// The device ordinal (`Device::Cuda(ordinal)`).
    pub ordinal: usize,
    /// The device's primary context.
    pub ctx: Arc<CudaContext>,
    /// The stream of every copy and launch.
    pub stream: Arc<CudaStream>,
    /// The architecture NVRTC compiles for: `sm_90a` on compute capability 9.0 (so Hopper-only
    /// instructions are available), `sm_XY` otherwise.
    pub arch: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// The device's name as the driver reports it.
    pub name: String,
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Shared memory one block may opt in to, in bytes.
    pub max_shared_per_block: usize,
    /// The two i32 the persistent Hopper forward takes its tiles from (`sched` in
    /// kernels/flash_fwd_wgmma.cu): zero before each launch, since every launch leaves them zero,
    /// and used by one launch at a time, since all of them are ordered on `stream`.
    tile_counter: OnceLock<CudaSlice<i32>>,
}

impl Gpu {
    /// The device address of [`Gpu::tile_counter`], allocated (zeroed) on first use.
    pub(crate) fn tile_counter(&self) -> Result<u64> {
        if self.tile_counter.get().is_none() {
            let zeros = self
                .stream
                .alloc_zeros::<i32>(2)
                .map_err(|e| driver_error("allocating the tile counter", e))?;
            // A thread that lost the race drops its buffer; the kept one is zero either way.
            let _ = self.tile_counter.set(zeros);
        }
        let counter = self.tile_counter.get().expect("set above");
        Ok(counter.device_ptr(&self.stream).0)
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{} {} {})", self.ordinal, self.name, self.arch)
    }
}

/// The architecture string NVRTC is given for compute capability `major.minor`.
pub(crate) fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

fn driver_error(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Loads the driver library and initializes it, or says why not.
fn init_driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("libcuda.so could not be loaded (no NVIDIA driver on this machine)".into());
        }
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e:?}"))
    })
    .clone()
    .map_err(Error::NoCudaDriver)
}

/// The number of CUDA devices, or why none can be used (no driver).
pub fn device_count() -> Result<usize> {
    init_driver()?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| driver_error("cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

/// The [`Gpu`] of `ordinal`, created on first use.
pub(crate) fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let gpus = GPUS.get_or_init(Default::default);
    let mut map = gpus.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::NoCudaDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("creating the context", e))?;
    // SAFETY: flashattn orders all its work on the one stream below, so cudarc's events between
    // streams are not needed; no buffer exists yet in this context.
    unsafe { ctx.disable_event_tracking() };
    keep_freed_memory(&ctx);
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| driver_error("reading the compute capability", e))?;
    if major < 8 {
        return Err(Error::Unsupported {
            device: "cuda",
            what: format!(
                "compute capability {major}.{minor} (flashattn's kernels need 8.0 or newer)"
            ),
        });
    }
    let attr = |a| {
        ctx.attribute(a)
            .map(|v| v.max(0) as usize)
            .map_err(|e| driver_error("reading a device attribute", e))
    };
    let gpu = Arc::new(Gpu {
        ordinal,
        arch: arch_for(major, minor),
        compute_capability: (major, minor),
        name: ctx.name().unwrap_or_else(|_| "unknown".into()),
        sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        max_shared_per_block: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        stream: ctx.default_stream(),
        tile_counter: OnceLock::new(),
        ctx,
    });
    map.insert(ordinal, gpu.clone());
    Ok(gpu)
}

/// The device's default memory pool, which serves cudarc's stream-ordered allocations; `None`
/// when the device has none (or cudarc does not allocate from it).
fn default_pool(ctx: &CudaContext) -> Option<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is valid for writes; the device handle comes from a live context.
    let got = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    (got == sys::CUresult::CUDA_SUCCESS && !pool.is_null() && ctx.has_async_alloc()).then_some(pool)
}

/// Sets a u64 attribute of `pool` (the release threshold, or 0 to reset a high-water mark).
fn set_pool_attribute(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    mut value: u64,
) -> Result<()> {
    // SAFETY: both attributes set here take a pointer to a u64, valid during the call.
    unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
        .result()
        .map_err(|e| driver_error("cuMemPoolSetAttribute", e))
}

/// Lets the device's default memory pool keep freed memory across synchronizations. With the
/// driver's default threshold of 0 every synchronization returns it to the system, and the next
/// output allocation maps its pages again (tens of microseconds per call for a 64 MiB output).
/// Best effort: a device without memory pools keeps its default.
fn keep_freed_memory(ctx: &CudaContext) {
    if let Some(pool) = default_pool(ctx) {
        let _ = set_pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            u64::MAX,
        );
    }
}

/// Device memory in the default memory pool of a GPU, which serves every flashattn allocation:
/// what is in use now, and the most in use since the last [`reset_memory_peak`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    /// Bytes in use now.
    pub current: u64,
    /// Most bytes in use since the last reset.
    pub peak: u64,
}

/// The default pool of GPU `ordinal`, or an error saying its memory cannot be measured.
fn measured_pool(ordinal: usize) -> Result<sys::CUmemoryPool> {
    default_pool(&gpu(ordinal)?.ctx).ok_or_else(|| {
        Error::Cuda(format!(
            "cuda:{ordinal} has no stream-ordered memory pool: device memory cannot be measured"
        ))
    })
}

fn pool_attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let mut value: u64 = 0;
    // SAFETY: the used-memory attributes write a u64 through the pointer, valid for the call.
    unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
        .result()
        .map_err(|e| driver_error("cuMemPoolGetAttribute", e))?;
    Ok(value)
}

/// The device memory flashattn's allocations on GPU `ordinal` hold (see [`MemoryUse`]).
/// Memory that libraries allocate outside the pool (cuBLAS's workspace) is not included.
pub fn memory_use(ordinal: usize) -> Result<MemoryUse> {
    use sys::CUmemPool_attribute::*;
    let pool = measured_pool(ordinal)?;
    Ok(MemoryUse {
        current: pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        peak: pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    })
}

/// Starts a new peak for [`memory_use`] at what is in use now.
pub fn reset_memory_peak(ordinal: usize) -> Result<()> {
    set_pool_attribute(
        measured_pool(ordinal)?,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        0,
    )
}

impl Gpu {
    /// Waits for all work queued on the stream; a failed kernel shows up here.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("synchronizing the stream", e))
    }

    /// Turns a driver error into [`Error::Cuda`] saying what was being done.
    pub(crate) fn err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
        move |e| driver_error(what, e)
    }
}

#[cfg(test)]
mod tests {
    use super::arch_for;

    #[test]
    fn hopper_gets_the_arch_specific_target() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(12, 0), "sm_120");
    }
}
