//! The machine's f32 matrix-product rate: the ceiling the CPU attention's FLOP rates are read
//! against (the issue's target is a share of it). A square sgemm `C = A·B` by the `gemm` crate
//! on all rayon threads, with the crate's own choice of kernels (AVX-512 where the CPU has it).

use std::hint::black_box;
use std::time::Instant;

use rand::{RngExt, SeedableRng, rngs::StdRng};

use crate::host_buf::HostBuf;

/// A square f32 product `C = A·B` of random `n × n` operands, kept for repeated timing.
///
/// ```
/// use flashattn::reference::ceiling::Sgemm;
/// let mut g = Sgemm::new(64, 1);
/// assert_eq!(g.flops(), 2.0 * 64f64.powi(3));
/// assert!(g.gflops(2) > 0.0);
/// ```
pub struct Sgemm {
    n: usize,
    a: HostBuf<f32>,
    b: HostBuf<f32>,
    c: HostBuf<f32>,
}

impl Sgemm {
    /// Operands of `n × n` drawn uniformly from [-1, 1) with `seed`; `C` starts as NaN. They lie
    /// in buffers allocated as flashattn allocates its tensors (huge pages for large ones: see
    /// [`crate::set_huge_pages`]), so that the ceiling and the attention it is read against run
    /// on the same kind of memory.
    pub fn new(n: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut draw =
            || HostBuf::collected(n * n, (0..n * n).map(|_| rng.random_range(-1.0f32..1.0)));
        Sgemm {
            n,
            a: draw(),
            b: draw(),
            c: HostBuf::filled(n * n, f32::NAN),
        }
    }

    /// The FLOPs of one product, `2·n³`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.n as f64).powi(3)
    }

    /// One product on all rayon threads, `C` overwritten.
    pub fn run(&mut self) {
        let (n, s) = (self.n, self.n as isize);
        // SAFETY: a, b and c each hold n·n elements, row-major (row stride n, column stride
        // 1), and c, borrowed mutably, aliases neither a nor b.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                self.c.as_mut_ptr(),
                1,
                s,
                false,
                self.a.as_ptr(),
                1,
                s,
                self.b.as_ptr(),
                1,
                s,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            )
        }
        black_box(&self.c);
    }

    /// GFLOP/s of the fastest of `repeats` products (at least one), after one untimed product.
    pub fn gflops(&mut self, repeats: u32) -> f64 {
        self.run();
        let best = (0..repeats.max(1))
            .map(|_| {
                let start = Instant::now();
                self.run();
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        self.flops() / best.max(1e-9) / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_product_is_a_times_b() {
        let n = 37;
        let mut g = Sgemm::new(n, 5);
        g.run();
        for (i, j) in [(0, 0), (3, 29), (36, 36), (20, 1)] {
            let want: f64 = (0..n)
                .map(|k| g.a[i * n + k] as f64 * g.b[k * n + j] as f64)
                .sum();
            let got = g.c[i * n + j] as f64;
            assert!((got - want).abs() < 1e-4, "C[{i},{j}] = {got}, want {want}");
        }
    }
}
