//! The online softmax of one query tile: a running maximum and sum per row, in base 2.
//!
//! Scores arrive tile by tile already multiplied by `log2(e)` (so `exp(s − m)` is `2^(s − m)`).
//! For each tile, a row's maximum can only grow; the accumulated output and sum are rescaled by
//! `2^(m_old − m_new)` (skipped when the maximum did not move, the common case after the first
//! tiles), and the tile's scores are replaced in place by their unnormalized probabilities.
//!
//! Edge case, a row with no visible key yet: its maximum is −∞, and `s − m` would be
//! `−∞ − (−∞) = NaN`. Such a row keeps shift 0 instead, so its masked (−∞) scores become
//! `2^−∞ = 0` and its sum stays 0; at the end it yields output 0 and log-sum-exp −∞.

use super::exp::{exp2, exp2_shifted_sum};

/// The largest element of `x` (−∞ when empty or all −∞). Scores are never NaN.
#[inline]
fn row_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for chunk in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let tail = chunks.remainder().iter().copied();
    lanes
        .into_iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// Rows of a row-major f32 tile: `data` holds whole rows of stride `ld`, of which the first
/// `cols` entries are used.
#[derive(Debug)]
pub(crate) struct Rows<'a> {
    pub data: &'a mut [f32],
    pub ld: usize,
    pub cols: usize,
}

impl<'a> Rows<'a> {
    /// Rows of `cols` packed entries each.
    pub(crate) fn dense(data: &'a mut [f32], cols: usize) -> Self {
        Rows {
            data,
            ld: cols,
            cols,
        }
    }

    /// Number of rows (`data.len()` is a multiple of `ld`).
    fn count(&self) -> usize {
        self.data.len() / self.ld.max(1)
    }

    fn row(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.ld..r * self.ld + self.cols]
    }
}

/// Running maximum (base 2) and sum of each row of a query tile.
#[derive(Debug, Default)]
pub(crate) struct OnlineSoftmax {
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl OnlineSoftmax {
    /// Starts a tile of `rows` rows: no key seen yet.
    pub(crate) fn reset(&mut self, rows: usize) {
        self.max.clear();
        self.max.resize(rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(rows, 0.0);
    }

    /// Folds one score tile into the state.
    ///
    /// `scores` holds rows `first_row..` of the tile (base-2 logits, −∞ where masked); they are
    /// overwritten by `2^(s − m_new)`. `acc` holds the same rows of the output accumulator; each
    /// is rescaled to the row's new maximum. The caller then adds `P·V` to `acc`.
    pub(crate) fn update(&mut self, first_row: usize, mut scores: Rows<'_>, mut acc: Rows<'_>) {
        debug_assert_eq!(scores.count(), acc.count());
        for r in 0..scores.count() {
            let row = scores.row(r);
            let (m_old, sum) = (&mut self.max[first_row + r], &mut self.sum[first_row + r]);
            let m_new = m_old.max(row_max(row));
            if m_new == f32::NEG_INFINITY {
                // No visible key yet in this row: every score is −∞ and becomes 0.
                exp2_shifted_sum(row, 0.0);
                continue;
            }
            let tile_sum = exp2_shifted_sum(row, m_new);
            if m_new > *m_old {
                let alpha = exp2(*m_old - m_new);
                *sum *= alpha;
                acc.row(r).iter_mut().for_each(|a| *a *= alpha);
                *m_old = m_new;
            }
            *sum += tile_sum;
        }
    }

    /// Divides each accumulated output row by its sum (0 for a row that saw no key) and returns
    /// the natural-log log-sum-exp of row `r` through `lse(r, value)` (−∞ for such a row).
    pub(crate) fn finish(&self, mut acc: Rows<'_>, mut lse: impl FnMut(usize, f32)) {
        for (r, (&m, &l)) in self.max.iter().zip(&self.sum).enumerate() {
            let row = acc.row(r);
            if l > 0.0 {
                let inv = 1.0 / l;
                row.iter_mut().for_each(|a| *a *= inv);
                lse(r, (m + l.log2()) * std::f32::consts::LN_2);
            } else {
                row.iter_mut().for_each(|a| *a = 0.0);
                lse(r, f32::NEG_INFINITY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tiles_equal_one_softmax() {
        let logits: Vec<f32> = (0..40).map(|j| (j as f32 * 1.3).sin() * 6.0).collect();
        let values: Vec<f32> = (0..40).map(|j| j as f32 * 0.25 - 3.0).collect();
        let mut sm = OnlineSoftmax::default();
        sm.reset(1);
        let mut acc = [0f32];
        for cols in [0..17, 17..40] {
            let mut s = logits[cols.clone()].to_vec();
            let n = s.len();
            sm.update(0, Rows::dense(&mut s, n), Rows::dense(&mut acc, 1));
            acc[0] += s.iter().zip(&values[cols]).map(|(p, v)| p * v).sum::<f32>();
        }
        let mut lse = 0.0;
        sm.finish(Rows::dense(&mut acc, 1), |_, x| lse = x);
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
        assert!((lse as f64 - want_lse).abs() < 1e-5 * want_lse.abs().max(1.0));
    }

    #[test]
    fn a_row_without_keys_gives_zero_and_minus_infinity() {
        let mut sm = OnlineSoftmax::default();
        sm.reset(1);
        let mut s = [f32::NEG_INFINITY; 5];
        let mut acc = [0f32; 3];
        sm.update(0, Rows::dense(&mut s, 5), Rows::dense(&mut acc, 3));
        assert!(s.iter().all(|&p| p == 0.0));
        let mut lse = 0.0;
        sm.finish(Rows::dense(&mut acc, 3), |_, x| lse = x);
        assert_eq!(acc, [0.0; 3]);
        assert_eq!(lse, f32::NEG_INFINITY);
    }
}
