//! No input makes the public API panic: proptest (fixed seed) throws random shapes, strides,
//! dtypes and options at forward and backward (flashattn's and the standard attention's), which
//! must return `Ok` or a typed `Err`.

use flashattn::reference::standard;
use flashattn::{
    AttentionParams, DType, Gradients, Tensor, backward, backward_into, forward, forward_into,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};

/// The proptest seed (printed by each property, so a failure can be replayed).
const SEED: u64 = 20261122;

/// Random ranks 2 to 5 with sizes 0 to 5, the last (head) dimension sometimes 512 or 513.
fn arb_shape() -> impl Strategy<Value = Vec<usize>> {
    (
        prop::collection::vec(0usize..6, 1..5),
        prop_oneof![8 => 0usize..6, 1 => Just(512usize), 1 => Just(513usize)],
    )
        .prop_map(|(mut lead, last)| {
            lead.push(last);
            lead
        })
}

/// A random tensor (f32, f16 or bf16), sometimes seen through a transpose of its two dimensions
/// before the last.
fn arb_tensor() -> impl Strategy<Value = Tensor> {
    (arb_shape(), 0usize..3, any::<bool>(), any::<u64>()).prop_map(
        |(shape, dtype, transpose, seed)| {
            let n: usize = shape.iter().product();
            let mut x = seed;
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect();
            let t = Tensor::from_vec(data, &shape).unwrap();
            let t = t
                .to_dtype([DType::F32, DType::F16, DType::BF16][dtype])
                .unwrap();
            let r = t.rank();
            if transpose && r >= 3 {
                t.transpose(r - 3, r - 2).unwrap()
            } else {
                t
            }
        },
    )
}

fn arb_params() -> impl Strategy<Value = AttentionParams> {
    let f = prop_oneof![
        Just(f32::NAN),
        Just(-1.0f32),
        Just(0.0f32),
        Just(0.3f32),
        Just(f32::INFINITY)
    ];
    let cu = prop::collection::vec(-1i32..8, 0..5);
    (
        prop::option::weighted(0.3, f.clone()),
        prop::option::weighted(0.3, f),
        prop::option::weighted(0.3, prop_oneof![0usize..4, Just(usize::MAX)]),
        prop::option::weighted(0.3, prop_oneof![0usize..4, Just(usize::MAX)]),
        prop::option::weighted(0.3, arb_tensor()),
        prop::option::weighted(0.3, arb_tensor()),
        prop::option::weighted(0.3, (cu.clone(), cu)),
    )
        .prop_map(|(scale, softcap, left, right, alibi, bias, varlen)| {
            let mut p = AttentionParams {
                scale,
                softcap,
                window: flashattn::Window::new(left, right),
                alibi_slopes: alibi,
                bias,
                ..Default::default()
            };
            if let Some((cq, ck)) = varlen {
                p = p.varlen(cq, ck);
            }
            p
        })
}

/// Tensors of a random shape `shape`, random dtype index `dtype`, optionally transposed.
fn make(shape: &[usize], dtype: usize, transpose: bool, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let t = Tensor::from_vec(data, shape).unwrap();
    let t = t
        .to_dtype([DType::F32, DType::F16, DType::BF16][dtype])
        .unwrap();
    let r = t.rank();
    if transpose && r >= 3 {
        t.transpose(r - 3, r - 2).unwrap()
    } else {
        t
    }
}

/// q, k, v and, for packed inputs, (cu_seqlens_q, cu_seqlens_k).
type Qkv = (Tensor, Tensor, Tensor, Option<(Vec<i32>, Vec<i32>)>);

/// q, k, v of consistent shapes (padded, or packed with matching cu_seqlens), so that the
/// options decide whether the call is valid.
fn arb_consistent() -> impl Strategy<Value = Qkv> {
    (
        prop::collection::vec((0usize..5, 0usize..5), 0..4),
        1usize..4,
        1usize..3,
        prop_oneof![1usize..9, Just(512usize)],
        1usize..9,
        0usize..3,
        any::<(bool, bool, u64)>(),
    )
        .prop_map(|(lens, hk, g, d, dv, dtype, (transpose, packed, seed))| {
            let (b, h) = (lens.len(), hk * g);
            let nq = lens.iter().map(|l| l.0).max().unwrap_or(0);
            let nk = lens.iter().map(|l| l.1).max().unwrap_or(0);
            if packed {
                let tq: usize = lens.iter().map(|l| l.0).sum();
                let tk: usize = lens.iter().map(|l| l.1).sum();
                let cu = |f: fn(&(usize, usize)) -> usize| {
                    std::iter::once(0)
                        .chain(lens.iter().scan(0, |acc, l| {
                            *acc += f(l) as i32;
                            Some(*acc)
                        }))
                        .collect::<Vec<i32>>()
                };
                (
                    make(&[tq, h, d], dtype, transpose, seed),
                    make(&[tk, hk, d], dtype, transpose, seed ^ 1),
                    make(&[tk, hk, dv], dtype, transpose, seed ^ 2),
                    Some((cu(|l| l.0), cu(|l| l.1))),
                )
            } else {
                (
                    make(&[b, nq, h, d], dtype, transpose, seed),
                    make(&[b, nk, hk, d], dtype, transpose, seed ^ 1),
                    make(&[b, nk, hk, dv], dtype, transpose, seed ^ 2),
                    None,
                )
            }
        })
}

/// A copy of `t` in `dtype` that shares no buffer (random outputs for the `_into` calls).
fn own(t: &Tensor, dtype: DType) -> Tensor {
    t.to_dtype(dtype).unwrap()
}

fn exercise(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttentionParams, dout: &Tensor) {
    let _ = standard::forward(q, k, v, p);
    let (mut out, mut lse) = (own(dout, q.dtype()), own(dout, DType::F32));
    let _ = forward_into(q, k, v, p, &mut out, &mut lse);
    if let Ok(f) = forward(q, k, v, p) {
        let _ = backward(q, k, v, &f.out, &f.lse, &f.out, p);
        let _ = backward(q, k, v, &f.out, &f.lse, dout, p);
        let _ = backward(q, k, v, dout, &f.lse, &f.out, p);
        let _ = standard::backward(q, k, v, &f.out, &f.lse, dout, p);
        let (mut out, mut lse) = (own(&f.out, q.dtype()), own(&f.lse, DType::F32));
        let _ = forward_into(q, k, v, p, &mut out, &mut lse);
        let mut shared = (f.out.clone(), f.lse.clone());
        let _ = forward_into(q, k, v, p, &mut shared.0, &mut shared.1);
        let mut g = Gradients {
            dq: own(q, q.dtype()),
            dk: own(k, q.dtype()),
            dv: own(dout, v.dtype()),
            dbias: p.bias.as_ref().map(|b| own(b, DType::F32)),
            drel_bias: p.rel_bias.as_ref().map(|t| own(t, DType::F32)),
        };
        let _ = backward_into(q, k, v, &f.out, &f.lse, dout, p, &mut g);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1000,
        rng_seed: RngSeed::Fixed(SEED),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Whatever it is given, forward returns Ok or Err (never panics), and the backward of a
    /// successful forward with random companions does too.
    #[test]
    fn random_inputs_never_panic(
        q in arb_tensor(),
        k in arb_tensor(),
        v in arb_tensor(),
        p in arb_params(),
        dout in arb_tensor(),
    ) {
        println!("proptest seed {SEED}");
        exercise(&q, &k, &v, &p, &dout);
    }

    /// Consistent q, k, v with random (valid or not) options and cu_seqlens: never a panic.
    #[test]
    fn random_options_never_panic(
        (q, k, v, cu) in arb_consistent(),
        p in arb_params(),
        keep_cu in any::<bool>(),
        dout in arb_tensor(),
    ) {
        println!("proptest seed {SEED}");
        let mut p = p;
        if let (Some((cq, ck)), true) = (cu, keep_cu) {
            p = p.varlen(cq, ck);
        }
        exercise(&q, &k, &v, &p, &dout);
    }
}
