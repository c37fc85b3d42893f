//! Vectorized `2^x` for the softmax tiles: AVX-512F or AVX2/FMA on x86-64, whichever is the
//! widest the CPU has (`simd::kernels`, chosen once per process), a portable scalar path otherwise.
//!
//! Attention works in base 2: scores are multiplied by `scale · log2(e)` once, so that
//! `exp(s − m) = 2^(s·log2e − m·log2e)` costs one `exp2` per element and no extra multiply.
//!
//! The portable path computes `2^x = 2^n · 2^f` with `n = round(x)` and `f ∈ [−½, ½]`; `2^f` is
//! a degree-6 polynomial (Chebyshev fit, relative error 1.8e-8 before f32 rounding, so within
//! ~2 ulp overall; a degree-5 fit was barely faster and less accurate in the forward). Inputs
//! below −127 give 0 (−∞ included, so masked scores vanish); inputs above +127 are clamped.
//!
//! AVX-512 has a cheaper route to nearly the same accuracy (see `avx512`): a table of
//! `2^(k/32)` in two registers, a quadratic on `[−1/64, 1/64]` and `vscalefps`, so that only
//! three of its instructions use the FMA pipes. The forward runs it inside the `Vᵀ·Pᵀ` product
//! (`microkernel::softmax_product`), where it takes about 4% of a forward. Worst relative
//! error over the whole range 2.1e-7. AVX2 takes a table too (see `avx2`): 8 entries in one
//! register and a cubic, worst relative error 1.6e-7. Inputs below −126 give 0 rather than a
//! subnormal: on Intel cores a subnormal result costs a microcode assist, which the masked
//! scores of every causal block paid (8% of a causal call; see BENCHMARKS.md).

use crate::cpu::simd::kernels;

/// Coefficients of `2^f` on `[−½, ½]`, lowest degree first.
const EXP2_POLY: [f32; 7] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_503_27,
    0.009_618_025,
    0.001_340_043_3,
    0.000_154_697_32,
];
/// Inputs are clamped to this range: `2^−127` has an all-zero exponent field, i.e. it is 0.
const EXP2_MIN: f32 = -127.0;
const EXP2_MAX: f32 = 127.0;
/// `1.5 · 2^23 + 127`: floats in `[2^23, 2^24)` are integers, so for |x| ≤ 127 `x + ROUNDER` is
/// `round(x) + 127` above `1.5 · 2^23`, i.e. `round(x) + 127` in its low mantissa bits.
const ROUNDER: f32 = 12_582_912.0 + 127.0;

/// `2^x` by the portable path's polynomial (for single values, and the vector kernels' tails).
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    let x = x.clamp(EXP2_MIN, EXP2_MAX);
    let t = x + ROUNDER;
    let f = x - (t - ROUNDER);
    let mut p = EXP2_POLY[6];
    for &c in EXP2_POLY[..6].iter().rev() {
        p = p * f + c;
    }
    p * f32::from_bits(t.to_bits() << 23)
}

/// `x[j] = 2^(x[j] − shift)` for every `j`; returns the sum of the new values.
///
/// With `shift` the row maximum this is the softmax numerator of one tile row (entries of −∞
/// become 0). `shift` must be finite; pass 0 for a row that is all −∞.
pub(crate) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    (kernels().exp2_shifted_sum)(x, shift)
}

/// Lanes of a panel (one per query of a 16-query panel).
pub(crate) const LANES: usize = 16;

/// For a row-major `rows × 16` panel: `x[r][l] = 2^(x[r][l] − shift[l])`; returns the sum of
/// each lane (column) of the new values. `shift` must be finite and at least every element of
/// its lane (a lane maximum, as in the softmax), so that every argument is ≤ 0.
pub(crate) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
    debug_assert_eq!(x.len() % LANES, 0);
    (kernels().exp2_shifted_panel)(x, shift)
}

/// The portable level's kernels.
pub(crate) mod portable {
    use super::{LANES, exp2};

    /// See [`super::exp2_shifted_sum`].
    pub(crate) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
        let mut lanes = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for chunk in &mut chunks {
            for (v, acc) in chunk.iter_mut().zip(&mut lanes) {
                *v = exp2(*v - shift);
                *acc += *v;
            }
        }
        let mut sum: f32 = lanes.iter().sum();
        for v in chunks.into_remainder() {
            *v = exp2(*v - shift);
            sum += *v;
        }
        sum
    }

    /// See [`super::exp2_shifted_panel`].
    pub(crate) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
        let mut sums = [0f32; LANES];
        for row in x.chunks_exact_mut(LANES) {
            for ((v, s), acc) in row.iter_mut().zip(shift).zip(&mut sums) {
                *v = exp2(*v - s);
                *acc += *v;
            }
        }
        sums
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// The relative error that `2^(x − s)` may carry from `x − s` rounded to f32 (half an ulp of
/// the difference, times ln 2), on top of the exponential's own: the vector kernels subtract
/// in f32, except AVX2's with a shift on the grid of eighths, which is exact. 0 for −∞.
#[cfg(test)]
pub(crate) fn shift_rounding(x: f32, s: f32) -> f64 {
    let y = (x - s).abs();
    if !y.is_finite() {
        return 0.0;
    }
    (f32::from_bits(y.to_bits() + 1) - y) as f64 * 0.5 * std::f64::consts::LN_2
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu::simd::{Kernels, Simd};

    /// The kernels of every level this CPU has.
    fn every_level() -> impl Iterator<Item = &'static Kernels> {
        Simd::available().map(Kernels::of)
    }

    #[test]
    fn exp2_is_accurate_and_flushes_minus_infinity() {
        let mut worst = 0f64;
        for i in -40000..=40000 {
            let x = i as f32 * 3e-3;
            let rel = (exp2(x) as f64 / (x as f64).exp2() - 1.0).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(-200.0), 0.0);
    }

    /// The vector kernels of every level this CPU has over the whole range, dense: relative error
    /// 3e-7 for normal results; below 2^-126 they may flush to 0; 0 from −∞, 2^127 at the
    /// top.
    #[test]
    fn vector_exp2_is_accurate_over_the_whole_range() {
        for k in every_level() {
            let mut x: Vec<f32> = (-160 * 4096..=128 * 4096)
                .map(|i| i as f32 / 4096.0 + 1.7e-5)
                .collect();
            x.extend([f32::NEG_INFINITY, 127.0, 300.0, -127.0, -126.0, 0.0]);
            let orig = x.clone();
            (k.exp2_shifted_sum)(&mut x, 0.0);
            for (&got, &o) in x.iter().zip(&orig) {
                let want = (o.min(127.0) as f64).exp2();
                let err = (got as f64 - want).abs();
                if want >= f32::MIN_POSITIVE as f64 {
                    assert!(err <= 3e-7 * want, "2^{o}: {got} vs {want}");
                } else {
                    assert!(err <= f32::MIN_POSITIVE as f64, "2^{o}: {got} vs {want}");
                }
            }
        }
    }

    /// Shifts on the grid of eighths (the softmax's maxima, which the AVX2 kernel folds into
    /// its rounding), off it, and on it but too large to fold.
    #[test]
    fn shifted_panel_matches_f64() {
        for k in every_level() {
            for base in [0.0f32, 0.3, 3.0e5] {
                // At least every value of its lane (base + 20 is the largest), as the softmax
                // passes.
                let shift: [f32; LANES] = std::array::from_fn(|l| base + 20.0 + l as f32 * 0.5);
                for rows in [0, 1, 5, 40] {
                    let orig: Vec<f32> = (0..rows * LANES)
                        .map(|i| {
                            if i % 7 == 2 {
                                f32::NEG_INFINITY
                            } else {
                                base + (i as f32 * 0.41).cos() * 20.0
                            }
                        })
                        .collect();
                    let mut x = orig.clone();
                    let sums = (k.exp2_shifted_panel)(&mut x, &shift);
                    for l in 0..LANES {
                        let (mut want_sum, mut sum_tol) = (0f64, 0f64);
                        for r in 0..rows {
                            let o = orig[r * LANES + l];
                            let want = (o as f64 - shift[l] as f64).exp2();
                            let got = x[r * LANES + l] as f64;
                            let tol = (3e-7 + shift_rounding(o, shift[l])) * want;
                            assert!((got - want).abs() <= tol, "{base}: {got} vs {want}");
                            want_sum += want;
                            sum_tol += tol;
                        }
                        // The terms' own errors, and the f32 sum's.
                        let err = (sums[l] as f64 - want_sum).abs();
                        assert!(err <= sum_tol + 1e-6 * want_sum.max(1e-30), "{base}: sum");
                    }
                }
            }
        }
    }

    #[test]
    fn shifted_sum_matches_scalar_on_every_length() {
        for k in every_level() {
            for n in [0, 1, 7, 8, 15, 16, 17, 33, 256, 259] {
                let orig: Vec<f32> = (0..n)
                    .map(|i| {
                        if i % 5 == 3 {
                            f32::NEG_INFINITY
                        } else {
                            (i as f32 * 0.77).sin() * 30.0
                        }
                    })
                    .collect();
                let shift = 4.5;
                let mut x = orig.clone();
                let sum = (k.exp2_shifted_sum)(&mut x, shift);
                let mut want_sum = 0f64;
                for (got, o) in x.iter().zip(&orig) {
                    let want = ((o - shift) as f64).exp2();
                    want_sum += want;
                    assert!((*got as f64 - want).abs() <= 3e-7 * want, "{got} vs {want}");
                }
                assert!((sum as f64 - want_sum).abs() <= 1e-6 * want_sum.max(1e-30));
            }
        }
    }
}
