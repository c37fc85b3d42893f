//! A first run: causal attention with grouped-query heads on random data, forward and backward,
//! checked against the f64 oracle and timed next to the standard (materializing) attention.
//!
//! `cargo run --release --example quickstart`

use std::process::ExitCode;
use std::time::Instant;

use flashattn::reference::{oracle, standard};
use flashattn::{AttentionParams, Tensor, backward, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};

const SEED: u64 = 2026;
/// The f32 bound on ‖result − oracle‖ / ‖oracle‖.
const TOLERANCE: f64 = 1e-5;

fn random(rng: &mut StdRng, shape: &[usize]) -> flashattn::Result<Tensor> {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.7f32..1.7)).collect();
    Tensor::from_vec(data, shape)
}

/// Largest absolute and relative (‖a − b‖ / ‖b‖) error.
fn errors(a: &Tensor, b: &[f64]) -> flashattn::Result<(f64, f64)> {
    let a = a.to_f64_vec()?;
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    Ok((max, (num / den).sqrt()))
}

/// The shortest of 3 runs of `f`, in milliseconds.
fn best_of_3(mut f: impl FnMut() -> flashattn::Result<()>) -> flashattn::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

fn main() -> flashattn::Result<ExitCode> {
    let (batch, n, heads, heads_kv, d) = (1, 512, 8, 2, 64);
    println!(
        "flashattn quickstart: causal attention, B={batch} N={n} H={heads} (kv heads {heads_kv}) D={d} f32, seed {SEED}"
    );
    let mut rng = StdRng::seed_from_u64(SEED);
    let q = random(&mut rng, &[batch, n, heads, d])?;
    let k = random(&mut rng, &[batch, n, heads_kv, d])?;
    let v = random(&mut rng, &[batch, n, heads_kv, d])?;
    let dout = random(&mut rng, &[batch, n, heads, d])?;
    let params = AttentionParams::default().causal();

    // Each time is the best of 3 runs, after one untimed run (thread pool start-up).
    let f = forward(&q, &k, &v, &params)?;
    let t_fwd = best_of_3(|| forward(&q, &k, &v, &params).map(drop))?;
    let g = backward(&q, &k, &v, &f.out, &f.lse, &dout, &params)?;
    let t_bwd = best_of_3(|| backward(&q, &k, &v, &f.out, &f.lse, &dout, &params).map(drop))?;
    let s = standard::forward(&q, &k, &v, &params)?;
    let t_std_fwd = best_of_3(|| standard::forward(&q, &k, &v, &params).map(drop))?;
    let t_std_bwd =
        best_of_3(|| standard::backward(&q, &k, &v, &s.out, &s.lse, &dout, &params).map(drop))?;

    let o = oracle::forward(&q, &k, &v, &params)?;
    let og = oracle::backward(&q, &k, &v, &dout, &params)?;
    let mut pass = true;
    for (name, got, want) in [
        ("out", &f.out, &o.out),
        ("dq", &g.dq, &og.dq),
        ("dk", &g.dk, &og.dk),
        ("dv", &g.dv, &og.dv),
    ] {
        let (max, rel) = errors(got, want)?;
        let ok = rel <= TOLERANCE;
        pass &= ok;
        println!(
            "[{}] {name:>3}: max abs error {max:.2e}, rel {rel:.2e} (bound {TOLERANCE:.0e})",
            if ok { "PASS" } else { "FAIL" }
        );
    }
    println!(
        "time: forward {t_fwd:.1} ms, backward {t_bwd:.1} ms (standard attention: {t_std_fwd:.1} ms, {t_std_bwd:.1} ms)"
    );
    println!("{}", if pass { "PASS" } else { "FAIL" });
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
