//! AVX-512F exp kernels: one 16-lane vector per row of a 16-query panel, by a table of
//! thirty-seconds and a quadratic (the other levels use a degree-6 polynomial; results agree
//! within 2 ulp). The forward's `softmax_product` calls [`exp2_ps`] inside its FMA loop.

use std::arch::x86_64::*;

use super::{EXP2_MAX, EXP2_MIN, EXP2_POLY, LANES, ROUNDER, exp2};

/// `2^(k/32)` for `k = 0..32`, correctly rounded: the table [`exp2_ps`] looks up with one
/// two-register lane permute.
const TABLE: [f32; 32] = [
    1.0,
    1.021_897_2,
    1.044_273_7,
    1.067_140_5,
    1.090_507_7,
    1.114_386_8,
    1.138_788_6,
    1.163_724_9,
    1.189_207_1,
    1.215_247_4,
    1.241_857_8,
    1.269_051,
    1.296_839_6,
    1.325_236_7,
    1.354_255_6,
    1.383_91,
    std::f32::consts::SQRT_2,
    1.445_180_8,
    1.476_826_2,
    1.509_164_5,
    1.542_210_8,
    1.575_980_9,
    1.610_490_3,
    1.645_755_5,
    1.681_792_9,
    1.718_619_3,
    1.756_252_2,
    1.794_709_1,
    1.834_008_1,
    1.874_167_7,
    1.915_206_6,
    1.957_144_1,
];
/// `2^f` on `[−1/64, 1/64]`, lowest degree first (minimax of the relative error, 5.4e-8 with
/// these f32 coefficients, before rounding).
const POLY: [f32; 3] = [1.0, 0.693_157_3, 0.240_224_75];
/// Inputs below this give 0, −∞ included: `2^x` is then below the smallest normal float, and
/// computing it would take a microcode assist on Intel cores for every vector that holds such
/// a lane (as the masked scores of a causal block all do).
const FLUSH: f32 = -126.0;
/// `1.5 · 2^18`: the spacing of floats in `[2^18, 2^19)` is 1/32, so adding it to `x` (below
/// 2^17 in magnitude) rounds `x` to the nearest multiple of 1/32 and leaves that multiple
/// times 32 in the low mantissa bits.
const THIRTY_SECONDS: f32 = 393_216.0;

/// `2^x` on 16 lanes: `x = n + k/32 + f` with `n + k/32` the multiple of 1/32 nearest `x` (two
/// adds, leaving `k` in the low bits of the first sum) and `|f| ≤ 1/64`; `2^f` is a quadratic,
/// `2^(k/32)` comes from [`TABLE`] (one `vpermt2ps`, which reads those low bits) and `2^n` is
/// applied by `vscalefps` (which takes `n` as the floor of `n + k/32`). Of its instructions
/// only the two FMAs and the multiply compete with the products for the FMA pipes (on Zen 5
/// the adds, maxima and `vscalefps` run beside them). Relative error within 1.5e-7 (the
/// portable path's degree-6 polynomial: 1.2e-7).
/// `CAP_ABOVE = false` skips the upper clamp, for arguments known to be ≤ 0. NaN gives NaN:
/// the clamps take `x` as their second operand, which `vmaxps`/`vminps` return for NaN.
#[inline]
#[target_feature(enable = "avx512f")]
pub(in crate::cpu) fn exp2_ps<const CAP_ABOVE: bool>(x: __m512) -> __m512 {
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(FLUSH));
    let mut x = _mm512_max_ps(_mm512_set1_ps(FLUSH), x);
    if CAP_ABOVE {
        x = _mm512_min_ps(_mm512_set1_ps(EXP2_MAX), x);
    }
    let t = _mm512_add_ps(x, _mm512_set1_ps(THIRTY_SECONDS));
    let r = _mm512_sub_ps(t, _mm512_set1_ps(THIRTY_SECONDS));
    let f = _mm512_sub_ps(x, r);
    let p = _mm512_fmadd_ps(_mm512_set1_ps(POLY[2]), f, _mm512_set1_ps(POLY[1]));
    let p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(POLY[0]));
    // SAFETY: TABLE holds 32 f32.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_ps(TABLE.as_ptr()),
            _mm512_loadu_ps(TABLE.as_ptr().add(16)),
        )
    };
    let y = _mm512_mul_ps(p, _mm512_permutex2var_ps(lo, _mm512_castps_si512(t), hi));
    _mm512_maskz_scalef_ps(keep, y, r)
}

/// `2^x` on 16 lanes by the other levels' degree-6 polynomial (see the module doc of
/// [`super`]): `x` clamped to `[−127, 127]`, `n = round(x)` from adding [`ROUNDER`], `2^n` from
/// `n + 127` shifted into the exponent field. Within 1.2e-7 of `2^x`, and 0 below `2^−126`; for
/// callers that need that accuracy over speed (softcap's `tanh`). NaN gives NaN.
#[inline]
#[target_feature(enable = "avx512f")]
pub(in crate::cpu) fn exp2_poly_ps(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_set1_ps(EXP2_MAX),
        _mm512_max_ps(_mm512_set1_ps(EXP2_MIN), x),
    );
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
pub(crate) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
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
pub(crate) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
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
