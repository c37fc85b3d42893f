//! Softcap, `cap · tanh(s / cap)`, over a run of scores, with its derivative `1 − tanh²` for the
//! backward: AVX-512F or AVX2/FMA when the CPU has them, `f32::tanh` otherwise.
//!
//! `tanh(y)` for `|y| < 0.75` is `y + y·u·P(u)` with `u = y²` and `P` of degree 5 (fitted to the
//! relative error, 1.6e-9 before f32 rounding); beyond, `(1 − e)/(1 + e)` with `e = 2^(−2|y|·log2 e)`
//! by the exp module's degree-6 polynomial, where `e ≤ 0.22` keeps that quotient well
//! conditioned; a vector whose lanes all lie below skips it (scores within ¾ of the cap are
//! the common case). `cap · tanh(s / cap)` comes out within 2.7 ulp of the exact value over the whole
//! range, against 3.2 for the scalar `f32::tanh` path (see the test); NaN stays NaN. A scalar
//! `tanh` per score made the forward with softcap 8× slower than without (see BENCHMARKS.md).

use crate::cpu::simd::kernels;

/// Below this `|y|` the polynomial, above it the exponential.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const SPLIT: f32 = 0.75;
/// `P(u)`, lowest degree first.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const POLY: [f32; 6] = [
    -0.333_333_15,
    0.133_326_94,
    -0.053_892_727,
    0.021_452_04,
    -0.007_657_264_5,
    0.001_736_941,
];

/// `x[i] = cap · tanh(x[i] / cap)`, and `deriv[i] = 1 − tanh²(x[i] / cap)` when given (of the same
/// length as `x`).
pub(crate) fn softcap(x: &mut [f32], cap: f32, deriv: Option<&mut [f32]>) {
    if let Some(d) = &deriv {
        assert_eq!(
            d.len(),
            x.len(),
            "softcap: derivative and scores differ in length"
        );
    }
    (kernels().softcap)(x, cap, deriv)
}

/// The portable level's kernel.
pub(crate) mod portable {
    pub(crate) use super::scalar as softcap;
}

/// The reference: `f32::tanh` per element.
pub(crate) fn scalar(x: &mut [f32], cap: f32, deriv: Option<&mut [f32]>) {
    let inv = 1.0 / cap;
    match deriv {
        Some(d) => x.iter_mut().zip(d).for_each(|(v, d)| {
            let t = (*v * inv).tanh();
            *v = cap * t;
            *d = 1.0 - t * t;
        }),
        None => x.iter_mut().for_each(|v| *v = cap * (*v * inv).tanh()),
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::{POLY, SPLIT, scalar};
    use crate::cpu::simd::exp::avx512::exp2_poly_ps;

    /// `tanh` on 16 lanes (see the module doc).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tanh_ps(y: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let yi = _mm512_castps_si512(y);
        let a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, yi));
        let u = _mm512_mul_ps(y, y);
        let mut p = _mm512_set1_ps(POLY[5]);
        for &c in POLY[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(c));
        }
        let small = _mm512_fmadd_ps(_mm512_mul_ps(y, u), p, y);
        // Ordered: NaN takes the polynomial, which keeps it.
        let beyond = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, _mm512_set1_ps(SPLIT));
        if beyond == 0 {
            return small;
        }
        let z = _mm512_mul_ps(a, _mm512_set1_ps(-2.0 * std::f32::consts::LOG2_E));
        let e = exp2_poly_ps(z);
        let one = _mm512_set1_ps(1.0);
        let t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        let large = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(t),
            _mm512_and_si512(sign, yi),
        ));
        _mm512_mask_blend_ps(beyond, small, large)
    }

    /// See [`crate::cpu::simd::softcap`].
    #[target_feature(enable = "avx512f")]
    pub(crate) fn softcap(x: &mut [f32], cap: f32, mut deriv: Option<&mut [f32]>) {
        let (c, inv) = (_mm512_set1_ps(cap), _mm512_set1_ps(1.0 / cap));
        let one = _mm512_set1_ps(1.0);
        let whole = x.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 ≤ x.len(), and deriv has x's length (checked by the caller).
            unsafe {
                let at = x.as_mut_ptr().add(i);
                let t = tanh_ps(_mm512_mul_ps(_mm512_loadu_ps(at), inv));
                _mm512_storeu_ps(at, _mm512_mul_ps(c, t));
                if let Some(d) = deriv.as_deref_mut() {
                    let dt = _mm512_fnmadd_ps(t, t, one);
                    _mm512_storeu_ps(d.as_mut_ptr().add(i), dt);
                }
            }
        }
        scalar(&mut x[whole..], cap, deriv.map(|d| &mut d[whole..]));
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{POLY, SPLIT, scalar};
    use crate::cpu::simd::exp::avx2::exp2_poly_ps;

    /// `tanh` on 8 lanes (see the module doc).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn tanh_ps(y: __m256) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        let a = _mm256_andnot_ps(sign, y);
        let u = _mm256_mul_ps(y, y);
        let mut p = _mm256_set1_ps(POLY[5]);
        for &c in POLY[..5].iter().rev() {
            p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(c));
        }
        let small = _mm256_fmadd_ps(_mm256_mul_ps(y, u), p, y);
        // Ordered: NaN takes the polynomial, which keeps it.
        let beyond = _mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(SPLIT));
        if _mm256_movemask_ps(beyond) == 0 {
            return small;
        }
        let z = _mm256_mul_ps(a, _mm256_set1_ps(-2.0 * std::f32::consts::LOG2_E));
        let e = exp2_poly_ps(z);
        let one = _mm256_set1_ps(1.0);
        let t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        let large = _mm256_or_ps(t, _mm256_and_ps(sign, y));
        _mm256_blendv_ps(small, large, beyond)
    }

    /// See [`crate::cpu::simd::softcap`].
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn softcap(x: &mut [f32], cap: f32, mut deriv: Option<&mut [f32]>) {
        let (c, inv) = (_mm256_set1_ps(cap), _mm256_set1_ps(1.0 / cap));
        let one = _mm256_set1_ps(1.0);
        let whole = x.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 ≤ x.len(), and deriv has x's length (checked by the caller).
            unsafe {
                let at = x.as_mut_ptr().add(i);
                let t = tanh_ps(_mm256_mul_ps(_mm256_loadu_ps(at), inv));
                _mm256_storeu_ps(at, _mm256_mul_ps(c, t));
                if let Some(d) = deriv.as_deref_mut() {
                    let dt = _mm256_fnmadd_ps(t, t, one);
                    _mm256_storeu_ps(d.as_mut_ptr().add(i), dt);
                }
            }
        }
        scalar(&mut x[whole..], cap, deriv.map(|d| &mut d[whole..]));
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::simd::{Kernels, Simd};

    /// Every level this CPU has against f64 `tanh`, dense over `[−12, 12]` and at the edges:
    /// within 3 ulp of `tanh` (4 of `cap · tanh`), ±cap beyond, NaN kept, the derivative within
    /// 1e-6 of `1 − tanh²`.
    #[test]
    fn softcap_matches_tanh_at_every_level() {
        let mut ys: Vec<f32> = (-120_000..=120_000)
            .map(|i| i as f32 * 1e-4 + 3.1e-6)
            .collect();
        ys.extend([0.0, -0.0, 0.75, -0.75, 0.749_999_9, 1e-30, 40.0, -300.0]);
        ys.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
        ]);
        let cap = 2.5f32;
        for level in Simd::available() {
            let softcap = Kernels::of(level).softcap;
            let mut x: Vec<f32> = ys.iter().map(|y| y * cap).collect();
            let mut d = vec![f32::NAN; x.len()];
            softcap(&mut x, cap, Some(&mut d));
            let mut worst = 0f64;
            for ((&y, &got), &dg) in ys.iter().zip(&x).zip(&d) {
                let input = (y * cap) as f64;
                let t = (input / cap as f64).tanh();
                let want = cap as f64 * t;
                let ulp = {
                    let w = (want.abs() as f32).max(f32::MIN_POSITIVE);
                    (f32::from_bits(w.to_bits() + 1) - w) as f64
                };
                let err = (got as f64 - want).abs() / ulp;
                worst = worst.max(err);
                assert!(
                    err <= 4.0,
                    "{level:?}: softcap({input}) = {got}, want {want}"
                );
                assert!(
                    (dg as f64 - (1.0 - t * t)).abs() <= 1e-6,
                    "{level:?}: {input}"
                );
            }
            println!("{level:?}: worst {worst:.2} ulp");
            let mut nan = [f32::NAN; 20];
            softcap(&mut nan, cap, None);
            assert!(nan.iter().all(|v| v.is_nan()));
        }
    }
}
