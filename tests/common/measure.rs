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
    v
}

/// The bias gradient the FlashAttention backward computes for a bias broadcast over keys: the
/// exact one plus, per query row it sums, rowsum(dO∘O_exact) − rowsum(dO∘O) for the rounded
/// forward output O.
pub fn key_summed_dbias(x: &Inputs, out: &Tensor, exact: &[f64]) -> Vec<f64> {
    let o_exact = oracle::forward(&x.q, &x.k, &x.v, &x.p).unwrap().out;
    let (o, dout) = (out.to_f64_vec().unwrap(), x.dout.to_f64_vec().unwrap());
    let heads = x.q.shape()[x.q.rank() - 2];
    let dv = out.shape()[out.rank() - 1];
    let s = x.p.bias.as_ref().unwrap().shape().to_vec();
    // (sequence, query index) of each packed or flattened query row.
    let rows: Vec<(usize, usize)> = match &x.p.varlen {
        Some(vl) => vl
            .cu_seqlens_q
            .windows(2)
            .enumerate()
            .flat_map(|(b, w)| (0..(w[1] - w[0]) as usize).map(move |i| (b, i)))
            .collect(),
        None => {
            let (b, n) = (x.q.shape()[0], x.q.shape()[1]);
            (0..b * n).map(|r| (r / n, r % n)).collect()
        }
    };
    let pick = |v: usize, n: usize| if n == 1 { 0 } else { v };
    let mut db = exact.to_vec();
    for (r, &(b, i)) in rows.iter().enumerate() {
        for h in 0..heads {
            let at = (r * heads + h) * dv;
            let d: f64 = (0..dv)
                .map(|c| dout[at + c] * (o_exact[at + c] - o[at + c]))
                .sum();
            db[(pick(b, s[0]) * s[1] + pick(h, s[1])) * s[2] + pick(i, s[2])] += d;
        }
    }
    db
}

pub fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `‖a − b‖ / denom` (0 when a = b).
pub fn diff(a: &[f64], b: &[f64], denom: f64) -> f64 {
    let d = norm(&a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>());
    if d == 0.0 { 0.0 } else { d / denom }
}

/// The scale of the bias gradient: its norm, or, when the bias is broadcast over keys, the norm
/// of the gradient of the same bias repeated along the keys (dS before the sum over keys).
pub fn key_summed_scale(x: &Inputs) -> f64 {
    let Some(bias) = &x.p.bias else { return 0.0 };
    let s = bias.shape().to_vec();
    let nk = match &x.p.varlen {
        Some(vl) => (vl.cu_seqlens_k.windows(2))
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0),
        None => x.k.shape()[1],
    };
    let mut p = x.p.clone();
    if s[3] == 1 && nk > 1 {
        let b = bias.to_f32_vec().unwrap();
        let wide: Vec<f32> = b.iter().flat_map(|&v| std::iter::repeat_n(v, nk)).collect();
        p.bias = Some(Tensor::from_vec(wide, &[s[0], s[1], s[2], nk]).unwrap());
    }
    let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &p).unwrap();
    norm(&og.dbias.unwrap())
}

/// The error of one gradient against the oracle.
#[derive(Clone, Copy, Debug)]
pub struct GradientError {
    /// `dq`, `dk`, `dv` or `dbias`.
    pub name: &'static str,
    /// flashattn's ‖got − oracle‖ / scale.
    pub err: f64,
    /// The standard attention's, by the same measure.
    pub standard: f64,
    /// The bound `err` must meet.
    pub bound: f64,
}

/// Runs flashattn's and the standard attention's forward and backward on `x` and measures every
/// gradient against the oracle's analytic one, relative to the oracle gradient's norm. Panics
/// on a non-finite gradient.
///
/// A bias broadcast over keys has an exactly-zero gradient (each row of dS sums to 0), so its
/// error is measured against the norm of the gradient the bias would get per key instead; and in
/// f16/bf16 flashattn's value is compared with what the FlashAttention backward computes there:
/// Σ_j dS_ij = rowsum(dO∘O_exact) − D_i, where D_i = rowsum(dO∘O) uses the forward's output
/// rounded to the dtype (see [`key_summed_dbias`]).
pub fn backward_errors(case: &Case, x: &Inputs) -> Vec<GradientError> {
    let f = forward(&x.q, &x.k, &x.v, &x.p).expect("forward");
    let g = backward(&x.q, &x.k, &x.v, &f.out, &f.lse, &x.dout, &x.p).expect("backward");
    let s = standard::forward(&x.q, &x.k, &x.v, &x.p).expect("standard forward");
    let sg = standard::backward(&x.q, &x.k, &x.v, &s.out, &s.lse, &x.dout, &x.p)
        .expect("standard backward");
    let og = oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).expect("oracle backward");
    for (grad, like, what) in [
        (&g.dq, &x.q, "dq"),
        (&g.dk, &x.k, "dk"),
        (&g.dv, &x.v, "dv"),
    ] {
        assert_eq!(grad.shape(), like.shape(), "{what} shape");
        assert_laid_out_like(grad, like, what);
    }
    let mut reference = vec![og.dq, og.dk, og.dv];
    reference.extend(og.dbias);
    let key_summed_bias = case.bias.is_some_and(|full| !full[3]);
    grads(&g)
        .into_iter()
        .zip(grads(&sg))
        .zip(&reference)
        .map(|(((name, got), (_, std_got)), want)| {
            assert!(got.iter().all(|v| v.is_finite()), "non-finite {name}");
            let key_summed = name == "dbias" && key_summed_bias;
            let scale = if key_summed {
                key_summed_scale(x)
            } else if norm(want) == 0.0 {
                zero_gradient_scale(name, x)
            } else {
                norm(want)
            };
            let standard = diff(&std_got, want, scale);
            let err = if key_summed && case.dtype != DType::F32 {
                diff(&got, &key_summed_dbias(x, &f.out, want), scale)
            } else {
                diff(&got, want, scale)
            };
            GradientError {
                name,
                err,
                standard,
                bound: tolerance(case.dtype, standard),
            }
        })
        .collect()
}

/// The scale of a gradient whose exact value is 0 (with a single visible key, say, where
/// dS = P·(dP − rowsum(P∘dP)) cancels exactly): the bound its entries would have without the
/// cancellation, from |dS_ij| ≤ 2·|dO_i|·max|v_j|: ‖dq‖ ≤ 2·scale·‖dO‖·max‖k_j‖·max‖v_j‖,
/// ‖dk‖ likewise with max‖q_i‖, ‖dbias‖ ≤ 2·‖dO‖·max‖v_j‖. A computed value is measured against it.
fn zero_gradient_scale(name: &str, x: &Inputs) -> f64 {
    let max_row = |t: &Tensor| {
        let dim = t.shape()[t.rank() - 1];
        let data = t.to_f64_vec().unwrap();
        data.chunks(dim.max(1)).map(norm).fold(0.0, f64::max)
    };
    let d = x.q.shape()[x.q.rank() - 1] as f64;
    let scale = x.p.scale.map_or(1.0 / d.sqrt(), f64::from);
    let ds = 2.0 * norm(&x.dout.to_f64_vec().unwrap()) * max_row(&x.v);
    match name {
        "dq" => ds * scale * max_row(&x.k),
        "dk" => ds * scale * max_row(&x.q),
        _ => ds,
    }
}

/// Runs every case's backward against the oracle (seed `seed0 + index`, printed), prints a line
/// per case and the worst errors per dtype, and fails listing every case out of tolerance.
pub fn check_backward_cases(test: &str, seed0: u64, cases: &[Case]) {
    let mut failures = Vec::new();
    let mut worst = Worst::default();
    for (n, case) in cases.iter().enumerate() {
        let seed = seed0 + n as u64;
        let x = case.inputs(&mut rng(seed));
        let errs = backward_errors(case, &x);
        let ok = errs.iter().all(|g| g.err <= g.bound);
        let line: Vec<String> = errs
            .iter()
            .map(|g| format!("{} {:.2e} (standard {:.2e})", g.name, g.err, g.standard))
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
