//! The standard attention baseline against the f64 oracle: exact to f32 rounding in f32, and
//! within a few half-precision roundings in f16/bf16 (it rounds S, P and O to the input dtype).

mod common;

use common::{Alibi, Case, Layout, rel, rng};
use flashattn::DType;
use flashattn::reference::{oracle, standard};

fn cases() -> Vec<Case> {
    vec![
        Case::new(37, 53, 16).heads(4, 2).batch(2).causal(),
        Case::new(64, 64, 32).window(Some(5), Some(3)).softcap(1.5),
        Case::new(20, 9, 8)
            .heads(3, 1)
            .alibi(Alibi::PerBatchHead)
            .bias([true, false, true, true])
            .batch(2),
        Case::new(0, 0, 8)
            .heads(2, 1)
            .varlen(&[(5, 7), (0, 4), (6, 0), (9, 9)])
            .bias([false, true, true, true])
            .layout(Layout::Bhnd)
            .dv(12),
        Case::new(100, 30, 64).causal().layout(Layout::Bhnd).dv(24),
    ]
}

/// Worst acceptable relative error of the standard attention per dtype: a few roundings to the
/// dtype's unit roundoff (2⁻²⁴, 2⁻¹¹, 2⁻⁸), since S, P and O are each rounded once.
fn bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 4.0 * 2f64.powi(-11),
        DType::BF16 => 4.0 * 2f64.powi(-8),
    }
}

#[test]
fn standard_forward_and_backward_match_the_oracle() {
    for (n, case) in cases().into_iter().enumerate() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let case = case.clone().dtype(dtype);
            let x = case.inputs(&mut rng(1000 + n as u64));
            let s = standard::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap();
            let e = rel(&s.out.to_f64_vec().unwrap(), &o.out);
            let g = standard::backward(&x.q, &x.k, &x.v, &s.out, &s.lse, &x.dout, &x.p).unwrap();
            let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).unwrap();
            let mut errs = vec![
                ("out", e),
                ("dq", rel(&g.dq.to_f64_vec().unwrap(), &og.dq)),
                ("dk", rel(&g.dk.to_f64_vec().unwrap(), &og.dk)),
                ("dv", rel(&g.dv.to_f64_vec().unwrap(), &og.dv)),
            ];
            if let (Some(a), Some(b)) = (&g.dbias, &og.dbias) {
                errs.push(("dbias", rel(&a.to_f64_vec().unwrap(), b)));
            }
            println!("case {n} {dtype}: {errs:?}");
            for (what, e) in errs {
                // Gradients go through twice as many roundings (P, dP, dS) as the output.
                let b = if what == "out" {
                    bound(dtype)
                } else {
                    2.0 * bound(dtype)
                };
                assert!(e <= b, "case {n} {dtype} {what}: rel error {e:e} > {b:e}");
            }
        }
    }
}
