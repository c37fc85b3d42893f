//! The forward's tile product on one panel of 16 queries: `C (=|+=) A · B` where
//!
//! * `C` is `rows × 16`, row-major with row stride `c_rs`;
//! * `A` is `rows × k`, read element by element (broadcast) at `a[r·a_rs + l·a_cs]`, so K or V
//!   rows are used in place, whatever their stride, without packing;
//! * `B` is `k × 16`, row `l` at `b[l·b_rs..][..16]`: the 16-query panel (Qᵀ or Pᵀ) the forward
//!   keeps packed.
//!
//! The forward uses it twice per key block: `Sᵀ = K · Qᵀ` (rows: keys, `k`: head dim) and
//! `Oᵀ += Vᵀ · Pᵀ` (rows: value dims, `k`: keys). On x86-64 with AVX2/FMA (detected at run time)
//! a 6×16 register block does 12 FMAs per step with two vector loads and six broadcasts; the
//! portable path computes the same sums in plain Rust.

use super::matmul::Write;

/// Queries per panel: two 8-lane AVX2 vectors.
pub(crate) const PANEL: usize = 16;
/// Rows of C per register block.
const MR: usize = 6;

/// Strides of the three operands (in elements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PanelStrides {
    pub a_rs: usize,
    pub a_cs: usize,
    pub b_rs: usize,
    pub c_rs: usize,
}

/// `C[rows × 16] (=|+=) A[rows × k] · B[k × 16]` (see the module doc for the layouts); returns
/// the largest new value of each of C's 16 columns (−∞ when `rows` is 0), taken from the
/// registers on the way out so the softmax need not read C again.
/// Panics if an operand reaches outside its slice (an internal bug).
pub(crate) fn panel_product(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    write: Write,
) -> [f32; PANEL] {
    let mut col_max = [f32::NEG_INFINITY; PANEL];
    if rows == 0 {
        return col_max;
    }
    assert!(
        (rows - 1) * st.c_rs + PANEL <= c.len(),
        "panel_product: C out of bounds"
    );
    if k == 0 {
        for r in 0..rows {
            let row = &mut c[r * st.c_rs..r * st.c_rs + PANEL];
            if write == Write::Overwrite {
                row.fill(0.0);
            }
            for (m, &x) in col_max.iter_mut().zip(row.iter()) {
                *m = m.max(x);
            }
        }
        return col_max;
    }
    assert!(
        (rows - 1) * st.a_rs + (k - 1) * st.a_cs < a.len(),
        "panel_product: A out of bounds"
    );
    assert!(
        (k - 1) * st.b_rs + PANEL <= b.len(),
        "panel_product: B out of bounds"
    );
    let acc = write == Write::Accumulate;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // Blocks of 6 rows, with two to five blocks of 5 instead of one short block at the end
        // (a 4-row block has too few accumulators to hide the FMA latency).
        let fives = if rows >= 20 { (MR - rows % MR) % MR } else { 0 };
        let mut r0 = 0;
        while r0 < rows {
            let left = rows - r0;
            let mr = if left <= 5 * fives { 5 } else { left.min(MR) };
            let (ar, cr) = (a[r0 * st.a_rs..].as_ptr(), c[r0 * st.c_rs..].as_mut_ptr());
            let b = b.as_ptr();
            // SAFETY: AVX2 and FMA are available (checked above). Rows r0..r0 + mr of A and C and
            // the k rows of B lie inside their slices (the bounds asserted above), and C (borrowed
            // mutably) does not overlap A or B.
            unsafe {
                match mr {
                    6 => avx2::block::<6>(cr, ar, b, k, st, acc, &mut col_max),
                    5 => avx2::block::<5>(cr, ar, b, k, st, acc, &mut col_max),
                    4 => avx2::block::<4>(cr, ar, b, k, st, acc, &mut col_max),
                    3 => avx2::block::<3>(cr, ar, b, k, st, acc, &mut col_max),
                    2 => avx2::block::<2>(cr, ar, b, k, st, acc, &mut col_max),
                    _ => avx2::block::<1>(cr, ar, b, k, st, acc, &mut col_max),
                }
            }
            r0 += mr;
        }
        return col_max;
    }
    portable(c, a, b, rows, k, st, acc)
}

fn portable(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    acc: bool,
) -> [f32; PANEL] {
    let mut col_max = [f32::NEG_INFINITY; PANEL];
    for r in 0..rows {
        let mut sum = [0f32; PANEL];
        for l in 0..k {
            let x = a[r * st.a_rs + l * st.a_cs];
            for (s, y) in sum.iter_mut().zip(&b[l * st.b_rs..l * st.b_rs + PANEL]) {
                *s += x * y;
            }
        }
        let row = &mut c[r * st.c_rs..r * st.c_rs + PANEL];
        for ((o, s), m) in row.iter_mut().zip(sum).zip(col_max.iter_mut()) {
            *o = if acc { *o + s } else { s };
            *m = m.max(*o);
        }
    }
    col_max
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::PanelStrides;

    /// One `R × 16` register block of C over the whole `k`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `a + r·a_rs + l·a_cs` (r < R, l < k), `b + l·b_rs .. + 16`
    /// (l < k) and `c + r·c_rs .. + 16` (r < R) must be valid, C writable and not overlapping A, B.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block<const R: usize>(
        c: *mut f32,
        a: *const f32,
        b: *const f32,
        k: usize,
        st: PanelStrides,
        accumulate: bool,
        col_max: &mut [f32; 16],
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut a_row = [a; R];
        for (r, p) in a_row.iter_mut().enumerate() {
            // SAFETY: row r < R of A is valid (caller's contract).
            *p = unsafe { a.add(r * st.a_rs) };
        }
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
        // SAFETY: `col_max` holds 16 f32.
        let (mut max_lo, mut max_hi) = unsafe {
            (
                _mm256_loadu_ps(col_max.as_ptr()),
                _mm256_loadu_ps(col_max.as_ptr().add(8)),
            )
        };
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
            _mm256_storeu_ps(col_max.as_mut_ptr(), max_lo);
            _mm256_storeu_ps(col_max.as_mut_ptr().add(8), max_hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_for_every_row_count() {
        for (rows, k) in [(1, 1), (5, 3), (6, 64), (13, 17), (64, 256), (7, 0)] {
            let (a_rs, a_cs, b_rs, c_rs) = (1, rows + 3, PANEL + 2, PANEL + 1);
            let a: Vec<f32> = (0..(rows + 3) * k.max(1))
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let b: Vec<f32> = (0..b_rs * k.max(1))
                .map(|i| (i as f32 * 0.11).cos())
                .collect();
            let st = PanelStrides {
                a_rs,
                a_cs,
                b_rs,
                c_rs,
            };
            for write in [Write::Overwrite, Write::Accumulate] {
                let mut c = vec![
                    if write == Write::Overwrite {
                        f32::NAN
                    } else {
                        1.0
                    };
                    rows * c_rs
                ];
                let col_max = panel_product(&mut c, &a, &b, rows, k, st, write);
                for j in 0..PANEL {
                    let want = (0..rows)
                        .map(|r| c[r * c_rs + j])
                        .fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(col_max[j], want);
                }
                for r in 0..rows {
                    for j in 0..PANEL {
                        let want: f32 = (0..k)
                            .map(|l| a[r * a_rs + l * a_cs] * b[l * b_rs + j])
                            .sum::<f32>()
                            + if write == Write::Accumulate { 1.0 } else { 0.0 };
                        let got = c[r * c_rs + j];
                        assert!(
                            (got - want).abs() < 1e-4,
                            "rows {rows} k {k} ({r},{j}): {got} vs {want}"
                        );
                    }
                }
                // The portable path (taken on CPUs without AVX2/FMA) gives the same sums.
                if k > 0 {
                    let mut c2 = vec![
                        if write == Write::Overwrite {
                            f32::NAN
                        } else {
                            1.0
                        };
                        rows * c_rs
                    ];
                    let max2 = portable(&mut c2, &a, &b, rows, k, st, write == Write::Accumulate);
                    for (x, y) in c2.iter().zip(&c).filter(|(x, _)| !x.is_nan()) {
                        assert!((x - y).abs() < 1e-4);
                    }
                    for (x, y) in max2.iter().zip(&col_max) {
                        assert!((x - y).abs() < 1e-4);
                    }
                }
            }
        }
    }
}
