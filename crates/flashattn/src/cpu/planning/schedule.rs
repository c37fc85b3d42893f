//! How a call's tasks reach the threads: runs of tasks taken from both ends.
//!
//! `par_iter` over a task list splits it into about as many contiguous runs as there are
//! threads and splits further only where a thread steals, so a thread may be left to finish a
//! run alone while the others wait. Here the tasks are cut into runs of about equal cost, each
//! taken from an atomic range: a thread takes its own run's tasks from the front (longest
//! first), then the other runs' from the back (their shortest). With several threads on one
//! run (`runs` = 1), the run is one queue in the order given. Measured against `par_iter` in
//! BENCHMARKS.md.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

/// Runs `body` on every task of `tasks` on the current rayon pool, and returns once every task
/// has ended; a panic in `body` is passed on once every task that started has ended.
///
/// The tasks are cut into at most `runs` contiguous runs of about equal total `cost` (1: one
/// queue for all threads). Each thread takes the tasks of a run of its own from the front,
/// then the other runs' from the back; with fewer runs than threads, several threads share a
/// run.
pub(crate) fn for_each_in_runs<T: Sync>(
    tasks: &[T],
    runs: usize,
    cost: impl Fn(&T) -> usize,
    body: impl Fn(&T) + Sync,
) {
    if tasks.is_empty() {
        return;
    }
    // A run's range is packed as two 32-bit halves; a task left out would leave its outputs
    // unwritten, which callers then take as written.
    assert!(
        u32::try_from(tasks.len()).is_ok(),
        "schedule: too many tasks"
    );
    let threads = rayon::current_num_threads().min(tasks.len());
    let runs = cut(tasks, runs.min(threads), cost);
    // One job a thread, each taking tasks until none is left.
    (0..threads)
        .into_par_iter()
        .with_max_len(1)
        .for_each(|thread| {
            let own = thread % runs.len();
            while let Some(i) = runs[own].front() {
                body(&tasks[i]);
            }
            for other in (1..runs.len()).map(|k| (own + k) % runs.len()) {
                while let Some(i) = runs[other].back() {
                    body(&tasks[i]);
                }
            }
        });
}

/// [`for_each_in_runs`] with one queue for all threads, in the order given.
pub(crate) fn for_each_queued<T: Sync>(tasks: &[T], body: impl Fn(&T) + Sync) {
    for_each_in_runs(tasks, 1, |_| 1, body);
}

/// [`for_each_queued`] over tasks that `body` takes by value (holding `&mut` borrows, say):
/// each is moved out of its slot by the one thread that runs it.
pub(crate) fn for_each_owned<T: Send>(tasks: impl IntoIterator<Item = T>, body: impl Fn(T) + Sync) {
    let slots: Vec<Mutex<Option<T>>> = tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
    for_each_queued(&slots, |slot| {
        if let Some(task) = slot.lock().ok().and_then(|mut t| t.take()) {
            body(task);
        }
    });
}

/// Runs `f(i, chunk)` on chunk `i` of `dst` cut into chunks of `chunk` elements (the last
/// may be shorter), each chunk a task of [`for_each_owned`].
pub(crate) fn for_each_chunk<T: Send>(
    dst: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    for_each_owned(dst.chunks_mut(chunk.max(1)).enumerate(), |(i, c)| f(i, c));
}

/// Cuts `tasks` into at most `runs` contiguous, non-empty runs of about equal total cost, none
/// but the last over its share unless by a single task.
fn cut<T>(tasks: &[T], runs: usize, cost: impl Fn(&T) -> usize) -> Vec<Run> {
    let runs = runs.clamp(1, tasks.len().max(1));
    let costs: Vec<usize> = tasks.iter().map(|t| cost(t).max(1)).collect();
    let total: u128 = costs.iter().map(|&c| c as u128).sum();
    let mut bounds = vec![0];
    let mut sum = 0u128;
    for (i, &c) in costs.iter().enumerate() {
        let r = bounds.len();
        let share = total * r as u128 / runs as u128;
        // Cut before task i when the run would pass its share with it (a run keeps at least
        // one task). The owner takes its run's longest tasks first and the other threads the
        // shortest from the back, so a run short of its share is topped up at the end, while
        // one over it cannot be (costs 8, 7, …, 1 on two threads cut 8, 7 | 6, …, 1).
        if r < runs && sum + c as u128 > share && i > bounds[r - 1] {
            bounds.push(i);
        }
        sum += c as u128;
    }
    bounds.push(tasks.len());
    bounds.windows(2).map(|w| Run::new(w[0], w[1])).collect()
}

/// The tasks `lo..hi` still to run of one run, taken from either end (both packed in one word,
/// so that a take is one compare-and-swap).
struct Run(AtomicU64);

impl Run {
    fn new(lo: usize, hi: usize) -> Self {
        Run(AtomicU64::new(Self::pack(lo, hi)))
    }

    fn pack(lo: usize, hi: usize) -> u64 {
        (hi as u64) << 32 | lo as u64
    }

    fn take(&self, front: bool) -> Option<usize> {
        let mut now = self.0.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = ((now & 0xffff_ffff) as usize, (now >> 32) as usize);
            if lo >= hi {
                return None;
            }
            let (next, task) = if front {
                (Self::pack(lo + 1, hi), lo)
            } else {
                (Self::pack(lo, hi - 1), hi - 1)
            };
            match self
                .0
                .compare_exchange_weak(now, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(task),
                Err(seen) => now = seen,
            }
        }
    }

    fn front(&self) -> Option<usize> {
        self.take(true)
    }

    fn back(&self) -> Option<usize> {
        self.take(false)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn every_task_runs_once() {
        for (n, runs) in [0, 1, 2, 3, 17, 100]
            .into_iter()
            .flat_map(|n| (1..4).map(move |r| (n, r)))
        {
            let tasks: Vec<usize> = (0..n).collect();
            let ran: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each_in_runs(
                &tasks,
                runs,
                |&t| t % 7,
                |&t| {
                    ran[t].fetch_add(1, Ordering::Relaxed);
                },
            );
            let once = ran.iter().all(|r| r.load(Ordering::Relaxed) == 1);
            assert!(once, "n = {n}, runs = {runs}");
        }
    }

    #[test]
    fn runs_are_contiguous_and_about_equal() {
        let bounds = |costs: &[usize], runs: usize| -> Vec<(usize, usize)> {
            cut(costs, runs, |&c| c)
                .iter()
                .map(|r| {
                    let w = r.0.load(Ordering::Relaxed);
                    ((w & 0xffff_ffff) as usize, (w >> 32) as usize)
                })
                .collect()
        };
        assert_eq!(bounds(&[8, 7, 6, 5, 4, 3, 2, 1], 2), [(0, 2), (2, 8)]);
        assert_eq!(bounds(&[3, 3, 3, 3, 3, 3], 3), [(0, 2), (2, 4), (4, 6)]);
        assert_eq!(bounds(&[1; 8], 4), [(0, 2), (2, 4), (4, 6), (6, 8)]);
        assert_eq!(bounds(&[100, 1, 1], 3), [(0, 1), (1, 2), (2, 3)]);
        assert_eq!(bounds(&[5, 5], 4), [(0, 1), (1, 2)]);
        assert_eq!(bounds(&[0, 0, 0], 2), [(0, 1), (1, 3)]);
    }

    #[test]
    fn one_thread_runs_the_tasks_in_the_order_given() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let tasks: Vec<usize> = (0..20).rev().collect();
        let order = std::sync::Mutex::new(Vec::new());
        pool.install(|| for_each_in_runs(&tasks, 2, |_| 1, |&t| order.lock().unwrap().push(t)));
        assert_eq!(order.into_inner().unwrap(), tasks);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let tasks: Vec<usize> = (0..32).collect();
        let ran = AtomicUsize::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                for_each_in_runs(
                    &tasks,
                    2,
                    |_| 1,
                    |&t| {
                        ran.fetch_add(1, Ordering::Relaxed);
                        assert_ne!(t, 5, "task 5 fails");
                    },
                )
            })
        }));
        assert!(result.is_err());
        // The thread that met the panic takes no more tasks; the others may go on.
        assert!((6..=tasks.len()).contains(&ran.load(Ordering::Relaxed)));
    }
}
