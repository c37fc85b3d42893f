//! The FlashAttention forward on the GPU (placeholder until the kernels land).

use super::compile::KernelSource;
use crate::attention::ForwardOutput;
use crate::error::{Error, Result};
use crate::params::AttentionParams;
use crate::problem::Problem;
use crate::tensor::Tensor;

/// Every forward kernel variant (none yet).
pub fn kernel_sources() -> Vec<KernelSource> {
    Vec::new()
}

/// Runs the forward of a validated problem whose tensors live on one GPU.
pub(crate) fn forward(
    _problem: &Problem,
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _params: &AttentionParams,
) -> Result<ForwardOutput> {
    Err(Error::Unsupported {
        device: "cuda",
        what: "the forward kernels are not built yet".into(),
    })
}
