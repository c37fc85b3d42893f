//! `Oᵀ += Vᵀ · Pᵀ` with the softmax's exponentials computed on the way: B arrives holding the
//! scores `Sᵀ` of one or two panels and leaves holding `Pᵀ = 2^(Sᵀ − shift)` (per panel and
//! lane), and the lane sums of `Pᵀ` come back for the running sums.
//!
//! With AVX-512 the first register block computes each row of `Pᵀ` just before it multiplies
//! it, and stores it for the other blocks: the exponentials' rounding, table lookup and scaling
//! run beside the FMAs instead of in a pass of their own. Other levels run the exp pass first,
//! then the plain product. The fused block computes row `l + 8` while it multiplies row `l`:
//! the exponential's long dependency chain would otherwise stall the FMAs (see BENCHMARKS.md
//! for what the fusion saves).

use super::Write;
use super::{Block, ColMax, PANEL, PairOffsets, PanelStrides, check_ab, check_c, product};
use crate::cpu::simd::{Kernels, Simd, cpu_simd};

/// `C[rows × 16] += A[rows × k] · 2^(B − shift)` on one panel or two (`pair`, laid out as for
/// [`super::panels_product`]), where each panel of B is `k` contiguous rows of 16
/// (`st.b_rs == 16`) and is overwritten by `2^(B − shift)`. `shift[w]` holds a finite shift per
/// lane of panel `w`, at least every score of its lane (a running maximum), so that every
/// exponent is ≤ 0; scores of −∞ give 0.
/// Returns the lane sums of each panel's new B (0 for the second panel when there is none).
/// Panics if an operand reaches outside its slice or the two B panels overlap.
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_product(
    c: &mut [f32],
    a: &[f32],
    b: &mut [f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    pair: Option<PairOffsets>,
    shift: &[ColMax; 2],
) -> [ColMax; 2] {
    match pair {
        Some(pair) => product_exp::<2>(cpu_simd(), c, a, b, rows, k, st, pair, shift),
        None => {
            let one = PairOffsets::default();
            let [sum] = product_exp::<1>(cpu_simd(), c, a, b, rows, k, st, one, &[shift[0]]);
            [sum, [0.0; PANEL]]
        }
    }
}

/// [`softmax_product`] on `W` panels with the product kernels of `simd` (at most the CPU's
/// level; the separate exp pass, where there is one, runs at the CPU's level).
#[allow(clippy::too_many_arguments)]
pub(super) fn product_exp<const W: usize>(
    simd: Simd,
    c: &mut [f32],
    a: &[f32],
    b: &mut [f32],
    rows: usize,
    k: usize,
    st: PanelStrides,
    pair: PairOffsets,
    shift: &[ColMax; W],
) -> [ColMax; W] {
    assert_eq!(st.b_rs, PANEL, "softmax product: B rows must be contiguous");
    let mut sums = [[0f32; PANEL]; W];
    if k == 0 {
        return sums;
    }
    // B's bounds: `check_ab` below, or the slicing of the exp pass and `product`'s check.
    assert!(
        W == 1 || pair.b >= k * PANEL,
        "softmax product: the two B panels overlap"
    );
    let kernels = Kernels::of(simd);
    if let Some(fused) = kernels.panels.product_exp
        && st.a_rs == 1
        && rows > 0
    {
        check_c::<W>(c.len(), rows, st, pair);
        check_ab::<W>(a.len(), b.len(), rows, k, st, pair);
        let b = b.as_mut_ptr().cast_const();
        let block = Block {
            accumulate: true,
            ..Block::new(c.as_mut_ptr(), a.as_ptr(), b, k, st, pair)
        };
        // SAFETY: the level's kernels run on this CPU (`Kernels::of`); the operands lie
        // inside their slices (checked above); B, borrowed mutably, may be written through
        // `block.b`, and C, also borrowed mutably, overlaps neither A nor B nor its other panel.
        unsafe { fused(block, rows, shift, &mut sums) };
        return sums;
    }
    for (w, sum) in sums.iter_mut().enumerate() {
        *sum = (kernels.exp2_shifted_panel)(&mut b[w * pair.b..][..k * PANEL], &shift[w]);
    }
    product::<W>(simd, c, a, b, rows, k, st, pair, Write::Accumulate);
    sums
}
