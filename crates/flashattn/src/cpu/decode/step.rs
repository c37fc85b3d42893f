//! One decoding task: the query of one sequence in the heads of one or more key/value groups,
//! against a run of keys, block by block (see the module doc of [`super`]).

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::kernels::{Level, level, scores_in_place, values_in_place};
use super::kernels::{scores_panels, values_panels};
use super::{BLOCK, write_head};
use crate::cpu::CpuElement;
use crate::cpu::SharedOut;
use crate::cpu::forward::Inputs;
use crate::cpu::forward::key_rows::{KeyRows, KeySource, PackedKeys};
use crate::cpu::line_buf::LineBuf;
use crate::cpu::online_softmax::PanelSoftmax;
use crate::cpu::prefetch::RowsAhead;
use crate::cpu::score_mods::{Biases, add_rel_run, sub_alibi};
use crate::cpu::simd::exp::{LANES, exp2_shifted_sum};
use crate::cpu::simd::lanes::lane_max;
use crate::cpu::simd::softcap::softcap;
#[cfg(target_arch = "x86_64")]
use crate::dtype::DType;
use crate::problem::Problem;
#[cfg(target_arch = "x86_64")]
use half::{bf16, f16};

/// How many (block, group) passes ahead of its own rows the kernels fetch K and V rows into
/// L2, one row for each row they read: faster than the whole next block at once, and 2 passes
/// the best of 1 to 3 (see BENCHMARKS.md).
const PASSES_AHEAD: usize = 2;

/// A thread's buffers for decoding steps, kept from call to call.
#[derive(Default)]
pub(super) struct Scratch {
    /// The query rows of the task's heads, `groups × group × d`, pre-scaled.
    q: LineBuf,
    /// The key block transposed (panel kernels only): `BLOCK / 16` panels of `d × 16`.
    kt: LineBuf,
    /// One group's scores, then probabilities: `group × BLOCK`.
    s: LineBuf,
    /// The output accumulator, `groups × group × dvp` ([`padded_dv`]), unnormalized.
    pub(super) o: LineBuf,
    /// Each group's running maxima and sums, its heads as lanes.
    pub(super) softmax: Vec<PanelSoftmax>,
    /// K and V rows converted to f32 (f16 and bf16 inputs).
    kv: PackedKeys,
    /// V's block in rows of `dvp` f32, zero past `dv`, when `dv` is not a multiple of 16.
    v: LineBuf,
}

/// The width of a row of `O` and of the V rows the kernels read: the value dims rounded up to
/// a whole vector of 16 (V's block copied into such rows when they differ).
pub(super) fn padded_dv(p: &Problem) -> usize {
    p.head_dim_v.next_multiple_of(LANES)
}

/// The query of sequence `b` in the heads of key/value heads `groups`, against keys `keys`.
pub(super) struct Step<'a, T> {
    pub p: &'a Problem,
    pub x: &'a Inputs<'a, T>,
    pub b: usize,
    pub groups: Range<usize>,
    pub keys: Range<usize>,
}

impl<T: CpuElement> Step<'_, T> {
    /// Leaves each group's unnormalized output rows in `sc.o` and its state in `sc.softmax`.
    /// Block by block, every group in turn: with the heads of a key row side by side in memory
    /// (`[B, N, H, D]`), the groups together read each block's rows as one contiguous run.
    pub(super) fn run(&self, sc: &mut Scratch) {
        let p = self.p;
        let (d, dv, g) = (p.head_dim, padded_dv(p), p.group());
        let heads = self.groups.len() * g;
        // Without score options, log2(e) rides on Q (as in the panels); with them, it comes
        // after them (`Group::mods`).
        let scale = if p.has_score_mods() {
            p.scale
        } else {
            p.scale * std::f32::consts::LOG2_E
        };
        sc.q.resize(heads * d, 0.0);
        for (r, row) in sc.q.chunks_exact_mut(d).enumerate() {
            let at = p.query_at(&p.q, self.b, 0, self.groups.start * g + r);
            T::widen_into(&self.x.q[at..at + d], row);
            row.iter_mut().for_each(|x| *x *= scale);
        }
        sc.kt.resize(BLOCK * d, 0.0);
        sc.s.resize(g.min(LANES) * BLOCK, 0.0);
        sc.o.clear();
        sc.o.resize(heads * dv, 0.0);
        sc.softmax.clear();
        sc.softmax.resize(
            self.groups.len() * g.div_ceil(LANES),
            PanelSoftmax::default(),
        );
        let mut k0 = self.keys.start;
        while k0 < self.keys.end {
            let block = k0..(k0 + BLOCK).min(self.keys.end);
            k0 = block.end;
            for (i, hk) in self.groups.clone().enumerate() {
                // The rows of the (block, group) pass `PASSES_AHEAD` after this one.
                let later = i + PASSES_AHEAD;
                let start = block.start + later / self.groups.len() * BLOCK;
                let ahead = if start < self.keys.end {
                    let hk = self.groups.start + later % self.groups.len();
                    self.ahead(hk, start..(start + BLOCK).min(self.keys.end))
                } else {
                    [RowsAhead::NONE; 2]
                };
                let source = self.source(hk);
                let rows = match self.in_place(hk, block.clone()) {
                    Some(rows) => rows,
                    None => {
                        let (k, v) = source.block(&mut sc.kv, block.clone());
                        let v = if dv == p.head_dim_v {
                            v
                        } else {
                            self.padded_v(&mut sc.v, hk, block.clone())
                        };
                        Rows::F32(k, v)
                    }
                };
                // A group of more than 16 heads in parts of 16, each with its own state.
                for (j, softmax) in sc.softmax[i * g.div_ceil(LANES)..]
                    .iter_mut()
                    .take(g.div_ceil(LANES))
                    .enumerate()
                {
                    let part = i * g + j * LANES..i * g + ((j + 1) * LANES).min(g);
                    let group = Group {
                        q: &sc.q[part.start * d..part.end * d],
                        o: &mut sc.o[part.start * dv..part.end * dv],
                        softmax,
                        s: &mut sc.s,
                        kt: &mut sc.kt,
                    };
                    let heads =
                        self.groups.start * g + part.start..self.groups.start * g + part.end;
                    let at = Place {
                        b: self.b,
                        heads,
                        keys: block.clone(),
                        biases: self.x.biases,
                    };
                    group.block(p, &at, rows, &ahead);
                }
            }
        }
    }

    /// Each of the task's heads with its state: (head, its output rows' offset in `sc.o`, its
    /// running maximum and sum), heads in order.
    pub(super) fn heads(&self, sc: &Scratch) -> Vec<(usize, usize, f32, f32)> {
        let (dv, g) = (padded_dv(self.p), self.p.group());
        let mut all = Vec::with_capacity(self.groups.len() * g);
        for (i, hk) in self.groups.clone().enumerate() {
            for r in 0..g {
                let (max, sum) = sc.softmax[i * g.div_ceil(LANES) + r / LANES].max_sum();
                let h = hk * g + r;
                all.push((h, (i * g + r) * dv, max[r % LANES], sum[r % LANES]));
            }
        }
        all
    }

    /// Writes the output rows (`sc.o` divided by the sums) and log-sum-exps of every head.
    pub(super) fn write(&self, sc: &Scratch, out: &SharedOut<'_, T>, lse: &SharedOut<'_, f32>) {
        let dv = self.p.head_dim_v;
        for (h, at, max, sum) in self.heads(sc) {
            write_head(
                self.p,
                (out, lse),
                (self.b, h),
                &sc.o[at..at + dv],
                (max, sum),
            );
        }
    }

    /// The K and V rows of key/value head `hk` for keys `keys` in their own dtype, for the
    /// AVX-512 and AVX2 kernels, which widen f16 and bf16 as they load (converting each block
    /// first made bf16 steps slower than f32 ones: 13.3 against 8.7 ms with AVX-512, 32 heads on
    /// 8, D=128, 32768 keys); `None` for the panels and for f32 (which [`Self::source`] reads in
    /// place).
    fn in_place(&self, hk: usize, keys: Range<usize>) -> Option<Rows<'_>> {
        #[cfg(target_arch = "x86_64")]
        if level() != Level::Panels && padded_dv(self.p) == self.p.head_dim_v {
            let p = self.p;
            let k = (self.x.k, p.k_at(self.b, keys.start, hk), p.k.row);
            let v = (self.x.v, p.v_at(self.b, keys.start, hk), p.v.row);
            return match T::DTYPE {
                DType::BF16 => Some(Rows::Bf16(KeyRows::cast(k), KeyRows::cast(v))),
                DType::F16 => Some(Rows::F16(KeyRows::cast(k), KeyRows::cast(v))),
                DType::F32 => None,
            };
        }
        let _ = (hk, keys);
        None
    }

    /// V's rows of key/value head `hk` for keys `keys`, as f32 in `buf`, each padded with zeros
    /// to [`padded_dv`].
    fn padded_v<'b>(&self, buf: &'b mut LineBuf, hk: usize, keys: Range<usize>) -> KeyRows<'b> {
        let (p, dv) = (self.p, self.p.head_dim_v);
        let width = padded_dv(p);
        buf.clear();
        buf.resize(keys.len() * width, 0.0);
        for (row, j) in buf.chunks_exact_mut(width).zip(keys) {
            let at = p.v_at(self.b, j, hk);
            T::widen_into(&self.x.v[at..at + dv], &mut row[..dv]);
        }
        KeyRows {
            data: buf,
            at: 0,
            stride: width,
        }
    }

    /// The K and V rows of key/value head `hk` for keys `keys`, to be fetched by the kernels.
    fn ahead(&self, hk: usize, keys: Range<usize>) -> [RowsAhead; 2] {
        let p = self.p;
        [
            (
                self.x.k,
                p.k_at(self.b, keys.start, hk),
                p.k.row,
                p.head_dim,
            ),
            (
                self.x.v,
                p.v_at(self.b, keys.start, hk),
                p.v.row,
                p.head_dim_v,
            ),
        ]
        .map(|(x, at, stride, width)| RowsAhead::new(x, (at, stride), (keys.len(), width)))
    }

    /// Where the rows of key/value head `hk` are read: in place when f32 (one pass over each
    /// block, whatever the stride), converted block by block otherwise.
    fn source(&self, hk: usize) -> KeySource<'_, T> {
        KeySource {
            p: self.p,
            k: self.x.k,
            v: self.x.v,
            b: self.b,
            hk,
            in_place: true,
            keep: false,
            call: 0,
        }
    }
}

/// One group's share of a task's buffers.
struct Group<'s> {
    /// Its query rows, `group × d`.
    q: &'s [f32],
    /// Its output rows, `group × dv`.
    o: &'s mut [f32],
    softmax: &'s mut PanelSoftmax,
    s: &'s mut [f32],
    kt: &'s mut [f32],
}

/// Where a group's block lies: sequence `b`, query heads `heads`, keys `keys`, and the f32 bias
/// buffer when there is one.
struct Place<'a> {
    b: usize,
    heads: Range<usize>,
    keys: Range<usize>,
    biases: Biases<'a>,
}

/// Softcap, ALiBi and bias on the scores of head `h` for the keys of `at` (`row`), then the
/// change to base 2, in the documented order. The step's one query sits at key `Seq::diag`
/// (`nk − 1` by default).
fn mods(p: &Problem, at: &Place<'_>, h: usize, row: &mut [f32]) {
    if let Some(cap) = p.softcap {
        softcap(row, cap, None);
    }
    let slope = p.slope(at.b, h);
    if slope != 0.0 {
        sub_alibi(row, slope, p.seqs[at.b].diag - at.keys.start as i64, -1);
    }
    if let (Some(data), Some((_, layout))) = (at.biases.bias, &p.bias) {
        let first = p.bias_row_at(layout, at.b, h, 0);
        let step = layout.strides[3];
        for (x, j) in row.iter_mut().zip(at.keys.clone()) {
            *x += data[first + j * step];
        }
    }
    if let (Some(data), Some(r)) = (at.biases.rel, &p.rel_bias) {
        let table = &data[r.row_at(h)..r.row_at(h) + r.width()];
        add_rel_run(row, table, at.keys.start as i64 - p.seqs[at.b].diag);
    }
    row.iter_mut().for_each(|x| *x *= std::f32::consts::LOG2_E);
}

impl Group<'_> {
    /// Folds the keys of `at` (`rows`) into the softmax state and `O`.
    /// The kernels fetch `ahead` (rows of K and V the task reads later) as they go.
    fn block(self, p: &Problem, at: &Place<'_>, rows: Rows<'_>, ahead: &[RowsAhead; 2]) {
        let (d, dv, n) = (p.head_dim, padded_dv(p), at.keys.len());
        #[cfg(target_arch = "x86_64")]
        let level = level();
        let (q, s) = (self.q, &mut *self.s);
        match rows {
            #[cfg(target_arch = "x86_64")]
            Rows::F32(k, _) if level != Level::Panels => {
                scores_in_place(q, s, (d, n), k, &ahead[0])
            }
            Rows::F32(k, _) => scores_panels(q, self.kt, s, (d, n), k, &ahead[0]),
            #[cfg(target_arch = "x86_64")]
            Rows::Bf16(k, _) => scores_in_place(q, s, (d, n), k, &ahead[0]),
            #[cfg(target_arch = "x86_64")]
            Rows::F16(k, _) => scores_in_place(q, s, (d, n), k, &ahead[0]),
        }
        let width = n.next_multiple_of(LANES);
        let mut tile_max = [f32::NEG_INFINITY; LANES];
        for ((row, m), h) in self
            .s
            .chunks_exact_mut(BLOCK)
            .zip(&mut tile_max)
            .zip(at.heads.clone())
        {
            if p.has_score_mods() {
                mods(p, at, h, &mut row[..n]);
            }
            row[n..width].fill(f32::NEG_INFINITY);
            *m = lane_max(&row[..width])
                .into_iter()
                .fold(f32::NEG_INFINITY, f32::max);
        }
        let shift = self.softmax.rescale_rows(tile_max, self.o, dv);
        let mut sums = [0f32; LANES];
        for (r, row) in self
            .s
            .chunks_exact_mut(BLOCK)
            .take(at.heads.len())
            .enumerate()
        {
            sums[r] = exp2_shifted_sum(&mut row[..n], shift[r]);
        }
        self.softmax.add_sums(&sums);
        let (o, s) = (self.o, &*self.s);
        match rows {
            #[cfg(target_arch = "x86_64")]
            Rows::F32(_, v) if level != Level::Panels => {
                values_in_place(o, s, (dv, n), v, &ahead[1])
            }
            Rows::F32(_, v) => values_panels(o, s, (dv, n), v, &ahead[1]),
            #[cfg(target_arch = "x86_64")]
            Rows::Bf16(_, v) => values_in_place(o, s, (dv, n), v, &ahead[1]),
            #[cfg(target_arch = "x86_64")]
            Rows::F16(_, v) => values_in_place(o, s, (dv, n), v, &ahead[1]),
        }
    }
}

/// A block's K and V rows as the kernels read them: f32 (in place, or converted), or, for the
/// AVX-512 and AVX2 kernels, f16 or bf16 in place.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(KeyRows<'a>, KeyRows<'a>),
    #[cfg(target_arch = "x86_64")]
    Bf16(KeyRows<'a, bf16>, KeyRows<'a, bf16>),
    #[cfg(target_arch = "x86_64")]
    F16(KeyRows<'a, f16>, KeyRows<'a, f16>),
}
