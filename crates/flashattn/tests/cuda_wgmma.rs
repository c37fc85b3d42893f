//! The Hopper (sm_90a) forward, `kernels/flash_fwd_wgmma.cu`, against the f64 oracle with the
//! bounds of `tests/cuda_forward.rs`, and which kernel each problem ran on: the wgmma kernel where
//! it applies, the tensor-core kernel where it does not or where it is switched off. Needs a GPU of
//! compute capability 9.0 (others: skipped with a note):
//! `cargo test --release --test cuda_wgmma -- --include-ignored`.
//!
//! One test function, because the switch (`internals::set_hopper_forward`) is process-wide.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::check_gpu_cases;
use common::{Alibi, Case, Layout, describe};
use flashattn::DType::{BF16, F16};
use flashattn::internals::{last_cuda_forward_kernel, set_hopper_forward};

/// Problems the wgmma kernel takes: both dtypes, head dims 64 to 256 and padded ones, V's head dim
/// apart from Q's, causal with Nq ≠ Nk both ways, windows, GQA and MQA, every score option (the
/// relative-position table too), batch > 1, lengths 1 to 2500 (tiles whose last consumers have no
/// rows, or rows that see no key), and `[B, H, N, D]` storage (strided rows that TMA still loads).
fn wgmma_cases() -> Vec<Case> {
    vec![
        Case::new(1000, 1000, 64).dtype(BF16).heads(4, 4),
        Case::new(200, 200, 128).dtype(F16).causal(),
        Case::new(65, 200, 80).dtype(BF16).layout(Layout::Bhnd),
        Case::new(200, 200, 32).dtype(F16),
        Case::new(200, 65, 64).dv(128).dtype(F16).causal(),
        Case::new(65, 1000, 128).dv(64).dtype(BF16).causal(),
        Case::new(1, 1000, 128).dtype(F16).heads(8, 1),
        Case::new(1, 1, 64).dtype(BF16),
        Case::new(1000, 200, 64)
            .dtype(BF16)
            .window(Some(100), Some(0)),
        Case::new(200, 200, 128)
            .dtype(F16)
            .batch(3)
            .heads(6, 2)
            .window(Some(16), Some(16)),
        Case::new(200, 1000, 64)
            .dtype(F16)
            .batch(2)
            .heads(8, 2)
            .layout(Layout::Bhnd),
        Case::new(113, 203, 128)
            .dtype(BF16)
            .batch(2)
            .heads(4, 2)
            .causal()
            .softcap(20.0)
            .alibi(Alibi::PerBatchHead)
            .bias([true, true, true, true]),
        Case::new(65, 65, 64)
            .dtype(F16)
            .heads(2, 1)
            .softcap(5.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, true, true])
            .scale(-0.3),
        Case::new(1000, 1000, 128)
            .dtype(BF16)
            .batch(2)
            .heads(2, 1)
            .causal(),
        Case::new(200, 113, 256).dtype(BF16).causal(),
        Case::new(300, 300, 192).dtype(F16).heads(4, 2),
        Case::new(130, 257, 160).dv(256).dtype(BF16).causal(),
        Case::new(257, 130, 256).dv(64).dtype(F16),
        Case::new(200, 200, 256)
            .dtype(BF16)
            .causal()
            .softcap(20.0)
            .alibi(Alibi::PerHead)
            .bias([true, true, true, true]),
        Case::new(150, 150, 192)
            .dtype(F16)
            .window(Some(40), Some(3))
            .bias([false, true, true, true]),
        // Masked, long, and on the 192-row tile (D ≤ 64).
        Case::new(2048, 2048, 64).dtype(F16).causal(),
        Case::new(2100, 2500, 48)
            .dtype(BF16)
            .window(Some(300), Some(20)),
        // A consumer whose rows see no key beside one whose rows do (rows below nq - nk see none),
        // on 128-row tiles and on 192-row ones.
        Case::new(1064, 200, 128)
            .dtype(F16)
            .window(Some(100), Some(0)),
        Case::new(2200, 200, 64).dtype(BF16).causal(),
        // A relative-position table alone and with every other option.
        Case::new(200, 300, 128)
            .dtype(BF16)
            .heads(4, 2)
            .causal()
            .rel_bias(64),
        Case::new(113, 203, 64)
            .dtype(F16)
            .window(Some(50), Some(10))
            .softcap(10.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, true, true])
            .rel_bias(500),
        Case::new(150, 150, 256).dtype(BF16).rel_bias(7),
    ]
}

/// Problems it does not take (a head dim above 256, a packed batch): the tensor-core kernel or the
/// CUDA-core one.
fn mma_cases() -> Vec<Case> {
    vec![
        Case::new(200, 113, 264).dtype(BF16).causal(),
        Case::new(0, 0, 64)
            .dtype(F16)
            .heads(4, 2)
            .varlen(&[(65, 200), (1, 7)]),
    ]
}

/// Runs `case` and checks it against the oracle, then whether the variant launched was the wgmma
/// kernel (`fwd_wgmma_…`).
fn check_on(wgmma: bool, test: &str, seed: u64, case: &Case) {
    check_gpu_cases(test, seed, std::slice::from_ref(case));
    let kernel = last_cuda_forward_kernel().expect("a forward was launched");
    println!("{}: {kernel}", describe(case));
    assert_eq!(
        kernel.starts_with("fwd_wgmma_"),
        wgmma,
        "{}: ran on {kernel}",
        describe(case)
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn wgmma_forward_matches_the_oracle_on_hopper() {
    let info = flashattn::cuda::device_info(0);
    if !info.as_ref().is_ok_and(|i| i.contains("sm_90a")) {
        println!("NOTE: skipped, the wgmma forward needs an sm_90a GPU (got {info:?})");
        return;
    }
    set_hopper_forward(true);
    for (n, case) in wgmma_cases().iter().enumerate() {
        check_on(true, "wgmma", 300_000 + n as u64, case);
    }
    for (n, case) in mma_cases().iter().enumerate() {
        check_on(false, "wgmma fallback", 310_000 + n as u64, case);
    }
    // Switched off, the same problems run on the other kernels.
    set_hopper_forward(false);
    for (n, case) in wgmma_cases().iter().take(3).enumerate() {
        check_on(false, "hopper off", 320_000 + n as u64, case);
    }
    set_hopper_forward(true);
}
