//! Reading a tensor's elements (in row-major order of its shape, downloaded first from a
//! device) and copying it into another dtype or a contiguous layout.

use std::borrow::Cow;

use half::{bf16, f16};

use super::{CpuStorage, Storage, Tensor, contiguous_strides};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::host_buf::HostBuf;

impl Tensor {
    /// Buffer indices of every element, in row-major order of the shape.
    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let numel = self.numel();
        let rank = self.rank();
        let mut idx = vec![0usize; rank];
        (0..numel).map(move |n| {
            let at = self.offset
                + idx
                    .iter()
                    .zip(&self.strides)
                    .map(|(i, s)| i * s)
                    .sum::<usize>();
            if n + 1 < numel {
                for d in (0..rank).rev() {
                    idx[d] += 1;
                    if idx[d] < self.shape[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            at
        })
    }

    /// The whole buffer on the host: borrowed when it lives there, downloaded otherwise.
    pub(crate) fn host(&self) -> Result<Cow<'_, CpuStorage>> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(Cow::Borrowed(s)),
            Storage::Device(s) => Ok(Cow::Owned(s.download()?)),
        }
    }

    /// The elements in row-major order of the shape, as `T` (which must be the tensor's dtype).
    /// A tensor on a GPU is downloaded first.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let host = self.host()?;
        if T::DTYPE != self.dtype {
            return Err(Error::DType {
                arg: "T",
                expected: self.dtype.to_string(),
                got: T::DTYPE,
            });
        }
        Ok(self
            .indices()
            .map(|i| T::from_f32(host.get_f32(i)))
            .collect())
    }

    /// The elements in row-major order of the shape, widened to f32 (downloaded first when on a GPU).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let host = self.host()?;
        Ok(self.indices().map(|i| host.get_f32(i)).collect())
    }

    /// The elements in row-major order of the shape, widened to f64.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(self.to_f32_vec()?.into_iter().map(f64::from).collect())
    }

    /// A contiguous copy converted to `dtype` (rounding to nearest), on the same device.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let host = self.host()?;
        let (n, widened) = (self.numel(), self.indices().map(|i| host.get_f32(i)));
        let storage = match dtype {
            DType::F32 => CpuStorage::F32(HostBuf::collected(n, widened)),
            DType::F16 => CpuStorage::F16(HostBuf::collected(n, widened.map(f16::from_f32))),
            DType::BF16 => CpuStorage::BF16(HostBuf::collected(n, widened.map(bf16::from_f32))),
        };
        let strides = contiguous_strides(&self.shape);
        match self.device_storage() {
            None => Self::from_cpu_storage(storage, &self.shape, &strides, 0, "self"),
            Some(d) => {
                Self::from_device_storage(d.upload_beside(&storage, 0)?, &self.shape, &strides, 0)
            }
        }
    }

    /// A contiguous copy (or this tensor, when it already is contiguous).
    pub fn contiguous(&self) -> Result<Self> {
        if self.is_contiguous() && self.offset == 0 {
            return Ok(self.clone());
        }
        self.to_dtype(self.dtype)
    }
}
