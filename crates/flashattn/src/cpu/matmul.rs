//! Tile products on f32: a thin, bounds-checked wrapper over the `gemm` crate, which picks its
//! SIMD kernel (AVX-512 or AVX2/FMA on x86-64, built with its `x86-v4` feature; a portable one
//! elsewhere) at run time.
//!
//! Every product runs on the calling thread (`Parallelism::None`): the attention kernels are
//! already parallel over (batch, head, block) with rayon, one tile product per task at a time.
//!
//! ```ignore
//! // S = Q·Kᵀ for a Br×D query tile and a Bc×D key tile, both row-major:
//! matmul(MatMut::row_major(&mut s, br, bc), MatRef::row_major(&q, br, d),
//!        MatRef::row_major(&k, bc, d).t(), Write::Overwrite);
//! // O += P·V:
//! matmul(MatMut::row_major(&mut o, br, dv), MatRef::row_major(&p, br, bc),
//!        MatRef::row_major(&v, bc, dv), Write::Accumulate);
//! ```

/// Where element `(r, c)` of a strided matrix lives: `r · row_stride + c · col_stride`.
#[derive(Clone, Copy, Debug)]
struct Shape {
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Shape {
    /// Panics unless every element lies inside a buffer of `len` elements.
    fn check(&self, len: usize, what: &str) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let last = (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride;
        assert!(
            last < len,
            "{what}: {}×{} matrix with strides ({}, {}) reaches element {last} of a buffer of {len}",
            self.rows,
            self.cols,
            self.row_stride,
            self.col_stride
        );
    }
}

/// A read-only strided view of an f32 matrix.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    shape: Shape,
}

impl<'a> MatRef<'a> {
    /// A `rows × cols` view with explicit strides (in elements). Panics if it reaches outside `data`.
    pub(crate) fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        let shape = Shape {
            rows,
            cols,
            row_stride,
            col_stride,
        };
        shape.check(data.len(), "MatRef");
        MatRef { data, shape }
    }

    /// A dense row-major `rows × cols` view (row stride `cols`).
    pub(crate) fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        MatRef {
            data: self.data,
            shape: Shape {
                rows: self.shape.cols,
                cols: self.shape.rows,
                row_stride: self.shape.col_stride,
                col_stride: self.shape.row_stride,
            },
        }
    }

    /// Number of rows.
    pub(crate) fn rows(&self) -> usize {
        self.shape.rows
    }

    /// Number of columns.
    pub(crate) fn cols(&self) -> usize {
        self.shape.cols
    }
}

/// A mutable strided view of an f32 matrix.
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    data: &'a mut [f32],
    shape: Shape,
}

impl<'a> MatMut<'a> {
    /// A `rows × cols` view with explicit strides (in elements). Panics if it reaches outside
    /// `data`. The strides must not make two elements alias (they are distinct in every use here).
    pub(crate) fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        let shape = Shape {
            rows,
            cols,
            row_stride,
            col_stride,
        };
        shape.check(data.len(), "MatMut");
        MatMut { data, shape }
    }

    /// A dense row-major `rows × cols` view (row stride `cols`).
    pub(crate) fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        MatMut {
            data: self.data,
            shape: Shape {
                rows: self.shape.cols,
                cols: self.shape.rows,
                row_stride: self.shape.col_stride,
                col_stride: self.shape.row_stride,
            },
        }
    }
}

/// What [`matmul`] does with the destination's previous contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// `dst = a·b` (the old contents are never read: they may be garbage or NaN).
    Overwrite,
    /// `dst += a·b`.
    Accumulate,
}

/// `dst (=|+=) a · b` in f32, on the calling thread. Shapes must agree (`a`: m×k, `b`: k×n,
/// `dst`: m×n); panics otherwise (an internal bug, never reachable from the public API).
pub(crate) fn matmul(dst: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, write: Write) {
    let (m, k, n) = (a.shape.rows, a.shape.cols, b.shape.cols);
    assert!(
        b.shape.rows == k && dst.shape.rows == m && dst.shape.cols == n,
        "matmul shapes: dst {}×{}, a {m}×{k}, b {}×{n}",
        dst.shape.rows,
        dst.shape.cols,
        b.shape.rows
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if write == Write::Overwrite {
            for r in 0..m {
                for c in 0..n {
                    dst.data[r * dst.shape.row_stride + c * dst.shape.col_stride] = 0.0;
                }
            }
        }
        return;
    }
    let s = |x: usize| x as isize;
    // SAFETY: the three views were bounds-checked against their slices when built (`Shape::check`),
    // so every element gemm touches lies inside them; `dst` is borrowed mutably and cannot alias
    // `a` or `b`; the dimensions passed are the views' own.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            s(dst.shape.col_stride),
            s(dst.shape.row_stride),
            write == Write::Accumulate,
            a.data.as_ptr(),
            s(a.shape.col_stride),
            s(a.shape.row_stride),
            b.data.as_ptr(),
            s(b.shape.col_stride),
            s(b.shape.row_stride),
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
            }
        }
        c
    }

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.618).sin()).collect()
    }

    #[test]
    fn matches_naive_with_transposes_and_accumulation() {
        for (m, k, n) in [(1, 1, 1), (7, 3, 5), (64, 80, 33), (65, 1, 130)] {
            let a = data(m * k, 0.5);
            let b = data(k * n, 1.5);
            let want = naive(&a, &b, m, k, n);
            // b stored transposed (n×k row-major), dst written transposed (n×m row-major).
            let bt: Vec<f32> = (0..n * k).map(|x| b[(x % k) * n + x / k]).collect();
            let mut dt = vec![f32::NAN; n * m];
            matmul(
                MatMut::row_major(&mut dt, n, m).t(),
                MatRef::row_major(&a, m, k),
                MatRef::row_major(&bt, n, k).t(),
                Write::Overwrite,
            );
            for i in 0..m {
                for j in 0..n {
                    assert!((dt[j * m + i] - want[i * n + j]).abs() < 1e-4);
                }
            }
            let mut d = vec![1.0f32; m * n];
            matmul(
                MatMut::row_major(&mut d, m, n),
                MatRef::row_major(&a, m, k),
                MatRef::row_major(&b, k, n),
                Write::Accumulate,
            );
            for (x, w) in d.iter().zip(&want) {
                assert!((x - (w + 1.0)).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn empty_inner_dimension_overwrites_with_zero() {
        let mut d = vec![f32::NAN; 6];
        matmul(
            MatMut::row_major(&mut d, 2, 3),
            MatRef::row_major(&[], 2, 0),
            MatRef::row_major(&[], 0, 3),
            Write::Overwrite,
        );
        assert!(d.iter().all(|&x| x == 0.0));
    }
}
