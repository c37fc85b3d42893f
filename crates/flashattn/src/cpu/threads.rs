//! Fork-join on the calling thread: the caller starts on the work at once and rayon's threads
//! join it as they come.
//!
//! A parallel iterator started from outside the pool injects its jobs, wakes the pool's
//! threads and puts the caller to sleep until the last job ends, so that every call pays a
//! wake-up at both ends (tens of µs each on a VM) and the caller's core idles meanwhile. Here
//! the caller runs worker 0 itself and hands workers `1..threads` to the pool as jobs that
//! only join while there is work: one that starts after the caller has finished returns
//! without touching it, and the caller never waits for one to start, only for those inside to
//! leave. So the workers' functions must share the work among themselves (take tasks from a
//! common queue): any of them may find it all done, and worker 0 alone may have to do it all.
//!
//! A pool that has gone to sleep wakes its thread onto the caller's own CPU as often as not
//! (the scheduler places a woken thread near its waker), where it cannot run while the caller
//! works. So the caller first waits [`ENTRY_WAIT`] for a worker to enter; if none has, it closes
//! the gate and hands every worker to the pool as a parallel iterator would, sleeping
//! meanwhile.
//!
//! Measured on the 2-vCPU Zen 4 VM (2026-11-25), f32, H=8, D=64, causal, 2 threads, median
//! call over 5 × 100 calls in one process, against a parallel iterator, back to back / 1 ms
//! apart: forward B=1, N=64 60 → 40 µs / 121 → 88 µs; N=256 416 → 391 µs / 531 → 464 µs;
//! backward N=128 368 → 327 µs / 810 → 480 µs; N=1024 within the noise (±1%). Without the
//! wait, 1 ms apart: N=256 545 → 745 µs, the woken thread on the caller's CPU in 25-65% of the
//! calls.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// Set in [`Gate::state`] once the caller has finished: no worker enters after it.
const CLOSED: usize = 1;
/// Set in [`Gate::state`] by the first worker to enter, and kept.
const ENTERED: usize = 2;
/// What one worker inside adds to [`Gate::state`] (the count above the two flags).
const INSIDE: usize = 4;

/// How the caller waits for the workers inside to leave: spins (about 70 µs on Zen 4, whose
/// `pause` takes some 64 cycles), then yields of its CPU, then naps: a worker inside is
/// finishing a task, which seldom takes long once the caller has run out of them.
const SPINS_BEFORE_YIELD: u32 = 1 << 12;
const YIELDS_BEFORE_NAPS: u32 = 256;
const NAP: Duration = Duration::from_micros(50);

/// How long the caller waits for a first worker to enter before it leaves the work to the pool
/// (workers awake enter within a few µs; see the module's doc). 6, 12, 20, 30 and 60 µs were
/// measured: 12 was best or within 2% of the best in every case.
const ENTRY_WAIT: Duration = Duration::from_micros(12);

/// Runs `worker(t)` for `t` in `0..threads`, each at most once: 0 on the calling thread, the
/// others on the current rayon pool if they start before worker 0 returns (see the module's
/// doc). If no worker has entered after [`ENTRY_WAIT`], all of them, 0 included, run on the pool
/// instead, as a parallel iterator's jobs. Returns once worker 0 has returned and every other
/// worker has either returned or will never run; a panic in any of them is passed on to the
/// caller after that.
pub(crate) fn on_threads(threads: usize, worker: impl Fn(usize) + Sync) {
    if threads <= 1 {
        return worker(0);
    }
    let worker: &(dyn Fn(usize) + Sync) = &worker;
    let work: *const (dyn Fn(usize) + Sync + '_) = worker;
    // SAFETY: only the lifetime of the pointee's type is erased; the pointer is dereferenced
    // only while the worker is counted inside the gate (see `WorkPtr`).
    let work: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(work) };
    let gate = Arc::new(Gate {
        state: AtomicUsize::new(0),
        work: WorkPtr(work),
        panic: Mutex::new(None),
    });
    let closing = Closing(&gate);
    for t in 1..threads {
        let gate = Arc::clone(&gate);
        rayon::spawn(move || gate.run(t));
    }
    let start = Instant::now();
    while gate.state.load(Ordering::Acquire) & ENTERED == 0 {
        if start.elapsed() >= ENTRY_WAIT {
            let asleep = gate
                .state
                .compare_exchange(0, CLOSED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if asleep {
                drop(closing);
                return (0..threads)
                    .into_par_iter()
                    .with_max_len(1)
                    .for_each(worker);
            }
            break;
        }
        std::hint::spin_loop();
    }
    let own = catch_unwind(AssertUnwindSafe(|| worker(0)));
    drop(closing);
    if let Err(payload) = own {
        resume_unwind(payload);
    }
    let other = gate.panic.lock().map_or(None, |mut p| p.take());
    if let Some(payload) = other {
        resume_unwind(payload);
    }
}

/// What the caller shares with the workers it hands to the pool.
struct Gate {
    /// [`CLOSED`] once the caller has finished, [`ENTERED`] once a worker has entered, plus
    /// [`INSIDE`] for each worker running.
    state: AtomicUsize,
    work: WorkPtr,
    /// The first panic of a worker on the pool, for the caller to pass on.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The workers' function. It lives on the caller's stack, which [`on_threads`] leaves (returning
/// or unwinding) only after the gate is closed and no worker is inside ([`Closing`]); a worker
/// dereferences it only once counted inside an open gate.
struct WorkPtr(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync` (shared by reference between threads); when it may be
// dereferenced is the gate's protocol above.
unsafe impl Send for WorkPtr {}
// SAFETY: as above.
unsafe impl Sync for WorkPtr {}

impl Gate {
    /// Worker `t` on a pool thread: enters unless the gate is closed, runs, leaves.
    fn run(&self, t: usize) {
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            if state & CLOSED != 0 {
                return;
            }
            match self.state.compare_exchange_weak(
                state,
                (state | ENTERED) + INSIDE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        // SAFETY: counted inside an open gate, so the caller is still in `on_threads` (see
        // `WorkPtr`).
        let work = unsafe { &*self.work.0 };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| work(t)))
            && let Ok(mut first) = self.panic.lock()
        {
            first.get_or_insert(payload);
        }
        self.state.fetch_sub(INSIDE, Ordering::Release);
    }
}

/// Closes the gate when dropped and waits until no worker is inside, however the caller's
/// own share ended.
struct Closing<'a>(&'a Gate);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        let state = &self.0.state;
        state.fetch_or(CLOSED, Ordering::AcqRel);
        let mut checks = 0u32;
        while state.load(Ordering::Acquire) >= INSIDE {
            checks = checks.saturating_add(1);
            if checks < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else if checks < SPINS_BEFORE_YIELD + YIELDS_BEFORE_NAPS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_runs_at_most_once_and_worker_0_once() {
        // One thread: the caller is the pool, so the others can only come through the fallback.
        for pool_threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(pool_threads)
                .build()
                .unwrap();
            for threads in [1, 2, 3, 5] {
                let ran: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    on_threads(threads, |t| {
                        ran[t].fetch_add(1, Ordering::Relaxed);
                    })
                });
                assert_eq!(ran[0].load(Ordering::Relaxed), 1);
                assert!(ran.iter().all(|r| r.load(Ordering::Relaxed) <= 1));
            }
        }
    }

    #[test]
    fn workers_share_a_queue_from_outside_the_pool() {
        let next = AtomicUsize::new(0);
        let done: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        on_threads(4, |_| {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(d) = done.get(i) else { break };
                d.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_closed_gate_runs_nothing_and_an_open_one_counts_its_workers_out() {
        let ran = AtomicUsize::new(0);
        let worker = |t: usize| {
            ran.fetch_add(t, Ordering::Relaxed);
        };
        let work: *const (dyn Fn(usize) + Sync + '_) = &worker;
        // SAFETY: as in `on_threads`; `worker` outlives the gate's every use below.
        let work: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(work) };
        let gate = Gate {
            state: AtomicUsize::new(0),
            work: WorkPtr(work),
            panic: Mutex::new(None),
        };
        gate.run(3);
        assert_eq!(gate.state.load(Ordering::Relaxed), ENTERED);
        drop(Closing(&gate));
        gate.run(5);
        assert_eq!(ran.load(Ordering::Relaxed), 3);
        assert_eq!(gate.state.load(Ordering::Relaxed), CLOSED | ENTERED);
    }

    #[test]
    fn a_panic_in_any_worker_reaches_the_caller() {
        let own = catch_unwind(|| on_threads(2, |t| assert_ne!(t, 0, "worker 0 fails")));
        assert!(own.is_err());
        let entered = std::sync::atomic::AtomicBool::new(false);
        let other = catch_unwind(AssertUnwindSafe(|| {
            on_threads(2, |t| {
                if t == 1 {
                    entered.store(true, Ordering::Release);
                    panic!("worker 1 fails");
                }
                // Worker 0 waits for worker 1 to enter (a pool thread wakes within seconds).
                let start = std::time::Instant::now();
                while !entered.load(Ordering::Acquire) && start.elapsed().as_secs() < 20 {
                    std::thread::yield_now();
                }
            })
        }));
        assert!(entered.load(Ordering::Acquire));
        assert!(other.is_err());
    }
}
