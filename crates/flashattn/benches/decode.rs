//! CPU decoding steps (one query a sequence against a long K/V cache) next to this machine's
//! memory read rate, measured in the same run.
//!
//! `cargo bench --bench decode`. A decoding step reads every K and V row once and does 4 FLOPs
//! per element read, so it is bound by memory, not by the FMA units: the rate reported is the
//! K and V bytes over the time of a call, and the ceiling is a vectorized sum of a 256 MiB f32
//! buffer on all rayon threads (far beyond any cache), measured before and after the steps; the
//! higher rate is used. Shapes: f32 (and bf16 for the long GQA step), B=1, one query, D=128,
//! with 32 query heads on 8 key/value heads (GQA), on 32 (MHA) and 8 on 1 (MQA), 4096 and 32768
//! keys, K/V stored `[B, N, H, D]` (rows of all heads interleaved, a KV cache appended to in
//! place) and `[B, H, N, D]` (each head's rows contiguous). The summary gives GB/s and the
//! percentage of the read rate from the fastest of criterion's samples and [from the median
//! sample].

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use flashattn::{AttentionParams, DType, Tensor, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use rayon::prelude::*;

use common::{Samples, rates, timed};

const HEAD_DIM: usize = 128;
const SEED: u64 = 2026;
/// Elements of the buffer the read rate is measured on (256 MiB of f32).
const SWEEP: usize = 64 << 20;

/// The sum of `x`, 16 lanes at a time on every thread (the compiler vectorizes the lanes).
fn sweep(x: &[f32]) -> f32 {
    x.par_chunks(1 << 16)
        .map(|c| {
            let mut acc = [0f32; 16];
            for v in c.chunks_exact(16) {
                for (a, y) in acc.iter_mut().zip(v) {
                    *a += y;
                }
            }
            acc.iter().sum::<f32>()
        })
        .sum()
}

/// Random `[1, n, heads, d]` values of `dtype`, stored in that order or as `[1, heads, n, d]`.
fn cache(rng: &mut StdRng, n: usize, heads: usize, heads_major: bool, dtype: DType) -> Tensor {
    let data: Vec<f32> = (0..n * heads * HEAD_DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let t = if heads_major {
        Tensor::from_vec(data, &[1, heads, n, HEAD_DIM]).and_then(|t| t.transpose(1, 2))
    } else {
        Tensor::from_vec(data, &[1, n, heads, HEAD_DIM])
    };
    t.and_then(|t| t.to_dtype(dtype))
        .expect("shape matches data")
}

fn main() {
    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let mut rng = StdRng::seed_from_u64(SEED);
    let buf: Vec<f32> = (0..SWEEP).map(|i| (i % 7) as f32).collect();
    let sweep_bytes = (SWEEP * size_of::<f32>()) as f64;
    let read = [Samples::default(), Samples::default()];
    let measure_read = |c: &mut Criterion, when: usize| {
        let mut g = c.benchmark_group("read");
        g.throughput(Throughput::Bytes(sweep_bytes as u64));
        g.bench_function(["before", "after"][when], |bench| {
            bench.iter_custom(|iters| {
                timed(&read[when], iters, || {
                    black_box(sweep(&buf));
                })
            })
        });
        g.finish();
    };
    measure_read(&mut c, 0);

    let mut results = Vec::new();
    let mut g = c.benchmark_group("decode");
    // (query heads, key/value heads, keys, dtype of q, K and V).
    let steps = [
        (32, 8, 4096, DType::F32),
        (32, 8, 32768, DType::F32),
        (32, 8, 32768, DType::BF16),
        (32, 32, 4096, DType::F32),
        (8, 1, 4096, DType::F32),
        (8, 1, 32768, DType::F32),
    ];
    for (heads, heads_kv, keys, dtype) in steps {
        let q = cache(&mut rng, 1, heads, false, dtype);
        for heads_major in [false, true] {
            let k = cache(&mut rng, keys, heads_kv, heads_major, dtype);
            let v = cache(&mut rng, keys, heads_kv, heads_major, dtype);
            let params = AttentionParams::default().causal();
            let layout = if heads_major { "BHND" } else { "BNHD" };
            let label = format!("{dtype}/H={heads}/Hkv={heads_kv}/N={keys}/{layout}");
            let bytes = (2 * keys * heads_kv * HEAD_DIM * dtype.size_in_bytes()) as f64;
            let samples = Samples::default();
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(BenchmarkId::from_parameter(&label), |bench| {
                bench.iter_custom(|iters| {
                    timed(&samples, iters, || {
                        black_box(forward(&q, &k, &v, &params).expect("forward"));
                    })
                })
            });
            results.push((label, bytes, samples));
        }
    }
    g.finish();
    measure_read(&mut c, 1);
    c.final_summary();

    if read.iter().any(|r| r.borrow().per_call.is_empty()) || results.is_empty() {
        return;
    }
    let [before, after] = [0, 1].map(|i| rates(&read[i], sweep_bytes));
    let ceiling = (before.0.max(after.0), before.1.max(after.1));
    println!(
        "\nsummary, this run ({} kernels, {} threads): K and V bytes read per second and % of \
         the memory read rate, fastest sample [median sample]",
        flashattn::cpu_simd(),
        rayon::current_num_threads()
    );
    for (when, r) in [("before", before), ("after", after)] {
        println!(
            "  {:<48} {:>6.1} GB/s          [{:.1}]",
            format!("read 256 MiB, all threads, {when}"),
            r.0,
            r.1
        );
    }
    for (label, bytes, samples) in &results {
        if !samples.borrow().per_call.is_empty() {
            let r = rates(samples, *bytes);
            println!(
                "  {:<48} {:>6.1} GB/s {:>5.1}%   [{:.1} {:.1}%]",
                format!("decode D={HEAD_DIM} {label}"),
                r.0,
                100.0 * r.0 / ceiling.0,
                r.1,
                100.0 * r.1 / ceiling.1
            );
        }
    }
}
