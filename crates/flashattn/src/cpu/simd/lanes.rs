//! Lane-wise operations on `rows × 16` panels (one lane per query), for the online softmax:
//! one AVX-512 vector per row when the CPU has it, plain Rust otherwise (which the compiler
//! vectorizes with the baseline SSE2); the log-sum-exps in f64 vectors with AVX2 too.

use crate::cpu::simd::exp::LANES;
use crate::cpu::simd::kernels;

/// The largest value of each lane over the rows of a `rows × 16` panel (−∞ for no rows).
pub(crate) fn lane_max(s: &[f32]) -> [f32; LANES] {
    (kernels().lane_max)(s)
}

/// `x[r][l] *= f[l]` for every row `r` of a `rows × 16` panel.
pub(crate) fn scale_lanes(x: &mut [f32], f: &[f32; LANES]) {
    (kernels().scale_lanes)(x, f)
}

/// Each lane's natural-log log-sum-exp `(max + log2(sum)) · ln 2` of a base-2 softmax state,
/// computed in f64 and rounded once (within 1 ulp of the exact value); −∞ for lanes whose sum
/// is 0 (no key seen), NaN for a sum that is NaN or negative. The forward takes one per query,
/// where a scalar `f32::log2` per lane cost 1–2% of a causal forward (see BENCHMARKS.md).
pub(crate) fn lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] {
    (kernels().lane_lse)(max, sum)
}

/// The portable level's kernels (plain Rust, which the compiler vectorizes with the baseline
/// SSE2).
pub(crate) mod portable {
    use super::LANES;

    /// See [`super::lane_max`].
    pub(crate) fn lane_max(s: &[f32]) -> [f32; LANES] {
        let mut m = [f32::NEG_INFINITY; LANES];
        for row in s.chunks_exact(LANES) {
            for (m, &v) in m.iter_mut().zip(row) {
                *m = if v > *m { v } else { *m };
            }
        }
        m
    }

    /// See [`super::scale_lanes`].
    pub(crate) fn scale_lanes(x: &mut [f32], f: &[f32; LANES]) {
        for row in x.chunks_exact_mut(LANES) {
            for (a, s) in row.iter_mut().zip(f) {
                *a *= s;
            }
        }
    }

    /// See [`super::lane_lse`].
    pub(crate) fn lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|l| {
            if sum[l] > 0.0 {
                ((max[l] as f64 + (sum[l] as f64).log2()) * std::f64::consts::LN_2) as f32
            } else if sum[l] == 0.0 {
                f32::NEG_INFINITY
            } else {
                f32::NAN
            }
        })
    }
}

/// `2 / (ln 2 · (2i + 1))`: `log2(m) = Σ c_i · t^(2i+1)` with `t = (m − 1)/(m + 1)` (the
/// series of `2·atanh(t) / ln 2`); where `|t| ≤ 0.2` the first omitted term is below 1e-11.
#[cfg(target_arch = "x86_64")]
const LOG2_SERIES: [f64; 7] = [
    2.885_390_081_777_927,
    0.961_796_693_925_975_6,
    0.577_078_016_355_585_4,
    0.412_198_583_111_132_4,
    0.320_598_897_975_325_2,
    0.262_308_189_252_538_8,
    0.221_953_083_213_686_7,
];

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::{LANES, LOG2_SERIES};

    #[target_feature(enable = "avx512f")]
    pub(crate) fn lane_max(s: &[f32]) -> [f32; LANES] {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for row in s.chunks_exact(LANES) {
            // SAFETY: `row` holds 16 f32.
            m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(row.as_ptr()) });
        }
        let mut out = [0f32; LANES];
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), m) };
        out
    }

    /// See [`super::lane_lse`]: eight lanes at a time in f64, `sum = m · 2^e` with `m ∈
    /// [0.75, 1.5)` (`vgetmantpd`, exact) and `e` from `vgetexppd` of `sum` and of `m`.
    #[target_feature(enable = "avx512f")]
    pub(crate) fn lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] {
        let mut out = [0f32; LANES];
        let one = _mm512_set1_pd(1.0);
        for half in 0..2 {
            // SAFETY: `max`, `sum` and `out` hold 16 f32, of which this reads or writes 8.
            unsafe {
                let at = 8 * half;
                let s = _mm512_cvtps_pd(_mm256_loadu_ps(sum.as_ptr().add(at)));
                let m = _mm512_getmant_pd::<_MM_MANT_NORM_P75_1P5, _MM_MANT_SIGN_NAN>(s);
                let e = _mm512_sub_pd(_mm512_getexp_pd(s), _mm512_getexp_pd(m));
                let t = _mm512_div_pd(_mm512_sub_pd(m, one), _mm512_add_pd(m, one));
                let t2 = _mm512_mul_pd(t, t);
                let mut p = _mm512_set1_pd(LOG2_SERIES[6]);
                for &c in LOG2_SERIES[..6].iter().rev() {
                    p = _mm512_fmadd_pd(p, t2, _mm512_set1_pd(c));
                }
                let mx = _mm512_cvtps_pd(_mm256_loadu_ps(max.as_ptr().add(at)));
                let log2 = _mm512_add_pd(mx, _mm512_fmadd_pd(p, t, e));
                let lse = _mm512_mul_pd(log2, _mm512_set1_pd(std::f64::consts::LN_2));
                let positive = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(s, _mm512_setzero_pd());
                let zero = _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(s, _mm512_setzero_pd());
                let lse = _mm512_mask_blend_pd(positive, _mm512_set1_pd(f64::NAN), lse);
                let lse = _mm512_mask_blend_pd(zero, lse, _mm512_set1_pd(f64::NEG_INFINITY));
                _mm256_storeu_ps(out.as_mut_ptr().add(at), _mm512_cvtpd_ps(lse));
            }
        }
        out
    }

    #[target_feature(enable = "avx512f")]
    pub(crate) fn scale_lanes(x: &mut [f32], f: &[f32; LANES]) {
        // SAFETY: `f` holds 16 f32.
        let f = unsafe { _mm512_loadu_ps(f.as_ptr()) };
        for row in x.chunks_exact_mut(LANES) {
            // SAFETY: `row` holds 16 f32.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr()), f);
                _mm512_storeu_ps(row.as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{LANES, LOG2_SERIES};

    /// See [`super::lane_lse`]: four lanes at a time in f64, where every f32 sum is normal:
    /// `sum = m · 2^e` with `m ∈ [0.75, 1.5)` from its mantissa bits and `e` from its exponent
    /// bits (placed in the mantissa of 2^52 and subtracted as a float).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn lane_lse(max: &[f32; LANES], sum: &[f32; LANES]) -> [f32; LANES] {
        let mut out = [0f32; LANES];
        let one = _mm256_set1_pd(1.0);
        for at in (0..LANES).step_by(4) {
            // SAFETY: `max`, `sum` and `out` hold 16 f32, of which this reads or writes 4.
            unsafe {
                let s = _mm256_cvtps_pd(_mm_loadu_ps(sum.as_ptr().add(at)));
                let bits = _mm256_castpd_si256(s);
                let mantissa = _mm256_and_si256(bits, _mm256_set1_epi64x(0x000f_ffff_ffff_ffff));
                let m = _mm256_castsi256_pd(_mm256_or_si256(mantissa, _mm256_castpd_si256(one)));
                let biased = _mm256_or_si256(
                    _mm256_srli_epi64::<52>(bits),
                    _mm256_set1_epi64x(0x4330_0000_0000_0000),
                );
                let two_52 = 4_503_599_627_370_496.0;
                let e = _mm256_sub_pd(_mm256_castsi256_pd(biased), _mm256_set1_pd(two_52 + 1023.0));
                let high = _mm256_cmp_pd::<_CMP_GE_OQ>(m, _mm256_set1_pd(1.5));
                let m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), high);
                let e = _mm256_add_pd(e, _mm256_and_pd(high, one));
                let t = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one));
                let t2 = _mm256_mul_pd(t, t);
                let mut p = _mm256_set1_pd(LOG2_SERIES[6]);
                for &c in LOG2_SERIES[..6].iter().rev() {
                    p = _mm256_fmadd_pd(p, t2, _mm256_set1_pd(c));
                }
                let mx = _mm256_cvtps_pd(_mm_loadu_ps(max.as_ptr().add(at)));
                let log2 = _mm256_add_pd(mx, _mm256_fmadd_pd(p, t, e));
                let lse = _mm256_mul_pd(log2, _mm256_set1_pd(std::f64::consts::LN_2));
                let positive = _mm256_cmp_pd::<_CMP_GT_OQ>(s, _mm256_setzero_pd());
                let zero = _mm256_cmp_pd::<_CMP_EQ_OQ>(s, _mm256_setzero_pd());
                let lse = _mm256_blendv_pd(_mm256_set1_pd(f64::NAN), lse, positive);
                let lse = _mm256_blendv_pd(lse, _mm256_set1_pd(f64::NEG_INFINITY), zero);
                let infinite = _mm256_cmp_pd::<_CMP_EQ_OQ>(s, _mm256_set1_pd(f64::INFINITY));
                let lse = _mm256_blendv_pd(lse, s, infinite);
                _mm_storeu_ps(out.as_mut_ptr().add(at), _mm256_cvtpd_ps(lse));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu::simd::{Kernels, Simd};

    /// The kernels of every level this CPU has.
    fn every_level() -> impl Iterator<Item = &'static Kernels> {
        Simd::available().map(Kernels::of)
    }

    /// Against f64 over sums from the smallest subnormal to +∞ (and the cut points of the
    /// mantissa interval), maxima of both signs: within 1 ulp, −∞ for a zero sum, NaN for a NaN
    /// or negative one.
    #[test]
    fn lane_lse_is_within_one_ulp() {
        for k in every_level() {
            let mut sums: Vec<f32> = (-149 * 64..128 * 64)
                .map(|i| (i as f64 / 64.0 + 1.3e-3).exp2() as f32)
                .collect();
            for c in [0.75f32, 1.0, 1.5, 2.0, 3.0] {
                sums.extend((0..40).map(|i| f32::from_bits(c.to_bits() + i)));
                sums.extend((1..40).map(|i| f32::from_bits(c.to_bits() - i)));
            }
            sums.extend([
                f32::from_bits(1),
                f32::MIN_POSITIVE,
                f32::MAX,
                f32::INFINITY,
            ]);
            sums.extend([0.0, -1.0, f32::NAN]);
            for (i, chunk) in sums.chunks(LANES).enumerate() {
                let mut sum = [1f32; LANES];
                sum[..chunk.len()].copy_from_slice(chunk);
                let max: [f32; LANES] =
                    std::array::from_fn(|l| (i * LANES + l) as f32 * 0.37 - 90.0);
                let got = (k.lane_lse)(&max, &sum);
                for l in 0..LANES {
                    let (m, s, g) = (max[l], sum[l], got[l]);
                    if s == 0.0 {
                        assert_eq!(g, f32::NEG_INFINITY, "sum {s}");
                        continue;
                    }
                    if s.is_nan() || s < 0.0 {
                        assert!(g.is_nan(), "sum {s}: {g}");
                        continue;
                    }
                    let want = (m as f64 + (s as f64).log2()) * std::f64::consts::LN_2;
                    let w = want as f32;
                    let next = f32::from_bits(w.abs().to_bits() + 1) - w.abs();
                    assert!(
                        (g as f64 - want).abs() <= next as f64 || g == w,
                        "max {m} sum {s:e}: {g} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn lane_max_and_scale_match_scalar_loops() {
        for k in every_level() {
            for rows in [0, 1, 3, 40] {
                let x: Vec<f32> = (0..rows * LANES).map(|i| (i as f32 * 0.7).sin()).collect();
                let m = (k.lane_max)(&x);
                for l in 0..LANES {
                    let want = (0..rows)
                        .map(|r| x[r * LANES + l])
                        .fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(m[l], want);
                }
                let f: [f32; LANES] = std::array::from_fn(|l| l as f32 - 3.5);
                let mut y = x.clone();
                (k.scale_lanes)(&mut y, &f);
                for (i, (a, b)) in y.iter().zip(&x).enumerate() {
                    assert_eq!(*a, b * f[i % LANES]);
                }
            }
        }
    }
}
