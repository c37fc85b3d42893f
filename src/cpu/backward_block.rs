//! One key block of the CPU backward (FlashAttention-2 with recomputation).
//!
//! A key block's K and V are packed once as f32 (K times `alpha`, the factor that turns `q·k`
//! into the logits the softmax exponentiates) and its `dK`, `dV` accumulate in f32 while every
//! query tile of the group's heads that sees the block passes by:
//!
//! ```text
//! S  = Q·(αK)ᵀ           score options (softcap, ALiBi, bias), mask on boundary tiles
//! P  = 2^(S − lse·log2e)   the forward's probabilities, recomputed
//! dP = dO·Vᵀ,  dS = P∘(dP − D)       (D = rowsum(dO∘O), computed before)
//! dV += Pᵀ·dO,  dK += dSᵀ·Q,  dQ += dS·(αK)
//! ```
//!
//! With softcap, `dS` is multiplied by the cap's derivative `1 − tanh²(s/cap)` after the bias
//! gradient has taken its copy. The constant factors (`scale`, `1/alpha`) are applied once when
//! the gradients are written, not per tile.

use std::ops::Range;

use super::SharedOut;
use super::backward::{Inputs, Layouts};
use super::bias_grad::{BiasGrad, TileFold};
use super::exp::exp2_shifted_sum;
use super::matmul::{MatMut, MatRef, Write, matmul};
use crate::mask::Mask;
use crate::problem::{BiasLayout, Problem, RowLayout};
use crate::tensor::CpuElement;

const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// Per-thread tile buffers, reused across key blocks.
#[derive(Default)]
pub(crate) struct Scratch {
    /// `alpha · K` of the block, `block_k × d`.
    k: Vec<f32>,
    /// V of the block, `block_k × dv`.
    v: Vec<f32>,
    /// dK and dV accumulators of the block.
    dk: Vec<f32>,
    dv: Vec<f32>,
    /// Q and dO of a query tile (only for f16/bf16: f32 inputs are read in place).
    q: Vec<f32>,
    dout: Vec<f32>,
    /// Scores, then probabilities P: `rows × keys`.
    s: Vec<f32>,
    /// dP, then dS.
    ds: Vec<f32>,
    /// Softcap derivative per score.
    dcap: Vec<f32>,
    fold: TileFold,
}

/// Where a task writes: dK/dV rows (disjoint per key block), the bias gradient.
pub(crate) struct Sinks<'s, 'a, T> {
    pub dk: &'s SharedOut<'a, T>,
    pub dv: &'s SharedOut<'a, T>,
    pub dbias: Option<&'s BiasGrad<'a>>,
}

/// The fixed context of one task: a (sequence, key/value head).
pub(crate) struct BlockCtx<'a, T> {
    pub p: &'a Problem,
    pub x: &'a Inputs<'a, T>,
    pub l: &'a Layouts,
    /// `D = rowsum(dO∘O)` per query, indexed like the log-sum-exp.
    pub delta: &'a [f32],
    pub b: usize,
    pub hk: usize,
    pub mask: Mask,
    /// Whether the problem has score options (softcap, ALiBi or bias): they take natural-log
    /// logits and convert them to base 2 themselves.
    pub score_mods: bool,
    /// K is multiplied by this: `scale · log2(e)`, or `scale` with score options.
    pub alpha: f32,
    /// Query rows per tile.
    pub block_q: usize,
}

/// The score options of one (sequence, query head).
struct HeadMods<'a> {
    softcap: Option<f32>,
    slope: f32,
    /// The f32 bias, the element index of `bias[b, h, 0, 0]` and its strides.
    bias: Option<(&'a [f32], usize, BiasLayout)>,
    /// Key position of query 0's diagonal.
    diag: i64,
}

impl<T: CpuElement> BlockCtx<'_, T> {
    /// Accumulates everything key block `keys` contributes: writes its dK and dV rows, adds its
    /// part of dQ to `dq` (this task's f32 partial: rows of sequence `b`, `group × d` per row)
    /// and of the bias gradient.
    pub(crate) fn key_block(
        &self,
        sc: &mut Scratch,
        keys: Range<usize>,
        dq: &mut [f32],
        out: &Sinks<'_, '_, T>,
    ) {
        let (p, b, hk) = (self.p, self.b, self.hk);
        let (d, dv, nc) = (p.head_dim, p.head_dim_v, keys.len());
        sc.k.clear();
        sc.v.clear();
        for j in keys.clone() {
            let at = p.k_at(b, j, hk);
            sc.k.extend(self.x.k[at..at + d].iter().map(|x| x.to_f32() * self.alpha));
            let at = p.v_at(b, j, hk);
            sc.v.extend(self.x.v[at..at + dv].iter().map(|x| x.to_f32()));
        }
        sc.dk.clear();
        sc.dk.resize(nc * d, 0.0);
        sc.dv.clear();
        sc.dv.resize(nc * dv, 0.0);

        let rows = self.mask.query_range_for_keys(keys.clone());
        let group = p.group();
        for h in hk * group..(hk + 1) * group {
            let mods = self.head_mods(h);
            let mut i0 = rows.start;
            while i0 < rows.end {
                let tile = i0..(i0 + self.block_q).min(rows.end);
                i0 = tile.end;
                let needs_mask = !self.mask.tile_is_full(tile.clone(), keys.clone());
                self.tile(sc, h, &mods, tile, keys.clone(), needs_mask, dq, out.dbias);
            }
        }

        for (c, j) in keys.enumerate() {
            // SAFETY: the dK/dV rows of (b, hk, key j) belong to the one task that owns key
            // block `keys`.
            unsafe {
                out.dk.write_row(
                    p.key_at(&out.dk.layout, b, j, hk),
                    sc.dk[c * d..(c + 1) * d]
                        .iter()
                        .map(|&g| T::from_f32(g * p.scale)),
                );
                out.dv.write_row(
                    p.key_at(&out.dv.layout, b, j, hk),
                    sc.dv[c * dv..(c + 1) * dv].iter().map(|&g| T::from_f32(g)),
                );
            }
        }
    }

    fn head_mods(&self, h: usize) -> HeadMods<'_> {
        let p = self.p;
        let bias = match (self.x.bias, &p.bias) {
            (Some(data), Some((_, layout))) => {
                Some((data, p.bias_row_at(layout, self.b, h, 0), *layout))
            }
            _ => None,
        };
        HeadMods {
            softcap: p.softcap,
            slope: p.slope(self.b, h),
            bias,
            diag: p.seqs[self.b].nk as i64 - p.seqs[self.b].nq as i64,
        }
    }

    /// The f32 rows `rows` of head `h` of a query-shaped operand: in place when it is f32,
    /// else converted into `buf`.
    fn query_rows<'s>(
        &self,
        src: &'s [T],
        layout: &RowLayout,
        buf: &'s mut Vec<f32>,
        h: usize,
        rows: Range<usize>,
        dim: usize,
    ) -> MatRef<'s> {
        let (p, b, n) = (self.p, self.b, rows.len());
        if let Some(src) = T::as_f32_slice(src) {
            let at = p.query_at(layout, b, rows.start, h);
            return MatRef::new(&src[at..], n, dim, layout.row, 1);
        }
        buf.clear();
        for i in rows {
            let at = p.query_at(layout, b, i, h);
            buf.extend(src[at..at + dim].iter().map(|x| x.to_f32()));
        }
        MatRef::row_major(buf, n, dim)
    }

    /// One `rows × keys` tile of query head `h` (see the module doc).
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        sc: &mut Scratch,
        h: usize,
        mods: &HeadMods<'_>,
        rows: Range<usize>,
        keys: Range<usize>,
        needs_mask: bool,
        dq: &mut [f32],
        dbias: Option<&BiasGrad<'_>>,
    ) {
        let (p, b) = (self.p, self.b);
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let (nr, nc) = (rows.len(), keys.len());
        let Scratch {
            k,
            v,
            dk,
            dv: dv_acc,
            q: q_buf,
            dout: dout_buf,
            s,
            ds,
            dcap,
            fold,
        } = sc;
        let q = self.query_rows(self.x.q, &p.q, q_buf, h, rows.clone(), d);
        let dout = self.query_rows(self.x.dout, &self.l.dout, dout_buf, h, rows.clone(), dv);
        let k = MatRef::row_major(k, nc, d);
        let v = MatRef::row_major(v, nc, dv);
        s.resize(nr * nc, 0.0);
        ds.resize(nr * nc, 0.0);
        let (s, ds) = (&mut s[..nr * nc], &mut ds[..nr * nc]);

        matmul(MatMut::row_major(s, nr, nc), q, k.t(), Write::Overwrite);
        if self.score_mods {
            dcap.resize(nr * nc, 1.0);
            mods.apply(s, &mut dcap[..nr * nc], rows.clone(), keys.clone());
        }
        for (r, i) in rows.clone().enumerate() {
            let row = &mut s[r * nc..(r + 1) * nc];
            if needs_mask {
                let seen = self.mask.key_range(i);
                let lo = seen.start.clamp(keys.start, keys.end) - keys.start;
                let hi = (seen.end.clamp(keys.start, keys.end) - keys.start).max(lo);
                row[..lo].fill(f32::NEG_INFINITY);
                row[hi..].fill(f32::NEG_INFINITY);
            }
            let lse = self.x.lse[p.lse_at(b, h, i)];
            if lse == f32::NEG_INFINITY {
                // A query that sees no key (or only −∞ scores): P is 0, not −∞ − (−∞).
                row.fill(0.0);
            } else {
                exp2_shifted_sum(row, lse * LOG2_E);
            }
        }

        matmul(MatMut::row_major(ds, nr, nc), dout, v.t(), Write::Overwrite);
        for (r, i) in rows.clone().enumerate() {
            let delta = self.delta[p.lse_at(b, h, i)];
            let (pr, dr) = (&s[r * nc..(r + 1) * nc], &mut ds[r * nc..(r + 1) * nc]);
            dr.iter_mut()
                .zip(pr)
                .for_each(|(g, &pij)| *g = pij * (*g - delta));
        }
        if let Some(db) = dbias {
            db.add_tile(fold, ds, b, h, rows.clone(), keys.clone());
        }
        if mods.softcap.is_some() {
            ds.iter_mut().zip(dcap.iter()).for_each(|(g, c)| *g *= c);
        }

        let p_t = MatRef::row_major(s, nr, nc).t();
        let ds_ref = MatRef::row_major(ds, nr, nc);
        matmul(
            MatMut::row_major(&mut dv_acc[..nc * dv], nc, dv),
            p_t,
            dout,
            Write::Accumulate,
        );
        matmul(
            MatMut::row_major(&mut dk[..nc * d], nc, d),
            ds_ref.t(),
            q,
            Write::Accumulate,
        );
        let group = p.group();
        let hh = h - self.hk * group;
        let dq_rows = MatMut::new(
            &mut dq[(rows.start * group + hh) * d..],
            nr,
            d,
            group * d,
            1,
        );
        matmul(dq_rows, ds_ref, k, Write::Accumulate);
    }
}

impl HeadMods<'_> {
    /// Turns `q·k·scale` of the tile into base-2 logits (softcap → ALiBi → bias → `· log2e`)
    /// and stores the softcap's derivative `1 − tanh²(s/cap)` in `dcap` (when there is a cap).
    fn apply(&self, s: &mut [f32], dcap: &mut [f32], rows: Range<usize>, keys: Range<usize>) {
        let nc = keys.len();
        for (r, i) in rows.enumerate() {
            let row = &mut s[r * nc..(r + 1) * nc];
            if let Some(cap) = self.softcap {
                let inv = 1.0 / cap;
                for (x, dc) in row.iter_mut().zip(&mut dcap[r * nc..(r + 1) * nc]) {
                    let t = (*x * inv).tanh();
                    *x = cap * t;
                    *dc = 1.0 - t * t;
                }
            }
            if self.slope != 0.0 {
                let center = i as i64 + self.diag;
                for (x, j) in row.iter_mut().zip(keys.clone()) {
                    *x -= self.slope * (j as i64 - center).abs() as f32;
                }
            }
            if let Some((data, row0, layout)) = self.bias {
                let at = row0 + i * layout.strides[2];
                for (x, j) in row.iter_mut().zip(keys.clone()) {
                    *x += data[at + j * layout.strides[3]];
                }
            }
            row.iter_mut().for_each(|x| *x *= LOG2_E);
        }
    }
}
