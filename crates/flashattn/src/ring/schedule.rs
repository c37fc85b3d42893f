//! The zigzag schedule: which chunks a rank holds, whose block it holds at each step, and the
//! diagonal of a query chunk over a key chunk.

use crate::error::{Error, Result};
use crate::mask::Window;

/// A sequence of `2 · ranks · chunk` positions in zigzag shards.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Zigzag {
    pub ranks: usize,
    pub chunk: usize,
}

impl Zigzag {
    /// The layout of `n` positions over `ranks` ranks; `n` must be a positive multiple of 2·ranks.
    pub fn new(n: usize, ranks: usize, arg: &'static str) -> Result<Self> {
        if ranks == 0 {
            return Err(Error::arg("ranks", "at least 1", 0));
        }
        if n == 0 || !n.is_multiple_of(2 * ranks) {
            return Err(Error::arg(
                arg,
                format!(
                    "a sequence length that is a positive multiple of 2 · ranks = {}",
                    2 * ranks
                ),
                n,
            ));
        }
        Ok(Zigzag {
            ranks,
            chunk: n / (2 * ranks),
        })
    }

    /// The chunks rank `r` holds, in the order of its shard.
    pub fn chunks(&self, r: usize) -> [usize; 2] {
        [r, 2 * self.ranks - 1 - r]
    }

    /// The rank whose block rank `r` holds at step `s`.
    pub fn source(&self, r: usize, s: usize) -> usize {
        (r + self.ranks - s % self.ranks) % self.ranks
    }

    /// The diagonal of query chunk `a` over key chunk `b` (query i of `a` sits at key i + d of
    /// `b`), or `None` when `window` leaves none of their pairs visible.
    pub fn pair(&self, window: Window, a: usize, b: usize) -> Option<i64> {
        let c = self.chunk as i64;
        let d = (a as i64 - b as i64) * c;
        let edge =
            |w: Option<usize>| w.map_or(i64::MAX / 4, |w| w.min(i64::MAX as usize / 4) as i64);
        // Key j is j − i − d from query i's diagonal, and j − i spans −(c − 1)..=c − 1.
        let seen = -(c - 1) - d <= edge(window.right) && (c - 1) - d >= -edge(window.left);
        seen.then_some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_meets_every_block_once_and_causal_work_is_balanced() {
        for ranks in 1..=5 {
            let z = Zigzag::new(8 * ranks, ranks, "q").unwrap();
            let work: Vec<usize> = (0..ranks)
                .map(|r| {
                    let mut seen: Vec<usize> = (0..ranks).map(|s| z.source(r, s)).collect();
                    seen.sort_unstable();
                    assert_eq!(seen, (0..ranks).collect::<Vec<_>>());
                    let blocks = seen.iter().flat_map(|&src| z.chunks(src));
                    let pairs = blocks.flat_map(|b| z.chunks(r).map(|a| (a, b)));
                    pairs
                        .filter(|&(a, b)| z.pair(Window::CAUSAL, a, b).is_some())
                        .count()
                })
                .collect();
            // Chunks r and 2P − 1 − r see r + 1 and 2P − r chunks of keys: 2P + 1 pairs each.
            assert!(
                work.iter().all(|&w| w == 2 * ranks + 1),
                "ranks {ranks}: {work:?}"
            );
        }
    }

    #[test]
    fn pairs_outside_a_window_are_skipped() {
        let z = Zigzag::new(16, 2, "q").unwrap(); // chunks of 4
        assert_eq!(z.pair(Window::FULL, 0, 3), Some(-12));
        assert_eq!(z.pair(Window::CAUSAL, 0, 1), None);
        assert_eq!(z.pair(Window::CAUSAL, 1, 0), Some(4));
        // Keys 4..8 before: a window of 4 keys back reaches chunk a − 1 but not a − 2.
        assert_eq!(z.pair(Window::new(Some(4), Some(0)), 2, 1), Some(4));
        assert_eq!(z.pair(Window::new(Some(4), Some(0)), 3, 1), None);
        assert!(Zigzag::new(12, 4, "q").is_err());
    }
}
