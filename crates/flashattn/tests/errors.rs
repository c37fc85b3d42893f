//! Every invalid argument gives a typed error that names the argument and says what was expected
//! and what was given — for flashattn and for the standard attention, which share the validation.
//! (`no_panic.rs` throws random inputs at the same API.)

use flashattn::reference::standard;
use flashattn::{AttentionParams, DType, Error, Tensor, backward, forward};

fn t(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| ((i * 7 + 3) % 11) as f32 * 0.1 - 0.5)
        .collect();
    Tensor::from_vec(data, shape).unwrap()
}

fn th(shape: &[usize], dtype: DType) -> Tensor {
    t(shape).to_dtype(dtype).unwrap()
}

/// Asserts that `r` failed on argument `arg` and that the message contains each of `says`.
fn expect_err<T: std::fmt::Debug>(r: flashattn::Result<T>, arg: &str, says: &[&str]) {
    let err = r.expect_err("an invalid argument must be an error");
    let msg = err.to_string();
    println!("{arg}: {msg}");
    assert_eq!(err.argument(), Some(arg), "wrong argument in: {msg}");
    for s in says {
        assert!(msg.contains(s), "`{msg}` should contain `{s}`");
    }
}

/// Checks the forward of flashattn and of the standard attention.
fn forward_err(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttentionParams, arg: &str, says: &[&str]) {
    expect_err(forward(q, k, v, p), arg, says);
    expect_err(standard::forward(q, k, v, p), arg, says);
}

fn qkv() -> (Tensor, Tensor, Tensor) {
    (t(&[2, 5, 4, 8]), t(&[2, 6, 2, 8]), t(&[2, 6, 2, 8]))
}

#[test]
fn mismatched_shapes() {
    let (q, k, v) = qkv();
    let p = AttentionParams::default();
    forward_err(
        &q,
        &t(&[3, 6, 2, 8]),
        &v,
        &p,
        "k",
        &["batch = 2", "batch = 3"],
    );
    forward_err(
        &q,
        &k,
        &t(&[3, 6, 2, 8]),
        &p,
        "v",
        &["batch = 2", "batch = 3"],
    );
    forward_err(
        &q,
        &k,
        &t(&[2, 7, 2, 8]),
        &p,
        "v",
        &["seqlen = 6", "seqlen = 7"],
    );
    forward_err(
        &q,
        &t(&[2, 6, 2, 9]),
        &v,
        &p,
        "k",
        &["head_dim = 8", "head_dim = 9"],
    );
    forward_err(
        &q,
        &k,
        &t(&[2, 6, 1, 8]),
        &p,
        "v",
        &["heads = 2", "heads = 1"],
    );
}

#[test]
fn heads_not_divisible() {
    let (_, k, v) = qkv();
    let p = AttentionParams::default();
    forward_err(
        &t(&[2, 5, 3, 8]),
        &k,
        &v,
        &p,
        "k",
        &["divides", "(3)", "2 heads"],
    );
    forward_err(&t(&[2, 5, 0, 8]), &k, &v, &p, "k", &["(0)"]);
    let k0 = t(&[2, 6, 0, 8]);
    forward_err(
        &t(&[2, 5, 2, 8]),
        &k0,
        &t(&[2, 6, 0, 8]),
        &p,
        "k",
        &["0 heads"],
    );
}

#[test]
fn head_dim_out_of_range() {
    let p = AttentionParams::default();
    let (q0, k0) = (t(&[1, 3, 1, 0]), t(&[1, 3, 1, 0]));
    forward_err(
        &q0,
        &k0,
        &t(&[1, 3, 1, 4]),
        &p,
        "q",
        &["1..=512", "head_dim = 0"],
    );
    let (q, k) = (t(&[1, 2, 1, 513]), t(&[1, 2, 1, 513]));
    forward_err(
        &q,
        &k,
        &t(&[1, 2, 1, 4]),
        &p,
        "q",
        &["1..=512", "head_dim = 513"],
    );
    let (q, k) = (t(&[1, 2, 1, 4]), t(&[1, 2, 1, 4]));
    forward_err(
        &q,
        &k,
        &t(&[1, 2, 1, 513]),
        &p,
        "v",
        &["1..=512", "head_dim = 513"],
    );
    forward_err(&q, &k, &t(&[1, 2, 1, 0]), &p, "v", &["head_dim = 0"]);
}

#[test]
fn mismatched_dtypes() {
    let (q, k, v) = qkv();
    let p = AttentionParams::default();
    let k16 = k.to_dtype(DType::F16).unwrap();
    forward_err(&q, &k16, &v, &p, "k", &["f32", "f16"]);
    let vb = v.to_dtype(DType::BF16).unwrap();
    forward_err(&q, &k, &vb, &p, "v", &["f32", "bf16"]);
    let q16 = q.to_dtype(DType::F16).unwrap();
    forward_err(&q16, &k, &v, &p, "k", &["f16", "f32"]);
    let r = forward(&q, &k, &v, &p);
    assert!(r.is_ok());
    let err = forward(&q, &k16, &v, &p).unwrap_err();
    assert!(matches!(
        err,
        Error::DType {
            got: DType::F16,
            ..
        }
    ));
}

#[test]
fn wrong_rank() {
    let p = AttentionParams::default();
    let (q3, k3) = (t(&[5, 2, 8]), t(&[6, 2, 8]));
    forward_err(&q3, &k3, &k3, &p, "q", &["4 dimensions", "[5, 2, 8]"]);
    let (q, k, v) = qkv();
    forward_err(&q, &t(&[2, 6, 2, 1, 8]), &v, &p, "k", &["4 dimensions"]);
    let pv = AttentionParams::default().varlen(vec![0, 5], vec![0, 6]);
    forward_err(&q, &k, &v, &pv, "q", &["3 dimensions", "packed"]);
    forward_err(&q3, &k, &k3, &pv, "k", &["3 dimensions"]);
}

#[test]
fn last_dim_not_contiguous() {
    let p = AttentionParams::default();
    // A [1, 5, 8, 2] buffer seen as [1, 5, 2, 8]: the head dimension has stride 2.
    let q = t(&[1, 5, 8, 2]).transpose(2, 3).unwrap();
    let k = t(&[1, 6, 2, 8]);
    forward_err(&q, &k, &k, &p, "q", &["stride 1", "stride 2"]);
    let v = t(&[1, 6, 8, 2]).transpose(2, 3).unwrap();
    forward_err(
        &t(&[1, 5, 2, 8]),
        &k,
        &v,
        &p,
        "v",
        &["stride 1", "stride 2"],
    );
}

#[test]
fn bad_cu_seqlens() {
    let (q, k) = (t(&[10, 2, 8]), t(&[12, 2, 8]));
    let vl = |cq: Vec<i32>, ck: Vec<i32>| AttentionParams::default().varlen(cq, ck);
    let ok = vl(vec![0, 4, 10], vec![0, 5, 12]);
    assert!(forward(&q, &k, &k, &ok).is_ok());
    let cases: Vec<(AttentionParams, &str, Vec<&str>)> = vec![
        (
            vl(vec![0, 6, 4, 10], vec![0, 5, 6, 12]),
            "cu_seqlens_q",
            vec!["non-decreasing", "4"],
        ),
        (
            vl(vec![0, 4, 10], vec![0, 5, 11]),
            "cu_seqlens_k",
            vec!["= 12", "11"],
        ),
        (
            vl(vec![0, 4, 9], vec![0, 5, 12]),
            "cu_seqlens_q",
            vec!["= 10", "9"],
        ),
        (
            vl(vec![0, 4, 11], vec![0, 5, 12]),
            "cu_seqlens_q",
            vec!["= 10", "11"],
        ),
        (
            vl(vec![0, 4, 10], vec![0, 5, 13]),
            "cu_seqlens_k",
            vec!["= 12", "13"],
        ),
        (
            vl(vec![1, 4, 10], vec![0, 5, 12]),
            "cu_seqlens_q",
            vec!["first entry 0", "1"],
        ),
        (
            vl(vec![0, 4, 10], vec![2, 5, 12]),
            "cu_seqlens_k",
            vec!["first entry 0", "2"],
        ),
        (
            vl(vec![], vec![0, 5, 12]),
            "cu_seqlens_q",
            vec!["0 entries"],
        ),
        (
            vl(vec![0, 10], vec![0, 5, 12]),
            "cu_seqlens_k",
            vec!["= 2", "= 3"],
        ),
        (
            vl(vec![0, -3, 10], vec![0, 5, 12]),
            "cu_seqlens_q",
            vec!["non-decreasing", "-3"],
        ),
        (
            vl(vec![0, 4, 10], vec![0, 5, 12, 12]),
            "cu_seqlens_k",
            vec!["= 3", "= 4"],
        ),
    ];
    for (p, arg, says) in cases {
        forward_err(&q, &k, &k, &p, arg, &says);
    }
}

#[test]
fn bad_bias() {
    let (q, k, v) = qkv();
    let p = |b: Tensor| AttentionParams::default().bias(b);
    let full = "[2, 4, 5, 6]";
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[2, 4, 5, 7])),
        "bias",
        &[full, "[2, 4, 5, 7]"],
    );
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[3, 1, 5, 6])),
        "bias",
        &[full, "[3, 1, 5, 6]"],
    );
    forward_err(&q, &k, &v, &p(t(&[1, 2, 5, 6])), "bias", &[full]);
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[5, 6])),
        "bias",
        &["4 dimensions", "[5, 6]"],
    );
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[1, 2, 4, 5, 6])),
        "bias",
        &["4 dimensions"],
    );
    assert!(forward(&q, &k, &v, &p(th(&[1, 4, 1, 6], DType::BF16))).is_ok());
}

#[test]
fn bad_rel_bias() {
    let (q, k, v) = qkv();
    let p = |r: Tensor| AttentionParams::default().rel_bias(r);
    let want = "shape [4, 2L - 1]";
    for shape in [&[4, 6][..], &[2, 5], &[4], &[1, 4, 5], &[4, 0]] {
        let got = format!("{shape:?}");
        forward_err(&q, &k, &v, &p(t(shape)), "rel_bias", &[want, &got]);
    }
    forward_err(
        &q,
        &k,
        &v,
        &p(th(&[4, 5], DType::F16)),
        "rel_bias",
        &["f32", "f16"],
    );
    // A transposed (non-contiguous) view of a valid table is read through a copy.
    let table = t(&[5, 4]).transpose(0, 1).unwrap();
    assert!(forward(&q, &k, &v, &p(table)).is_ok());
}

/// `backward_into` takes a relative-position table's gradient exactly when the call has one.
#[test]
fn rel_bias_gradient_given_exactly_with_a_table() {
    let (q, k, v) = qkv();
    let with = AttentionParams::default().rel_bias(t(&[4, 3]));
    for (p, drel, says) in [
        (&with, None, "a tensor"),
        (&AttentionParams::default(), Some(t(&[4, 3])), "None"),
        (&with, Some(t(&[4, 5])), "[4, 3]"),
    ] {
        let f = forward(&q, &k, &v, p).unwrap();
        let mut g = backward(&q, &k, &v, &f.out, &f.lse, &f.out, p).unwrap();
        g.drel_bias = drel;
        let r = flashattn::backward_into(&q, &k, &v, &f.out, &f.lse, &f.out, p, &mut g);
        expect_err(r, "drel_bias", &[says]);
    }
}

#[test]
fn bad_alibi() {
    let (q, k, v) = qkv();
    let p = |s: Tensor| AttentionParams::default().alibi(s);
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[2])),
        "alibi_slopes",
        &["[4] or [2, 4]", "[2]"],
    );
    forward_err(
        &q,
        &k,
        &v,
        &p(t(&[4, 2])),
        "alibi_slopes",
        &["[4] or [2, 4]", "[4, 2]"],
    );
    forward_err(&q, &k, &v, &p(t(&[1, 4])), "alibi_slopes", &["[1, 4]"]);
    forward_err(
        &q,
        &k,
        &v,
        &p(th(&[4], DType::F16)),
        "alibi_slopes",
        &["f32", "f16"],
    );
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let s = Tensor::from_vec(vec![0.5, bad, 0.25, 0.125], &[4]).unwrap();
        forward_err(
            &q,
            &k,
            &v,
            &p(s),
            "alibi_slopes",
            &["finite", &bad.to_string()],
        );
    }
}

#[test]
fn bad_scale_and_softcap() {
    let (q, k, v) = qkv();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let p = AttentionParams::default().scale(bad);
        forward_err(&q, &k, &v, &p, "scale", &["finite", &bad.to_string()]);
    }
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY, -0.0] {
        let p = AttentionParams::default().softcap(bad);
        forward_err(&q, &k, &v, &p, "softcap", &["> 0", &bad.to_string()]);
    }
}

#[test]
fn backward_bad_out_dout_lse() {
    let (q, k, v) = qkv();
    let p = AttentionParams::default();
    let f = forward(&q, &k, &v, &p).unwrap();
    let (out, lse) = (&f.out, &f.lse);
    let both = |o: &Tensor, l: &Tensor, d: &Tensor, arg: &str, says: &[&str]| {
        expect_err(backward(&q, &k, &v, o, l, d, &p), arg, says);
        expect_err(standard::backward(&q, &k, &v, o, l, d, &p), arg, says);
    };
    assert!(backward(&q, &k, &v, out, lse, out, &p).is_ok());
    both(
        &t(&[2, 5, 4, 7]),
        lse,
        out,
        "out",
        &["[2, 5, 4, 8]", "[2, 5, 4, 7]"],
    );
    both(
        out,
        lse,
        &t(&[2, 5, 2, 8]),
        "dout",
        &["[2, 5, 4, 8]", "[2, 5, 2, 8]"],
    );
    both(
        &th(&[2, 5, 4, 8], DType::F16),
        lse,
        out,
        "out",
        &["f32", "f16"],
    );
    both(
        out,
        lse,
        &th(&[2, 5, 4, 8], DType::BF16),
        "dout",
        &["f32", "bf16"],
    );
    both(out, &t(&[2, 4, 6]), out, "lse", &["[2, 4, 5]", "[2, 4, 6]"]);
    both(out, &t(&[2, 5, 4]), out, "lse", &["[2, 4, 5]"]);
    both(
        out,
        &th(&[2, 4, 5], DType::F16),
        out,
        "lse",
        &["f32", "f16"],
    );
    let strided = t(&[2, 5, 8, 4]).transpose(2, 3).unwrap();
    both(out, lse, &strided, "dout", &["stride 1"]);
    // The backward validates q, k, v and the params as the forward does.
    expect_err(
        backward(&q, &t(&[2, 6, 3, 8]), &t(&[2, 6, 3, 8]), out, lse, out, &p),
        "k",
        &["divides"],
    );
    let bad = AttentionParams::default().softcap(-2.0);
    expect_err(
        backward(&q, &k, &v, out, lse, out, &bad),
        "softcap",
        &["-2"],
    );
}

#[test]
fn bad_tensor_construction() {
    let r = Tensor::from_vec(vec![1.0f32; 5], &[2, 3]);
    assert!(r.unwrap_err().argument().is_some());
    let r = Tensor::from_vec_strided(vec![1.0f32; 6], &[2, 3], &[3], 0);
    assert_eq!(r.unwrap_err().argument(), Some("strides"));
    let r = Tensor::from_vec_strided(vec![1.0f32; 6], &[2, 3], &[3, 1], 1);
    assert!(r.is_err());
    let r = Tensor::from_vec_strided(vec![1.0f32; 6], &[2, 3], &[usize::MAX, 1], 0);
    assert!(r.is_err());
    assert!(t(&[2, 3]).transpose(0, 2).is_err());
    let r = Tensor::from_vec(vec![1.0f32; 2], &[usize::MAX, 2]);
    assert_eq!(r.unwrap_err().argument(), Some("shape"));
    let r = t(&[2, 3]).to_vec::<half::f16>();
    assert_eq!(r.unwrap_err().argument(), Some("T"));
}

/// `from_vec` and `from_slice` make contiguous tensors: the data must hold exactly the shape's
/// element count (more is not silently left out); `from_vec_strided` may view a larger buffer.
#[test]
fn contiguous_constructors_take_exactly_the_shape() {
    for (shape, numel) in [(&[2, 3][..], 6), (&[0, 3], 0), (&[], 1), (&[4, 1, 2], 8)] {
        for len in 0..12 {
            let data: Vec<f32> = (0..len).map(|i| i as f32 - 2.5).collect();
            let results = [
                Tensor::from_vec(data.clone(), shape),
                Tensor::from_slice(&data, shape),
            ];
            for r in results {
                if len == numel {
                    assert_eq!(r.unwrap().to_vec::<f32>().unwrap(), data);
                } else {
                    let want = format!("{numel} elements");
                    let got = format!("{len} elements");
                    expect_err(r, "data", &[&want, &got, &format!("{shape:?}")]);
                }
            }
        }
    }
    let r = Tensor::from_slice(&[flashattn::half::f16::ONE; 7], &[2, 3]);
    expect_err(r, "data", &["6 elements", "7 elements"]);
    let view = Tensor::from_vec_strided(vec![1.0f32; 10], &[2, 3], &[3, 1], 1).unwrap();
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![1.0; 6]);
}

#[test]
fn huge_shapes_are_errors() {
    let err = Tensor::full(&[1 << 62], DType::F32, 0.0).unwrap_err();
    assert_eq!(err.argument(), Some("shape"), "{err}");
    let err = Tensor::from_vec_strided(vec![1.0f32], &[1 << 61], &[0], 0).unwrap_err();
    assert_eq!(err.argument(), Some("shape"), "{err}");
    // q as a stride-0 view of 2^52 rows, v with head_dim 512: the output would hold 2^61 elements.
    let q = Tensor::from_vec_strided(vec![0.5f32], &[1, 1 << 52, 1, 1], &[0; 4], 0).unwrap();
    let p = AttentionParams::default();
    forward_err(
        &q,
        &t(&[1, 1, 1, 1]),
        &t(&[1, 1, 1, 512]),
        &p,
        "v",
        &["2^60", "512"],
    );
    // 2^31 queries and keys (stride-0 views): the standard attention's 2^62-element score
    // matrix cannot be allocated, which is an error, not an abort.
    let q = Tensor::from_vec_strided(vec![0.5f32], &[1, 1 << 31, 1, 1], &[0; 4], 0).unwrap();
    match standard::forward(&q, &q, &q, &p) {
        Err(Error::Unsupported { what, .. }) => assert!(what.contains("score matrix"), "{what}"),
        other => panic!("expected an error, got {:?}", other.map(|_| ())),
    }
}
