//! CPU attention throughput next to this machine's f32 GEMM rate, measured in the same run.
//!
//! `cargo bench --bench attention` (add a criterion filter such as `forward` to run a part).
//! Shapes of the core issue: f32, B=1, H=8, D=64, N ∈ {1024, 4096}, causal and not, for
//! `flashattn::forward` and `flashattn::backward`. FLOPs by the usual count: `4·B·H·N²·D` for the
//! forward, halved when causal, ×2.5 for the backward; criterion's "elements" are these FLOPs, so
//! its `thrpt` reads as FLOP/s. The ceiling is a gemm-crate sgemm of 1024×1024×1024 on all
//! threads. A summary line per configuration gives GFLOP/s and the percentage of the GEMM rate,
//! from the fastest of criterion's samples (the machine is shared, so slow samples mostly measure
//! other processes) and, beside it, from the median sample.

use std::cell::RefCell;
use std::hint::black_box;
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use flashattn::{AttentionParams, Tensor, backward, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};

const BATCH: usize = 1;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEQLENS: [usize; 2] = [1024, 4096];
const GEMM_N: usize = 1024;
const SEED: u64 = 2026;

/// Per-iteration times of every sample criterion took for one benchmark.
type Samples = Rc<RefCell<Vec<Duration>>>;

/// Times `f` the way criterion asks (`iters` calls) and keeps the per-call time of the sample.
fn timed(samples: &Samples, iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    let elapsed = start.elapsed();
    samples.borrow_mut().push(elapsed / iters.max(1) as u32);
    elapsed
}

/// The fastest and the median per-call time of the samples, in seconds.
fn best_and_median(samples: &Samples) -> (f64, f64) {
    let mut t: Vec<f64> = samples.borrow().iter().map(Duration::as_secs_f64).collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[t.len() / 2])
}

fn random(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(data, shape).expect("shape matches data")
}

/// sgemm `c = a·b` of `n × n` matrices with the gemm crate on all rayon threads.
fn sgemm(c: &mut [f32], a: &[f32], b: &[f32], n: usize) {
    let s = n as isize;
    // SAFETY: a, b and c each hold n·n elements, row-major (row stride n, column stride 1), and
    // c does not alias a or b.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            c.as_mut_ptr(),
            1,
            s,
            false,
            a.as_ptr(),
            1,
            s,
            b.as_ptr(),
            1,
            s,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        )
    }
}

struct Summary {
    name: String,
    flops: f64,
    /// Fastest and median seconds per call.
    seconds: (f64, f64),
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    println!(
        "seed {SEED}, {} rayon threads",
        rayon::current_num_threads()
    );
    let mut rng = StdRng::seed_from_u64(SEED);
    let mut results: Vec<Summary> = Vec::new();

    let n = GEMM_N;
    let a: Vec<f32> = (0..n * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let b: Vec<f32> = (0..n * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut out = vec![f32::NAN; n * n];
    let gemm_flops = 2.0 * (n * n * n) as f64;
    let gemm_samples = Samples::default();
    {
        let mut g = c.benchmark_group("gemm");
        g.throughput(Throughput::Elements(gemm_flops as u64));
        g.bench_function(format!("sgemm_{n}x{n}x{n}"), |bench| {
            bench.iter_custom(|iters| {
                timed(&gemm_samples, iters, || {
                    sgemm(&mut out, &a, &b, n);
                    black_box(&out);
                })
            })
        });
        g.finish();
    }

    for pass in ["forward", "backward"] {
        let mut g = c.benchmark_group(pass);
        for &seq in &SEQLENS {
            let shape = [BATCH, seq, HEADS, HEAD_DIM];
            let (q, k, v, dout) = (
                random(&mut rng, &shape),
                random(&mut rng, &shape),
                random(&mut rng, &shape),
                random(&mut rng, &shape),
            );
            for causal in [false, true] {
                let params = if causal {
                    AttentionParams::default().causal()
                } else {
                    AttentionParams::default()
                };
                let fwd_flops = 4.0 * (BATCH * HEADS * seq * seq * HEAD_DIM) as f64
                    / if causal { 2.0 } else { 1.0 };
                let flops = if pass == "forward" {
                    fwd_flops
                } else {
                    2.5 * fwd_flops
                };
                let label = format!("N={seq}/{}", if causal { "causal" } else { "full" });
                let samples = Samples::default();
                g.throughput(Throughput::Elements(flops as u64));
                if pass == "forward" {
                    g.bench_function(BenchmarkId::from_parameter(&label), |bench| {
                        bench.iter_custom(|iters| {
                            timed(&samples, iters, || {
                                black_box(forward(&q, &k, &v, &params).expect("forward"));
                            })
                        })
                    });
                } else {
                    let f = forward(&q, &k, &v, &params).expect("forward");
                    g.bench_function(BenchmarkId::from_parameter(&label), |bench| {
                        bench.iter_custom(|iters| {
                            timed(&samples, iters, || {
                                black_box(
                                    backward(&q, &k, &v, &f.out, &f.lse, &dout, &params)
                                        .expect("backward"),
                                );
                            })
                        })
                    });
                }
                if !samples.borrow().is_empty() {
                    results.push(Summary {
                        name: format!("{pass} f32 B={BATCH} H={HEADS} D={HEAD_DIM} {label}"),
                        flops,
                        seconds: best_and_median(&samples),
                    });
                }
            }
        }
        g.finish();
    }
    c.final_summary();

    if gemm_samples.borrow().is_empty() {
        return;
    }
    let (best, median) = best_and_median(&gemm_samples);
    let gemm_rate = (gemm_flops / best / 1e9, gemm_flops / median / 1e9);
    println!("\nsummary (this run; GFLOP/s from the fastest sample, median sample in brackets):");
    println!(
        "  sgemm {n}x{n}x{n} f32, all threads: {:.1} GFLOP/s [{:.1}]",
        gemm_rate.0, gemm_rate.1
    );
    for r in &results {
        let rate = (r.flops / r.seconds.0 / 1e9, r.flops / r.seconds.1 / 1e9);
        println!(
            "  {:<44} {:>8.2} ms {:>7.1} GFLOP/s {:>6.1}% of GEMM   [{:.1} GFLOP/s, {:.1}%]",
            r.name,
            r.seconds.0 * 1e3,
            rate.0,
            100.0 * rate.0 / gemm_rate.0,
            rate.1,
            100.0 * rate.1 / gemm_rate.1
        );
    }
}
