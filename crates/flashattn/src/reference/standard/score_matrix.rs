//! The materialized matrices of the standard attention and the steps that fill them: the
//! per-sequence f32 copies of the inputs, the `[batch, heads, nq, nk]` buffers, the score steps
//! (rounded to the input dtype after each), the softmax, and the matrix products (`gemm`).

use rayon::prelude::*;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::problem::{Problem, RowLayout, strides_like};
use crate::tensor::Tensor;

use super::score_elements;

/// A zeroed `[batch, heads, nq, nk]` f32 matrix, or an error when it cannot be allocated.
pub(super) fn score_matrix(p: &Problem) -> Result<Vec<f32>> {
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

/// `x` rounded to `T` and widened back.
#[inline(always)]
pub(super) fn round<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

/// `dst[m×n] = alpha · lhs·rhs` (row-major `dst`), or `dst += alpha · lhs·rhs` when `accumulate`.
/// `lhs` is `m×k` and `rhs` is `k×n`, each given by its (row, column) strides.
pub(super) struct MatMul {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) lhs_strides: (usize, usize),
    pub(super) rhs_strides: (usize, usize),
    pub(super) alpha: f32,
    pub(super) accumulate: bool,
}

impl MatMul {
    pub(super) fn run(&self, dst: &mut [f32], lhs: &[f32], rhs: &[f32]) {
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
        // Inside a rayon task the tasks already use every thread; called from outside a pool
        // (fewer tasks than threads, see `map_tasks`) the product itself is parallel.
        let parallelism = match rayon::current_thread_index() {
            Some(_) => gemm::Parallelism::None,
            None => gemm::Parallelism::Rayon(0),
        };
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
                parallelism,
            )
        }
    }
}

/// Maps `f` over `tasks`: in parallel when there are at least as many tasks as threads, else
/// one after the other on this thread, so that each matrix product uses every thread instead.
pub(super) fn map_tasks<I: Send, R: Send>(
    tasks: Vec<I>,
    f: impl Fn(I) -> R + Sync + Send,
) -> Vec<R> {
    if tasks.len() >= rayon::current_num_threads() {
        tasks.into_par_iter().map(f).collect()
    } else {
        tasks.into_iter().map(f).collect()
    }
}

/// The inputs of one sequence in f32, per head: `q[h]` is `nq × d`, `k[hk]` and `v[hk]` are
/// `nk × d` and `nk × dv`, row-major.
pub(super) struct SeqInputs {
    pub(super) q: Vec<Vec<f32>>,
    pub(super) k: Vec<Vec<f32>>,
    pub(super) v: Vec<Vec<f32>>,
}

pub(super) fn gather_rows(
    t: &[f32],
    at: impl Fn(usize) -> usize,
    rows: usize,
    dim: usize,
) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| &t[at(r)..at(r) + dim])
        .copied()
        .collect()
}

/// The whole buffer behind a validated host tensor, widened to f32 (index it with the Problem).
pub(super) fn widen(t: &Tensor) -> Result<Vec<f32>> {
    let s = t.cpu_storage().ok_or_else(|| Error::DeviceMismatch {
        arg: "q",
        expected: "cpu".into(),
        got: t.device().to_string(),
    })?;
    Ok((0..s.len()).map(|i| s.get_f32(i)).collect())
}

pub(super) fn seq_inputs(p: &Problem, b: usize, q: &[f32], k: &[f32], v: &[f32]) -> SeqInputs {
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
pub(super) fn split_scores<'a>(
    p: &Problem,
    buf: &'a mut [f32],
    group: usize,
) -> Vec<&'a mut [f32]> {
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
pub(super) fn scores<T: Element>(
    p: &Problem,
    biases: &Biases,
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
    let diag = p.seqs[b].diag;
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
            .zip(biases.bias.as_deref())
            .map(|((_, l), data)| (data, p.bias_row_at(l, b, h, i), l.strides[3]));
        let rel_row = p
            .rel_bias
            .as_ref()
            .zip(biases.rel.as_deref())
            .map(|(r, t)| {
                let w = r.width();
                (r, &t[r.row_at(h)..r.row_at(h) + w])
            });
        if slope != 0.0 || bias_row.is_some() || rel_row.is_some() {
            for (j, x) in row.iter_mut().enumerate() {
                let rel = j as i64 - (i as i64 + diag);
                let alibi = slope * rel.abs() as f32;
                let add = bias_row.map_or(0.0, |(data, r, sj)| data[r + j * sj]);
                let add_rel = rel_row.map_or(0.0, |(r, t)| t[r.column(rel)]);
                *x = round::<T>(*x - alibi + add + add_rel);
            }
        }
        let keys = mask.key_range(i);
        row[..keys.start].fill(f32::NEG_INFINITY);
        row[keys.end.max(keys.start)..].fill(f32::NEG_INFINITY);
    }
}

/// Softmax of each `nk`-long row of `s` in place (f32, rounded to `T`); returns each row's
/// log-sum-exp (−∞, with a zero row, where every key is masked).
pub(super) fn softmax<T: Element>(s: &mut [f32], nq: usize, nk: usize) -> Vec<f32> {
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

/// The f32 elements of the problem's biases, in logical order.
pub(super) struct Biases {
    pub bias: Option<Vec<f32>>,
    /// The relative-position table, `[heads, 2L − 1]`.
    pub rel: Option<Vec<f32>>,
}

/// The biases of `p` widened to f32 (those it has).
pub(super) fn bias_data(p: &Problem) -> Result<Biases> {
    Ok(Biases {
        bias: p.bias.as_ref().map(|(t, _)| widen(t)).transpose()?,
        rel: p.rel_bias.as_ref().map(|r| widen(&r.table)).transpose()?,
    })
}

/// A tensor over `data` (row-major in the memory order of `like`'s strides for `shape`).
pub(super) fn tensor_like<T: Element>(
    data: Vec<f32>,
    like: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
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
pub(super) fn layout_like(like: &Tensor, shape: &[usize]) -> RowLayout {
    let s = strides_like(like, shape);
    let r = shape.len();
    RowLayout {
        offset: 0,
        batch: if r == 4 { s[0] } else { 0 },
        row: s[r - 3],
        head: s[r - 2],
    }
}
