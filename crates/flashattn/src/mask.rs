//! The one mask predicate. Causal attention is the window (left = ∞, right = 0); no mask is (∞, ∞).
//!
//! Query `i` sits at key position `i + diag`. By default queries and keys are aligned
//! bottom-right, `diag = nk - nq`, so with `nq < nk` the last query sees every key, and with
//! `nq > nk` the first `nq - nk` causal rows see no key at all (their output is 0 and their
//! log-sum-exp is −∞).

/// A sliding window of keys around each query's diagonal position; `None` is unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// How many keys before the diagonal a query sees (`None`: all of them).
    pub left: Option<usize>,
    /// How many keys after the diagonal a query sees (`None`: all of them).
    pub right: Option<usize>,
}

impl Window {
    /// Every key is visible.
    pub const FULL: Window = Window {
        left: None,
        right: None,
    };
    /// Causal: keys up to and including the diagonal.
    pub const CAUSAL: Window = Window {
        left: None,
        right: Some(0),
    };

    /// A window of `left` keys before and `right` keys after the diagonal.
    pub fn new(left: Option<usize>, right: Option<usize>) -> Self {
        Window { left, right }
    }

    /// True when nothing is masked.
    pub fn is_full(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }
}

/// The window resolved for one sequence of `nq` queries and `nk` keys.
#[derive(Clone, Copy, Debug)]
pub struct Mask {
    /// Key position of query 0's diagonal.
    diag: i64,
    left: i64,
    right: i64,
    nq: i64,
    nk: i64,
}

impl Mask {
    /// The window for a sequence of `nq` queries over `nk` keys, aligned bottom-right.
    pub fn new(window: Window, nq: usize, nk: usize) -> Self {
        Mask::with_diagonal(window, nq, nk, nk as i64 - nq as i64)
    }

    /// The window for `nq` queries over `nk` keys, query `i`'s diagonal at key `i + diag`.
    pub fn with_diagonal(window: Window, nq: usize, nk: usize, diag: i64) -> Self {
        let clamp =
            |w: Option<usize>| w.map_or(i64::MAX / 4, |w| w.min(i64::MAX as usize / 4) as i64);
        // Diagonals are cut at ±2^60 as windows are at 2^61 (no sequence is that long), so no
        // sum below overflows.
        let far = 1i64 << 60;
        Mask {
            diag: diag.clamp(-far, far),
            left: clamp(window.left),
            right: clamp(window.right),
            nq: nq as i64,
            nk: nk as i64,
        }
    }

    /// Whether query `i` sees key `j`.
    #[inline(always)]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let d = j as i64 - (i as i64 + self.diag);
        -self.left <= d && d <= self.right
    }

    /// The keys query `i` sees, as a half-open range (empty when it sees none).
    #[inline]
    pub fn key_range(&self, i: usize) -> std::ops::Range<usize> {
        let center = i as i64 + self.diag;
        let lo = (center - self.left).clamp(0, self.nk);
        let hi = (center + self.right + 1).clamp(0, self.nk);
        lo as usize..(hi.max(lo)) as usize
    }

    /// The keys any query in `rows` sees: key blocks outside it are skipped whole.
    pub fn key_range_for_rows(&self, rows: std::ops::Range<usize>) -> std::ops::Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        let first = self.key_range(rows.start);
        let last = self.key_range(rows.end - 1);
        let (lo, hi) = (first.start.min(last.start), first.end.max(last.end));
        if lo >= hi { 0..0 } else { lo..hi }
    }

    /// The queries that see any key in `keys` (the backward walks only these rows of a key
    /// block). Query `i` sees key `j` iff `j − diag − right ≤ i ≤ j − diag + left`, and these
    /// intervals of consecutive keys overlap, so the union is one range.
    pub fn query_range_for_keys(&self, keys: std::ops::Range<usize>) -> std::ops::Range<usize> {
        if keys.is_empty() {
            return 0..0;
        }
        let lo = (keys.start as i64 - self.diag - self.right).clamp(0, self.nq);
        let hi = (keys.end as i64 - self.diag + self.left).clamp(0, self.nq);
        if lo >= hi {
            0..0
        } else {
            lo as usize..hi as usize
        }
    }

    /// The keys every query in `rows` sees (empty when there are none, or no rows).
    pub fn keys_seen_by_all(&self, rows: std::ops::Range<usize>) -> std::ops::Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        // The window's lower edge is tightest for the last row, the upper edge for the first.
        let lo = self.key_range(rows.end - 1).start;
        let hi = self.key_range(rows.start).end;
        lo..hi.max(lo)
    }

    /// True when every query in `rows` sees every key in `keys`: such a tile needs no masking.
    pub fn tile_is_full(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> bool {
        if rows.is_empty() || keys.is_empty() {
            return true;
        }
        let all = self.keys_seen_by_all(rows);
        all.start <= keys.start && keys.end <= all.end
    }

    /// True when no query in `rows` sees any key in `keys`.
    pub fn tile_is_empty(
        &self,
        rows: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
    ) -> bool {
        let seen = self.key_range_for_rows(rows);
        seen.end <= keys.start || keys.end <= seen.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(w: Window, nq: usize, nk: usize, diag: i64) {
        let m = Mask::with_diagonal(w, nq, nk, diag);
        for i in 0..nq {
            let r = m.key_range(i);
            for j in 0..nk {
                assert_eq!(
                    m.visible(i, j),
                    r.contains(&j),
                    "{w:?} nq={nq} nk={nk} diag={diag} i={i} j={j}"
                );
            }
        }
        for bs in [1, 3, 16] {
            for k0 in (0..nk).step_by(bs) {
                let keys = k0..(k0 + bs).min(nk);
                let want: Vec<usize> = (0..nq)
                    .filter(|&i| keys.clone().any(|j| m.visible(i, j)))
                    .collect();
                let got: Vec<usize> = m.query_range_for_keys(keys.clone()).collect();
                assert_eq!(got, want, "{w:?} nq={nq} nk={nk} diag={diag} keys {keys:?}");
            }
            for q0 in (0..nq).step_by(bs) {
                let rows = q0..(q0 + bs).min(nq);
                let by_all: Vec<usize> = (0..nk)
                    .filter(|&j| rows.clone().all(|i| m.visible(i, j)))
                    .collect();
                let got: Vec<usize> = m.keys_seen_by_all(rows.clone()).collect();
                assert_eq!(
                    got, by_all,
                    "{w:?} nq={nq} nk={nk} diag={diag} rows {rows:?}"
                );
                for k0 in (0..nk).step_by(bs) {
                    let keys = k0..(k0 + bs).min(nk);
                    let any = rows.clone().any(|i| keys.clone().any(|j| m.visible(i, j)));
                    let all = rows.clone().all(|i| keys.clone().all(|j| m.visible(i, j)));
                    assert_eq!(m.tile_is_empty(rows.clone(), keys.clone()), !any);
                    assert_eq!(m.tile_is_full(rows.clone(), keys.clone()), all);
                }
            }
        }
    }

    #[test]
    fn ranges_match_the_predicate() {
        let windows = [
            Window::FULL,
            Window::CAUSAL,
            Window::new(Some(3), Some(0)),
            Window::new(Some(0), Some(2)),
            Window::new(Some(5), Some(7)),
            Window::new(None, Some(4)),
            Window::new(Some(2), None),
        ];
        for w in windows {
            for (nq, nk) in [(1, 1), (7, 7), (7, 20), (20, 7), (33, 65), (0, 5), (5, 0)] {
                // Bottom-right, then diagonals before, at and past the keys.
                let (nq_i, nk_i) = (nq as i64, nk as i64);
                for diag in [nk_i - nq_i, -nq_i - 2, -3, 0, 5, nk_i + 2] {
                    brute(w, nq, nk, diag);
                }
            }
        }
    }

    #[test]
    fn causal_is_bottom_right() {
        let m = Mask::new(Window::CAUSAL, 2, 5);
        assert_eq!(m.key_range(0), 0..4);
        assert_eq!(m.key_range(1), 0..5);
        let m = Mask::new(Window::CAUSAL, 5, 2);
        assert!(m.key_range(0).is_empty());
        assert_eq!(m.key_range(4), 0..2);
    }

    #[test]
    fn a_diagonal_moves_the_window() {
        // Queries 0..4 of a block at global position 8, keys of a block at 4: diag 4.
        let m = Mask::with_diagonal(Window::CAUSAL, 4, 6, 4);
        assert_eq!(m.key_range(0), 0..5);
        assert_eq!(m.key_range(3), 0..6);
        let m = Mask::with_diagonal(Window::new(Some(1), Some(0)), 4, 6, -2);
        assert!(m.key_range(1).is_empty());
        assert_eq!(m.key_range(2), 0..1);
        assert_eq!(m.key_range(3), 0..2);
        // The farthest diagonals: causal rows see no key, or all; unmasked rows see all.
        let far = |w, d| Mask::with_diagonal(w, 3, 5, d);
        assert!(far(Window::CAUSAL, i64::MIN).key_range(2).is_empty());
        assert!(
            far(Window::CAUSAL, i64::MIN)
                .query_range_for_keys(0..5)
                .is_empty()
        );
        assert_eq!(far(Window::CAUSAL, i64::MAX).key_range(0), 0..5);
        assert_eq!(
            far(Window::CAUSAL, i64::MAX).query_range_for_keys(0..5),
            0..3
        );
        assert_eq!(far(Window::FULL, i64::MIN).key_range(0), 0..5);
        assert!(
            far(Window::new(Some(2), Some(2)), i64::MAX)
                .key_range(0)
                .is_empty()
        );
    }
}
