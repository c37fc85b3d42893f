//! The fused attention layer: `y = attention(rope(x·w_qkv + b_qkv)) · w_o + b_o`, forward and
//! backward, on either device.
//!
//! How it is fused: the projections are GEMMs of a GEMM library (the `gemm` crate on the CPU,
//! cuBLAS on the GPU), so the fusion is in how their outputs feed the attention:
//!
//! * the QKV GEMM writes one packed buffer `[.., (H + 2·HK)·D]` (columns: q heads, k heads, v
//!   heads), its bias broadcast into it first and accumulated onto (beta = 1);
//! * the rotary embedding rotates the q and k heads in place in that buffer: no unrotated copy of
//!   Q or K is kept;
//! * the attention reads Q, K and V straight out of it through strides (three views, rows
//!   `(H + 2·HK)·D` apart), no split copy, and writes its `[.., H, D]` output, which is the
//!   `[rows, H·D]` operand of the output GEMM as it lies.
//!
//! The backward mirrors it: `dout = dy·w_oᵀ`, the attention backward writes dq, dk and dv
//! through strides into one packed gradient buffer, the inverse rotation (the transpose) runs in
//! place there, and that buffer is the operand of the GEMMs for dx and dw_qkv. Bias gradients
//! are column sums (on the GPU a GEMM with a vector of ones). On the CPU, f16 and bf16 run the
//! GEMMs and the rotation in f32 (the `gemm` crate's f32 kernels) and round once into the
//! packed buffer; on the GPU cuBLAS takes the dtype itself, with f32 accumulation.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_copy;
pub mod params;
pub(crate) mod rope;
pub(crate) mod shape;

use crate::backend::BackwardInputs;
use crate::error::Result;
use crate::outputs::ForwardOutput;
use crate::problem::{Problem, backward_problem};
use crate::tensor::{Device, Tensor};
use params::{LayerParams, LayerWeights};
use shape::LayerShape;

/// What [`layer_forward`] returns: the output and what the backward reads again.
#[derive(Clone, Debug)]
pub struct LayerOutput {
    /// `[batch, seqlen, model_dim]` (`[total_tokens, model_dim]` with varlen), `x`'s dtype.
    pub y: Tensor,
    /// The packed projections after the rotation, `[.., (H + 2·HK)·head_dim]`: the Q, K and V
    /// the attention read.
    pub qkv: Tensor,
    /// The attention's output `[.., H, head_dim]` (the output GEMM's operand) and log-sum-exp.
    pub attention: ForwardOutput,
}

/// What [`layer_backward`] returns, each gradient in the dtype and shape of its input.
#[derive(Clone, Debug)]
pub struct LayerGradients {
    /// Gradient of `x`.
    pub dx: Tensor,
    /// Gradient of `w_qkv`.
    pub dw_qkv: Tensor,
    /// Gradient of `b_qkv`, when the call has one.
    pub db_qkv: Option<Tensor>,
    /// Gradient of `w_o`.
    pub dw_o: Tensor,
    /// Gradient of `b_o`, when the call has one.
    pub db_o: Option<Tensor>,
    /// Gradient of the attention's bias (f32, its shape), when the call has one.
    pub dbias: Option<Tensor>,
    /// Gradient of the attention's relative-position table (f32, its shape), when it has one.
    pub drel_bias: Option<Tensor>,
}

/// The gradients the output projection gives: the attention's upstream gradient and those of
/// `w_o` and `b_o`.
pub(crate) struct OutGrads {
    pub(crate) dout: Tensor,
    pub(crate) dw_o: Tensor,
    pub(crate) db_o: Option<Tensor>,
}

/// The gradients the QKV projection gives from the packed gradient.
pub(crate) struct QkvGrads {
    pub(crate) dx: Tensor,
    pub(crate) dw_qkv: Tensor,
    pub(crate) db_qkv: Option<Tensor>,
}

/// The steps of the layer on one device; the attention between them is the public API's.
pub(crate) trait LayerSteps: Sync {
    /// The packed, rotated `x·w_qkv + b_qkv`.
    fn qkv(&self, s: &LayerShape, x: &Tensor, w: &LayerWeights) -> Result<Tensor>;
    /// `out·w_o + b_o`.
    fn output(&self, s: &LayerShape, out: &Tensor, w: &LayerWeights) -> Result<Tensor>;
    /// `dout = dy·w_oᵀ`, `dw_o = outᵀ·dy`, `db_o = Σ dy`.
    fn out_grads(
        &self,
        s: &LayerShape,
        out: &Tensor,
        w: &LayerWeights,
        dy: &Tensor,
    ) -> Result<OutGrads>;
    /// The attention backward into one packed gradient buffer (and the gradients of the bias and
    /// the relative-position table).
    fn attention_grads(
        &self,
        s: &LayerShape,
        p: &Problem,
        x: BackwardInputs<'_>,
    ) -> Result<(Tensor, [Option<Tensor>; 2])>;
    /// The inverse rotation in place in `dqkv`, then `dx`, `dw_qkv`, `db_qkv`.
    fn qkv_grads(
        &self,
        s: &LayerShape,
        x: &Tensor,
        w: &LayerWeights,
        dqkv: Tensor,
    ) -> Result<QkvGrads>;
    /// Heads `first..first + heads` of each row of `src` (contiguous rows, all its elements past
    /// the row dims of `x`) copied into a new `[.., heads, head_dim]` tensor and rotated there
    /// (by the negative angles with `inverse`) when the call has a rotary embedding. The
    /// separate-calls yardstick's (`reference::unfused_layer`) Q and K copies.
    fn heads_copy(
        &self,
        s: &LayerShape,
        src: &Tensor,
        first: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<Tensor>;
    /// The yardstick's concatenation: each row of dq, dk and dv (contiguous `[.., H, D]`,
    /// `[.., HK, D]`, `[.., HK, D]`) side by side in a new packed `[.., cols]` tensor.
    fn concat(&self, s: &LayerShape, parts: [&Tensor; 3]) -> Result<Tensor>;
}

pub(crate) fn steps(device: Device) -> Result<&'static dyn LayerSteps> {
    match device {
        Device::Cpu => Ok(&cpu::CpuSteps),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Ok(&cuda::CudaSteps),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::error::Error::Unsupported {
            device: "cuda",
            what: "this build has no CUDA backend (cargo feature `cuda`)".into(),
        }),
    }
}

/// The fused attention layer: `x` `[batch, seqlen, model_dim]` (`[total_tokens, model_dim]`
/// with varlen) through the QKV projection, the rotary embedding of Q and K, attention with
/// every option of `params.attention`, and the output projection. See [`LayerParams`] and
/// [`LayerWeights`] for the shapes; every tensor must share `x`'s dtype and device.
///
/// ```
/// use flashattn::{LayerParams, LayerWeights, Rope, RopeStyle, Tensor, layer_forward};
/// let (b, n, m, h, d) = (1, 5, 12, 2, 4);
/// let t = |shape: &[usize], f: f32| {
///     let len: usize = shape.iter().product();
///     Tensor::from_vec((0..len).map(|i| (i as f32 * f).sin()).collect::<Vec<_>>(), shape)
/// };
/// let w = LayerWeights {
///     w_qkv: t(&[m, 3 * h * d], 0.37)?,
///     b_qkv: None,
///     w_o: t(&[h * d, m], 0.71)?,
///     b_o: Some(t(&[m], 0.13)?),
/// };
/// let p = LayerParams::new(h, h).rope(Rope::new(RopeStyle::Half));
/// let f = layer_forward(&t(&[b, n, m], 0.29)?, &w, &p)?;
/// assert_eq!(f.y.shape(), &[1, 5, 12]);
/// assert_eq!(f.qkv.shape(), &[1, 5, 24]);
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn layer_forward(x: &Tensor, w: &LayerWeights, params: &LayerParams) -> Result<LayerOutput> {
    let s = LayerShape::new(x, w, params)?;
    let steps = steps(s.device)?;
    let qkv = steps.qkv(&s, x, w)?;
    let [q, k, v] = s.views(&qkv)?;
    let attention = crate::attention::forward(&q, &k, &v, &params.attention)?;
    drop((q, k, v));
    let y = steps.output(&s, &attention.out, w)?;
    Ok(LayerOutput { y, qkv, attention })
}

/// Gradients of [`layer_forward`] with respect to `x`, the weights and biases (and the
/// attention's bias), given the forward's result `fwd` for the same `x`, weights and params, and
/// the upstream gradient `dy` (shaped like `y`).
///
/// ```
/// use flashattn::{LayerParams, LayerWeights, Tensor, layer_backward, layer_forward};
/// let t = |shape: &[usize], f: f32| {
///     let len: usize = shape.iter().product();
///     Tensor::from_vec((0..len).map(|i| (i as f32 * f).cos()).collect::<Vec<_>>(), shape)
/// };
/// let w = LayerWeights { w_qkv: t(&[6, 24], 0.3)?, b_qkv: Some(t(&[24], 0.2)?), w_o: t(&[12, 6], 0.5)?, b_o: None };
/// let (x, p) = (t(&[2, 3, 6], 0.7)?, LayerParams::new(2, 1));
/// let f = layer_forward(&x, &w, &p)?;
/// let g = layer_backward(&x, &w, &p, &f, &f.y)?;
/// assert_eq!(g.dw_qkv.shape(), &[6, 24]);
/// assert!(g.db_o.is_none());
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn layer_backward(
    x: &Tensor,
    w: &LayerWeights,
    params: &LayerParams,
    fwd: &LayerOutput,
    dy: &Tensor,
) -> Result<LayerGradients> {
    let s = LayerShape::new(x, w, params)?;
    s.expect_rows(dy, "dy", s.model_dim)?;
    s.expect_rows(&fwd.qkv, "qkv", s.cols)?;
    s.expect_heads(&fwd.attention.out, "out")?;
    let steps = steps(s.device)?;
    let out = &fwd.attention.out;
    let o = steps.out_grads(&s, out, w, dy)?;
    let [q, k, v] = s.views(&fwd.qkv)?;
    let x_attn = [&q, &k, &v, out, &fwd.attention.lse, &o.dout];
    let p = backward_problem(x_attn, &params.attention)?;
    let (dqkv, [dbias, drel_bias]) = steps.attention_grads(&s, &p, x_attn)?;
    drop((q, k, v));
    let g = steps.qkv_grads(&s, x, w, dqkv)?;
    Ok(LayerGradients {
        dx: g.dx,
        dw_qkv: g.dw_qkv,
        db_qkv: g.db_qkv,
        dw_o: o.dw_o,
        db_o: o.db_o,
        dbias,
        drel_bias,
    })
}
