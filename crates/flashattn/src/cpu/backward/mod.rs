//! CPU backward: the FlashAttention-2 algorithm with recomputation, parallel with rayon.
//!
//! 1. `D = rowsum(dO∘O)` per (sequence, query head, query).
//! 2. One task per (sequence, key/value head), or per part of one when there are too few of
//!    those for the threads: a run of the group's query heads, or a chunk of the key blocks
//!    (`split`). A task walks its key blocks; each keeps its dK and dV in f32 while
//!    the query tiles of the task's heads that see it pass by (whole tiles outside the mask are
//!    never visited), see [`crate::cpu::backward::block`].
//! 3. A task that has every key block sums its dQ in its thread's scratch and writes its dq rows
//!    when its last key block is done, while they are still in cache (faster than per-chunk
//!    partials; see BENCHMARKS.md). Chunks of key blocks accumulate dQ in f32 partial buffers (`O(N·D)`
//!    each; the rows of one (sequence, key/value head) are one slice, so tasks own disjoint
//!    slices), summed into dq at the end; runs of query heads write their dK and dV rows to
//!    f32 partials, summed into dk and dv at the end.
//!
//! The loops that read or write strided rows once a call per head (the packing of Q, dO, K and
//! V, the writes of dK, dV and dQ) ask for the rows a few on from the current one
//! ([`RowsAhead::ahead_of`](crate::cpu::prefetch::RowsAhead::ahead_of)): rows a head apart
//! otherwise each wait on memory (see BENCHMARKS.md). The passes over every head's rows (`D`, the sums of the
//! partials) go in memory order instead ([`for_each_row`]).
//!
//! Extra memory: the partials (`chunks ·` the size of dq, or `runs ·` the size of dk and dv, in
//! f32; none for whole groups), `D`, and per-thread tiles (the Q, dO and, with every key block,
//! dQ rows of the task's sequence and heads among them), kept by the thread from one call to the
//! next when they take at most 8 MiB ([`KEPT_SCRATCH_BYTES`]).

mod bias_grad;
mod block;
mod rel_bias_grad;
mod split;

use std::cell::RefCell;
use std::ops::Range;

use crate::cpu::planning::schedule::{for_each_owned, for_each_queued};

use super::{SharedOut, call_number, with_thread_scratch};
use crate::cpu::CpuElement;
use crate::cpu::backward::bias_grad::BiasGrad;
use crate::cpu::backward::block::{BlockCtx, Scratch, Sinks, padded};
use crate::cpu::backward::rel_bias_grad::RelGrad;
use crate::cpu::backward::split::{Split, chunk_blocks, key_part_len, sequence_costs};
use crate::cpu::line_buf::LineBuf;
use crate::cpu::score_mods::Biases;
use crate::cpu::simd::elementwise::dot;
use crate::problem::{Problem, RowLayout, Seq};

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub biases: Biases<'a>,
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
    /// The relative-position table's gradient (zeroed), `[heads, 2L − 1]`.
    pub drel_bias: Option<&'a mut [f32]>,
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
/// each). 128×128 beat the earlier 64×64 by 3–6% at every head dim up to 256 (see
/// BENCHMARKS.md).
fn backward_tiles(d: usize, dv: usize) -> BackwardTiles {
    BackwardTiles {
        block_q: 128,
        block_k: if d.max(dv) <= 256 { 128 } else { 64 },
    }
}

/// One task: sequence `b`, key/value head `hk`, the query heads `heads` of its group (all, or
/// run `run` of them) and the key blocks of chunk `chunk` ([`chunk_blocks`]; all with one
/// chunk). `dq` is the task's dQ partial (rows of sequence `b`, `group × d16` per row) when the
/// key blocks are split; otherwise the task sums dQ in its thread's scratch and writes dq
/// itself.
struct Task<'a> {
    b: usize,
    hk: usize,
    heads: Range<usize>,
    run: usize,
    chunk: usize,
    dq: Option<&'a mut [f32]>,
}

pub(crate) fn run<T: CpuElement>(p: &Problem, x: Inputs<'_, T>, l: &Layouts, o: Outputs<'_, T>) {
    let tiles = backward_tiles(p.head_dim, p.head_dim_v);
    let delta = row_deltas(p, &x, l);
    let costs = sequence_costs(p);
    let split = Split::of(p, &costs, tiles.block_k, rayon::current_num_threads());
    let (chunks, runs) = (split.chunks(), split.runs());
    let row_len = p.group() * padded(p.head_dim);
    let part_len = p.total_q * row_len;
    // Zeros written by all threads (see `filled`: the products read the partials first). With
    // one chunk, each task sums its dQ in its own scratch instead, still in cache when it is
    // written to dq.
    let mut partials = match chunks {
        1 => LineBuf::default(),
        _ => LineBuf::filled(chunks * p.heads_kv * part_len, 0.0),
    };
    // Runs of query heads write their dK and dV rows here, every row once: `[run][key row][key
    // head][d or dv]`, f32, in the rows of the packed (or flattened) keys.
    let widths = [p.head_dim, p.head_dim_v];
    let mut key_parts = widths.map(|w| match runs {
        1 => LineBuf::default(),
        _ => LineBuf::filled(runs * key_part_len(p, w), 0.0),
    });

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
    let [dk_parts, dv_parts] = {
        let [dk, dv] = key_parts.each_mut();
        [(widths[0], dk), (widths[1], dv)].map(|part| key_partial_outs(p, part, runs))
    };
    let run_sinks: Vec<Sinks<'_, '_, f32>> = dk_parts
        .iter()
        .zip(&dv_parts)
        .map(|(dk, dv)| Sinks {
            dk,
            dv,
            dbias: dbias.as_ref(),
        })
        .collect();
    let drel = p
        .rel_bias
        .as_ref()
        .map(|r| RelGrad::new(p, r.width(), chunks));
    let score_mods = p.has_score_mods();
    let alpha = if score_mods {
        p.scale
    } else {
        p.scale * std::f32::consts::LOG2_E
    };

    let group = p.group();
    let mut tasks: Vec<Task<'_>> = match chunks {
        // Sequences without keys too: their dq rows are written as zeros.
        1 => (0..p.heads_kv)
            .flat_map(|hk| {
                let per_run = group / runs;
                (0..runs).flat_map(move |run| {
                    let h0 = hk * group + run * per_run;
                    (0..p.batch).map(move |b| Task {
                        b,
                        hk,
                        heads: h0..h0 + per_run,
                        run,
                        chunk: 0,
                        dq: None,
                    })
                })
            })
            .collect(),
        _ => split_tasks(p, &mut partials, chunks, tiles.block_k, part_len, row_len),
    };
    // Longest first (the sequences of a packed batch differ): the threads take them from one
    // queue in this order, so the long tasks go out first, as `Split::of` assumed.
    tasks.sort_by(|a, b| costs[b.b].total_cmp(&costs[a.b]));
    let factor = p.scale / alpha;
    let call = call_number();
    let body = |scratch: &mut Scratch, task: Task<'_>| {
        let ctx = BlockCtx {
            p,
            x: &x,
            l,
            delta: &delta,
            b: task.b,
            hk: task.hk,
            heads: task.heads.clone(),
            mask: p.mask(task.b),
            score_mods,
            alpha,
            block_q: tiles.block_q,
            call,
        };
        let (nq, nk) = (p.seqs[task.b].nq, p.seqs[task.b].nk);
        let mut own = std::mem::take(&mut scratch.dq);
        let direct = task.dq.is_none();
        let dq = match task.dq {
            Some(dq) => dq,
            None => {
                own.clear();
                own.resize(nq * task.heads.len() * padded(p.head_dim), 0.0);
                &mut own[..]
            }
        };
        let blocks = chunk_blocks(task.chunk, chunks, nk.div_ceil(tiles.block_k));
        let keys = blocks.map(|j| j * tiles.block_k..((j + 1) * tiles.block_k).min(nk));
        if let Some(r) = &p.rel_bias {
            scratch.rel.start(task.heads.len(), r.width());
        }
        match runs {
            1 => keys.for_each(|keys| ctx.key_block(scratch, keys, dq, &sinks)),
            _ => keys.for_each(|keys| ctx.key_block(scratch, keys, dq, &run_sinks[task.run])),
        }
        if let Some(g) = &drel {
            g.store(&scratch.rel, task.b, task.chunk, task.heads.clone());
        }
        if direct {
            for h in task.heads.clone() {
                write_dq(p, (task.b, h), (&own, &task.heads), factor, &o.dq);
            }
        }
        scratch.dq = own;
        if scratch.bytes() > KEPT_SCRATCH_BYTES {
            *scratch = Scratch::default();
        }
    };
    // Each task is taken by the first thread free.
    for_each_owned(tasks, |task| {
        with_thread_scratch(&SCRATCH, |scratch| body(scratch, task))
    });

    match split {
        Split::KeyChunks(_) => sum_partials(p, &partials, chunks, factor, &o.dq),
        Split::Heads(_) => sum_key_partials(p, &key_parts, runs, [&o.dk, &o.dv]),
        Split::Whole => {}
    }
    if let (Some(g), Some(out)) = (drel, o.drel_bias) {
        g.finish(out);
    }
}

/// The most bytes of tile buffers a thread keeps for its next task, in this call or the next:
/// a thread's scratch (the packed Q and dO rows of a task's sequence and heads, its dQ, the key
/// block's tiles) is freed after a task that made it larger. Allocated per rayon job instead, a
/// job's fresh buffers were faulted in again whenever the allocator had given the last job's
/// back to the system (see BENCHMARKS.md).
const KEPT_SCRATCH_BYTES: usize = 8 << 20;

thread_local! {
    /// Each thread's tile buffers, kept from task to task and call to call (at most
    /// [`KEPT_SCRATCH_BYTES`]).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The layout of the dK or dV partial sums of one run of query heads (`[key row][key head][w]`
/// with `w` the head dim, the rows those of the packed or flattened keys): `key_at` finds row
/// `(b, j, hk)` in it as in dk or dv.
fn key_partial_layout(p: &Problem, w: usize) -> RowLayout {
    let row = p.heads_kv * w;
    RowLayout {
        offset: 0,
        batch: if p.varlen { 0 } else { p.max_nk * row },
        row,
        head: w,
    }
}

/// `buf` (`runs` partial sums of rows `w` wide) cut into the writers of the runs (none for one
/// run).
fn key_partial_outs<'a>(
    p: &Problem,
    (w, buf): (usize, &'a mut LineBuf),
    runs: usize,
) -> Vec<SharedOut<'a, f32>> {
    let run_len = key_part_len(p, w);
    if runs == 1 || run_len == 0 {
        return Vec::new();
    }
    buf.chunks_exact_mut(run_len)
        .map(|part| SharedOut::new(part, key_partial_layout(p, w)))
        .collect()
}

/// `dk = Σ_run dK partial`, `dv = Σ_run dV partial` (each already scaled), written in their
/// memory order.
fn sum_key_partials<T: CpuElement>(
    p: &Problem,
    parts: &[LineBuf; 2],
    runs: usize,
    outs: [&SharedOut<'_, T>; 2],
) {
    for ((part, out), w) in parts.iter().zip(outs).zip([p.head_dim, p.head_dim_v]) {
        let layout = key_partial_layout(p, w);
        let run_len = key_part_len(p, w);
        for_each_row(p, Rows::Keys, &out.layout, |sum, b, j, hk| {
            let at = p.key_at(&layout, b, j, hk);
            sum.clear();
            sum.resize(w, 0.0);
            for run in 0..runs {
                let row = &part[run * run_len + at..][..w];
                sum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
            }
            // SAFETY: row (b, j, hk) of dk or dv is written by this (b, j, hk) alone.
            unsafe { out.write_f32_row(p.key_at(&out.layout, b, j, hk), sum, 1.0) };
        });
    }
}

/// Cuts `partials` (`[chunk][kv head][query row][group · d16]`, `d16` the head dim rounded up
/// to 16) into the dQ slices of every task that has key blocks.
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
                        heads: hk * p.group()..(hk + 1) * p.group(),
                        run: 0,
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
/// order ([`for_each_row`]). f16 and bf16 rows are widened a row at a time with the CPU's
/// conversion instructions first: element by element (one conversion call each, with its
/// run-time F16C check), this pass took a sizeable share of the call (see BENCHMARKS.md).
fn row_deltas<T: CpuElement>(p: &Problem, x: &Inputs<'_, T>, l: &Layouts) -> Vec<f32> {
    let mut delta = vec![0f32; p.lse_shape().iter().product()];
    let out = SharedOut::new(&mut delta, RowLayout::default());
    let dv = p.head_dim_v;
    for_each_row(p, Rows::Queries, &l.out, |buf, b, i, h| {
        let (o, g) = (p.query_at(&l.out, b, i, h), p.query_at(&l.dout, b, i, h));
        let (o, g) = (&x.out[o..o + dv], &x.dout[g..g + dv]);
        let d = match (T::as_f32_slice(o), T::as_f32_slice(g)) {
            (Some(o), Some(g)) => dot(o, g),
            _ => {
                buf.resize(2 * dv, 0.0);
                let (wo, wg) = buf.split_at_mut(dv);
                T::widen_into(o, wo);
                T::widen_into(g, wg);
                dot(wo, wg)
            }
        };
        // SAFETY: D[b, h, i] is written by this (b, i, h) alone.
        unsafe { out.write_row(p.lse_at(b, h, i), std::iter::once(d)) };
    });
    delta
}

/// Which rows [`for_each_row`] visits: every query row of every query head, or every key row
/// of every key/value head.
#[derive(Clone, Copy)]
enum Rows {
    Queries,
    Keys,
}

/// Calls `f(buf, b, i, h)` once for every row `i` of every sequence `b` and head `h` (query or
/// key rows and heads, per `rows`), a chunk of rows per task (`buf` a scratch vector of
/// the task), in the memory order of `layout`: all heads of a row together where a row's heads
/// lie side by side (`[B, N, H, D]`), so that each 4 KiB page is visited once for all its
/// heads' rows rather than once per head; head by head over the chunk where each head's rows
/// are contiguous (`[B, H, N, D]`).
///
/// Head by head over all rows instead, each `[B, N, H, D]` row waited on its page's
/// translation more than on its data (see BENCHMARKS.md).
fn for_each_row<F>(p: &Problem, rows: Rows, layout: &RowLayout, f: F)
where
    F: Fn(&mut Vec<f32>, usize, usize, usize) + Sync,
{
    let (len, heads): (fn(&Seq) -> usize, usize) = match rows {
        Rows::Queries => (|s| s.nq, p.heads_q),
        Rows::Keys => (|s| s.nk, p.heads_kv),
    };
    // At most CHUNK_ROWS rows a task, but four tasks a thread where the rows are few.
    let total: usize = p.seqs.iter().map(len).sum();
    let threads = rayon::current_num_threads().max(1);
    let step = total.div_ceil(4 * threads).clamp(16, CHUNK_ROWS);
    let chunks: Vec<(usize, Range<usize>)> = (0..p.batch)
        .flat_map(|b| {
            let n = len(&p.seqs[b]);
            (0..n.div_ceil(step)).map(move |c| (b, c * step..((c + 1) * step).min(n)))
        })
        .collect();
    let heads_inner = layout.head < layout.row;
    for_each_queued(&chunks, |(b, rows)| {
        let (b, rows) = (*b, rows.clone());
        let mut buf = Vec::new();
        if heads_inner {
            rows.for_each(|i| (0..heads).for_each(|h| f(&mut buf, b, i, h)));
        } else {
            (0..heads).for_each(|h| rows.clone().for_each(|i| f(&mut buf, b, i, h)));
        }
    });
}

/// The most rows per task of [`for_each_row`], which takes fewer where they would leave it
/// fewer than four tasks a thread: at N ≤ 256 one or two 256-row tasks kept one thread waiting
/// on the other (see BENCHMARKS.md).
const CHUNK_ROWS: usize = 256;

/// `dq = factor · Σ_chunk partial`, converted to `T` and written in dq's memory order (faster
/// than head by head over all rows; see BENCHMARKS.md).
fn sum_partials<T: CpuElement>(
    p: &Problem,
    partials: &[f32],
    chunks: usize,
    factor: f32,
    dq: &SharedOut<'_, T>,
) {
    let (d, d16, group) = (p.head_dim, padded(p.head_dim), p.group());
    let part_len = p.total_q * group * d16;
    for_each_row(p, Rows::Queries, &dq.layout, |sum, b, i, h| {
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
/// sequence's rows for the task's query heads `heads` (`[query row][heads · d16]`, f32).
fn write_dq<T: CpuElement>(
    p: &Problem,
    (b, h): (usize, usize),
    (dq_rows, heads): (&[f32], &Range<usize>),
    factor: f32,
    dq: &SharedOut<'_, T>,
) {
    let (d, d16) = (p.head_dim, padded(p.head_dim));
    let nq = p.seqs[b].nq;
    let ahead = dq.rows_ahead((p.query_at(&dq.layout, b, 0, h), dq.layout.row), nq, d);
    for i in 0..nq {
        ahead.fetch(i);
        let at = (i * heads.len() + h - heads.start) * d16;
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
