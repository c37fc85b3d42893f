//! AVX2/FMA kernel of the panel product: a 6×16 register block (two 8-lane halves per row),
//! 12 FMAs per step with two vector loads and six broadcasts.

use std::arch::x86_64::*;

use super::{Block, ColMax, PanelStrides};

/// Rows of C per register block.
const MR: usize = 6;

/// See [`super::PanelKernels::product`]: one panel at a time (the gradient's epilogue is the
/// caller's).
///
/// # Safety
/// AVX2 and FMA must be available and the operands of `x` valid for `rows` rows on
/// `col_max.len()` panels (checked by [`super::product`]).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn product_panels(x: Block, rows: usize, col_max: &mut [ColMax]) {
    for (w, max) in col_max.iter_mut().enumerate() {
        let one = Block {
            c: x.c.wrapping_add(w * x.pair.c),
            b: x.b.wrapping_add(w * x.pair.b),
            ..x
        };
        // SAFETY: the caller's contract, for panel w alone.
        unsafe { product(one, rows, max) };
    }
}

/// One panel's product (see [`super::panels_product`]), in blocks of 6 rows, with two to five
/// blocks of 5 instead of one short block at the end (a 4-row block has too few accumulators
/// to hide the FMA latency), and 7 or 8 rows as two blocks of 3 or 4 rather than 6 and 1 or 2.
/// The new values' column maxima widen `col_max`.
///
/// # Safety
/// AVX2 and FMA must be available and the operands of `x` valid for `rows` rows (checked by
/// [`super::product`]).
#[target_feature(enable = "avx2,fma")]
unsafe fn product(x: Block, rows: usize, col_max: &mut ColMax) {
    let fives = if rows >= 20 { (MR - rows % MR) % MR } else { 0 };
    let (b, k, st, acc) = (x.b, x.k, x.st, x.accumulate);
    let mut r0 = 0;
    while r0 < rows {
        let left = rows - r0;
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
                6 => block::<6>(c, a, b, k, st, acc, col_max),
                5 => block::<5>(c, a, b, k, st, acc, col_max),
                4 => block::<4>(c, a, b, k, st, acc, col_max),
                3 => block::<3>(c, a, b, k, st, acc, col_max),
                2 => block::<2>(c, a, b, k, st, acc, col_max),
                _ => block::<1>(c, a, b, k, st, acc, col_max),
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

/// One `R × 16` register block of C over `k` steps; its rows widen `col_max`.
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
    k: usize,
    st: PanelStrides,
    accumulate: bool,
    col_max: &mut ColMax,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let a_row = a_rows::<R>(a, st);
    for l in 0..k {
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
    let max = col_max.as_mut_ptr();
    // SAFETY: `col_max` holds 16 f32.
    let (mut max_lo, mut max_hi) = unsafe { (_mm256_loadu_ps(max), _mm256_loadu_ps(max.add(8))) };
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
        }
    }
    // SAFETY: `col_max` holds 16 f32.
    unsafe {
        _mm256_storeu_ps(max, max_lo);
        _mm256_storeu_ps(max.add(8), max_hi);
    }
}
