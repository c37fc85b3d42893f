//! Where the command computes: moving inputs to the device and results back.
//!
//! This build's library has no CUDA tensors yet (`Tensor::to_device` is not there), so a CUDA
//! device is refused up front with a message, exit status 2.

use flashattn::{Device, Tensor};

use super::inputs::Inputs;
use super::{CliResult, fail};

/// Checks that `device` can run attention in this build, before any work starts.
pub fn ensure_available(device: Device) -> CliResult<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => Err(fail(format!(
            "--device {device}: this build of flashattn has no CUDA backend yet (the library \
             cannot place tensors on a GPU); use --device cpu"
        ))),
    }
}

/// A tensor moved to `device` (the tensor itself on the CPU).
pub fn to_device(t: &Tensor, device: Device) -> CliResult<Tensor> {
    ensure_available(device)?;
    Ok(t.clone())
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
    Ok(Inputs {
        q: to_device(&x.q, device)?,
        k: to_device(&x.k, device)?,
        v: to_device(&x.v, device)?,
        dout: to_device(&x.dout, device)?,
        p,
    })
}

/// A result tensor in host memory.
pub fn download(t: &Tensor) -> CliResult<Tensor> {
    match t.device() {
        Device::Cpu => Ok(t.clone()),
        other => Err(fail(format!("cannot download a tensor from {other}"))),
    }
}
