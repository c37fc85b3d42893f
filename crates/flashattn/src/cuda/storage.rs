//! Typed device buffers (f32, f16, bf16): allocate, poison, upload, download, and the raw device
//! address that kernels receive in their parameter structs. A [`CudaStorage`] is the core's
//! `DeviceStorage` of a GPU tensor.
//!
//! All copies and launches of one GPU are ordered on its single stream (see [`Gpu`]), so a buffer
//! written by a kernel is read correctly by the next launch or download without extra events.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::{bf16, f16};

use super::device::{Gpu, gpu};
use crate::dtype::DType;
use crate::error::Result;
use crate::host_buf::HostBuf;
use crate::outputs::poison_outputs;
use crate::tensor::{CpuStorage, Device, DeviceStorage, Tensor};

/// A device allocation of one dtype, or device memory of another owner.
pub(crate) enum DeviceBuffer {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
    Foreign(ForeignMemory),
}

/// Device memory that another owner holds (a PyTorch tensor's), used where it lies and never
/// freed by flashattn: dropping it drops `keep`, the owner's handle.
pub(crate) struct ForeignMemory {
    /// The device address of element 0.
    pub(crate) ptr: u64,
    pub(crate) dtype: DType,
    pub(crate) _keep: Box<dyn Any + Send + Sync>,
}

/// A device buffer and the GPU it lives on. `len` counts elements; an empty buffer still holds
/// one element so that its address is valid.
pub(crate) struct CudaStorage {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) buf: DeviceBuffer,
    len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage(cuda:{}, {} x {})",
            self.gpu.ordinal,
            self.len,
            self.dtype()
        )
    }
}

/// Uninitialized device memory for `len` elements (at least one).
fn alloc_raw<T: DeviceRepr>(gpu: &Gpu, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the memory is uninitialized; every caller fills it (poison, upload, or a kernel
    // that writes every element of an output) before any read.
    unsafe { gpu.stream.alloc::<T>(len.max(1)) }.map_err(Gpu::err("allocating device memory"))
}

impl CudaStorage {
    /// An output buffer of `len` elements, which the caller's kernels must write entirely:
    /// filled with NaN when poisoning is on (tests, `crate::outputs::set_poison_outputs`), left unwritten
    /// otherwise (no extra pass over memory in production and benchmarks).
    pub(crate) fn alloc_output(gpu: &Arc<Gpu>, dtype: DType, len: usize) -> Result<Self> {
        if poison_outputs() {
            return Self::alloc_poisoned(gpu, dtype, len);
        }
        let buf = match dtype {
            DType::F32 => DeviceBuffer::F32(alloc_raw(gpu, len)?),
            DType::F16 => DeviceBuffer::F16(alloc_raw(gpu, len)?),
            DType::BF16 => DeviceBuffer::BF16(alloc_raw(gpu, len)?),
        };
        Ok(CudaStorage {
            gpu: gpu.clone(),
            buf,
            len,
        })
    }

    /// A buffer of `len` elements with every byte 0xFF: NaN in f32, f16 and bf16, so an element a
    /// kernel fails to write is caught.
    pub(crate) fn alloc_poisoned(gpu: &Arc<Gpu>, dtype: DType, len: usize) -> Result<Self> {
        let buf = match dtype {
            DType::F32 => DeviceBuffer::F32(alloc_raw(gpu, len)?),
            DType::F16 => DeviceBuffer::F16(alloc_raw(gpu, len)?),
            DType::BF16 => DeviceBuffer::BF16(alloc_raw(gpu, len)?),
        };
        let mut s = CudaStorage {
            gpu: gpu.clone(),
            buf,
            len,
        };
        s.poison()?;
        Ok(s)
    }

    /// `len` elements of foreign memory on `gpu` (see [`ForeignMemory`]).
    pub(crate) fn foreign(gpu: &Arc<Gpu>, memory: ForeignMemory, len: usize) -> Self {
        CudaStorage {
            gpu: gpu.clone(),
            buf: DeviceBuffer::Foreign(memory),
            len,
        }
    }

    /// Copies the elements of a host buffer from `from` on to the GPU.
    pub(crate) fn upload(gpu: &Arc<Gpu>, host: &CpuStorage, from: usize) -> Result<Self> {
        let from = from.min(host.len());
        fn up<T: DeviceRepr>(gpu: &Gpu, v: &[T]) -> Result<CudaSlice<T>> {
            let mut d = alloc_raw(gpu, v.len())?;
            if !v.is_empty() {
                gpu.stream
                    .memcpy_htod(v, &mut d)
                    .map_err(Gpu::err("copying to the device"))?;
            }
            Ok(d)
        }
        let buf = match host {
            CpuStorage::F32(v) => DeviceBuffer::F32(up(gpu, &v[from..])?),
            CpuStorage::F16(v) => DeviceBuffer::F16(up(gpu, &v[from..])?),
            CpuStorage::BF16(v) => DeviceBuffer::BF16(up(gpu, &v[from..])?),
        };
        Ok(CudaStorage {
            gpu: gpu.clone(),
            buf,
            len: host.len() - from,
        })
    }

    /// Copies the whole buffer back to the host (waits for the work queued before it).
    pub(crate) fn download(&self) -> Result<CpuStorage> {
        fn down<T: DeviceRepr>(gpu: &Gpu, d: &CudaSlice<T>, len: usize) -> Result<HostBuf<T>> {
            let mut v = gpu
                .stream
                .clone_dtoh(d)
                .map_err(Gpu::err("copying from the device"))?;
            v.truncate(len);
            Ok(HostBuf::Taken(v))
        }
        let g = &self.gpu;
        Ok(match &self.buf {
            DeviceBuffer::F32(d) => CpuStorage::F32(down(g, d, self.len)?),
            DeviceBuffer::F16(d) => CpuStorage::F16(down(g, d, self.len)?),
            DeviceBuffer::BF16(d) => CpuStorage::BF16(down(g, d, self.len)?),
            DeviceBuffer::Foreign(m) => match m.dtype {
                DType::F32 => CpuStorage::F32(self.download_foreign(m.ptr)?),
                DType::F16 => CpuStorage::F16(self.download_foreign(m.ptr)?),
                DType::BF16 => CpuStorage::BF16(self.download_foreign(m.ptr)?),
            },
        })
    }

    /// The `len` elements of foreign memory at `ptr`, copied to the host once the stream's
    /// earlier work is done.
    fn download_foreign<T: DeviceRepr + Default + Clone>(&self, ptr: u64) -> Result<HostBuf<T>> {
        let mut v = vec![T::default(); self.len];
        if !v.is_empty() {
            let stream = self.gpu.stream.cu_stream();
            // SAFETY: `ptr` holds `len` elements of `T` (`Tensor::from_device_raw`'s contract and
            // its dtype check), and `v` has room for exactly that many; the copy is waited for
            // before `v` is used.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, ptr, stream) }
                .map_err(Gpu::err("copying from the device"))?;
            self.gpu.synchronize()?;
        }
        Ok(HostBuf::Taken(v))
    }

    /// Overwrites every byte with 0xFF (NaN in every dtype).
    pub(crate) fn poison(&mut self) -> Result<()> {
        self.fill_bytes(0xFF)
    }

    /// Sets every byte to `byte` (0 gives zeros in every dtype).
    pub(crate) fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        // flashattn's allocations hold one element even when empty; foreign memory holds `len`.
        let held = match self.buf {
            DeviceBuffer::Foreign(_) => self.len,
            _ => self.len.max(1),
        };
        let bytes = held * self.dtype().size_in_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let ptr = self.device_ptr();
        // SAFETY: `ptr` is the start of this buffer, which holds at least `bytes` bytes; the
        // memset is ordered on the stream every use of the buffer goes through.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr, byte, bytes, self.gpu.stream.cu_stream())
        }
        .map_err(Gpu::err("filling device memory"))
    }

    /// The device address of element 0, for a kernel's parameter struct.
    pub(crate) fn device_ptr(&self) -> u64 {
        let s = &self.gpu.stream;
        // Event tracking is off for flashattn's contexts, so the guards record nothing.
        match &self.buf {
            DeviceBuffer::F32(d) => d.device_ptr(s).0,
            DeviceBuffer::F16(d) => d.device_ptr(s).0,
            DeviceBuffer::BF16(d) => d.device_ptr(s).0,
            DeviceBuffer::Foreign(m) => m.ptr,
        }
    }

    /// Element type.
    pub(crate) fn dtype(&self) -> DType {
        match &self.buf {
            DeviceBuffer::F32(_) => DType::F32,
            DeviceBuffer::F16(_) => DType::F16,
            DeviceBuffer::BF16(_) => DType::BF16,
            DeviceBuffer::Foreign(m) => m.dtype,
        }
    }
}

impl DeviceStorage for CudaStorage {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }

    fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal)
    }

    fn download(&self) -> Result<CpuStorage> {
        CudaStorage::download(self)
    }

    fn upload_beside(&self, host: &CpuStorage, from: usize) -> Result<Box<dyn DeviceStorage>> {
        Ok(Box::new(CudaStorage::upload(&self.gpu, host, from)?))
    }
}

/// A buffer on GPU `ordinal` holding the elements of `host` from `from` on.
pub(crate) fn upload(
    host: &CpuStorage,
    from: usize,
    ordinal: usize,
) -> Result<Box<dyn DeviceStorage>> {
    Ok(Box::new(CudaStorage::upload(&gpu(ordinal)?, host, from)?))
}

/// The GPU's side of a tensor: its buffer as this backend's own type.
impl Tensor {
    /// A view of a device buffer (every element it can reach must lie inside the buffer).
    pub(crate) fn from_cuda_storage(
        storage: CudaStorage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        Tensor::from_device_storage(Box::new(storage), shape, strides, offset)
    }

    /// The whole device buffer behind the view, when the tensor lives on a GPU.
    pub(crate) fn cuda_storage(&self) -> Option<&CudaStorage> {
        let any: &dyn std::any::Any = self.device_storage()?;
        any.downcast_ref()
    }

    /// The device address of the view's first element (`offset` applied), when on a GPU.
    pub(crate) fn cuda_ptr(&self) -> Option<u64> {
        self.cuda_storage()
            .map(|s| s.device_ptr() + (self.offset() * self.dtype().size_in_bytes()) as u64)
    }
}
