//! Where the CPU forward's time goes, per kind of task (cargo feature `profile`): each task's
//! TSC cycles (nanoseconds off x86-64), and those of its query packing, K/V copying and output
//! writing, summed over the calls of a process by (sequence lengths, mask, query rows) and
//! reported per (query, key) pair that the mask lets the task see (a decoding step, which runs
//! no tasks, is not counted). Tasks of the same rows under two masks (full and
//! causal) are told apart, so one `flashattn bench` run times both side by side.
//!
//! Without the feature the clock is an empty type and the report `None`: nothing is timed.
//!
//! ```text
//! cargo run --release --features profile -- bench --seqlens 1024 --pass forward --gemm
//! ```

/// The timed parts of a forward task; the rest of its cycles are the products, the softmax and
/// the bookkeeping around them.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Section {
    /// Packing the `Qᵀ` panels.
    Queries = 0,
    /// Copying or converting K and V rows.
    Keys = 1,
    /// Writing the output rows and log-sum-exps.
    Output = 2,
}

pub(crate) use imp::TaskClock;
pub use imp::report;

#[cfg(feature = "profile")]
mod imp {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    use std::ops::Range;
    use std::sync::Mutex;

    use super::Section;
    use crate::mask::{Mask, Window};

    /// (queries, keys, window's left and right, first row, end row) of a kind of task.
    type Kind = (usize, usize, Option<usize>, Option<usize>, usize, usize);

    #[derive(Default)]
    struct Sums {
        tasks: u64,
        pairs: u64,
        total: u64,
        sections: [u64; 3],
    }

    impl Sums {
        fn add(&mut self, other: &Sums) {
            self.tasks += other.tasks;
            self.pairs += other.pairs;
            self.total += other.total;
            for (sum, x) in self.sections.iter_mut().zip(other.sections) {
                *sum += x;
            }
        }
    }

    static TASKS: Mutex<BTreeMap<Kind, Sums>> = Mutex::new(BTreeMap::new());

    /// One line of the report: a (sequence, mask), the rows of its tasks, their sums.
    fn line(
        out: &mut String,
        seq: (usize, usize, Option<usize>, Option<usize>),
        rows: &str,
        s: &Sums,
    ) {
        let (nq, nk, left, right) = seq;
        let per = |x: u64| x as f64 / s.pairs.max(1) as f64;
        let side = |x: Option<usize>| x.map_or("∞".to_string(), |v| v.to_string());
        let rest = s.total.saturating_sub(s.sections.iter().sum());
        let _ = writeln!(
            out,
            "{nq:>6} {nk:>5}  ({:>4},{:>4})  {rows:>10} {:>7} {:>7.2} {:>6.2} {:>6.2} {:>6.2} {:>6.2}",
            side(left),
            side(right),
            s.tasks,
            per(s.total),
            per(s.sections[0]),
            per(s.sections[1]),
            per(s.sections[2]),
            per(rest),
        );
    }

    /// TSC cycles on x86-64; elsewhere nanoseconds since the first call.
    fn now() -> u64 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: RDTSC reads a counter; every x86-64 CPU has it.
        return unsafe { std::arch::x86_64::_rdtsc() };
        #[cfg(not(target_arch = "x86_64"))]
        {
            static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
            START
                .get_or_init(std::time::Instant::now)
                .elapsed()
                .as_nanos() as u64
        }
    }

    /// One task's cycles, added to its kind's sums when dropped.
    pub(crate) struct TaskClock {
        kind: Kind,
        pairs: u64,
        start: u64,
        sections: [u64; 3],
    }

    impl TaskClock {
        /// The clock of a task on `rows` of a sequence of `nq` queries and `nk` keys under
        /// `window`, resolved as `mask`.
        pub(crate) fn start(
            (nq, nk, window): (usize, usize, Window),
            mask: &Mask,
            rows: Range<usize>,
        ) -> TaskClock {
            let pairs = rows.clone().map(|i| mask.key_range(i).len() as u64).sum();
            TaskClock {
                kind: (nq, nk, window.left, window.right, rows.start, rows.end),
                pairs,
                start: now(),
                sections: [0; 3],
            }
        }

        /// Runs `f`, counting its cycles to `section`.
        pub(crate) fn time<R>(&mut self, section: Section, f: impl FnOnce() -> R) -> R {
            let t = now();
            let r = f();
            self.sections[section as usize] += now() - t;
            r
        }
    }

    impl Drop for TaskClock {
        fn drop(&mut self) {
            let total = now() - self.start;
            let mut tasks = TASKS.lock().unwrap_or_else(|e| e.into_inner());
            tasks.entry(self.kind).or_default().add(&Sums {
                tasks: 1,
                pairs: self.pairs,
                total,
                sections: self.sections,
            });
        }
    }

    /// The CPU forward's cycle profile (the `profile` feature): a table of this process's
    /// forward tasks so far, one line per kind and one per (sequence, mask), or `None` when no
    /// task ran.
    pub fn report() -> Option<String> {
        let tasks = TASKS.lock().unwrap_or_else(|e| e.into_inner());
        if tasks.is_empty() {
            return None;
        }
        let mut out = String::from(
            "forward tasks, TSC cycles per visible (query, key) pair (q: packing Qᵀ, kv: K/V \
             rows, o: output rows; rest: products, softmax, bookkeeping):\n\
             \x20   nq    nk  window      rows       tasks   total      q     kv      o   rest\n",
        );
        // Each kind's line, and after the kinds of one (sequence, mask) their sums.
        let mut all = Sums::default();
        let mut kinds = tasks.iter().peekable();
        while let Some((&(nq, nk, left, right, r0, r1), s)) = kinds.next() {
            line(&mut out, (nq, nk, left, right), &format!("{r0}-{r1}"), s);
            all.add(s);
            let same = |k: &Kind| (k.0, k.1, k.2, k.3) == (nq, nk, left, right);
            if !kinds.peek().is_some_and(|(k, _)| same(k)) {
                line(&mut out, (nq, nk, left, right), "all", &all);
                all = Sums::default();
            }
        }
        Some(out)
    }
}

#[cfg(not(feature = "profile"))]
mod imp {
    use std::ops::Range;

    use super::Section;
    use crate::mask::{Mask, Window};

    /// Times nothing (built without the `profile` feature).
    pub(crate) struct TaskClock;

    impl TaskClock {
        #[inline(always)]
        pub(crate) fn start(_: (usize, usize, Window), _: &Mask, _: Range<usize>) -> TaskClock {
            TaskClock
        }

        #[inline(always)]
        pub(crate) fn time<R>(&mut self, _: Section, f: impl FnOnce() -> R) -> R {
            f()
        }
    }

    /// The CPU forward's cycle profile: always `None` in this build, which times nothing (built
    /// with the `profile` feature, a table of the forward's tasks).
    pub fn report() -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::{Mask, Window};

    #[test]
    fn a_clock_runs_what_it_times() {
        let mask = Mask::new(Window::CAUSAL, 64, 64);
        {
            let mut clock = TaskClock::start((64, 64, Window::CAUSAL), &mask, 0..16);
            assert_eq!(clock.time(Section::Keys, || 41 + 1), 42);
        }
        #[cfg(feature = "profile")]
        assert!(report().is_some_and(|r| r.contains("0-16")));
        #[cfg(not(feature = "profile"))]
        assert!(report().is_none());
    }
}
