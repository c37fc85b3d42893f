//! The public entry points. Each call validates into a [`Problem`] and dispatches once on the
//! device the tensors live on.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::{Layout, expect_writable};
use crate::params::AttentionParams;
use crate::problem::{Problem, expect_like};
use crate::tensor::{Device, Tensor};

/// What [`forward`] returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// The attention output: shaped like `q` with the head dimension of `v`, in `q`'s dtype and
    /// memory order (a `[batch, heads, seqlen, dim]`-strided q gives a like-strided output).
    pub out: Tensor,
    /// Log-sum-exp of each query's scores (natural log, f32): `[batch, heads, seqlen_q]`, or
    /// `[heads, total_q]` with packed variable-length input. −∞ for a query that sees no key.
    pub lse: Tensor,
}

/// What [`backward`] returns: gradients in the dtype and memory order of their inputs.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// Gradient of `q`.
    pub dq: Tensor,
    /// Gradient of `k` (summed over the query heads that share each key head).
    pub dk: Tensor,
    /// Gradient of `v`.
    pub dv: Tensor,
    /// Gradient of the bias, f32, in the bias' shape (summed over its broadcast dimensions).
    pub dbias: Option<Tensor>,
}

/// Exact attention, `softmax(q·kᵀ·scale)·v` with the options of `params`, computed tile by tile
/// with an online softmax so the score matrix is never stored.
///
/// `q` is `[batch, seqlen_q, heads, head_dim]`, `k` and `v` are `[batch, seqlen_k, heads_kv, _]`
/// (any strides, head dimension contiguous); with [`AttentionParams::varlen`] they are packed
/// `[total_tokens, heads, head_dim]`.
///
/// ```
/// use flashattn::{AttentionParams, Tensor, forward};
/// let (b, n, h, d) = (1, 5, 2, 4);
/// let data: Vec<f32> = (0..b * n * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
/// let q = Tensor::from_vec(data.clone(), &[b, n, h, d])?;
/// let k = Tensor::from_vec(data.iter().map(|x| x * 0.5).collect::<Vec<_>>(), &[b, n, h, d])?;
/// let v = Tensor::from_vec(data, &[b, n, h, d])?;
/// let res = forward(&q, &k, &v, &AttentionParams::default().causal())?;
/// assert_eq!(res.out.shape(), &[1, 5, 2, 4]);
/// assert_eq!(res.lse.shape(), &[1, 2, 5]);
/// // The first query sees only the first key, so its output is that key's value row.
/// let out = res.out.to_vec::<f32>()?;
/// assert!((out[0] - v.to_vec::<f32>()?[0]).abs() < 1e-6);
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    let p = Problem::new(q, k, v, params)?;
    match p.device {
        Device::Cpu => crate::cpu::forward(&p, q, k, v),
        Device::Cuda(_) => cuda::forward(&p, q, k, v),
    }
}

/// The GPU entry points, or the same signatures failing with [`Error::Unsupported`] in a build
/// without the `cuda` feature.
#[cfg(feature = "cuda")]
mod cuda {
    pub(super) use crate::cuda::forward::{forward, forward_into};
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::ForwardOutput;
    use crate::error::{Error, Result};
    use crate::problem::Problem;
    use crate::tensor::Tensor;

    fn no_backend() -> Error {
        Error::Unsupported {
            device: "cuda",
            what: "this build has no CUDA backend (cargo feature `cuda`)".into(),
        }
    }

    pub(super) fn forward(
        _: &Problem,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<ForwardOutput> {
        Err(no_backend())
    }

    pub(super) fn forward_into(
        _: &Problem,
        _: (&Tensor, &Tensor, &Tensor),
        _: &mut Tensor,
        _: &mut Tensor,
    ) -> Result<()> {
        Err(no_backend())
    }
}

/// Gradients of [`forward`] with respect to q, k, v (and the bias), given the forward's `out` and
/// `lse` and the upstream gradient `dout` (shaped like `out`). Uses the FlashAttention-2 backward:
/// scores are recomputed tile by tile, nothing of size seqlen² is stored.
///
/// ```
/// use flashattn::{AttentionParams, Tensor, backward, forward};
/// let x: Vec<f32> = (0..2 * 3 * 1 * 4).map(|i| (i as f32 * 0.71).cos()).collect();
/// let t = Tensor::from_vec(x, &[2, 3, 1, 4])?;
/// let p = AttentionParams::default();
/// let f = forward(&t, &t, &t, &p)?;
/// let g = backward(&t, &t, &t, &f.out, &f.lse, &f.out, &p)?;
/// assert_eq!(g.dq.shape(), t.shape());
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<Gradients> {
    let p = backward_problem([q, k, v, out, lse, dout], params)?;
    match p.device {
        Device::Cpu => crate::cpu::backward(&p, [q, k, v, out, lse, dout]),
        Device::Cuda(_) => Err(unsupported_backward()),
    }
}

/// [`forward`] into tensors the caller owns, so that a loop of calls allocates nothing: `out`
/// shaped like [`ForwardOutput::out`] in q's dtype (any strides that reach each element once,
/// head dimension contiguous) and `lse` shaped like [`ForwardOutput::lse`], f32, contiguous. Both
/// must be tensors no other tensor shares a buffer with (not clones or views of another), on
/// q's device. Every element of both is overwritten; nothing is written unless every argument
/// is valid. On a GPU the call is queued on flashattn's stream like [`forward`]'s.
///
/// ```
/// use flashattn::{AttentionParams, DType, Tensor, forward, forward_into};
/// let x: Vec<f32> = (0..3 * 2 * 8).map(|i| (i as f32 * 0.3).sin()).collect();
/// let q = Tensor::from_vec(x, &[1, 3, 2, 8])?;
/// let p = AttentionParams::default().causal();
/// let mut out = Tensor::full(&[1, 3, 2, 8], DType::F32, 0.0)?;
/// let mut lse = Tensor::full(&[1, 2, 3], DType::F32, 0.0)?;
/// for _ in 0..2 {
///     forward_into(&q, &q, &q, &p, &mut out, &mut lse)?;
/// }
/// assert_eq!(out.to_vec::<f32>()?, forward(&q, &q, &q, &p)?.out.to_vec::<f32>()?);
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    let p = Problem::new(q, k, v, params)?;
    let out_shape = Problem::shape_like(q, p.head_dim_v);
    expect_writable(out, "out", &out_shape, p.dtype, p.device, Layout::Rows)?;
    let lse_shape = p.lse_shape();
    expect_writable(
        lse,
        "lse",
        &lse_shape,
        DType::F32,
        p.device,
        Layout::Contiguous,
    )?;
    match p.device {
        Device::Cpu => crate::cpu::forward_into(&p, (q, k, v), out, lse),
        Device::Cuda(_) => cuda::forward_into(&p, (q, k, v), out, lse),
    }
}

/// [`backward`] into gradients the caller owns (for instance those of an earlier call), so
/// that a loop of calls allocates no gradients: `dq`, `dk`, `dv` shaped like q, k, v in their
/// dtype (any strides that reach each element once, head dimension contiguous), and `dbias`
/// given exactly when the call has a bias, shaped like it, f32, contiguous. Each must be a tensor
/// no other tensor shares a buffer with, on q's device. Every element is overwritten; nothing is
/// written unless every argument is valid.
///
/// ```
/// use flashattn::{AttentionParams, Tensor, backward, backward_into, forward};
/// let x: Vec<f32> = (0..2 * 3 * 1 * 4).map(|i| (i as f32 * 0.71).cos()).collect();
/// let t = Tensor::from_vec(x, &[2, 3, 1, 4])?;
/// let p = AttentionParams::default();
/// let f = forward(&t, &t, &t, &p)?;
/// let mut g = backward(&t, &t, &t, &f.out, &f.lse, &f.out, &p)?;
/// let first = g.dq.to_vec::<f32>()?;
/// backward_into(&t, &t, &t, &f.out, &f.lse, &f.out, &p, &mut g)?;
/// assert_eq!(g.dq.to_vec::<f32>()?, first);
/// # Ok::<(), flashattn::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn backward_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
    grads: &mut Gradients,
) -> Result<()> {
    let p = backward_problem([q, k, v, out, lse, dout], params)?;
    let (dtype, device) = (p.dtype, p.device);
    expect_writable(&mut grads.dq, "dq", q.shape(), dtype, device, Layout::Rows)?;
    expect_writable(&mut grads.dk, "dk", k.shape(), dtype, device, Layout::Rows)?;
    expect_writable(&mut grads.dv, "dv", v.shape(), dtype, device, Layout::Rows)?;
    match (&p.bias, grads.dbias.as_mut()) {
        (Some((bias, _)), Some(db)) => expect_writable(
            db,
            "dbias",
            bias.shape(),
            DType::F32,
            device,
            Layout::Contiguous,
        )?,
        (Some(_), None) => {
            return Err(Error::arg(
                "dbias",
                "a tensor (the call has a bias)",
                "None",
            ));
        }
        (None, Some(_)) => {
            return Err(Error::arg(
                "dbias",
                "None (the call has no bias)",
                "a tensor",
            ));
        }
        (None, None) => {}
    }
    match p.device {
        Device::Cpu => crate::cpu::backward_into(&p, [q, k, v, out, lse, dout], grads),
        Device::Cuda(_) => Err(unsupported_backward()),
    }
}

/// Validates a backward call (flashattn's and the standard attention's): the forward's problem,
/// then out, lse and dout against it.
pub(crate) fn backward_problem(
    [q, k, v, out, lse, dout]: [&Tensor; 6],
    params: &AttentionParams,
) -> Result<Problem> {
    let p = Problem::new(q, k, v, params)?;
    let out_shape = Problem::shape_like(q, p.head_dim_v);
    expect_like(out, "out", &out_shape, p.dtype, p.device)?;
    expect_like(dout, "dout", &out_shape, p.dtype, p.device)?;
    if lse.shape() != p.lse_shape().as_slice() {
        return Err(Error::arg(
            "lse",
            format!("shape {:?}", p.lse_shape()),
            format!("shape {:?}", lse.shape()),
        ));
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            arg: "lse",
            expected: "f32".into(),
            got: lse.dtype(),
        });
    }
    if lse.device() != p.device {
        return Err(Error::DeviceMismatch {
            arg: "lse",
            expected: p.device.to_string(),
            got: lse.device().to_string(),
        });
    }
    Ok(p)
}

fn unsupported_backward() -> Error {
    Error::Unsupported {
        device: "cuda",
        what: "backward".into(),
    }
}
