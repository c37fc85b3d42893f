//! `dS = P ∘ (dO·Vᵀ − D)` in one product: the backward's `dP` never reaches memory. With
//! AVX-512 each register block is turned into `dS` on its way out (the row's `D` subtracted,
//! times the probabilities at the same place in the score tile); other levels run the plain
//! product, then that function over the stored rows.
//!
//! As a pass of its own over the stored `dP` (load it and P, store `dS`), it waited on its
//! stores; fused, the backward runs 1–2% faster (see BENCHMARKS.md).
//!
//! The epilogue is compiled into kernels of its own (the kernels' `GRAD`). With a run-time
//! choice in every kernel's store instead (this epilogue and an exponential one, `P = 2^(S −
//! lse)`, side by side), the plain kernels kept the epilogues' constants in registers and the
//! forward ran at less than half its rate. An exponential epilogue, compiled apart or run out
//! of line on each block's rows, gained nothing over the backward's separate exp pass.

use super::Write;
use super::{Block, GradRows, PANEL, PairOffsets, PanelStrides, check_ab, check_c, product};
use crate::cpu::simd::{Kernels, Simd, cpu_simd};

/// `C[r] = P[r] ∘ (A[r]·B − delta[r])` for every row `r` of C (`rows × 16`, one panel or two
/// as in [`super::panels_product`]), where P holds a panel (or two) at the same offsets and
/// strides as C. Panics if an operand reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_grad_product(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    (rows, k): (usize, usize),
    st: PanelStrides,
    pair: Option<PairOffsets>,
    p: &[f32],
    delta: &[f32],
) {
    match pair {
        Some(pair) => grad::<2>(cpu_simd(), c, a, b, (rows, k), st, pair, (p, delta)),
        None => {
            let one = PairOffsets::default();
            grad::<1>(cpu_simd(), c, a, b, (rows, k), st, one, (p, delta))
        }
    }
}

/// [`softmax_grad_product`] on `W` panels with the kernels of `simd` (at most the CPU's level).
#[allow(clippy::too_many_arguments)]
pub(super) fn grad<const W: usize>(
    simd: Simd,
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    (rows, k): (usize, usize),
    st: PanelStrides,
    pair: PairOffsets,
    (p, delta): (&[f32], &[f32]),
) {
    if rows == 0 {
        return;
    }
    check_c::<W>(c.len(), rows, st, pair);
    check_c::<W>(p.len(), rows, st, pair);
    assert!(
        delta.len() >= rows,
        "softmax grad product: a row's D missing"
    );
    let kernels = &Kernels::of(simd).panels;
    // The epilogue kernels read A by rows (`a_rs != 1`), as the backward's dO is.
    if kernels.grad && k > 0 && st.a_rs != 1 {
        check_ab::<W>(a.len(), b.len(), rows, k, st, pair);
        let grad = GradRows {
            p: p.as_ptr(),
            delta: delta.as_ptr(),
        };
        let block = Block {
            grad: Some(grad),
            ..Block::new(c.as_mut_ptr(), a.as_ptr(), b.as_ptr(), k, st, pair)
        };
        let mut col_max = [[f32::NEG_INFINITY; PANEL]; W];
        // SAFETY: the level's kernels run on this CPU (`Kernels::of`); C, A, B and P lie inside
        // their slices and `delta` holds a value per row (checked above); C, borrowed mutably,
        // overlaps neither A, B, P nor its other panel.
        unsafe { (kernels.product)(block, rows, &mut col_max) };
        return;
    }
    product::<W>(simd, c, a, b, rows, k, st, pair, Write::Overwrite);
    for w in 0..W {
        for (r, &d) in delta[..rows].iter().enumerate() {
            let at = w * pair.c + r * st.c_rs;
            let (row, probs) = (&mut c[at..at + PANEL], &p[at..at + PANEL]);
            row.iter_mut()
                .zip(probs)
                .for_each(|(g, &x)| *g = x * (*g - d));
        }
    }
}
