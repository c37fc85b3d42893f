//! The sample recording both benches share: criterion times each benchmark through
//! `iter_custom`, and the summaries are computed from what [`timed`] kept.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// What criterion's samples of one benchmark measured.
pub struct Measured {
    /// Wall-clock time per call of each sample.
    pub per_call: Vec<Duration>,
    /// Calls and process CPU seconds over all samples (CPU time when readable).
    calls: u64,
    cpu_seconds: Option<f64>,
}

impl Default for Measured {
    fn default() -> Self {
        Measured {
            per_call: Vec::new(),
            calls: 0,
            cpu_seconds: Some(0.0),
        }
    }
}

pub type Samples = Rc<RefCell<Measured>>;

/// User + system CPU time of this process, all threads, in seconds (Linux only).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which ends at the last ')'); utime and stime are the 14th
    // and 15th fields of the line, in clock ticks of 1/100 s (USER_HZ).
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = rest.get(11)?.parse::<f64>().ok()? + rest.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Times `f` the way criterion asks (`iters` calls) and records the sample.
pub fn timed(samples: &Samples, iters: u64, mut f: impl FnMut()) -> Duration {
    let cpu0 = process_cpu_seconds();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    let elapsed = start.elapsed();
    let cpu = process_cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    let mut m = samples.borrow_mut();
    m.per_call.push(elapsed / iters.max(1) as u32);
    m.calls += iters;
    m.cpu_seconds = m.cpu_seconds.zip(cpu).map(|(total, c)| total + c);
    elapsed
}

/// Rates in billions a second of `amount` per call (FLOPs, bytes): (fastest sample, median
/// sample, CPU time over all rayon threads).
pub fn rates(samples: &Samples, amount: f64) -> (f64, f64, Option<f64>) {
    let m = samples.borrow();
    let mut t: Vec<f64> = m.per_call.iter().map(Duration::as_secs_f64).collect();
    t.sort_by(f64::total_cmp);
    let threads = rayon::current_num_threads() as f64;
    let cpu = m
        .cpu_seconds
        .filter(|&c| c > 0.0)
        .map(|c| amount * m.calls as f64 / (c / threads) / 1e9);
    (amount / t[0] / 1e9, amount / t[t.len() / 2] / 1e9, cpu)
}
