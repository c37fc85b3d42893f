//! CPU attention throughput next to this machine's f32 GEMM rate, measured in the same run.
//!
//! `cargo bench --bench attention` (add a criterion filter such as `forward` to run a part).
//! Shapes of the core issue: f32, B=1, H=8, D=64, N ∈ {1024, 4096}, causal and not, for
//! `flashattn::forward` and `flashattn::backward`, and `flashattn::backward_into` writing into
//! the gradients of an untimed first call, as the sgemm writes into a kept C: the allocating
//! `backward` also pays for fresh pages whenever the allocator has given its last call's
//! gradients back to the system (see BENCHMARKS.md);
//! and the forward at N=1024 with each score option (softcap 30, ALiBi, a `[1, 1, N, N]` bias),
//! group `options`, and with head-major `[B, H, N, D]` storage, group `head_major`.
//! FLOPs by the usual count: `4·B·H·N²·D` for the
//! forward, halved when causal, ×2.5 for the backward; criterion's "elements" are these FLOPs, so
//! its `thrpt` reads as FLOP/s. The ceiling is a gemm-crate sgemm of 1024×1024×1024 on all
//! threads (AVX-512 where the CPU has it: the crate is built with its `x86-v4` feature),
//! measured before and after the attention runs; the higher rate is used. A summary line per
//! configuration gives GFLOP/s and the percentage of the GEMM rate three ways: from the fastest
//! of criterion's samples, from the median sample, and from the
//! process CPU time of all samples (Linux `/proc/self/stat`), counted as if every rayon thread
//! had a core to itself: on a machine shared with other jobs, wall-clock samples also measure
//! the others, while CPU time does not (idle-spinning rayon workers still count against us).

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use flashattn::reference::ceiling::Sgemm;
use flashattn::{AttentionParams, Tensor, backward, backward_into, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};

use common::{Samples, rates, timed};

const BATCH: usize = 1;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEQLENS: [usize; 2] = [1024, 4096];
const GEMM_N: usize = 1024;
const SEED: u64 = 2026;

fn random(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(data, shape).expect("shape matches data")
}

struct Summary {
    name: String,
    flops: f64,
    samples: Samples,
}

impl Summary {
    /// Adds a summary line for `samples` unless criterion's filter skipped the benchmark.
    fn keep(results: &mut Vec<Summary>, name: String, flops: f64, samples: Samples) {
        if !samples.borrow().per_call.is_empty() {
            results.push(Summary {
                name,
                flops,
                samples,
            });
        }
    }
}

/// Times the allocating `forward` on `q, k, v` under `label` in group `g`, and keeps its summary
/// line `name` for `flops` per call.
fn bench_forward(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    results: &mut Vec<Summary>,
    (label, name): (&str, String),
    flops: f64,
    [q, k, v]: [&Tensor; 3],
    params: &AttentionParams,
) {
    let samples = Samples::default();
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function(BenchmarkId::from_parameter(label), |bench| {
        bench.iter_custom(|iters| {
            timed(&samples, iters, || {
                black_box(forward(q, k, v, params).expect("forward"));
            })
        })
    });
    Summary::keep(results, name, flops, samples);
}

fn main() {
    // No HTML charts: criterion's plotters backend needs system fonts and panics without them,
    // and the figures that matter are the summary lines printed below.
    let mut c = Criterion::default()
        .without_plots()
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
    let mut sgemm = Sgemm::new(n, SEED);
    let gemm_flops = sgemm.flops();
    // The ceiling is measured before and after the attention runs, and the higher of the two is
    // used: the machine's speed drifts over the minutes of a run.
    let gemm_samples = [Samples::default(), Samples::default()];
    let mut measure_gemm = |c: &mut Criterion, when: usize| {
        let mut g = c.benchmark_group("gemm");
        g.throughput(Throughput::Elements(gemm_flops as u64));
        let name = format!("sgemm_{n}x{n}x{n}/{}", ["before", "after"][when]);
        g.bench_function(name, |bench| {
            bench.iter_custom(|iters| {
                timed(&gemm_samples[when], iters, || {
                    sgemm.run();
                })
            })
        });
        g.finish();
    };
    measure_gemm(&mut c, 0);

    for pass in ["forward", "backward", "backward_into"] {
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
                let name = format!("{pass} f32 B={BATCH} H={HEADS} D={HEAD_DIM} {label}");
                if pass == "forward" {
                    let qkv = [&q, &k, &v];
                    bench_forward(&mut g, &mut results, (&label, name), flops, qkv, &params);
                    continue;
                }
                let samples = Samples::default();
                g.throughput(Throughput::Elements(flops as u64));
                if pass == "backward" {
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
                } else {
                    let f = forward(&q, &k, &v, &params).expect("forward");
                    let mut grads =
                        backward(&q, &k, &v, &f.out, &f.lse, &dout, &params).expect("backward");
                    g.bench_function(BenchmarkId::from_parameter(&label), |bench| {
                        bench.iter_custom(|iters| {
                            timed(&samples, iters, || {
                                backward_into(
                                    &q, &k, &v, &f.out, &f.lse, &dout, &params, &mut grads,
                                )
                                .expect("backward_into");
                                black_box(&grads);
                            })
                        })
                    });
                }
                Summary::keep(&mut results, name, flops, samples);
            }
        }
        g.finish();
    }
    // The score options on the forward at N=1024, full attention: what each costs beside the
    // plain row (same FLOP count).
    let mut g = c.benchmark_group("options");
    let seq = SEQLENS[0];
    let shape = [BATCH, seq, HEADS, HEAD_DIM];
    let (q, k, v) = (
        random(&mut rng, &shape),
        random(&mut rng, &shape),
        random(&mut rng, &shape),
    );
    let slopes: Vec<f32> = (0..HEADS).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    let slopes = Tensor::from_vec(slopes, &[HEADS]).expect("slopes");
    let bias = random(&mut rng, &[1, 1, seq, seq]);
    let flops = 4.0 * (BATCH * HEADS * seq * seq * HEAD_DIM) as f64;
    let qkv = [&q, &k, &v];
    for (option, params) in [
        ("softcap", AttentionParams::default().softcap(30.0)),
        ("alibi", AttentionParams::default().alibi(slopes)),
        ("bias", AttentionParams::default().bias(bias)),
    ] {
        let label = format!("{option}/N={seq}");
        let name = format!("forward+{option} f32 B={BATCH} H={HEADS} D={HEAD_DIM} N={seq}");
        bench_forward(&mut g, &mut results, (&label, name), flops, qkv, &params);
    }
    g.finish();

    // The forward at N=1024 with head-major storage, `[B, H, N, D]` (PyTorch SDPA's layout),
    // passed as the `[B, N, H, D]` view it transposes to: each head's rows are then one
    // stream, where `[B, N, H, D]` puts a head's rows a whole row of heads apart.
    let mut g = c.benchmark_group("head_major");
    let head_major = |rng: &mut StdRng| {
        random(rng, &[BATCH, HEADS, seq, HEAD_DIM])
            .transpose(1, 2)
            .expect("a [B, N, H, D] view")
    };
    let (q, k, v) = (
        head_major(&mut rng),
        head_major(&mut rng),
        head_major(&mut rng),
    );
    let qkv = [&q, &k, &v];
    for causal in [false, true] {
        let (params, mask) = if causal {
            (AttentionParams::default().causal(), "causal")
        } else {
            (AttentionParams::default(), "full")
        };
        let flops = flops / if causal { 2.0 } else { 1.0 };
        let label = format!("N={seq}/{mask}");
        let name = format!("forward f32 [B,H,N,D] B={BATCH} H={HEADS} D={HEAD_DIM} {label}");
        bench_forward(&mut g, &mut results, (&label, name), flops, qkv, &params);
    }
    g.finish();

    measure_gemm(&mut c, 1);
    c.final_summary();

    if gemm_samples.iter().any(|g| g.borrow().per_call.is_empty()) {
        return;
    }
    let pct = |x: f64, of: f64| 100.0 * x / of;
    let show_cpu = |c: Option<f64>, of: Option<f64>| match (c, of) {
        (Some(c), Some(of)) => format!("{c:.1} GFLOP/s {:.1}%", pct(c, of)),
        _ => "n/a".to_string(),
    };
    let [before, after] = [0, 1].map(|i| rates(&gemm_samples[i], gemm_flops));
    let higher = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| x.max(y));
    let gemm = (
        before.0.max(after.0),
        before.1.max(after.1),
        higher(before.2, after.2),
    );
    println!(
        "\nsummary, this run ({} kernels; the gemm crate's own choice for sgemm): GFLOP/s and % \
         of the GEMM rate from the fastest sample [median sample] {{CPU time, {} threads}}",
        flashattn::cpu_simd(),
        rayon::current_num_threads()
    );
    for (when, g) in [("before", before), ("after", after)] {
        println!(
            "  {:<56} {:>7.1} GFLOP/s          [{:.1}] {{{}}}",
            format!("sgemm {n}x{n}x{n} f32, all threads, {when}"),
            g.0,
            g.1,
            g.2.map_or("n/a".into(), |c| format!("{c:.1}"))
        );
    }
    println!("  (percentages below are of the higher of the two)");
    for r in &results {
        let x = rates(&r.samples, r.flops);
        println!(
            "  {:<56} {:>7.1} GFLOP/s {:>5.1}%   [{:.1} {:.1}%] {{{}}}",
            r.name,
            x.0,
            pct(x.0, gemm.0),
            x.1,
            pct(x.1, gemm.1),
            show_cpu(x.2, gemm.2)
        );
    }
}
