//! Strided matrix products by the `gemm` crate, bounds-checked before its unsafe call: the
//! layer's f32 projections and linear attention's f64 chunk products share it.

pub(crate) use gemm::Parallelism;

/// An element type `gemm` multiplies.
pub(crate) trait GemmElement: Copy + 'static {
    const ZERO: Self;
    const ONE: Self;
}

impl GemmElement for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl GemmElement for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// A matrix operand: its elements, row stride and column stride (a transpose swaps them).
pub(crate) type Operand<'a, T> = (&'a [T], usize, usize);

/// `dst[m×n] = a·b`, or `dst += a·b` with `accumulate`, `a` being `m×k`, `b` `k×n`, `dst`
/// row-major.
pub(crate) fn matmul<T: GemmElement>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    a: Operand<'_, T>,
    b: Operand<'_, T>,
    accumulate: bool,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    let dst = &mut dst[..m * n];
    if k == 0 {
        if !accumulate {
            dst.fill(T::ZERO);
        }
        return;
    }
    let last =
        |(_, rs, cs): Operand<'_, T>, rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(last(a, m, k) < a.0.len(), "lhs out of bounds");
    assert!(last(b, k, n) < b.0.len(), "rhs out of bounds");
    // SAFETY: the asserts keep every element gemm reads inside `a` and `b`, `dst` holds the m×n
    // row-major result, and the three are distinct borrows, so nothing aliases.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.0.as_ptr(),
            a.2 as isize,
            a.1 as isize,
            b.0.as_ptr(),
            b.2 as isize,
            b.1 as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        )
    }
}
