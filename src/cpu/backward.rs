//! CPU backward: one task per (sequence, key/value head), recomputing probabilities from the LSE.

use std::sync::Mutex;

use rayon::prelude::*;

use super::SharedOut;
use crate::problem::{Problem, RowLayout};
use crate::tensor::CpuElement;

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub bias: Option<&'a [f32]>,
    pub out: &'a [T],
    pub lse: &'a [f32],
    pub dout: &'a [T],
}

pub(crate) struct Layouts {
    pub out: RowLayout,
    pub dout: RowLayout,
    pub dq: RowLayout,
    pub dk: RowLayout,
    pub dv: RowLayout,
}

pub(crate) struct Outputs<'a, T> {
    pub dq: &'a mut [T],
    pub dk: &'a mut [T],
    pub dv: &'a mut [T],
    pub dbias: Option<&'a mut [f32]>,
}

fn f32s<T: CpuElement>(x: &[T], at: usize, n: usize) -> Vec<f32> {
    x[at..at + n].iter().map(|v| v.to_f32()).collect()
}

pub(crate) fn run<T: CpuElement>(p: &Problem, x: Inputs<'_, T>, l: &Layouts, o: Outputs<'_, T>) {
    let dq = SharedOut::new(o.dq, l.dq);
    let dk = SharedOut::new(o.dk, l.dk);
    let dv = SharedOut::new(o.dv, l.dv);
    let bias_shape_strides = p.bias.as_ref().map(|(t, _)| {
        let s = t.shape();
        let pick = |n: usize, st: usize| if n == 1 { 0 } else { st };
        [
            pick(s[0], s[1] * s[2] * s[3]),
            pick(s[1], s[2] * s[3]),
            pick(s[2], s[3]),
            pick(s[3], 1),
        ]
    });
    let dbias = o.dbias.map(Mutex::new);
    let tasks: Vec<(usize, usize)> = (0..p.batch)
        .flat_map(|b| (0..p.heads_kv).map(move |hk| (b, hk)))
        .collect();
    tasks.par_iter().for_each(|&(b, hk)| {
        let (d, dvd) = (p.head_dim, p.head_dim_v);
        let (nq, nk) = (p.seqs[b].nq, p.seqs[b].nk);
        let mask = p.mask(b);
        let mut gk = vec![0f32; nk * d];
        let mut gv = vec![0f32; nk * dvd];
        let ks: Vec<Vec<f32>> = (0..nk).map(|j| f32s(x.k, p.k_at(b, j, hk), d)).collect();
        let vs: Vec<Vec<f32>> = (0..nk).map(|j| f32s(x.v, p.v_at(b, j, hk), dvd)).collect();
        for h in hk * p.group()..(hk + 1) * p.group() {
            let slope = p.slope(b, h);
            for i in 0..nq {
                let qi = f32s(x.q, p.q_at(b, i, h), d);
                let go = f32s(x.dout, p.query_at(&l.dout, b, i, h), dvd);
                let oi = f32s(x.out, p.query_at(&l.out, b, i, h), dvd);
                let delta: f32 = go.iter().zip(&oi).map(|(a, b)| a * b).sum();
                let lse = x.lse[p.lse_at(b, h, i)];
                let diag = i as i64 + nk as i64 - nq as i64;
                let mut gq = vec![0f32; d];
                for j in mask.key_range(i) {
                    let raw: f32 = qi.iter().zip(&ks[j]).map(|(a, b)| a * b).sum::<f32>() * p.scale;
                    let (mut s, mut dcap) = (raw, 1.0);
                    if let Some(cap) = p.softcap {
                        let t = (raw / cap).tanh();
                        s = cap * t;
                        dcap = 1.0 - t * t;
                    }
                    s -= slope * (j as i64 - diag).abs() as f32;
                    if let (Some(bias), Some((_, bl))) = (x.bias, p.bias.as_ref()) {
                        s += bias[p.bias_row_at(bl, b, h, i) + j * bl.strides[3]];
                    }
                    let pij = (s - lse).exp();
                    let dp: f32 = go.iter().zip(&vs[j]).map(|(a, b)| a * b).sum();
                    let ds = pij * (dp - delta);
                    if let (Some(db), Some(st)) = (&dbias, bias_shape_strides) {
                        db.lock().expect("dbias lock")
                            [b * st[0] + h * st[1] + i * st[2] + j * st[3]] += ds;
                    }
                    let ds_raw = ds * dcap * p.scale;
                    gv[j * dvd..][..dvd]
                        .iter_mut()
                        .zip(&go)
                        .for_each(|(g, o)| *g += pij * o);
                    gq.iter_mut()
                        .zip(&ks[j])
                        .for_each(|(g, k)| *g += ds_raw * k);
                    gk[j * d..][..d]
                        .iter_mut()
                        .zip(&qi)
                        .for_each(|(g, q)| *g += ds_raw * q);
                }
                // SAFETY: dq rows of (b, h) for h in this key head's group belong to this task alone.
                unsafe {
                    dq.write_row(
                        p.query_at(&dq.layout, b, i, h),
                        gq.iter().map(|&g| T::from_f32(g)),
                    )
                };
            }
        }
        for j in 0..nk {
            // SAFETY: dk/dv rows of (b, hk) belong to this task alone.
            unsafe {
                dk.write_row(
                    p.key_at(&dk.layout, b, j, hk),
                    gk[j * d..][..d].iter().map(|&g| T::from_f32(g)),
                );
                dv.write_row(
                    p.key_at(&dv.layout, b, j, hk),
                    gv[j * dvd..][..dvd].iter().map(|&g| T::from_f32(g)),
                );
            }
        }
    });
}
