//! AVX2/FMA exp kernels: 8 lanes, two vectors per row of a 16-query panel.

use std::arch::x86_64::*;

use super::{EXP2_MAX, EXP2_MIN, LANES, exp2};

/// `2^(j/8)` for `j` in 0..8 (correctly rounded f32 bits), each less `j << 20`, the bits that
/// [`exp2_ps`] adds to it (see there).
const EXP2_EIGHTHS: [i32; 8] = {
    let mut t = [
        0x3f80_0000,
        0x3f8b_95c2,
        0x3f98_37f0,
        0x3fa5_fed7,
        0x3fb5_04f3,
        0x3fc5_672a,
        0x3fd7_44fd,
        0x3fea_c0c7,
    ];
    let mut j = 0;
    while j < 8 {
        t[j] -= (j as i32) << 20;
        j += 1;
    }
    t
};
/// Coefficients 1 to 3 of `2^f` on `[−1/16, 1/16]` (the constant term is 1): a minimax fit of
/// the relative error, 2.7e-8 with the coefficients in f32.
const EXP2_CUBIC: [f32; 3] = [0.693_147_24, 0.240_257_64, 0.055_496_223];
/// `1.5 · 2^20`: floats in `[2^20, 2^21)` are multiples of 1/8, so for |x| ≤ 127 `x + EIGHTHS`
/// rounds `x` to the nearest eighth `m/8` and holds `2^22 + m` in its mantissa.
const EIGHTHS: f32 = 1_572_864.0;

/// `2^x` on 8 lanes: `2^x = 2^n · 2^(j/8) · 2^f` with `m = 8n + j` the nearest eighth of `x`
/// (`j` in 0..8) and `f ∈ [−1/16, 1/16]`. Adding [`EIGHTHS`] rounds `x` and leaves `m` in the
/// low mantissa bits: their low three bits pick `2^(j/8)` from a register (`vpermps` reads only
/// those), and `m` shifted up by 20 adds `n` to its exponent field (with `j << 20`, which the
/// table holds already subtracted). The cubic for `2^f` takes four instructions of the FMA
/// pipes where the portable path's degree-6 polynomial on `[−½, ½]` takes seven, and its
/// dependency chain is shorter (a pass 20% faster a vector; see BENCHMARKS.md). Worst relative
/// error over the whole range 1.6e-7 (the degree-6 polynomial: 8.0e-8). Inputs below −127 give 0 (−∞
/// included), results below 2^−126 may be subnormal or 0; inputs above +127 are clamped.
/// `CAP_ABOVE = false` skips the upper clamp, for arguments known to be ≤ 0. NaN gives NaN:
/// the clamps take `x` as their second operand, which `vmaxps`/`vminps` return for NaN.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2_ps<const CAP_ABOVE: bool>(x: __m256) -> __m256 {
    let x = if CAP_ABOVE {
        _mm256_min_ps(_mm256_set1_ps(EXP2_MAX), x)
    } else {
        x
    };
    exp2_shifted_ps(x, Shift::folded(_mm256_setzero_ps()))
}

/// `2^(x − s)` on 8 lanes for a shift `s` on the grid of eighths ([`Shift::folded`]): [`exp2_ps`]
/// of `x − s` without the subtraction. `t = x + (EIGHTHS − s)` rounds the exact `x − s` to its
/// nearest eighth in one step, and `f = x − (t − (EIGHTHS − s))` is exact (each subtraction
/// takes two floats within a factor of two of each other), so `x − s` is never rounded to f32
/// as a pass that subtracts first rounds it: the result is as accurate as `exp2_ps` of the
/// exact difference. Inputs below `s − 127` give 0.
///
/// One vector instruction fewer than subtracting: the softmax keeps its running maxima on the
/// grid (`online_softmax`) so that its passes take this route.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2_shifted_ps(x: __m256, s: Shift) -> __m256 {
    let x = _mm256_max_ps(s.floor, x);
    let t = _mm256_add_ps(x, s.offset);
    let f = _mm256_sub_ps(x, _mm256_sub_ps(t, s.offset));
    let m = _mm256_castps_si256(t);
    // SAFETY: the table holds 8 i32.
    let table = unsafe { _mm256_loadu_si256(EXP2_EIGHTHS.as_ptr().cast()) };
    let two_j = _mm256_permutevar8x32_epi32(table, m);
    let scale = _mm256_castsi256_ps(_mm256_add_epi32(two_j, _mm256_slli_epi32::<20>(m)));
    let mut p = _mm256_set1_ps(EXP2_CUBIC[2]);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_CUBIC[1]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_CUBIC[0]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
    _mm256_mul_ps(p, scale)
}

/// A shift folded into [`exp2_shifted_ps`]'s rounding: `s − 127` and `EIGHTHS − s`.
#[derive(Clone, Copy)]
struct Shift {
    floor: __m256,
    offset: __m256,
}

impl Shift {
    /// Folds `s` (each lane a multiple of 1/8 of magnitude at most [`FOLDED_MAX`], so that both
    /// fields are exact).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn folded(s: __m256) -> Shift {
        Shift {
            floor: _mm256_add_ps(s, _mm256_set1_ps(EXP2_MIN)),
            offset: _mm256_sub_ps(_mm256_set1_ps(EIGHTHS), s),
        }
    }

    /// Whether every lane of `s` can be folded.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn foldable(s: __m256) -> bool {
        let eighths = _mm256_mul_ps(s, _mm256_set1_ps(8.0));
        let whole = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(eighths);
        let small = _mm256_cmp_ps::<_CMP_LE_OQ>(
            _mm256_andnot_ps(_mm256_set1_ps(-0.0), s),
            _mm256_set1_ps(FOLDED_MAX),
        );
        let on_grid = _mm256_cmp_ps::<_CMP_EQ_OQ>(whole, eighths);
        _mm256_movemask_ps(_mm256_and_ps(small, on_grid)) == 0xff
    }
}

/// The largest shift [`Shift::folded`] takes: with `|s| ≤ 2^18` and `x − s` in `[−127, 0]`,
/// `EIGHTHS − s` and `x + (EIGHTHS − s)` stay within `[2^20, 2^21)`, where floats are the
/// multiples of 1/8.
const FOLDED_MAX: f32 = 262_144.0;

/// `2^x` on 8 lanes for any `x`, as [`exp2_ps`] (for callers outside this module).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(in crate::cpu) fn exp2_poly_ps(x: __m256) -> __m256 {
    exp2_ps::<true>(x)
}

/// See [`super::exp2_shifted_panel`]. Four rows a step: eight independent exponentials in
/// flight hide more of each one's dependency chain (the fastest of 1, 2, 4 and 8 rows a step
/// on a panel in L1; see BENCHMARKS.md).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp2_shifted_panel(x: &mut [f32], shift: &[f32; LANES]) -> [f32; LANES] {
    // SAFETY: `shift` holds 16 f32, read as two unaligned 8-lane vectors.
    let shift = unsafe {
        [
            _mm256_loadu_ps(shift.as_ptr()),
            _mm256_loadu_ps(shift.as_ptr().add(8)),
        ]
    };
    let fold = Shift::foldable(shift[0]) && Shift::foldable(shift[1]);
    let sums = if fold {
        panel_pass::<true>(x, shift)
    } else {
        panel_pass::<false>(x, shift)
    };
    let mut out = [0f32; LANES];
    // SAFETY: `out` holds 16 f32.
    unsafe {
        _mm256_storeu_ps(out.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), sums[1]);
    }
    out
}

/// [`exp2_shifted_panel`]'s pass, the shifts folded into the rounding (`FOLD`) or subtracted.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn panel_pass<const FOLD: bool>(x: &mut [f32], shift: [__m256; 2]) -> [__m256; 2] {
    let shifts = (shift, shift.map(|s| Shift::folded(s)));
    let mut sums = [_mm256_setzero_ps(); 2];
    let mut steps = x.chunks_exact_mut(4 * LANES);
    for step in &mut steps {
        add_step(&mut sums, shifted_vectors::<8, false, FOLD>(step, shifts));
    }
    for row in steps.into_remainder().chunks_exact_mut(LANES) {
        add_step(&mut sums, shifted_vectors::<2, false, FOLD>(row, shifts));
    }
    sums
}

/// The `V` vectors of `x` (rows of a panel, so even vectors are lanes 0–7 and odd ones 8–15)
/// replaced by `2^(x − shift)` (clamped above as [`exp2_ps`] says); returns them. The shifts
/// come as they are and as [`Shift::folded`] (computed once by the caller, outside its loop):
/// with `FOLD` they are folded into the rounding ([`exp2_shifted_ps`]; they must be foldable).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn shifted_vectors<const V: usize, const CAP_ABOVE: bool, const FOLD: bool>(
    x: &mut [f32],
    (shift, folded): ([__m256; 2], [Shift; 2]),
) -> [__m256; V] {
    assert_eq!(x.len(), 8 * V);
    let ptr = x.as_mut_ptr();
    // SAFETY: `x` holds exactly V vectors of 8 f32, read and written unaligned.
    unsafe {
        let e: [__m256; V] = std::array::from_fn(|i| {
            let v = _mm256_loadu_ps(ptr.add(8 * i));
            if FOLD {
                exp2_shifted_ps(v, folded[i % 2])
            } else {
                exp2_ps::<CAP_ABOVE>(_mm256_sub_ps(v, shift[i % 2]))
            }
        });
        for (i, &v) in e.iter().enumerate() {
            _mm256_storeu_ps(ptr.add(8 * i), v);
        }
        e
    }
}

/// Adds a step's vectors `e` (2 or 8) to `sums`: the even ones to the first, the odd ones to
/// the second, in pairs (a shorter dependency chain than one running sum).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn add_step<const V: usize>(sums: &mut [__m256; 2], e: [__m256; V]) {
    for (h, sum) in sums.iter_mut().enumerate() {
        let step = match V {
            2 => e[h],
            8 => _mm256_add_ps(
                _mm256_add_ps(e[h], e[h + 2]),
                _mm256_add_ps(e[h + 4], e[h + 6]),
            ),
            _ => unreachable!("steps take 2 or 8 vectors"),
        };
        *sum = _mm256_add_ps(*sum, step);
    }
}

/// See [`super::exp2_shifted_sum`].
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let s = [_mm256_set1_ps(shift); 2];
    let s = (s, s.map(|s| Shift::folded(s)));
    let mut sums = [_mm256_setzero_ps(); 2];
    let mut steps = x.chunks_exact_mut(64);
    for step in &mut steps {
        add_step(&mut sums, shifted_vectors::<8, true, false>(step, s));
    }
    let mut chunks = steps.into_remainder().chunks_exact_mut(16);
    for chunk in &mut chunks {
        add_step(&mut sums, shifted_vectors::<2, true, false>(chunk, s));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(sums[0], sums[1])) };
    let mut sum: f32 = lanes.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp2(*v - shift);
        sum += *v;
    }
    sum
}
