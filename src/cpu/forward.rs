//! CPU forward: one task per (sequence, head, query block); online softmax over the visible keys.

use rayon::prelude::*;

use super::SharedOut;
use crate::problem::Problem;
use crate::tensor::CpuElement;

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub bias: Option<&'a [f32]>,
}

const BLOCK_Q: usize = 64;

pub(crate) fn run<T: CpuElement>(
    p: &Problem,
    x: Inputs<'_, T>,
    out: SharedOut<'_, T>,
    lse: &mut [f32],
) {
    let tasks: Vec<(usize, usize, usize)> = (0..p.batch)
        .flat_map(|b| {
            (0..p.heads_q)
                .flat_map(move |h| (0..p.seqs[b].nq.div_ceil(BLOCK_Q)).map(move |t| (b, h, t)))
        })
        .collect();
    let lse_out = SharedOut::new(lse, Default::default());
    tasks.par_iter().for_each(|&(b, h, t)| {
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let hk = p.kv_head(h);
        let mask = p.mask(b);
        let slope = p.slope(b, h);
        let mut acc = vec![0f32; dv];
        let mut qf = vec![0f32; d];
        for i in t * BLOCK_Q..((t + 1) * BLOCK_Q).min(p.seqs[b].nq) {
            let q0 = p.q_at(b, i, h);
            qf.iter_mut()
                .zip(&x.q[q0..q0 + d])
                .for_each(|(f, x)| *f = x.to_f32() * p.scale);
            acc.iter_mut().for_each(|a| *a = 0.0);
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            let diag = i as i64 + p.seqs[b].nk as i64 - p.seqs[b].nq as i64;
            let bias_row = p
                .bias
                .as_ref()
                .map(|(_, bl)| (p.bias_row_at(bl, b, h, i), bl.strides[3]));
            for j in mask.key_range(i) {
                let k0 = p.k_at(b, j, hk);
                let mut s: f32 = qf
                    .iter()
                    .zip(&x.k[k0..k0 + d])
                    .map(|(a, b)| a * b.to_f32())
                    .sum();
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                s -= slope * (j as i64 - diag).abs() as f32;
                if let (Some(bias), Some((r, sj))) = (x.bias, bias_row) {
                    s += bias[r + j * sj];
                }
                let m_new = m.max(s);
                let alpha = (m - m_new).exp();
                let pij = (s - m_new).exp();
                l = l * alpha + pij;
                let v0 = p.v_at(b, j, hk);
                acc.iter_mut()
                    .zip(&x.v[v0..v0 + dv])
                    .for_each(|(a, v)| *a = *a * alpha + pij * v.to_f32());
                m = m_new;
            }
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            let o0 = p.query_at(&out.layout, b, i, h);
            // SAFETY: row (b, i, h) of out and lse belongs to this task alone.
            unsafe {
                out.write_row(o0, acc.iter().map(|a| T::from_f32(a * inv)));
                lse_out.write_row(
                    p.lse_at(b, h, i),
                    std::iter::once(if l > 0.0 {
                        m + l.ln()
                    } else {
                        f32::NEG_INFINITY
                    }),
                );
            }
        }
    });
}
