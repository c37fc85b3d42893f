//! Validation of a layer call: every tensor's shape, dtype and device against `x` and the
//! head counts, and the views of Q, K and V in the packed qkv buffer.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layer::params::{LayerParams, LayerWeights, RopeStyle};
use crate::tensor::{Device, Tensor};

/// The rotary embedding of a validated call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopeOf {
    pub style: RopeStyle,
    pub base: f64,
    /// The rotary dim `R` (even, ≤ head_dim).
    pub dim: usize,
}

/// A validated layer call.
#[derive(Clone, Debug)]
pub(crate) struct LayerShape {
    pub dtype: DType,
    pub device: Device,
    /// `x`'s shape: `[batch, seqlen, model_dim]`, or `[total_tokens, model_dim]` with varlen.
    pub x_shape: Vec<usize>,
    /// Rows of `x` (`batch · seqlen` or `total_tokens`).
    pub rows: usize,
    pub model_dim: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Columns of the packed qkv buffer, `(H + 2·HK) · head_dim`.
    pub cols: usize,
    pub rope: Option<RopeOf>,
    /// The rotary position of each row.
    pub positions: Vec<i32>,
}

/// Checks `t`'s device, dtype (that of `x`) and shape.
fn expect(t: &Tensor, arg: &'static str, shape: &[usize], s: &LayerShape) -> Result<()> {
    if t.device() != s.device {
        return Err(Error::DeviceMismatch {
            arg,
            expected: format!("{} (the device of x)", s.device),
            got: t.device().to_string(),
        });
    }
    if t.dtype() != s.dtype {
        return Err(Error::DType {
            arg,
            expected: format!("{} (the dtype of x)", s.dtype),
            got: t.dtype(),
        });
    }
    if t.shape() != shape {
        return Err(Error::arg(
            arg,
            format!("shape {shape:?}"),
            format!("shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

impl LayerShape {
    /// Validates `x`, the weights and the options.
    pub(crate) fn new(x: &Tensor, w: &LayerWeights, p: &LayerParams) -> Result<Self> {
        let varlen = p.attention.varlen.as_ref();
        let x_shape = x.shape().to_vec();
        let (rows, model_dim) = match (varlen, x_shape.as_slice()) {
            (None, &[b, n, m]) => (b * n, m),
            (Some(_), &[t, m]) => (t, m),
            (None, _) => {
                return Err(Error::arg(
                    "x",
                    "shape [batch, seqlen, model_dim]",
                    format!("shape {x_shape:?}"),
                ));
            }
            (Some(_), _) => {
                return Err(Error::arg(
                    "x",
                    "shape [total_tokens, model_dim] (packed, with varlen)",
                    format!("shape {x_shape:?}"),
                ));
            }
        };
        if let Some(v) = varlen
            && v.cu_seqlens_k != v.cu_seqlens_q
        {
            return Err(Error::arg(
                "cu_seqlens_k",
                "the same lengths as cu_seqlens_q (the layer attends x to itself)",
                format!("{:?}", v.cu_seqlens_k),
            ));
        }
        let (heads, heads_kv) = (p.heads, p.heads_kv);
        if heads == 0 {
            return Err(Error::arg("heads", "at least 1", heads));
        }
        if heads_kv == 0 || !heads.is_multiple_of(heads_kv) {
            return Err(Error::arg(
                "heads_kv",
                format!("a divisor of heads = {heads}"),
                heads_kv,
            ));
        }
        let all_heads = heads + 2 * heads_kv;
        let cols = match w.w_qkv.shape() {
            &[m, c] if m == model_dim && c > 0 && c.is_multiple_of(all_heads) => c,
            s => {
                return Err(Error::arg(
                    "w_qkv",
                    format!(
                        "shape [model_dim = {model_dim}, (heads + 2·heads_kv)·head_dim] (a \
                         positive multiple of {all_heads} columns)"
                    ),
                    format!("shape {s:?}"),
                ));
            }
        };
        let head_dim = cols / all_heads;
        let rope = match p.rope {
            None => None,
            Some(r) => {
                let dim = r.dim.unwrap_or(head_dim);
                if dim == 0 || dim % 2 == 1 || dim > head_dim {
                    return Err(Error::arg(
                        "rope_dim",
                        format!("an even number in 2..={head_dim} (head_dim)"),
                        dim,
                    ));
                }
                if !(r.base.is_finite() && r.base > 0.0) {
                    return Err(Error::arg("rope_base", "a positive finite number", r.base));
                }
                Some(RopeOf {
                    style: r.style,
                    base: r.base,
                    dim,
                })
            }
        };
        let positions = match &p.positions {
            Some(pos) if pos.len() != rows => {
                return Err(Error::arg(
                    "positions",
                    format!("{rows} values (one per row of x)"),
                    format!("{} values", pos.len()),
                ));
            }
            Some(pos) => pos.clone(),
            None => default_positions(&x_shape, varlen.map(|v| v.cu_seqlens_q.as_slice()))?,
        };
        let s = LayerShape {
            dtype: x.dtype(),
            device: x.device(),
            x_shape,
            rows,
            model_dim,
            heads,
            heads_kv,
            head_dim,
            cols,
            rope,
            positions,
        };
        expect(&w.w_qkv, "w_qkv", &[model_dim, cols], &s)?;
        if let Some(b) = &w.b_qkv {
            expect(b, "b_qkv", &[cols], &s)?;
        }
        expect(&w.w_o, "w_o", &[heads * head_dim, model_dim], &s)?;
        if let Some(b) = &w.b_o {
            expect(b, "b_o", &[model_dim], &s)?;
        }
        Ok(s)
    }

    /// `x`'s shape with the last dim `n` (`y`: model_dim, the qkv buffer: cols).
    pub(crate) fn rows_of(&self, n: usize) -> Vec<usize> {
        let mut s = self.x_shape.clone();
        *s.last_mut().expect("x has rank 2 or 3") = n;
        s
    }

    /// `[.., heads, head_dim]` over `x`'s row dims.
    pub(crate) fn heads_of(&self, heads: usize) -> Vec<usize> {
        let mut s = self.rows_of(heads);
        s.push(self.head_dim);
        s
    }

    /// Checks a tensor shaped like the rows of `x` with `n` columns (`dy`, the saved qkv).
    pub(crate) fn expect_rows(&self, t: &Tensor, arg: &'static str, n: usize) -> Result<()> {
        expect(t, arg, &self.rows_of(n), self)
    }

    /// Checks a tensor shaped `[.., heads, head_dim]` (the saved attention output).
    pub(crate) fn expect_heads(&self, t: &Tensor, arg: &'static str) -> Result<()> {
        expect(t, arg, &self.heads_of(self.heads), self)
    }

    /// The views of Q, K and V in a contiguous packed `[.., cols]` buffer: the q heads from column
    /// 0, the k heads from `H·D`, the v heads from `(H + HK)·D`, rows `cols` apart.
    pub(crate) fn views(&self, qkv: &Tensor) -> Result<[Tensor; 3]> {
        let (c, d) = (self.cols, self.head_dim);
        let mut strides = vec![c, d, 1];
        if self.x_shape.len() == 3 {
            strides.insert(0, self.x_shape[1] * c);
        }
        let starts = [0, self.heads, self.heads + self.heads_kv];
        let counts = [self.heads, self.heads_kv, self.heads_kv];
        let view = |i: usize| {
            qkv.view(
                &self.heads_of(counts[i]),
                &strides,
                qkv.offset() + starts[i] * d,
            )
        };
        Ok([view(0)?, view(1)?, view(2)?])
    }
}

/// Rows numbered from 0 in each sequence: `row mod seqlen`, or from `cu_seqlens[b]` with varlen.
fn default_positions(x_shape: &[usize], cu: Option<&[i32]>) -> Result<Vec<i32>> {
    let too_long = |n: usize| Error::arg("x", "sequences of at most 2^31 rows", n);
    match cu {
        None => {
            let (b, n) = (x_shape[0], x_shape[1]);
            let n32 = i32::try_from(n).map_err(|_| too_long(n))?;
            Ok((0..b).flat_map(|_| 0..n32).collect())
        }
        Some(cu) => {
            let mut pos = Vec::with_capacity(x_shape[0]);
            for w in cu.windows(2) {
                pos.extend(0..(w[1] - w[0]).max(0));
            }
            // Rows past the last sequence (a malformed cu_seqlens the attention rejects) get 0.
            pos.resize(x_shape[0], 0);
            Ok(pos)
        }
    }
}
