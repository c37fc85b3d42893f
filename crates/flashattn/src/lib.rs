//! # flashattn
//!
//! Exact attention, `softmax(Q·Kᵀ·scale)·V`, by the FlashAttention algorithm: Q, K and V are
//! processed in tiles with an online softmax (a running max and sum per query, rescaling the
//! accumulator), so the N×N score matrix is never stored and memory stays O(N).
//!
//! * [`forward`] and [`backward`] take strided [`Tensor`]s and one [`AttentionParams`]; the call
//!   runs where the tensors live (the CPU path is always available); [`forward_into`] and
//!   [`backward_into`] write into tensors the caller keeps from call to call.
//! * Options: scale, causal and sliding windows ([`Window`]), ALiBi, softcap, additive bias,
//!   relative-position bias, the diagonal offset ([`AttentionParams::diagonal`]: query `i` at
//!   key `i + d`, for ring attention's blocks), MQA/GQA, packed
//!   variable-length batches, head dims 1..=512 (V's may differ).
//! * [`layer_forward`] and [`layer_backward`]: the fused attention layer (QKV projection, rotary
//!   embedding, attention, output projection) built on them.
//! * [`linear_forward`] and [`linear_backward`]: linear attention (a feature map instead of the
//!   softmax), the O(N) alternative.
//! * [`mod@ring`]: ring attention (context parallelism) over a communicator of ranks, with the
//!   exact merge of partial results by their log-sum-exp ([`merge_partials`]).
//! * [`mod@reference`] holds the f64 oracle and the "standard attention" baseline that the tests and
//!   benchmarks measure against.

// Three layers, each importing only those below it:
// - the core: plain types and checks that name no backend (dtype, error, tensor and its host
//   buffers, params, mask, problem, outputs) and the interface every backend implements
//   (backend);
// - the backends: cpu (always built) and cuda (cargo feature `cuda`), each a `Backend`, the
//   GPU's buffers a `tensor::DeviceStorage`;
// - the public API: the entry points (attention) and the device dispatch (devices), and the
//   reference implementations that tests and benchmarks measure against.
pub mod attention;
mod backend;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod devices;
pub mod dtype;
pub mod error;
mod host_buf;
pub mod layer;
pub mod linear;
pub mod mask;
mod outputs;
pub mod params;
mod problem;
pub mod reference;
pub mod ring;
pub mod tensor;

pub use attention::{backward, backward_into, forward, forward_into};
pub use cpu::{Simd, cpu_simd};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
/// The crate of the `f16` and `bf16` element types.
pub use half;
pub use host_buf::set_huge_pages;
pub use layer::params::{LayerParams, LayerWeights, Rope, RopeStyle};
pub use layer::{LayerGradients, LayerOutput, layer_backward, layer_forward};
pub use linear::{FeatureMap, LinearGradients, LinearParams, linear_backward, linear_forward};
pub use mask::{Mask, Window};
pub use outputs::{ForwardOutput, Gradients};
pub use params::{AttentionParams, MAX_DIAGONAL, VarLen};
pub use ring::merge_partials;
pub use tensor::{Device, Tensor};

/// For flashattn's own tools and tests, not part of the API: the validated problem, the switch
/// that poisons outputs, the CPU forward's cycle profile, the GPU forward's Hopper switch and last
/// variant, and the GPU backward's Hopper and tensor-core switches and last variant.
#[doc(hidden)]
pub mod internals {
    pub use crate::cpu::forward_profile;
    #[cfg(feature = "cuda")]
    pub use crate::cuda::backward::{
        last_cuda_backward_kernel, set_hopper_backward, set_mma_backward,
    };
    #[cfg(feature = "cuda")]
    pub use crate::cuda::forward::{last_cuda_forward_kernel, set_hopper_forward};
    pub use crate::outputs::set_poison_outputs;
    pub use crate::problem::Problem;
}

/// The README's example, compiled and run by `cargo test` so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
