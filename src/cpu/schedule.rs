//! How a call's tasks reach the rayon threads: runs of tasks taken from both ends.
//!
//! `par_iter` over a task list splits it into about as many contiguous runs as there are
//! threads and splits further only where a thread steals, so a thread may be left to finish a
//! run alone while the others wait, and the first thread out of work goes to sleep before the
//! caller is woken. Here the tasks are cut into runs of about equal cost, each taken from an
//! atomic range: a thread takes its own run's tasks from the front (longest first), then the
//! other runs' from the back (their shortest), and a thread that finds no task left spins until
//! the last one has ended, so that its vCPU is awake when the caller is woken (for a bounded
//! time: then it leaves the waiting to rayon, which puts it to sleep). With several
//! threads on one run (`runs` = 1), the run is one queue in the order given.
//!
//! Measured on the 2-vCPU Zen 4 VM (2026-11-24), f32 forward, D=64, 2 threads, `[B, N, H, D]`,
//! interleaved rounds of 10 calls in one process against `par_iter` (median over rounds of the
//! ratio of the rounds' fastest calls; the host's noise is about ±2%):
//! - B=4, H=8, N=1024 (one queue): full 1.018–1.021, causal 1.019–1.023, mean call -2.5%;
//! - B=1, H=8, N=1024 (one queue): 0.995–1.024 over nine runs, mean call -4.4% to +1.3%;
//! - B=1, N=128 and 512, one run a thread: within 1% (one queue there: 10% slower at N=128,
//!   threads alternating between heads);
//! - f16 inputs, N=1024, one run a thread: 1.004–1.015 (one queue: causal 0.97–0.98, every
//!   thread converting every head).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// Spins of a waiting thread before it starts to yield its CPU between checks (about 70 µs on
/// Zen 4, whose `pause` takes some 64 cycles).
const SPINS_BEFORE_YIELD: u32 = 1 << 12;

/// Yields after the spins before a waiting thread stops waiting for the last task: the wait
/// pays only when that task ends soon, and a longer one would keep a CPU busy for nothing.
const YIELDS: u32 = 256;

/// Runs `body` on every task of `tasks` on the current rayon pool and returns once every task
/// has ended; a panic in `body` is passed on, as by rayon.
///
/// The tasks are cut into at most `runs` contiguous runs of about equal total `cost` (1: one
/// queue for all threads). Each thread takes the tasks of a run of its own from the front,
/// then the other runs' from the back; with fewer runs than threads, several threads share a
/// run.
pub(crate) fn for_each_in_runs<T: Sync>(
    tasks: &[T],
    runs: usize,
    cost: impl Fn(&T) -> usize,
    body: impl Fn(&T) + Sync + Send,
) {
    if tasks.is_empty() {
        return;
    }
    // A run's range is packed as two 32-bit halves.
    debug_assert!(u32::try_from(tasks.len()).is_ok());
    let threads = rayon::current_num_threads().min(tasks.len());
    let runs = cut(tasks, runs.min(threads), cost);
    let unfinished = AtomicUsize::new(tasks.len());
    let run_task = |i: usize| {
        // Counted as finished even if `body` panics, so the other threads stop waiting.
        let _finished = Finished(&unfinished);
        body(&tasks[i]);
    };
    (0..threads)
        .into_par_iter()
        .with_max_len(1)
        .for_each(|thread| {
            let own = thread % runs.len();
            while let Some(i) = runs[own].front() {
                run_task(i);
            }
            for other in (1..runs.len()).map(|k| (own + k) % runs.len()) {
                while let Some(i) = runs[other].back() {
                    run_task(i);
                }
            }
            for check in 0..SPINS_BEFORE_YIELD + YIELDS {
                if unfinished.load(Ordering::Acquire) == 0 {
                    break;
                }
                if check < SPINS_BEFORE_YIELD {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        });
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
        // one over it cannot be: tasks of cost 8, 7, …, 1 on two threads (B=1, H=1, N=1024,
        // causal) cut 8, 7, 6 | 5, …, 1 (closest to the share) ran 21 units on one thread
        // against 18; cut 8, 7 | 6, …, 1, the forward ran 1.137× as fast (median over 12
        // interleaved rounds; B=1 with H=2, 3 and N=128, 512 within 1%; 2026-11-24).
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

/// Counts one task as finished when dropped.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
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
        // The other threads still run every other task.
        assert_eq!(ran.load(Ordering::Relaxed), tasks.len());
    }
}
