//! Lane-wise operations on `rows × 16` panels (one lane per query), for the online softmax:
//! one AVX-512 vector per row when the CPU has it, plain Rust otherwise (which the compiler
//! vectorizes with the baseline SSE2).

use super::exp::LANES;
#[cfg(target_arch = "x86_64")]
use super::simd::{Simd, cpu_simd};

/// The largest value of each lane over the rows of a `rows × 16` panel (−∞ for no rows).
pub(crate) fn lane_max(s: &[f32]) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if cpu_simd() == Simd::Avx512 {
        // SAFETY: the CPU supports AVX-512F.
        return unsafe { avx512::lane_max(s) };
    }
    let mut m = [f32::NEG_INFINITY; LANES];
    for row in s.chunks_exact(LANES) {
        for (m, &v) in m.iter_mut().zip(row) {
            *m = if v > *m { v } else { *m };
        }
    }
    m
}

/// `x[r][l] *= f[l]` for every row `r` of a `rows × 16` panel.
pub(crate) fn scale_lanes(x: &mut [f32], f: &[f32; LANES]) {
    #[cfg(target_arch = "x86_64")]
    if cpu_simd() == Simd::Avx512 {
        // SAFETY: the CPU supports AVX-512F.
        return unsafe { avx512::scale_lanes(x, f) };
    }
    for row in x.chunks_exact_mut(LANES) {
        for (a, s) in row.iter_mut().zip(f) {
            *a *= s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::LANES;

    #[target_feature(enable = "avx512f")]
    pub(super) fn lane_max(s: &[f32]) -> [f32; LANES] {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for row in s.chunks_exact(LANES) {
            // SAFETY: `row` holds 16 f32.
            m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(row.as_ptr()) });
        }
        let mut out = [0f32; LANES];
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), m) };
        out
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn scale_lanes(x: &mut [f32], f: &[f32; LANES]) {
        // SAFETY: `f` holds 16 f32.
        let f = unsafe { _mm512_loadu_ps(f.as_ptr()) };
        for row in x.chunks_exact_mut(LANES) {
            // SAFETY: `row` holds 16 f32.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr()), f);
                _mm512_storeu_ps(row.as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_max_and_scale_match_scalar_loops() {
        for rows in [0, 1, 3, 40] {
            let x: Vec<f32> = (0..rows * LANES).map(|i| (i as f32 * 0.7).sin()).collect();
            let m = lane_max(&x);
            for l in 0..LANES {
                let want = (0..rows)
                    .map(|r| x[r * LANES + l])
                    .fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(m[l], want);
            }
            let f: [f32; LANES] = std::array::from_fn(|l| l as f32 - 3.5);
            let mut y = x.clone();
            scale_lanes(&mut y, &f);
            for (i, (a, b)) in y.iter().zip(&x).enumerate() {
                assert_eq!(*a, b * f[i % LANES]);
            }
        }
    }
}
