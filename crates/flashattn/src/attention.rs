//! The public entry points. Each call validates into a [`Problem`] and dispatches once on the
//! device the tensors live on, to that device's backend (`crate::backend::Backend`).

use crate::devices::backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::{ForwardOutput, Gradients, Layout, expect_writable};
use crate::params::AttentionParams;
use crate::problem::{Problem, backward_problem};
use crate::tensor::Tensor;

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
    backend(p.device)?.forward(&p, q, k, v)
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
    backend(p.device)?.backward(&p, [q, k, v, out, lse, dout])
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
    backend(p.device)?.forward_into(&p, (q, k, v), out, lse)
}

/// [`backward`] into gradients the caller owns (for instance those of an earlier call), so
/// that a loop of calls allocates no gradients: `dq`, `dk`, `dv` shaped like q, k, v in their
/// dtype (any strides that reach each element once, head dimension contiguous), and `dbias`
/// given exactly when the call has a bias, shaped like it, f32, contiguous (and `drel_bias` likewise
/// for a relative-position bias table). Each must be a tensor
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
    let bias = p.bias.as_ref().map(|(t, _)| t.shape());
    expect_bias_grad(grads.dbias.as_mut(), "dbias", bias, device)?;
    let rel = p.rel_bias.as_ref().map(|r| r.table.shape());
    expect_bias_grad(grads.drel_bias.as_mut(), "drel_bias", rel, device)?;
    backend(p.device)?.backward_into(&p, [q, k, v, out, lse, dout], grads)
}

/// Checks a bias gradient handed to [`backward_into`]: given exactly when the call has that bias
/// (of shape `shape`), f32, contiguous.
fn expect_bias_grad(
    grad: Option<&mut Tensor>,
    arg: &'static str,
    shape: Option<&[usize]>,
    device: crate::tensor::Device,
) -> Result<()> {
    match (shape, grad) {
        (Some(shape), Some(g)) => {
            expect_writable(g, arg, shape, DType::F32, device, Layout::Contiguous)
        }
        (Some(_), None) => Err(Error::arg(
            arg,
            format!("a tensor (the call has a {})", &arg[1..]),
            "None",
        )),
        (None, Some(_)) => Err(Error::arg(
            arg,
            format!("None (the call has no {})", &arg[1..]),
            "a tensor",
        )),
        (None, None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use crate::host_buf::{HUGE_BYTES, LINE_BYTES, huge_pages};

    /// The outputs of `forward` and `backward`, the tensors of `Tensor::full`, `from_slice` and
    /// conversions start on a line in every dtype, and from 2 MiB on on a huge page.
    #[test]
    fn tensors_flashattn_allocates_are_aligned() {
        use crate::{AttentionParams, DType, Tensor, backward, forward};
        fn first_byte(t: &Tensor) -> usize {
            let at = t.offset();
            match t.dtype() {
                DType::F32 => t.cpu_slice::<f32>().unwrap()[at..].as_ptr() as usize,
                DType::F16 => t.cpu_slice::<half::f16>().unwrap()[at..].as_ptr() as usize,
                DType::BF16 => t.cpu_slice::<half::bf16>().unwrap()[at..].as_ptr() as usize,
            }
        }
        let p = AttentionParams::default().causal();
        // [B, N, H, D]: 2 MiB in f32 for the second.
        for shape in [[2, 5, 3, 8], [4, 16, 64, 128]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let x = Tensor::from_vec(data.clone(), &shape)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let f = forward(&x, &x, &x, &p).unwrap();
                let g = backward(&x, &x, &x, &f.out, &f.lse, &x, &p).unwrap();
                let full = Tensor::full(&shape, dtype, 1.0).unwrap();
                let copy = Tensor::from_slice(&data, &shape).unwrap();
                let tensors = [
                    ("x", &x),
                    ("out", &f.out),
                    ("lse", &f.lse),
                    ("dq", &g.dq),
                    ("dk", &g.dk),
                    ("dv", &g.dv),
                    ("full", &full),
                    ("from_slice", &copy),
                ];
                for (name, t) in tensors {
                    let bytes = t.numel() * t.dtype().size_in_bytes();
                    let huge = bytes >= HUGE_BYTES && huge_pages();
                    let align = if huge { HUGE_BYTES } else { LINE_BYTES };
                    assert_eq!(first_byte(t) % align, 0, "{dtype} {name} {shape:?}");
                }
            }
        }
    }
}
