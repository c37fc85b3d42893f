//! AVX2/FMA kernel of the panel product: a 6×16 register block (two 8-lane halves per row),
//! 12 FMAs per step with two vector loads and six broadcasts; rows and steps where only the
//! upper half matters ([`super::HighLanes`]) take the upper half alone.

use std::arch::x86_64::*;

use super::{Block, ColBounds, PanelStrides};

/// Rows of C per register block.
const MR: usize = 6;

/// Rows of C per register block of the upper half alone (one accumulator a row).
const MR_HIGH: usize = 8;

/// One panel's product (see [`super::panels_product`]), in blocks of 6 rows, with two to five
/// blocks of 5 instead of one short block at the end (a 4-row block has too few accumulators
/// to hide the FMA latency), and 7 or 8 rows as two blocks of 3 or 4 rather than 6 and 1 or 2.
/// Rows from `x.high_row` on take the upper 8 lanes alone (the lower ones get −∞), and steps
/// from `x.high_step` on feed the upper 8 alone. The new values' column maxima and minima widen
/// `bounds` (in the upper lanes only, for the rows of the upper half alone).
///
/// # Safety
/// AVX2 and FMA must be available and the operands of `x` valid for `rows` rows (checked by
/// [`super::product`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn product(x: Block, rows: usize, bounds: &mut ColBounds) {
    let both = x.high_row.min(rows);
    let fives = if both >= 20 { (MR - both % MR) % MR } else { 0 };
    let (b, k, st, acc) = (x.b, x.k, x.st, x.accumulate);
    let split = x.high_step.min(k);
    let mut r0 = 0;
    while r0 < both {
        let left = both - r0;
        let mr = match left {
            _ if left <= 5 * fives => 5,
            7 | 8 => 4,
            _ => left.min(MR),
        };
        // SAFETY: rows r0..r0 + mr lie inside A and C (the caller's contract).
        let (c, a) = unsafe { (x.c.add(r0 * x.st.c_rs), x.a.add(r0 * x.st.a_rs)) };
        // SAFETY: as above, for this block's rows.
        unsafe {
            match mr {
                6 => block::<6>(c, a, b, (split, k), st, acc, bounds),
                5 => block::<5>(c, a, b, (split, k), st, acc, bounds),
                4 => block::<4>(c, a, b, (split, k), st, acc, bounds),
                3 => block::<3>(c, a, b, (split, k), st, acc, bounds),
                2 => block::<2>(c, a, b, (split, k), st, acc, bounds),
                _ => block::<1>(c, a, b, (split, k), st, acc, bounds),
            }
        }
        r0 += mr;
    }
    while r0 < rows {
        let mr = (rows - r0).min(MR_HIGH);
        // SAFETY: as above.
        let (c, a) = unsafe { (x.c.add(r0 * x.st.c_rs), x.a.add(r0 * x.st.a_rs)) };
        // SAFETY: as above.
        unsafe {
            match mr {
                8 => block_high::<8>(c, a, b, k, st, acc, bounds),
                7 => block_high::<7>(c, a, b, k, st, acc, bounds),
                6 => block_high::<6>(c, a, b, k, st, acc, bounds),
                5 => block_high::<5>(c, a, b, k, st, acc, bounds),
                4 => block_high::<4>(c, a, b, k, st, acc, bounds),
                3 => block_high::<3>(c, a, b, k, st, acc, bounds),
                2 => block_high::<2>(c, a, b, k, st, acc, bounds),
                _ => block_high::<1>(c, a, b, k, st, acc, bounds),
            }
        }
        r0 += mr;
    }
}

/// Pointers to the `R` rows of A from `a`.
#[inline(always)]
fn a_rows<const R: usize>(a: *const f32, st: PanelStrides) -> [*const f32; R] {
    std::array::from_fn(|r| a.wrapping_add(r * st.a_rs))
}

/// One `R × 16` register block of C over `k` steps, of which those from `split` on feed the
/// upper 8 lanes alone; its rows widen `bounds`.
///
/// # Safety
/// AVX2 and FMA must be available; `a + r·a_rs + l·a_cs` (r < R, l < k), `b + l·b_rs .. + 16`
/// (l < k) and `c + r·c_rs .. + 16` (r < R) must be valid, C writable and not overlapping A, B.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const R: usize>(
    c: *mut f32,
    a: *const f32,
    b: *const f32,
    (split, k): (usize, usize),
    st: PanelStrides,
    accumulate: bool,
    bounds: &mut ColBounds,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let a_row = a_rows::<R>(a, st);
    for l in 0..split {
        // SAFETY: l < k: row l of B and column l of A's rows are valid (caller's contract).
        unsafe {
            let bl = b.add(l * st.b_rs);
            let b0 = _mm256_loadu_ps(bl);
            let b1 = _mm256_loadu_ps(bl.add(8));
            let off = l * st.a_cs;
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a_row[r].add(off));
                acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
            }
        }
    }
    for l in split..k {
        // SAFETY: as above.
        unsafe {
            let b1 = _mm256_loadu_ps(b.add(l * st.b_rs + 8));
            let off = l * st.a_cs;
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a_row[r].add(off));
                acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
            }
        }
    }
    // SAFETY: the bounds hold 16 f32 each.
    let [mut max_lo, mut max_hi, mut min_lo, mut min_hi] = unsafe { load_bounds(bounds) };
    for (r, [lo, hi]) in acc.into_iter().enumerate() {
        // SAFETY: row r < R of C holds 16 writable elements (caller's contract).
        unsafe {
            let cr = c.add(r * st.c_rs);
            let (mut lo, mut hi) = (lo, hi);
            if accumulate {
                lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr.add(8)));
            }
            _mm256_storeu_ps(cr, lo);
            _mm256_storeu_ps(cr.add(8), hi);
            max_lo = _mm256_max_ps(max_lo, lo);
            max_hi = _mm256_max_ps(max_hi, hi);
            min_lo = _mm256_min_ps(min_lo, lo);
            min_hi = _mm256_min_ps(min_hi, hi);
        }
    }
    // SAFETY: the bounds hold 16 f32 each.
    unsafe { store_bounds(bounds, [max_lo, max_hi, min_lo, min_hi]) };
}

/// One `R × 8` register block of C's upper lanes over `k` steps: the lower lanes of its rows are
/// set to −∞ (when overwriting) or left (when accumulating), and only the upper ones widen
/// `bounds`.
///
/// # Safety
/// As for [`block`].
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_high<const R: usize>(
    c: *mut f32,
    a: *const f32,
    b: *const f32,
    k: usize,
    st: PanelStrides,
    accumulate: bool,
    bounds: &mut ColBounds,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let a_row = a_rows::<R>(a, st);
    for l in 0..k {
        // SAFETY: l < k: row l of B and column l of A's rows are valid (caller's contract).
        unsafe {
            let b1 = _mm256_loadu_ps(b.add(l * st.b_rs + 8));
            let off = l * st.a_cs;
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a_row[r].add(off));
                acc[r] = _mm256_fmadd_ps(x, b1, acc[r]);
            }
        }
    }
    // SAFETY: the bounds hold 16 f32 each.
    let [max_lo, mut max_hi, min_lo, mut min_hi] = unsafe { load_bounds(bounds) };
    for (r, hi) in acc.into_iter().enumerate() {
        // SAFETY: row r < R of C holds 16 writable elements (caller's contract).
        unsafe {
            let cr = c.add(r * st.c_rs);
            let mut hi = hi;
            if accumulate {
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr.add(8)));
            } else {
                _mm256_storeu_ps(cr, _mm256_set1_ps(f32::NEG_INFINITY));
            }
            _mm256_storeu_ps(cr.add(8), hi);
            max_hi = _mm256_max_ps(max_hi, hi);
            min_hi = _mm256_min_ps(min_hi, hi);
        }
    }
    // SAFETY: the bounds hold 16 f32 each.
    unsafe { store_bounds(bounds, [max_lo, max_hi, min_lo, min_hi]) };
}

/// The bounds as four vectors: maxima low and high, minima low and high.
///
/// # Safety
/// AVX must be available.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bounds(bounds: &ColBounds) -> [__m256; 4] {
    let (max, min) = (bounds.max.as_ptr(), bounds.min.as_ptr());
    // SAFETY: the bounds hold 16 f32 each.
    unsafe {
        [
            _mm256_loadu_ps(max),
            _mm256_loadu_ps(max.add(8)),
            _mm256_loadu_ps(min),
            _mm256_loadu_ps(min.add(8)),
        ]
    }
}

/// Stores [`load_bounds`]'s four vectors back.
///
/// # Safety
/// AVX must be available.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_bounds(bounds: &mut ColBounds, [max_lo, max_hi, min_lo, min_hi]: [__m256; 4]) {
    let (max, min) = (bounds.max.as_mut_ptr(), bounds.min.as_mut_ptr());
    // SAFETY: the bounds hold 16 f32 each.
    unsafe {
        _mm256_storeu_ps(max, max_lo);
        _mm256_storeu_ps(max.add(8), max_hi);
        _mm256_storeu_ps(min, min_lo);
        _mm256_storeu_ps(min.add(8), min_hi);
    }
}
