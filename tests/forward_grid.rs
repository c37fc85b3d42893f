//! The forward pass against the f64 oracle over the grid of the core issue. Each axis (sequence
//! lengths, head dims, batch and GQA ratios, every mask option alone and combined, dtypes, layouts,
//! varlen, head_dim_v) has every one of its values in some case; the axes are not multiplied out.
//!
//! Bounds: f32 relative error ≤ 1e-5; f16/bf16 within 2× the standard attention's error in the
//! same precision (+1e-6, see `common::HALF_FLOOR`); lse as in `common::lse_tolerance`.

mod common;

use common::{Alibi, Case, Layout, check_forward_cases};
use flashattn::{AttentionParams, DType, Element, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const SEQLENS: [usize; 9] = [1, 7, 63, 64, 65, 113, 203, 256, 1000];
const HEAD_DIMS: [usize; 9] = [1, 8, 32, 64, 80, 96, 128, 256, 512];

/// Every sequence length as Nq and as Nk, equal and unequal, unmasked and causal.
#[test]
fn sequence_lengths() {
    let mut cases = Vec::new();
    for (n, &nq) in SEQLENS.iter().enumerate() {
        // Nk: the same length, and the next one in the list (wrapping), so each value is met
        // paired with itself and with a different length on both sides.
        let other = SEQLENS[(n + 1) % SEQLENS.len()];
        for (m, nk) in [nq, other].into_iter().enumerate() {
            let d = [32, 64, 16][(n + m) % 3];
            let case = Case::new(nq, nk, d).dtype(DTYPES[(n + m) % 3]);
            cases.push(case.clone());
            cases.push(case.causal());
        }
    }
    // The longest length against the shortest, both ways.
    cases.push(Case::new(1, 1000, 64).causal());
    cases.push(Case::new(1000, 1, 64).dtype(DType::BF16));
    cases.push(Case::new(1000, 7, 8).causal().dtype(DType::F16));
    check_forward_cases("sequence_lengths", 10_000, &cases);
}

/// Every head dimension, in every dtype.
#[test]
fn head_dims() {
    let mut cases = Vec::new();
    for (n, &d) in HEAD_DIMS.iter().enumerate() {
        for (m, &dtype) in DTYPES.iter().enumerate() {
            let (nq, nk) = [(65, 113), (113, 65), (64, 64)][(n + m) % 3];
            let mut case = Case::new(nq, nk, d).dtype(dtype).heads(2, 1);
            if m == 1 {
                case = case.causal();
            }
            if n % 2 == 1 {
                case = case.layout(Layout::Bhnd);
            }
            cases.push(case);
        }
    }
    check_forward_cases("head_dims", 20_000, &cases);
}

/// head_dim of V different from that of Q and K, including at the extremes 1 and 512.
#[test]
fn head_dim_v_differs() {
    let pairs = [
        (64, 32),
        (32, 128),
        (8, 1),
        (1, 8),
        (512, 64),
        (64, 512),
        (96, 80),
        (80, 256),
    ];
    let cases: Vec<Case> = pairs
        .iter()
        .enumerate()
        .map(|(n, &(d, dv))| {
            let case = Case::new(63, 113, d).dv(dv).dtype(DTYPES[n % 3]);
            if n % 2 == 0 { case.causal() } else { case }
        })
        .collect();
    check_forward_cases("head_dim_v_differs", 30_000, &cases);
}

/// Batch sizes and GQA ratios, MQA included.
#[test]
fn batch_and_gqa() {
    let shapes = [
        (1, 1, 1),
        (2, 4, 2),
        (3, 8, 1),
        (2, 6, 3),
        (4, 4, 4),
        (5, 6, 2),
        (2, 16, 1),
        (3, 12, 4),
    ];
    let mut cases = Vec::new();
    for (n, &(b, h, hk)) in shapes.iter().enumerate() {
        let case = Case::new(65, 63, 32)
            .batch(b)
            .heads(h, hk)
            .dtype(DTYPES[n % 3]);
        cases.push(case.clone());
        cases.push(
            case.causal()
                .alibi(Alibi::PerBatchHead)
                .layout(Layout::Bhnd),
        );
    }
    check_forward_cases("batch_and_gqa", 40_000, &cases);
}

/// Each mask option alone, on unequal lengths both ways.
#[test]
fn options_alone() {
    let options: Vec<fn(Case) -> Case> = vec![
        |c| c.causal(),
        |c| c.window(Some(8), Some(8)),
        |c| c.window(Some(16), Some(0)),
        |c| c.window(Some(0), Some(16)),
        |c| c.window(Some(3), Some(40)),
        |c| c.window(Some(0), Some(0)),
        |c| c.window(None, Some(5)),
        |c| c.window(Some(7), None),
        |c| c.alibi(Alibi::PerHead),
        |c| c.alibi(Alibi::PerBatchHead),
        |c| c.softcap(1.5),
        |c| c.softcap(30.0),
        |c| c.bias([true, true, true, true]),
        |c| c.bias([false, false, true, true]),
        |c| c.bias([true, false, true, true]),
        |c| c.bias([false, true, true, true]),
        |c| c.bias([false, false, false, true]),
        |c| c.bias([true, true, false, false]),
        |c| c.bias([false, false, true, false]),
        |c| c.scale(0.5),
    ];
    let mut cases = Vec::new();
    for (n, option) in options.iter().enumerate() {
        for (m, (nq, nk)) in [(113, 203), (203, 113)].into_iter().enumerate() {
            let base = Case::new(nq, nk, 32)
                .batch(2)
                .heads(4, 2)
                .dtype(DTYPES[(n + m) % 3]);
            cases.push(option(base));
        }
    }
    check_forward_cases("options_alone", 50_000, &cases);
}

/// Options combined, the way models use them.
#[test]
fn options_combined() {
    let cases = vec![
        Case::new(256, 256, 64)
            .heads(4, 1)
            .causal()
            .softcap(20.0)
            .alibi(Alibi::PerHead),
        Case::new(113, 256, 64)
            .window(Some(32), Some(0))
            .bias([false, true, true, true])
            .heads(2, 2),
        Case::new(203, 65, 96)
            .batch(3)
            .causal()
            .bias([true, false, true, true])
            .alibi(Alibi::PerBatchHead)
            .dtype(DType::F16),
        Case::new(65, 203, 80)
            .window(Some(20), Some(7))
            .softcap(2.0)
            .bias([false, false, true, true])
            .alibi(Alibi::PerHead)
            .layout(Layout::Bhnd)
            .dtype(DType::BF16),
        Case::new(64, 64, 128)
            .heads(8, 2)
            .window(Some(0), Some(9))
            .softcap(5.0)
            .dtype(DType::F16)
            .layout(Layout::Bhnd),
        Case::new(7, 63, 8)
            .batch(4)
            .heads(3, 1)
            .causal()
            .alibi(Alibi::PerBatchHead)
            .bias([true, true, true, true])
            .softcap(1.0)
            .scale(0.3)
            .dtype(DType::BF16),
    ];
    check_forward_cases("options_combined", 60_000, &cases);
}

/// Every dtype in both memory layouts, plain and with options.
#[test]
fn dtypes_and_layouts() {
    let mut cases = Vec::new();
    for &dtype in &DTYPES {
        for layout in [Layout::Bnhd, Layout::Bhnd] {
            let base = Case::new(113, 65, 64)
                .batch(2)
                .heads(4, 2)
                .dtype(dtype)
                .layout(layout);
            cases.push(base.clone());
            cases.push(base.causal().softcap(10.0).bias([false, true, true, true]));
        }
    }
    check_forward_cases("dtypes_and_layouts", 70_000, &cases);
}

/// Packed variable-length batches with uneven lengths, empty sequences included.
#[test]
fn varlen() {
    let batches: [&[(usize, usize)]; 6] = [
        &[(5, 7), (63, 64), (1, 1), (113, 65)],
        &[(0, 0), (7, 7), (0, 9), (12, 0), (65, 203)],
        &[(256, 256), (1, 113)],
        &[(30, 20), (20, 30), (0, 1), (1, 0)],
        &[(64, 64)],
        &[(0, 0)],
    ];
    let mut cases = Vec::new();
    for (n, lens) in batches.iter().enumerate() {
        let base = Case::new(0, 0, 32)
            .varlen(lens)
            .heads(4, 2)
            .dtype(DTYPES[n % 3]);
        cases.push(base.clone());
        cases.push(base.clone().causal().layout(Layout::Bhnd));
        cases.push(
            base.window(Some(6), Some(2))
                .alibi(Alibi::PerBatchHead)
                .bias([true, false, true, true])
                .dtype(DTYPES[(n + 1) % 3]),
        );
    }
    cases.push(
        Case::new(0, 0, 80)
            .dv(48)
            .varlen(&[(40, 90), (90, 40), (0, 3)])
            .heads(6, 1)
            .softcap(4.0)
            .alibi(Alibi::PerHead),
    );
    check_forward_cases("varlen", 80_000, &cases);
}

/// A `shape` view with `strides` and `offset` of `data` converted to `dtype`.
fn strided(
    data: &[f32],
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Tensor {
    fn typed<T: Element>(
        data: &[f32],
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Tensor {
        let v: Vec<T> = data.iter().map(|&x| T::from_f32(x)).collect();
        Tensor::from_vec_strided(v, shape, strides, offset).unwrap()
    }
    match dtype {
        DType::F32 => typed::<f32>(data, shape, strides, offset),
        DType::F16 => typed::<half::f16>(data, shape, strides, offset),
        DType::BF16 => typed::<half::bf16>(data, shape, strides, offset),
    }
}

/// q, k and v as strided views into one packed `[batch, seqlen, 3, heads, dim]` buffer (the
/// layout of a fused QKV projection): rows `3 · heads · dim` apart, k and v at offsets.
#[test]
fn packed_qkv_views() {
    let shapes = [
        (2, 65, 4, 32, DType::F32),
        (1, 113, 2, 64, DType::F16),
        (3, 7, 8, 8, DType::BF16),
    ];
    for (n, &(b, len, h, d, dtype)) in shapes.iter().enumerate() {
        let seed = 90_000 + n as u64;
        let mut rng = common::rng(seed);
        let buf = common::values(&mut rng, b * len * 3 * h * d, 1.7);
        let (shape, strides) = ([b, len, h, d], [len * 3 * h * d, 3 * h * d, d, 1]);
        let view = |which: usize| strided(&buf, dtype, &shape, &strides, which * h * d);
        let dout = common::tensor(&mut rng, &shape, dtype, Layout::Bnhd);
        for p in [
            AttentionParams::default(),
            AttentionParams::default().causal(),
        ] {
            let x = common::Inputs {
                q: view(0),
                k: view(1),
                v: view(2),
                dout: dout.clone(),
                p,
            };
            let e = common::forward_errors(&x);
            let tol = common::tolerance(dtype, e.standard);
            println!("packed qkv B={b} N={len} H={h} D={d} {dtype} seed {seed}: {e:?}");
            assert!(e.out <= tol, "{e:?} > {tol:e}");
            assert!(
                e.lse <= common::lse_tolerance(dtype, e.standard_lse),
                "{e:?}"
            );
            // The backward reads the same views (and writes gradients in their memory order).
            let case = Case::new(len, len, d).batch(b).heads(h, h).dtype(dtype);
            for g in common::backward_errors(&case, &x) {
                println!("  {g:?}");
                assert!(g.err <= g.bound, "{g:?}");
            }
        }
    }
}
