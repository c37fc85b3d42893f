//! AVX-512F exp kernels: one 16-lane vector per row of a 16-query panel, by a table of
//! sixteenths and a cubic (the other levels use a degree-6 polynomial; results agree within
//! 2 ulp).

use std::arch::x86_64::*;

use super::{EXP2_MAX, LANES, exp2};

/// `2^(k/16)` for `k = 0..16`, correctly rounded: the table [`exp2_ps`] looks up with one
/// lane permute.
const TABLE: [f32; 16] = [
    1.0,
    1.044_273_7,
    1.090_507_7,
    1.138_788_6,
    1.189_207_1,
    1.241_857_8,
    1.296_839_6,
    1.354_255_6,
    std::f32::consts::SQRT_2,
    1.476_826_2,
    1.542_210_8,
    1.610_490_3,
    1.681_792_9,
    1.756_252_2,
    1.834_008_1,
    1.915_206_6,
];
/// `2^f` on `[0, 1/16)`, lowest degree first (least-squares minimax of the relative error,
/// 1.1e-9 before f32 rounding).
const POLY: [f32; 4] = [1.0, 0.693_147_8, 0.240_179_05, 0.056_718_16];
/// Inputs below this give 0 (`2^−150` rounds to 0), −∞ included.
const FLUSH: f32 = -150.0;
/// `1.5 · 2^19`: adding it to a multiple of 1/16 below 2^18 in magnitude leaves `16·x` in the
/// low mantissa bits (the spacing of floats in `[2^19, 2^20)` is 1/16).
const SIXTEENTHS: f32 = 786_432.0;

/// `2^x` on 16 lanes: `x = n + k/16 + f` with `n + k/16` the multiple of 1/16 at or below `x`
/// (one `vrndscaleps`), `2^f` a cubic, `2^(k/16)` from [`TABLE`] (one `vpermps`) and `2^n`
/// applied by `vscalefps`. Three FMAs where the AVX2 and scalar paths' degree-6 polynomial
/// takes six; relative error within 1.5e-7 (AVX2's: 1.2e-7). `CAP_ABOVE = false` skips the
/// upper clamp, for arguments known to be ≤ 0.
#[inline]
#[target_feature(enable = "avx512f")]
fn exp2_ps<const CAP_ABOVE: bool>(x: __m512) -> __m512 {
    let mut x = _mm512_max_ps(x, _mm512_set1_ps(FLUSH));
    if CAP_ABOVE {
        x = _mm512_min_ps(x, _mm512_set1_ps(EXP2_MAX));
    }
    // Round down to a multiple of 2^-4: imm8 = (4 << 4) | round toward −∞, no exceptions.
    let r = _mm512_roundscale_ps::<{ (4 << 4) | _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
    let f = _mm512_sub_ps(x, r);
    let mut p = _mm512_set1_ps(POLY[3]);
    for &c in POLY[..3].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    let k = _mm512_castps_si512(_mm512_add_ps(r, _mm512_set1_ps(SIXTEENTHS)));
    // SAFETY: TABLE holds 16 f32.
    let table = unsafe { _mm512_loadu_ps(TABLE.as_ptr()) };
    let y = _mm512_mul_ps(p, _mm512_permutexvar_ps(k, table));
    _mm512_scalef_ps(y, r)
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
