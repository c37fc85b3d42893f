//! The standard attention backward: materializes `P` and `dS` of every (sequence, head) and
//! applies the textbook formulas, with the products through `gemm`.

use rayon::prelude::*;

use crate::dtype::Element;
use crate::error::Result;
use crate::outputs::Gradients;
use crate::problem::{Problem, RelBias};
use crate::tensor::{Tensor, contiguous_strides};

use super::score_matrix::{
    MatMul, SeqInputs, bias_data, gather_rows, layout_like, map_tasks, round, score_matrix, scores,
    seq_inputs, softmax, split_scores, tensor_like, widen,
};

/// The gradients of one (sequence, key/value head): `dq` per query head of its group.
struct GroupGradients {
    dq: Vec<Vec<f32>>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

pub(super) fn backward_typed<T: Element>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
) -> Result<Gradients> {
    let (qd, kd, vd, dod) = (widen(q)?, widen(k)?, widen(v)?, widen(dout)?);
    let biases = bias_data(p)?;
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
    let groups: Vec<GroupGradients> = map_tasks(tasks, |(((b, hk), pm), dsm)| {
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
            scores::<T>(p, &biases, b, h, x, pm, dcap.as_deref_mut());
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
    });

    let dbias = p
        .bias
        .as_ref()
        .map(|(t, _)| bias_gradient(p, t.shape(), &ds_buf))
        .transpose()?;
    let drel_bias = p
        .rel_bias
        .as_ref()
        .map(|r| rel_bias_gradient(p, r, &ds_buf))
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
        drel_bias,
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

/// The relative-position table's gradient (f32, `[heads, 2L − 1]`): `dS` summed over the pairs
/// that read each entry.
fn rel_bias_gradient(p: &Problem, rel: &RelBias, ds: &[f32]) -> Result<Tensor> {
    let w = rel.width();
    let mut dr = vec![0f32; p.heads_q * w];
    let mut at = 0;
    for s in &p.seqs {
        let diag = s.diag;
        for h in 0..p.heads_q {
            for i in 0..s.nq {
                for j in 0..s.nk {
                    dr[h * w + rel.column(j as i64 - (i as i64 + diag))] += ds[at];
                    at += 1;
                }
            }
        }
    }
    Tensor::from_vec(dr, &[p.heads_q, w])
}
