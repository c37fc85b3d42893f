//! How the CPU backward splits its work into tasks: one per (sequence, key/value head) when
//! there are enough of those for the threads; else the query heads of each group split into
//! runs (GQA/MQA), each run a task with dK/dV partial sums; else the key blocks split into
//! chunks, each chunk a task with dQ partial sums.
//!
//! A run of query heads packs only its own heads' Q and dO rows and owns their dQ, so nothing
//! on the query side is done twice; its price is the K and V of each key block packed once per
//! run, and partial dK/dV (the smaller side under GQA: `heads_kv · nk` rows against
//! `heads_q · nq`) summed at the end. Chunks of key blocks, which a group of one query head
//! needs, pack every query row of the group once per chunk and sum dQ partials instead. Runs
//! beat chunks under GQA, and more runs than the threads need cost their K/V packing and
//! partials (see BENCHMARKS.md).

use crate::cpu::backward::block::padded;
use crate::problem::Problem;

/// The most memory the partial sums may take (dQ beyond the first full-size f32 dQ, or dK and
/// dV): bounds the split for long sequences on machines with many threads.
const EXTRA_PARTIALS_BYTES: usize = 256 << 20;

/// How the backward splits its work over tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// One task per (sequence, key/value head), with every query head of its group and every
    /// key block: no partial sums.
    Whole,
    /// The query heads of each group in this many runs of equal length, each run a task with
    /// every key block; dK and dV summed over the runs afterwards.
    Heads(usize),
    /// The key blocks of each (sequence, key/value head) in this many chunks
    /// ([`chunk_blocks`]), each chunk a task with every query head of the group; dQ summed over
    /// the chunks afterwards.
    KeyChunks(usize),
}

impl Split {
    /// The split for `threads` threads, given each sequence's work (`costs`, from
    /// [`sequence_costs`]). A split is balanced when its tasks, handed out longest first, leave
    /// at most 15% of the threads' time idle ([`balance`]; the tasks of one sequence have equal
    /// work, sequences of a packed batch differ). In order of preference: whole groups, then
    /// runs of query heads (fewest first; a divisor of the group size, so runs have equal
    /// work), with two balanced tasks per thread, else one; then chunks of key blocks likewise
    /// (fewest first, at most one per key block); else the best balanced of them all. Partial
    /// sums stay within [`EXTRA_PARTIALS_BYTES`].
    ///
    /// Balance wins over fewer tasks: five whole groups on two threads take three rounds, and
    /// a packed batch of one long and several short sequences leaves one thread the long one;
    /// one task per thread costs nothing when two cannot be had (see BENCHMARKS.md).
    pub(crate) fn of(p: &Problem, costs: &[f64], block_k: usize, threads: usize) -> Split {
        let threads = threads.max(1);
        let groups = (p.batch * p.heads_kv).max(1);
        let group = p.group();
        let run_bytes = (key_part_len(p, p.head_dim) + key_part_len(p, p.head_dim_v)) * 4;
        let heads: Vec<Split> = std::iter::once(Split::Whole)
            .chain(
                (2..=group)
                    .filter(|&r| group.is_multiple_of(r) && r * run_bytes <= EXTRA_PARTIALS_BYTES)
                    .map(Split::Heads),
            )
            .collect();
        let blocks = p.max_nk.div_ceil(block_k).max(1);
        let partial_bytes = (p.total_q * p.heads_q * padded(p.head_dim) * 4).max(1);
        let by_memory = 1 + EXTRA_PARTIALS_BYTES / partial_bytes;
        let chunks: Vec<Split> = (2..=blocks.min(by_memory).min(2 * threads))
            .map(Split::KeyChunks)
            .collect();
        let tasks = |s: &Split| groups * s.chunks() * s.runs();
        let busy = |s: &Split| balance(costs, p.heads_kv, s.chunks() * s.runs(), threads);
        for family in [&heads, &chunks] {
            for per_thread in [2, 1] {
                let good = |s: &&Split| tasks(s) >= per_thread * threads && busy(s) >= 0.85;
                if let Some(&split) = family.iter().find(good) {
                    return split;
                }
            }
        }
        let best = |a: &&Split, b: &&Split| {
            // The earlier (cheaper) split on ties.
            busy(a)
                .total_cmp(&busy(b))
                .then(std::cmp::Ordering::Greater)
        };
        heads
            .iter()
            .chain(&chunks)
            .max_by(best)
            .copied()
            .unwrap_or(Split::Whole)
    }

    /// Chunks of key blocks (1 unless [`Split::KeyChunks`]).
    pub(crate) fn chunks(self) -> usize {
        match self {
            Split::KeyChunks(chunks) => chunks,
            _ => 1,
        }
    }

    /// Runs of query heads per group (1 unless [`Split::Heads`]).
    pub(crate) fn runs(self) -> usize {
        match self {
            Split::Heads(runs) => runs,
            _ => 1,
        }
    }
}

/// Elements of one run's dK or dV partial sums, rows `w` wide: a row per key of the packed (or
/// flattened) keys and key/value head.
pub(crate) fn key_part_len(p: &Problem, w: usize) -> usize {
    p.batch * p.max_nk * p.heads_kv * w
}

/// Each sequence's work: the (query, key) pairs its mask lets through, counted a block of 128
/// queries at a time (each block as if it saw every key its rows see).
pub(crate) fn sequence_costs(p: &Problem) -> Vec<f64> {
    (0..p.batch)
        .map(|b| {
            let (nq, mask) = (p.seqs[b].nq, p.mask(b));
            (0..nq.div_ceil(128))
                .map(|t| {
                    let rows = t * 128..((t + 1) * 128).min(nq);
                    (rows.len() * mask.key_range_for_rows(rows).len()) as f64
                })
                .sum()
        })
        .collect()
}

/// The share of `threads` threads' time kept busy when each sequence's work (`costs`) is cut
/// into `parts` equal tasks for each of `heads_kv` key/value heads, and the tasks go, longest
/// first, to the least loaded thread (as the backward hands them out, sorted longest first).
fn balance(costs: &[f64], heads_kv: usize, parts: usize, threads: usize) -> f64 {
    let mut tasks: Vec<f64> = costs
        .iter()
        .flat_map(|&c| std::iter::repeat_n(c / parts as f64, parts * heads_kv))
        .collect();
    tasks.sort_by(|a, b| b.total_cmp(a));
    let total: f64 = tasks.iter().sum();
    let mut load = vec![0f64; threads];
    for t in tasks {
        let least = (0..threads)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]))
            .unwrap_or(0);
        load[least] += t;
    }
    let longest = load.iter().copied().fold(0f64, f64::max);
    if longest > 0.0 {
        total / (threads as f64 * longest)
    } else {
        1.0
    }
}

/// The key blocks (of `blocks`) that chunk `chunk` of `chunks` takes: back and forth, so that
/// in each round of `2 · chunks` blocks chunk `c` takes the `c`-th from either end. Under a
/// causal mask, where a block's work falls linearly with its index, the chunks get equal work
/// (every `chunks`-th block instead gave the first chunk the most: 12, 10, 8 and 6 query tiles
/// for four chunks of eight blocks; see BENCHMARKS.md).
pub(crate) fn chunk_blocks(
    chunk: usize,
    chunks: usize,
    blocks: usize,
) -> impl Iterator<Item = usize> {
    let round = 2 * chunks;
    (0..blocks).filter(move |j| j % round == chunk || j % round == round - 1 - chunk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttentionParams, Tensor};

    /// Every key block goes to one chunk, in order, and under a causal mask (block `j` of `n`
    /// seen by `n − j` query tiles) the chunks get equal work when the blocks fill whole rounds
    /// of `2 · chunks`, and differ by less than the heaviest block's otherwise.
    #[test]
    fn chunks_take_every_block_once_and_balance_causal_work() {
        for blocks in 1..40 {
            for chunks in 1..=blocks.min(9) {
                let mut seen = vec![0; blocks];
                let work: Vec<usize> = (0..chunks)
                    .map(|c| {
                        let mine: Vec<usize> = chunk_blocks(c, chunks, blocks).collect();
                        assert!(mine.windows(2).all(|w| w[0] < w[1]));
                        assert_eq!(mine.first(), Some(&c), "{blocks} blocks, {chunks} chunks");
                        mine.iter().for_each(|&j| seen[j] += 1);
                        mine.iter().map(|&j| blocks - j).sum()
                    })
                    .collect();
                let at = format!("{blocks} blocks, {chunks} chunks: {work:?}");
                assert!(seen.iter().all(|&n| n == 1), "{at}");
                let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
                if blocks % (2 * chunks) == 0 {
                    assert_eq!(lo, hi, "{at}");
                } else {
                    assert!(hi - lo <= blocks, "{at}");
                }
            }
        }
    }

    /// Whole groups when there are enough for the threads and they balance, runs of query heads
    /// under GQA/MQA (the fewest that divide the group and give enough balanced tasks), chunks
    /// of key blocks when the group is one head or too small, or whole groups balance badly.
    #[test]
    fn split_follows_groups_and_threads() {
        let problem = |b: usize, h: usize, hkv: usize, n: usize| {
            let t = |heads| Tensor::full(&[b, n, heads, 64], crate::DType::F32, 0.5).unwrap();
            Problem::new(&t(h), &t(hkv), &t(hkv), &AttentionParams::default()).unwrap()
        };
        let cases = [
            // (batch, heads, kv heads, threads, split)
            (1, 8, 8, 2, Split::Whole),
            (1, 8, 1, 2, Split::Heads(4)),
            (1, 8, 1, 4, Split::Heads(8)),
            (1, 8, 2, 2, Split::Heads(2)),
            (3, 2, 1, 2, Split::Heads(2)),
            (1, 2, 1, 2, Split::Heads(2)),
            (1, 2, 1, 4, Split::KeyChunks(8)),
            (1, 4, 4, 4, Split::Whole),
            (1, 5, 5, 2, Split::KeyChunks(2)),
            (1, 9, 9, 2, Split::Whole),
            (1, 20, 20, 8, Split::KeyChunks(2)),
            (1, 8, 1, 3, Split::Heads(8)),
            (1, 3, 3, 4, Split::KeyChunks(4)),
            (1, 8, 1, 8, Split::Heads(8)),
            (1, 8, 1, 16, Split::KeyChunks(16)),
            (2, 4, 1, 1, Split::Whole),
        ];
        let split = |p: &Problem, threads| Split::of(p, &sequence_costs(p), 64, threads);
        for (b, h, hkv, threads, want) in cases {
            let got = split(&problem(b, h, hkv, 1024), threads);
            assert_eq!(got, want, "B={b} H={h} Hkv={hkv}, {threads} threads");
        }
        // Chunks never outnumber the key blocks.
        assert_eq!(split(&problem(1, 1, 1, 100), 8), Split::KeyChunks(2));
        // A packed batch whose one long sequence would keep a thread busy alone is split;
        // one of sequences of similar lengths is not.
        let packed = |lens: &[usize], h: usize| {
            let total: usize = lens.iter().sum();
            let cu: Vec<i32> = std::iter::once(0)
                .chain(lens.iter().scan(0, |end, &l| {
                    *end += l as i32;
                    Some(*end)
                }))
                .collect();
            let t = Tensor::full(&[total, h, 16], crate::DType::F32, 0.5).unwrap();
            let params = AttentionParams::default().varlen(cu.clone(), cu);
            Problem::new(&t, &t, &t, &params).unwrap()
        };
        let skewed = packed(&[1024, 128, 128, 128, 128, 128, 128, 128], 1);
        assert_eq!(split(&skewed, 2), Split::KeyChunks(2));
        let even = packed(&[300, 310, 290, 305, 295, 300, 300, 300], 1);
        assert_eq!(split(&even, 2), Split::Whole);
    }

    /// Equal tasks keep `tasks / (threads · rounds)` of the threads' time busy; one long task
    /// among short ones keeps its thread busy after the others are done.
    #[test]
    fn balance_of_equal_and_skewed_tasks() {
        assert_eq!(balance(&[1.0; 5], 1, 1, 2), 5.0 / 6.0);
        assert_eq!(balance(&[1.0; 5], 1, 2, 2), 1.0);
        assert_eq!(balance(&[2.0, 1.0, 1.0], 1, 1, 2), 1.0);
        assert_eq!(balance(&[6.0, 1.0, 1.0], 1, 1, 2), 8.0 / 12.0);
        assert_eq!(balance(&[0.0, 0.0], 3, 1, 4), 1.0);
    }
}
