//! Which backend serves a device, and copies of tensors between devices: the parts of the
//! public API that name a backend (the core below them names none).

use crate::backend::Backend;
use crate::error::Result;
use crate::tensor::{CpuStorage, Device, DeviceStorage, Storage, Tensor};

/// The backend of `device`'s tensors.
pub(crate) fn backend(device: Device) -> Result<&'static dyn Backend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::Cpu),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Ok(&crate::cuda::Cuda),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(no_cuda()),
    }
}

/// A device buffer on GPU `ordinal` holding the elements of `host` from `from` on.
#[cfg(feature = "cuda")]
fn upload(host: &CpuStorage, from: usize, ordinal: usize) -> Result<Box<dyn DeviceStorage>> {
    crate::cuda::upload(host, from, ordinal)
}

#[cfg(not(feature = "cuda"))]
fn upload(_host: &CpuStorage, _from: usize, _ordinal: usize) -> Result<Box<dyn DeviceStorage>> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> crate::Error {
    crate::Error::Unsupported {
        device: "cuda",
        what: "this build has no CUDA backend (cargo feature `cuda`)".into(),
    }
}

impl Tensor {
    /// The same view (shape and strides) with its buffer copied to `device`. A tensor already
    /// there is returned as is (no copy). Uploading a strided view uploads its buffer from the
    /// view's first element on (at offset 0 on the GPU, where allocations start aligned), so
    /// transposes and other views keep their strides; downloading copies the whole buffer and
    /// keeps the offset.
    ///
    /// ```
    /// use flashattn::{Device, Tensor};
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// match t.to_device(Device::Cuda(0)) {
    ///     Ok(g) => assert_eq!(g.to_device(Device::Cpu)?.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0]),
    ///     Err(e) => println!("no GPU here: {e}"),
    /// }
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let host = self.host()?;
        // Strides are never negative, so no element of the view lies before `offset`.
        Ok(match device {
            Device::Cpu => {
                self.with_storage(Storage::Cpu(host.into_owned()), device, self.offset())
            }
            Device::Cuda(ordinal) => {
                let storage = upload(&host, self.offset(), ordinal)?;
                self.with_storage(Storage::Device(storage), device, 0)
            }
        })
    }
}
