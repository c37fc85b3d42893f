//! The online softmax of one panel of 16 queries: a running maximum and sum per query, base 2.
//!
//! The forward keeps its tiles transposed: a score tile is `keys × 16` (`Sᵀ`), the output
//! accumulator `dv × 16` (`Oᵀ`), so each query is one lane and every step below is a plain
//! vector operation down the rows. Scores arrive already multiplied by `log2(e)`, so
//! `exp(s − m) = 2^(s − m)`. Per key tile a query's maximum can only grow; its sum and its
//! accumulator column are rescaled by `2^(m_old − m_new)` (skipped for the whole panel when no
//! maximum moved, the common case after the first tiles), and the scores are then replaced in
//! place by their unnormalized probabilities `Pᵀ` (by the forward's `softmax_product`, while it
//! multiplies them by V).
//!
//! Edge case, a query with no visible key yet: its maximum is −∞, and `s − m` would be
//! `−∞ − (−∞) = NaN`. Such a lane is shifted by 0 instead, so its (masked, −∞) scores become
//! `2^−∞ = 0` and its sum stays 0; at the end it gives output 0 and log-sum-exp −∞.
//!
//! NaN: the maxima pass over NaN scores (`f32::max`), but the exponentials turn each into a
//! NaN probability, so the query's sum and accumulator column become NaN and stay NaN through
//! every rescale: its output and log-sum-exp come out NaN, as they do elsewhere.

use crate::cpu::simd::exp::{LANES, exp2_shifted_panel};
use crate::cpu::simd::lanes::{lane_lse, lane_max, scale_lanes};

/// Running maximum (base 2) and sum of each query of a panel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PanelSoftmax {
    max: [f32; LANES],
    sum: [f32; LANES],
}

impl Default for PanelSoftmax {
    /// No key seen yet.
    fn default() -> Self {
        PanelSoftmax {
            max: [f32::NEG_INFINITY; LANES],
            sum: [0.0; LANES],
        }
    }
}

impl PanelSoftmax {
    /// Folds the maxima of a `keys × 16` tile of base-2 scores (−∞ where masked) into the
    /// state and rescales the running sums and the `dv × 16` accumulator `acc` to the new
    /// maxima. Returns each lane's shift: the caller replaces the tile by `2^(s − shift)`, adds
    /// `Vᵀ·Pᵀ` to `acc` and the tile's lane sums by [`Self::add_sums`] (`softmax_product` does
    /// both at once). `tile_max` is each lane's maximum over the tile when the caller already
    /// has it (exactly: an upper bound could flush every term to 0).
    pub(crate) fn rescale(
        &mut self,
        scores: &[f32],
        tile_max: Option<[f32; LANES]>,
        acc: &mut [f32],
    ) -> [f32; LANES] {
        let (alpha, shift, moved) = self.fold(tile_max.unwrap_or_else(|| lane_max(scores)));
        if moved {
            scale_lanes(acc, &alpha);
        }
        shift
    }

    /// [`Self::rescale`] for an accumulator kept as rows, lane `l`'s in row `l` of `acc` (each
    /// `width` long): a decoding step's orientation, whose lanes are heads.
    pub(crate) fn rescale_rows(
        &mut self,
        tile_max: [f32; LANES],
        acc: &mut [f32],
        width: usize,
    ) -> [f32; LANES] {
        let (alpha, shift, moved) = self.fold(tile_max);
        if moved {
            for (row, a) in acc.chunks_exact_mut(width).zip(alpha) {
                row.iter_mut().for_each(|x| *x *= a);
            }
        }
        shift
    }

    /// Folds a tile's lane maxima into the state and rescales the sums: returns each lane's
    /// factor `2^(m_old − m_new)` for its accumulator, its shift, and whether any lane with
    /// something accumulated moved.
    fn fold(&mut self, tile_max: [f32; LANES]) -> ([f32; LANES], [f32; LANES], bool) {
        let mut alpha = self.max;
        let mut shift = [0f32; LANES];
        let mut moved = false;
        for l in 0..LANES {
            let m_new = up_to_eighth(self.max[l].max(tile_max[l]));
            // A lane's first visible key needs no rescale: its sum and accumulator are still 0.
            moved |= m_new > self.max[l] && self.max[l] > f32::NEG_INFINITY;
            self.max[l] = m_new;
            shift[l] = if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                m_new
            };
        }
        // alpha = 2^(m_old − m_new): 1 where the maximum stayed, 0 from m_old = −∞.
        exp2_shifted_panel(&mut alpha, &shift);
        for (s, a) in self.sum.iter_mut().zip(&alpha) {
            *s *= a;
        }
        (alpha, shift, moved)
    }

    /// Adds a tile's lane sums of `2^(s − shift)` (after [`Self::rescale`]).
    pub(crate) fn add_sums(&mut self, tile_sum: &[f32; LANES]) {
        for (s, t) in self.sum.iter_mut().zip(tile_sum) {
            *s += t;
        }
    }

    /// Each lane's running maximum (base 2) and sum, for a caller that combines partial
    /// results of the same queries (a decoding step split over its keys).
    pub(crate) fn max_sum(&self) -> ([f32; LANES], [f32; LANES]) {
        (self.max, self.sum)
    }

    /// Each query's factor for its accumulator column, `1 / sum` (0 for a query that saw no
    /// key, NaN for one whose sum is NaN), and its natural-log log-sum-exp (−∞ and NaN for
    /// those). The forward applies the factors as it writes the output rows.
    pub(crate) fn finish(&self) -> ([f32; LANES], [f32; LANES]) {
        let inv = self.sum.map(inverse_sum);
        (inv, lane_lse(&self.max, &self.sum))
    }
}

/// `1 / sum` of a softmax sum, 0 where no key was seen (a sum of 0); NaN stays NaN.
pub(crate) fn inverse_sum(sum: f32) -> f32 {
    if sum == 0.0 { 0.0 } else { 1.0 / sum }
}

/// `m` rounded up to a multiple of 1/8 (where it is not one already: any `|m| ≥ 2^20` is, and
/// ±∞ and NaN stay). The running maxima are kept on this grid so that the AVX2 exponential can fold
/// each lane's shift into its rounding (`exp::avx2`); a maximum up to 1/8 above the scores
/// costs nothing in accuracy (each term is at most 1, the largest at least 2^−1/8).
fn up_to_eighth(m: f32) -> f32 {
    // By truncation to an integer rather than `f32::ceil`, which without SSE4.1 (the crate's
    // baseline) is a call into libm for every lane of every fold.
    let x = m * 8.0;
    if x.abs() < 8_388_608.0 {
        let t = x as i32 as f32;
        (if t < x { t + 1.0 } else { t }) * 0.125
    } else {
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maxima_round_up_to_eighths() {
        let cases = [
            (1.01, 1.125),
            (-1.01, -1.0),
            (2.5, 2.5),
            (0.0, 0.0),
            (-0.01, 0.0),
            (1e-30, 0.125),
            (-3.3, -3.25),
            (524_287.97, 524_288.0),
            (1_048_576.5, 1_048_576.5),
            (3.0e38, 3.0e38),
            (f32::INFINITY, f32::INFINITY),
            (f32::NEG_INFINITY, f32::NEG_INFINITY),
        ];
        for (m, want) in cases {
            assert_eq!(up_to_eighth(m), want, "{m}");
        }
        assert!(up_to_eighth(f32::NAN).is_nan());
    }

    /// Lane 0 sees 40 keys in two tiles, lane 1 none, the others one key.
    #[test]
    fn two_tiles_equal_one_softmax_and_empty_lanes_stay_zero() {
        let logits: Vec<f32> = (0..40).map(|j| (j as f32 * 1.3).sin() * 6.0).collect();
        let values: Vec<f32> = (0..40).map(|j| j as f32 * 0.25 - 3.0).collect();
        let mut sm = PanelSoftmax::default();
        let mut acc = [0f32; LANES];
        for keys in [0..17, 17..40] {
            let mut s = vec![f32::NEG_INFINITY; keys.len() * LANES];
            for (r, j) in keys.clone().enumerate() {
                s[r * LANES] = logits[j];
                if j == 20 {
                    s[r * LANES + 2..(r + 1) * LANES].fill(1.5);
                }
            }
            let shift = sm.rescale(&s, None, &mut acc);
            let tile_sum = exp2_shifted_panel(&mut s, &shift);
            sm.add_sums(&tile_sum);
            for (r, j) in keys.enumerate() {
                for l in 0..LANES {
                    acc[l] += s[r * LANES + l] * values[j];
                }
            }
        }
        let (inv, lse) = sm.finish();
        scale_lanes(&mut acc, &inv);
        let m = logits.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
        let z: f64 = logits.iter().map(|&x| (x as f64 - m).exp2()).sum();
        let want: f64 = logits
            .iter()
            .zip(&values)
            .map(|(&x, &v)| (x as f64 - m).exp2() * v as f64)
            .sum::<f64>()
            / z;
        assert!((acc[0] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
        let want_lse = (m + z.log2()) * std::f64::consts::LN_2;
        assert!((lse[0] as f64 - want_lse).abs() < 1e-5 * want_lse.abs().max(1.0));
        assert_eq!((acc[1], lse[1]), (0.0, f32::NEG_INFINITY));
        assert!((acc[5] - values[20]).abs() < 1e-6);
        assert!((lse[5] - 1.5 * std::f32::consts::LN_2).abs() < 1e-6);
    }
}
