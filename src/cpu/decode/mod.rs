//! Decoding steps (at most one query per sequence): the query heads of one key/value group are
//! the rows of a matrix-vector product against the group's K and V, read once.
//!
//! The forward's panels make the lanes queries, so a single query fills 1 of 16 lanes, or, with
//! the group's heads as lanes, as many as the group has heads (4 of 16 for 32 query heads on 8
//! key/value heads): most of the multiply-adds go to empty lanes. Here the lanes run along the
//! keys or the value dims instead. Per block of 64 keys:
//!
//! ```text
//! S  = Q · Kᵀ              heads × keys    AVX-512: dot products of K's rows in place, 16 at
//!                                          a time, reduced by a shuffle tree (`avx512`);
//!                                          otherwise K transposed into panels of 16 keys
//!                                          and the panel microkernel, heads as its rows
//!      (softcap)
//! m  = online softmax      per head        rescales the rows of O when a maximum moves
//! O += P · V               heads × dv      value dims as lanes, V rows in place
//! ```
//!
//! The next block's K and V rows are fetched into L2 while a block is multiplied. Groups of more
//! than 16 heads fill the panels' lanes already and stay with them, as do ALiBi and bias (a slope
//! or a bias row per head) and value dims that are not a multiple of 16.
//!
//! Measured (2-core Zen 5 VM, 2 threads, f32, one query, D=128, fastest of 10 calls, µs, the
//! panels with heads as lanes → these kernels, K/V `[B, N, H, D]` and `[B, H, N, D]`):
//! 32 query heads on 8 key/value heads, 4096 keys: 1561 → 1014 and 1151 → 633; 32768 keys:
//! 18117 → 13736 and 14168 → 9600; 32 heads without grouping (one query in 16 lanes before),
//! 1024 keys: 1802 → 784 and 1673 → 469; 4096 keys: 7997 → 4756 and 8354 → 3046.

#[cfg(target_arch = "x86_64")]
mod avx512;

use std::ops::Range;

use crate::cpu::SharedOut;
use crate::cpu::exp::{LANES, exp2_shifted_sum};
use crate::cpu::key_rows::{KeyRows, KeySource, PackedKeys};
use crate::cpu::lanes::lane_max;
use crate::cpu::matmul::Write;
use crate::cpu::microkernel::{PairOffsets, PanelStrides, panels_product};
use crate::cpu::online_softmax::PanelSoftmax;
#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::{Simd, cpu_simd};
use crate::cpu::softcap::softcap;
use crate::cpu::transpose::transpose;
use crate::problem::Problem;
use crate::tensor::CpuElement;

/// Keys per block: the block's `Kᵀ` (`64 × d` f32, 32 KiB at d = 128) stays in L1 while the
/// heads' scores are multiplied out of it.
const BLOCK: usize = 64;

/// True when the forward's tasks take decoding steps by [`GroupStep`].
pub(super) fn applies(p: &Problem) -> bool {
    p.max_nq <= 1
        && p.alibi.is_none()
        && p.bias.is_none()
        && p.group() <= LANES
        && p.head_dim_v.is_multiple_of(LANES)
}

/// A thread's buffers for decoding steps, kept from call to call.
#[derive(Default)]
pub(super) struct DecodeScratch {
    /// The group's query rows, `heads × d`, pre-scaled.
    q: Vec<f32>,
    /// The key block transposed: `BLOCK / 16` panels of `d × 16`.
    kt: Vec<f32>,
    /// Scores, then probabilities: `heads × BLOCK`.
    s: Vec<f32>,
    /// The output accumulator, `heads × dv`.
    o: Vec<f32>,
}

/// The query `i` of sequence `b` in heads `h..h + heads` (one key/value group) against keys
/// `keys`, the K and V rows read through `source`.
pub(super) struct GroupStep<'a, T> {
    pub p: &'a Problem,
    pub q: &'a [T],
    pub source: KeySource<'a, T>,
    pub b: usize,
    pub h: usize,
    pub heads: usize,
    pub i: usize,
    pub keys: Range<usize>,
}

impl<T: CpuElement> GroupStep<'_, T> {
    /// Writes the group's output rows and log-sum-exps.
    pub(super) fn run(
        &self,
        sc: &mut DecodeScratch,
        kv: &mut PackedKeys,
        out: &SharedOut<'_, T>,
        lse: &SharedOut<'_, f32>,
    ) {
        let p = self.p;
        let (d, dv, g) = (p.head_dim, p.head_dim_v, self.heads);
        // Without softcap, log2(e) rides on Q (as in the panels); with it, it comes after.
        let scale = match p.softcap {
            Some(_) => p.scale,
            None => p.scale * std::f32::consts::LOG2_E,
        };
        sc.q.resize(g * d, 0.0);
        for (r, row) in sc.q.chunks_exact_mut(d).enumerate() {
            let at = p.query_at(&p.q, self.b, self.i, self.h + r);
            T::widen_into(&self.q[at..at + d], row);
            row.iter_mut().for_each(|x| *x *= scale);
        }
        // Only the panel kernels transpose K.
        sc.kt.resize(BLOCK * d, 0.0);
        sc.s.resize(g * BLOCK, 0.0);
        sc.o.clear();
        sc.o.resize(g * dv, 0.0);
        let mut softmax = PanelSoftmax::default();
        let mut k0 = self.keys.start;
        while k0 < self.keys.end {
            let block = k0..(k0 + BLOCK).min(self.keys.end);
            k0 = block.end;
            self.source.prefetch(k0..(k0 + BLOCK).min(self.keys.end));
            let (k_rows, v_rows) = self.source.block(kv, block.clone());
            self.block(sc, &mut softmax, block.len(), k_rows, v_rows);
        }
        let (inv, lse_lanes) = softmax.finish();
        for (r, row) in sc.o.chunks_exact(dv).enumerate() {
            let h = self.h + r;
            // SAFETY: out[b, i, h, ..] and lse[b, h, i] of the group's heads belong to this task.
            unsafe {
                out.write_f32_row(p.query_at(&out.layout, self.b, self.i, h), row, inv[r]);
                lse.write_row(p.lse_at(self.b, h, self.i), std::iter::once(lse_lanes[r]));
            }
        }
    }

    /// Folds `n` keys (rows of `k_rows` and `v_rows`) into the softmax state and `O`.
    fn block(
        &self,
        sc: &mut DecodeScratch,
        softmax: &mut PanelSoftmax,
        n: usize,
        k_rows: KeyRows<'_>,
        v_rows: KeyRows<'_>,
    ) {
        let dv = self.p.head_dim_v;
        #[cfg(target_arch = "x86_64")]
        let wide = cpu_simd() == Simd::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        if wide {
            #[cfg(target_arch = "x86_64")]
            self.scores_avx512(sc, n, k_rows);
        } else {
            self.scores_panels(sc, n, k_rows);
        }
        let width = n.next_multiple_of(LANES);
        let mut tile_max = [f32::NEG_INFINITY; LANES];
        for (row, m) in sc.s.chunks_exact_mut(BLOCK).zip(&mut tile_max) {
            if let Some(cap) = self.p.softcap {
                softcap(&mut row[..n], cap, None);
                row[..n]
                    .iter_mut()
                    .for_each(|x| *x *= std::f32::consts::LOG2_E);
            }
            row[n..width].fill(f32::NEG_INFINITY);
            *m = lane_max(&row[..width])
                .into_iter()
                .fold(f32::NEG_INFINITY, f32::max);
        }
        let shift = softmax.rescale_rows(tile_max, &mut sc.o, dv);
        let mut sums = [0f32; LANES];
        for (r, row) in sc.s.chunks_exact_mut(BLOCK).enumerate() {
            sums[r] = exp2_shifted_sum(&mut row[..n], shift[r]);
        }
        softmax.add_sums(&sums);
        if wide {
            #[cfg(target_arch = "x86_64")]
            self.values_avx512(sc, n, v_rows);
        } else {
            self.values_panels(sc, n, v_rows);
        }
    }

    /// `S = Q · Kᵀ` by the panel microkernel: K's block transposed into `d × 16` panels of
    /// keys, the heads as the rows.
    fn scores_panels(&self, sc: &mut DecodeScratch, n: usize, k_rows: KeyRows<'_>) {
        let (d, g) = (self.p.head_dim, self.heads);
        let panels = n.div_ceil(LANES);
        for c in 0..panels {
            let rows = LANES.min(n - c * LANES);
            let kt = &mut sc.kt[c * d * LANES..(c + 1) * d * LANES];
            transpose(kt, LANES, k_rows.skip(c * LANES), k_rows.stride(), rows, d);
        }
        for c in (0..panels).step_by(2) {
            panels_product(
                &mut sc.s[c * LANES..],
                &sc.q,
                &sc.kt[c * d * LANES..],
                g,
                d,
                PanelStrides {
                    a_rs: d,
                    a_cs: 1,
                    b_rs: LANES,
                    c_rs: BLOCK,
                },
                (c + 1 < panels).then_some(PairOffsets {
                    b: d * LANES,
                    c: LANES,
                }),
                Write::Overwrite,
            );
        }
    }

    /// `O += P · V` by the panel microkernel: the heads as the rows, 16 value dims a panel.
    fn values_panels(&self, sc: &mut DecodeScratch, n: usize, v_rows: KeyRows<'_>) {
        let (dv, g) = (self.p.head_dim_v, self.heads);
        let v = v_rows.skip(0);
        for c in (0..dv / LANES).step_by(2) {
            panels_product(
                &mut sc.o[c * LANES..],
                &sc.s,
                &v[c * LANES..],
                g,
                n,
                PanelStrides {
                    a_rs: BLOCK,
                    a_cs: 1,
                    b_rs: v_rows.stride(),
                    c_rs: dv,
                },
                (c + 1 < dv / LANES).then_some(PairOffsets { b: LANES, c: LANES }),
                Write::Accumulate,
            );
        }
    }

    /// `S = Q · Kᵀ` as dot products of K's rows in place, 16 at a time (see [`avx512::scores`]).
    #[cfg(target_arch = "x86_64")]
    fn scores_avx512(&self, sc: &mut DecodeScratch, n: usize, k_rows: KeyRows<'_>) {
        let (d, g) = (self.p.head_dim, self.heads);
        let (k, k_rs) = (k_rows.skip(0), k_rows.stride());
        assert!(
            n >= 1 && (n - 1) * k_rs + d <= k.len(),
            "decode: K block out of bounds"
        );
        assert!(sc.q.len() >= g * d && sc.s.len() >= g * BLOCK);
        let hp = if g % 4 == 0 {
            4
        } else if g % 2 == 0 {
            2
        } else {
            1
        };
        for g0 in (0..g).step_by(hp) {
            let q = (sc.q[g0 * d..].as_ptr(), d);
            let s = (sc.s[g0 * BLOCK..].as_mut_ptr(), BLOCK);
            let k = (k.as_ptr(), k_rs);
            // SAFETY: AVX-512F is available; heads g0..g0 + hp have rows of q (d each) and of s
            // (BLOCK each, a multiple of 16 and at least n), and the n rows of K lie inside `k`
            // (asserted above).
            unsafe {
                match hp {
                    4 => avx512::scores::<4>(q, k, s, d, n),
                    2 => avx512::scores::<2>(q, k, s, d, n),
                    _ => avx512::scores::<1>(q, k, s, d, n),
                }
            }
        }
    }

    /// `O += P · V` with `GH × CW` blocks of accumulators (see [`avx512::accumulate`]).
    #[cfg(target_arch = "x86_64")]
    fn values_avx512(&self, sc: &mut DecodeScratch, n: usize, v_rows: KeyRows<'_>) {
        let (dv, g) = (self.p.head_dim_v, self.heads);
        let (v, v_rs) = (v_rows.skip(0), v_rows.stride());
        assert!(
            n >= 1 && (n - 1) * v_rs + dv <= v.len(),
            "decode: V block out of bounds"
        );
        assert!(sc.o.len() >= g * dv && sc.s.len() >= g * BLOCK);
        let chunks = dv / LANES;
        for g0 in (0..g).step_by(4) {
            let gh = (g - g0).min(4);
            let widest = if gh <= 2 { 8 } else { 4 };
            let mut c0 = 0;
            while c0 < chunks {
                let cw = [8, 4, 2, 1]
                    .into_iter()
                    .find(|&w| w <= widest && w <= chunks - c0)
                    .unwrap_or(1);
                let o = (sc.o[g0 * dv + c0 * LANES..].as_mut_ptr(), dv);
                let p = (sc.s[g0 * BLOCK..].as_ptr(), BLOCK);
                let v = (v[c0 * LANES..].as_ptr(), v_rs);
                // SAFETY: AVX-512F is available; heads g0..g0 + gh have rows of o (dv each, of
                // which columns 16·c0.. + 16·cw) and of p (n probabilities each), and the n rows
                // of V lie inside `v` (asserted above).
                unsafe {
                    match (gh, cw) {
                        (1, 8) => avx512::accumulate::<1, 8>(o, p, v, n),
                        (1, 4) => avx512::accumulate::<1, 4>(o, p, v, n),
                        (1, 2) => avx512::accumulate::<1, 2>(o, p, v, n),
                        (1, _) => avx512::accumulate::<1, 1>(o, p, v, n),
                        (2, 8) => avx512::accumulate::<2, 8>(o, p, v, n),
                        (2, 4) => avx512::accumulate::<2, 4>(o, p, v, n),
                        (2, 2) => avx512::accumulate::<2, 2>(o, p, v, n),
                        (2, _) => avx512::accumulate::<2, 1>(o, p, v, n),
                        (3, 4) => avx512::accumulate::<3, 4>(o, p, v, n),
                        (3, 2) => avx512::accumulate::<3, 2>(o, p, v, n),
                        (3, _) => avx512::accumulate::<3, 1>(o, p, v, n),
                        (_, 4) => avx512::accumulate::<4, 4>(o, p, v, n),
                        (_, 2) => avx512::accumulate::<4, 2>(o, p, v, n),
                        (_, _) => avx512::accumulate::<4, 1>(o, p, v, n),
                    }
                }
                c0 += cw;
            }
        }
    }
}
