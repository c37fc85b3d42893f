//! Linear attention on the GPU against its f64 oracle, with the bound of the CPU scans
//! (`tests/linear.rs`): the CPU's cases, then sequences spanning many chunks (more and fewer
//! queries than keys, GQA, head dims to 256), empty sequences and a single key, in every dtype
//! and both layouts, outputs poisoned. Needs a CUDA device:
//! `cargo test --release --test cuda_linear -- --include-ignored`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, poison};
use common::linear::{Case, FLAVOURS, SMALL, check};
use flashattn::{DType, Error, FeatureMap, LinearParams, Tensor, linear_backward, linear_forward};

const LONG: [Case; 10] = [
    ([2, 300, 257, 4, 2, 64, 64], true, FeatureMap::Elu1),
    ([1, 200, 450, 8, 2, 32, 48], true, FeatureMap::Relu),
    ([1, 333, 333, 2, 1, 128, 128], true, FeatureMap::Elu1),
    ([2, 150, 97, 3, 3, 256, 8], false, FeatureMap::Elu1),
    ([1, 1000, 1000, 2, 2, 64, 64], true, FeatureMap::Elu1),
    ([1, 65, 1, 2, 1, 4, 4], true, FeatureMap::Elu1),
    ([1, 0, 5, 2, 1, 8, 8], true, FeatureMap::Elu1),
    ([1, 6, 0, 2, 1, 8, 8], true, FeatureMap::Relu),
    ([1, 6, 0, 2, 1, 8, 8], false, FeatureMap::Elu1),
    ([1, 130, 700, 4, 1, 16, 16], true, FeatureMap::Relu),
];

fn run(test: &str, seed0: u64, cases: &[Case]) {
    poison();
    let mut worst = 0f64;
    for (n, &case) in cases.iter().enumerate() {
        for (m, &flavour) in FLAVOURS.iter().enumerate() {
            worst = worst.max(check(case, flavour, GPU, seed0 + 10 * n as u64 + m as u64));
        }
    }
    println!("{test}: worst error / tolerance {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_cpu_cases_match_the_oracle() {
    run("the CPU cases", 9600, &SMALL);
}

#[test]
#[ignore = "needs a CUDA device"]
fn long_empty_and_single_key_cases_match_the_oracle() {
    run("long, empty and single-key cases", 9700, &LONG);
}

#[test]
#[ignore = "needs a CUDA device"]
fn inputs_on_two_devices_are_typed_errors_naming_the_argument() {
    let t = |shape: &[usize]| Tensor::full(shape, DType::F32, 0.5).unwrap();
    let (q, k, v) = (t(&[1, 4, 2, 8]), t(&[1, 5, 1, 8]), t(&[1, 5, 1, 3]));
    let up = |x: &Tensor| x.to_device(GPU).unwrap();
    let p = LinearParams::default();
    let arg = |e: Error| e.argument();
    assert_eq!(
        arg(linear_forward(&up(&q), &k, &up(&v), &p).unwrap_err()),
        Some("k")
    );
    assert_eq!(
        arg(linear_forward(&up(&q), &up(&k), &v, &p).unwrap_err()),
        Some("v")
    );
    let dout = t(&[1, 4, 2, 3]);
    assert_eq!(
        arg(linear_backward(&up(&q), &up(&k), &up(&v), &dout, &p).unwrap_err()),
        Some("dout")
    );
    assert!(linear_backward(&up(&q), &up(&k), &up(&v), &up(&dout), &p).is_ok());
}
