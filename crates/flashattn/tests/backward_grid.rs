//! The backward pass (dq, dk, dv and the bias gradient) against the oracle's analytic gradient,
//! over the awkward sizes and options of the forward grid (each value in some case, not the full
//! product). Bounds as for the forward: f32 relative error ≤ 1e-5, f16/bf16 within 2× the
//! standard attention's backward in the same precision (see `common::backward_errors`).

mod common;

use common::{Alibi, Case, Layout, check_backward_cases};
use flashattn::DType;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Every sequence length as Nq and as Nk, unmasked and causal.
#[test]
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
    check_backward_cases("backward sequence_lengths", 110_000, &cases);
}

/// Every head dimension, with V's head dimension equal and different.
#[test]
fn head_dims() {
    let dims = [1, 8, 32, 64, 80, 96, 128, 256, 512];
    let mut cases = Vec::new();
    for (n, &d) in dims.iter().enumerate() {
        let dv = dims[(n + 4) % dims.len()];
        cases.push(Case::new(65, 63, d).dtype(DTYPES[n % 3]).heads(2, 1));
        cases.push(
            Case::new(63, 65, d)
                .dv(dv)
                .causal()
                .dtype(DTYPES[(n + 1) % 3])
                .layout(Layout::Bhnd),
        );
    }
    check_backward_cases("backward head_dims", 120_000, &cases);
}

/// Batch sizes, GQA and MQA, each option alone and combined, both layouts.
#[test]
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
        base(11).scale(0.4),
        base(12).heads(8, 1).batch(3),
        base(13).heads(6, 3).batch(1).layout(Layout::Bhnd),
        base(14)
            .causal()
            .softcap(10.0)
            .alibi(Alibi::PerBatchHead)
            .bias([true, false, true, true]),
        base(15)
            .window(Some(20), Some(3))
            .softcap(1.5)
            .bias([false, false, true, true])
            .layout(Layout::Bhnd),
    ];
    check_backward_cases("backward options", 130_000, &cases);
}

/// Packed variable-length batches with uneven and empty sequences.
#[test]
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
    check_backward_cases("backward varlen", 140_000, &cases);
}

/// The relative-position table's gradient (and the others) over the forward grid's table cases.
#[test]
fn rel_bias() {
    check_backward_cases("backward rel_bias", 190_000, &common::grid::rel_bias());
}
