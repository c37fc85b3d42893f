//! One key block of the CPU backward (FlashAttention-2 with recomputation).
//!
//! A key block's K and V are packed once as f32 (K times `alpha`, the factor that turns `q·k`
//! into the logits the softmax exponentiates) and its `dK`, `dV` accumulate in f32 while every
//! query tile of the task's query heads (its key/value head's group, or a run of it) that sees
//! the block passes by:
//!
//! ```text
//! S  = Q·(αK)ᵀ           score options (softcap, ALiBi, bias), mask on boundary tiles
//! P  = 2^(S − lse·log2e)   the forward's probabilities, recomputed
//! dS = P∘(dO·Vᵀ − D)       one product, dP never stored (D = rowsum(dO∘O), computed before)
//! dV += Pᵀ·dO,  dK += dSᵀ·Q,  dQ += dS·(αK)
//! ```
//!
//! Every product is the microkernel's `C[rows × 16] (=|+=) A · B[k × 16]` over 16-column panels
//! of the right operand (see [`crate::cpu::simd::microkernel`]): A is read in place whatever its strides
//! (Pᵀ and dSᵀ are transposed views of the score tile), and the right operands are kept
//! 16-wide: the block's `αKᵀ`, `Vᵀ` and `αK`, zero-padded to multiples of 16 columns once per
//! block, Q and dO packed (as f32, padded) once per (sequence, query heads) for all the key
//! blocks a thread takes of them (packed per tile and key block, they cost 8–15% of the
//! backward; see BENCHMARKS.md). Nothing is repacked per product. Extra memory per thread: the sequence's Q and dO rows of the task's
//! query heads, and their dQ when the thread's task has every key block (else the dQ partials
//! of `crate::cpu::backward`).
//!
//! Tiles that cross the mask boundary are cut into strips of 16 rows, each multiplying only the
//! keys it can see (rounded out to 16) and masking per element; their dV and dK are taken once
//! per chunk of keys over all the strips that see it. With softcap, `dS` is multiplied
//! by the cap's derivative `1 − tanh²(s/cap)` after the bias gradient has taken its copy. The
//! constant factors (`scale`, `1/alpha`) are applied once when the gradients are written.

use std::ops::Range;

use crate::cpu::CpuElement;
use crate::cpu::SharedOut;
use crate::cpu::backward::bias_grad::{BiasGrad, TileFold};
use crate::cpu::backward::rel_bias_grad::RelFold;
use crate::cpu::backward::{Inputs, Layouts};
use crate::cpu::line_buf::LineBuf;
use crate::cpu::prefetch::RowsAhead;
use crate::cpu::score_mods::{ScoreMods, apply_score_mods_rows};
use crate::cpu::simd::exp::exp2_shifted_sum;
use crate::cpu::simd::microkernel::{
    PANEL, PairOffsets, PanelStrides, Write, panels_product, softmax_grad_product,
};
use crate::cpu::simd::transpose::transpose;
use crate::mask::Mask;
use crate::problem::{Problem, RowLayout};

const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// `n` rounded up to whole 16-column panels.
pub(crate) fn padded(n: usize) -> usize {
    n.div_ceil(PANEL) * PANEL
}

/// `buf` as `rows` rows `ld` apart whose columns `width..ld` are zero; the columns below `width`
/// are left as they were, for the caller to write.
fn padded_rows(buf: &mut LineBuf, (rows, width): (usize, usize), ld: usize) {
    buf.resize(rows * ld, 0.0);
    if width < ld {
        buf.chunks_exact_mut(ld)
            .for_each(|row| row[width..].fill(0.0));
    }
}

/// Per-thread tile buffers, reused across key blocks.
#[derive(Default)]
pub(crate) struct Scratch {
    /// `αKᵀ` of the block, `d × nc16` (zero columns past the block's keys).
    kt: LineBuf,
    /// `Vᵀ` of the block, `dv × nc16`.
    vt: LineBuf,
    /// V of the block, `nc × dv` (only for f16/bf16, on its way to `vt`).
    v: LineBuf,
    /// `αK` of the block, `nc16 × d16` (zero-padded).
    k: LineBuf,
    /// dK (`nc × d16`) and dV (`nc × dv16`) accumulators of the block.
    dk: LineBuf,
    dv: LineBuf,
    /// Q and dO of every query row of the task's sequence, for each of its query heads:
    /// `heads × nq × d16` / `heads × nq × dv16` (zero-padded), packed once per (sequence, query
    /// heads) rather than once per key block and tile.
    q: LineBuf,
    dout: LineBuf,
    /// The call, sequence and first query head of the rows `q` and `dout` hold.
    packed_for: Option<(u64, usize, usize)>,
    /// dQ of a task that has every key block of its (sequence, key/value head), summed here
    /// (`nq × heads × d16`) rather than in a partial shared by the call (see `backward`).
    pub(crate) dq: LineBuf,
    /// Scores, then probabilities P: `rows × keys16`.
    s: LineBuf,
    /// dP, then dS.
    ds: LineBuf,
    /// Softcap derivative per score.
    dcap: LineBuf,
    fold: TileFold,
    /// The task's sums of the relative-position table's gradient.
    pub(crate) rel: RelFold,
}

impl Scratch {
    /// The bytes its buffers hold.
    pub(crate) fn bytes(&self) -> usize {
        let tiles = [
            &self.kt, &self.vt, &self.v, &self.k, &self.dk, &self.dv, &self.q, &self.dout,
            &self.dq, &self.s, &self.ds, &self.dcap,
        ];
        tiles.iter().map(|b| b.bytes()).sum::<usize>() + self.fold.bytes() + self.rel.bytes()
    }
}

/// Where a task writes: dK/dV rows (disjoint per key block; `U` is the gradients' element
/// type, or f32 for the partial sums of a task that has only some query heads of its group),
/// the bias gradient.
pub(crate) struct Sinks<'s, 'a, U> {
    pub dk: &'s SharedOut<'a, U>,
    pub dv: &'s SharedOut<'a, U>,
    pub dbias: Option<&'s BiasGrad<'a>>,
}

/// The fixed context of one task: a (sequence, key/value head), the query heads of its group
/// that the task takes.
pub(crate) struct BlockCtx<'a, T> {
    pub p: &'a Problem,
    pub x: &'a Inputs<'a, T>,
    pub l: &'a Layouts,
    /// `D = rowsum(dO∘O)` per query, indexed like the log-sum-exp.
    pub delta: &'a [f32],
    pub b: usize,
    pub hk: usize,
    /// The task's query heads: the whole group of `hk`, or a run of it.
    pub heads: Range<usize>,
    pub mask: Mask,
    /// Whether the problem has score options (softcap, ALiBi or bias): they take natural-log
    /// logits and convert them to base 2 themselves.
    pub score_mods: bool,
    /// K is multiplied by this: `scale · log2(e)`, or `scale` with score options.
    pub alpha: f32,
    /// Query rows per tile.
    pub block_q: usize,
    /// This call's number, telling the rows a thread's scratch packed in this call from those
    /// of an earlier one.
    pub call: u64,
}

/// A left operand read in place: element `(r, l)` at `data[r·rs + l·cs]`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// A right operand or destination of 16-column panels: row `l` at `data[l·rs..]`, its width a
/// multiple of 16 inside each row.
struct Panels<D> {
    data: D,
    rs: usize,
}

impl<'a> Strided<'a> {
    /// The same rows as a right operand (their width is a multiple of 16 when read this way).
    fn panels(self) -> Panels<&'a [f32]> {
        Panels {
            data: self.data,
            rs: self.rs,
        }
    }
}

/// The transpose of a row-major tile with row stride `ld` (Pᵀ, dSᵀ: read down its columns).
fn transposed(data: &[f32], ld: usize) -> Strided<'_> {
    Strided {
        data,
        rs: 1,
        cs: ld,
    }
}

/// The microkernel's strides for C (rows `c_rs` apart), A and B, and where each pair of
/// 16-column panels of a `cols`-wide C starts (`cols` a multiple of 16): two panels at a time
/// (each broadcast of A feeds both), one for an odd last panel.
fn panel_pairs(
    c_rs: usize,
    a: &Strided<'_>,
    b_rs: usize,
    cols: usize,
) -> (
    PanelStrides,
    impl Iterator<Item = (usize, Option<PairOffsets>)>,
) {
    let st = PanelStrides {
        a_rs: a.rs,
        a_cs: a.cs,
        b_rs,
        c_rs,
    };
    let pair = PairOffsets { b: PANEL, c: PANEL };
    let starts = (0..cols).step_by(2 * PANEL);
    (
        st,
        starts.map(move |c0| (c0, (c0 + 2 * PANEL <= cols).then_some(pair))),
    )
}

/// `C[rows × cols] (=|+=) A[rows × k] · B[k × cols]`, `cols` a multiple of 16, panel by panel.
fn product(
    c: Panels<&mut [f32]>,
    a: Strided<'_>,
    b: Panels<&[f32]>,
    (rows, k, cols): (usize, usize, usize),
    write: Write,
) {
    let (st, pairs) = panel_pairs(c.rs, &a, b.rs, cols);
    for (c0, both) in pairs {
        let (c, b) = (&mut c.data[c0..], &b.data[c0..]);
        panels_product(c, a.data, b, rows, k, st, both, write);
    }
}

/// `C[rows × cols] = P ∘ (A · B − delta[r])` per row `r` (`P` at C's offsets and row stride),
/// `cols` a multiple of 16, panel by panel: the softmax gradient `dS` from `dO`, `Vᵀ`, P and D.
fn grad_product(
    c: Panels<&mut [f32]>,
    a: Strided<'_>,
    b: Panels<&[f32]>,
    (rows, k, cols): (usize, usize, usize),
    probs: &[f32],
    delta: &[f32],
) {
    let (st, pairs) = panel_pairs(c.rs, &a, b.rs, cols);
    for (c0, both) in pairs {
        let (c, b, p) = (&mut c.data[c0..], &b.data[c0..], &probs[c0..]);
        softmax_grad_product(c, a.data, b, (rows, k), st, both, p, delta);
    }
}

impl<T: CpuElement> BlockCtx<'_, T> {
    /// Accumulates everything key block `keys` contributes through the task's query heads:
    /// writes its dK and dV rows, adds its part of dQ to `dq` (rows of sequence `b`,
    /// `heads × d16` per row, f32) and of the bias gradient.
    pub(crate) fn key_block<U: CpuElement>(
        &self,
        sc: &mut Scratch,
        keys: Range<usize>,
        dq: &mut [f32],
        out: &Sinks<'_, '_, U>,
    ) {
        let (p, b, hk) = (self.p, self.b, self.hk);
        let (d, dv, nc) = (p.head_dim, p.head_dim_v, keys.len());
        let (d16, dv16, nc16) = (padded(d), padded(dv), padded(nc));
        if sc.packed_for != Some((self.call, b, self.heads.start)) {
            self.pack_queries(&mut sc.q, self.x.q, &p.q, d);
            self.pack_queries(&mut sc.dout, self.x.dout, &self.l.dout, dv);
            sc.packed_for = Some((self.call, b, self.heads.start));
        }
        // Only the padding is zeroed: the packing below writes everything else.
        padded_rows(&mut sc.kt, (d, nc), nc16);
        padded_rows(&mut sc.vt, (dv, nc), nc16);
        padded_rows(&mut sc.k, (nc16, d), d16);
        sc.k[nc * d16..].fill(0.0);
        // Rows a head apart come from memory one by one: K's rows are fetched a few ahead of
        // their packing, and V's, which the transpose below reads, as K's are packed.
        let (k0, v0) = (p.k_at(b, keys.start, hk), p.v_at(b, keys.start, hk));
        let k_ahead = RowsAhead::ahead_of(self.x.k, (k0, p.k.row), (nc, d));
        let v_rows = RowsAhead::new(self.x.v, (v0, p.v.row), (nc, dv));
        for (c, j) in keys.clone().enumerate() {
            k_ahead.fetch(c);
            v_rows.fetch(c);
            let (at, row) = (p.k_at(b, j, hk), &mut sc.k[c * d16..c * d16 + d]);
            T::widen_into(&self.x.k[at..at + d], row);
            row.iter_mut().for_each(|x| *x *= self.alpha);
        }
        transpose(&mut sc.kt, nc16, &sc.k, d16, nc, d);
        let at = p.v_at(b, keys.start, hk);
        match T::as_f32_slice(self.x.v) {
            Some(v) => transpose(&mut sc.vt, nc16, &v[at..], p.v.row, nc, dv),
            None => {
                sc.v.resize(nc * dv, 0.0);
                for (c, j) in keys.clone().enumerate() {
                    let at = p.v_at(b, j, hk);
                    T::widen_into(&self.x.v[at..at + dv], &mut sc.v[c * dv..(c + 1) * dv]);
                }
                transpose(&mut sc.vt, nc16, &sc.v, dv, nc, dv);
            }
        }
        sc.dk.clear();
        sc.dk.resize(nc * d16, 0.0);
        sc.dv.clear();
        sc.dv.resize(nc * dv16, 0.0);

        let rows = self.mask.query_range_for_keys(keys.clone());
        sc.s.resize(self.block_q * nc16, 0.0);
        sc.ds.resize(self.block_q * nc16, 0.0);
        for h in self.heads.clone() {
            let mods = ScoreMods::new(p, self.x.biases, b, h);
            let mut i0 = rows.start;
            while i0 < rows.end {
                let tile = i0..(i0 + self.block_q).min(rows.end);
                i0 = tile.end;
                let at = ScoresAt { at: 0, ld: nc16 };
                if self.mask.tile_is_full(tile.clone(), keys.clone()) {
                    let span = (tile.clone(), keys.clone(), keys.start);
                    self.scores(sc, h, &mods, span.clone(), false, at, dq, out.dbias);
                    self.key_grads(sc, h, span, at);
                } else {
                    self.boundary_tile(sc, h, &mods, tile, keys.clone(), dq, out.dbias);
                }
            }
        }

        let written = |o: &SharedOut<'_, U>, len: usize| {
            let at = (p.key_at(&o.layout, b, keys.start, hk), o.layout.row);
            o.rows_ahead(at, nc, len)
        };
        let (dk_ahead, dv_ahead) = (written(out.dk, d), written(out.dv, dv));
        for (c, j) in keys.enumerate() {
            dk_ahead.fetch(c);
            dv_ahead.fetch(c);
            // SAFETY: the dK/dV rows of (b, hk, key j) belong to the one task that owns key
            // block `keys`.
            unsafe {
                out.dk.write_f32_row(
                    p.key_at(&out.dk.layout, b, j, hk),
                    &sc.dk[c * d16..c * d16 + d],
                    p.scale,
                );
                out.dv.write_f32_row(
                    p.key_at(&out.dv.layout, b, j, hk),
                    &sc.dv[c * dv16..c * dv16 + dv],
                    1.0,
                );
            }
        }
    }

    /// Every query row of sequence `b`, for each of the task's query heads, of a query-shaped
    /// operand (`dim` wide) into `buf` as f32, `dim16` wide and zero-padded: `heads × nq ×
    /// dim16`. Packed even when f32: read in place, rows `heads · dim` apart fall
    /// into few L1 sets.
    fn pack_queries(&self, buf: &mut LineBuf, src: &[T], layout: &RowLayout, dim: usize) {
        let (p, b) = (self.p, self.b);
        let (nq, dim16) = (p.seqs[b].nq, padded(dim));
        padded_rows(buf, (self.heads.len() * nq, dim), dim16);
        for (g, h) in self.heads.clone().enumerate() {
            let at = (p.query_at(layout, b, 0, h), layout.row);
            let ahead = RowsAhead::ahead_of(src, at, (nq, dim));
            for i in 0..nq {
                ahead.fetch(i);
                let at = p.query_at(layout, b, i, h);
                let r = (g * nq + i) * dim16;
                T::widen_into(&src[at..at + dim], &mut buf[r..r + dim]);
            }
        }
    }

    /// Rows `rows` of query head `h` in a buffer of [`Self::pack_queries`] (`dim16` wide).
    fn packed_rows<'s>(
        &self,
        buf: &'s [f32],
        h: usize,
        rows: Range<usize>,
        dim: usize,
    ) -> Strided<'s> {
        let (nq, dim16) = (self.p.seqs[self.b].nq, padded(dim));
        let g = h - self.heads.start;
        Strided {
            data: &buf[(g * nq + rows.start) * dim16..(g * nq + rows.end) * dim16],
            rs: dim16,
            cs: 1,
        }
    }

    /// A tile crossing the mask boundary (query head `h`, queries `tile` × the block's `keys`):
    /// strips of 16 rows, each over the keys it sees from a 16-aligned column of the block
    /// (so the packed panels line up), their P and dS side by side in one tile-wide buffer
    /// (zero outside what each strip computed), then dV and dK once per chunk of keys over the
    /// queries that see them.
    ///
    /// A strip of its own per `Pᵀ·dO` and `dSᵀ·Q` would load and store every register block of
    /// dV and dK for 16 steps only (see BENCHMARKS.md for the chunks' gain).
    #[allow(clippy::too_many_arguments)]
    fn boundary_tile(
        &self,
        sc: &mut Scratch,
        h: usize,
        mods: &ScoreMods<'_>,
        tile: Range<usize>,
        keys: Range<usize>,
        dq: &mut [f32],
        dbias: Option<&BiasGrad<'_>>,
    ) {
        let ld = padded(keys.len());
        for s0 in tile.clone().step_by(PANEL) {
            let strip = s0..(s0 + PANEL).min(tile.end);
            let seen = self.mask.key_range_for_rows(strip.clone());
            let lo = seen.start.clamp(keys.start, keys.end);
            let hi = seen.end.clamp(lo, keys.end);
            let empty = lo == hi;
            let lo = keys.start + (lo - keys.start) / PANEL * PANEL;
            let cols = if empty {
                0..0
            } else {
                lo - keys.start..lo - keys.start + padded(hi - lo)
            };
            for row in (s0 - tile.start..strip.end - tile.start).map(|r| r * ld..(r + 1) * ld) {
                for buf in [&mut sc.s[row.clone()], &mut sc.ds[row]] {
                    buf[..cols.start].fill(0.0);
                    buf[cols.end..].fill(0.0);
                }
            }
            if empty {
                continue;
            }
            let needs_mask = !self.mask.tile_is_full(strip.clone(), lo..hi);
            let at = ScoresAt {
                at: (s0 - tile.start) * ld + cols.start,
                ld,
            };
            let span = (strip, lo..hi, keys.start);
            self.scores(sc, h, mods, span, needs_mask, at, dq, dbias);
        }
        for c0 in keys.clone().step_by(KEY_CHUNK) {
            let chunk = c0..(c0 + KEY_CHUNK).min(keys.end);
            let seen = self.mask.query_range_for_keys(chunk.clone());
            let rows = seen.start.max(tile.start)..seen.end.min(tile.end);
            if rows.is_empty() {
                continue;
            }
            let at = ScoresAt {
                at: (rows.start - tile.start) * ld + (c0 - keys.start),
                ld,
            };
            self.key_grads(sc, h, (rows, chunk, keys.start), at);
        }
    }

    /// The scores of query head `h` over queries `rows` × keys `keys` (sequence positions;
    /// `keys` starts a multiple of 16 after `block0`, the first key of the packed block): S
    /// into P and dP into dS in the scratch's `s` and `ds` at `at` (each row `padded(keys)`
    /// wide), the bias gradient and dQ.
    #[allow(clippy::too_many_arguments)]
    fn scores(
        &self,
        sc: &mut Scratch,
        h: usize,
        mods: &ScoreMods<'_>,
        (rows, keys, block0): (Range<usize>, Range<usize>, usize),
        needs_mask: bool,
        at: ScoresAt,
        dq: &mut [f32],
        dbias: Option<&BiasGrad<'_>>,
    ) {
        let (p, b) = (self.p, self.b);
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let d16 = padded(d);
        let (nr, nc, nc16) = (rows.len(), keys.len(), padded(keys.len()));
        let (c0, block16, ld) = (keys.start - block0, sc.kt.len() / d, at.ld);
        let Scratch {
            kt,
            vt,
            k,
            q: q_buf,
            dout: dout_buf,
            s,
            ds,
            dcap,
            fold,
            rel,
            ..
        } = sc;
        let q = self.packed_rows(q_buf, h, rows.clone(), d);
        let dout = self.packed_rows(dout_buf, h, rows.clone(), dv);
        let len = (nr - 1) * ld + nc16;
        let (s, ds) = (&mut s[at.at..at.at + len], &mut ds[at.at..at.at + len]);

        let kt = Panels {
            data: &kt[c0..],
            rs: block16,
        };
        let s_rows = Panels {
            data: &mut *s,
            rs: ld,
        };
        product(s_rows, q, kt, (nr, d, nc16), Write::Overwrite);
        if self.score_mods {
            if dcap.len() < at.at + len {
                dcap.resize(at.at + len, 1.0);
            }
            let dcap = &mut dcap[at.at..at.at + len];
            apply_score_mods_rows(mods, (s, ld), dcap, rows.clone(), keys.clone());
        }
        for (r, i) in rows.clone().enumerate() {
            let row = &mut s[r * ld..r * ld + nc16];
            if needs_mask {
                let seen = self.mask.key_range(i);
                let lo = seen.start.clamp(keys.start, keys.end) - keys.start;
                let hi = (seen.end.clamp(keys.start, keys.end) - keys.start).max(lo);
                row[..lo].fill(f32::NEG_INFINITY);
                row[hi..nc].fill(f32::NEG_INFINITY);
            }
            let lse = self.x.lse[p.lse_at(b, h, i)];
            if lse == f32::NEG_INFINITY {
                // A query that sees no key (or only −∞ scores): P is 0, not −∞ − (−∞).
                row.fill(0.0);
            } else {
                exp2_shifted_sum(&mut row[..nc], lse * LOG2_E);
                row[nc..].fill(0.0);
            }
        }

        let vt = Panels {
            data: &vt[c0..],
            rs: block16,
        };
        let dp_rows = Panels {
            data: &mut *ds,
            rs: ld,
        };
        // dS = P∘(dP − D), straight from the product (`D` is indexed like the log-sum-exp).
        let d0 = p.lse_at(b, h, rows.start);
        let delta = &self.delta[d0..d0 + nr];
        grad_product(dp_rows, dout, vt, (nr, dv, nc16), s, delta);
        if let Some(db) = dbias {
            db.add_tile(fold, (ds, ld), b, h, rows.clone(), keys.clone());
        }
        if p.rel_bias.is_some() {
            let tile = (rows.clone(), keys.clone());
            rel.add_tile(h - self.heads.start, (ds, ld), tile, p.seqs[b].diag);
        }
        if mods.has_softcap() {
            for r in 0..nr {
                let row = r * ld..r * ld + nc16;
                let cap = &dcap[at.at + row.start..at.at + row.end];
                ds[row].iter_mut().zip(cap).for_each(|(g, c)| *g *= c);
            }
        }

        let (width, hh) = (self.heads.len(), h - self.heads.start);
        let dq_rows = Panels {
            data: &mut dq[(rows.start * width + hh) * d16..],
            rs: width * d16,
        };
        let ds_rows = Strided {
            data: ds,
            rs: ld,
            cs: 1,
        };
        let k = Panels {
            data: &k[c0 * d16..],
            rs: d16,
        };
        product(dq_rows, ds_rows, k, (nr, nc, d16), Write::Accumulate);
    }

    /// `dV[keys] += Pᵀ·dO[rows]` and `dK[keys] += dSᵀ·Q[rows]` of query head `h`, with P and
    /// dS of queries `rows` × keys `keys` at `at` in the scratch (zero where masked; `keys`
    /// starts anywhere after `block0`, the first key of the packed block).
    fn key_grads(
        &self,
        sc: &mut Scratch,
        h: usize,
        (rows, keys, block0): (Range<usize>, Range<usize>, usize),
        at: ScoresAt,
    ) {
        let (d, dv) = (self.p.head_dim, self.p.head_dim_v);
        let (d16, dv16) = (padded(d), padded(dv));
        let (nr, nc, c0) = (rows.len(), keys.len(), keys.start - block0);
        let q = self.packed_rows(&sc.q, h, rows.clone(), d);
        let dout = self.packed_rows(&sc.dout, h, rows, dv);
        let dv_rows = Panels {
            data: &mut sc.dv[c0 * dv16..],
            rs: dv16,
        };
        let p = transposed(&sc.s[at.at..], at.ld);
        product(dv_rows, p, dout.panels(), (nc, nr, dv16), Write::Accumulate);
        let dk_rows = Panels {
            data: &mut sc.dk[c0 * d16..],
            rs: d16,
        };
        let ds = transposed(&sc.ds[at.at..], at.ld);
        product(dk_rows, ds, q.panels(), (nc, nr, d16), Write::Accumulate);
    }
}

/// Where a tile's scores lie in the scratch's `s` and `ds`: query row `r`, key column `c` at
/// `at + r·ld + c`.
#[derive(Clone, Copy)]
struct ScoresAt {
    at: usize,
    ld: usize,
}

/// Keys per dV/dK product of a boundary tile: one register block of rows on a pair of panels
/// (the microkernel's 12 × 2), so each block's accumulators are loaded and stored once for
/// all the queries that see its keys.
const KEY_CHUNK: usize = 12;
