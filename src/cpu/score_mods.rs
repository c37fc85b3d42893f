//! The per-element steps between `q·k·scale` and the softmax, applied to a score tile in place:
//! softcap → ALiBi → bias → (to base 2) → mask, in the documented order.
//!
//! Tiles that need none of them (no option, inside the mask) never come here: their scale already
//! carries `log2(e)` and the forward feeds them straight to the online softmax.

use std::ops::Range;

use crate::mask::Mask;
use crate::problem::{BiasLayout, Problem};

use super::online_softmax::Rows;

/// The score options of one (sequence, query head).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreMods<'a> {
    softcap: Option<f32>,
    /// ALiBi slope (0 without ALiBi).
    slope: f32,
    /// The f32 bias and the element index of `bias[b, h, 0, 0]`, with its strides.
    bias: Option<(&'a [f32], usize, BiasLayout)>,
    /// Key position of query 0's diagonal (`nk − nq`).
    diag: i64,
}

impl<'a> ScoreMods<'a> {
    /// The options of sequence `b`, query head `h`; `bias` is the f32 bias buffer when given.
    pub(crate) fn new(p: &Problem, bias: Option<&'a [f32]>, b: usize, h: usize) -> Self {
        let bias = match (bias, &p.bias) {
            (Some(data), Some((_, layout))) => {
                Some((data, p.bias_row_at(layout, b, h, 0), *layout))
            }
            _ => None,
        };
        ScoreMods {
            softcap: p.softcap,
            slope: p.slope(b, h),
            bias,
            diag: p.seqs[b].nk as i64 - p.seqs[b].nq as i64,
        }
    }

    /// True when the scores need any per-element step besides the mask.
    pub(crate) fn any(&self) -> bool {
        self.softcap.is_some() || self.slope != 0.0 || self.bias.is_some()
    }

    /// Turns scaled scores `q·k·scale` of queries `rows` × keys `keys` (sequence positions) into
    /// base-2 logits: softcap, ALiBi and bias, then `· log2(e)`. Only call when [`Self::any`].
    pub(crate) fn apply(&self, s: Rows<'_>, rows: Range<usize>, keys: Range<usize>) {
        let log2e = std::f32::consts::LOG2_E;
        for (r, i) in rows.enumerate() {
            let row = &mut s.data[r * s.ld..r * s.ld + s.cols];
            if let Some(cap) = self.softcap {
                let inv = 1.0 / cap;
                row.iter_mut().for_each(|x| *x = cap * (*x * inv).tanh());
            }
            if self.slope != 0.0 {
                let center = i as i64 + self.diag;
                for (x, j) in row.iter_mut().zip(keys.clone()) {
                    *x -= self.slope * (j as i64 - center).abs() as f32;
                }
            }
            if let Some((data, row0, layout)) = self.bias {
                let at = row0 + i * layout.strides[2];
                let sj = layout.strides[3];
                for (x, j) in row.iter_mut().zip(keys.clone()) {
                    *x += data[at + j * sj];
                }
            }
            row.iter_mut().for_each(|x| *x *= log2e);
        }
    }
}

/// Sets to −∞ the scores of queries `rows` × keys `keys` that `mask` hides.
pub(crate) fn apply_mask(mask: &Mask, s: Rows<'_>, rows: Range<usize>, keys: Range<usize>) {
    for (r, i) in rows.enumerate() {
        let row = &mut s.data[r * s.ld..r * s.ld + s.cols];
        let seen = mask.key_range(i);
        let lo = seen.start.clamp(keys.start, keys.end) - keys.start;
        let hi = seen.end.clamp(keys.start, keys.end) - keys.start;
        let hi = hi.max(lo);
        row[..lo].fill(f32::NEG_INFINITY);
        row[hi..].fill(f32::NEG_INFINITY);
    }
}
