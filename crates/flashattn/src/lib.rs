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
//!   MQA/GQA, packed variable-length batches, head dims 1..=512 (V's may differ).
//! * [`mod@reference`] holds the f64 oracle and the "standard attention" baseline that the tests and
//!   benchmarks measure against.

pub mod attention;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
mod host_buf;
pub mod mask;
mod outputs;
pub mod params;
pub mod problem;
pub mod reference;
pub mod tensor;

pub use attention::{ForwardOutput, Gradients, backward, backward_into, forward, forward_into};
pub use cpu::{Simd, cpu_simd, forward_profile};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use host_buf::set_huge_pages;
pub use mask::{Mask, Window};
pub use outputs::set_poison_outputs;
pub use params::{AttentionParams, VarLen};
pub use tensor::{Device, Tensor};

/// The README's example, compiled and run by `cargo test` so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
