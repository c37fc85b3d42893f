//! How the forward cuts each sequence's queries into tasks, and what each task costs.

use std::ops::Range;

use crate::mask::Mask;

/// The query blocks of a sequence of `nq` queries: `block_q` rows each, but for the block that
/// sees the fewest keys under `mask`, which is cut into blocks of [`TAIL_Q`] rows. Sorted
/// longest first, a (sequence, head)'s short blocks come last, so that each thread's run of
/// tasks ends on short tasks and a thread that finishes its run early waits less for the other
/// to end its last task (a thread's wait at the end of a call fell to a third; see
/// BENCHMARKS.md).
pub(crate) fn query_blocks(nq: usize, block_q: usize, mask: &Mask) -> Vec<Range<usize>> {
    let blocks = (0..nq.div_ceil(block_q)).map(|t| t * block_q..((t + 1) * block_q).min(nq));
    let cheapest = blocks
        .clone()
        .min_by_key(|rows| block_cost(mask, rows.clone()));
    blocks
        .flat_map(|rows| {
            let step = if Some(&rows) == cheapest.as_ref() {
                TAIL_Q.min(block_q)
            } else {
                block_q
            };
            (rows.start..rows.end)
                .step_by(step)
                .map(move |q| q..(q + step).min(rows.end))
        })
        .collect()
}

/// Query rows times the keys they see under `mask`: a block's share of the call's work.
pub(crate) fn block_cost(mask: &Mask, rows: Range<usize>) -> usize {
    rows.len() * mask.key_range_for_rows(rows).len()
}

/// The rows of the short tasks that end each (sequence, head)'s tasks (see [`query_blocks`]).
const TAIL_Q: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::Window;

    #[test]
    fn the_cheapest_query_block_is_cut_into_short_ones() {
        let causal = Mask::new(Window::CAUSAL, 1024, 1024);
        let full = Mask::new(Window::FULL, 1000, 1000);
        let cases = [
            // Causal: the first block sees the fewest keys.
            (
                &causal,
                1024,
                512,
                vec![0..128, 128..256, 256..384, 384..512, 512..1024],
            ),
            // Full: the short last block is the cheapest.
            (
                &full,
                1000,
                512,
                vec![0..512, 512..640, 640..768, 768..896, 896..1000],
            ),
            (&full, 200, 512, vec![0..128, 128..200]),
            // Tasks of 128 queries already: nothing to cut.
            (&causal, 300, 128, vec![0..128, 128..256, 256..300]),
        ];
        for (mask, nq, block_q, want) in cases {
            assert_eq!(
                query_blocks(nq, block_q, mask),
                want,
                "nq {nq} block {block_q}"
            );
        }
    }
}
