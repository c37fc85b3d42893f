//! The rotary embedding's arithmetic, shared by both devices: the frequency table and which
//! dims a pair couples (the GPU kernel `kernels/rope.cu` reads the same table), and the
//! rotation of f32 rows in place on the CPU.

use rayon::prelude::*;

use crate::layer::params::RopeStyle;
use crate::layer::shape::{LayerShape, RopeOf};

/// `base^(−2p/R)` for each pair `p < R/2`, in f64 (the angle `t · freq` is formed in f64 too, so
/// positions in the millions keep their phase).
pub(crate) fn inv_freq(rope: &RopeOf) -> Vec<f64> {
    let r = rope.dim as f64;
    (0..rope.dim / 2)
        .map(|p| rope.base.powf(-2.0 * p as f64 / r))
        .collect()
}

/// The two dims of a head that pair `p` couples.
#[inline]
pub(crate) fn pair(style: RopeStyle, p: usize, half: usize) -> (usize, usize) {
    match style {
        RopeStyle::Half => (p, p + half),
        RopeStyle::Interleaved => (2 * p, 2 * p + 1),
    }
}

/// Rotates the q and k heads (the first `H + HK` heads) of each row of a packed `[rows, cols]`
/// f32 buffer in place, by the row's angles, or by their negatives with `inverse` (the
/// transpose, which takes the gradient of the rotated values back to the projected ones).
pub(crate) fn rotate_rows(buf: &mut [f32], s: &LayerShape, rope: &RopeOf, inverse: bool) {
    rotate_heads(buf, s.cols, s.heads + s.heads_kv, s, rope, inverse);
}

/// [`rotate_rows`] on the first `heads` heads of rows `row_len` apart (one tensor of q or k
/// heads alone: `row_len = heads · head_dim`).
pub(crate) fn rotate_heads(
    buf: &mut [f32],
    row_len: usize,
    heads: usize,
    s: &LayerShape,
    rope: &RopeOf,
    inverse: bool,
) {
    let freqs = inv_freq(rope);
    let (d, half) = (s.head_dim, rope.dim / 2);
    let sign = if inverse { -1.0 } else { 1.0 };
    buf.par_chunks_mut(row_len)
        .zip(&s.positions)
        .for_each(|(row, &t)| {
            for (p, &f) in freqs.iter().enumerate() {
                let (sin, cos) = (f64::from(t) * f).sin_cos();
                let sin = sign * sin;
                let (a, b) = pair(rope.style, p, half);
                for head in row[..heads * d].chunks_exact_mut(d) {
                    let (x, y) = (f64::from(head[a]), f64::from(head[b]));
                    head[a] = (x * cos - y * sin) as f32;
                    head[b] = (x * sin + y * cos) as f32;
                }
            }
        });
}
