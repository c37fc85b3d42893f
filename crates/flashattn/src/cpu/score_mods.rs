//! The per-element steps between `q·k·scale` and the softmax, applied to a score panel in place:
//! softcap → ALiBi → biases → (to base 2) → mask, in the documented order.
//!
//! Tiles that need none of them (no option, inside the mask) never come here: their scale already
//! carries `log2(e)` and the forward feeds them straight to the online softmax.

use std::ops::Range;

use crate::mask::Mask;
use crate::problem::{BiasLayout, Problem};

use crate::cpu::simd::exp::LANES;
use crate::cpu::simd::multiversion;
use crate::cpu::simd::softcap::softcap;
use crate::cpu::simd::transpose::transpose;

/// The f32 buffers of the call's biases (those it has).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Biases<'a> {
    /// The additive bias' buffer (indexed by `Problem::bias_row_at`).
    pub bias: Option<&'a [f32]>,
    /// The relative-position table's buffer (indexed by `RelBias::row_at`).
    pub rel: Option<&'a [f32]>,
}

/// The score options of one (sequence, query head).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreMods<'a> {
    softcap: Option<f32>,
    /// ALiBi slope (0 without ALiBi).
    slope: f32,
    /// The f32 bias and the element index of `bias[b, h, 0, 0]`, with its strides.
    bias: Option<(&'a [f32], usize, BiasLayout)>,
    /// The head's row of the relative-position table (`2L − 1` entries).
    rel: Option<&'a [f32]>,
    /// Key position of query 0's diagonal (`Seq::diag`).
    diag: i64,
}

impl<'a> ScoreMods<'a> {
    /// The options of sequence `b`, query head `h`, reading the biases' buffers `x`.
    pub(crate) fn new(p: &Problem, x: Biases<'a>, b: usize, h: usize) -> Self {
        let bias = match (x.bias, &p.bias) {
            (Some(data), Some((_, layout))) => {
                Some((data, p.bias_row_at(layout, b, h, 0), *layout))
            }
            _ => None,
        };
        let rel = match (x.rel, &p.rel_bias) {
            (Some(data), Some(r)) => Some(&data[r.row_at(h)..r.row_at(h) + r.width()]),
            _ => None,
        };
        ScoreMods {
            softcap: p.softcap,
            slope: p.slope(b, h),
            bias,
            rel,
            diag: p.seqs[b].diag,
        }
    }

    /// True when the scores need any per-element step besides the mask.
    pub(crate) fn any(&self) -> bool {
        self.softcap.is_some() || self.slope != 0.0 || self.bias.is_some() || self.rel.is_some()
    }

    /// True when the scores pass through a softcap (whose derivative the backward needs).
    pub(crate) fn has_softcap(&self) -> bool {
        self.softcap.is_some()
    }
}

multiversion! {
    /// Turns the scaled scores `q·k·scale` of a `keys × 16` panel (`Sᵀ`, lane `l` = query
    /// `first_query + l`, only the first `queries` lanes used) into base-2 logits by the options
    /// of `mods`: softcap, ALiBi and the biases, then `· log2(e)`; returns each lane's maximum of the
    /// result. Only call when [`ScoreMods::any`].
    ///
    /// One pass over the panel, compiled for the widest SIMD level the CPU has: element by
    /// element, or compiled for the baseline SSE2, the options cost a large share of a forward.
    pub(crate) fn apply_score_mods(
        mods: &ScoreMods<'_>,
        s: &mut [f32],
        first_query: usize,
        queries: usize,
        keys: Range<usize>,
    ) -> [f32; LANES] = ScoreMods::apply_rows;
}

impl ScoreMods<'_> {
    /// The steps after softcap run as one pass over the rows, which also takes each lane's
    /// maximum (the forward's online softmax needs it, and would read the panel again).
    #[inline(always)]
    fn apply_rows(
        &self,
        s: &mut [f32],
        first_query: usize,
        queries: usize,
        keys: Range<usize>,
    ) -> [f32; LANES] {
        if let Some(cap) = self.softcap {
            softcap(s, cap, None);
        }
        // Query i sits at key i + diag: lane l of row j is |c − l| keys from it, with
        // c = j − first_query − diag, one more each row; exact f32 integers below 2^24, the
        // distances go through f64 (before the pass) beyond.
        let c0 = keys.start as i64 - first_query as i64 - self.diag;
        let mut slope = self.slope;
        if slope != 0.0 && c0.unsigned_abs() + (keys.len() + LANES) as u64 > EXACT {
            for (r, row) in s.chunks_exact_mut(LANES).enumerate() {
                sub_alibi(row, slope, c0 + r as i64, -1);
            }
            slope = 0.0;
        }
        let log2e = std::f32::consts::LOG2_E;
        let mut max = [f32::NEG_INFINITY; LANES];
        let mut bias = [0f32; LANES * LANES];
        for (k0, block) in (0..).step_by(LANES).zip(s.chunks_mut(LANES * LANES)) {
            let rows = block.len() / LANES;
            if let Some(b) = self.bias {
                bias_block(
                    &mut bias,
                    b,
                    first_query..first_query + queries,
                    keys.start + k0,
                    rows,
                );
            }
            if let Some(table) = self.rel {
                if self.bias.is_none() {
                    bias.fill(0.0);
                }
                rel_block(&mut bias, table, c0 + k0 as i64, queries, rows);
            }
            for (r, (row, b)) in block
                .chunks_exact_mut(LANES)
                .zip(bias.chunks_exact(LANES))
                .enumerate()
            {
                let c = (c0 + (k0 + r) as i64) as f32;
                for l in 0..LANES {
                    let v = (row[l] - slope * (c - IOTA[l]).abs() + b[l]) * log2e;
                    row[l] = v;
                    max[l] = if v > max[l] { v } else { max[l] };
                }
            }
        }
        max
    }

    /// The body of [`apply_score_mods_rows`].
    #[inline(always)]
    fn apply_query_rows(
        &self,
        (s, ld): (&mut [f32], usize),
        dcap: &mut [f32],
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let nc = keys.len();
        let [_, _, si, sj] = self.bias.map_or([0; 4], |(_, _, layout)| layout.strides);
        for (r, i) in rows.enumerate() {
            let row = &mut s[r * ld..r * ld + nc];
            if let Some(cap) = self.softcap {
                softcap(row, cap, Some(&mut dcap[r * ld..r * ld + nc]));
            }
            if self.slope != 0.0 {
                // Key keys.start + x is |c + x| keys from query i's diagonal.
                sub_alibi(
                    row,
                    self.slope,
                    keys.start as i64 - (i as i64 + self.diag),
                    1,
                );
            }
            if let Some((data, row0, _)) = self.bias {
                let at = row0 + i * si;
                if sj == 1 {
                    let b = &data[at + keys.start..at + keys.end];
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                } else {
                    for (x, j) in row.iter_mut().zip(keys.clone()) {
                        *x += data[at + j * sj];
                    }
                }
            }
            if let Some(table) = self.rel {
                add_rel_run(row, table, keys.start as i64 - (i as i64 + self.diag));
            }
            row.iter_mut().for_each(|x| *x *= std::f32::consts::LOG2_E);
        }
    }
}

multiversion! {
    /// The backward's [`apply_score_mods`]: turns `q·k·scale` of a tile with queries `rows` as
    /// its rows (`ld` apart in `s.0`, `s.1 = ld`) and `keys` as its columns into base-2 logits
    /// by the options of `mods` (softcap → ALiBi → biases → `· log2e`) and stores the softcap's
    /// derivative `1 − tanh²(s/cap)` in `dcap` (same layout, when there is a cap), a pass over
    /// each row per step, compiled for the widest SIMD level the CPU has.
    pub(crate) fn apply_score_mods_rows(
        mods: &ScoreMods<'_>,
        s: (&mut [f32], usize),
        dcap: &mut [f32],
        rows: Range<usize>,
        keys: Range<usize>,
    ) = ScoreMods::apply_query_rows;
}

/// `0, 1, …, 15` as f32.
const IOTA: [f32; LANES] = {
    let mut a = [0f32; LANES];
    let mut i = 0;
    while i < LANES {
        a[i] = i as f32;
        i += 1;
    }
    a
};

/// Distances up to this are exact f32 integers.
const EXACT: u64 = 1 << 24;

/// `x[k] −= slope · |c + step·k|` (`step` ±1): ALiBi's distances along a run of scores, in f32
/// where they are exact integers, in f64 beyond.
#[inline(always)]
pub(crate) fn sub_alibi(x: &mut [f32], slope: f32, c: i64, step: i64) {
    if c.unsigned_abs() + x.len() as u64 <= EXACT {
        let (mut base, step) = (c as f32, step as f32);
        // Whole 16-element chunks as arrays, so that the loop over them vectorizes.
        let (chunks, rest) = x.as_chunks_mut::<LANES>();
        for chunk in chunks {
            for (v, l) in chunk.iter_mut().zip(IOTA) {
                *v -= slope * (base + step * l).abs();
            }
            base += step * LANES as f32;
        }
        for (v, l) in rest.iter_mut().zip(IOTA) {
            *v -= slope * (base + step * l).abs();
        }
    } else {
        for (k, v) in x.iter_mut().enumerate() {
            *v -= slope * (c as f64 + (step * k as i64) as f64).abs() as f32;
        }
    }
}

/// The keys of a run at distances `d0, d0 + 1, …` from the diagonal, split where the table's
/// clamp starts: those at `≤ −r` (reading entry 0), those in between (entries `d + r`, from
/// `middle`), and those at `≥ r` (entry `2r`), for a table of `2r + 1` entries.
#[inline(always)]
fn rel_split(n: usize, r: i64, d0: i64) -> (usize, usize, usize) {
    let a = (1 - r - d0).clamp(0, n as i64);
    let b = (r - d0).clamp(a, n as i64);
    (
        a as usize,
        b as usize,
        (d0 + a + r).clamp(0, 2 * r + 1) as usize,
    )
}

/// `x[k] += table[clamp(d0 + k, −r, r) + r]`: the relative-position bias along a run of keys
/// whose distances from the diagonal are `d0, d0 + 1, …` (`table` has `2r + 1` entries).
#[inline(always)]
pub(crate) fn add_rel_run(x: &mut [f32], table: &[f32], d0: i64) {
    let last = table.len() - 1;
    let (a, b, m) = rel_split(x.len(), (last / 2) as i64, d0);
    x[..a].iter_mut().for_each(|v| *v += table[0]);
    x[a..b]
        .iter_mut()
        .zip(&table[m..])
        .for_each(|(v, t)| *v += t);
    x[b..].iter_mut().for_each(|v| *v += table[last]);
}

/// The transpose of [`add_rel_run`]: adds each `x[k]` to the table entry that key `k` reads
/// (`acc` has `2r + 1` entries), in the order of `k` within each entry.
#[inline(always)]
pub(crate) fn fold_rel_run(acc: &mut [f32], x: &[f32], d0: i64) {
    let last = acc.len() - 1;
    let (a, b, m) = rel_split(x.len(), (last / 2) as i64, d0);
    acc[0] += x[..a].iter().sum::<f32>();
    acc[m..].iter_mut().zip(&x[a..b]).for_each(|(g, v)| *g += v);
    acc[last] += x[b..].iter().sum::<f32>();
}

/// Adds the relative-position bias to a `rows × 16` block of a panel (lane `l` of row `r` at
/// distance `d0 + r − l` from the diagonal; lanes from `queries` on are left alone), through one
/// strip of the `rows + 15` distances the block spans.
#[inline(always)]
fn rel_block(
    block: &mut [f32; LANES * LANES],
    table: &[f32],
    d0: i64,
    queries: usize,
    rows: usize,
) {
    let mut strip = [0f32; 2 * LANES];
    let strip = &mut strip[..rows + LANES - 1];
    add_rel_run(strip, table, d0 - (LANES as i64 - 1));
    for (r, row) in block.chunks_exact_mut(LANES).take(rows).enumerate() {
        for (l, x) in row[..queries].iter_mut().enumerate() {
            *x += strip[r + LANES - 1 - l];
        }
    }
}

/// Rows `j0..j0 + rows` of the bias seen from a panel (`bias[i, j]`, element `row0 + i·si + j·sj`,
/// at lane `i − queries.start` of row `j − j0` of `block`; lanes past the queries read 0): one
/// value a row when the bias is the same for every query, 16×16 transposes when its key
/// dimension is contiguous, element by element otherwise.
#[inline(always)]
fn bias_block(
    block: &mut [f32; LANES * LANES],
    (data, row0, layout): (&[f32], usize, BiasLayout),
    queries: Range<usize>,
    j0: usize,
    rows: usize,
) {
    let [_, _, si, sj] = layout.strides;
    let nq = queries.len();
    if si == 0 {
        for (row, j) in block.chunks_exact_mut(LANES).zip(j0..j0 + rows) {
            row[..nq].fill(data[row0 + j * sj]);
        }
    } else if sj == 1 {
        let first = row0 + queries.start * si + j0;
        transpose(block, LANES, &data[first..], si, nq, rows);
    } else {
        for (row, j) in block.chunks_exact_mut(LANES).zip(j0..j0 + rows) {
            for (x, i) in row.iter_mut().zip(queries.clone()) {
                *x = data[row0 + i * si + j * sj];
            }
        }
    }
}

/// Sets to −∞ the scores of a `keys × 16` panel (`Sᵀ`, lane `l` = query `first_query + l`, the
/// first `queries` lanes used) that `mask` hides.
///
/// Each lane's visible keys are one run `lo[l]..hi[l]` of the panel's rows, so a row is a
/// branch-free select of 16 lanes against those bounds (vectorized by the compiler), and the
/// rows every lane sees are skipped (it stays compiled for the baseline: for AVX-512 the
/// compiler vectorizes across rows instead, which was slower).
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

    /// Both of `sub_alibi`'s paths (exact f32 integers, and f64 for distances past 2^24) against
    /// the distance computed in i64, for runs of any length and both directions.
    #[test]
    fn sub_alibi_matches_integer_distances() {
        for c in [0i64, 5, -37, 1 << 24, -(1 << 30), (1 << 24) - 20] {
            for step in [1i64, -1] {
                for n in [1usize, 16, 37] {
                    let mut x: Vec<f32> = (0..n).map(|k| k as f32 * 0.5).collect();
                    sub_alibi(&mut x, 0.375, c, step);
                    for (k, &got) in x.iter().enumerate() {
                        let dist = (c + step * k as i64).abs() as f32;
                        assert_eq!(
                            got,
                            k as f32 * 0.5 - 0.375 * dist,
                            "c {c} step {step} k {k}"
                        );
                    }
                }
            }
        }
    }

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
