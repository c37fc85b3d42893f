//! Linear attention on the CPU against its f64 oracle (the definition as a weighted average,
//! O(N²)): outputs and gradients over awkward sizes, GQA, causal with more or fewer queries than
//! keys, both feature maps, every dtype and a strided layout; the oracle's gradients against
//! central finite differences; a typed error naming the argument for every bad input.

mod common;

use common::{Layout, rng, tensor};
use flashattn::reference::linear as oracle;
use flashattn::{DType, Error, FeatureMap, LinearParams, Tensor, linear_backward, linear_forward};
use rand::RngExt;

/// `[batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v]`, causal, feature map.
type Case = ([usize; 7], bool, FeatureMap);

const CASES: [Case; 8] = [
    ([1, 1, 1, 1, 1, 1, 1], false, FeatureMap::Elu1),
    ([2, 37, 53, 4, 2, 16, 24], false, FeatureMap::Elu1),
    ([2, 37, 53, 4, 2, 16, 24], true, FeatureMap::Elu1),
    ([1, 70, 19, 3, 1, 8, 5], true, FeatureMap::Elu1),
    ([2, 29, 29, 2, 2, 33, 33], true, FeatureMap::Relu),
    ([1, 45, 64, 6, 3, 64, 32], false, FeatureMap::Relu),
    ([3, 9, 130, 2, 1, 7, 11], true, FeatureMap::Relu),
    ([1, 128, 128, 2, 2, 64, 64], true, FeatureMap::Elu1),
];

/// The unit roundoff's multiple a result may be off by: the scans sum in f64, so each value is
/// off by its final rounding into `dtype` (half an ulp) and the rounding of the inputs (none: the
/// oracle reads the same rounded inputs).
fn tolerance(dtype: DType, want: &[f64]) -> f64 {
    let eps = match dtype {
        DType::F32 => f64::from(f32::EPSILON),
        DType::F16 => f64::from(half::f16::EPSILON),
        _ => f64::from(half::bf16::EPSILON),
    };
    eps * want.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

fn max_err(got: &Tensor, want: &[f64]) -> f64 {
    let got = got.to_f64_vec().unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold(0.0, |m, (a, b)| m.max((a - b).abs()))
}

#[test]
fn linear_attention_matches_its_oracle() {
    let mut worst = 0f64;
    for (n, &(dims, causal, feature_map)) in CASES.iter().enumerate() {
        let [b, nq, nk, h, hk, d, dv] = dims;
        for (m, (dtype, layout)) in [
            (DType::F32, Layout::Bnhd),
            (DType::BF16, Layout::Bhnd),
            (DType::F16, Layout::Bnhd),
        ]
        .into_iter()
        .enumerate()
        {
            let mut r = rng(9100 + 10 * n as u64 + m as u64);
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
            let out = linear_forward(&q, &k, &v, &p).unwrap();
            assert_eq!(out.shape(), [b, nq, h, dv]);
            assert_eq!(out.dtype(), dtype);
            let (eo, to) = (max_err(&out, &want), tolerance(dtype, &want));
            let (dq, dk, dv_) =
                oracle::linear_backward(dims, &f(&q), &f(&k), &f(&v), &f(&dout), &p);
            let g = linear_backward(&q, &k, &v, &dout, &p).unwrap();
            let checks = [
                ("out", eo, to),
                ("dq", max_err(&g.dq, &dq), tolerance(dtype, &dq)),
                ("dk", max_err(&g.dk, &dk), tolerance(dtype, &dk)),
                ("dv", max_err(&g.dv, &dv_), tolerance(dtype, &dv_)),
            ];
            for (name, err, tol) in checks {
                println!(
                    "{dims:?} causal={causal} {feature_map:?} {dtype:?} {name}: error {err:.3e} (tolerance {tol:.3e})"
                );
                assert!(
                    err <= tol,
                    "{dims:?} causal={causal} {feature_map:?} {dtype:?} {name}: {err:.3e} > {tol:.3e}"
                );
                worst = worst.max(err / tol);
            }
        }
    }
    println!("worst error / tolerance: {worst:.3}");
}

#[test]
fn the_oracle_gradients_match_finite_differences() {
    for (n, (dims, causal, feature_map)) in [
        ([1, 3, 4, 2, 1, 3, 2], true, FeatureMap::Elu1),
        ([2, 4, 3, 2, 2, 2, 3], false, FeatureMap::Relu),
        ([1, 5, 2, 1, 1, 4, 4], true, FeatureMap::Relu),
    ]
    .into_iter()
    .enumerate()
    {
        let [b, nq, nk, h, hk, d, dv] = dims;
        let mut r = rng(9300 + n as u64);
        let mut draw = |len: usize| {
            (0..len)
                .map(|_| r.random_range(-1.5..1.5))
                .collect::<Vec<f64>>()
        };
        let (q, k, v, dout) = (
            draw(b * nq * h * d),
            draw(b * nk * hk * d),
            draw(b * nk * hk * dv),
            draw(b * nq * h * dv),
        );
        let p = LinearParams {
            causal,
            feature_map,
            eps: 1e-3,
        };
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            oracle::linear_forward(dims, q, k, v, &p)
                .iter()
                .zip(&dout)
                .map(|(o, g)| o * g)
                .sum()
        };
        let (dq, dk, dv_) = oracle::linear_backward(dims, &q, &k, &v, &dout, &p);
        let step = 1e-6;
        for (name, which, grad) in [("dq", 0, &dq), ("dk", 1, &dk), ("dv", 2, &dv_)] {
            for idx in 0..grad.len() {
                let mut xs = [q.clone(), k.clone(), v.clone()];
                xs[which][idx] += step;
                let up = loss(&xs[0], &xs[1], &xs[2]);
                xs[which][idx] -= 2.0 * step;
                let down = loss(&xs[0], &xs[1], &xs[2]);
                let numeric = (up - down) / (2.0 * step);
                assert!(
                    (numeric - grad[idx]).abs() <= 1e-6 * (1.0 + numeric.abs()),
                    "{dims:?} {name}[{idx}]: analytic {} vs finite differences {numeric}",
                    grad[idx]
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_argument() {
    let t = |shape: &[usize], dtype: DType| Tensor::full(shape, dtype, 0.5).unwrap();
    let (q, k, v) = (
        t(&[1, 4, 2, 8], DType::F32),
        t(&[1, 5, 1, 8], DType::F32),
        t(&[1, 5, 1, 3], DType::F32),
    );
    let p = LinearParams::default();
    let arg = |e: Error| e.argument();
    assert_eq!(
        arg(linear_forward(&t(&[4, 2, 8], DType::F32), &k, &v, &p).unwrap_err()),
        Some("q")
    );
    assert_eq!(
        arg(linear_forward(&q, &t(&[1, 5, 1, 7], DType::F32), &v, &p).unwrap_err()),
        Some("k")
    );
    assert_eq!(
        arg(linear_forward(&q, &k, &t(&[1, 6, 1, 3], DType::F32), &p).unwrap_err()),
        Some("v")
    );
    assert_eq!(
        arg(linear_forward(
            &q,
            &t(&[1, 5, 3, 8], DType::F32),
            &t(&[1, 5, 3, 3], DType::F32),
            &p
        )
        .unwrap_err()),
        Some("k")
    );
    assert_eq!(
        arg(linear_forward(&q, &t(&[1, 5, 1, 8], DType::BF16), &v, &p).unwrap_err()),
        Some("k")
    );
    for eps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let bad = LinearParams { eps, ..p };
        assert_eq!(
            arg(linear_forward(&q, &k, &v, &bad).unwrap_err()),
            Some("eps")
        );
    }
    assert_eq!(
        arg(linear_backward(&q, &k, &v, &t(&[1, 4, 2, 8], DType::F32), &p).unwrap_err()),
        Some("dout")
    );
    assert_eq!(
        arg(linear_backward(&q, &k, &v, &t(&[1, 4, 2, 3], DType::F16), &p).unwrap_err()),
        Some("dout")
    );
    assert!(linear_backward(&q, &k, &v, &t(&[1, 4, 2, 3], DType::F32), &p).is_ok());
}
