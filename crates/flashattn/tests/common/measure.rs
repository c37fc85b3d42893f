//! Error measures against the f64 oracle, the bounds of the tests, and the loops that check a
//! list of cases and report the worst errors.

use flashattn::reference::{oracle, standard};
use flashattn::{DType, Gradients, Tensor, backward, forward};

use super::{Case, Inputs, describe, out_shape, rng};

/// `‖a − b‖ / ‖b‖`; 0 when both are zero, infinite when only `b` is.
pub fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if num == 0.0 {
        0.0
    } else if den == 0.0 {
        f64::INFINITY
    } else {
        (num / den).sqrt()
    }
}

/// The largest `|a − b| / max(1, |b|)` over entries where the reference is finite; panics where
/// one is −∞ and the other is not (rows that see no key must be −∞ exactly) or on NaN.
pub fn lse_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lse lengths differ");
    let mut worst = 0f64;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(!x.is_nan(), "lse[{i}] is NaN");
        if y == f64::NEG_INFINITY || x == f64::NEG_INFINITY {
            assert_eq!(x, y, "lse[{i}]: got {x}, oracle {y}");
        } else {
            worst = worst.max((x - y).abs() / y.abs().max(1.0));
        }
    }
    worst
}

/// Errors of one forward run against the oracle.
#[derive(Clone, Copy, Debug)]
pub struct ForwardErrors {
    /// ‖out − oracle‖ / ‖oracle‖ of flashattn.
    pub out: f64,
    /// The same measure for the standard attention in the same precision.
    pub standard: f64,
    /// Largest |lse − oracle| / max(1, |oracle|) of flashattn.
    pub lse: f64,
    /// The same measure for the standard attention.
    pub standard_lse: f64,
}

/// Runs flashattn's and the standard attention's forward on `x` and measures both against the
/// oracle. Checks that the outputs have no NaN.
pub fn forward_errors(x: &Inputs) -> ForwardErrors {
    let f = flashattn::forward(&x.q, &x.k, &x.v, &x.p).expect("forward");
    let s = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("standard forward");
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p).expect("oracle forward");
    assert_eq!(
        f.out.shape(),
        out_shape(x.q.shape(), x.v.shape()[x.v.rank() - 1])
    );
    assert_eq!(f.out.dtype(), x.q.dtype());
    assert_laid_out_like(&f.out, &x.q, "out");
    assert_laid_out_like(&s.out, &x.q, "standard out");
    let out = f.out.to_f64_vec().unwrap();
    assert!(out.iter().all(|x| x.is_finite()), "non-finite output");
    ForwardErrors {
        out: rel(&out, &o.out),
        standard: rel(&s.out.to_f64_vec().unwrap(), &o.out),
        lse: lse_error(&f.lse.to_f64_vec().unwrap(), &o.lse),
        standard_lse: lse_error(&s.lse.to_f64_vec().unwrap(), &o.lse),
    }
}

/// Asserts that `t` (an output or gradient) has the memory order of `like`: the same order of
/// strides over the dimensions of size > 1 (so a `[B,H,N,D]`-stored q gives a `[B,H,N,D]`-stored
/// output), a contiguous last dimension, and dtype. Empty tensors have no memory order.
pub fn assert_laid_out_like(t: &Tensor, like: &Tensor, what: &str) {
    assert_eq!(t.dtype(), like.dtype(), "{what} dtype");
    if t.numel() == 0 {
        return; // no element, no memory order
    }
    let r = t.rank();
    assert!(
        t.shape()[r - 1] <= 1 || t.strides()[r - 1] == 1,
        "{what}: last dim not contiguous"
    );
    let big = |a: usize| t.shape()[a] > 1 && like.shape()[a] > 1;
    for a in (0..r - 1).filter(|&a| big(a)) {
        for b in (0..r - 1).filter(|&b| big(b) && b != a) {
            assert_eq!(
                t.strides()[a].cmp(&t.strides()[b]),
                like.strides()[a].cmp(&like.strides()[b]),
                "{what} strides {:?} are not in the order of {:?}",
                t.strides(),
                like.strides()
            );
        }
    }
}

/// The absolute floor added to "2× the standard attention's error" so that a standard error of
/// exactly 0 (an output every method gets exactly, e.g. a single visible key) does not demand an
/// error below 0. It is far below any half-precision rounding error (2⁻¹¹ ≈ 4.9e-4).
pub const HALF_FLOOR: f64 = 1e-6;

/// f32 tolerance of the relative output error.
pub const F32_TOL: f64 = 1e-5;

/// The bound flashattn's relative error must meet for `dtype`, given the standard attention's.
pub fn tolerance(dtype: DType, standard_err: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => 2.0 * standard_err + HALF_FLOOR,
    }
}

/// Worst errors seen per dtype, for the summary line of a test.
#[derive(Default)]
pub struct Worst {
    entries: Vec<(DType, f64, f64, f64)>,
}

impl Worst {
    pub fn add(&mut self, dtype: DType, out: f64, ratio: f64, lse: f64) {
        match self.entries.iter_mut().find(|e| e.0 == dtype) {
            Some(e) => {
                e.1 = e.1.max(out);
                e.2 = e.2.max(ratio);
                e.3 = e.3.max(lse);
            }
            None => self.entries.push((dtype, out, ratio, lse)),
        }
    }

    /// Prints one line per dtype (`what`: the quantity measured, e.g. "out" or "gradients").
    pub fn print(&self, test: &str, what: &str) {
        for (t, err, ratio, lse) in &self.entries {
            let lse = if *lse > 0.0 {
                format!(", lse {lse:.2e}")
            } else {
                String::new()
            };
            println!("{test}: worst {t}: {what} rel {err:.2e}, {what} / standard {ratio:.2}{lse}");
        }
    }
}

/// Largest acceptable `|lse − oracle| / max(1, |oracle|)`. The log-sum-exp is computed in f32
/// from the inputs for every dtype, so f32 rounding sets the bound; for f16/bf16 the
/// same-precision rule (2× the standard attention) is allowed when it is the looser one.
pub fn lse_tolerance(dtype: DType, standard_lse: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => F32_TOL.max(2.0 * standard_lse),
    }
}

/// Runs every case's forward against the oracle (seed `seed0 + index`, printed), prints a line
/// per case and the worst errors per dtype, and fails listing every case out of tolerance.
pub fn check_forward_cases(test: &str, seed0: u64, cases: &[Case]) {
    // Outputs the library allocates start as NaN, so an element left unwritten fails the case.
    flashattn::internals::set_poison_outputs(true);
    let mut failures = Vec::new();
    let mut worst = Worst::default();
    for (n, case) in cases.iter().enumerate() {
        let seed = seed0 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let e = forward_errors(&x);
        let tol = tolerance(case.dtype, e.standard);
        let lse_tol = lse_tolerance(case.dtype, e.standard_lse);
        let ok = e.out <= tol && e.lse <= lse_tol;
        println!(
            "[{}] {test} #{n} seed {seed} {}: out rel {:.2e} (standard {:.2e}, bound {:.2e}), lse {:.2e} (bound {:.2e})",
            if ok { "PASS" } else { "FAIL" },
            describe(case),
            e.out,
            e.standard,
            tol,
            e.lse,
            lse_tol
        );
        let ratio = if e.standard > 0.0 {
            e.out / e.standard
        } else {
            0.0
        };
        worst.add(case.dtype, e.out, ratio, e.lse);
        if !ok {
            failures.push(format!("#{n} seed {seed} {}: {e:?}", describe(case)));
        }
    }
    worst.print(test, "out");
    assert!(
        failures.is_empty(),
        "{test}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The gradients of `g` as f64, with their names.
pub fn grads(g: &Gradients) -> Vec<(&'static str, Vec<f64>)> {
    let mut v = vec![
        ("dq", g.dq.to_f64_vec().unwrap()),
        ("dk", g.dk.to_f64_vec().unwrap()),
        ("dv", g.dv.to_f64_vec().unwrap()),
    ];
    if let Some(b) = &g.dbias {
        v.push(("dbias", b.to_f64_vec().unwrap()));
    }
    if let Some(r) = &g.drel_bias {
        v.push(("drel_bias", r.to_f64_vec().unwrap()));
    }
    v
}

pub fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `‖a − b‖ / denom` (0 when a = b).
pub fn diff(a: &[f64], b: &[f64], denom: f64) -> f64 {
    let d = norm(&a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>());
    if d == 0.0 { 0.0 } else { d / denom }
}

/// The error of one gradient against the oracle.
#[derive(Clone, Copy, Debug)]
pub struct GradientError {
    /// `dq`, `dk`, `dv`, `dbias` or `drel_bias`.
    pub name: &'static str,
    /// flashattn's ‖got − oracle‖ / scale, against the oracle's gradient of the
    /// FlashAttention-2 formulation for the output flashattn's forward returned
    /// (`oracle::backward_given_out`); in f32 that is the exact gradient to ~1e-7.
    pub err: f64,
    /// flashattn's error against the exact gradient (reported; in f16/bf16 it includes the
    /// effect of the forward output's rounding, a property of the algorithm).
    pub total: f64,
    /// The standard attention's, by the same measure.
    pub standard: f64,
    /// The error of the reference rounded to the gradient's dtype: the best any result in that
    /// dtype can do.
    pub rounding: f64,
    /// The bound `err` must meet.
    pub bound: f64,
}

/// `values` rounded to `dtype` (to nearest), as f64.
fn rounded_to(dtype: DType, values: &[f64]) -> Vec<f64> {
    values
        .iter()
        .map(|&x| match dtype {
            DType::F32 => x as f32 as f64,
            DType::F16 => half::f16::from_f64(x).to_f64(),
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
        })
        .collect()
}

/// Runs flashattn's and the standard attention's forward and backward on `x` and measures every
/// gradient against the oracle; panics on a non-finite gradient.
///
/// * Scale: errors are relative to the magnitude of the terms each gradient sums
///   (`oracle::backward_magnitudes`), not to the gradient itself: each row of dS sums to 0, so
///   with few visible keys (or a bias broadcast over keys) the gradient is a difference of nearly
///   equal terms, and even the standard attention in f32 is off by more than 1e-5 of it.
/// * Reference: flashattn is compared with `oracle::backward_given_out` for the output its own
///   forward returned — the FlashAttention-2 backward reads that stored output
///   (`D_i = dO_i·out_i`), so in f16/bf16 the output's rounding is part of its answer by design;
///   the error against the exact gradient is reported as `total`. The standard attention (which
///   uses `rowsum(P∘dP)`) is measured against the exact gradient.
/// * Bound: as for the forward, f32 ≤ 1e-5, f16/bf16 within 2× the standard attention, or 2×
///   the error of the reference rounded to the gradient's dtype where that is larger: the two
///   references differ (by the output's rounding), so the standard attention's error against
///   the exact gradient can be far below what the correctly rounded answer to flashattn's
///   reference misses it by. Seen on a single-element dq of f16 (B=1, Nq=1, Nk=15, D=1, Dv=22,
///   ALiBi; proptest seed 77): flashattn's dq was that reference rounded to nearest, 2.8e-6 off
///   it in units of the summed terms, against a bound of 2.2e-6 from the standard attention's
///   lucky 6.1e-7 (the same f16 value, measured against the exact gradient).
pub fn backward_errors(case: &Case, x: &Inputs) -> Vec<GradientError> {
    let f = forward(&x.q, &x.k, &x.v, &x.p).expect("forward");
    let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).expect("backward");
    gradient_errors(case, x, &f.out, &g, [&x.q, &x.k, &x.v])
}

/// The measures of [`backward_errors`] for gradients `g` computed elsewhere (on a GPU) from the
/// host inputs `x`, given the forward output `out` they read (on the host), each gradient laid out
/// like the tensor of `like` (q, k, v as passed to the backward).
pub fn gradient_errors(
    case: &Case,
    x: &Inputs,
    out: &Tensor,
    g: &Gradients,
    like: [&Tensor; 3],
) -> Vec<GradientError> {
    let s = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("standard forward");
    let sg = standard::backward(&x.q, &x.k, &x.v, &s.out, &s.lse, &x.dout, &x.p)
        .expect("standard backward");
    let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).expect("oracle backward");
    let given_out = oracle::backward_given_out(&x.q, &x.k, &x.v, out, &x.dout, &x.p)
        .expect("oracle backward given out");
    let om = oracle::backward_magnitudes(&x.q, &x.k, &x.v, &x.dout, &x.p).expect("magnitudes");
    for (grad, like, what) in [
        (&g.dq, like[0], "dq"),
        (&g.dk, like[1], "dk"),
        (&g.dv, like[2], "dv"),
    ] {
        assert_eq!(grad.shape(), like.shape(), "{what} shape");
        assert_laid_out_like(grad, like, what);
    }
    let listed = |g: flashattn::reference::oracle::OracleGradients| {
        let mut v = vec![g.dq, g.dk, g.dv];
        v.extend(g.dbias);
        v.extend(g.drel_bias);
        v
    };
    let (exact, flash_ref, magnitudes) = (listed(og), listed(given_out), listed(om));
    assert_eq!(
        grads(g).len(),
        exact.len(),
        "a bias gradient exactly with each bias"
    );
    if let (Some(db), Some(bias)) = (&g.dbias, &x.p.bias) {
        assert_eq!(db.shape(), bias.shape(), "dbias shape");
        assert_eq!(db.dtype(), DType::F32, "dbias dtype");
    }
    if let (Some(dr), Some(table)) = (&g.drel_bias, &x.p.rel_bias) {
        assert_eq!(dr.shape(), table.shape(), "drel_bias shape");
        assert_eq!(dr.dtype(), DType::F32, "drel_bias dtype");
    }
    grads(g)
        .into_iter()
        .zip(grads(&sg))
        .zip(exact.iter().zip(&flash_ref).zip(&magnitudes))
        .map(
            |(((name, got), (_, std_got)), ((exact, flash_ref), terms))| {
                assert!(got.iter().all(|v| v.is_finite()), "non-finite {name}");
                // Errors relative to the magnitude of the summed terms (see
                // `oracle::backward_magnitudes`); with no term at all (no visible key) the
                // gradient must be exactly 0.
                let scale = norm(terms);
                let standard = diff(&std_got, exact, scale);
                // The bias gradient is f32 whatever the inputs' dtype.
                let dtype = if name == "dbias" || name == "drel_bias" {
                    DType::F32
                } else {
                    case.dtype
                };
                let rounding = diff(&rounded_to(dtype, flash_ref), flash_ref, scale);
                GradientError {
                    name,
                    err: diff(&got, flash_ref, scale),
                    total: diff(&got, exact, scale),
                    standard,
                    rounding,
                    bound: tolerance(case.dtype, standard.max(rounding)),
                }
            },
        )
        .collect()
}

/// Runs every case's backward against the oracle (seed `seed0 + index`, printed), prints a line
/// per case and the worst errors per dtype, and fails listing every case out of tolerance.
pub fn check_backward_cases(test: &str, seed0: u64, cases: &[Case]) {
    check_backward_cases_with(test, seed0, cases, backward_errors);
}

/// [`check_backward_cases`] with the gradients' errors measured by `errors` (on the host, or on
/// a GPU).
pub fn check_backward_cases_with(
    test: &str,
    seed0: u64,
    cases: &[Case],
    errors: impl Fn(&Case, &Inputs) -> Vec<GradientError>,
) {
    // Outputs the library allocates start as NaN, so an element left unwritten fails the case.
    flashattn::internals::set_poison_outputs(true);
    let mut failures = Vec::new();
    let mut worst = Worst::default();
    for (n, case) in cases.iter().enumerate() {
        let seed = seed0 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let errs = errors(case, &x);
        let ok = errs.iter().all(|g| g.err <= g.bound);
        let line: Vec<String> = errs
            .iter()
            .map(|g| {
                format!(
                    "{} {:.2e} (vs exact {:.2e}; standard {:.2e})",
                    g.name, g.err, g.total, g.standard
                )
            })
            .collect();
        println!(
            "[{}] {test} #{n} seed {seed} {}: {}",
            if ok { "PASS" } else { "FAIL" },
            describe(case),
            line.join(", ")
        );
        for g in &errs {
            let ratio = if g.standard > 0.0 {
                g.err / g.standard
            } else {
                0.0
            };
            worst.add(case.dtype, g.err, ratio, 0.0);
        }
        if !ok {
            failures.push(format!("#{n} seed {seed} {}: {errs:?}", describe(case)));
        }
    }
    worst.print(test, "gradients");
    assert!(
        failures.is_empty(),
        "{test}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
