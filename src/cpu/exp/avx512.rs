//! AVX-512F exp kernels: one 16-lane vector per row of a 16-query panel, the same polynomial
//! and rounding as the AVX2 and scalar paths (so every level gives the same bits).

use std::arch::x86_64::*;

use super::{EXP2_MAX, EXP2_MIN, EXP2_POLY, LANES, ROUNDER, exp2};

/// `2^x` on 16 lanes (see [`super::avx2`]'s `exp2_ps` for the rounding trick).
/// `CAP_ABOVE = false` skips the upper clamp, for arguments known to be ≤ 0.
#[inline]
#[target_feature(enable = "avx512f")]
fn exp2_ps<const CAP_ABOVE: bool>(x: __m512) -> __m512 {
    let mut x = _mm512_max_ps(x, _mm512_set1_ps(EXP2_MIN));
    if CAP_ABOVE {
        x = _mm512_min_ps(x, _mm512_set1_ps(EXP2_MAX));
    }
    let rounder = _mm512_set1_ps(ROUNDER);
    let t = _mm512_add_ps(x, rounder);
    let f = _mm512_sub_ps(x, _mm512_sub_ps(t, rounder));
    let mut p = _mm512_set1_ps(EXP2_POLY[6]);
    for &c in EXP2_POLY[..6].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(t)));
    _mm512_mul_ps(p, two_n)
}

/// See [`super::exp2_shifted_panel`].
#[target_feature(enable = "avx512f")]
pub(super) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
    // SAFETY: `shift` holds 16 f32.
    let s = unsafe { _mm512_loadu_ps(shift.as_ptr()) };
    // Two sums, so consecutive rows do not wait on each other's add.
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut rows = x.chunks_exact_mut(2 * LANES);
    for two in &mut rows {
        let ptr = two.as_mut_ptr();
        // SAFETY: `two` holds exactly 32 f32, read and written as two unaligned vectors.
        unsafe {
            let a = exp2_ps::<false>(_mm512_sub_ps(_mm512_loadu_ps(ptr), s));
            let b = exp2_ps::<false>(_mm512_sub_ps(_mm512_loadu_ps(ptr.add(LANES)), s));
            _mm512_storeu_ps(ptr, a);
            _mm512_storeu_ps(ptr.add(LANES), b);
            acc0 = _mm512_add_ps(acc0, a);
            acc1 = _mm512_add_ps(acc1, b);
        }
    }
    let last = rows.into_remainder();
    if !last.is_empty() {
        let ptr = last.as_mut_ptr();
        // SAFETY: the remainder of a panel is one row of exactly 16 f32.
        unsafe {
            let a = exp2_ps::<false>(_mm512_sub_ps(_mm512_loadu_ps(ptr), s));
            _mm512_storeu_ps(ptr, a);
            acc0 = _mm512_add_ps(acc0, a);
        }
    }
    let mut sums = [0f32; LANES];
    // SAFETY: `sums` holds 16 f32.
    unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), _mm512_add_ps(acc0, acc1)) };
    sums
}

/// See [`super::exp2_shifted_sum`].
#[target_feature(enable = "avx512f")]
pub(super) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let s = _mm512_set1_ps(shift);
    let mut acc = _mm512_setzero_ps();
    let mut chunks = x.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        let ptr = chunk.as_mut_ptr();
        // SAFETY: `chunk` holds exactly 16 f32, read and written as one unaligned vector.
        unsafe {
            let a = exp2_ps::<true>(_mm512_sub_ps(_mm512_loadu_ps(ptr), s));
            _mm512_storeu_ps(ptr, a);
            acc = _mm512_add_ps(acc, a);
        }
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    for v in chunks.into_remainder() {
        *v = exp2(*v - shift);
        sum += *v;
    }
    sum
}
