//! The "standard attention" baseline: materializes the score matrix of every (sequence, head),
//! applies the softmax to it, and multiplies by V — the way attention is written without
//! FlashAttention, in the precision of the inputs.
//!
//! For inputs of dtype `T` every materialized value is rounded to `T`, as a framework computing in
//! `T` would store it: `S = q·kᵀ·scale` (accumulated in f32), then each of softcap and ALiBi + bias,
//! then `P = softmax(S)` (computed in f32), then `O = P·V` (accumulated in f32). The backward
//! rounds `dP`, `dS` and the softcap's `dS` likewise, and accumulates its products in f32.
//!
//! The matrices are held in f32 buffers (whose values are rounded to `T`), one
//! `[batch, heads, seqlen_q, seqlen_k]` matrix for the forward and two for the backward; see
//! [`forward_extra_memory_bytes`]. It is a yardstick for tests (the error a plain implementation
//! makes in the same precision) and for benchmarks (speed and memory of the materializing method),
//! so its products run through the `gemm` crate, parallel over (sequence, head) with rayon.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::attention::{ForwardOutput, Gradients};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::params::AttentionParams;
use crate::problem::{Problem, RowLayout, expect_like, strides_like};
use crate::tensor::{Tensor, contiguous_strides};

/// Bytes of the matrices [`forward`] materializes for problem `p`: the scores of every
/// (sequence, head) in f32, plus f32 working copies of q, k, v and the output. Saturates at
/// `usize::MAX`.
pub fn forward_extra_memory_bytes(p: &Problem) -> usize {
    score_elements(p)
        .saturating_add(operand_elements(p))
        .saturating_mul(4)
}

/// Bytes of the matrices [`backward`] materializes for problem `p`: `P` and `dS` of every
/// (sequence, head) in f32, plus f32 working copies of the inputs and gradients. Saturates at
/// `usize::MAX`.
pub fn backward_extra_memory_bytes(p: &Problem) -> usize {
    score_elements(p)
        .saturating_add(operand_elements(p))
        .saturating_mul(8)
}

/// Elements of one `[batch, heads, nq, nk]` matrix (per-sequence lengths with varlen), saturating.
fn score_elements(p: &Problem) -> usize {
    p.seqs
        .iter()
        .fold(0usize, |n, s| n.saturating_add(s.nq.saturating_mul(s.nk)))
        .saturating_mul(p.heads_q)
}

fn operand_elements(p: &Problem) -> usize {
    let rows_q: usize = p.seqs.iter().map(|s| s.nq).sum();
    let rows_k: usize = p.seqs.iter().map(|s| s.nk).sum();
    p.heads_q
        .saturating_mul(rows_q + rows_k)
        .saturating_mul(p.head_dim + p.head_dim_v)
}

/// A zeroed `[batch, heads, nq, nk]` f32 matrix, or an error when it cannot be allocated.
fn score_matrix(p: &Problem) -> Result<Vec<f32>> {
    let n = score_elements(p);
    let mut m = Vec::new();
    m.try_reserve_exact(n).map_err(|_| Error::Unsupported {
        device: "cpu",
        what: format!(
            "the standard attention's score matrix of {n} f32 elements does not fit in memory"
        ),
    })?;
    m.resize(n, 0.0);
    Ok(m)
}

/// Standard attention forward: same arguments, validation and outputs (`out` in `q`'s dtype and
/// memory order, `lse` f32) as [`crate::forward`].
///
/// ```
/// use flashattn::{AttentionParams, Tensor, reference::standard};
/// let x: Vec<f32> = (0..3 * 2 * 4).map(|i| (i as f32 * 0.3).sin()).collect();
/// let t = Tensor::from_vec(x, &[1, 3, 2, 4])?;
/// let res = standard::forward(&t, &t, &t, &AttentionParams::default().causal())?;
/// let fa = flashattn::forward(&t, &t, &t, &AttentionParams::default().causal())?;
/// let (a, b) = (res.out.to_vec::<f32>()?, fa.out.to_vec::<f32>()?);
/// assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    let p = Problem::new(q, k, v, params)?;
    host_only(&p)?;
    match p.dtype {
        DType::F32 => forward_typed::<f32>(&p, q, k, v),
        DType::F16 => forward_typed::<f16>(&p, q, k, v),
        DType::BF16 => forward_typed::<bf16>(&p, q, k, v),
    }
}

/// Standard attention backward: materializes `P` and `dS` and applies the textbook formulas
/// (`dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(P∘dP))`, `dQ = dS·K·scale`,
/// `dK = dSᵀ·Q·scale`). Same arguments, validation and outputs as [`crate::backward`]; `P` is
/// recomputed exactly as [`forward`] computes it, so `out` and `lse` are only validated.
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<Gradients> {
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
    host_only(&p)?;
    match p.dtype {
        DType::F32 => backward_typed::<f32>(&p, q, k, v, dout),
        DType::F16 => backward_typed::<f16>(&p, q, k, v, dout),
        DType::BF16 => backward_typed::<bf16>(&p, q, k, v, dout),
    }
}

fn host_only(p: &Problem) -> Result<()> {
    if p.device != crate::tensor::Device::Cpu {
        return Err(Error::Unsupported {
            device: "cuda",
            what: "the standard attention baseline runs on the CPU only".into(),
        });
    }
    Ok(())
}

/// `x` rounded to `T` and widened back.
#[inline(always)]
fn round<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

/// `dst[m×n] = alpha · lhs·rhs` (row-major `dst`), or `dst += alpha · lhs·rhs` when `accumulate`.
/// `lhs` is `m×k` and `rhs` is `k×n`, each given by its (row, column) strides.
struct MatMul {
    m: usize,
    n: usize,
    k: usize,
    lhs_strides: (usize, usize),
    rhs_strides: (usize, usize),
    alpha: f32,
    accumulate: bool,
}

impl MatMul {
    fn run(&self, dst: &mut [f32], lhs: &[f32], rhs: &[f32]) {
        let (m, n, k) = (self.m, self.n, self.k);
        if m == 0 || n == 0 {
            return;
        }
        let dst = &mut dst[..m * n];
        if k == 0 {
            if !self.accumulate {
                dst.fill(0.0);
            }
            return;
        }
        let last =
            |(rs, cs): (usize, usize), rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs;
        assert!(
            last(self.lhs_strides, m, k) < lhs.len(),
            "lhs out of bounds"
        );
        assert!(
            last(self.rhs_strides, k, n) < rhs.len(),
            "rhs out of bounds"
        );
        // SAFETY: the asserts above keep every element gemm reads inside `lhs` and `rhs`, and `dst`
        // holds the m×n row-major result; the three slices are distinct borrows, so nothing aliases.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                self.accumulate,
                lhs.as_ptr(),
                self.lhs_strides.1 as isize,
                self.lhs_strides.0 as isize,
                rhs.as_ptr(),
                self.rhs_strides.1 as isize,
                self.rhs_strides.0 as isize,
                1.0,
                self.alpha,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    }
}

/// The inputs of one sequence in f32, per head: `q[h]` is `nq × d`, `k[hk]` and `v[hk]` are
/// `nk × d` and `nk × dv`, row-major.
struct SeqInputs {
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn gather_rows(t: &[f32], at: impl Fn(usize) -> usize, rows: usize, dim: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| &t[at(r)..at(r) + dim])
        .copied()
        .collect()
}

/// The whole buffer behind a validated host tensor, widened to f32 (index it with the Problem).
fn widen(t: &Tensor) -> Result<Vec<f32>> {
    let s = t.cpu_storage().ok_or_else(|| Error::DeviceMismatch {
        arg: "q",
        expected: "cpu".into(),
        got: t.device().to_string(),
    })?;
    Ok((0..s.len()).map(|i| s.get_f32(i)).collect())
}

fn seq_inputs(p: &Problem, b: usize, q: &[f32], k: &[f32], v: &[f32]) -> SeqInputs {
    let (nq, nk) = (p.seqs[b].nq, p.seqs[b].nk);
    SeqInputs {
        q: (0..p.heads_q)
            .map(|h| gather_rows(q, |i| p.q_at(b, i, h), nq, p.head_dim))
            .collect(),
        k: (0..p.heads_kv)
            .map(|hk| gather_rows(k, |j| p.k_at(b, j, hk), nk, p.head_dim))
            .collect(),
        v: (0..p.heads_kv)
            .map(|hk| gather_rows(v, |j| p.v_at(b, j, hk), nk, p.head_dim_v))
            .collect(),
    }
}

/// Splits one `[batch, heads, nq, nk]` buffer into the matrices of each (sequence, head group of
/// `group` heads), in (sequence, group) order.
fn split_scores<'a>(p: &Problem, buf: &'a mut [f32], group: usize) -> Vec<&'a mut [f32]> {
    let mut rest = buf;
    let mut parts = Vec::with_capacity(p.batch * p.heads_q / group);
    for s in &p.seqs {
        for _ in 0..p.heads_q / group {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(group * s.nq * s.nk);
            parts.push(head);
            rest = tail;
        }
    }
    parts
}

/// The scores of (sequence `b`, head `h`) after every step but the softmax, rounded to `T` after
/// each step, into `s` (`nq × nk`); masked entries are −∞. With a softcap, `dcap` receives
/// `d cap·tanh(x/cap) / dx` per entry.
fn scores<T: Element>(
    p: &Problem,
    bias: Option<&[f32]>,
    b: usize,
    h: usize,
    x: &SeqInputs,
    s: &mut [f32],
    mut dcap: Option<&mut [f32]>,
) {
    let (nq, nk, d) = (p.seqs[b].nq, p.seqs[b].nk, p.head_dim);
    MatMul {
        m: nq,
        n: nk,
        k: d,
        lhs_strides: (d, 1),
        rhs_strides: (1, d),
        alpha: p.scale,
        accumulate: false,
    }
    .run(s, &x.q[h], &x.k[p.kv_head(h)]);
    let mask = p.mask(b);
    let slope = p.slope(b, h);
    let diag = nk as i64 - nq as i64;
    for i in 0..nq {
        let row = &mut s[i * nk..(i + 1) * nk];
        if T::DTYPE != DType::F32 {
            row.iter_mut().for_each(|x| *x = round::<T>(*x));
        }
        if let Some(cap) = p.softcap {
            for (j, x) in row.iter_mut().enumerate() {
                let t = (*x / cap).tanh();
                *x = round::<T>(cap * t);
                if let Some(dc) = dcap.as_deref_mut() {
                    dc[i * nk + j] = 1.0 - t * t;
                }
            }
        }
        let bias_row = p
            .bias
            .as_ref()
            .zip(bias)
            .map(|((_, l), data)| (data, p.bias_row_at(l, b, h, i), l.strides[3]));
        if slope != 0.0 || bias_row.is_some() {
            for (j, x) in row.iter_mut().enumerate() {
                let alibi = slope * (j as i64 - (i as i64 + diag)).abs() as f32;
                let add = bias_row.map_or(0.0, |(data, r, sj)| data[r + j * sj]);
                *x = round::<T>(*x - alibi + add);
            }
        }
        let keys = mask.key_range(i);
        row[..keys.start].fill(f32::NEG_INFINITY);
        row[keys.end.max(keys.start)..].fill(f32::NEG_INFINITY);
    }
}

/// Softmax of each `nk`-long row of `s` in place (f32, rounded to `T`); returns each row's
/// log-sum-exp (−∞, with a zero row, where every key is masked).
fn softmax<T: Element>(s: &mut [f32], nq: usize, nk: usize) -> Vec<f32> {
    if nk == 0 {
        return vec![f32::NEG_INFINITY; nq];
    }
    s.chunks_mut(nk)
        .map(|row| {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                row.fill(0.0);
                return f32::NEG_INFINITY;
            }
            // exp(x − m) = 2^((x − m)·log2 e): subtracting first keeps the argument exact
            // near the maximum; −∞ (masked) becomes 0.
            row.iter_mut()
                .for_each(|x| *x = (*x - m) * std::f32::consts::LOG2_E);
            let sum = crate::cpu::exp2_shifted_sum(row, 0.0);
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x = round::<T>(*x * inv));
            m + sum.ln()
        })
        .collect()
}

/// The bias' f32 buffer when the problem has one.
fn bias_data(p: &Problem) -> Result<Option<Vec<f32>>> {
    p.bias.as_ref().map(|(t, _)| widen(t)).transpose()
}

/// A tensor over `data` (row-major in the memory order of `like`'s strides for `shape`).
fn tensor_like<T: Element>(data: Vec<f32>, like: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let strides = strides_like(like, shape);
    Tensor::from_vec_strided(
        data.into_iter().map(T::from_f32).collect::<Vec<T>>(),
        shape,
        &strides,
        0,
    )
}

/// Where rows of a `[batch, seqlen, heads, dim]` (or packed) buffer shaped `shape` in the memory
/// order of `like` sit (see [`strides_like`]).
fn layout_like(like: &Tensor, shape: &[usize]) -> RowLayout {
    let s = strides_like(like, shape);
    let r = shape.len();
    RowLayout {
        offset: 0,
        batch: if r == 4 { s[0] } else { 0 },
        row: s[r - 3],
        head: s[r - 2],
    }
}

struct HeadForward {
    out: Vec<f32>,
    lse: Vec<f32>,
}

fn forward_typed<T: Element>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    let (qd, kd, vd) = (widen(q)?, widen(k)?, widen(v)?);
    let bias = bias_data(p)?;
    let mut scores_buf = score_matrix(p)?;
    let tasks: Vec<(usize, usize, &mut [f32])> = (0..p.batch)
        .flat_map(|b| (0..p.heads_q).map(move |h| (b, h)))
        .zip(split_scores(p, &mut scores_buf, 1))
        .map(|((b, h), s)| (b, h, s))
        .collect();
    let inputs: Vec<SeqInputs> = (0..p.batch)
        .into_par_iter()
        .map(|b| seq_inputs(p, b, &qd, &kd, &vd))
        .collect();
    let heads: Vec<HeadForward> = tasks
        .into_par_iter()
        .map(|(b, h, s)| {
            let (nq, nk, dv) = (p.seqs[b].nq, p.seqs[b].nk, p.head_dim_v);
            let x = &inputs[b];
            scores::<T>(p, bias.as_deref(), b, h, x, s, None);
            let lse = softmax::<T>(s, nq, nk);
            let mut out = vec![0f32; nq * dv];
            MatMul {
                m: nq,
                n: dv,
                k: nk,
                lhs_strides: (nk, 1),
                rhs_strides: (dv, 1),
                alpha: 1.0,
                accumulate: false,
            }
            .run(&mut out, s, &x.v[p.kv_head(h)]);
            HeadForward { out, lse }
        })
        .collect();

    let out_shape = Problem::shape_like(q, p.head_dim_v);
    let out_layout = layout_like(q, &out_shape);
    let mut out = vec![0f32; out_shape.iter().product()];
    let mut lse = vec![f32::NEG_INFINITY; p.lse_shape().iter().product()];
    let dv = p.head_dim_v;
    for (t, r) in heads.iter().enumerate() {
        let (b, h) = (t / p.heads_q, t % p.heads_q);
        for i in 0..p.seqs[b].nq {
            let o = p.query_at(&out_layout, b, i, h);
            out[o..o + dv].copy_from_slice(&r.out[i * dv..(i + 1) * dv]);
            lse[p.lse_at(b, h, i)] = r.lse[i];
        }
    }
    let lse_shape = p.lse_shape();
    Ok(ForwardOutput {
        out: tensor_like::<T>(out, q, &out_shape)?,
        lse: Tensor::from_vec_strided(lse, &lse_shape, &contiguous_strides(&lse_shape), 0)?,
    })
}

/// The gradients of one (sequence, key/value head): `dq` per query head of its group.
struct GroupGradients {
    dq: Vec<Vec<f32>>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn backward_typed<T: Element>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
) -> Result<Gradients> {
    let (qd, kd, vd, dod) = (widen(q)?, widen(k)?, widen(v)?, widen(dout)?);
    let bias = bias_data(p)?;
    let dout_layout = crate::problem::row_layout(dout);
    let g = p.group();
    let (d, dvd) = (p.head_dim, p.head_dim_v);
    let mut p_buf = score_matrix(p)?;
    let mut ds_buf = score_matrix(p)?;
    let inputs: Vec<(SeqInputs, Vec<Vec<f32>>)> = (0..p.batch)
        .into_par_iter()
        .map(|b| {
            let nq = p.seqs[b].nq;
            let go = (0..p.heads_q)
                .map(|h| gather_rows(&dod, |i| p.query_at(&dout_layout, b, i, h), nq, dvd))
                .collect();
            (seq_inputs(p, b, &qd, &kd, &vd), go)
        })
        .collect();
    let tasks: Vec<_> = (0..p.batch)
        .flat_map(|b| (0..p.heads_kv).map(move |hk| (b, hk)))
        .zip(split_scores(p, &mut p_buf, g))
        .zip(split_scores(p, &mut ds_buf, g))
        .collect();
    let groups: Vec<GroupGradients> = tasks
        .into_par_iter()
        .map(|(((b, hk), pm), dsm)| {
            let (nq, nk) = (p.seqs[b].nq, p.seqs[b].nk);
            let (x, go) = (&inputs[b].0, &inputs[b].1);
            let mut r = GroupGradients {
                dq: Vec::with_capacity(g),
                dk: vec![0f32; nk * d],
                dv: vec![0f32; nk * dvd],
            };
            let mut dcap = p.softcap.map(|_| vec![0f32; nq * nk]);
            for (gi, h) in (hk * g..(hk + 1) * g).enumerate() {
                let pm = &mut pm[gi * nq * nk..(gi + 1) * nq * nk];
                let ds = &mut dsm[gi * nq * nk..(gi + 1) * nq * nk];
                scores::<T>(p, bias.as_deref(), b, h, x, pm, dcap.as_deref_mut());
                softmax::<T>(pm, nq, nk);
                // dV += Pᵀ·dO
                MatMul {
                    m: nk,
                    n: dvd,
                    k: nq,
                    lhs_strides: (1, nk),
                    rhs_strides: (dvd, 1),
                    alpha: 1.0,
                    accumulate: true,
                }
                .run(&mut r.dv, pm, &go[h]);
                // dP = dO·Vᵀ, then dS = P∘(dP − rowsum(P∘dP)), both rounded to T.
                MatMul {
                    m: nq,
                    n: nk,
                    k: dvd,
                    lhs_strides: (dvd, 1),
                    rhs_strides: (1, dvd),
                    alpha: 1.0,
                    accumulate: false,
                }
                .run(ds, &go[h], &x.v[hk]);
                for (pr, dr) in pm.chunks(nk.max(1)).zip(ds.chunks_mut(nk.max(1))) {
                    dr.iter_mut().for_each(|x| *x = round::<T>(*x));
                    let dot: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    pr.iter()
                        .zip(dr.iter_mut())
                        .for_each(|(pij, x)| *x = round::<T>(pij * (*x - dot)));
                }
                // Through the softcap: dS_raw = dS · (1 − tanh²), rounded to T.
                let ds_raw: &[f32] = match dcap.as_deref_mut() {
                    Some(dc) => {
                        dc.iter_mut()
                            .zip(ds.iter())
                            .for_each(|(c, s)| *c = round::<T>(s * *c));
                        dc
                    }
                    None => ds,
                };
                // dQ = dS_raw·K·scale, dK += dS_rawᵀ·Q·scale
                let mut dq = vec![0f32; nq * d];
                MatMul {
                    m: nq,
                    n: d,
                    k: nk,
                    lhs_strides: (nk, 1),
                    rhs_strides: (d, 1),
                    alpha: p.scale,
                    accumulate: false,
                }
                .run(&mut dq, ds_raw, &x.k[hk]);
                r.dq.push(dq);
                MatMul {
                    m: nk,
                    n: d,
                    k: nq,
                    lhs_strides: (1, nk),
                    rhs_strides: (d, 1),
                    alpha: p.scale,
                    accumulate: true,
                }
                .run(&mut r.dk, ds_raw, &x.q[h]);
            }
            r
        })
        .collect();

    let dbias = p
        .bias
        .as_ref()
        .map(|(t, _)| bias_gradient(p, t.shape(), &ds_buf))
        .transpose()?;
    let (dq_l, dk_l, dv_l) = (
        layout_like(q, q.shape()),
        layout_like(k, k.shape()),
        layout_like(v, v.shape()),
    );
    let mut dq = vec![0f32; q.numel()];
    let mut dk = vec![0f32; k.numel()];
    let mut dv = vec![0f32; v.numel()];
    for (t, r) in groups.iter().enumerate() {
        let (b, hk) = (t / p.heads_kv, t % p.heads_kv);
        for (gi, gq) in r.dq.iter().enumerate() {
            for i in 0..p.seqs[b].nq {
                let o = p.query_at(&dq_l, b, i, hk * g + gi);
                dq[o..o + d].copy_from_slice(&gq[i * d..(i + 1) * d]);
            }
        }
        for j in 0..p.seqs[b].nk {
            let o = p.key_at(&dk_l, b, j, hk);
            dk[o..o + d].copy_from_slice(&r.dk[j * d..(j + 1) * d]);
            let o = p.key_at(&dv_l, b, j, hk);
            dv[o..o + dvd].copy_from_slice(&r.dv[j * dvd..(j + 1) * dvd]);
        }
    }
    Ok(Gradients {
        dq: tensor_like::<T>(dq, q, q.shape())?,
        dk: tensor_like::<T>(dk, k, k.shape())?,
        dv: tensor_like::<T>(dv, v, v.shape())?,
        dbias,
    })
}

/// The bias gradient (f32, contiguous, in the bias' shape): `dS` summed over the bias' broadcast
/// dimensions.
fn bias_gradient(p: &Problem, shape: &[usize], ds: &[f32]) -> Result<Tensor> {
    let cs = contiguous_strides(shape);
    let st: Vec<usize> = (0..4)
        .map(|a| if shape[a] == 1 { 0 } else { cs[a] })
        .collect();
    let mut db = vec![0f32; shape.iter().product()];
    let mut at = 0;
    for (b, s) in p.seqs.iter().enumerate() {
        for h in 0..p.heads_q {
            for i in 0..s.nq {
                for j in 0..s.nk {
                    db[b * st[0] + h * st[1] + i * st[2] + j * st[3]] += ds[at];
                    at += 1;
                }
            }
        }
    }
    Tensor::from_vec_strided(db, shape, &cs, 0)
}
