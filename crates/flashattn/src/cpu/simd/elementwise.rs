//! The backward's `D = rowsum(dO∘O)` dot products, in AVX-512 when the CPU has it (the
//! baseline build gives the compiler only SSE2's 4 lanes), plain Rust otherwise. (`dS =
//! P∘(dP − D)` is the epilogue of `dP`'s product: `microkernel::softmax_grad_product`.)

use crate::cpu::simd::kernels;

/// `Σ a[j]·b[j]` (equal lengths), in several partial sums.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    (kernels().dot)(a, b)
}

/// The portable level's kernel.
pub(crate) mod portable {
    /// See [`super::dot`]: eight running sums, which the compiler keeps in vector lanes.
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut sums = [0f32; 8];
        let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ca.zip(cb) {
            for ((s, x), y) in sums.iter_mut().zip(x).zip(y) {
                *s += x * y;
            }
        }
        sums.iter().sum::<f32>() + tail
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    const LANES: usize = 16;

    #[target_feature(enable = "avx512f")]
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (ca, cb) = (a.chunks_exact(2 * LANES), b.chunks_exact(2 * LANES));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            // SAFETY: `x` and `y` hold 32 f32 each.
            unsafe {
                s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr()), s0);
                let (x1, y1) = (x.as_ptr().add(LANES), y.as_ptr().add(LANES));
                s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1), _mm512_loadu_ps(y1), s1);
            }
        }
        let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::simd::{Kernels, Simd};

    #[test]
    fn dot_matches_f64_sums() {
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 64, 100] {
            let p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos().abs()).collect();
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.91).sin()).collect();
            let want: f64 = p.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
            let norm: f64 = p
                .iter()
                .zip(&g)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            for level in Simd::available() {
                let got = (Kernels::of(level).dot)(&p, &g) as f64;
                assert!(
                    (got - want).abs() <= 1e-6 * norm.max(1.0),
                    "{level} n {n}: {got} vs {want}"
                );
            }
        }
    }
}
