//! One linear-attention case on a device against the f64 oracle, with the bound of the CPU scans
//! (shared by `tests/linear.rs` and `tests/cuda_linear.rs`): each value within the unit roundoff
//! of its dtype times the largest magnitude of the result.

use super::{Layout, rng, tensor};
use flashattn::reference::linear as oracle;
use flashattn::{DType, Device, FeatureMap, LinearParams, Tensor, linear_backward, linear_forward};
use rand::RngExt;

/// `[batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v]`, causal, feature map.
pub type Case = ([usize; 7], bool, FeatureMap);

/// Awkward sizes, GQA, causal with more or fewer queries than keys, both feature maps.
pub const SMALL: [Case; 8] = [
    ([1, 1, 1, 1, 1, 1, 1], false, FeatureMap::Elu1),
    ([2, 37, 53, 4, 2, 16, 24], false, FeatureMap::Elu1),
    ([2, 37, 53, 4, 2, 16, 24], true, FeatureMap::Elu1),
    ([1, 70, 19, 3, 1, 8, 5], true, FeatureMap::Elu1),
    ([2, 29, 29, 2, 2, 33, 33], true, FeatureMap::Relu),
    ([1, 45, 64, 6, 3, 64, 32], false, FeatureMap::Relu),
    ([3, 9, 130, 2, 1, 7, 11], true, FeatureMap::Relu),
    ([1, 128, 128, 2, 2, 64, 64], true, FeatureMap::Elu1),
];

/// The dtypes and layouts every case runs in (q, k, v strided with `Bhnd`).
pub const FLAVOURS: [(DType, Layout); 3] = [
    (DType::F32, Layout::Bnhd),
    (DType::BF16, Layout::Bhnd),
    (DType::F16, Layout::Bnhd),
];

/// The unit roundoff's multiple a result may be off by: the scans sum in f64 (on a GPU in f32 for
/// f16/bf16, whose rounding is far coarser), so each value is off by its final rounding into
/// `dtype` (half an ulp) and the rounding of the inputs (none: the oracle reads the same rounded
/// inputs).
pub fn tolerance(dtype: DType, want: &[f64]) -> f64 {
    let eps = match dtype {
        DType::F32 => f64::from(f32::EPSILON),
        DType::F16 => f64::from(half::f16::EPSILON),
        _ => f64::from(half::bf16::EPSILON),
    };
    eps * want.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

pub fn max_err(got: &Tensor, want: &[f64]) -> f64 {
    let got = got.to_f64_vec().unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold(0.0, |m, (a, b)| m.max((a - b).abs()))
}

/// Runs `case` in `dtype` and `layout` on `device` (fresh inputs from `seed`, eps drawn in
/// [1e-6, 1e-3)): the output and the three gradients against the oracle; returns the worst
/// error / tolerance and panics past 1.
pub fn check(case: Case, (dtype, layout): (DType, Layout), device: Device, seed: u64) -> f64 {
    let (dims, causal, feature_map) = case;
    let [b, nq, nk, h, hk, d, dv] = dims;
    let mut r = rng(seed);
    let q = tensor(&mut r, &[b, nq, h, d], dtype, layout);
    let k = tensor(&mut r, &[b, nk, hk, d], dtype, layout);
    let v = tensor(&mut r, &[b, nk, hk, dv], dtype, layout);
    let dout = tensor(&mut r, &[b, nq, h, dv], dtype, Layout::Bnhd);
    let p = LinearParams {
        causal,
        feature_map,
        eps: r.random_range(1e-6..1e-3),
    };
    let f = |t: &Tensor| t.to_f64_vec().unwrap();
    let want = oracle::linear_forward(dims, &f(&q), &f(&k), &f(&v), &p);
    let (dq, dk, dv_) = oracle::linear_backward(dims, &f(&q), &f(&k), &f(&v), &f(&dout), &p);
    let up = |t: &Tensor| t.to_device(device).unwrap();
    let (q, k, v, dout) = (up(&q), up(&k), up(&v), up(&dout));
    let out = linear_forward(&q, &k, &v, &p).unwrap();
    let g = linear_backward(&q, &k, &v, &dout, &p).unwrap();
    for (t, shape) in [
        (&out, [b, nq, h, dv]),
        (&g.dq, [b, nq, h, d]),
        (&g.dk, [b, nk, hk, d]),
        (&g.dv, [b, nk, hk, dv]),
    ] {
        assert_eq!(t.shape(), shape);
        assert_eq!(t.dtype(), dtype);
        assert_eq!(t.device(), device);
    }
    let mut worst = 0f64;
    for (name, got, want) in [
        ("out", &out, &want),
        ("dq", &g.dq, &dq),
        ("dk", &g.dk, &dk),
        ("dv", &g.dv, &dv_),
    ] {
        let (err, tol) = (max_err(got, want), tolerance(dtype, want));
        let what = format!("{dims:?} causal={causal} {feature_map:?} {dtype:?} {layout:?} {name}");
        println!("{what}: error {err:.3e} (tolerance {tol:.3e})");
        assert!(err <= tol, "{what}: {err:.3e} > {tol:.3e}");
        if tol > 0.0 {
            worst = worst.max(err / tol);
        }
    }
    worst
}
