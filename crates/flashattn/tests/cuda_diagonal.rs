//! The diagonal offset (`AttentionParams::diagonal`) on the GPU: query `i`'s diagonal at key
//! `i + d`, which the mask, ALiBi and the relative-position table measure from.
//!
//! Forward and backward against the f64 oracle with the bounds of `tests/cuda_forward.rs` and
//! `tests/cuda_backward.rs` (fresh random inputs, seeds printed, outputs and free memory poisoned),
//! on every kernel: the Hopper (wgmma) forward and backward on sm_90a GPUs, the tensor-core ones,
//! the CUDA-core ones, the deterministic dQ pass and the standard attention (which `gpu_errors`
//! runs beside each forward). Diagonals before, at and past the keys, and beyond ±N up to ±2^40
//! (which the kernels get clamped where that changes nothing), with causal and windows, ALiBi,
//! softcap, biases, GQA, varlen and decoding steps. Also the diagonals the kernels cannot hold
//! (a typed Unsupported). Ring attention on a GPU is in `tests/ring.rs`.
//! Run with `cargo test --release --test cuda_diagonal -- --include-ignored` on a machine with a GPU.
//!
//! The forward's kernel switch (`internals::set_hopper_forward`) is process-wide: one test
//! function walks the forward's kernels.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, check_gpu_backward_cases, check_gpu_cases, gpu_backward_errors, to_device};
use common::{Alibi, Case, Inputs, Layout, check_backward_cases_with, describe, rng};
use flashattn::internals::{
    last_cuda_backward_kernel, last_cuda_forward_kernel, set_hopper_backward, set_hopper_forward,
    set_mma_backward,
};
use flashattn::{DType, Error, MAX_DIAGONAL, forward};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Diagonals of 65 queries over 113 keys: every row's before the first key, some rows', 0,
/// inside, past the last key for some rows and for all.
const DIAGONALS: [i64; 7] = [-70, -20, -7, 0, 30, 100, 120];

/// Diagonals with every option in every dtype (f32 runs on the CUDA-core kernels, f16/bf16 on the
/// tensor cores), head dims 64 and 128 (the Hopper kernels take both).
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (n, &d) in DIAGONALS.iter().enumerate() {
        let base = |m: usize| {
            Case::new(65, 113, 64)
                .dtype(DTYPES[(n + m) % 3])
                .diagonal(d)
        };
        cases.push(base(0).causal());
        cases.push(base(1).window(Some(7), Some(3)).heads(4, 2));
        cases.push(
            base(2)
                .alibi(Alibi::PerHead)
                .rel_bias(9)
                .softcap(5.0)
                .layout(Layout::Bhnd),
        );
        cases.push(
            base(3)
                .causal()
                .alibi(Alibi::PerBatchHead)
                .bias([true, false, true, true])
                .batch(2)
                .heads(6, 1),
        );
    }
    for (n, d) in [-9i64, 0, 6, 50].into_iter().enumerate() {
        cases.push(
            Case::new(0, 0, 64)
                .heads(3, 1)
                .dtype(DTYPES[n % 3])
                .window(Some(4), Some(2))
                .alibi(Alibi::PerBatchHead)
                .rel_bias(5)
                .varlen(&[(5, 9), (0, 4), (17, 0), (33, 33), (40, 12), (1, 70)])
                .diagonal(d),
        );
    }
    for (n, d) in [-3i64, 50, 199, 230].into_iter().enumerate() {
        cases.push(
            Case::new(1, 200, 64)
                .batch(3)
                .heads(8, 2)
                .dtype(DTYPES[n % 3])
                .causal()
                .alibi(Alibi::PerHead)
                .rel_bias(17)
                .diagonal(d),
        );
    }
    // Many key blocks: whole blocks skipped before and after the window, full ones inside it.
    cases.push(
        Case::new(300, 1000, 128)
            .dtype(DType::BF16)
            .heads(4, 2)
            .causal()
            .diagonal(700),
    );
    cases.push(
        Case::new(300, 1000, 64)
            .dtype(DType::F16)
            .window(Some(200), Some(30))
            .alibi(Alibi::PerHead)
            .diagonal(450),
    );
    cases.push(
        Case::new(1000, 300, 128)
            .dtype(DType::BF16)
            .causal()
            .diagonal(-500),
    );
    cases.extend(far_cases());
    cases
}

/// Diagonals beyond ±N up to ±2^40: every key seen reading the table's first or last entry, or
/// none seen under a window.
fn far_cases() -> Vec<Case> {
    let base = |n: usize| Case::new(20, 30, 64).heads(2, 1).dtype(DTYPES[n % 3]);
    vec![
        base(0).causal().rel_bias(4).diagonal(MAX_DIAGONAL),
        base(1).causal().rel_bias(4).diagonal(-MAX_DIAGONAL),
        base(2).rel_bias(4).softcap(3.0).diagonal(-(1 << 35)),
        base(0).rel_bias(40).diagonal(1 << 31),
        base(1).window(Some(5), None).diagonal(MAX_DIAGONAL),
        base(2).window(None, Some(3)).diagonal(-MAX_DIAGONAL),
        base(0).window(Some(5), Some(2)).diagonal(36),
        base(1).window(Some(1 << 35), Some(0)).diagonal(1 << 34),
        // ALiBi with a diagonal far from the keys, yet within 2^30 (not clamped).
        base(2).causal().alibi(Alibi::PerHead).diagonal(-5000),
    ]
}

/// Runs `cases` on the forward the switch leaves, checks them, and returns the kernels that ran.
fn forward_kernels(test: &str, seed: u64, cases: &[Case]) -> Vec<String> {
    let mut kernels = Vec::new();
    for (n, case) in cases.iter().enumerate() {
        check_gpu_cases(test, seed + n as u64, std::slice::from_ref(case));
        let kernel = last_cuda_forward_kernel().expect("a forward ran");
        println!("{}: {kernel}", describe(case));
        kernels.push(kernel);
    }
    kernels
}

/// The forward on each kernel: Hopper on (sm_90a only), then off (tensor-core and CUDA-core).
#[test]
#[ignore = "needs a CUDA device"]
fn forward_on_every_kernel() {
    let hopper = flashattn::cuda::device_info(0).is_ok_and(|i| i.contains("sm_90a"));
    let cases = cases();
    let ran = |kernels: &[String], prefix: &str| kernels.iter().any(|k| k.starts_with(prefix));
    if hopper {
        set_hopper_forward(true);
        let kernels = forward_kernels("diagonal forward hopper", 400_000, &cases);
        assert!(
            ran(&kernels, "fwd_wgmma_"),
            "no case ran on the wgmma forward"
        );
    } else {
        println!("NOTE: the wgmma forward needs an sm_90a GPU; its pass is skipped");
    }
    set_hopper_forward(false);
    let kernels = forward_kernels("diagonal forward", 410_000, &cases);
    assert!(
        ran(&kernels, "fwd_mma_"),
        "no case ran on the tensor-core forward"
    );
    assert!(
        ran(&kernels, "fwd_general_"),
        "no case ran on the CUDA-core forward"
    );
    assert!(
        !ran(&kernels, "fwd_wgmma_"),
        "the Hopper forward ran while off"
    );
    // Half precision on the CUDA-core kernel: a head dim the tensor-core ones do not take.
    let general = [
        Case::new(65, 113, 264)
            .dtype(DType::BF16)
            .causal()
            .diagonal(-20),
        Case::new(65, 113, 264)
            .dtype(DType::F16)
            .alibi(Alibi::PerHead)
            .rel_bias(9)
            .diagonal(100),
    ];
    let kernels = forward_kernels("diagonal forward general", 420_000, &general);
    assert!(
        kernels.iter().all(|k| k.starts_with("fwd_general_")),
        "{kernels:?}"
    );
    set_hopper_forward(true);
}

/// The backward with the default kernel choice: the Hopper kernel where it takes the problem on
/// sm_90a, the tensor-core one for f16/bf16 elsewhere, the CUDA-core one for f32.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_default_kernels() {
    check_gpu_backward_cases("diagonal backward", 430_000, &cases());
}

/// The backward off Hopper: the tensor-core key-block kernel for f16/bf16.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_tensor_core_kernel() {
    set_hopper_backward(false);
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.dtype != DType::F32)
        .collect();
    check_gpu_backward_cases("diagonal backward mma", 440_000, &cases);
    let kernel = last_cuda_backward_kernel().expect("a backward ran");
    assert!(kernel.starts_with("bwd_mma_"), "{kernel}");
    set_hopper_backward(true);
}

/// The backward on the CUDA-core key-block kernel in every dtype.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_cuda_core_kernel() {
    set_mma_backward(false);
    check_gpu_backward_cases("diagonal backward general", 450_000, &cases());
    let kernel = last_cuda_backward_kernel().expect("a backward ran");
    assert!(kernel.starts_with("bwd_general_"), "{kernel}");
    set_mma_backward(true);
}

/// The Hopper backward on problems it takes (sm_90a only): f16/bf16, head dims 64 and 128, no
/// varlen, checked to have run there.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_hopper_kernel() {
    let info = flashattn::cuda::device_info(0);
    if !info.as_ref().is_ok_and(|i| i.contains("sm_90a")) {
        println!("NOTE: skipped, the Hopper backward needs an sm_90a GPU (got {info:?})");
        return;
    }
    let (f16, bf16) = (DType::F16, DType::BF16);
    let cases = [
        Case::new(200, 300, 64).dtype(bf16).causal().diagonal(-20),
        Case::new(300, 200, 128).dtype(f16).causal().diagonal(150),
        Case::new(1000, 1000, 64)
            .dtype(bf16)
            .heads(4, 2)
            .window(Some(100), Some(0))
            .diagonal(-300),
        Case::new(113, 203, 128)
            .dtype(f16)
            .heads(4, 2)
            .window(Some(50), Some(10))
            .alibi(Alibi::PerHead)
            .bias([true, false, true, true])
            .diagonal(140),
        Case::new(65, 200, 64)
            .dtype(bf16)
            .causal()
            .alibi(Alibi::PerBatchHead)
            .batch(2)
            .diagonal(-7),
        Case::new(200, 200, 64)
            .dtype(f16)
            .causal()
            .diagonal(MAX_DIAGONAL),
        Case::new(200, 200, 128)
            .dtype(bf16)
            .window(Some(10), Some(10))
            .diagonal(-MAX_DIAGONAL),
    ];
    for (n, case) in cases.iter().enumerate() {
        check_gpu_backward_cases(
            "diagonal backward hopper",
            460_000 + n as u64,
            std::slice::from_ref(case),
        );
        let kernel = last_cuda_backward_kernel().expect("a backward ran");
        println!("{}: {kernel}", describe(case));
        assert!(kernel.starts_with("bwd_wgmma_"), "{kernel}");
    }
}

/// Deterministic mode (the dQ pass walks key blocks of its own) with diagonals, on the
/// tensor-core and CUDA-core kernels.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_deterministic() {
    let cases: Vec<Case> = cases().into_iter().step_by(3).collect();
    check_backward_cases_with("gpu diagonal backward det", 470_000, &cases, |case, x| {
        let det = Inputs {
            q: x.q.clone(),
            k: x.k.clone(),
            v: x.v.clone(),
            dout: x.dout.clone(),
            p: x.p.clone().deterministic(true),
        };
        let errors = gpu_backward_errors(case, &det);
        let kernel = last_cuda_backward_kernel().expect("a backward ran");
        assert!(kernel.ends_with("_det"), "{kernel}");
        errors
    });
}

/// Diagonals whose positions 32 bits cannot hold exactly are a typed Unsupported on the GPU
/// (the CPU runs them): ALiBi with a diagonal past 2^30, a window edge that binds that far.
#[test]
#[ignore = "needs a CUDA device"]
fn diagonals_the_kernels_cannot_hold_are_unsupported() {
    let cases = [
        Case::new(20, 30, 64)
            .causal()
            .alibi(Alibi::PerHead)
            .diagonal(MAX_DIAGONAL),
        Case::new(20, 30, 64)
            .window(Some(1 << 35), None)
            .diagonal(1 << 35),
    ];
    for (n, case) in cases.iter().enumerate() {
        let x = case.inputs(&mut rng(480_000 + n as u64));
        forward(&x.q, &x.k, &x.v, &x.p).expect("the CPU runs it");
        let g = to_device(&x, GPU);
        let err = forward(&g.q, &g.k, &g.v, &g.p).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { device: "cuda", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("diagonal ="), "{err}");
    }
}
