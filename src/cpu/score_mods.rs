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
///
/// Each lane's visible keys are one run `lo[l]..hi[l]` of the panel's rows, so a row is a
/// branch-free select of 16 lanes against those bounds (vectorized by the compiler), and the
/// rows every lane sees are skipped. (Per-element scalar stores were 12% of a 1-thread forward
/// with window (0, 0) at N=1024, D=64; this is 4.6%.)
pub(crate) fn apply_mask(
    mask: &Mask,
    s: &mut [f32],
    first_query: usize,
    queries: usize,
    keys: Range<usize>,
) {
    let n = keys.len();
    // Row bounds as i32, so that the select vectorizes. Unused lanes keep their (discarded)
    // scores.
    assert!(n <= i32::MAX as usize, "apply_mask: {n} rows in one panel");
    let mut lo = [0i32; LANES];
    let mut hi = [n as i32; LANES];
    for l in 0..queries {
        let seen = mask.key_range(first_query + l);
        let a = seen.start.clamp(keys.start, keys.end) - keys.start;
        let b = (seen.end.clamp(keys.start, keys.end) - keys.start).max(a);
        (lo[l], hi[l]) = (a as i32, b as i32);
    }
    // Rows every lane sees are left alone: only the rows before and after them are visited.
    let first_all = lo.iter().max().map_or(0, |&a| a as usize);
    let end_all = hi.iter().min().map_or(0, |&b| b as usize).max(first_all);
    for rows in [0..first_all.min(n), end_all.min(n)..n] {
        let rows_of_s = s[rows.start * LANES..rows.end * LANES].chunks_exact_mut(LANES);
        for (r, row) in (rows.start as i32..).zip(rows_of_s) {
            for ((x, &a), &b) in row.iter_mut().zip(&lo).zip(&hi) {
                // All ones where the key is hidden, as a bit mask.
                let hide = u32::from((r < a) | (r >= b)).wrapping_neg();
                *x = f32::from_bits(x.to_bits() & !hide | f32::NEG_INFINITY.to_bits() & hide);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::Window;

    /// Against `Mask::visible` element by element, for windows that cut panels in every way.
    #[test]
    fn apply_mask_hides_exactly_what_the_mask_hides() {
        let windows = [
            Window::CAUSAL,
            Window::new(Some(5), Some(2)),
            Window::new(Some(0), Some(0)),
            Window::new(None, Some(3)),
        ];
        for window in windows {
            for (nq, nk) in [(40, 40), (23, 57), (57, 23)] {
                let mask = Mask::new(window, nq, nk);
                for first_query in (0..nq).step_by(16) {
                    let queries = (nq - first_query).min(LANES);
                    for keys in [0..nk, 3..nk.min(21), nk / 2..nk] {
                        let mut s: Vec<f32> = (0..keys.len() * LANES).map(|i| i as f32).collect();
                        apply_mask(&mask, &mut s, first_query, queries, keys.clone());
                        for (r, j) in keys.clone().enumerate() {
                            for l in 0..LANES {
                                let x = s[r * LANES + l];
                                let hidden = l < queries && !mask.visible(first_query + l, j);
                                let want = if hidden {
                                    f32::NEG_INFINITY
                                } else {
                                    (r * LANES + l) as f32
                                };
                                assert_eq!(x, want, "{window:?} q {} k {j}", first_query + l);
                            }
                        }
                    }
                }
            }
        }
    }
}
