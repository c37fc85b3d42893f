//! CPU forward: FlashAttention over Br×Bc tiles, kept transposed in panels of 16 queries.
//!
//! One task per (sequence, query head, block of `block_q` queries, or of 128 for the block
//! that sees the fewest keys: `query_blocks`) owns those rows of the output; a decoding step
//! (one query a sequence) runs as a matrix-vector product instead, the query heads of a group
//! as its rows (`decode`). A task packs its queries once as `Qᵀ` panels (`d × 16`, f32, times
//! `scale · log2(e)` so the softmax runs in base 2), then walks only the key blocks its rows can
//! see (`Mask::key_range_for_rows`). Per key block and pair of panels:
//!
//! ```text
//! Sᵀ  = K · Qᵀ            keys × 16 (×2)  microkernel, K rows read in place
//!       (softcap, ALiBi, biases; mask)    only where needed
//! m   = online softmax     per lane        rescales Oᵀ when a maximum moves
//! Oᵀ += Vᵀ · Pᵀ            dv × 16 (×2)    microkernel, V rows read in place, computing
//!                                          Pᵀ = 2^(Sᵀ − m) on the way (softmax_product)
//! ```
//!
//! The two panels of a pair share each broadcast of K and V (the microkernel's 12×2 register
//! blocks; see `microkernel`). Keys both panels see are multiplied once for both, keys only one
//! sees for that one, so a causal diagonal block costs about 8 wasted keys per row, and only
//! panels crossing the mask boundary mask per element. Tasks start longest first (`schedule`).
//! f32 K/V rows are read in place unless the tiles pack them (`tile_config`: long heads, or rows
//! that alias in L1); packed or converted (f16/bf16) rows are kept by the thread for its next
//! task on the same head when the head's K and V take at most 2 MiB as f32, else packed per key
//! block (`key_rows`).
//!
//! Extra memory: one scratch per thread that runs tasks (Qᵀ, Oᵀ, Sᵀ panel, packed K/V rows),
//! O(tile), kept by the thread from one call to the next (at most about 4 MiB: 2 MiB of tiles
//! at head dim 512, 2 MiB of kept rows).

pub(crate) mod key_rows;
mod pieces;

use std::cell::RefCell;
use std::ops::Range;

use super::{SharedOut, call_number, with_thread_scratch};
use crate::cpu::CpuElement;
use crate::cpu::decode;
use crate::cpu::forward::key_rows::{KeyRows, KeySource, PackedKeys};
use crate::cpu::forward::pieces::{contains, merged, pieces};
use crate::cpu::line_buf::LineBuf;
use crate::cpu::online_softmax::PanelSoftmax;
use crate::cpu::planning::query_blocks::{block_cost, query_blocks};
use crate::cpu::planning::schedule::for_each_in_runs;
use crate::cpu::planning::tile_config::{ForwardTiles, MAX_BLOCK_Q, forward_tiles, l2_bytes};
use crate::cpu::profile::{Section, TaskClock};
use crate::cpu::score_mods::{Biases, ScoreMods, apply_mask, apply_score_mods};
use crate::cpu::simd::exp::LANES;
use crate::cpu::simd::lanes::lane_max;
use crate::cpu::simd::microkernel::{
    NO_MAX, PairOffsets, PanelStrides, Write, join_max, panels_product, softmax_product,
};
use crate::cpu::simd::transpose::transpose_scaled;
use crate::mask::Mask;
use crate::problem::{Problem, RowLayout};

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub biases: Biases<'a>,
}

/// Per-thread tile buffers, reused across tasks and calls.
#[derive(Default)]
struct Scratch {
    panels: Panels,
    /// 16 query rows in row-major order (f32), on their way into or out of a panel.
    rows: LineBuf,
    kv: PackedKeys,
}

/// The task's query panels.
#[derive(Default)]
struct Panels {
    /// `Qᵀ` panels, `panels × d × 16`, pre-scaled, zero past the last query.
    qt: LineBuf,
    /// `Oᵀ` accumulator panels, `panels × dv × 16`.
    ot: LineBuf,
    /// Scores, then probabilities, of a pair of panels: `2 × block_k × 16`.
    st: LineBuf,
    softmax: Vec<PanelSoftmax>,
}

/// The rows of one panel's lanes in a query-shaped operand: lane `l` at `at + l·stride`.
struct LaneRows {
    at: usize,
    stride: usize,
    /// How many lanes the panel fills.
    count: usize,
}

/// What one task works on: a block of queries of one (sequence, query head).
#[derive(Clone, Debug)]
struct Task {
    b: usize,
    h: usize,
    /// Its query rows (within the sequence).
    rows: Range<usize>,
    /// Query rows times the keys they see: the task's share of the call's work.
    cost: usize,
}

pub(crate) fn run<T: CpuElement>(
    p: &Problem,
    x: Inputs<'_, T>,
    out: SharedOut<'_, T>,
    lse: SharedOut<'_, f32>,
) {
    if decode::applies(p) {
        return decode::run(p, &x, out, lse);
    }
    let rows: usize = p.seqs.iter().map(|s| s.nq).sum::<usize>() * p.heads_q;
    // The keys one task's queries can see at most: under a window bounded on both sides, its
    // width and the largest task's queries, however long the sequences.
    let span = match (p.window.left, p.window.right) {
        (Some(l), Some(r)) => l.saturating_add(r).saturating_add(1 + MAX_BLOCK_Q),
        _ => p.max_nk,
    };
    let tiles = forward_tiles(
        p.head_dim,
        p.head_dim_v,
        (p.max_nk, span),
        ([p.k.row, p.v.row], T::as_f32_slice(x.k).is_some()),
        rows / rayon::current_num_threads(),
        l2_bytes(),
    );
    // Counted before the cheapest blocks are cut (see `query_blocks`).
    let by_head = (0..p.batch)
        .map(|b| p.seqs[b].nq.div_ceil(tiles.block_q) * p.heads_q)
        .sum::<usize>()
        >= 8 * rayon::current_num_threads();
    let mut tasks: Vec<Task> = (0..p.batch)
        .flat_map(|b| {
            let mask = p.mask(b);
            query_blocks(p.seqs[b].nq, tiles.block_q, &mask)
                .into_iter()
                .flat_map(move |rows| {
                    let cost = block_cost(&mask, rows.clone());
                    (0..p.heads_q).map(move |h| Task {
                        b,
                        h,
                        rows: rows.clone(),
                        cost,
                    })
                })
        })
        .collect();
    // Longest first: with causal or windowed masks the tasks differ in size, and a long task
    // started last would leave the other threads idle. With many tasks a thread, longest first
    // within each (sequence, head) instead, so that a thread's run of tasks finds its head's K
    // and V in its L2 rather than in memory (12–15% where the inputs pass the L3; see
    // BENCHMARKS.md).
    tasks.sort_by_key(|t| {
        let head = if by_head { (t.b, t.h) } else { (0, 0) };
        (head, std::cmp::Reverse(t.cost))
    });
    let call = call_number();
    let body = |task: &Task| {
        let ctx = TaskCtx {
            p,
            x: &x,
            tiles,
            b: task.b,
            h: task.h,
            hk: p.kv_head(task.h),
            rows: task.rows.clone(),
            mask: p.mask(task.b),
            mods: ScoreMods::new(p, x.biases, task.b, task.h),
            call,
        };
        with_thread_scratch(&SCRATCH, |scratch| ctx.run(scratch, &out, &lse));
    };
    // With many tasks a thread (`by_head`) and rows read in place, one queue: the threads work
    // on the same head at once and share its rows through the last-level cache. Otherwise one
    // run of tasks a thread: its heads' rows, converted or packed and kept by the thread
    // (`keep_kv`), or read in place next to the neighbouring heads' rows that its core's
    // prefetchers bring in with them.
    let in_place = !tiles.pack_kv && T::as_f32_slice(x.k).is_some();
    let runs = if by_head && in_place {
        1
    } else {
        rayon::current_num_threads()
    };
    for_each_in_runs(&tasks, runs, |t| t.cost, body);
}

thread_local! {
    /// Each thread's tile buffers, kept from call to call: allocated and zeroed per rayon job
    /// instead, they cost 1–5% (see BENCHMARKS.md).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The fixed context of one task.
struct TaskCtx<'a, T> {
    p: &'a Problem,
    x: &'a Inputs<'a, T>,
    tiles: ForwardTiles,
    b: usize,
    h: usize,
    hk: usize,
    /// The task's queries (sequence positions).
    rows: Range<usize>,
    mask: Mask,
    mods: ScoreMods<'a>,
    /// This call's number, telling its kept key rows from another call's.
    call: u64,
}

impl<T: CpuElement> TaskCtx<'_, T> {
    fn run(&self, sc: &mut Scratch, out: &SharedOut<'_, T>, lse: &SharedOut<'_, f32>) {
        let (p, b, dv) = (self.p, self.b, self.p.head_dim_v);
        let seq = (p.seqs[b].nq, p.seqs[b].nk, p.window);
        let mut clock = TaskClock::start(seq, &self.mask, self.rows.clone());
        let panels = self.rows.len().div_ceil(LANES);
        clock.time(Section::Queries, || self.pack_queries(sc, panels));
        sc.panels.ot.clear();
        sc.panels.ot.resize(panels * dv * LANES, 0.0);
        sc.panels.softmax.clear();
        sc.panels.softmax.resize(panels, PanelSoftmax::default());
        sc.panels.st.resize(2 * self.tiles.block_k * LANES, 0.0);

        let keys = self.mask.key_range_for_rows(self.rows.clone());
        let source = self.keys();
        let mut k0 = keys.start;
        while k0 < keys.end {
            let block = k0..(k0 + self.tiles.block_k).min(keys.end);
            k0 = block.end;
            if self.mask.tile_is_empty(self.rows.clone(), block.clone()) {
                continue;
            }
            let (k_rows, v_rows) =
                clock.time(Section::Keys, || source.block(&mut sc.kv, block.clone()));
            for first in (0..panels).step_by(2) {
                let pair = first..(first + 2).min(panels);
                self.panel_pair(&mut sc.panels, pair, block.clone(), k_rows, v_rows);
            }
        }
        clock.time(Section::Output, || self.write_outputs(sc, out, lse));
    }

    /// Writes the task's output rows, each divided by its softmax sum, and their log-sum-exps.
    fn write_outputs(&self, sc: &mut Scratch, out: &SharedOut<'_, T>, lse: &SharedOut<'_, f32>) {
        let (p, b) = (self.p, self.b);
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let panels = self.rows.len().div_ceil(LANES);
        sc.rows.resize(LANES * dv.max(d), 0.0);
        for panel in 0..panels {
            let ot = &mut sc.panels.ot[panel * dv * LANES..(panel + 1) * dv * LANES];
            let (inv, lse_panel) = sc.panels.softmax[panel].finish();
            // A query that saw no key writes 0, even where its column took 0 · NaN from a NaN
            // in a V row that other queries of the panel see.
            if inv.contains(&0.0) {
                for row in ot.chunks_exact_mut(LANES) {
                    for (x, &f) in row.iter_mut().zip(&inv) {
                        if f == 0.0 {
                            *x = 0.0;
                        }
                    }
                }
            }
            let rows = self.lane_rows(&out.layout, panel);
            let size = (dv, rows.count);
            // f32 rows straight from the panel; other dtypes through a row buffer. Each lane's
            // column is divided by its sum on the way.
            // SAFETY: the output rows of the panel's lanes belong to this task alone.
            let written =
                unsafe { out.write_transposed_f32(rows.at, rows.stride, ot, LANES, size, &inv) };
            if !written {
                transpose_scaled(&mut sc.rows, dv, ot, LANES, size, &inv);
            }
            for (l, &lane_lse) in lse_panel[..rows.count].iter().enumerate() {
                let (i, h) = self.lane(panel, l);
                // SAFETY: out[b, i, h, ..] and lse[b, h, i] belong to this task alone.
                unsafe {
                    if !written {
                        out.write_f32_row(
                            rows.at + l * rows.stride,
                            &sc.rows[l * dv..(l + 1) * dv],
                            1.0,
                        );
                    }
                    lse.write_row(p.lse_at(b, h, i), std::iter::once(lane_lse));
                }
            }
        }
    }

    /// The query (sequence position) and query head of lane `l` of panel `panel`.
    fn lane(&self, panel: usize, l: usize) -> (usize, usize) {
        (self.rows.start + panel * LANES + l, self.h)
    }

    /// Where the rows of panel `panel`'s queries lie in a query-shaped operand of layout
    /// `layout` (q, out): the first row's element index and the stride from row to row.
    fn lane_rows(&self, layout: &RowLayout, panel: usize) -> LaneRows {
        let queries = self.panel_queries(panel);
        LaneRows {
            at: self.p.query_at(layout, self.b, queries.start, self.h),
            stride: layout.row,
            count: queries.len(),
        }
    }

    /// Queries (sequence positions) of panel `panel`.
    fn panel_queries(&self, panel: usize) -> Range<usize> {
        let q0 = self.rows.start + panel * LANES;
        q0..(q0 + LANES).min(self.rows.end)
    }

    /// Folds key block `block` into panels `pair` (one or two): `Sᵀ = K·Qᵀ`, score options and
    /// mask, the online softmax of each panel, then `Oᵀ += Vᵀ·Pᵀ`. Keys both panels see are
    /// multiplied for both at once; keys only one sees (the ends of a causal or window
    /// diagonal), for that one alone. Each panel's softmax and `Vᵀ·Pᵀ` cover only the keys it
    /// sees; the mask touches only its partly visible rows, and the maxima of the other rows
    /// come from the products' registers.
    fn panel_pair(
        &self,
        sc: &mut Panels,
        pair: Range<usize>,
        block: Range<usize>,
        k_rows: KeyRows<'_>,
        v_rows: KeyRows<'_>,
    ) {
        let (d, dv) = (self.p.head_dim, self.p.head_dim_v);
        let clip = |keys: Range<usize>| keys.start.max(block.start)..keys.end.min(block.end);
        let queries: [Range<usize>; 2] = std::array::from_fn(|w| {
            if pair.start + w >= pair.end {
                return 0..0;
            }
            self.panel_queries(pair.start + w)
        });
        let seen = queries
            .clone()
            .map(|q| clip(self.mask.key_range_for_rows(q)));
        // Keys every query of a panel sees, within the block.
        let full = std::array::from_fn(|w| {
            let keys = self.mask.keys_seen_by_all(queries[w].clone());
            let lo = keys.start.max(seen[w].start);
            lo..keys.end.min(seen[w].end).max(lo)
        });
        let visible = seen.iter().filter(|r| !r.is_empty());
        let Some(start) = visible.clone().map(|r| r.start).min() else {
            return;
        };
        let end = visible.map(|r| r.end).max().unwrap_or(start);
        // The rows of both score panels: every key either panel sees.
        let n = end - start;
        let st = &mut sc.st[..pair.len() * n * LANES];
        let qt = &sc.qt[pair.start * d * LANES..pair.end * d * LANES];
        let ot = &mut sc.ot[pair.start * dv * LANES..pair.end * dv * LANES];
        let pieces = pieces(&seen, &full);
        // Per panel: the maxima of the scores the products gave exactly (rows every query of
        // the panel sees); rows of pieces that reach past `full` are maxed after the mask.
        let mut exact = [NO_MAX; 2];
        let mut shift = [[0f32; LANES]; 2];
        for piece in pieces.iter().flatten() {
            let (w, keys) = (piece.first, &piece.keys);
            let at = w * n * LANES + (keys.start - start) * LANES;
            let piece_max = panels_product(
                &mut st[at..],
                k_rows.skip(keys.start - block.start),
                &qt[w * d * LANES..],
                keys.len(),
                d,
                PanelStrides {
                    a_rs: k_rows.stride,
                    a_cs: 1,
                    b_rs: LANES,
                    c_rs: LANES,
                },
                piece.both.then_some(PairOffsets {
                    b: d * LANES,
                    c: n * LANES,
                }),
                Write::Overwrite,
            );
            for (w, m) in piece.panels().zip(&piece_max) {
                if contains(&full[w], keys) {
                    join_max(&mut exact[w], m);
                }
            }
        }
        for (w, panel) in pair.clone().enumerate() {
            let keys = seen[w].clone();
            if keys.is_empty() {
                continue;
            }
            let q = &queries[w];
            let rows = (keys.start - start)..(keys.end - start);
            let st = &mut st[(w * n + rows.start) * LANES..(w * n + rows.end) * LANES];
            let mut tile_max = Some(exact[w]);
            if self.mods.any() {
                let max = apply_score_mods(&self.mods, st, q.start, q.len(), keys.clone());
                // Exact unless the mask hides some of these scores below.
                tile_max = (full[w] == keys).then_some(max);
            }
            if full[w] != keys {
                apply_mask(&self.mask, st, q.start, q.len(), keys.clone());
            }
            if let Some(m) = tile_max.as_mut() {
                let partial = pieces
                    .iter()
                    .flatten()
                    .filter(|p| p.panels().any(|x| x == w) && !contains(&full[w], &p.keys));
                for piece in partial {
                    let r = piece.keys.start - keys.start..piece.keys.end - keys.start;
                    let pm = lane_max(&st[r.start * LANES..r.end * LANES]);
                    for (m, p) in m.iter_mut().zip(pm) {
                        *m = m.max(p);
                    }
                }
            }
            let ot = &mut ot[w * dv * LANES..(w + 1) * dv * LANES];
            shift[w] = sc.softmax[panel].rescale(st, tile_max, ot);
        }
        let mut sums = [[0f32; LANES]; 2];
        // One product per run of keys: the cuts for exact maxima do not matter here.
        for piece in merged(&pieces).iter().flatten() {
            let (w, keys) = (piece.first, &piece.keys);
            let piece_sums = softmax_product(
                &mut ot[w * dv * LANES..],
                v_rows.skip(keys.start - block.start),
                &mut st[w * n * LANES + (keys.start - start) * LANES..],
                dv,
                keys.len(),
                PanelStrides {
                    a_rs: 1,
                    a_cs: v_rows.stride,
                    b_rs: LANES,
                    c_rs: LANES,
                },
                piece.both.then_some(PairOffsets {
                    b: n * LANES,
                    c: dv * LANES,
                }),
                &[shift[w], shift[1.min(w + 1)]],
            );
            for (w, s) in piece.panels().zip(&piece_sums) {
                for (total, x) in sums[w].iter_mut().zip(s) {
                    *total += x;
                }
            }
        }
        for (w, panel) in pair.enumerate() {
            sc.softmax[panel].add_sums(&sums[w]);
        }
    }

    /// Packs `Qᵀ` panels as f32, scaled on the way, zero-padded past the last query.
    fn pack_queries(&self, sc: &mut Scratch, panels: usize) {
        let p = self.p;
        let d = p.head_dim;
        // Without per-element options, log2(e) rides on Q; otherwise `ScoreMods::apply` adds it
        // after softcap, ALiBi and bias.
        let scale = if self.mods.any() {
            p.scale
        } else {
            p.scale * std::f32::consts::LOG2_E
        };
        // Every lane of a full panel is written below: only a short last panel's padding needs
        // its zeros.
        sc.panels.qt.resize(panels * d * LANES, 0.0);
        sc.rows.resize(LANES * d.max(p.head_dim_v), 0.0);
        for panel in 0..panels {
            let rows = self.lane_rows(&p.q, panel);
            let n = rows.count;
            let qt = &mut sc.panels.qt[panel * d * LANES..(panel + 1) * d * LANES];
            if n < LANES {
                qt.fill(0.0);
            }
            let (size, scale) = ((n, d), &[scale; LANES]);
            match T::as_f32_slice(self.x.q) {
                Some(q) => transpose_scaled(qt, LANES, &q[rows.at..], rows.stride, size, scale),
                None => {
                    for l in 0..n {
                        let at = rows.at + l * rows.stride;
                        T::widen_into(&self.x.q[at..at + d], &mut sc.rows[l * d..(l + 1) * d]);
                    }
                    transpose_scaled(qt, LANES, &sc.rows, d, size, scale);
                }
            }
        }
    }

    /// Where this task reads its K and V rows (see [`KeySource`]).
    fn keys(&self) -> KeySource<'_, T> {
        let p = self.p;
        KeySource {
            p,
            k: self.x.k,
            v: self.x.v,
            b: self.b,
            hk: self.hk,
            in_place: !self.tiles.pack_kv,
            keep: self.tiles.keep_kv,
            call: self.call,
        }
    }
}
