//! The portable level's panel product: plain Rust over the raw operands.

use super::{Block, ColMax, PANEL};

/// See [`super::PanelKernels::product`] (the gradient's epilogue is the caller's).
///
/// # Safety
/// The operands of `x` must be valid for `rows` rows on `col_max.len()` panels (checked by
/// [`super::product`]).
pub(crate) unsafe fn product(x: Block, rows: usize, col_max: &mut [ColMax]) {
    let st = x.st;
    for (w, max) in col_max.iter_mut().enumerate() {
        let (c, b) = (
            x.c.wrapping_add(w * x.pair.c),
            x.b.wrapping_add(w * x.pair.b),
        );
        for r in 0..rows {
            let mut sum = [0f32; PANEL];
            for l in 0..x.k {
                // SAFETY: row r < rows of A, step l < k, row l of panel w of B and row r of
                // panel w of C lie inside their operands (the caller's contract).
                let (a, b) = unsafe {
                    let a = *x.a.add(r * st.a_rs + l * st.a_cs);
                    (a, std::slice::from_raw_parts(b.add(l * st.b_rs), PANEL))
                };
                for (s, y) in sum.iter_mut().zip(b) {
                    *s += a * y;
                }
            }
            // SAFETY: as above; C overlaps neither A nor B.
            let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * st.c_rs), PANEL) };
            for ((o, s), m) in row.iter_mut().zip(sum).zip(max.iter_mut()) {
                *o = if x.accumulate { *o + s } else { s };
                *m = m.max(*o);
            }
        }
    }
}
