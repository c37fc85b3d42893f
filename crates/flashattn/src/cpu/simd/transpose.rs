//! Strided f32 transpose, for moving rows in and out of the forward's 16-query panels:
//! 16×16 blocks in AVX-512 registers or 8×8 blocks in AVX2 registers when the CPU has them
//! (see [`cpu_simd`]), scalar at the edges and on other CPUs. The copies can scale the
//! columns on the way (the forward's query scale going in, each query's `1 / sum` going out),
//! which saves a pass over the panel.

use crate::cpu::simd::{Kernels, Simd, cpu_simd};

/// Factors for the columns of a transposed source: column `c` is multiplied by `f[c % 16]`
/// (one factor for all columns, or one per query of a 16-query panel).
pub(crate) type ColScale = [f32; 16];

/// `dst[c · dst_rs + r] = src[r · src_rs + c]` for `r < rows`, `c < cols`.
/// Panics if either side reaches outside its slice (an internal bug).
pub(crate) fn transpose(
    dst: &mut [f32],
    dst_rs: usize,
    src: &[f32],
    src_rs: usize,
    rows: usize,
    cols: usize,
) {
    transpose_with(cpu_simd(), dst, dst_rs, (src, src_rs, None), rows, cols);
}

/// [`transpose`] with column `c` multiplied by `f[c % 16]`.
pub(crate) fn transpose_scaled(
    dst: &mut [f32],
    dst_rs: usize,
    src: &[f32],
    src_rs: usize,
    (rows, cols): (usize, usize),
    f: &ColScale,
) {
    transpose_with(cpu_simd(), dst, dst_rs, (src, src_rs, Some(f)), rows, cols);
}

/// A transpose's source: the elements, their row stride and the column factors if any.
type Source<'a> = (&'a [f32], usize, Option<&'a ColScale>);

/// [`transpose_scaled`] with the kernels of `simd` (at most [`cpu_simd`]).
fn transpose_with(
    simd: Simd,
    dst: &mut [f32],
    dst_rs: usize,
    src: Source<'_>,
    rows: usize,
    cols: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        (cols - 1) * dst_rs + rows <= dst.len(),
        "transpose: destination out of bounds"
    );
    // SAFETY: every destination element lies inside `dst` (asserted above), which is borrowed
    // mutably, so nothing else touches it and it does not overlap `src`.
    unsafe { transpose_to(simd, dst.as_mut_ptr(), dst_rs, src, rows, cols) }
}

/// [`transpose_scaled`] (unscaled without factors) with the kernels of `simd` (at most
/// [`cpu_simd`]) into a destination given by pointer: `dst + c · dst_rs + r` for `r < rows`,
/// `c < cols` (for rows of a buffer that other threads write elsewhere at the same time).
///
/// # Safety
/// Those destination elements must be valid for writes, and nothing else may read or write them
/// during the call; `src` must not overlap them.
pub(crate) unsafe fn transpose_to(
    simd: Simd,
    dst: *mut f32,
    dst_rs: usize,
    (src, src_rs, f): Source<'_>,
    rows: usize,
    cols: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        (rows - 1) * src_rs + cols <= src.len(),
        "transpose: source out of bounds"
    );
    // Square blocks in registers, the level's widest first (16×16 with AVX-512, 8×8 with
    // AVX2 also for what the 16×16 blocks leave), elements one by one at the edges.
    let mut covered = (0, 0);
    for &(size, block) in Kernels::of(simd).transpose_blocks {
        let (full_r, full_c) = (rows / size * size, cols / size * size);
        for r in (0..full_r).step_by(size) {
            for c in (0..full_c).step_by(size) {
                if r < covered.0 && c < covered.1 {
                    continue;
                }
                // SAFETY: the level's kernels run on this CPU (`Kernels::of`); the block at
                // (r, c) lies inside the source (asserted above, r + size <= rows and c + size
                // <= cols) and among the destination elements the caller vouches for, which do
                // not overlap the source; `f[c % 16..]` holds at least `size` factors (c is a
                // multiple of `size`).
                unsafe {
                    let d = dst.add(c * dst_rs + r);
                    let s = src.as_ptr().add(r * src_rs + c);
                    let f = f.map(|f| f.as_ptr().add(c % 16));
                    block(d, dst_rs, s, src_rs, f);
                }
            }
        }
        covered = (full_r, full_c);
    }
    let scalar = |rs: std::ops::Range<usize>, cs: std::ops::Range<usize>| {
        for r in rs {
            for c in cs.clone() {
                let x = src[r * src_rs + c] * f.map_or(1.0, |f| f[c % 16]);
                // SAFETY: a destination element the caller vouches for.
                unsafe { dst.add(c * dst_rs + r).write(x) };
            }
        }
    };
    scalar(0..covered.0, covered.1..cols);
    scalar(covered.0..rows, 0..cols);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Transposes the 8×8 block at `src` (row stride `src_rs`) into `dst` (row stride `dst_rs`),
    /// its column `c` multiplied by `f[c]` when `f` is given.
    ///
    /// # Safety
    /// AVX2 must be available; 8 rows of 8 elements must be readable at `src` and writable at
    /// `dst` with their strides, the two must not overlap, and `f` must hold 8 f32.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn block8(
        dst: *mut f32,
        dst_rs: usize,
        src: *const f32,
        src_rs: usize,
        f: Option<*const f32>,
    ) {
        // SAFETY: `f` holds 8 f32 and rows 0..8 of the source block are readable (caller's
        // contract).
        let f = f.map(|f| unsafe { _mm256_loadu_ps(f) });
        let r: [__m256; 8] = std::array::from_fn(|i| {
            let row = unsafe { _mm256_loadu_ps(src.add(i * src_rs)) };
            f.map_or(row, |f| _mm256_mul_ps(row, f))
        });
        // Interleave pairs of rows, then pairs of pairs, then swap 128-bit halves.
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (i, v) in out.into_iter().enumerate() {
            // SAFETY: rows 0..8 of the destination block are writable (caller's contract).
            unsafe { _mm256_storeu_ps(dst.add(i * dst_rs), v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// Transposes the 16×16 block at `src` (row stride `src_rs`) into `dst` (row stride
    /// `dst_rs`), its column `c` multiplied by `f[c]` when `f` is given: 4×4 transposes inside
    /// each 128-bit lane, then a 4×4 transpose of the lanes.
    ///
    /// # Safety
    /// AVX-512F must be available; 16 rows of 16 elements must be readable at `src` and writable
    /// at `dst` with their strides, the two must not overlap, and `f` must hold 16 f32.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn block16(
        dst: *mut f32,
        dst_rs: usize,
        src: *const f32,
        src_rs: usize,
        f: Option<*const f32>,
    ) {
        // SAFETY: `f` holds 16 f32 and rows 0..16 of the source block are readable (caller's
        // contract).
        let f = f.map(|f| unsafe { _mm512_loadu_ps(f) });
        let r: [__m512; 16] = std::array::from_fn(|i| {
            let row = unsafe { _mm512_loadu_ps(src.add(i * src_rs)) };
            f.map_or(row, |f| _mm512_mul_ps(row, f))
        });
        // t: pairs of rows interleaved; u[4g + k]: in 128-bit lane j, column 4j + k of rows
        // 4g..4g + 4.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (g, k) = (i / 4, i % 4);
            let (a, b) = (t[4 * g + k / 2], t[4 * g + 2 + k / 2]);
            if k % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        for k in 0..4 {
            let v0 = _mm512_shuffle_f32x4::<0x44>(u[k], u[4 + k]);
            let v1 = _mm512_shuffle_f32x4::<0xEE>(u[k], u[4 + k]);
            let v2 = _mm512_shuffle_f32x4::<0x44>(u[8 + k], u[12 + k]);
            let v3 = _mm512_shuffle_f32x4::<0xEE>(u[8 + k], u[12 + k]);
            let out = [
                _mm512_shuffle_f32x4::<0x88>(v0, v2),
                _mm512_shuffle_f32x4::<0xDD>(v0, v2),
                _mm512_shuffle_f32x4::<0x88>(v1, v3),
                _mm512_shuffle_f32x4::<0xDD>(v1, v3),
            ];
            for (j, v) in out.into_iter().enumerate() {
                // SAFETY: row 4j + k < 16 of the destination block is writable (caller's
                // contract).
                unsafe { _mm512_storeu_ps(dst.add((4 * j + k) * dst_rs), v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition_on_every_edge() {
        // Factors that are exact in f32, different for each of 16 columns.
        let factors: ColScale = std::array::from_fn(|c| 0.25 * (c as f32 + 1.0));
        for (rows, cols) in [
            (1, 1),
            (8, 8),
            (16, 64),
            (13, 80),
            (16, 1),
            (3, 17),
            (64, 16),
            (16, 16),
            (32, 48),
            (40, 24),
            (17, 33),
        ] {
            let (src_rs, dst_rs) = (cols + 5, rows + 3);
            let src: Vec<f32> = (0..rows * src_rs).map(|i| i as f32).collect();
            for simd in Simd::available() {
                for f in [None, Some(&factors)] {
                    let mut dst = vec![f32::NAN; cols * dst_rs];
                    transpose_with(simd, &mut dst, dst_rs, (&src, src_rs, f), rows, cols);
                    for r in 0..rows {
                        for c in 0..cols {
                            let want = src[r * src_rs + c] * f.map_or(1.0, |f| f[c % 16]);
                            assert_eq!(
                                dst[c * dst_rs + r],
                                want,
                                "{simd} {rows}×{cols} ({r},{c}) scaled: {}",
                                f.is_some()
                            );
                        }
                    }
                }
            }
        }
    }
}
