//! The forward pass against the f64 oracle over the grid of the core issue. Each axis (sequence
//! lengths, head dims, batch and GQA ratios, every mask option alone and combined, dtypes, layouts,
//! varlen, head_dim_v) has every one of its values in some case; the axes are not multiplied out.
//!
//! Bounds: f32 relative error ≤ 1e-5; f16/bf16 within 2× the standard attention's error in the
//! same precision (+1e-6, see `common::HALF_FLOOR`); lse as in `common::lse_tolerance`.

mod common;

use common::{Case, Layout, check_forward_cases, grid};
use flashattn::{AttentionParams, DType, Element, Tensor};

/// Every sequence length as Nq and as Nk, equal and unequal, unmasked and causal.
#[test]
fn sequence_lengths() {
    check_forward_cases("sequence_lengths", 10_000, &grid::sequence_lengths());
}

/// Every head dimension, in every dtype.
#[test]
fn head_dims() {
    check_forward_cases("head_dims", 20_000, &grid::head_dims());
}

/// head_dim of V different from that of Q and K, including at the extremes 1 and 512.
#[test]
fn head_dim_v_differs() {
    check_forward_cases("head_dim_v_differs", 30_000, &grid::head_dim_v_differs());
}

/// Batch sizes and GQA ratios, MQA included.
#[test]
fn batch_and_gqa() {
    check_forward_cases("batch_and_gqa", 40_000, &grid::batch_and_gqa());
}

/// Each mask option alone, on unequal lengths both ways.
#[test]
fn options_alone() {
    check_forward_cases("options_alone", 50_000, &grid::options_alone());
}

/// Options combined, the way models use them.
#[test]
fn options_combined() {
    check_forward_cases("options_combined", 60_000, &grid::options_combined());
}

/// Every dtype in both memory layouts, plain and with options.
#[test]
fn dtypes_and_layouts() {
    check_forward_cases("dtypes_and_layouts", 70_000, &grid::dtypes_and_layouts());
}

/// Packed variable-length batches with uneven lengths, empty sequences included.
#[test]
fn varlen() {
    check_forward_cases("varlen", 80_000, &grid::varlen());
}

/// The relative-position table alone and with every other option.
#[test]
fn rel_bias() {
    check_forward_cases("rel_bias", 90_000, &grid::rel_bias());
}

/// Decoding steps (one query) with the query heads of a key/value head as a panel's lanes:
/// GQA groups below, at and beyond one panel (2, 4, 16, 32 heads), key counts over several key
/// blocks, masks that cut the keys from the left, softcap, every dtype, both layouts and a
/// packed batch with sequences of 0 and 1 query. ALiBi and a bias keep lanes of queries; one
/// case of each checks that they still decode right.
#[test]
fn decode_heads_as_lanes() {
    let cases = [
        Case::new(1, 700, 64).heads(8, 4),
        Case::new(1, 700, 64).heads(8, 2).causal(),
        Case::new(1, 1000, 128).heads(32, 8).dtype(DType::BF16),
        Case::new(1, 513, 64)
            .heads(32, 1)
            .dtype(DType::F16)
            .layout(Layout::Bhnd),
        Case::new(1, 300, 80)
            .heads(16, 1)
            .window(Some(100), Some(0))
            .softcap(20.0),
        Case::new(1, 257, 32)
            .batch(3)
            .heads(6, 2)
            .window(Some(7), None),
        Case::new(1, 64, 512).heads(4, 2).dv(16),
        Case::new(1, 400, 64)
            .heads(8, 2)
            .alibi(common::Alibi::PerHead),
        Case::new(1, 400, 64)
            .heads(4, 1)
            .bias([false, true, true, true]),
        Case::new(1, 1, 64)
            .heads(6, 3)
            .varlen(&[(1, 300), (0, 17), (1, 1), (1, 0)]),
    ];
    check_forward_cases("decode_heads_as_lanes", 95_000, &cases);
}

/// Decoding steps by the matrix-vector kernels (value dims a multiple of 16): every group size
/// of the AVX-512 kernels' head blocks (1-4 heads and their remainders) and groups of more than
/// 16 heads (states of 16 lanes), head dims that end in a partial vector, value dims of 1 to 32
/// vectors, and key counts around the 16-key groups and 64-key blocks.
#[test]
fn decode_group_kernels() {
    let mut cases = Vec::new();
    for (g, hk) in [
        (1, 3),
        (2, 2),
        (3, 1),
        (4, 2),
        (5, 1),
        (6, 1),
        (8, 1),
        (16, 1),
        (17, 1),
        (33, 2),
    ] {
        for (nk, d, dv) in [
            (1, 64, 64),
            (15, 17, 16),
            (16, 1, 48),
            (17, 100, 128),
            (63, 128, 32),
            (64, 8, 16),
            (65, 64, 512),
            (129, 512, 64),
            (1000, 96, 96),
        ] {
            cases.push(Case::new(1, nk, d).heads(g * hk, hk).dv(dv));
        }
    }
    cases.extend([
        Case::new(1, 700, 128)
            .heads(8, 2)
            .dtype(DType::BF16)
            .softcap(15.0),
        // f16 and bf16 rows read in place, head dims ending in a partial vector.
        Case::new(1, 70, 17).heads(4, 2).dtype(DType::BF16),
        Case::new(1, 33, 100).heads(3, 1).dtype(DType::F16),
        Case::new(1, 129, 1).heads(2, 2).dtype(DType::BF16).dv(32),
        Case::new(1, 333, 64)
            .heads(12, 4)
            .dtype(DType::F16)
            .layout(Layout::Bhnd)
            .window(Some(40), Some(0)),
        Case::new(1, 200, 32).heads(5, 5).batch(2).causal(),
        Case::new(1, 1, 48)
            .heads(6, 2)
            .varlen(&[(1, 90), (1, 0), (0, 5), (1, 65)]),
        // ALiBi (per head, per sequence and head) and biases broadcast in every way, with
        // softcap, and split over keys.
        Case::new(1, 300, 64)
            .heads(8, 2)
            .alibi(common::Alibi::PerHead),
        Case::new(1, 200, 32)
            .batch(3)
            .heads(4, 4)
            .alibi(common::Alibi::PerBatchHead)
            .softcap(20.0),
        Case::new(1, 150, 64)
            .heads(6, 3)
            .bias([false, true, true, true]),
        Case::new(1, 130, 48)
            .batch(2)
            .heads(4, 1)
            .dtype(DType::BF16)
            .bias([true, true, false, true])
            .window(Some(90), Some(0)),
        Case::new(1, 2500, 64)
            .heads(8, 4)
            .alibi(common::Alibi::PerHead)
            .bias([true, false, true, true]),
        // Value dims that are not a multiple of 16 (padded rows).
        Case::new(1, 200, 64).heads(8, 2).dv(8),
        Case::new(1, 90, 17).heads(6, 3).dv(40).dtype(DType::BF16),
        Case::new(1, 100, 1)
            .heads(3, 1)
            .dv(17)
            .dtype(DType::F16)
            .layout(Layout::Bhnd),
        Case::new(1, 2500, 33).heads(4, 1).dv(1),
        // Few groups for the threads: keys split between tasks and the runs combined.
        Case::new(1, 5000, 64).heads(4, 1),
        Case::new(1, 5000, 64).heads(8, 4),
        Case::new(1, 3000, 64).heads(40, 1),
        Case::new(1, 4000, 32).heads(6, 3).layout(Layout::Bhnd),
        Case::new(1, 3000, 128).heads(1, 1).softcap(10.0),
        Case::new(1, 2100, 32)
            .heads(2, 1)
            .dtype(DType::BF16)
            .window(Some(1500), Some(0)),
        Case::new(1, 1, 16)
            .heads(3, 1)
            .varlen(&[(1, 4000), (1, 0), (0, 10), (1, 1030)]),
    ]);
    check_forward_cases("decode_group_kernels", 96_000, &cases);
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
