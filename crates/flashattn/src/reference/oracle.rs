//! The f64 oracle: materializes every score in double precision, straight from the definition in
//! [`crate::params`]. Never optimized; it is the truth the tests compare against.
//!
//! Outputs are row-major in logical order: `out` and the gradients of q/k/v as
//! `[rows, heads, dim]` (rows = `batch · seqlen` when padded, packed rows with varlen), `lse` in
//! the shape of [`Problem::lse_shape`], `dbias` in the bias' shape, `drel_bias` in the table's.

use crate::error::Result;
use crate::params::AttentionParams;
use crate::problem::Problem;
use crate::tensor::Tensor;

/// The oracle's forward results.
#[derive(Clone, Debug)]
pub struct OracleForward {
    /// `[rows_q, heads_q, head_dim_v]`.
    pub out: Vec<f64>,
    /// Log-sum-exp, natural log, −∞ for rows that see no key.
    pub lse: Vec<f64>,
}

/// The oracle's gradients.
#[derive(Clone, Debug)]
pub struct OracleGradients {
    /// `[rows_q, heads_q, head_dim]`.
    pub dq: Vec<f64>,
    /// `[rows_k, heads_kv, head_dim]`.
    pub dk: Vec<f64>,
    /// `[rows_k, heads_kv, head_dim_v]`.
    pub dv: Vec<f64>,
    /// In the bias' shape (summed over its broadcast dimensions).
    pub dbias: Option<Vec<f64>>,
    /// `[heads, 2L − 1]`: each entry sums dS over the pairs that read it.
    pub drel_bias: Option<Vec<f64>>,
}

struct Inputs {
    p: Problem,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    bias: Option<Vec<f64>>,
    bias_shape: [usize; 4],
    /// The relative-position table, row-major `[heads, 2L − 1]`.
    rel: Option<Vec<f64>>,
}

impl Inputs {
    fn new(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttentionParams) -> Result<Self> {
        let p = Problem::new(q, k, v, params)?;
        let (bias, bias_shape) = match &params.bias {
            Some(b) => {
                let s = b.shape();
                (Some(b.to_f64_vec()?), [s[0], s[1], s[2], s[3]])
            }
            None => (None, [1; 4]),
        };
        Ok(Inputs {
            q: q.to_f64_vec()?,
            k: k.to_f64_vec()?,
            v: v.to_f64_vec()?,
            bias,
            bias_shape,
            rel: params
                .rel_bias
                .as_ref()
                .map(|t| t.to_f64_vec())
                .transpose()?,
            p,
        })
    }

    fn bias_index(&self, b: usize, h: usize, i: usize, j: usize) -> usize {
        let s = self.bias_shape;
        let pick = |x: usize, n: usize| if n == 1 { 0 } else { x };
        ((pick(b, s[0]) * s[1] + pick(h, s[1])) * s[2] + pick(i, s[2])) * s[3] + pick(j, s[3])
    }

    /// The table entry that query `i` and key `j` (`rel = j − (i + diag)`) of head `h` read.
    fn rel_index(&self, h: usize, rel: i64) -> Option<usize> {
        let width = self.rel.as_ref()?.len() / self.p.heads_q;
        let r = (width / 2) as i64;
        Some(h * width + (rel.clamp(-r, r) + r) as usize)
    }

    /// Scores of one (sequence, head) after every step but the softmax, and the softcap's
    /// derivative ds/ds_raw per score. Masked entries are −∞.
    fn scores(&self, b: usize, h: usize) -> (Vec<f64>, Vec<f64>) {
        let p = &self.p;
        let (nq, nk, d) = (p.seqs[b].nq, p.seqs[b].nk, p.head_dim);
        let hk = h / (p.heads_q / p.heads_kv);
        let mut s = vec![f64::NEG_INFINITY; nq * nk];
        let mut dcap = vec![1.0; nq * nk];
        let diag = p.seqs[b].diag;
        for i in 0..nq {
            let qi = &self.q[(p.q_row(b, i) * p.heads_q + h) * d..][..d];
            for j in 0..nk {
                let rel = j as i64 - (i as i64 + diag);
                let hidden = p.window.left.is_some_and(|l| rel < -(l as i64))
                    || p.window.right.is_some_and(|r| rel > r as i64);
                let kj = &self.k[(p.k_row(b, j) * p.heads_kv + hk) * d..][..d];
                let mut x = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * p.scale as f64;
                if let Some(cap) = p.softcap {
                    let cap = cap as f64;
                    let t = (x / cap).tanh();
                    x = cap * t;
                    dcap[i * nk + j] = 1.0 - t * t;
                }
                x -= p.slope(b, h) as f64 * (rel as f64).abs();
                if let Some(bias) = &self.bias {
                    x += bias[self.bias_index(b, h, i, j)];
                }
                if let (Some(t), Some(at)) = (&self.rel, self.rel_index(h, rel)) {
                    x += t[at];
                }
                if !hidden {
                    s[i * nk + j] = x;
                }
            }
        }
        (s, dcap)
    }

    /// Softmax of each row in place; returns the log-sum-exp per row (−∞ for a row that sees no
    /// key, including every row when there are no keys at all).
    fn softmax(s: &mut [f64], nq: usize, nk: usize) -> Vec<f64> {
        if nk == 0 {
            return vec![f64::NEG_INFINITY; nq];
        }
        s.chunks_mut(nk)
            .map(|row| {
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    row.iter_mut().for_each(|x| *x = 0.0);
                    return f64::NEG_INFINITY;
                }
                let sum: f64 = row.iter().map(|x| (x - m).exp()).sum();
                row.iter_mut().for_each(|x| *x = (*x - m).exp() / sum);
                m + sum.ln()
            })
            .collect()
    }
}

/// The forward pass in f64.
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<OracleForward> {
    let x = Inputs::new(q, k, v, params)?;
    let p = &x.p;
    let dv = p.head_dim_v;
    let mut out = vec![0.0; p.total_q * p.heads_q * dv];
    let mut lse = vec![f64::NEG_INFINITY; p.lse_shape().iter().product()];
    for b in 0..p.batch {
        let (nq, nk) = (p.seqs[b].nq, p.seqs[b].nk);
        for h in 0..p.heads_q {
            let hk = p.kv_head(h);
            let (mut s, _) = x.scores(b, h);
            let l = Inputs::softmax(&mut s, nq, nk);
            for i in 0..nq {
                lse[p.lse_at(b, h, i)] = l[i];
                let o = &mut out[(p.q_row(b, i) * p.heads_q + h) * dv..][..dv];
                for j in 0..nk {
                    let vj = &x.v[(p.k_row(b, j) * p.heads_kv + hk) * dv..][..dv];
                    o.iter_mut()
                        .zip(vj)
                        .for_each(|(o, v)| *o += s[i * nk + j] * v);
                }
            }
        }
    }
    Ok(OracleForward { out, lse })
}

/// The analytic gradients in f64, for upstream gradient `dout` (shaped like the output).
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<OracleGradients> {
    gradients(q, k, v, dout, None, params, false)
}

/// The magnitudes of the terms each gradient sums: the same sums as [`backward`] with every
/// term, down to the products inside `dS_ij = P_ij (dO_i·v_j − D_i)`, replaced by its absolute
/// value (`|dS|_ij = P_ij (|dO_i|·|v_j| + |D|_i)`, `|dq|_i = scale · Σ_j |dS|_ij · |k_j|`, and so
/// on). They are the scale of each gradient's rounding error: where the terms cancel (each row
/// of dS sums to 0; with one visible key dS is exactly 0), an error relative to the gradient
/// itself would measure the cancellation, not the implementation.
pub fn backward_magnitudes(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<OracleGradients> {
    gradients(q, k, v, dout, None, params, true)
}

/// The gradients of the FlashAttention-2 formulation for a given forward output `out`: as
/// [`backward`], but with `D_i = dO_i · out_i` in `dS_ij = P_ij (dP_ij − D_i)` instead of
/// `Σ_j P_ij dP_ij`. The two agree when `out` is exact; for an `out` stored in f16/bf16 this is
/// exactly what a FlashAttention backward computes from it (it reads the stored output), so it
/// separates an implementation's own error from the effect of the output's rounding.
pub fn backward_given_out(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<OracleGradients> {
    let out = out.to_f64_vec()?;
    gradients(q, k, v, dout, Some(&out), params, false)
}

/// The gradients (with `D` from `out` when given, see [`backward_given_out`]), or with
/// `magnitudes` the sums of the absolute values of their terms.
fn gradients(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    out: Option<&[f64]>,
    params: &AttentionParams,
    magnitudes: bool,
) -> Result<OracleGradients> {
    let a = |x: f64| if magnitudes { x.abs() } else { x };
    let x = Inputs::new(q, k, v, params)?;
    let p = &x.p;
    let (d, dv) = (p.head_dim, p.head_dim_v);
    let dout = dout.to_f64_vec()?;
    let rows_k = k.shape()[0] * if p.varlen { 1 } else { k.shape()[1] };
    let mut dq = vec![0.0; p.total_q * p.heads_q * d];
    let mut dk = vec![0.0; rows_k * p.heads_kv * d];
    let mut dvv = vec![0.0; rows_k * p.heads_kv * dv];
    let mut dbias = x.bias.as_ref().map(|b| vec![0.0; b.len()]);
    let mut drel = x.rel.as_ref().map(|t| vec![0.0; t.len()]);
    let scale = p.scale as f64;
    for b in 0..p.batch {
        let (nq, nk) = (p.seqs[b].nq, p.seqs[b].nk);
        for h in 0..p.heads_q {
            let hk = p.kv_head(h);
            let (mut s, dcap) = x.scores(b, h);
            Inputs::softmax(&mut s, nq, nk);
            for i in 0..nq {
                let qrow = (p.q_row(b, i) * p.heads_q + h) * d;
                let go = &dout[(p.q_row(b, i) * p.heads_q + h) * dv..][..dv];
                let vrow = |j: usize| (p.k_row(b, j) * p.heads_kv + hk) * dv;
                // dP_ij = dO_i · V_j; dS_ij = P_ij (dP_ij − Σ_k P_ik dP_ik).
                let dp: Vec<f64> = (0..nk)
                    .map(|j| {
                        go.iter()
                            .zip(&x.v[vrow(j)..][..dv])
                            .map(|(o, v)| a(*o) * a(*v))
                            .sum()
                    })
                    .collect();
                let row_dot: f64 = match out {
                    Some(o) => go
                        .iter()
                        .zip(&o[(p.q_row(b, i) * p.heads_q + h) * dv..])
                        .map(|(a, b)| a * b)
                        .sum(),
                    None => (0..nk).map(|j| s[i * nk + j] * dp[j]).sum(),
                };
                for j in 0..nk {
                    let pij = s[i * nk + j];
                    let krow = (p.k_row(b, j) * p.heads_kv + hk) * d;
                    dvv[vrow(j)..][..dv]
                        .iter_mut()
                        .zip(go)
                        .for_each(|(g, o)| *g += pij * a(*o));
                    let ds = if magnitudes {
                        pij * (dp[j] + row_dot)
                    } else {
                        pij * (dp[j] - row_dot)
                    };
                    if let Some(db) = dbias.as_mut() {
                        db[x.bias_index(b, h, i, j)] += ds;
                    }
                    if let Some(dr) = drel.as_mut() {
                        let rel = j as i64 - (i as i64 + p.seqs[b].diag);
                        dr[x.rel_index(h, rel).expect("a table")] += ds;
                    }
                    let ds_raw = a(ds * dcap[i * nk + j] * scale);
                    for c in 0..d {
                        dq[qrow + c] += ds_raw * a(x.k[krow + c]);
                        dk[krow + c] += ds_raw * a(x.q[qrow + c]);
                    }
                }
            }
        }
    }
    Ok(OracleGradients {
        dq,
        dk,
        dv: dvv,
        dbias,
        drel_bias: drel,
    })
}
