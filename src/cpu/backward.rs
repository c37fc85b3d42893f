//! CPU backward: the FlashAttention-2 algorithm with recomputation, parallel with rayon.
//!
//! 1. `D = rowsum(dO∘O)` per (sequence, query head, query).
//! 2. One task per (sequence, key/value head, chunk of key blocks). A task walks its key blocks;
//!    each keeps its dK and dV in f32 while the query tiles that see it pass by (whole tiles
//!    outside the mask are never visited), see [`super::backward_block`]. Chunks take key
//!    blocks back and forth (`chunk_blocks`), so under a causal mask they get equal work.
//! 3. dQ is accumulated per chunk in an f32 partial buffer (`O(N·D)` each; the rows of one
//!    (sequence, key/value head) are one slice, so tasks own disjoint slices) and the partials
//!    are summed into dq at the end. Splitting key blocks into chunks keeps every thread busy
//!    even with a single key/value head. With one chunk (enough (sequence, key/value head)
//!    pairs for the threads) each task sums its dQ in its thread's scratch and writes its dq
//!    rows when its last key block is done, while they are still in cache: no partials, no
//!    second pass over them. f32, B=1, H=8, D=64, N=1024, `backward_into`, ratio to the
//!    partials, median over 8–20 interleaved rounds (Zen 4 VM, 2026-11-24): two threads full
//!    1.018, causal 1.023; one thread full 1.009, causal 1.015.
//!
//! The loops that read or write strided rows once a call (the packing of Q, dO, K and V, the
//! writes of dK, dV and dQ) ask for the rows a few on from the current one
//! ([`RowsAhead::ahead_of`]): rows a head apart otherwise each wait on memory. Measured on the
//! 2-vCPU Zen 4 VM (2026-11-24), f32, B=1, H=8, D=64, N=1024, `backward_into`, % of the sgemm
//! rate timed in the same round, median over 8–10 interleaved rounds, ratio with/without:
//! one thread full 1.010, causal 1.022; two threads full 1.015, causal 1.020.
//!
//! Extra memory: the partials (`chunks ·` the size of dq, in f32, none with one chunk), `D`, and
//! per-thread tiles (with one chunk, the dQ of one (sequence, key/value head) among them).

use std::ops::Range;

use rayon::prelude::*;

use super::SharedOut;
use super::backward_block::{BlockCtx, Scratch, Sinks, padded};
use super::bias_grad::BiasGrad;
use super::elementwise::dot;
use crate::problem::{Problem, RowLayout};
use crate::tensor::CpuElement;

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub bias: Option<&'a [f32]>,
    pub out: &'a [T],
    pub lse: &'a [f32],
    pub dout: &'a [T],
}

pub(crate) struct Layouts {
    pub out: RowLayout,
    pub dout: RowLayout,
}

/// The gradients: dq, dk and dv only written (every element once), the bias gradient added to.
pub(crate) struct Outputs<'a, T> {
    pub dq: SharedOut<'a, T>,
    pub dk: SharedOut<'a, T>,
    pub dv: SharedOut<'a, T>,
    pub dbias: Option<&'a mut [f32]>,
}

/// How the backward cuts the work.
#[derive(Clone, Copy, Debug)]
struct BackwardTiles {
    /// Query rows per score tile.
    block_q: usize,
    /// Keys per block (the rows of dK/dV kept in f32 while queries pass by).
    block_k: usize,
}

/// Tiles of the backward for head dims `d` (Q, K) and `dv` (V): 128 query rows, and key blocks
/// of 128 keys up to head dim 256, 64 beyond, so that a key block's packed `αKᵀ`, `Vᵀ`, `αK`
/// and its dK/dV accumulators (five `block_k × dim` f32 buffers: 160 KiB at d = 64, 640 KiB at
/// d = 256 and, with 64 keys, at d = 512) stay in a 1 MiB L2 with the tile's S and dP (64 KiB
/// each).
///
/// Measured on the 2-core Zen 5 VM (AVX-512 kernels, 2026-11-23), f32, `backward_into`, 2
/// threads, fastest call in two rounds, µs, 64×64 (the earlier tiles, chosen on the device
/// machine's Xeon with AVX2 kernels) → 128×128: H=8, N=1024, D=64 full 13339–13501 →
/// 12611–12653, causal 7217–7335 → 6911–6982 (128×64, 64×128, 256×128, 128×256, 256×256,
/// 192×128 within 2% of 128×128; 32×64 and 64×32 slower); N=4096 full 198794–199254 →
/// 187137–187371, causal 103033–103429 → 97079–98429; D=32 full 7021–7132 → 6598–6807;
/// D=128 full 25923–26097 → 25038–25113 (128×64 the same); D=256 full 52274–53511 →
/// 49979–50916; H=1, N=4096 full 24626–25787 → 23600–24145. At D=512 128×64 and 128×128
/// were within noise of 64×64 (100829–107941 µs).
fn backward_tiles(d: usize, dv: usize) -> BackwardTiles {
    BackwardTiles {
        block_q: 128,
        block_k: if d.max(dv) <= 256 { 128 } else { 64 },
    }
}

/// The most memory the dQ partials may take beyond the first (a full-size f32 dQ): bounds the
/// chunk count for long sequences on machines with many threads.
const EXTRA_PARTIALS_BYTES: usize = 256 << 20;

/// How many chunks the key blocks of each (sequence, key/value head) are split into: enough for
/// about two tasks per thread (tasks of one problem have equal work: chunks take the key blocks
/// back and forth so that a causal mask does not unbalance them), at most one chunk per key block,
/// and no more than [`EXTRA_PARTIALS_BYTES`] of extra dQ partials.
fn key_chunks(p: &Problem, block_k: usize) -> usize {
    let target = 2 * rayon::current_num_threads();
    let groups = (p.batch * p.heads_kv).max(1);
    let blocks = p.max_nk.div_ceil(block_k).max(1);
    let partial_bytes = (p.total_q * p.heads_q * padded(p.head_dim) * 4).max(1);
    let by_memory = 1 + EXTRA_PARTIALS_BYTES / partial_bytes;
    target.div_ceil(groups).min(by_memory).clamp(1, blocks)
}

/// One task: the key blocks of chunk `chunk` ([`chunk_blocks`]) of sequence `b`, key/value head `hk`, and the
/// task's dQ partial (rows of sequence `b`, `group × d16` per row), none when the task has every
/// key block (one chunk): it then sums dQ in its thread's scratch and writes dq itself.
struct Task<'a> {
    b: usize,
    hk: usize,
    chunk: usize,
    dq: Option<&'a mut [f32]>,
}

pub(crate) fn run<T: CpuElement>(p: &Problem, x: Inputs<'_, T>, l: &Layouts, o: Outputs<'_, T>) {
    let tiles = backward_tiles(p.head_dim, p.head_dim_v);
    let delta = row_deltas(p, &x, l);
    let chunks = key_chunks(p, tiles.block_k);
    let row_len = p.group() * padded(p.head_dim);
    let part_len = p.total_q * row_len;
    // Zeros written by all threads (see `filled`: the products read the partials first). With
    // one chunk, each task sums its dQ in its own scratch instead, still in cache when it is
    // written to dq.
    let direct = chunks == 1;
    let mut partials = match direct {
        true => Vec::new(),
        false => super::filled(chunks * p.heads_kv * part_len, 0f32),
    };

    let bias_shape = p.bias.as_ref().map(|(t, _)| t.shape().to_vec());
    let dbias = o
        .dbias
        .zip(bias_shape)
        .map(|(data, shape)| BiasGrad::new(data, &shape));
    let sinks = Sinks {
        dk: &o.dk,
        dv: &o.dv,
        dbias: dbias.as_ref(),
    };
    let score_mods = p.has_score_mods();
    let alpha = if score_mods {
        p.scale
    } else {
        p.scale * std::f32::consts::LOG2_E
    };

    let tasks = match direct {
        // Sequences without keys too: their dq rows are written as zeros.
        true => (0..p.heads_kv)
            .flat_map(|hk| {
                (0..p.batch).map(move |b| Task {
                    b,
                    hk,
                    chunk: 0,
                    dq: None,
                })
            })
            .collect(),
        false => split_tasks(p, &mut partials, chunks, tiles.block_k, part_len, row_len),
    };
    let factor = p.scale / alpha;
    tasks
        .into_par_iter()
        .for_each_init(Scratch::default, |scratch, task| {
            let ctx = BlockCtx {
                p,
                x: &x,
                l,
                delta: &delta,
                b: task.b,
                hk: task.hk,
                mask: p.mask(task.b),
                score_mods,
                alpha,
                block_q: tiles.block_q,
            };
            let (nq, nk) = (p.seqs[task.b].nq, p.seqs[task.b].nk);
            let mut own = std::mem::take(&mut scratch.dq);
            let dq = match task.dq {
                Some(dq) => dq,
                None => {
                    own.clear();
                    own.resize(nq * row_len, 0.0);
                    &mut own[..]
                }
            };
            for j in chunk_blocks(task.chunk, chunks, nk.div_ceil(tiles.block_k)) {
                let keys = j * tiles.block_k..((j + 1) * tiles.block_k).min(nk);
                ctx.key_block(scratch, keys, dq, &sinks);
            }
            if direct {
                for h in task.hk * p.group()..(task.hk + 1) * p.group() {
                    write_dq(p, (task.b, h), &own, factor, &o.dq);
                }
            }
            scratch.dq = own;
        });

    if !direct {
        sum_partials(p, &partials, chunks, factor, &o.dq);
    }
}

/// The key blocks (of `blocks`) that chunk `chunk` of `chunks` takes: back and forth, so that
/// in each round of `2 · chunks` blocks chunk `c` takes the `c`-th from either end. Under a
/// causal mask, where a block's work falls linearly with its index, the chunks get equal work
/// (every `chunks`-th block instead gave the first chunk the most: 12, 10, 8 and 6 query tiles
/// for four chunks of eight blocks; f32, B=1, H=8 query heads on one key/value head, D=64,
/// N=1024, causal, `backward_into` on two threads, median over 12 interleaved rounds: 65.5% →
/// 80.0% of the sgemm rate, 1.21×; full attention the same; 2026-11-24).
fn chunk_blocks(chunk: usize, chunks: usize, blocks: usize) -> impl Iterator<Item = usize> {
    let round = 2 * chunks;
    (0..blocks).filter(move |j| j % round == chunk || j % round == round - 1 - chunk)
}

/// Cuts `partials` (`[chunk][kv head][query row][group · d16]`, `d16` the head dim rounded up
/// to 16) into the dQ slices of every task
/// that has key blocks.
fn split_tasks<'a>(
    p: &Problem,
    partials: &'a mut [f32],
    chunks: usize,
    block_k: usize,
    part_len: usize,
    row_len: usize,
) -> Vec<Task<'a>> {
    let mut tasks = Vec::new();
    let mut rest = partials;
    let mut consumed = 0;
    for chunk in 0..chunks {
        for hk in 0..p.heads_kv {
            for (b, seq) in p.seqs.iter().enumerate() {
                let start = (chunk * p.heads_kv + hk) * part_len + p.q_row(b, 0) * row_len;
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
                let (dq, tail) = tail.split_at_mut(seq.nq * row_len);
                rest = tail;
                consumed = start + seq.nq * row_len;
                if chunk * block_k < seq.nk {
                    tasks.push(Task {
                        b,
                        hk,
                        chunk,
                        dq: Some(dq),
                    });
                }
            }
        }
    }
    tasks
}

/// `D[b, h, i] = Σ dO∘O` over the value dimension, indexed like the log-sum-exp, in O's memory
/// order ([`for_each_query_row`]).
fn row_deltas<T: CpuElement>(p: &Problem, x: &Inputs<'_, T>, l: &Layouts) -> Vec<f32> {
    let mut delta = vec![0f32; p.lse_shape().iter().product()];
    let out = SharedOut::new(&mut delta, RowLayout::default());
    let dv = p.head_dim_v;
    for_each_query_row(p, &l.out, |_, b, i, h| {
        let (o, g) = (p.query_at(&l.out, b, i, h), p.query_at(&l.dout, b, i, h));
        let (o, g) = (&x.out[o..o + dv], &x.dout[g..g + dv]);
        let d = match (T::as_f32_slice(o), T::as_f32_slice(g)) {
            (Some(o), Some(g)) => dot(o, g),
            _ => o.iter().zip(g).map(|(a, b)| a.to_f32() * b.to_f32()).sum(),
        };
        // SAFETY: D[b, h, i] is written by this (b, i, h) alone.
        unsafe { out.write_row(p.lse_at(b, h, i), std::iter::once(d)) };
    });
    delta
}

/// Calls `f(buf, b, i, h)` once for every query row `i` of every sequence `b` and query head
/// `h`, a chunk of rows per rayon task (`buf` a scratch vector of the task), in the memory order
/// of the query-shaped `layout`: all heads of a row together where a row's heads lie side by
/// side (`[B, N, H, D]`), so that each 4 KiB page is visited once for all its heads' rows
/// rather than once per head; head by head over the chunk where each head's rows are
/// contiguous (`[B, H, N, D]`).
///
/// Head by head over all rows instead, each `[B, N, H, D]` row waited on its page's
/// translation more than on its data (on the 2-vCPU Zen 4 VM with 4 KiB pages): f32, B=1, H=8,
/// D=64, N=1024, `backward_into`, `D`'s pass took 0.9% → 0.5% of one thread's call (full) and
/// 1.7% → 0.8% (causal); two threads, median over 12 interleaved rounds, the whole call 1.006×
/// (full) and 1.014× (causal) as fast (2026-11-24). `[B, H, N, D]` is as before (0.6%, 1.1%).
fn for_each_query_row<F>(p: &Problem, layout: &RowLayout, f: F)
where
    F: Fn(&mut Vec<f32>, usize, usize, usize) + Sync,
{
    let chunks: Vec<(usize, Range<usize>)> = (0..p.batch)
        .flat_map(|b| {
            let nq = p.seqs[b].nq;
            (0..nq.div_ceil(CHUNK_ROWS))
                .map(move |c| (b, c * CHUNK_ROWS..((c + 1) * CHUNK_ROWS).min(nq)))
        })
        .collect();
    let heads_inner = layout.head < layout.row;
    chunks.into_par_iter().for_each(|(b, rows)| {
        let mut buf = Vec::new();
        if heads_inner {
            rows.for_each(|i| (0..p.heads_q).for_each(|h| f(&mut buf, b, i, h)));
        } else {
            (0..p.heads_q).for_each(|h| rows.clone().for_each(|i| f(&mut buf, b, i, h)));
        }
    });
}

/// Query rows per task of [`for_each_query_row`] (64 and 256 were the same with
/// `[B, N, H, D]`; 256 took 5% less with `[B, H, N, D]`, whose rows it reads head by head).
const CHUNK_ROWS: usize = 256;

/// `dq = factor · Σ_chunk partial`, converted to `T` and written in dq's memory order (head by
/// head over all rows before: f32, B=1, H=8 query heads on one key/value head, D=64, N=1024,
/// `backward_into` on two threads, four chunks, median over 12 interleaved rounds: the whole
/// call 1.025× (full) and 1.037× (causal) as fast; 2026-11-24).
fn sum_partials<T: CpuElement>(
    p: &Problem,
    partials: &[f32],
    chunks: usize,
    factor: f32,
    dq: &SharedOut<'_, T>,
) {
    let (d, d16, group) = (p.head_dim, padded(p.head_dim), p.group());
    let part_len = p.total_q * group * d16;
    for_each_query_row(p, &dq.layout, |sum, b, i, h| {
        let at = (p.q_row(b, i) * group + h % group) * d16;
        sum.clear();
        sum.resize(d, 0.0);
        for chunk in 0..chunks {
            let part = &partials[(chunk * p.heads_kv + p.kv_head(h)) * part_len + at..][..d];
            sum.iter_mut().zip(part).for_each(|(r, x)| *r += x);
        }
        // SAFETY: dq[b, i, h, ..] is written by this (b, i, h) alone.
        unsafe { dq.write_f32_row(p.query_at(&dq.layout, b, i, h), sum, factor) };
    });
}

/// The dq rows of sequence `b`, query head `h`, from a task that summed them all (one chunk):
/// `factor · dQ`, converted to `T` and written in dq's layout. `dq_rows` holds the dQ of the
/// sequence's rows for h's key/value head (`[query row][group · d16]`, f32).
fn write_dq<T: CpuElement>(
    p: &Problem,
    (b, h): (usize, usize),
    dq_rows: &[f32],
    factor: f32,
    dq: &SharedOut<'_, T>,
) {
    let (d, d16, group) = (p.head_dim, padded(p.head_dim), p.group());
    let nq = p.seqs[b].nq;
    let ahead = dq.rows_ahead((p.query_at(&dq.layout, b, 0, h), dq.layout.row), nq, d);
    for i in 0..nq {
        ahead.fetch(i);
        let at = (i * group + h % group) * d16;
        // SAFETY: dq[b, i, h, ..] is written by this call alone.
        unsafe {
            dq.write_f32_row(
                p.query_at(&dq.layout, b, i, h),
                &dq_rows[at..at + d],
                factor,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key block's five f32 buffers (`αKᵀ`, `Vᵀ`, `αK`, dK, dV) stay within 640 KiB at every
    /// head dim, and tiles are whole 16-row panels.
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
                assert!(
                    seen.iter().all(|&n| n == 1),
                    "{blocks} blocks, {chunks} chunks"
                );
                let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
                if blocks % (2 * chunks) == 0 {
                    assert_eq!(lo, hi, "{blocks} blocks, {chunks} chunks: {work:?}");
                } else {
                    assert!(
                        hi - lo <= blocks,
                        "{blocks} blocks, {chunks} chunks: {work:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn key_block_buffers_fit_l2_at_every_head_dim() {
        for d in (1..=512).step_by(7).chain([64, 128, 256, 257, 512]) {
            for dv in [d, 64, 512] {
                let t = backward_tiles(d, dv);
                let bytes = t.block_k * (3 * padded(d) + 2 * padded(dv)) * 4;
                assert!(bytes <= 640 << 10, "d {d} dv {dv}: {bytes} bytes");
                assert_eq!((t.block_q % 16, t.block_k % 16), (0, 0));
            }
        }
    }
}
