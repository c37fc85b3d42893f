//! The GPU backward against the f64 oracle's analytic gradients, with the bounds of the CPU
//! backward (`tests/backward_grid.rs`: f32 ≤ 1e-5 of the summed terms, f16/bf16 within 2× the
//! standard attention's backward in the same precision), over awkward lengths, head dims, every
//! option, varlen, both layouts; plus `backward_into` on the GPU.
//! The GPU tests need a CUDA device: run with
//! `cargo test --release --test cuda_backward -- --include-ignored` on a machine with a GPU.
//!
//! Each case draws fresh random inputs (seed printed), uploads them, poisons the allocator's
//! free memory and the outputs with NaN, runs flashattn's GPU forward and backward, and measures
//! the gradients on the host (`common::gradient_errors`).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{GPU, check_gpu_backward_cases, poison, to_device};
use common::{Alibi, Case, Layout, gradient_errors, padded, rng};
use flashattn::internals::{last_cuda_backward_kernel, set_hopper_backward, set_mma_backward};
use flashattn::{DType, Device, Gradients, Tensor, backward, backward_into, forward};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Every sequence length as Nq and as Nk, unmasked and causal.
#[test]
#[ignore = "needs a CUDA device"]
fn sequence_lengths() {
    let pairs = [
        (1, 1),
        (7, 63),
        (63, 7),
        (64, 65),
        (65, 64),
        (113, 203),
        (203, 113),
        (256, 256),
        (1000, 1000),
        (1, 1000),
        (1000, 1),
    ];
    let mut cases = Vec::new();
    for (n, &(nq, nk)) in pairs.iter().enumerate() {
        let case = Case::new(nq, nk, 32).dtype(DTYPES[n % 3]);
        cases.push(case.clone());
        cases.push(case.causal().dtype(DTYPES[(n + 1) % 3]));
    }
    check_gpu_backward_cases("backward sequence_lengths", 210_000, &cases);
}

/// Every head dimension in every dtype, with V's head dimension equal and different, both
/// layouts.
#[test]
#[ignore = "needs a CUDA device"]
fn head_dims() {
    let dims = [1, 32, 64, 80, 128, 256, 512];
    let mut cases = Vec::new();
    for (n, &d) in dims.iter().enumerate() {
        let dv = dims[(n + 3) % dims.len()];
        for (m, dtype) in DTYPES.into_iter().enumerate() {
            cases.push(Case::new(65, 63, d).dtype(dtype).heads(2, 1));
            let other = Case::new(63, 113, d)
                .dv(dv)
                .causal()
                .dtype(DTYPES[(n + m + 1) % 3]);
            cases.push(other.layout(Layout::Bhnd));
        }
    }
    check_gpu_backward_cases("backward head_dims", 220_000, &cases);
}

/// Batch sizes, GQA and MQA, windows, each score option alone and combined, broadcast biases
/// and their gradient, non-positive scales, both layouts.
#[test]
#[ignore = "needs a CUDA device"]
fn options() {
    let base = |n: usize| {
        Case::new(113, 65, 32)
            .batch(2)
            .heads(4, 2)
            .dtype(DTYPES[n % 3])
    };
    let cases = vec![
        base(0).causal(),
        base(1).window(Some(9), Some(0)),
        base(2).window(Some(0), Some(17)),
        base(3).window(Some(4), Some(30)).layout(Layout::Bhnd),
        base(4).alibi(Alibi::PerHead),
        base(5).alibi(Alibi::PerBatchHead),
        base(6).softcap(2.0),
        base(7).bias([true, true, true, true]),
        base(8).bias([false, true, true, true]),
        base(9).bias([true, false, false, true]),
        base(10).bias([false, false, true, false]),
        base(11).bias([false, false, false, false]),
        base(12).scale(0.4),
        base(13).scale(-0.3),
        base(14).scale(0.0).causal(),
        base(15).heads(8, 1).batch(3),
        base(16).heads(6, 3).batch(1).layout(Layout::Bhnd),
        base(17)
            .causal()
            .softcap(10.0)
            .alibi(Alibi::PerBatchHead)
            .bias([true, false, true, true]),
        base(18)
            .window(Some(20), Some(3))
            .softcap(1.5)
            .bias([false, false, true, true])
            .layout(Layout::Bhnd),
        base(19)
            .heads(8, 2)
            .causal()
            .softcap(5.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, false, true])
            .scale(-0.2),
    ];
    check_gpu_backward_cases("backward options", 230_000, &cases);
}

/// Packed variable-length batches with uneven and empty sequences.
#[test]
#[ignore = "needs a CUDA device"]
fn varlen() {
    let lens: [&[(usize, usize)]; 3] = [
        &[(5, 7), (63, 64), (0, 3), (113, 65), (4, 0)],
        &[(256, 203), (1, 1)],
        &[(0, 0), (30, 50), (50, 30)],
    ];
    let mut cases = Vec::new();
    for (n, l) in lens.iter().enumerate() {
        let base = Case::new(0, 0, 48).varlen(l).heads(4, 2).dtype(DTYPES[n]);
        cases.push(base.clone().causal());
        cases.push(
            base.window(Some(5), Some(5))
                .alibi(Alibi::PerHead)
                .bias([true, true, true, true])
                .layout(Layout::Bhnd)
                .dv(24),
        );
    }
    check_gpu_backward_cases("backward varlen", 240_000, &cases);
}

/// The relative-position table's gradient (and the others) over the forward grid's table cases,
/// on the tensor-core (f16/bf16) and CUDA-core (f32) key-block kernels.
#[test]
#[ignore = "needs a CUDA device"]
fn rel_bias() {
    check_gpu_backward_cases("backward rel_bias", 245_000, &common::grid::rel_bias());
}

/// Rows that see no key (causal with Nq > Nk, LSE −∞): their dq rows are exactly 0, nothing
/// is NaN, and the rest meets the bounds.
#[test]
#[ignore = "needs a CUDA device"]
fn rows_without_keys() {
    for (n, dtype) in DTYPES.into_iter().enumerate() {
        let case = Case::new(65, 7, 64)
            .causal()
            .dtype(dtype)
            .bias([true, true, true, true]);
        let x = case.inputs(&mut rng(250_000 + n as u64));
        let g = to_device(&x, GPU);
        poison();
        let f = forward(&g.q, &g.k, &g.v, &g.p).expect("gpu forward");
        let grads = backward(&g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p).expect("backward");
        let dq = grads.dq.to_f32_vec().unwrap();
        // Query i sees keys 0..=i + 7 - 65: the first 58 rows see none.
        assert!(
            dq[..58 * 64].iter().all(|&v| v == 0.0),
            "{dtype}: dq of rows without keys"
        );
        let dbias = grads.dbias.as_ref().unwrap().to_f32_vec().unwrap();
        assert!(
            dbias[..58 * 7].iter().all(|&v| v == 0.0),
            "{dtype}: dbias of those rows"
        );
        let out = f.out.to_device(Device::Cpu).unwrap();
        for e in gradient_errors(&case, &x, &out, &grads, [&g.q, &g.k, &g.v]) {
            println!("rows without keys {dtype}: {e:?}");
            assert!(e.err <= e.bound, "{dtype}: {e:?}");
        }
    }
}

/// `backward_into` on the GPU writes every element of caller-owned, row-padded gradients
/// (NaN-filled first; the bias gradient too, which the call must zero), call after call, within
/// the bounds.
#[test]
#[ignore = "needs a CUDA device"]
fn backward_into_padded_gradients() {
    for (i, case) in common::output_cases().iter().enumerate() {
        let x = case.inputs(&mut rng(260_000 + i as u64));
        let g = to_device(&x, GPU);
        let f = forward(&g.q, &g.k, &g.v, &g.p).unwrap();
        let on_gpu = |t: Tensor| t.to_device(GPU).unwrap();
        let mut grads = Gradients {
            dq: on_gpu(padded(x.q.shape(), case.dtype)),
            dk: on_gpu(padded(x.k.shape(), case.dtype)),
            dv: on_gpu(padded(x.v.shape(), case.dtype)),
            dbias: x
                .p
                .bias
                .as_ref()
                .map(|b| on_gpu(Tensor::full(b.shape(), DType::F32, f32::NAN).unwrap())),
            drel_bias: x
                .p
                .rel_bias
                .as_ref()
                .map(|r| on_gpu(Tensor::full(r.shape(), DType::F32, f32::NAN).unwrap())),
        };
        let out = f.out.to_device(Device::Cpu).unwrap();
        for call in 0..2 {
            backward_into(&g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p, &mut grads).unwrap();
            // The gradients keep the caller's (padded) layout, whatever q, k, v's.
            let like = [&grads.dq, &grads.dk, &grads.dv].map(|t| t.clone());
            for e in gradient_errors(case, &x, &out, &grads, [&like[0], &like[1], &like[2]]) {
                println!("backward_into case {i} call {call}: {e:?}");
                assert!(e.err <= e.bound, "case {i} call {call}: {e:?}");
            }
        }
    }
}

/// The CUDA-core kernel in f16/bf16 where the tensor-core one would run (switched off on this
/// thread): lengths, GQA, every option, varlen.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_core_kernel_in_half_precision() {
    set_mma_backward(false);
    let cases = vec![
        Case::new(113, 203, 64).causal().dtype(DType::F16),
        Case::new(65, 63, 128).heads(4, 1).dtype(DType::BF16),
        Case::new(203, 113, 32)
            .batch(2)
            .heads(4, 2)
            .window(Some(20), Some(3))
            .softcap(3.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, true, true])
            .dtype(DType::BF16)
            .layout(Layout::Bhnd),
        Case::new(0, 0, 48)
            .varlen(&[(5, 7), (63, 64), (0, 3), (113, 65)])
            .heads(4, 2)
            .causal()
            .dtype(DType::F16),
    ];
    check_gpu_backward_cases("backward cuda-core half", 270_000, &cases);
    let kernel = last_cuda_backward_kernel().expect("a backward ran");
    assert!(kernel.starts_with("bwd_general_"), "{kernel}");
    set_mma_backward(true);
}

/// Which key-block kernel runs off Hopper (its kernel switched off on this thread): tensor cores
/// for f16/bf16 head dims that are multiples of 8 up to 128, CUDA cores for f32, other head dims
/// and larger ones.
#[test]
#[ignore = "needs a CUDA device"]
fn kernel_choice() {
    set_hopper_backward(false);
    let cases = [
        (DType::F16, 64, 64, "bwd_mma_f16_d64x64"),
        (DType::BF16, 128, 96, "bwd_mma_bf16_d128x96"),
        (DType::BF16, 40, 40, "bwd_mma_bf16_d48x48"),
        (DType::F32, 64, 64, "bwd_general_f32"),
        (DType::F16, 256, 256, "bwd_general_f16"),
        (DType::BF16, 36, 36, "bwd_general_bf16"),
    ];
    for (n, (dtype, d, dv, want)) in cases.into_iter().enumerate() {
        let case = Case::new(70, 90, d).dv(dv).dtype(dtype);
        let x = to_device(&case.inputs(&mut rng(280_000 + n as u64)), GPU);
        let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
        let kernel = last_cuda_backward_kernel().expect("a backward ran");
        assert!(kernel.starts_with(want), "{dtype} d {d}/{dv}: {kernel}");
    }
    set_hopper_backward(true);
}

/// The Hopper kernels (on sm_90a GPUs; elsewhere skipped with a note): lengths about their 128-
/// and 64-key blocks and 64-row steps, causal with Nq ≠ Nk both ways, windows, GQA and MQA, head
/// dims 32 to 256 and V's apart (the wide kernel above 128, with 192 and 200 padded to 256), every
/// score option (the softcap and the table at head dims up to 64 and on the wide kernel), `[B, H,
/// N, D]` storage; then the problems they leave to the other kernels (a softcap at 128, varlen).
#[test]
#[ignore = "needs a CUDA device"]
fn hopper_kernel() {
    let info = flashattn::cuda::device_info(0);
    if !info.as_ref().is_ok_and(|i| i.contains("sm_90a")) {
        println!("NOTE: skipped, the Hopper backward needs an sm_90a GPU (got {info:?})");
        return;
    }
    let (f16, bf16) = (DType::F16, DType::BF16);
    let wgmma = [
        Case::new(1000, 1000, 64).dtype(bf16).heads(4, 4),
        Case::new(200, 200, 128).dtype(f16).causal(),
        Case::new(65, 200, 80).dtype(bf16).layout(Layout::Bhnd),
        Case::new(129, 127, 32).dtype(f16),
        Case::new(200, 65, 64).dv(128).dtype(f16).causal(),
        Case::new(65, 1000, 128).dv(64).dtype(bf16).causal(),
        Case::new(1, 1000, 128).dtype(f16).heads(8, 1),
        Case::new(1000, 1, 64).dtype(bf16),
        Case::new(1000, 200, 64)
            .dtype(bf16)
            .window(Some(100), Some(0)),
        Case::new(300, 300, 128)
            .dtype(f16)
            .batch(3)
            .heads(6, 2)
            .window(Some(16), Some(16)),
        Case::new(113, 203, 64)
            .dtype(bf16)
            .batch(2)
            .heads(4, 2)
            .causal()
            .softcap(20.0)
            .alibi(Alibi::PerBatchHead)
            .bias([true, true, true, true]),
        Case::new(65, 65, 48)
            .dtype(f16)
            .heads(2, 1)
            .softcap(5.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, true, true])
            .scale(-0.3),
        Case::new(203, 113, 128)
            .dtype(f16)
            .heads(4, 2)
            .window(Some(50), Some(10))
            .alibi(Alibi::PerHead)
            .bias([true, false, true, true]),
        Case::new(200, 200, 256).dtype(bf16).causal(),
        Case::new(129, 65, 192).dtype(f16).heads(4, 2),
        Case::new(65, 1000, 256)
            .dv(128)
            .dtype(bf16)
            .layout(Layout::Bhnd),
        Case::new(300, 129, 96).dv(256).dtype(f16).causal(),
        Case::new(1, 1000, 256).dtype(f16).heads(8, 1),
        Case::new(1000, 1, 200).dtype(bf16),
        Case::new(113, 203, 256)
            .dtype(bf16)
            .batch(2)
            .heads(4, 2)
            .window(Some(40), Some(8))
            .alibi(Alibi::PerHead)
            .bias([true, false, true, true]),
        Case::new(70, 90, 256).dtype(f16).softcap(10.0),
        Case::new(100, 140, 152).dtype(bf16).heads(4, 2).causal(),
        Case::new(129, 203, 256)
            .dtype(f16)
            .heads(6, 2)
            .window(Some(30), Some(12))
            .softcap(15.0)
            .bias([false, true, true, true]),
        Case::new(150, 150, 256)
            .dtype(bf16)
            .heads(4, 2)
            .causal()
            .softcap(30.0)
            .rel_bias(40),
    ];
    let others = [
        Case::new(113, 203, 128).dtype(bf16).softcap(10.0),
        Case::new(0, 0, 64)
            .dtype(f16)
            .heads(4, 2)
            .varlen(&[(65, 200), (1, 7)]),
    ];
    for (n, case) in wgmma.iter().chain(&others).enumerate() {
        check_gpu_backward_cases(
            "backward hopper",
            285_000 + n as u64,
            std::slice::from_ref(case),
        );
        let kernel = last_cuda_backward_kernel().expect("a backward ran");
        println!("{}: {kernel}", common::describe(case));
        assert_eq!(
            kernel.starts_with("bwd_wgmma_"),
            n < wgmma.len(),
            "{kernel}"
        );
    }
}

/// Deterministic mode: two backward calls give the same bits (dq, dk, dv, dbias, drel_bias), on the
/// Hopper (narrow and wide, on sm_90a), tensor-core and CUDA-core key-block kernels, with biases broadcast over every combination of
/// dims (each walks a different path of the dQ pass), GQA and varlen; and the gradients meet the
/// bounds.
#[test]
#[ignore = "needs a CUDA device"]
fn deterministic_gradients_repeat_bitwise() {
    let base = |n: usize, d: usize| {
        Case::new(203, 113, d)
            .batch(2)
            .heads(4, 2)
            .dtype(DTYPES[n % 3])
    };
    let cases = [
        base(0, 64).causal().bias([true, false, true, true]),
        base(1, 64).bias([false, false, false, true]).softcap(4.0),
        base(2, 128)
            .window(Some(30), Some(7))
            .bias([true, true, false, false]),
        base(3, 256)
            .bias([false, false, false, false])
            .alibi(Alibi::PerHead),
        base(4, 32).layout(Layout::Bhnd),
        base(10, 192).causal().bias([true, false, true, false]),
        base(11, 256)
            .window(Some(40), Some(3))
            .alibi(Alibi::PerHead),
        base(14, 256).causal().softcap(20.0).rel_bias(30),
        base(5, 80).bias([true, true, true, true]).scale(-0.2),
        Case::new(0, 0, 48)
            .varlen(&[(5, 7), (63, 64), (0, 3), (113, 65)])
            .heads(4, 2)
            .causal()
            .bias([false, true, true, false])
            .dtype(DType::F16),
        base(6, 64).causal().rel_bias(40).alibi(Alibi::PerBatchHead),
        base(7, 32)
            .rel_bias(3)
            .bias([false, true, false, true])
            .layout(Layout::Bhnd),
        Case::new(0, 0, 64)
            .varlen(&[(5, 7), (63, 64), (0, 3), (113, 65)])
            .heads(4, 2)
            .window(Some(20), Some(4))
            .rel_bias(70)
            .dtype(DType::BF16),
    ];
    let bits = |g: &Gradients| {
        let mut all = vec![
            common::bits(&g.dq),
            common::bits(&g.dk),
            common::bits(&g.dv),
        ];
        all.extend(g.dbias.as_ref().map(common::bits));
        all.extend(g.drel_bias.as_ref().map(common::bits));
        all
    };
    for (n, case) in cases.iter().enumerate() {
        let mut x = case.inputs(&mut rng(290_000 + n as u64));
        x.p = x.p.clone().deterministic(true);
        let g = to_device(&x, GPU);
        let f = forward(&g.q, &g.k, &g.v, &g.p).unwrap();
        poison();
        let first = backward(&g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p).unwrap();
        let kernel = last_cuda_backward_kernel().expect("a backward ran");
        assert!(kernel.ends_with("_det"), "{kernel}");
        poison();
        let second = backward(&g.q, &g.k, &g.v, &f.out, &f.lse, &g.dout, &g.p).unwrap();
        assert!(
            bits(&first) == bits(&second),
            "#{n} {kernel}: gradients differ between runs"
        );
        let out = f.out.to_device(Device::Cpu).unwrap();
        for e in gradient_errors(case, &x, &out, &first, [&g.q, &g.k, &g.v]) {
            println!("deterministic #{n} {kernel}: {e:?}");
            assert!(e.err <= e.bound, "#{n} {kernel}: {e:?}");
        }
    }
}
