//! The standard attention's memory estimate against what it really allocates (a counting
//! allocator): it does materialize the score matrices, and the estimate the benchmarks use to
//! skip it is not below the measured peak.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flashattn::internals::Problem;
use flashattn::reference::standard;
use flashattn::{AttentionParams, Tensor};

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's layout; the counters are
// only statistics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Peak bytes allocated by `f` beyond what was live before it, minus what it returns.
fn peak_extra<R>(f: impl FnOnce() -> R, returned: impl Fn(&R) -> usize) -> usize {
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let r = f();
    PEAK.load(Ordering::SeqCst) - before - returned(&r)
}

#[test]
fn estimates_cover_the_measured_peak() {
    let (b, n, h, hk, d) = (2, 384, 4, 2, 64);
    let data = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let q = Tensor::from_vec(data(b * n * h * d, 1), &[b, n, h, d]).unwrap();
    let k = Tensor::from_vec(data(b * n * hk * d, 2), &[b, n, hk, d]).unwrap();
    let v = Tensor::from_vec(data(b * n * hk * d, 3), &[b, n, hk, d]).unwrap();
    let dout = Tensor::from_vec(data(b * n * h * d, 4), &[b, n, h, d]).unwrap();
    for params in [
        AttentionParams::default(),
        AttentionParams::default().causal(),
    ] {
        let problem = Problem::new(&q, &k, &v, &params).unwrap();
        let scores = b * h * n * n * 4;
        let f = standard::forward(&q, &k, &v, &params).unwrap();
        let out_bytes = |o: &flashattn::ForwardOutput| (o.out.numel() + o.lse.numel()) * 4;
        let fwd = peak_extra(
            || standard::forward(&q, &k, &v, &params).unwrap(),
            out_bytes,
        );
        let fwd_est = standard::forward_extra_memory_bytes(&problem);
        let grad_bytes =
            |g: &flashattn::Gradients| (g.dq.numel() + g.dk.numel() + g.dv.numel()) * 4;
        let bwd = peak_extra(
            || standard::backward(&q, &k, &v, &f.out, &f.lse, &dout, &params).unwrap(),
            grad_bytes,
        );
        let bwd_est = standard::backward_extra_memory_bytes(&problem);
        println!(
            "causal={}: forward peak extra {fwd} B (estimate {fwd_est}, scores {scores}); backward {bwd} B (estimate {bwd_est})",
            params.is_masked()
        );
        assert!(fwd >= scores, "the forward materializes the scores");
        assert!(bwd >= 2 * scores, "the backward materializes P and dS");
        assert!(
            fwd <= fwd_est,
            "forward estimate {fwd_est} below the peak {fwd}"
        );
        assert!(
            bwd <= bwd_est,
            "backward estimate {bwd_est} below the peak {bwd}"
        );
    }
}
