//! The fused layer's yardstick: the same steps as separate calls, each result a tensor of its
//! own, as a model written against a plain attention call runs them. The projection GEMM writes
//! the packed `x·w_qkv + b_qkv`; the rotary embedding writes rotated copies of Q and K; attention
//! reads them (and V through strides); the output GEMM. The backward: the output projection's
//! gradients, the attention backward into separate dq, dk, dv, their inverse rotation into new
//! tensors, their concatenation into one packed gradient, the QKV GEMMs. The GEMMs are the
//! fused layer's own, so timing the two measures what fusing saves. Either device, every step on
//! it (on the GPU the copies and the concatenation are 2-D device-to-device copies).

use crate::attention::{backward as attention_backward, forward as attention_forward};
use crate::error::Result;
use crate::layer::params::{LayerParams, LayerWeights};
use crate::layer::shape::LayerShape;
use crate::layer::{LayerGradients, LayerSteps, steps};
use crate::outputs::ForwardOutput;
use crate::tensor::Tensor;

/// What [`forward`] returns: the output and each step's result the backward reads again.
#[derive(Clone, Debug)]
pub struct UnfusedOutput {
    /// `[batch, seqlen, model_dim]` (`[total_tokens, model_dim]` with varlen).
    pub y: Tensor,
    /// The packed projections before the rotation, `[.., (H + 2·HK)·head_dim]` (V is read from it).
    pub qkv: Tensor,
    /// The rotated queries `[.., H, head_dim]`, a tensor of their own (a view of `qkv` without
    /// a rotary embedding).
    pub q: Tensor,
    /// The rotated keys `[.., HK, head_dim]`, a tensor of their own.
    pub k: Tensor,
    /// The attention's output and log-sum-exp.
    pub attention: ForwardOutput,
}

/// The validated call, the same without its rotation (the projection GEMM alone), and the
/// device's steps.
fn shapes(
    x: &Tensor,
    w: &LayerWeights,
    params: &LayerParams,
) -> Result<(LayerShape, LayerShape, &'static dyn LayerSteps)> {
    let s = LayerShape::new(x, w, params)?;
    let mut plain = s.clone();
    plain.rope = None;
    let steps = steps(s.device)?;
    Ok((s, plain, steps))
}

/// The layer of [`crate::layer_forward`] as separate calls (see the module docs).
///
/// ```
/// use flashattn::reference::unfused_layer;
/// use flashattn::{LayerParams, LayerWeights, Rope, RopeStyle, Tensor, layer_forward};
/// let t = |shape: &[usize], f: f32| {
///     let len: usize = shape.iter().product();
///     Tensor::from_vec((0..len).map(|i| (i as f32 * f).sin()).collect::<Vec<_>>(), shape)
/// };
/// let w = LayerWeights { w_qkv: t(&[6, 12], 0.3)?, b_qkv: None, w_o: t(&[4, 6], 0.5)?, b_o: None };
/// let (x, p) = (t(&[1, 3, 6], 0.7)?, LayerParams::new(1, 1).rope(Rope::new(RopeStyle::Half)));
/// let (fused, separate) = (layer_forward(&x, &w, &p)?, unfused_layer::forward(&x, &w, &p)?);
/// let (a, b) = (fused.y.to_f64_vec()?, separate.y.to_f64_vec()?);
/// assert!(a.iter().zip(&b).all(|(a, b)| (a - b).abs() < 1e-5));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward(x: &Tensor, w: &LayerWeights, params: &LayerParams) -> Result<UnfusedOutput> {
    let (s, plain, steps) = shapes(x, w, params)?;
    let qkv = steps.qkv(&plain, x, w)?;
    let [q, k, v] = s.views(&qkv)?;
    // Without a rotary embedding the attention reads Q and K through strides too.
    let (q, k) = match s.rope {
        None => (q, k),
        Some(_) => (
            steps.heads_copy(&s, &qkv, 0, s.heads, false)?,
            steps.heads_copy(&s, &qkv, s.heads, s.heads_kv, false)?,
        ),
    };
    let attention = attention_forward(&q, &k, &v, &params.attention)?;
    let y = steps.output(&s, &attention.out, w)?;
    Ok(UnfusedOutput {
        y,
        qkv,
        q,
        k,
        attention,
    })
}

/// The gradients of [`forward`], step by step (see the module docs), given its result `fwd` for
/// the same `x`, weights and params and the upstream gradient `dy`.
pub fn backward(
    x: &Tensor,
    w: &LayerWeights,
    params: &LayerParams,
    fwd: &UnfusedOutput,
    dy: &Tensor,
) -> Result<LayerGradients> {
    let (s, plain, steps) = shapes(x, w, params)?;
    s.expect_rows(dy, "dy", s.model_dim)?;
    s.expect_rows(&fwd.qkv, "qkv", s.cols)?;
    s.expect_heads(&fwd.attention.out, "out")?;
    let o = steps.out_grads(&s, &fwd.attention.out, w, dy)?;
    let [_, _, v] = s.views(&fwd.qkv)?;
    let (out, lse) = (&fwd.attention.out, &fwd.attention.lse);
    let g = attention_backward(&fwd.q, &fwd.k, &v, out, lse, &o.dout, &params.attention)?;
    let dq = steps.heads_copy(&s, &g.dq, 0, s.heads, true)?;
    let dk = steps.heads_copy(&s, &g.dk, 0, s.heads_kv, true)?;
    // The concatenation: each row's q, k and v gradients side by side.
    let dqkv = steps.concat(&s, [&dq, &dk, &g.dv])?;
    let q = steps.qkv_grads(&plain, x, w, dqkv)?;
    Ok(LayerGradients {
        dx: q.dx,
        dw_qkv: q.dw_qkv,
        db_qkv: q.db_qkv,
        dw_o: o.dw_o,
        db_o: o.db_o,
        dbias: g.dbias,
        drel_bias: g.drel_bias,
    })
}
