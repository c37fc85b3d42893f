//! The diagonal offset (`AttentionParams::diagonal`): query `i`'s diagonal at key `i + d`, as ring
//! attention needs for a block of queries against a block of keys elsewhere in the sequence.
//!
//! Forward and backward against the f64 oracle with the grid's bounds (f32 ≤ 1e-5, f16/bf16
//! within 2× the standard attention) for diagonals before, at and past the keys, with every
//! option; the explicit default diagonal bitwise equal to none; rows past the keys; the range
//! check; and attention over keys `[0, n)` as the LSE-merge of attention over `[0, m)` and
//! `[m, n)` (proptest, fixed seed).

mod common;

use common::{Alibi, Case, F32_TOL, Layout, bits, check_backward_cases, check_forward_cases};
use common::{lse_error, rel, rng};
use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, DType, Error, Gradients, MAX_DIAGONAL, Tensor, Window};
use flashattn::{backward, backward_into, forward, forward_into};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};
use rand::SeedableRng;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Diagonals of 65 queries over 113 keys: every row's before the first key, some rows', 0,
/// inside, the default 48, past the last key for some rows and for all.
const DIAGONALS: [i64; 7] = [-70, -20, 0, 30, 48, 100, 120];

/// Diagonals with every option: causal and windows, ALiBi, softcap, biases, GQA, varlen,
/// decoding steps (one query, and one query over keys split between threads), both layouts.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (n, &d) in DIAGONALS.iter().enumerate() {
        let base = Case::new(65, 113, 32).dtype(DTYPES[n % 3]).diagonal(d);
        cases.push(base.clone().causal());
        cases.push(base.clone().window(Some(7), Some(3)).heads(4, 2));
        cases.push(
            base.clone()
                .alibi(Alibi::PerHead)
                .rel_bias(9)
                .softcap(5.0)
                .layout(Layout::Bhnd),
        );
        cases.push(
            base.causal()
                .alibi(Alibi::PerBatchHead)
                .bias([true, false, true, true])
                .batch(2)
                .heads(6, 1),
        );
    }
    let packed = [(5, 9), (0, 4), (17, 0), (33, 33), (40, 12), (1, 70)];
    for (n, d) in [-9i64, 0, 6, 50].into_iter().enumerate() {
        cases.push(
            Case::new(0, 0, 16)
                .heads(3, 1)
                .dtype(DTYPES[n % 3])
                .window(Some(4), Some(2))
                .alibi(Alibi::PerBatchHead)
                .rel_bias(5)
                .varlen(&packed)
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
    cases.push(
        Case::new(1, 3000, 32)
            .heads(2, 1)
            .causal()
            .softcap(10.0)
            .diagonal(1700),
    );
    cases.push(
        Case::new(1, 3000, 32)
            .window(Some(1200), Some(0))
            .diagonal(2500),
    );
    // The extremes of the range: causal rows that see every key, and none.
    cases.push(
        Case::new(20, 30, 8)
            .causal()
            .rel_bias(4)
            .diagonal(MAX_DIAGONAL),
    );
    cases.push(
        Case::new(20, 30, 8)
            .causal()
            .rel_bias(4)
            .diagonal(-MAX_DIAGONAL),
    );
    cases
}

#[test]
fn forward_against_oracle() {
    check_forward_cases("diagonal forward", 310_000, &cases());
}

#[test]
fn backward_against_oracle() {
    check_backward_cases("diagonal backward", 320_000, &cases());
}

/// `diagonal(nk − nq)` is the default: every output and gradient bitwise the same as none.
#[test]
fn the_default_diagonal_is_bitwise_none() {
    let cases = [
        Case::new(203, 113, 64)
            .heads(4, 2)
            .causal()
            .alibi(Alibi::PerHead)
            .rel_bias(9),
        Case::new(70, 150, 32)
            .dtype(DType::BF16)
            .window(Some(20), Some(5))
            .softcap(8.0)
            .layout(Layout::Bhnd),
        Case::new(1, 500, 64)
            .batch(2)
            .heads(8, 1)
            .causal()
            .alibi(Alibi::PerHead),
        // Packed sequences with one nk − nq (4), as the explicit diagonal applies to all.
        Case::new(0, 0, 16)
            .heads(2, 1)
            .dtype(DType::F16)
            .causal()
            .rel_bias(6)
            .varlen(&[(5, 9), (0, 4), (30, 34)]),
    ];
    for (n, case) in cases.into_iter().enumerate() {
        let x = case.inputs(&mut rng(330_000 + n as u64));
        let d = match &case.varlen {
            Some(lens) => (lens[0].1 - lens[0].0) as i64,
            None => case.nk as i64 - case.nq as i64,
        };
        let explicit = x.p.clone().diagonal(d);
        let run = |p: &AttentionParams| {
            let f = forward(&x.q, &x.k, &x.v, p).unwrap();
            let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, p).unwrap();
            let mut all = vec![bits(&f.out), bits(&f.lse), bits(&g.dq), bits(&g.dk)];
            all.push(bits(&g.dv));
            all.extend(g.drel_bias.as_ref().map(bits));
            all
        };
        assert_eq!(
            run(&x.p),
            run(&explicit),
            "case {n}: {}",
            common::describe(&case)
        );
    }
}

/// `forward_into` and `backward_into` take the diagonal as `forward` and `backward` do.
#[test]
fn the_into_calls_take_the_diagonal() {
    let case = Case::new(40, 70, 32)
        .heads(4, 2)
        .causal()
        .alibi(Alibi::PerHead)
        .rel_bias(6);
    let x = case.diagonal(-5).inputs(&mut rng(335_000));
    let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let mut out = Tensor::full(f.out.shape(), DType::F32, f32::NAN).unwrap();
    let mut lse = Tensor::full(f.lse.shape(), DType::F32, f32::NAN).unwrap();
    forward_into(&x.q, &x.k, &x.v, &x.p, &mut out, &mut lse).unwrap();
    assert_eq!((bits(&out), bits(&lse)), (bits(&f.out), bits(&f.lse)));
    let want = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
    let nan = |t: &Tensor| Tensor::full(t.shape(), DType::F32, f32::NAN).unwrap();
    let mut g = Gradients {
        dq: nan(&want.dq),
        dk: nan(&want.dk),
        dv: nan(&want.dv),
        dbias: None,
        drel_bias: want.drel_bias.as_ref().map(nan),
    };
    backward_into(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p, &mut g).unwrap();
    for (a, b) in [(&g.dq, &want.dq), (&g.dk, &want.dk), (&g.dv, &want.dv)] {
        assert_eq!(bits(a), bits(b));
    }
    assert_eq!(
        bits(g.drel_bias.as_ref().unwrap()),
        bits(want.drel_bias.as_ref().unwrap())
    );
}

/// Rows that see no key (a window whose left edge lies past the last key, causal rows whose
/// diagonal lies before the first): output 0, log-sum-exp −∞, and no gradient.
#[test]
fn rows_past_the_keys_see_nothing() {
    let (nq, nk) = (9, 12);
    let cases = [
        Case::new(nq, nk, 16)
            .window(Some(3), Some(0))
            .diagonal(nk as i64 + 4),
        Case::new(nq, nk, 16).causal().diagonal(-(nq as i64)),
    ];
    for (n, case) in cases.into_iter().enumerate() {
        let x = case
            .heads(2, 1)
            .rel_bias(3)
            .inputs(&mut rng(340_000 + n as u64));
        let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        assert!(f.out.to_f32_vec().unwrap().iter().all(|&o| o == 0.0));
        assert!(
            f.lse
                .to_f32_vec()
                .unwrap()
                .iter()
                .all(|&l| l == f32::NEG_INFINITY)
        );
        let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
        for t in [&g.dq, &g.dk, &g.dv, g.drel_bias.as_ref().unwrap()] {
            assert!(t.to_f32_vec().unwrap().iter().all(|&v| v == 0.0));
        }
    }
}

/// A diagonal past ±2^40 is an error naming `diagonal`, for flashattn, the standard attention
/// and the oracle; the bounds themselves are accepted.
#[test]
fn a_diagonal_out_of_range_is_a_typed_error() {
    let x = Case::new(5, 6, 8).causal().inputs(&mut rng(350_000));
    let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    for d in [MAX_DIAGONAL + 1, -MAX_DIAGONAL - 1, i64::MAX, i64::MIN] {
        let p = x.p.clone().diagonal(d);
        let errs = [
            forward(&x.q, &x.k, &x.v, &p).map(|_| ()),
            standard::forward(&x.q, &x.k, &x.v, &p).map(|_| ()),
            oracle::forward(&x.q, &x.k, &x.v, &p).map(|_| ()),
            backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &p).map(|_| ()),
        ];
        for r in errs {
            let err = r.expect_err("an out-of-range diagonal must be an error");
            let msg = err.to_string();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{msg}");
            assert_eq!(err.argument(), Some("diagonal"), "{msg}");
            assert!(
                msg.contains("2^40") && msg.contains(&d.to_string()),
                "{msg}"
            );
        }
    }
    for d in [MAX_DIAGONAL, -MAX_DIAGONAL] {
        forward(&x.q, &x.k, &x.v, &x.p.clone().diagonal(d)).unwrap();
    }
}

/// The proptest seed of the merge property.
const SEED: u64 = 0x5EED_D1A6;

/// Random small problems split at key `m` (0 and n included): the window, ALiBi, the table,
/// softcap, GQA, both layouts, a batch of two.
fn arb_split() -> impl Strategy<Value = (Case, usize, i64)> {
    let side = prop_oneof![2 => Just(None), 3 => (0usize..12).prop_map(Some)];
    (
        (1usize..40, 1usize..70, 1usize..20),
        (
            side.clone(),
            side,
            0usize..3,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        (-80i64..80, 0usize..=100, 1usize..3, 1usize..3),
    )
        .prop_map(
            |((nq, nk, d), (l, r, alibi, table, cap, bhnd), (diag, at, hk, g))| {
                let mut c = Case::new(nq, nk, d)
                    .batch(2)
                    .heads(hk * g, hk)
                    .diagonal(diag);
                c.window = Window::new(l, r);
                c.alibi = [Alibi::None, Alibi::PerHead, Alibi::PerBatchHead][alibi];
                c.rel_bias = table.then_some(7);
                c.softcap = cap.then_some(4.0);
                c.layout = if bhnd { Layout::Bhnd } else { Layout::Bnhd };
                (c, nk * at / 100, diag)
            },
        )
}

/// Keys `keys` of a `[batch, n, heads, dim]` tensor (in either layout), as a view.
fn key_rows(t: &Tensor, keys: std::ops::Range<usize>) -> Tensor {
    let (s, mut shape) = (t.strides().to_vec(), t.shape().to_vec());
    shape[1] = keys.len();
    t.view(&shape, &s, t.offset() + keys.start * s[1]).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        rng_seed: RngSeed::Fixed(SEED),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Attention over keys `[0, n)` with diagonal `d` equals the LSE-merge of attention over
    /// `[0, m)` with `d` and over `[m, n)` with `d − m` (ring attention's step), in f32 to 1e-5.
    #[test]
    fn attention_is_the_merge_of_key_blocks((case, m, d) in arb_split(), seed in any::<u64>()) {
        println!("proptest seed {SEED}");
        let x = case.inputs(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let full = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let part = |keys: std::ops::Range<usize>, d: i64| {
            let (k, v) = (key_rows(&x.k, keys.clone()), key_rows(&x.v, keys));
            let f = forward(&x.q, &k, &v, &x.p.clone().diagonal(d)).unwrap();
            (f.out.to_f64_vec().unwrap(), f.lse.to_f64_vec().unwrap())
        };
        let ((o1, l1), (o2, l2)) = (part(0..m, d), part(m..case.nk, d - m as i64));
        let dv = case.dv;
        let lse: Vec<f64> = l1.iter().zip(&l2).map(|(&a, &b)| {
            let hi = a.max(b);
            if hi == f64::NEG_INFINITY { hi } else { hi + ((a - hi).exp() + (b - hi).exp()).ln() }
        }).collect();
        // out[b, i, h] and lse[b, h, i]: rows of dv, one per (b, i, h).
        let (nq, h) = (case.nq, case.heads);
        let mut out = vec![0f64; o1.len()];
        for (row, o) in out.chunks_exact_mut(dv).enumerate() {
            let (b, i, hh) = (row / (nq * h), row / h % nq, row % h);
            let at = (b * h + hh) * nq + i;
            if lse[at] == f64::NEG_INFINITY {
                continue;
            }
            let (w1, w2) = ((l1[at] - lse[at]).exp(), (l2[at] - lse[at]).exp());
            for (c, o) in o.iter_mut().enumerate() {
                *o = w1 * o1[row * dv + c] + w2 * o2[row * dv + c];
            }
        }
        let e_out = rel(&out, &full.out.to_f64_vec().unwrap());
        let e_lse = lse_error(&lse, &full.lse.to_f64_vec().unwrap());
        prop_assert!(e_out <= F32_TOL && e_lse <= F32_TOL,
            "{} split at {m}: out {e_out:e}, lse {e_lse:e}", common::describe(&case));
    }
}

/// On CUDA tensors a diagonal other than nk − nq is `Unsupported` (the kernels take only the
/// bottom-right one), forward, backward and the GPU standard attention; `nk − nq` runs.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_takes_only_the_default_diagonal() {
    use common::gpu::{GPU, to_device};
    let case = Case::new(20, 30, 32).dtype(DType::F16).heads(2, 1).causal();
    let x = to_device(&case.inputs(&mut rng(360_000)), GPU);
    let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
    let explicit = forward(&x.q, &x.k, &x.v, &x.p.clone().diagonal(10)).unwrap();
    assert_eq!(bits(&f.out), bits(&explicit.out));
    let p = x.p.clone().diagonal(-4);
    let errs = [
        forward(&x.q, &x.k, &x.v, &p).map(|_| ()),
        standard::forward(&x.q, &x.k, &x.v, &p).map(|_| ()),
        backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &p).map(|_| ()),
    ];
    for r in errs {
        let err = r.expect_err("a diagonal the kernels lack must be an error");
        let msg = err.to_string();
        assert!(
            matches!(err, Error::Unsupported { device: "cuda", .. }),
            "{msg}"
        );
        assert!(msg.contains("diagonal = -4"), "{msg}");
    }
}
