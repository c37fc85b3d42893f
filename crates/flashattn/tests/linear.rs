//! Linear attention on the CPU against its f64 oracle (the definition as a weighted average,
//! O(N²)): outputs and gradients over awkward sizes, GQA, causal with more or fewer queries than
//! keys, both feature maps, every dtype and a strided layout; the oracle's gradients against
//! central finite differences; a typed error naming the argument for every bad input.

mod common;

use common::linear::{FLAVOURS, SMALL, check};
use common::rng;
use flashattn::reference::linear as oracle;
use flashattn::{
    DType, Device, Error, FeatureMap, LinearParams, Tensor, linear_backward, linear_forward,
};
use rand::RngExt;

#[test]
fn linear_attention_matches_its_oracle() {
    let mut worst = 0f64;
    for (n, &case) in SMALL.iter().enumerate() {
        for (m, &flavour) in FLAVOURS.iter().enumerate() {
            let seed = 9100 + 10 * n as u64 + m as u64;
            worst = worst.max(check(case, flavour, Device::Cpu, seed));
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
