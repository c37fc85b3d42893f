//! Linear attention, the O(N) alternative to softmax attention: with a feature map φ,
//! `out_i = φ(q_i)ᵀ·S / (φ(q_i)·z + eps)`, `S = Σ_j φ(k_j)·v_jᵀ`, `z = Σ_j φ(k_j)`, the sums over
//! every key (causal: over keys j ≤ i + nk − nq). No score scale. O(N·D·Dv) time and an O(D·Dv)
//! state per head; forward and backward, on the CPU and on CUDA GPUs.
//!
//! Both backends compute every result as one chunked scan `y_r = Σ_{s visible to r} (x_r·u_s)·w_s`
//! (chunks of sources: the state `Σ u_s·w_sᵀ` of the chunks before a row's own, and the masked
//! product within it) over prepared operands: φ(q), φ(k), `[v, 1]` (v and a column of ones, so
//! that one scan gives numerator and denominator) and, in the backward, `[g, c]` with
//! `g_i = dout_i / den_i`, `c_i = −g_i·out_i`:
//!
//! | result | rows | x | sources | u | w |
//! |---|---|---|---|---|---|
//! | num, den − eps | queries | φ(q) | keys | φ(k) | [v, 1] |
//! | dq / φ'(q) | queries | [g, c] | keys | [v, 1] | φ(k) |
//! | dk / φ'(k) | keys, from the end | [v, 1] | queries, from the end | [g, c] | φ(q) |
//! | dv | keys, from the end | φ(k) | queries, from the end | φ(q) | g |
//!
//! Counted from their ends, key j sees query i when i ≤ j: the reverse scan is the forward one.
//! Sums are in f64 for every dtype: `[g, c]·[v_j, 1] = g·(v_j − out)` cancels when a query's
//! output is nearly one value's (a single visible key), and f32 sums then miss the bound of the
//! tests even for f16 results.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layer::cpu::f32_rows;
use crate::tensor::{Device, Tensor};

/// The feature map φ applied to queries and keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FeatureMap {
    /// `elu(x) + 1`: `x + 1` for `x > 0`, `eˣ` otherwise (always positive).
    #[default]
    Elu1,
    /// `max(x, 0)`.
    Relu,
}

impl FeatureMap {
    /// φ(x) and φ'(x).
    pub(crate) fn apply(self, x: f64) -> (f64, f64) {
        match self {
            FeatureMap::Elu1 if x > 0.0 => (x + 1.0, 1.0),
            FeatureMap::Elu1 => (x.exp(), x.exp()),
            FeatureMap::Relu if x > 0.0 => (x, 1.0),
            FeatureMap::Relu => (0.0, 0.0),
        }
    }
}

/// The options of a linear-attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearParams {
    /// Query i sees keys j ≤ i + nk − nq only (bottom-right aligned, as the softmax path).
    pub causal: bool,
    /// φ.
    pub feature_map: FeatureMap,
    /// Added to every denominator; finite and > 0.
    pub eps: f64,
}

impl Default for LinearParams {
    fn default() -> Self {
        LinearParams {
            causal: false,
            feature_map: FeatureMap::Elu1,
            eps: 1e-6,
        }
    }
}

/// The gradients of [`linear_backward`], each in the dtype and shape of its input.
#[derive(Clone, Debug)]
pub struct LinearGradients {
    /// Gradient of `q`.
    pub dq: Tensor,
    /// Gradient of `k` (summed over the query heads of its group).
    pub dk: Tensor,
    /// Gradient of `v` (summed over the query heads of its group).
    pub dv: Tensor,
}

/// The validated sizes of one call: q `[b, nq, h, d]`, k `[b, nk, hk, d]`, v `[b, nk, hk, dv]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LinearShape {
    pub b: usize,
    pub nq: usize,
    pub nk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    pub dv: usize,
}

fn dims(name: &'static str, t: &Tensor) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(t.shape()).map_err(|_| {
        Error::arg(
            name,
            "a rank-4 tensor [batch, seqlen, heads, head_dim]",
            format!("{:?}", t.shape()),
        )
    })
}

fn check(q: &Tensor, k: &Tensor, v: &Tensor, params: &LinearParams) -> Result<LinearShape> {
    if !(params.eps.is_finite() && params.eps > 0.0) {
        return Err(Error::arg("eps", "a finite number > 0", params.eps));
    }
    let [b, nq, h, d] = dims("q", q)?;
    let [bk, nk, hk, dk] = dims("k", k)?;
    let [bv, nv, hv, dv] = dims("v", v)?;
    let dtypes = "f32, f16 or bf16";
    if !matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::DType {
            arg: "q",
            expected: dtypes.into(),
            got: q.dtype(),
        });
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(Error::DType {
                arg: name,
                expected: format!("{} (q's)", q.dtype()),
                got: t.dtype(),
            });
        }
        if t.device() != q.device() {
            return Err(Error::DeviceMismatch {
                arg: name,
                expected: q.device().to_string(),
                got: t.device().to_string(),
            });
        }
    }
    let expect = |arg, want: usize, got: usize, what: &str| {
        if want == got {
            Ok(())
        } else {
            Err(Error::arg(arg, format!("{what} {want}"), got))
        }
    };
    expect("k", b, bk, "batch (q's)")?;
    expect("v", b, bv, "batch (q's)")?;
    expect("k", d, dk, "head_dim (q's)")?;
    expect("v", nk, nv, "seqlen (k's)")?;
    expect("v", hk, hv, "heads (k's)")?;
    if hk == 0 || h % hk != 0 {
        return Err(Error::arg(
            "k",
            format!("a number of heads dividing q's {h}"),
            hk,
        ));
    }
    if d == 0 || dv == 0 {
        return Err(Error::arg("q", "head dims > 0", format!("{d} and {dv}")));
    }
    Ok(LinearShape {
        b,
        nq,
        nk,
        h,
        hk,
        d,
        dv,
    })
}

/// The error of a CUDA tensor in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda() -> Error {
    Error::Unsupported {
        device: "cuda",
        what: "linear attention in a build without the cargo feature `cuda`".into(),
    }
}

/// A CPU result in `dtype` (f32 as it is, no copy).
fn result(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(data, shape)?;
    if dtype == DType::F32 {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// Linear attention of q `[batch, seqlen_q, heads, head_dim]` over k `[batch, seqlen_k,
/// heads_k, head_dim]` and v `[batch, seqlen_k, heads_k, head_dim_v]` (heads a multiple of
/// heads_k, GQA): the output `[batch, seqlen_q, heads, head_dim_v]` in q's dtype. f32, f16 and
/// bf16; the sums are kept in f64. Any strides; the output is contiguous, on the inputs' device.
pub fn linear_forward(q: &Tensor, k: &Tensor, v: &Tensor, params: &LinearParams) -> Result<Tensor> {
    let shape = check(q, k, v, params)?;
    match q.device() {
        Device::Cpu => {}
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => return cuda::forward(shape, q, k, v, params),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(no_cuda()),
    }
    let out = cpu::forward(
        &shape,
        (&f32_rows(q)?, &f32_rows(k)?, &f32_rows(v)?),
        params,
    );
    result(out, &[shape.b, shape.nq, shape.h, shape.dv], q.dtype())
}

/// The gradients of [`linear_forward`] for the upstream gradient `dout` (the output's shape and
/// dtype).
pub fn linear_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    params: &LinearParams,
) -> Result<LinearGradients> {
    let s = check(q, k, v, params)?;
    let want = [s.b, s.nq, s.h, s.dv];
    if dout.shape() != want {
        return Err(Error::arg(
            "dout",
            format!("the output's shape {want:?}"),
            format!("{:?}", dout.shape()),
        ));
    }
    if dout.dtype() != q.dtype() {
        return Err(Error::DType {
            arg: "dout",
            expected: format!("{} (q's)", q.dtype()),
            got: dout.dtype(),
        });
    }
    if dout.device() != q.device() {
        return Err(Error::DeviceMismatch {
            arg: "dout",
            expected: q.device().to_string(),
            got: dout.device().to_string(),
        });
    }
    match q.device() {
        Device::Cpu => {}
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => return cuda::backward(s, (q, k, v), dout, params),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(no_cuda()),
    }
    let (dq, dk, dv) = cpu::backward(
        &s,
        (&f32_rows(q)?, &f32_rows(k)?, &f32_rows(v)?),
        &f32_rows(dout)?,
        params,
    );
    let t = |data, shape: &[usize]| result(data, shape, q.dtype());
    Ok(LinearGradients {
        dq: t(dq, &[s.b, s.nq, s.h, s.d])?,
        dk: t(dk, &[s.b, s.nk, s.hk, s.d])?,
        dv: t(dv, &[s.b, s.nk, s.hk, s.dv])?,
    })
}
