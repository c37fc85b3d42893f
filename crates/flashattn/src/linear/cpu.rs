//! The CPU scans of linear attention, one (batch, kv head) a task: the forward keeps the prefix
//! state (S, z) as it walks the queries; the backward walks them again for dq and then the keys
//! backwards with the suffix state (dS, dz) of the queries that see them, for dk and dv.

use rayon::prelude::*;

use super::{LinearParams, LinearShape};

/// The keys query `i` sees: `0..visible(i)`.
fn visible(s: &LinearShape, causal: bool, i: usize) -> usize {
    if causal {
        (i + 1 + s.nk).saturating_sub(s.nq).min(s.nk)
    } else {
        s.nk
    }
}

/// The running sums `S = Σ φ(k_j)·v_jᵀ` (`d × dv`) and `z = Σ φ(k_j)` over the keys added.
struct State {
    s: Vec<f64>,
    z: Vec<f64>,
    keys: usize,
}

impl State {
    fn new(sh: &LinearShape) -> Self {
        State {
            s: vec![0.0; sh.d * sh.dv],
            z: vec![0.0; sh.d],
            keys: 0,
        }
    }

    /// Adds the keys up to `end` of (batch `b`, kv head `kh`) of `(k, v)`.
    fn advance(
        &mut self,
        sh: &LinearShape,
        p: &LinearParams,
        (k, v): (&[f32], &[f32]),
        (b, kh): (usize, usize),
        end: usize,
    ) {
        while self.keys < end {
            let j = self.keys;
            let kr = &k[((b * sh.nk + j) * sh.hk + kh) * sh.d..][..sh.d];
            let vr = &v[((b * sh.nk + j) * sh.hk + kh) * sh.dv..][..sh.dv];
            for (c, &x) in kr.iter().enumerate() {
                let phi = p.feature_map.apply(f64::from(x)).0;
                self.z[c] += phi;
                for (acc, &y) in self.s[c * sh.dv..][..sh.dv].iter_mut().zip(vr) {
                    *acc += phi * f64::from(y);
                }
            }
            self.keys += 1;
        }
    }

    /// φ(q)ᵀ·S into `num` and φ(q)·z + eps, for the features `phi`.
    fn read(&self, sh: &LinearShape, eps: f64, phi: &[f64], num: &mut [f64]) -> f64 {
        num.fill(0.0);
        let mut den = eps;
        for (c, &f) in phi.iter().enumerate() {
            den += f * self.z[c];
            for (n, &x) in num.iter_mut().zip(&self.s[c * sh.dv..][..sh.dv]) {
                *n += f * x;
            }
        }
        den
    }
}

/// φ and φ' of a query or key row.
fn features(p: &LinearParams, row: &[f32], phi: &mut [f64], dphi: &mut [f64]) {
    for ((x, f), df) in row.iter().zip(phi.iter_mut()).zip(dphi.iter_mut()) {
        (*f, *df) = p.feature_map.apply(f64::from(*x));
    }
}

/// The query heads of kv head `kh`.
fn group(sh: &LinearShape, kh: usize) -> std::ops::Range<usize> {
    let g = sh.h / sh.hk;
    kh * g..(kh + 1) * g
}

/// The output `[b, nq, h, dv]` of contiguous f32 q, k and v.
pub(super) fn forward(
    sh: LinearShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &LinearParams,
) -> Vec<f32> {
    let parts: Vec<(usize, usize, Vec<f32>)> = (0..sh.b * sh.hk)
        .into_par_iter()
        .map(|task| {
            let (b, kh) = (task / sh.hk, task % sh.hk);
            let heads = group(&sh, kh);
            let mut out = vec![0.0f32; sh.nq * heads.len() * sh.dv];
            let (mut state, mut phi, mut dphi, mut num) = (
                State::new(&sh),
                vec![0.0; sh.d],
                vec![0.0; sh.d],
                vec![0.0; sh.dv],
            );
            for i in 0..sh.nq {
                state.advance(&sh, p, (k, v), (b, kh), visible(&sh, p.causal, i));
                for (g, h) in heads.clone().enumerate() {
                    features(
                        p,
                        &q[((b * sh.nq + i) * sh.h + h) * sh.d..][..sh.d],
                        &mut phi,
                        &mut dphi,
                    );
                    let den = state.read(&sh, p.eps, &phi, &mut num);
                    for (o, n) in out[(i * heads.len() + g) * sh.dv..][..sh.dv]
                        .iter_mut()
                        .zip(&num)
                    {
                        *o = (n / den) as f32;
                    }
                }
            }
            (b, kh, out)
        })
        .collect();
    let mut out = vec![0.0f32; sh.b * sh.nq * sh.h * sh.dv];
    for (b, kh, part) in parts {
        place(
            &mut out,
            &part,
            (b, sh.nq, sh.h),
            group(&sh, kh).start,
            sh.dv,
        );
    }
    out
}

/// Copies a task's rows `part` (`rows` of them, consecutive heads of `width` each) into `dst`
/// `[batch, rows, heads, width]` of batch `b`, from head `head0` on.
fn place(
    dst: &mut [f32],
    part: &[f32],
    (b, rows, heads): (usize, usize, usize),
    head0: usize,
    width: usize,
) {
    if rows == 0 {
        return;
    }
    let len = part.len() / rows;
    for (i, src) in part.chunks_exact(len).enumerate() {
        dst[((b * rows + i) * heads + head0) * width..][..len].copy_from_slice(src);
    }
}

/// dq `[b, nq, h, d]`, dk `[b, nk, hk, d]` and dv `[b, nk, hk, dv]`.
pub(super) fn backward(
    sh: LinearShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    p: &LinearParams,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let parts: Vec<_> = (0..sh.b * sh.hk)
        .into_par_iter()
        .map(|task| backward_task(&sh, q, k, v, dout, p, task))
        .collect();
    let mut dq = vec![0.0f32; sh.b * sh.nq * sh.h * sh.d];
    let mut dk = vec![0.0f32; sh.b * sh.nk * sh.hk * sh.d];
    let mut dv = vec![0.0f32; sh.b * sh.nk * sh.hk * sh.dv];
    for (task, (pq, pk, pv)) in parts.into_iter().enumerate() {
        let (b, kh) = (task / sh.hk, task % sh.hk);
        place(&mut dq, &pq, (b, sh.nq, sh.h), group(&sh, kh).start, sh.d);
        place(&mut dk, &pk, (b, sh.nk, sh.hk), kh, sh.d);
        place(&mut dv, &pv, (b, sh.nk, sh.hk), kh, sh.dv);
    }
    (dq, dk, dv)
}

/// One (batch, kv head): its query heads' dq and its dk, dv. With `g_i = dout_i / den_i` and
/// `c_i = −g_i·out_i`: `dφ(q_i) = S_i·g_i + c_i·z_i`, and over the queries that see key j,
/// `dS_j = Σ φ(q_i)·g_iᵀ`, `dz_j = Σ c_i·φ(q_i)`, `dφ(k_j) = dS_j·v_j + dz_j`, `dv_j = dS_jᵀ·φ(k_j)`.
fn backward_task(
    sh: &LinearShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    p: &LinearParams,
    task: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (b, kh) = (task / sh.hk, task % sh.hk);
    let heads = group(sh, kh);
    let rows = sh.nq * heads.len();
    // Per query row (i, head): φ(q), g and c, kept for the key walk.
    let (mut phis, mut gs, mut cs) = (
        vec![0.0f64; rows * sh.d],
        vec![0.0f64; rows * sh.dv],
        vec![0.0f64; rows],
    );
    let mut dq = vec![0.0f32; rows * sh.d];
    let (mut state, mut dphi, mut num) = (State::new(sh), vec![0.0; sh.d], vec![0.0; sh.dv]);
    for i in 0..sh.nq {
        state.advance(sh, p, (k, v), (b, kh), visible(sh, p.causal, i));
        for (g, h) in heads.clone().enumerate() {
            let r = i * heads.len() + g;
            let phi = &mut phis[r * sh.d..][..sh.d];
            features(
                p,
                &q[((b * sh.nq + i) * sh.h + h) * sh.d..][..sh.d],
                phi,
                &mut dphi,
            );
            let den = state.read(sh, p.eps, phi, &mut num);
            let gr = &mut gs[r * sh.dv..][..sh.dv];
            let mut c = 0.0;
            for ((gv, &n), &d) in gr
                .iter_mut()
                .zip(&num)
                .zip(&dout[((b * sh.nq + i) * sh.h + h) * sh.dv..][..sh.dv])
            {
                *gv = f64::from(d) / den;
                c -= *gv * n / den;
            }
            cs[r] = c;
            for (ch, out) in dq[r * sh.d..][..sh.d].iter_mut().enumerate() {
                let sg: f64 = state.s[ch * sh.dv..][..sh.dv]
                    .iter()
                    .zip(gr.iter())
                    .map(|(s, g)| s * g)
                    .sum();
                *out = ((sg + c * state.z[ch]) * dphi[ch]) as f32;
            }
        }
    }
    let (mut ds, mut dz) = (vec![0.0f64; sh.d * sh.dv], vec![0.0f64; sh.d]);
    let (mut dk, mut dv) = (vec![0.0f32; sh.nk * sh.d], vec![0.0f32; sh.nk * sh.dv]);
    let (mut phik, mut dphik) = (vec![0.0; sh.d], vec![0.0; sh.d]);
    // Queries [first, nq) are in (dS, dz); a key is seen by the queries whose `visible` exceeds it.
    let mut first = sh.nq;
    for j in (0..sh.nk).rev() {
        while first > 0 && visible(sh, p.causal, first - 1) > j {
            first -= 1;
            for g in 0..heads.len() {
                let r = first * heads.len() + g;
                for (ch, &f) in phis[r * sh.d..][..sh.d].iter().enumerate() {
                    dz[ch] += cs[r] * f;
                    for (acc, &gv) in ds[ch * sh.dv..][..sh.dv]
                        .iter_mut()
                        .zip(&gs[r * sh.dv..][..sh.dv])
                    {
                        *acc += f * gv;
                    }
                }
            }
        }
        features(
            p,
            &k[((b * sh.nk + j) * sh.hk + kh) * sh.d..][..sh.d],
            &mut phik,
            &mut dphik,
        );
        let vr = &v[((b * sh.nk + j) * sh.hk + kh) * sh.dv..][..sh.dv];
        for ch in 0..sh.d {
            let row = &ds[ch * sh.dv..][..sh.dv];
            let dsv: f64 = row.iter().zip(vr).map(|(s, &x)| s * f64::from(x)).sum();
            dk[j * sh.d + ch] = ((dsv + dz[ch]) * dphik[ch]) as f32;
        }
        for (e, out) in dv[j * sh.dv..][..sh.dv].iter_mut().enumerate() {
            *out = (0..sh.d)
                .map(|ch| ds[ch * sh.dv + e] * phik[ch])
                .sum::<f64>() as f32;
        }
    }
    (dq, dk, dv)
}
