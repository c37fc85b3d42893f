//! The f64 oracle of linear attention, straight from its definition as a weighted average:
//! `out_i = Σ_j a_ij·v_j / (Σ_j a_ij + eps)` with `a_ij = φ(q_i)·φ(k_j)` over the keys query i
//! sees, O(N²); its gradients by the chain rule through `a`. Inputs and outputs are contiguous
//! f64 in the layouts of [`crate::linear_forward`].

use crate::linear::{LinearParams, LinearShape};

/// The sizes of an oracle call: `[batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v]`.
pub type LinearDims = [usize; 7];

fn shape([b, nq, nk, h, hk, d, dv]: LinearDims) -> LinearShape {
    LinearShape {
        b,
        nq,
        nk,
        h,
        hk,
        d,
        dv,
    }
}

/// Whether query i sees key j.
fn sees(s: &LinearShape, causal: bool, i: usize, j: usize) -> bool {
    !causal || j + s.nq <= i + s.nk
}

/// One (batch, query head): the weights `a` `[nq, nk]` (0 where unseen) and φ'(q), φ(k), φ'(k).
struct Head {
    a: Vec<f64>,
    phiq: Vec<f64>,
    dphiq: Vec<f64>,
    phik: Vec<f64>,
    dphik: Vec<f64>,
}

fn head(s: &LinearShape, p: &LinearParams, q: &[f64], k: &[f64], b: usize, h: usize) -> Head {
    let kh = h / (s.h / s.hk);
    let map = |x: f64| p.feature_map.apply(x);
    let qrow = |i: usize| &q[((b * s.nq + i) * s.h + h) * s.d..][..s.d];
    let krow = |j: usize| &k[((b * s.nk + j) * s.hk + kh) * s.d..][..s.d];
    let (phiq, dphiq): (Vec<f64>, Vec<f64>) = (0..s.nq)
        .flat_map(|i| qrow(i).iter().map(|&x| map(x)))
        .unzip();
    let (phik, dphik): (Vec<f64>, Vec<f64>) = (0..s.nk)
        .flat_map(|j| krow(j).iter().map(|&x| map(x)))
        .unzip();
    let mut a = vec![0.0; s.nq * s.nk];
    for i in 0..s.nq {
        for j in (0..s.nk).filter(|&j| sees(s, p.causal, i, j)) {
            a[i * s.nk + j] = (0..s.d)
                .map(|c| phiq[i * s.d + c] * phik[j * s.d + c])
                .sum();
        }
    }
    Head {
        a,
        phiq,
        dphiq,
        phik,
        dphik,
    }
}

/// The output `[b, nq, h, dv]`.
pub fn linear_forward(
    dims: LinearDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    p: &LinearParams,
) -> Vec<f64> {
    let s = shape(dims);
    let mut out = vec![0.0; s.b * s.nq * s.h * s.dv];
    for b in 0..s.b {
        for h in 0..s.h {
            let kh = h / (s.h / s.hk);
            let w = head(&s, p, q, k, b, h);
            for i in 0..s.nq {
                let den = p.eps + (0..s.nk).map(|j| w.a[i * s.nk + j]).sum::<f64>();
                for e in 0..s.dv {
                    let num: f64 = (0..s.nk)
                        .map(|j| w.a[i * s.nk + j] * v[((b * s.nk + j) * s.hk + kh) * s.dv + e])
                        .sum();
                    out[((b * s.nq + i) * s.h + h) * s.dv + e] = num / den;
                }
            }
        }
    }
    out
}

/// dq `[b, nq, h, d]`, dk `[b, nk, hk, d]` and dv `[b, nk, hk, dv]` for the upstream gradient `dout`.
pub fn linear_backward(
    dims: LinearDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    p: &LinearParams,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let s = shape(dims);
    let out = linear_forward(dims, q, k, v, p);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..s.b {
        for h in 0..s.h {
            let kh = h / (s.h / s.hk);
            let w = head(&s, p, q, k, b, h);
            let at = |t: &[f64], i: usize, e: usize| t[((b * s.nq + i) * s.h + h) * s.dv + e];
            for i in 0..s.nq {
                let den = p.eps + (0..s.nk).map(|j| w.a[i * s.nk + j]).sum::<f64>();
                // out_i = num_i / den_i: d num_i = dout_i / den_i, d den_i = −(dout_i·out_i) / den_i.
                let dden = -(0..s.dv)
                    .map(|e| at(dout, i, e) * at(&out, i, e))
                    .sum::<f64>()
                    / den;
                for j in (0..s.nk).filter(|&j| sees(&s, p.causal, i, j)) {
                    let vrow = ((b * s.nk + j) * s.hk + kh) * s.dv;
                    let mut da = dden;
                    for e in 0..s.dv {
                        let dnum = at(dout, i, e) / den;
                        da += dnum * v[vrow + e];
                        dv[vrow + e] += w.a[i * s.nk + j] * dnum;
                    }
                    for c in 0..s.d {
                        dq[((b * s.nq + i) * s.h + h) * s.d + c] +=
                            da * w.phik[j * s.d + c] * w.dphiq[i * s.d + c];
                        dk[((b * s.nk + j) * s.hk + kh) * s.d + c] +=
                            da * w.phiq[i * s.d + c] * w.dphik[j * s.d + c];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
