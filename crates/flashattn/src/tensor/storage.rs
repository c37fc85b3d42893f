//! The buffers behind tensors: host buffers of one dtype ([`CpuStorage`]), and device buffers
//! behind the [`DeviceStorage`] trait that a device backend implements (the core never names a
//! backend's types).

use std::any::Any;

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::host_buf::HostBuf;
use crate::tensor::Device;

/// A host buffer of one dtype.
#[derive(Clone, Debug)]
pub(crate) enum CpuStorage {
    F32(HostBuf<f32>),
    F16(HostBuf<f16>),
    BF16(HostBuf<bf16>),
}

impl CpuStorage {
    pub(crate) fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
        }
    }

    /// A buffer of `len` copies of `value`, rounded to `dtype` (see [`HostBuf::filled`]).
    pub(crate) fn filled(dtype: DType, len: usize, value: f32) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(HostBuf::filled(len, value)),
            DType::F16 => CpuStorage::F16(HostBuf::filled(len, f16::from_f32(value))),
            DType::BF16 => CpuStorage::BF16(HostBuf::filled(len, bf16::from_f32(value))),
        }
    }

    pub(crate) fn get_f32(&self, i: usize) -> f32 {
        match self {
            CpuStorage::F32(v) => v[i],
            CpuStorage::F16(v) => v[i].to_f32(),
            CpuStorage::BF16(v) => v[i].to_f32(),
        }
    }

    /// The storage of `data`, moved (not copied).
    pub(crate) fn of<T: Element>(data: HostBuf<T>) -> Self {
        // Element is implemented for exactly f32, f16 and bf16; each arm moves the buffer.
        let any: Box<dyn Any> = Box::new(data);
        match T::DTYPE {
            DType::F32 => CpuStorage::F32(*any.downcast().expect("DTYPE F32 is f32")),
            DType::F16 => CpuStorage::F16(*any.downcast().expect("DTYPE F16 is f16")),
            DType::BF16 => CpuStorage::BF16(*any.downcast().expect("DTYPE BF16 is bf16")),
        }
    }
}

/// Typed access to a [`CpuStorage`] for generic code (the CPU backend's `CpuElement` adds its
/// row conversions to it).
pub(crate) trait HostElement: Element {
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn wrap(v: HostBuf<Self>) -> CpuStorage;
}

macro_rules! host_element {
    ($t:ty, $variant:ident) => {
        impl HostElement for $t {
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(&v[..]),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(&mut v[..]),
                    _ => None,
                }
            }
            fn wrap(v: HostBuf<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
        }
    };
}
host_element!(f32, F32);
host_element!(f16, F16);
host_element!(bf16, BF16);

/// A buffer on a device other than the host, as a device backend implements it. The backend
/// gets its own type back from a tensor by downcasting (`as &dyn Any`).
pub(crate) trait DeviceStorage: Any + std::fmt::Debug + Send + Sync {
    /// Element count.
    fn len(&self) -> usize;
    /// Element type.
    fn dtype(&self) -> DType;
    /// The device the buffer lives on.
    fn device(&self) -> Device;
    /// A copy of the whole buffer on the host (after the work queued before it).
    fn download(&self) -> Result<CpuStorage>;
    /// A buffer on this one's device holding the elements of `host` from `from` on.
    fn upload_beside(&self, host: &CpuStorage, from: usize) -> Result<Box<dyn DeviceStorage>>;
}

/// The buffer behind a tensor.
#[derive(Debug)]
pub(crate) enum Storage {
    Cpu(CpuStorage),
    Device(Box<dyn DeviceStorage>),
}

impl Storage {
    /// Elements in the whole buffer.
    pub(crate) fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Device(s) => s.len(),
        }
    }
}
