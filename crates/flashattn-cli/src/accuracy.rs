//! Errors of flashattn against the f64 oracle and the bounds they must meet: the same measures
//! and bounds as the test suite (`tests/common/measure.rs`).
//!
//! * Forward: relative error `‖out − oracle‖ / ‖oracle‖` and the log-sum-exp's largest
//!   `|lse − oracle| / max(1, |oracle|)`.
//! * Backward: each gradient's `‖g − ref‖` relative to the magnitude of the terms it sums
//!   (`oracle::backward_magnitudes`: rows of dS sum to zero, so a gradient can be a near-cancelling
//!   difference), against `oracle::backward_given_out` for the output flashattn's forward returned
//!   (the FlashAttention-2 backward reads that stored output by design).
//! * Bounds: f32 ≤ 1e-5; f16/bf16 within 2× the standard attention's error in the same precision
//!   (plus a floor of 1e-6 for outputs every method gets exactly).

use flashattn::reference::{oracle, standard};
use flashattn::{DType, Device, Tensor};

use super::CliResult;
use super::device;
use super::inputs::Inputs;

/// f32 bound of the relative error.
pub const F32_TOL: f64 = 1e-5;
/// Absolute floor added to 2× the standard attention's error (far below half precision's 4.9e-4).
pub const HALF_FLOOR: f64 = 1e-6;

/// The bound for `dtype`, given the standard attention's error in the same precision.
pub fn tolerance(dtype: DType, standard_err: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => 2.0 * standard_err + HALF_FLOOR,
    }
}

/// The log-sum-exp bound: computed in f32 for every dtype, so f32's bound, or the
/// same-precision rule when it is looser.
pub fn lse_tolerance(dtype: DType, standard_lse: f64) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::F16 | DType::BF16 => F32_TOL.max(2.0 * standard_lse),
    }
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Largest `|a − b|`, infinite when either holds a NaN.
pub fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() { f64::INFINITY } else { m.max(d) }
    })
}

/// `‖a − b‖ / denom`: 0 when `a = b`, infinite for a NaN or a zero `denom` with `a ≠ b`.
pub fn rel(a: &[f64], b: &[f64], denom: f64) -> f64 {
    let d = norm(&a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>());
    if d == 0.0 {
        0.0
    } else if d.is_nan() || denom == 0.0 {
        f64::INFINITY
    } else {
        d / denom
    }
}

/// Largest `|a − b| / max(1, |b|)` of log-sum-exps; −∞ must match −∞ exactly (rows that see no
/// key), otherwise the error is infinite.
pub fn lse_error(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0, |m, (&x, &y)| {
        if x.is_nan() || (x == f64::NEG_INFINITY) != (y == f64::NEG_INFINITY) {
            f64::INFINITY
        } else if y == f64::NEG_INFINITY {
            m
        } else {
            m.max((x - y).abs() / y.abs().max(1.0))
        }
    })
}

/// The forward's errors and bounds.
#[derive(Clone, Debug)]
pub struct ForwardCheck {
    /// Largest absolute error of the output.
    pub max_abs: f64,
    /// Relative error of the output.
    pub rel: f64,
    /// The bound `rel` must meet.
    pub bound: f64,
    /// Largest relative error of the log-sum-exp.
    pub lse: f64,
    /// The bound `lse` must meet.
    pub lse_bound: f64,
    /// The standard attention's relative error (f16/bf16 only: it sets the bound).
    pub standard: Option<f64>,
}

impl ForwardCheck {
    /// The same errors with every bound divided by `factor`.
    pub fn tightened(mut self, factor: f64) -> Self {
        self.bound /= factor;
        self.lse_bound /= factor;
        self
    }

    /// Whether every error is within its bound.
    pub fn pass(&self) -> bool {
        self.rel <= self.bound && self.lse <= self.lse_bound
    }
}

/// The error of one gradient.
#[derive(Clone, Debug)]
pub struct GradientCheck {
    /// `dq`, `dk`, `dv`, `dbias` or `drel_bias`.
    pub name: &'static str,
    /// Largest absolute error.
    pub max_abs: f64,
    /// Error relative to the magnitude of the summed terms.
    pub rel: f64,
    /// The bound `rel` must meet.
    pub bound: f64,
    /// The standard attention's error by the same measure (f16/bf16 only: it sets the bound).
    pub standard: Option<f64>,
}

/// Every gradient's error.
#[derive(Clone, Debug)]
pub struct BackwardCheck {
    /// One entry per gradient.
    pub grads: Vec<GradientCheck>,
}

impl BackwardCheck {
    /// The same errors with every bound divided by `factor`.
    pub fn tightened(mut self, factor: f64) -> Self {
        self.grads.iter_mut().for_each(|g| g.bound /= factor);
        self
    }

    /// Whether every gradient is within its bound.
    pub fn pass(&self) -> bool {
        self.grads.iter().all(|g| g.rel <= g.bound)
    }

    /// The gradient furthest from its bound (by error / bound).
    pub fn worst(&self) -> Option<&GradientCheck> {
        self.grads
            .iter()
            .max_by(|a, b| (a.rel / a.bound).total_cmp(&(b.rel / b.bound)))
    }
}

/// Runs flashattn's forward on `device` and measures it against the oracle.
pub fn check_forward(x: &Inputs, dtype: DType, dev: Device) -> CliResult<ForwardCheck> {
    let on = device::upload(x, dev)?;
    let f = flashattn::forward(&on.q, &on.k, &on.v, &on.p)?;
    let (out, lse) = (device::download(&f.out)?, device::download(&f.lse)?);
    let o = oracle::forward(&x.q, &x.k, &x.v, &x.p)?;
    let out = out.to_f64_vec()?;
    let lse = lse.to_f64_vec()?;
    let (standard, standard_lse) = match dtype {
        DType::F32 => (None, 0.0),
        DType::F16 | DType::BF16 => {
            // The standard attention where flashattn ran (the GPU baseline on a GPU; the CPU
            // one where the GPU baseline lacks an option).
            let s = standard::forward(&on.q, &on.k, &on.v, &on.p)
                .or_else(|_| standard::forward(&x.q, &x.k, &x.v, &x.p))?;
            let so = device::download(&s.out)?.to_f64_vec()?;
            let err = rel(&so, &o.out, norm(&o.out));
            let slse = device::download(&s.lse)?.to_f64_vec()?;
            (Some(err), lse_error(&slse, &o.lse))
        }
    };
    Ok(ForwardCheck {
        max_abs: max_abs(&out, &o.out),
        rel: rel(&out, &o.out, norm(&o.out)),
        bound: tolerance(dtype, standard.unwrap_or(0.0)),
        lse: lse_error(&lse, &o.lse),
        lse_bound: lse_tolerance(dtype, standard_lse),
        standard,
    })
}

fn listed(g: oracle::OracleGradients) -> Vec<Vec<f64>> {
    let mut v = vec![g.dq, g.dk, g.dv];
    v.extend(g.dbias);
    v.extend(g.drel_bias);
    v
}

fn tensors(g: &flashattn::Gradients) -> CliResult<Vec<(&'static str, Vec<f64>)>> {
    let mut v = vec![
        ("dq", device::download(&g.dq)?.to_f64_vec()?),
        ("dk", device::download(&g.dk)?.to_f64_vec()?),
        ("dv", device::download(&g.dv)?.to_f64_vec()?),
    ];
    if let Some(b) = &g.dbias {
        v.push(("dbias", device::download(b)?.to_f64_vec()?));
    }
    if let Some(t) = &g.drel_bias {
        v.push(("drel_bias", device::download(t)?.to_f64_vec()?));
    }
    Ok(v)
}

/// Runs flashattn's forward and backward on `device` and measures every gradient against the
/// oracle (see the module's notes).
pub fn check_backward(x: &Inputs, dtype: DType, dev: Device) -> CliResult<BackwardCheck> {
    let on = device::upload(x, dev)?;
    let f = flashattn::forward(&on.q, &on.k, &on.v, &on.p)?;
    let g = flashattn::backward(&on.q, &on.k, &on.v, &f.out, &f.lse, &on.dout, &on.p)?;
    let got = tensors(&g)?;
    let out: Tensor = device::download(&f.out)?;
    // The oracle is single-threaded: its three gradients run side by side.
    let (reference, (magnitudes, exact)) = rayon::join(
        || oracle::backward_given_out(&x.q, &x.k, &x.v, &out, &x.dout, &x.p),
        || {
            rayon::join(
                || oracle::backward_magnitudes(&x.q, &x.k, &x.v, &x.dout, &x.p),
                || match dtype {
                    DType::F32 => Ok(None),
                    DType::F16 | DType::BF16 => {
                        oracle::backward(&x.q, &x.k, &x.v, &x.dout, &x.p).map(Some)
                    }
                },
            )
        },
    );
    let (reference, magnitudes) = (listed(reference?), listed(magnitudes?));
    let standard_errs: Option<Vec<f64>> = match exact? {
        None => None,
        Some(exact) => {
            let exact = listed(exact);
            let s = standard::forward(&x.q, &x.k, &x.v, &x.p)?;
            let sg = standard::backward(&x.q, &x.k, &x.v, &s.out, &s.lse, &x.dout, &x.p)?;
            let sg = tensors(&sg)?;
            Some(
                sg.iter()
                    .zip(&exact)
                    .zip(&magnitudes)
                    .map(|(((_, s), e), m)| rel(s, e, norm(m)))
                    .collect(),
            )
        }
    };
    let grads = got
        .into_iter()
        .enumerate()
        .map(|(i, (name, got))| {
            let scale = norm(&magnitudes[i]);
            let standard = standard_errs.as_ref().map(|s| s[i]);
            GradientCheck {
                name,
                max_abs: max_abs(&got, &reference[i]),
                rel: rel(&got, &reference[i], scale),
                bound: tolerance(dtype, standard.unwrap_or(0.0)),
                standard,
            }
        })
        .collect();
    Ok(BackwardCheck { grads })
}
