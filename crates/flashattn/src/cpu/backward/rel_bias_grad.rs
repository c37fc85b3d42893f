//! The relative-position table's gradient of the CPU backward: each entry sums `dS` over the
//! (query, key) pairs that read it.
//!
//! A task sums its tiles into its thread's [`RelFold`] (one row a query head of the task), then
//! stores those rows in its own slot of [`RelGrad`]; the slots are added up in a fixed order
//! at the end, so the result does not depend on which thread finished first.

use std::ops::Range;
use std::sync::Mutex;

use crate::cpu::score_mods::fold_rel_run;
use crate::problem::Problem;

/// Per-thread sums of one task: `heads × width` (width `2L − 1`).
#[derive(Default)]
pub(crate) struct RelFold {
    sums: Vec<f32>,
    width: usize,
}

impl RelFold {
    /// Zeroed rows for a task of `heads` query heads.
    pub(crate) fn start(&mut self, heads: usize, width: usize) {
        self.sums.clear();
        self.sums.resize(heads * width, 0.0);
        self.width = width;
    }

    /// Adds the `rows × keys` tile `ds` (row-major with row stride `ld`) of the task's query
    /// head number `head`, whose query `i` has its diagonal at key `i + diag`.
    pub(crate) fn add_tile(
        &mut self,
        head: usize,
        (ds, ld): (&[f32], usize),
        (rows, keys): (Range<usize>, Range<usize>),
        diag: i64,
    ) {
        let acc = &mut self.sums[head * self.width..(head + 1) * self.width];
        for (r, i) in rows.enumerate() {
            let row = &ds[r * ld..r * ld + keys.len()];
            fold_rel_run(acc, row, keys.start as i64 - (i as i64 + diag));
        }
    }

    /// The bytes it holds (its capacity).
    pub(crate) fn bytes(&self) -> usize {
        self.sums.capacity() * size_of::<f32>()
    }
}

/// The tasks' sums, one slot per (key chunk, sequence, query head): `[chunk][b][h][width]`.
pub(crate) struct RelGrad {
    slots: Mutex<Vec<f32>>,
    batch: usize,
    heads: usize,
    width: usize,
}

impl RelGrad {
    /// Zeroed slots for `p`'s table over `chunks` chunks of key blocks.
    pub(crate) fn new(p: &Problem, width: usize, chunks: usize) -> Self {
        RelGrad {
            slots: Mutex::new(vec![0.0; chunks * p.batch * p.heads_q * width]),
            batch: p.batch,
            heads: p.heads_q,
            width,
        }
    }

    /// Stores the sums of the task of sequence `b`, key chunk `chunk`, query heads `heads`.
    pub(crate) fn store(&self, fold: &RelFold, b: usize, chunk: usize, heads: Range<usize>) {
        let at = ((chunk * self.batch + b) * self.heads + heads.start) * self.width;
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[at..at + heads.len() * self.width].copy_from_slice(&fold.sums);
    }

    /// Adds the slots into `out` (`[heads, width]`, zeroed), chunk by chunk and sequence by
    /// sequence.
    pub(crate) fn finish(self, out: &mut [f32]) {
        let slots = self.slots.into_inner().unwrap_or_else(|e| e.into_inner());
        let per = self.heads * self.width;
        for slot in slots.chunks_exact(per) {
            out.iter_mut().zip(slot).for_each(|(o, x)| *o += x);
        }
    }
}
