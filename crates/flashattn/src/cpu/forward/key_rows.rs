//! Where a forward task reads the K and V rows of a key block: in place (f32), or converted or
//! copied into packed f32 rows that a thread keeps for its next task on the same head.

use std::ops::Range;

use crate::cpu::CpuElement;
use crate::cpu::line_buf::LineBuf;
use crate::cpu::prefetch::RowsAhead;
use crate::problem::Problem;

/// K and V rows as f32 when not read in place: rows `packed` of one (call, sequence, kv head),
/// row `j` at `(j − packed.start)·width`, kept from task to task while the thread stays on that
/// head; or, for heads too long to keep, the current key block alone.
#[derive(Default)]
pub(crate) struct PackedKeys {
    k: LineBuf,
    v: LineBuf,
    /// (call, sequence, kv head) whose rows `k` and `v` hold.
    owner: Option<(u64, usize, usize)>,
    packed: Range<usize>,
}

/// Rows `j0..` of K or V, f32 unless a decoding kernel reads them in their own dtype: row
/// `j0 + r` at `data[at + r·stride..]`.
#[derive(Clone, Copy)]
pub(crate) struct KeyRows<'a, E = f32> {
    pub(crate) data: &'a [E],
    pub(crate) at: usize,
    pub(crate) stride: usize,
}

impl<'a, E> KeyRows<'a, E> {
    /// The rows from `r` on.
    pub(crate) fn skip(&self, r: usize) -> &'a [E] {
        &self.data[self.at + r * self.stride..]
    }
}

/// The K and V rows of one (sequence `b`, key/value head `hk`) as a task reads them.
pub(crate) struct KeySource<'a, T> {
    pub p: &'a Problem,
    pub k: &'a [T],
    pub v: &'a [T],
    pub b: usize,
    pub hk: usize,
    /// Read f32 rows in place (else they are copied into packed rows).
    pub in_place: bool,
    /// Keep packed rows for the thread's next task on the same head.
    pub keep: bool,
    /// This call's number, telling its kept rows from another call's.
    pub call: u64,
}

impl<T: CpuElement> KeySource<'_, T> {
    /// K and V rows of the key block `keys` as f32: in place for f32 when `in_place`, converted
    /// or copied into `kv` otherwise, where they stay for the thread's next task on the same
    /// head when `keep`.
    pub(crate) fn block<'s>(
        &'s self,
        kv: &'s mut PackedKeys,
        keys: Range<usize>,
    ) -> (KeyRows<'s>, KeyRows<'s>) {
        let (p, b, hk) = (self.p, self.b, self.hk);
        let (d, dv) = (p.head_dim, p.head_dim_v);
        let in_place = |x: &'s [T], stride, at: usize| {
            T::as_f32_slice(x)
                .filter(|_| self.in_place)
                .map(|data| KeyRows { data, at, stride })
        };
        if let (Some(k), Some(v)) = (
            in_place(self.k, p.k.row, p.k_at(b, keys.start, hk)),
            in_place(self.v, p.v.row, p.v_at(b, keys.start, hk)),
        ) {
            return (k, v);
        }
        let (nk, keep) = (p.seqs[b].nk, self.keep);
        let owner = (self.call, b, hk);
        let fits = keep
            && kv.owner == Some(owner)
            && kv.packed.start <= keys.start
            && keys.start <= kv.packed.end;
        if !fits {
            kv.owner = keep.then_some(owner);
            kv.packed = keys.start..keys.start;
            let rows = if keep { nk - keys.start } else { keys.len() };
            kv.k.resize(rows * d, 0.0);
            kv.v.resize(rows * dv, 0.0);
        }
        let base = kv.packed.start;
        let first = kv.packed.end.max(keys.start);
        // The rows a few keys on, fetched as each row is converted or copied.
        let ahead = |x: &[T], at: usize, stride: usize, width: usize| {
            RowsAhead::ahead_of(x, (at, stride), (keys.end.saturating_sub(first), width))
        };
        let ahead = [
            ahead(self.k, p.k_at(b, first, hk), p.k.row, d),
            ahead(self.v, p.v_at(b, first, hk), p.v.row, dv),
        ];
        for j in first..keys.end {
            ahead[0].fetch(j - first);
            ahead[1].fetch(j - first);
            let (ka, va) = (p.k_at(b, j, hk), p.v_at(b, j, hk));
            let r = j - base;
            T::widen_into(&self.k[ka..ka + d], &mut kv.k[r * d..(r + 1) * d]);
            T::widen_into(&self.v[va..va + dv], &mut kv.v[r * dv..(r + 1) * dv]);
        }
        kv.packed.end = kv.packed.end.max(keys.end);
        let at = keys.start - base;
        (
            KeyRows {
                data: &kv.k,
                at: at * d,
                stride: d,
            },
            KeyRows {
                data: &kv.v,
                at: at * dv,
                stride: dv,
            },
        )
    }
}
