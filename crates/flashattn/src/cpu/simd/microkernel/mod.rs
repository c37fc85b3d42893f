//! The tile products on 16-query panels: `C (=|+=) A · B` where
//!
//! * `C` is `rows × 16`, row-major with row stride `c_rs`;
//! * `A` is `rows × k`, read element by element (broadcast) at `a[r·a_rs + l·a_cs]`, so K or V
//!   rows are used in place, whatever their stride, without packing;
//! * `B` is `k × 16`, row `l` at `b[l·b_rs..][..16]`: the 16-query panel (Qᵀ or Pᵀ) the forward
//!   keeps packed.
//!
//! The forward uses it twice per key block: `Sᵀ = K · Qᵀ` (rows: keys, `k`: head dim) and
//! `Oᵀ += Vᵀ · Pᵀ` (rows: value dims, `k`: keys), the latter through [`softmax_product()`], which
//! also turns the scores into `Pᵀ` on the way. The backward's `dP = dO·Vᵀ` goes through
//! [`softmax_grad_product()`], whose blocks leave as `dS = P∘(dP − D)`. [`panels_product`] can
//! multiply the same `A` by two panels at once (two `B`s and two `C`s, each a fixed offset from
//! the first), so each broadcast of `A` feeds two FMAs.
//!
//! Kernels, by level (their cache-hot rates against the FMA peak are in BENCHMARKS.md):
//!
//! | level    | register block (rows × panels) |
//! |----------|--------------------------------|
//! | avx512   | 12 × 2 (pairs), 24 × 1         |
//! | avx2     | 6 × 1 (two 8-lane halves)      |
//! | portable | plain Rust                     |
//!
//! The pair's 24 accumulators need 14 loads per 24 FMAs (two `B` rows, twelve broadcasts); a
//! single panel's 24 need 25, which is what holds it back. Without AVX-512 a pair is two
//! single-panel products.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod portable;
mod softmax_grad;
mod softmax_product;

use crate::cpu::simd::{Kernels, Simd, cpu_simd};

pub(crate) use softmax_grad::softmax_grad_product;
pub(crate) use softmax_product::softmax_product;

/// What a product does with C's previous contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// `C = A·B` (the old contents are never read: they may be garbage or NaN).
    Overwrite,
    /// `C += A·B`.
    Accumulate,
}

/// Queries per panel: one 16-lane AVX-512 vector, two 8-lane AVX2 vectors.
pub(crate) const PANEL: usize = 16;

/// Strides of the three operands (in elements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PanelStrides {
    pub a_rs: usize,
    pub a_cs: usize,
    pub b_rs: usize,
    pub c_rs: usize,
}

/// Where the second panel of a pair starts, relative to the first (in elements).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PairOffsets {
    pub b: usize,
    pub c: usize,
}

/// The maxima of each of C's 16 columns.
pub(crate) type ColMax = [f32; PANEL];

/// `C[rows × 16] (=|+=) A[rows × k] · B[k × 16]` (see the module doc for the layouts), on
/// two panels at once when `pair` is given: panel `w` of B starts at `b[w·pair.b..]` and of C
/// at `c[w·pair.c..]` (the two C panels must not overlap: one after the other, or side by side
/// in the same rows). Returns the maximum of each of C's 16 columns' new values, per panel
/// (−∞ when `rows` is 0, and for the second panel when there is none), taken from the
/// registers on the way out so the softmax need not read C again; every level returns them
/// exactly.
/// Panics if an operand reaches outside its slice (an internal bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn panels_product(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    pair: Option<PairOffsets>,
    write: Write,
) -> [ColMax; 2] {
    match pair {
        Some(pair) => product::<2>(cpu_simd(), c, a, b, rows, k, st, pair, write),
        None => {
            let one = PairOffsets::default();
            let [max] = product::<1>(cpu_simd(), c, a, b, rows, k, st, one, write);
            [max, NO_MAX]
        }
    }
}

/// The column maxima of no values.
pub(crate) const NO_MAX: ColMax = [f32::NEG_INFINITY; PANEL];

/// Widens the column maxima `max` to take in `other`.
pub(crate) fn join_max(max: &mut ColMax, other: &ColMax) {
    for (m, o) in max.iter_mut().zip(other) {
        *m = m.max(*o);
    }
}

/// A level's product kernel (see [`PanelKernels::product`]).
pub(crate) type ProductFn = unsafe fn(x: Block, rows: usize, col_max: &mut [ColMax]);

/// A level's fused softmax product (see [`PanelKernels::product_exp`]).
pub(crate) type ProductExpFn =
    unsafe fn(x: Block, rows: usize, shift: &[ColMax], sums: &mut [ColMax]);

/// One level's panel kernels (a field of [`Kernels`]).
pub(crate) struct PanelKernels {
    /// The product of [`product`] on `col_max.len()` panels (1 or 2), which widens `col_max`;
    /// it stores the softmax gradient's epilogue itself (`Block::grad`) where `grad` says so.
    ///
    /// # Safety
    /// The level's CPU features must be available, and the operands valid for `rows` rows
    /// (checked by [`product`]).
    pub(crate) product: ProductFn,
    /// The softmax product with its exponentials inside the first block's loop, for A's columns
    /// contiguous (see [`softmax_product()`]), where the level has one.
    ///
    /// # Safety
    /// As for `product`, with `a_rs == 1`, B writable through `x.b` and `st.b_rs == 16`.
    pub(crate) product_exp: Option<ProductExpFn>,
    /// Whether `product` honours `Block::grad` (for A's rows not contiguous).
    pub(crate) grad: bool,
}

/// The operands of one register block, as raw pointers (see [`product`] for their checks).
#[derive(Clone, Copy)]
pub(crate) struct Block {
    c: *mut f32,
    a: *const f32,
    b: *const f32,
    k: usize,
    st: PanelStrides,
    pair: PairOffsets,
    accumulate: bool,
    /// Store `P ∘ (acc − delta[r])` instead of `acc` (see [`softmax_grad_product`]).
    grad: Option<GradRows>,
}

/// The softmax gradient's operands: P at C's offsets, `delta` one value per row of C.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct GradRows {
    p: *const f32,
    delta: *const f32,
}

impl Block {
    /// The product of `k` steps on C, A and B from their first elements, plainly stored
    /// (`accumulate` false, no gradient).
    fn new(
        c: *mut f32,
        a: *const f32,
        b: *const f32,
        k: usize,
        st: PanelStrides,
        pair: PairOffsets,
    ) -> Block {
        Block {
            c,
            a,
            b,
            k,
            st,
            pair,
            accumulate: false,
            grad: None,
        }
    }

    /// The block `rows` rows further down C and A.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn down(self, rows: usize) -> Block {
        Block {
            c: self.c.wrapping_add(rows * self.st.c_rs),
            a: self.a.wrapping_add(rows * self.st.a_rs),
            grad: self.grad.map(|g| GradRows {
                p: g.p.wrapping_add(rows * self.st.c_rs),
                delta: g.delta.wrapping_add(rows),
            }),
            ..self
        }
    }
}

/// The product on `W` panels with the kernels of `simd` (at most the CPU's level).
#[allow(clippy::too_many_arguments)]
fn product<const W: usize>(
    simd: Simd,
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    pair: PairOffsets,
    write: Write,
) -> [ColMax; W] {
    let mut col_max = [NO_MAX; W];
    if rows == 0 {
        return col_max;
    }
    check_c::<W>(c.len(), rows, st, pair);
    if k == 0 {
        for (w, max) in col_max.iter_mut().enumerate() {
            for r in 0..rows {
                let row = &mut c[w * pair.c + r * st.c_rs..][..PANEL];
                if write == Write::Overwrite {
                    row.fill(0.0);
                }
                join_max(max, &(&*row).try_into().expect("a row of 16"));
            }
        }
        return col_max;
    }
    check_ab::<W>(a.len(), b.len(), rows, k, st, pair);
    let block = Block {
        accumulate: write == Write::Accumulate,
        ..Block::new(c.as_mut_ptr(), a.as_ptr(), b.as_ptr(), k, st, pair)
    };
    // SAFETY: the level's kernels run on this CPU (`Kernels::of`); the operands are inside
    // their slices (asserted above) and C, borrowed mutably, overlaps neither A nor B nor (for
    // a pair) its other panel.
    unsafe { (Kernels::of(simd).panels.product)(block, rows, &mut col_max) };
    col_max
}

/// Panics unless the `rows × 16` panels of C lie inside `c_len` elements and apart (rows ≥ 1).
fn check_c<const W: usize>(c_len: usize, rows: usize, st: PanelStrides, pair: PairOffsets) {
    for w in 0..W {
        assert!(
            w * pair.c + (rows - 1) * st.c_rs + PANEL <= c_len,
            "panel product: C out of bounds"
        );
    }
    if W == 2 {
        // The second panel starts after the first one's last row, or sits beside it in the
        // same rows (within each row's stride).
        let after = pair.c >= (rows - 1) * st.c_rs + PANEL;
        let beside = pair.c >= PANEL && pair.c + PANEL <= st.c_rs;
        assert!(after || beside, "panel product: the two C panels overlap");
    }
}

/// Panics unless A (`rows × k`) and the `W` panels of B (`k × 16`) lie inside their slices
/// (rows, k ≥ 1).
fn check_ab<const W: usize>(
    a_len: usize,
    b_len: usize,
    rows: usize,
    k: usize,
    st: PanelStrides,
    pair: PairOffsets,
) {
    assert!(
        (rows - 1) * st.a_rs + (k - 1) * st.a_cs < a_len,
        "panel product: A out of bounds"
    );
    assert!(
        (W - 1) * pair.b + (k - 1) * st.b_rs + PANEL <= b_len,
        "panel product: B out of bounds"
    );
}

#[cfg(test)]
mod tests;
