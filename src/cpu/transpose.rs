//! Strided f32 transpose, for moving rows in and out of the forward's 16-query panels:
//! 8×8 blocks in AVX2 registers when the CPU has it (detected at run time), scalar at the edges
//! and on other CPUs.

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
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        (rows - 1) * src_rs + cols <= src.len(),
        "transpose: source out of bounds"
    );
    assert!(
        (cols - 1) * dst_rs + rows <= dst.len(),
        "transpose: destination out of bounds"
    );
    let (full_r, full_c) = (rows / 8 * 8, cols / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    let blocked = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let blocked = false;
    if blocked {
        for r in (0..full_r).step_by(8) {
            for c in (0..full_c).step_by(8) {
                // SAFETY: AVX2 is available (checked above); the 8×8 block at (r, c) lies inside
                // both slices (the bounds asserted above, r + 8 <= rows and c + 8 <= cols), and
                // `dst` is borrowed mutably, so it does not overlap `src`.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    avx2::block8(
                        dst.as_mut_ptr().add(c * dst_rs + r),
                        dst_rs,
                        src.as_ptr().add(r * src_rs + c),
                        src_rs,
                    )
                };
            }
        }
    }
    let scalar = |dst: &mut [f32], rs: std::ops::Range<usize>, cs: std::ops::Range<usize>| {
        for r in rs {
            for c in cs.clone() {
                dst[c * dst_rs + r] = src[r * src_rs + c];
            }
        }
    };
    if blocked {
        scalar(dst, 0..full_r, full_c..cols);
        scalar(dst, full_r..rows, 0..cols);
    } else {
        scalar(dst, 0..rows, 0..cols);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Transposes the 8×8 block at `src` (row stride `src_rs`) into `dst` (row stride `dst_rs`).
    ///
    /// # Safety
    /// AVX2 must be available; 8 rows of 8 elements must be readable at `src` and writable at
    /// `dst` with their strides, and the two must not overlap.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block8(dst: *mut f32, dst_rs: usize, src: *const f32, src_rs: usize) {
        // SAFETY: rows 0..8 of the source block are readable (caller's contract).
        let r: [__m256; 8] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * src_rs)) });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition_on_every_edge() {
        for (rows, cols) in [
            (1, 1),
            (8, 8),
            (16, 64),
            (13, 80),
            (16, 1),
            (3, 17),
            (64, 16),
        ] {
            let (src_rs, dst_rs) = (cols + 5, rows + 3);
            let src: Vec<f32> = (0..rows * src_rs).map(|i| i as f32).collect();
            let mut dst = vec![f32::NAN; cols * dst_rs];
            transpose(&mut dst, dst_rs, &src, src_rs, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        dst[c * dst_rs + r],
                        src[r * src_rs + c],
                        "{rows}×{cols} ({r},{c})"
                    );
                }
            }
        }
    }
}
