//! The CPU forward's extra memory at N = 32768 (f32, B=1, H=8, D=64): a counting global
//! allocator records the peak of live heap bytes while the forward runs, and the test asserts
//! that the peak beyond the inputs and the outputs stays under 64 MiB. The standard attention
//! would hold the scores, 8 · 32768² · 4 bytes = 32 GiB.
//!
//! A sliding window keeps the run short. The peak does not depend on the mask: the forward's
//! scratch is one set of tiles per worker thread, sized by the head dims alone, and its task
//! list depends only on the sequence lengths and heads; the mask only decides which key blocks
//! are visited.
//!
//! This file holds one test so that no other test allocates while it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flashattn::{AttentionParams, Tensor, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are only
// bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc` is passed on as is.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn forward_extra_memory_at_32k_is_under_64_mib() {
    let (b, n, h, d) = (1, 32768, 8, 64);
    let seed = 32768;
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut random = || {
        let data: Vec<f32> = (0..b * n * h * d)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        Tensor::from_vec(data, &[b, n, h, d]).unwrap()
    };
    let (q, k, v) = (random(), random(), random());
    let params = AttentionParams::default().window(512, 0);

    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let res = forward(&q, &k, &v, &params).unwrap();
    let peak = PEAK.load(Ordering::SeqCst);

    let outputs = (res.out.numel() + res.lse.numel()) * 4;
    let extra = peak - before - outputs;
    println!(
        "N={n} B={b} H={h} D={d} f32, window(512, 0): inputs {:.1} MiB, outputs {:.1} MiB, \
         peak beyond inputs and outputs {:.2} MiB (standard attention's scores: {:.0} MiB)",
        3.0 * q.numel() as f64 * 4.0 / MIB,
        outputs as f64 / MIB,
        extra as f64 / MIB,
        (b * h * n * n * 4) as f64 / MIB
    );
    assert!(extra < 64 * 1024 * 1024, "extra peak {extra} bytes");

    // The run computed something: the last query's output is finite and not all zero.
    let out = res.out.to_vec::<f32>().unwrap();
    let last = &out[out.len() - d..];
    assert!(last.iter().all(|x| x.is_finite()) && last.iter().any(|&x| x != 0.0));
}
