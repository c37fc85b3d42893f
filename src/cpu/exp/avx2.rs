//! AVX2/FMA exp kernels: 8 lanes, two vectors per row of a 16-query panel.

use std::arch::x86_64::*;

use super::{EXP2_MAX, EXP2_MIN, EXP2_POLY, LANES, ROUNDER, exp2};

/// `2^x` on 8 lanes. Adding [`ROUNDER`] rounds `x` to an integer `n` and leaves `n + 127`
/// in the low mantissa bits, which shifted into the exponent field give `2^n`.
/// `CAP_ABOVE = false` skips the upper clamp, for arguments known to be ≤ 0 (7% faster).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2_ps<const CAP_ABOVE: bool>(x: __m256) -> __m256 {
    let mut x = _mm256_max_ps(x, _mm256_set1_ps(EXP2_MIN));
    if CAP_ABOVE {
        x = _mm256_min_ps(x, _mm256_set1_ps(EXP2_MAX));
    }
    let rounder = _mm256_set1_ps(ROUNDER);
    let t = _mm256_add_ps(x, rounder);
    let f = _mm256_sub_ps(x, _mm256_sub_ps(t, rounder));
    let mut p = _mm256_set1_ps(EXP2_POLY[6]);
    for &c in EXP2_POLY[..6].iter().rev() {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_castps_si256(t)));
    _mm256_mul_ps(p, two_n)
}

/// `2^x` on 8 lanes for any `x`, as [`exp2_ps`] (for callers outside this module).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(in crate::cpu) fn exp2_poly_ps(x: __m256) -> __m256 {
    exp2_ps::<true>(x)
}

/// See [`super::exp2_shifted_panel`].
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
    // SAFETY: `shift` holds 16 f32, read as two unaligned 8-lane vectors.
    let (s0, s1) = unsafe {
        (
            _mm256_loadu_ps(shift.as_ptr()),
            _mm256_loadu_ps(shift.as_ptr().add(8)),
        )
    };
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for row in x.chunks_exact_mut(LANES) {
        let ptr = row.as_mut_ptr();
        // SAFETY: `row` holds exactly 16 f32, read and written as two unaligned vectors.
        unsafe {
            let a = exp2_ps::<false>(_mm256_sub_ps(_mm256_loadu_ps(ptr), s0));
            let b = exp2_ps::<false>(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(8)), s1));
            _mm256_storeu_ps(ptr, a);
            _mm256_storeu_ps(ptr.add(8), b);
            acc0 = _mm256_add_ps(acc0, a);
            acc1 = _mm256_add_ps(acc1, b);
        }
    }
    let mut sums = [0f32; LANES];
    // SAFETY: `sums` holds 16 f32.
    unsafe {
        _mm256_storeu_ps(sums.as_mut_ptr(), acc0);
        _mm256_storeu_ps(sums.as_mut_ptr().add(8), acc1);
    }
    sums
}

/// See [`super::exp2_shifted_sum`].
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let s = _mm256_set1_ps(shift);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut chunks = x.chunks_exact_mut(16);
    for chunk in &mut chunks {
        let ptr = chunk.as_mut_ptr();
        // SAFETY: `chunk` holds exactly 16 f32, read and written as two unaligned 8-lane vectors.
        unsafe {
            let a = exp2_ps::<true>(_mm256_sub_ps(_mm256_loadu_ps(ptr), s));
            let b = exp2_ps::<true>(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(8)), s));
            _mm256_storeu_ps(ptr, a);
            _mm256_storeu_ps(ptr.add(8), b);
            acc0 = _mm256_add_ps(acc0, a);
            acc1 = _mm256_add_ps(acc1, b);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc0, acc1)) };
    let mut sum: f32 = lanes.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp2(*v - shift);
        sum += *v;
    }
    sum
}
