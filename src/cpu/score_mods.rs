//! The per-element steps between `q·k·scale` and the softmax, applied to a score panel in place:
//! softcap → ALiBi → bias → (to base 2) → mask, in the documented order.
//!
//! Tiles that need none of them (no option, inside the mask) never come here: their scale already
//! carries `log2(e)` and the forward feeds them straight to the online softmax.

use std::ops::Range;

use crate::mask::Mask;
use crate::problem::{BiasLayout, Problem};

use super::exp::LANES;

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

    /// Turns the scaled scores `q·k·scale` of a `keys × 16` panel (`Sᵀ`, lane `l` = query
    /// `first_query + l`, only the first `queries` lanes used) into base-2 logits: softcap,
    /// ALiBi and bias, then `· log2(e)`. Only call when [`Self::any`].
    pub(crate) fn apply(
        &self,
        s: &mut [f32],
        first_query: usize,
        queries: usize,
        keys: Range<usize>,
    ) {
        let log2e = std::f32::consts::LOG2_E;
        for (row, j) in s.chunks_exact_mut(LANES).zip(keys) {
            for (l, x) in row[..queries].iter_mut().enumerate() {
                let i = first_query + l;
                let mut v = *x;
                if let Some(cap) = self.softcap {
                    v = cap * (v / cap).tanh();
                }
                v -= self.slope * (j as i64 - (i as i64 + self.diag)).abs() as f32;
                if let Some((data, row0, layout)) = self.bias {
                    v += data[row0 + i * layout.strides[2] + j * layout.strides[3]];
                }
                *x = v * log2e;
            }
        }
    }
}

/// Sets to −∞ the scores of a `keys × 16` panel (`Sᵀ`, lane `l` = query `first_query + l`, the
/// first `queries` lanes used) that `mask` hides.
pub(crate) fn apply_mask(
    mask: &Mask,
    s: &mut [f32],
    first_query: usize,
    queries: usize,
    keys: Range<usize>,
) {
    for l in 0..queries {
        let seen = mask.key_range(first_query + l);
        let lo = seen.start.clamp(keys.start, keys.end) - keys.start;
        let hi = (seen.end.clamp(keys.start, keys.end) - keys.start).max(lo);
        for r in (0..lo).chain(hi..keys.len()) {
            s[r * LANES + l] = f32::NEG_INFINITY;
        }
    }
}
