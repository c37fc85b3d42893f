//! CPU forward: FlashAttention over Br×Bc tiles.
//!
//! One rayon task per (sequence, query head, block of `block_q` queries) owns its rows of the
//! output. It packs its Q tile once (as f32, times `scale · log2(e)` so the softmax runs in base
//! 2), then walks only the key blocks its rows can see (`Mask::key_range_for_rows`): per block,
//! `S = Q·Kᵀ` and `O += P·V` are `gemm` tile products and the online softmax sits between them.
//! Blocks inside the mask (the main loop) are never masked; blocks that cross its boundary are
//! cut into strips of rows, each multiplying only the keys it can see and masking per element.
//!
//! Extra memory: one scratch of tiles per worker thread (Q, Kᵀ, V, S, O), independent of N.

use std::any::TypeId;
use std::ops::Range;

use rayon::prelude::*;

use super::SharedOut;
use super::matmul::{MatMut, MatRef, Write, matmul};
use super::online_softmax::{OnlineSoftmax, Rows};
use super::score_mods::{ScoreMods, apply_mask};
use super::tile_config::{ForwardTiles, forward_tiles};
use crate::mask::Mask;
use crate::problem::Problem;
use crate::tensor::CpuElement;

pub(crate) struct Inputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub bias: Option<&'a [f32]>,
}

/// `x` as f32 when `T` is f32 (the tiles then read it in place), `None` for f16/bf16.
fn as_f32<T: CpuElement>(x: &[T]) -> Option<&[f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: `T` is `f32` (same TypeId), so the slice is reinterpreted as its own type.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) }
    })
}

/// Per-thread tile buffers, reused across tasks.
#[derive(Default)]
struct Scratch {
    /// Q tile, `block_q × d`, pre-scaled.
    q: Vec<f32>,
    /// Kᵀ tile, `d × block_k`.
    kt: Vec<f32>,
    /// V tile, `block_k × dv` (only for f16/bf16; f32 V is read in place).
    v: Vec<f32>,
    /// Scores, then probabilities: up to `block_q × block_k`.
    s: Vec<f32>,
    /// Output accumulator, `block_q × dv`.
    o: Vec<f32>,
    softmax: OnlineSoftmax,
}

/// What one task works on: a block of queries of one (sequence, query head).
#[derive(Clone, Copy, Debug)]
struct Task {
    b: usize,
    h: usize,
    /// First query row (within the sequence).
    q0: usize,
}

/// The fixed context of one task, shared by its key blocks.
struct TaskCtx<'a, T> {
    p: &'a Problem,
    x: &'a Inputs<'a, T>,
    tiles: ForwardTiles,
    b: usize,
    hk: usize,
    rows: Range<usize>,
    mask: Mask,
    mods: ScoreMods<'a>,
}

pub(crate) fn run<T: CpuElement>(
    p: &Problem,
    x: Inputs<'_, T>,
    out: SharedOut<'_, T>,
    lse: &mut [f32],
) {
    let tiles = forward_tiles(p.head_dim, p.head_dim_v);
    let tasks: Vec<Task> = (0..p.batch)
        .flat_map(|b| {
            let blocks = p.seqs[b].nq.div_ceil(tiles.block_q);
            (0..p.heads_q).flat_map(move |h| {
                (0..blocks).map(move |t| Task {
                    b,
                    h,
                    q0: t * tiles.block_q,
                })
            })
        })
        .collect();
    let lse_out = SharedOut::new(lse, Default::default());
    tasks
        .par_iter()
        .for_each_init(Scratch::default, |scratch, task| {
            let rows = task.q0..(task.q0 + tiles.block_q).min(p.seqs[task.b].nq);
            let ctx = TaskCtx {
                p,
                x: &x,
                tiles,
                b: task.b,
                hk: p.kv_head(task.h),
                rows,
                mask: p.mask(task.b),
                mods: ScoreMods::new(p, x.bias, task.b, task.h),
            };
            ctx.run(scratch, task.h, &out, &lse_out);
        });
}

impl<T: CpuElement> TaskCtx<'_, T> {
    fn run(&self, sc: &mut Scratch, h: usize, out: &SharedOut<'_, T>, lse: &SharedOut<'_, f32>) {
        let (p, b) = (self.p, self.b);
        let (d, dv, nr) = (p.head_dim, p.head_dim_v, self.rows.len());
        // Without per-element options, log2(e) rides on the Q tile; otherwise it is applied
        // after softcap/ALiBi/bias (see `ScoreMods::apply`).
        let q_scale = if self.mods.any() {
            p.scale
        } else {
            p.scale * std::f32::consts::LOG2_E
        };
        sc.q.clear();
        for i in self.rows.clone() {
            let at = p.q_at(b, i, h);
            sc.q.extend(self.x.q[at..at + d].iter().map(|v| v.to_f32() * q_scale));
        }
        sc.o.clear();
        sc.o.resize(nr * dv, 0.0);
        sc.softmax.reset(nr);

        let keys = self.mask.key_range_for_rows(self.rows.clone());
        let mut k0 = keys.start;
        while k0 < keys.end {
            let block = k0..(k0 + self.tiles.block_k).min(keys.end);
            k0 = block.end;
            if self.mask.tile_is_empty(self.rows.clone(), block.clone()) {
                continue;
            }
            self.pack_keys(sc, block.clone());
            if self.mask.tile_is_full(self.rows.clone(), block.clone()) {
                self.tile(sc, 0..nr, block.clone(), block.start, false);
                continue;
            }
            // Crossing the mask boundary: strips of rows, each over the keys it can see.
            for s0 in (0..nr).step_by(self.tiles.strip) {
                let strip = s0..(s0 + self.tiles.strip).min(nr);
                let seq_rows = self.rows.start + strip.start..self.rows.start + strip.end;
                let seen = self.mask.key_range_for_rows(seq_rows.clone());
                let sub = seen.start.max(block.start)..seen.end.min(block.end);
                if sub.is_empty() {
                    continue;
                }
                let needs_mask = !self.mask.tile_is_full(seq_rows, sub.clone());
                self.tile(sc, strip, sub, block.start, needs_mask);
            }
        }

        let o_rows = Rows::dense(&mut sc.o, dv);
        let row0 = self.rows.start;
        sc.softmax.finish(o_rows, |r, value| {
            // SAFETY: lse[b, h, row0 + r] belongs to this task alone.
            unsafe { lse.write_row(p.lse_at(b, h, row0 + r), std::iter::once(value)) };
        });
        for (r, i) in self.rows.clone().enumerate() {
            let row = &sc.o[r * dv..(r + 1) * dv];
            // SAFETY: out[b, i, h, ..] belongs to this task alone.
            unsafe {
                out.write_row(
                    p.query_at(&out.layout, b, i, h),
                    row.iter().map(|&o| T::from_f32(o)),
                )
            };
        }
    }

    /// Packs Kᵀ (`d × n`) and, for f16/bf16, V (`n × dv`) of the key block `keys` as f32.
    fn pack_keys(&self, sc: &mut Scratch, keys: Range<usize>) {
        let (p, b, hk) = (self.p, self.b, self.hk);
        let (d, dv, n) = (p.head_dim, p.head_dim_v, keys.len());
        sc.kt.resize(d * n, 0.0);
        for (c, j) in keys.clone().enumerate() {
            let at = p.k_at(b, j, hk);
            for (dd, k) in self.x.k[at..at + d].iter().enumerate() {
                sc.kt[dd * n + c] = k.to_f32();
            }
        }
        if as_f32(self.x.v).is_none() {
            sc.v.clear();
            for j in keys {
                let at = p.v_at(b, j, hk);
                sc.v.extend(self.x.v[at..at + dv].iter().map(|v| v.to_f32()));
            }
        }
    }

    /// One score tile: queries `strip` (tile rows) × keys `keys` (sequence positions, inside the
    /// packed block that starts at key `block0`): `S = Q·Kᵀ`, options, mask, online softmax,
    /// `O += P·V`.
    fn tile(
        &self,
        sc: &mut Scratch,
        strip: Range<usize>,
        keys: Range<usize>,
        block0: usize,
        needs_mask: bool,
    ) {
        let p = self.p;
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let (nr, nc) = (strip.len(), keys.len());
        let c0 = keys.start - block0;
        let block_n = sc.kt.len() / d;
        sc.s.resize(nr * nc, 0.0);
        let s = &mut sc.s[..nr * nc];
        matmul(
            MatMut::row_major(s, nr, nc),
            MatRef::row_major(&sc.q[strip.start * d..strip.end * d], nr, d),
            MatRef::new(&sc.kt[c0..], d, nc, block_n, 1),
            Write::Overwrite,
        );
        let seq_rows = self.rows.start + strip.start..self.rows.start + strip.end;
        if self.mods.any() {
            self.mods
                .apply(Rows::dense(s, nc), seq_rows.clone(), keys.clone());
        }
        if needs_mask {
            apply_mask(&self.mask, Rows::dense(s, nc), seq_rows, keys.clone());
        }
        let o = &mut sc.o[strip.start * dv..strip.end * dv];
        sc.softmax
            .update(strip.start, Rows::dense(s, nc), Rows::dense(o, dv));
        let v = match as_f32(self.x.v) {
            Some(v) => {
                let at = p.v_at(self.b, keys.start, self.hk);
                MatRef::new(&v[at..], nc, dv, p.v.row, 1)
            }
            None => MatRef::row_major(&sc.v[c0 * dv..(c0 + nc) * dv], nc, dv),
        };
        matmul(
            MatMut::row_major(o, nr, dv),
            MatRef::row_major(s, nr, nc),
            v,
            Write::Accumulate,
        );
    }
}
