//! `forward_into` and `backward_into`: the same results as `forward` and `backward`, written
//! into caller-owned tensors of any disjoint layout (poisoned with NaN first, so an element
//! left unwritten shows), call after call; and a typed error, with nothing written, for every
//! output that cannot take the result.

mod common;

use common::{Case, bits, padded, rng};
use flashattn::{
    AttentionParams, DType, Error, Gradients, Tensor, Window, backward, backward_into, forward,
    forward_into,
};

/// A NaN-filled contiguous tensor of `shape` (f32) starting at offset 2 of its buffer.
fn contiguous_at_offset(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let strides: Vec<usize> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    Tensor::full(&[n + 2], DType::F32, f32::NAN)
        .unwrap()
        .view(shape, &strides, 2)
        .unwrap()
}

#[test]
fn forward_into_writes_what_forward_returns_in_any_layout() {
    for (i, case) in common::output_cases().iter().enumerate() {
        let x = case.inputs(&mut rng(4100 + i as u64));
        let want = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let mut out = padded(want.out.shape(), case.dtype);
        let mut lse = contiguous_at_offset(want.lse.shape());
        for call in 0..2 {
            forward_into(&x.q, &x.k, &x.v, &x.p, &mut out, &mut lse).unwrap();
            assert_eq!(bits(&out), bits(&want.out), "case {i}, call {call}: out");
            assert_eq!(bits(&lse), bits(&want.lse), "case {i}, call {call}: lse");
        }
    }
}

#[test]
fn backward_into_writes_what_backward_returns_in_any_layout() {
    for (i, case) in common::output_cases().iter().enumerate() {
        let x = case.inputs(&mut rng(4200 + i as u64));
        let f = forward(&x.q, &x.k, &x.v, &x.p).unwrap();
        let want = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).unwrap();
        let mut g = Gradients {
            dq: padded(x.q.shape(), case.dtype),
            dk: padded(x.k.shape(), case.dtype),
            dv: padded(x.v.shape(), case.dtype),
            // NaN: the bias gradient is accumulated, so it must be zeroed by the call.
            dbias: want.dbias.as_ref().map(|d| contiguous_at_offset(d.shape())),
            drel_bias: want
                .drel_bias
                .as_ref()
                .map(|d| contiguous_at_offset(d.shape())),
        };
        for call in 0..2 {
            backward_into(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p, &mut g).unwrap();
            for (name, got, want) in [
                ("dq", &g.dq, &want.dq),
                ("dk", &g.dk, &want.dk),
                ("dv", &g.dv, &want.dv),
            ] {
                assert_eq!(bits(got), bits(want), "case {i}, call {call}: {name}");
            }
            let dbias = (g.dbias.as_ref().map(bits), want.dbias.as_ref().map(bits));
            assert_eq!(dbias.0, dbias.1, "case {i}, call {call}: dbias");
            let drel = (
                g.drel_bias.as_ref().map(bits),
                want.drel_bias.as_ref().map(bits),
            );
            assert_eq!(drel.0, drel.1, "case {i}, call {call}: drel_bias");
        }
    }
}

/// Asserts that `r` failed on argument `arg` with a message containing `says`.
fn expect_err(r: flashattn::Result<()>, arg: &str, says: &str) {
    let err = r.expect_err("an output that cannot take the result must be an error");
    let msg = err.to_string();
    println!("{arg}: {msg}");
    assert_eq!(err.argument(), Some(arg), "{msg}");
    assert!(msg.contains(says), "`{msg}` should contain `{says}`");
}

fn all_nan(t: &Tensor) -> bool {
    t.to_f32_vec().unwrap().iter().all(|x| x.is_nan())
}

#[test]
fn outputs_that_cannot_take_the_result_are_typed_errors_and_nothing_is_written() {
    let x = Case::new(5, 6, 8)
        .batch(2)
        .heads(4, 2)
        .inputs(&mut rng(4300));
    let (q, k, v, p) = (&x.q, &x.k, &x.v, &x.p);
    let out_shape = [2, 5, 4, 8];
    let lse_shape = [2, 4, 5];
    let nan = |shape: &[usize], dtype| Tensor::full(shape, dtype, f32::NAN).unwrap();

    let mut lse = nan(&lse_shape, DType::F32);
    let mut bad = nan(&[2, 5, 4, 7], DType::F32);
    expect_err(
        forward_into(q, k, v, p, &mut bad, &mut lse),
        "out",
        "shape [2, 5, 4, 8]",
    );
    let mut bad = nan(&out_shape, DType::F16);
    expect_err(forward_into(q, k, v, p, &mut bad, &mut lse), "out", "f32");
    let mut out = nan(&out_shape, DType::F32);
    let other = out.clone();
    expect_err(
        forward_into(q, k, v, p, &mut out, &mut lse),
        "out",
        "shared",
    );
    drop(other);
    // Every head at the same place: one element reached four times.
    let mut overlapping = nan(&[2 * 5 * 8], DType::F32)
        .view(&out_shape, &[40, 8, 0, 1], 0)
        .unwrap();
    expect_err(
        forward_into(q, k, v, p, &mut overlapping, &mut lse),
        "out",
        "reach every element once",
    );
    let mut columns = nan(&[2, 5, 8, 4], DType::F32).transpose(2, 3).unwrap();
    expect_err(
        forward_into(q, k, v, p, &mut columns, &mut lse),
        "out",
        "stride",
    );
    let mut strided_lse = nan(&[2, 5, 4], DType::F32).transpose(1, 2).unwrap();
    expect_err(
        forward_into(q, k, v, p, &mut out, &mut strided_lse),
        "lse",
        "contiguous",
    );
    // Rows padded: a contiguous last dimension, but not row-major as the kernels index it.
    let mut padded_lse = nan(&[2 * 4 * 6], DType::F32)
        .view(&lse_shape, &[24, 6, 1], 0)
        .unwrap();
    expect_err(
        forward_into(q, k, v, p, &mut out, &mut padded_lse),
        "lse",
        "row-major",
    );
    let mut lse_f16 = nan(&lse_shape, DType::F16);
    expect_err(
        forward_into(q, k, v, p, &mut out, &mut lse_f16),
        "lse",
        "f32",
    );
    assert!(
        all_nan(&out) && all_nan(&lse),
        "an invalid call wrote its outputs"
    );

    let f = forward(q, k, v, p).unwrap();
    let fresh = |t: &Tensor| nan(t.shape(), DType::F32);
    let mut g = Gradients {
        dq: fresh(q),
        dk: fresh(&x.k.transpose(1, 2).unwrap()),
        dv: fresh(v),
        dbias: None,
        drel_bias: None,
    };
    let call = |g: &mut Gradients, p: &AttentionParams| {
        backward_into(q, k, v, &f.out, &f.lse, &x.dout, p, g)
    };
    expect_err(call(&mut g, p), "dk", "shape [2, 6, 2, 8]");
    g.dk = fresh(k);
    g.dbias = Some(nan(&[1, 4, 5, 6], DType::F32));
    expect_err(call(&mut g, p), "dbias", "None");
    let with_bias = AttentionParams {
        bias: Some(Tensor::full(&[1, 4, 5, 6], DType::F32, 0.5).unwrap()),
        window: Window::CAUSAL,
        ..p.clone()
    };
    g.dbias = None;
    expect_err(call(&mut g, &with_bias), "dbias", "a tensor");
    g.dbias = Some(nan(&[1, 4, 6, 5], DType::F32).transpose(2, 3).unwrap());
    expect_err(call(&mut g, &with_bias), "dbias", "contiguous");
    assert!(
        [&g.dq, &g.dk, &g.dv].iter().all(|t| all_nan(t)),
        "an invalid call wrote its gradients"
    );
    let Err(Error::InvalidArgument { .. }) = call(&mut g, &with_bias) else {
        panic!("still invalid");
    };
}
