//! The forward grid of the core issue as case lists, shared by the CPU tests
//! (`tests/forward_grid.rs`) and the GPU tests (`tests/cuda_forward.rs`). Each axis (sequence
//! lengths, head dims, batch and GQA ratios, every mask option alone and combined, dtypes,
//! layouts, varlen, head_dim_v) has every one of its values in some case; the axes are not
//! multiplied out. `SEEDS` gives each list's first seed.

use super::{Alibi, Case, Layout};
use flashattn::DType;

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
pub const SEQLENS: [usize; 9] = [1, 7, 63, 64, 65, 113, 203, 256, 1000];
pub const HEAD_DIMS: [usize; 9] = [1, 8, 32, 64, 80, 96, 128, 256, 512];

/// Every list with its name and first seed (seed of case `n` = first seed + n).
pub fn all() -> Vec<(&'static str, u64, Vec<Case>)> {
    vec![
        ("sequence_lengths", 10_000, sequence_lengths()),
        ("head_dims", 20_000, head_dims()),
        ("head_dim_v_differs", 30_000, head_dim_v_differs()),
        ("batch_and_gqa", 40_000, batch_and_gqa()),
        ("options_alone", 50_000, options_alone()),
        ("options_combined", 60_000, options_combined()),
        ("dtypes_and_layouts", 70_000, dtypes_and_layouts()),
        ("varlen", 80_000, varlen()),
        ("rel_bias", 90_000, rel_bias()),
    ]
}

/// Every sequence length as Nq and as Nk, equal and unequal, unmasked and causal.
pub fn sequence_lengths() -> Vec<Case> {
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
    cases
}

/// Every head dimension, in every dtype.
pub fn head_dims() -> Vec<Case> {
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
    cases
}

/// head_dim of V different from that of Q and K, including at the extremes 1 and 512.
pub fn head_dim_v_differs() -> Vec<Case> {
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
    cases
}

/// Batch sizes and GQA ratios, MQA included.
pub fn batch_and_gqa() -> Vec<Case> {
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
    cases
}

/// Each mask option alone, on unequal lengths both ways.
pub fn options_alone() -> Vec<Case> {
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
    cases
}

/// Options combined, the way models use them.
pub fn options_combined() -> Vec<Case> {
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
    cases
}

/// Every dtype in both memory layouts, plain and with options.
pub fn dtypes_and_layouts() -> Vec<Case> {
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
    cases
}

/// Packed variable-length batches with uneven lengths, empty sequences included.
pub fn varlen() -> Vec<Case> {
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
    cases
}

/// The relative-position table (`L` from 1 to past the sequence lengths) alone and with every
/// other option: unequal lengths both ways, causal and windows, GQA, a decoding step, packed
/// variable lengths, both layouts. Small sizes: forward and backward use it on the CPU and GPU.
pub fn rel_bias() -> Vec<Case> {
    vec![
        Case::new(1, 1, 8).rel_bias(1),
        Case::new(7, 63, 16).rel_bias(4).causal(),
        Case::new(63, 7, 32).rel_bias(9).dtype(DType::BF16),
        Case::new(65, 113, 32)
            .heads(4, 2)
            .window(Some(8), Some(3))
            .rel_bias(17)
            .dtype(DType::F16),
        Case::new(113, 65, 64)
            .batch(2)
            .heads(6, 2)
            .causal()
            .softcap(5.0)
            .alibi(Alibi::PerBatchHead)
            .bias([false, true, true, true])
            .rel_bias(300),
        Case::new(1, 203, 64)
            .batch(2)
            .heads(8, 2)
            .alibi(Alibi::PerHead)
            .rel_bias(50)
            .dtype(DType::BF16),
        Case::new(64, 64, 80)
            .heads(2, 1)
            .rel_bias(64)
            .softcap(2.0)
            .layout(Layout::Bhnd),
        Case::new(0, 0, 32)
            .varlen(&[(5, 9), (0, 4), (17, 0), (33, 33), (1, 20)])
            .heads(4, 2)
            .causal()
            .softcap(3.0)
            .bias([true, false, true, true])
            .rel_bias(6)
            .dtype(DType::F16),
        Case::new(0, 0, 64)
            .varlen(&[(40, 90), (90, 40)])
            .heads(3, 1)
            .window(Some(20), Some(5))
            .alibi(Alibi::PerBatchHead)
            .rel_bias(33)
            .layout(Layout::Bhnd),
    ]
}
