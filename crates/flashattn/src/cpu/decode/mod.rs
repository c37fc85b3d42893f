//! Decoding steps (at most one query per sequence): the query heads of one key/value group are
//! the rows of a matrix-vector product against the group's K and V, read once.
//!
//! The forward's panels make the lanes queries, so a single query fills 1 of 16 lanes, or, with
//! the group's heads as lanes, as many as the group has heads (4 of 16 for 32 query heads on 8
//! key/value heads): most of the multiply-adds go to empty lanes. Here the lanes run along the
//! keys or the value dims instead. Per block of 64 keys:
//!
//! ```text
//! S  = Q · Kᵀ              heads × keys    AVX-512 and AVX2: dot products of K's rows in
//!                                          place, 16 (8) at a time, reduced by a shuffle
//!                                          tree (`avx512`, `avx2`); otherwise K transposed
//!                                          into panels of 16 keys and the panel
//!                                          microkernel, heads as its rows (`kernels`)
//!      (softcap, ALiBi, bias)
//! m  = online softmax      per head        rescales the rows of O when a maximum moves
//! O += P · V               heads × dv      value dims as lanes, V rows in place
//! ```
//!
//! The AVX-512 and AVX2 kernels read f16 and bf16 rows in place, widening them as they load.
//!
//! The kernels fetch into L2 the K and V rows of the (block, group) pass after next, one row
//! for each row they read, so that memory streams at the pace the rows are used. With the rows
//! of all key/value heads of a key side by side (`[B, N, H, D]`, a cache appended to in place),
//! a task takes every group of its sequence, block by block, so that the groups read each block
//! as one run of memory; with each head's rows apart (`[B, H, N, D]`), one group. When that
//! leaves threads idle, the keys are split into runs whose partial results are combined after
//! (the split-K of flash-decoding). A group of more than 16 heads runs in parts of 16, each with
//! its own softmax state (16 lanes). Softcap, ALiBi and a bias apply to each head's row of
//! scores. Value dims that are not a multiple of 16 are padded: `O`'s rows are whole vectors,
//! and V's block is copied into such rows.
//!
//! The in-place kernels run a decoding step about twice as fast as the panel microkernel with
//! a group's heads as lanes, and three times as fast on f16/bf16 rows (see BENCHMARKS.md).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kernels;
mod step;

#[cfg(target_arch = "x86_64")]
pub(crate) use kernels::Level;

use std::cell::RefCell;
use std::ops::Range;

use crate::cpu::planning::schedule::for_each_queued;

use crate::cpu::CpuElement;
use crate::cpu::forward::Inputs;
use crate::cpu::online_softmax::inverse_sum;
use crate::cpu::simd::exp::{LANES, exp2};
use crate::cpu::simd::lanes::lane_lse;
use crate::cpu::{SharedOut, with_thread_scratch};
use crate::problem::Problem;
use step::{Scratch, Step};

/// Keys per block: the block's scores stay in L1 beside the rows being multiplied (and `Kᵀ`,
/// `64 × d` f32, 32 KiB at d = 128, for the panel kernels).
const BLOCK: usize = 64;

/// Fewest keys a task takes when a sequence's keys are split between tasks, so that a run's
/// partial result (`dv + 2` floats a head) stays small beside the K and V rows it reads.
const MIN_SPLIT: usize = 1024;

/// True when the forward runs as decoding steps here ([`run`]).
pub(crate) fn applies(p: &Problem) -> bool {
    p.max_nq <= 1
}

thread_local! {
    /// Each thread's buffers for decoding steps, kept from call to call.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// What one task computes: sequence `b`, key/value heads `groups`, keys `keys`; with `slot`,
/// a run of a split sequence, whose partial results go to slots `slot..slot + groups.len()`.
struct Task {
    b: usize,
    groups: Range<usize>,
    keys: Range<usize>,
    slot: Option<usize>,
}

/// The forward of a decoding step ([`applies`]).
pub(crate) fn run<T: CpuElement>(
    p: &Problem,
    x: &Inputs<'_, T>,
    out: SharedOut<'_, T>,
    lse: SharedOut<'_, f32>,
) {
    let (g, dv) = (p.group(), p.head_dim_v);
    let interleaved = p.k.head < p.k.row && p.v.head < p.v.row;
    let spans: Vec<Task> = (0..p.batch)
        .filter(|&b| p.seqs[b].nq > 0)
        .flat_map(|b| {
            let keys = p.mask(b).key_range_for_rows(0..1);
            // One task for every group, or one a group.
            let width = if interleaved { p.heads_kv } else { 1 };
            let groups = (0..p.heads_kv).step_by(width).map(move |h| h..h + width);
            groups.map(move |groups| Task {
                b,
                groups,
                keys: keys.clone(),
                slot: None,
            })
        })
        .collect();
    // Fewer than four tasks a thread: split the keys, into runs of about a quarter of a
    // thread's share of the work.
    let threads = rayon::current_num_threads();
    let work = |t: &Task| t.keys.len() * t.groups.len();
    let share = spans.iter().map(work).sum::<usize>().div_ceil(4 * threads);
    let enough = spans.len() >= 4 * threads;
    let mut tasks = Vec::new();
    // (sequence, key/value head, the slots of its runs' partial results).
    let mut split: Vec<(usize, usize, Vec<usize>)> = Vec::new();
    let mut slots = 0;
    for span in spans {
        let run_keys = (share / span.groups.len()).max(MIN_SPLIT);
        let runs = span.keys.len().div_ceil(run_keys);
        if enough || runs <= 1 {
            tasks.push(span);
            continue;
        }
        let step = span.keys.len().div_ceil(runs);
        let first = split.len();
        split.extend(span.groups.clone().map(|hk| (span.b, hk, Vec::new())));
        for k0 in span.keys.clone().step_by(step) {
            for (i, entry) in split[first..].iter_mut().enumerate() {
                entry.2.push(slots + i);
            }
            tasks.push(Task {
                keys: k0..(k0 + step).min(span.keys.end),
                groups: span.groups.clone(),
                slot: Some(slots),
                ..span
            });
            slots += span.groups.len();
        }
    }
    // A group's partial result: for each of its g heads, the row of dv, its maximum and sum.
    let part = g * (dv + 2);
    let mut partials = vec![0f32; slots * part];
    {
        let shared = SharedOut::new(&mut partials, Default::default());
        for_each_queued(&tasks, |task| {
            let step = Step {
                p,
                x,
                b: task.b,
                groups: task.groups.clone(),
                keys: task.keys.clone(),
            };
            with_thread_scratch(&SCRATCH, |sc| {
                step.run(sc);
                let Some(slot) = task.slot else {
                    return step.write(sc, &out, &lse);
                };
                for (h, at, max, sum) in step.heads(sc) {
                    let at_part = slot * part + (h - task.groups.start * g) * (dv + 2);
                    // SAFETY: the task's slots of the partials belong to it alone.
                    unsafe {
                        shared.write_row(at_part, sc.o[at..at + dv].iter().copied());
                        shared.write_row(at_part + dv, [max, sum].into_iter());
                    }
                }
            });
        });
    }
    for_each_queued(&split, |(b, hk, runs)| {
        let runs: Vec<&[f32]> = runs
            .iter()
            .map(|&i| &partials[i * part..(i + 1) * part])
            .collect();
        combine(p, (*b, hk * g), &runs, &out, &lse);
    });
}

/// Writes the output rows and log-sum-exps of heads `h..h + group` of sequence `b` from the
/// partial results of runs of its keys (see [`run`]).
fn combine<T: CpuElement>(
    p: &Problem,
    (b, h): (usize, usize),
    runs: &[&[f32]],
    out: &SharedOut<'_, T>,
    lse: &SharedOut<'_, f32>,
) {
    let (g, dv) = (p.group(), p.head_dim_v);
    let mut o = vec![0f32; dv];
    for r in 0..g {
        let head = |run: &[f32]| -> (f32, f32) {
            let at = r * (dv + 2) + dv;
            (run[at], run[at + 1])
        };
        let max = runs
            .iter()
            .map(|run| head(run).0)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        o.fill(0.0);
        for run in runs {
            let (m, s) = head(run);
            // A run that saw no key (a NaN sum goes on, and makes the head's NaN).
            if s == 0.0 {
                continue;
            }
            let f = exp2(m - max);
            sum += f * s;
            for (a, x) in o.iter_mut().zip(&run[r * (dv + 2)..r * (dv + 2) + dv]) {
                *a += f * x;
            }
        }
        write_head(p, (out, lse), (b, h + r), &o, (max, sum));
    }
}

/// Writes head `h` of sequence `b`: its output row (`o` divided by `sum`; 0 where no key was
/// seen, even where `o` took 0 · NaN from a NaN in V) and its log-sum-exp from the base-2
/// `max` and `sum`.
fn write_head<T: CpuElement>(
    p: &Problem,
    (out, lse): (&SharedOut<'_, T>, &SharedOut<'_, f32>),
    (b, h): (usize, usize),
    o: &[f32],
    (max, sum): (f32, f32),
) {
    let (mut m16, mut s16) = ([f32::NEG_INFINITY; LANES], [0f32; LANES]);
    (m16[0], s16[0]) = (max, sum);
    let inv = inverse_sum(sum);
    let zeros;
    let o = if sum == 0.0 {
        zeros = vec![0f32; o.len()];
        &zeros
    } else {
        o
    };
    // SAFETY: out[b, 0, h, ..] and lse[b, h, 0] belong to the caller's task alone (a task's
    // heads, or a split group's combination).
    unsafe {
        out.write_f32_row(p.query_at(&out.layout, b, 0, h), o, inv);
        lse.write_row(p.lse_at(b, h, 0), std::iter::once(lane_lse(&m16, &s16)[0]));
    }
}
