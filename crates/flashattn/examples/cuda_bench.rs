//! GPU timings for `bench/compare_sdpa.py`: flashattn's forward, backward or both (and optionally
//! the GPU standard attention's forward) on the shapes of the CUDA issue, timed with CUDA events (warm-up, then the median of
//! several samples), written as JSON.
//!
//! `cargo run --release --example cuda_bench -- --json out.json`
//!
//! Shapes: for each head dim D and sequence length N, batch = tokens / N and heads = model_dim / D
//! (defaults: 16384 tokens, model dim 2048, so every shape moves the same q, k, v). FLOPs are
//! `4·B·H·N²·D`, halved when causal, times 2.5 for the backward and 3.5 for both. The backward
//! writes into the gradients of an untimed first call (`backward_into`), as a training loop would. Inputs are fresh random values in `[-1.7, 1.7)`, stored
//! `[batch, seqlen, heads, dim]`.
//!
//! Needs a CUDA device; exits with status 1 and the reason otherwise.

#[cfg(feature = "cuda")]
mod bench {
    use clap::Parser;
    use flashattn::reference::standard;
    use flashattn::{AttentionParams, DType, Device, Tensor};
    use rand::{RngExt, SeedableRng, rngs::StdRng};
    use serde_json::json;

    /// Command-line options.
    #[derive(Parser, Debug)]
    #[command(about = "Time flashattn's GPU attention on the CUDA issue's shapes")]
    pub struct Args {
        /// Sequence lengths.
        #[arg(long, value_delimiter = ',', default_values_t = [512usize, 1024, 2048, 4096, 8192, 16384])]
        seqlens: Vec<usize>,
        /// Head dims.
        #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128])]
        head_dims: Vec<usize>,
        /// Causal: true, false or both.
        #[arg(long, default_value = "both")]
        causal: String,
        /// Element type: bf16, f16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: DType,
        /// batch · seqlen.
        #[arg(long, default_value_t = 16384)]
        tokens: usize,
        /// heads · head_dim.
        #[arg(long, default_value_t = 2048)]
        model_dim: usize,
        /// Untimed calls before the samples.
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        /// Timed calls (the median is reported).
        #[arg(long, default_value_t = 20)]
        samples: usize,
        /// forward, backward, or fwdbwd (the forward and then the backward).
        #[arg(long, default_value = "forward")]
        pass: String,
        /// Also time the GPU standard attention's forward (materializes the score matrix).
        #[arg(long)]
        standard: bool,
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Write every figure here as JSON.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    }

    fn median(v: &[f64]) -> f64 {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        if s.is_empty() {
            f64::NAN
        } else if s.len() % 2 == 1 {
            s[s.len() / 2]
        } else {
            (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
        }
    }

    pub fn main() -> Result<(), String> {
        let args = Args::parse();
        let err = |e: flashattn::Error| e.to_string();
        let gpu = Device::Cuda(args.device);
        let info = flashattn::cuda::device_info(args.device).map_err(err)?;
        println!("device: {info}");
        let causals: Vec<bool> = match args.causal.as_str() {
            "both" => vec![false, true],
            "true" => vec![true],
            "false" => vec![false],
            other => {
                return Err(format!(
                    "--causal: expected true, false or both, got `{other}`"
                ));
            }
        };
        // One random buffer per operand, viewed as [B, N, H, D] for every shape.
        let numel = args.tokens * args.model_dim;
        let mut rng = StdRng::seed_from_u64(2026);
        let mut operand = || -> Result<Tensor, String> {
            let data: Vec<f32> = (0..numel).map(|_| rng.random_range(-1.7f32..1.7)).collect();
            Tensor::from_vec(data, &[numel])
                .and_then(|t| t.to_dtype(args.dtype))
                .and_then(|t| t.to_device(gpu))
                .map_err(err)
        };
        let (q, k, v, dout) = (operand()?, operand()?, operand()?, operand()?);
        let pass_flops = match args.pass.as_str() {
            "forward" => 1.0,
            "backward" => 2.5,
            "fwdbwd" => 3.5,
            other => {
                return Err(format!(
                    "--pass: expected forward, backward or fwdbwd, got `{other}`"
                ));
            }
        };
        if args.standard && args.pass != "forward" {
            return Err("--standard times the forward only".into());
        }
        let mut rows = Vec::new();
        println!(
            "{:>5} {:>6} {:>3} {:>6} {:>4} | {:>10} {:>8} | {:>10} {:>8}",
            "D", "causal", "B", "N", "H", "fa ms", "TFLOP/s", "std ms", "TFLOP/s"
        );
        for &d in &args.head_dims {
            for &causal in &causals {
                for &n in &args.seqlens {
                    if args.tokens % n != 0 || args.model_dim % d != 0 {
                        return Err(format!(
                            "seqlen {n} must divide {} and head dim {d} must divide {}",
                            args.tokens, args.model_dim
                        ));
                    }
                    let (b, h) = (args.tokens / n, args.model_dim / d);
                    let shape = [b, n, h, d];
                    let strides = [n * h * d, h * d, d, 1];
                    let view = |t: &Tensor| t.view(&shape, &strides, 0).map_err(err);
                    let (qv, kv, vv, dov) = (view(&q)?, view(&k)?, view(&v)?, view(&dout)?);
                    let p = if causal {
                        AttentionParams::default().causal()
                    } else {
                        AttentionParams::default()
                    };
                    let flops = pass_flops * 4.0 * (b * h * d) as f64 * (n * n) as f64
                        / if causal { 2.0 } else { 1.0 };
                    let mut cells = Vec::new();
                    let methods: &[&str] = if args.standard {
                        &["flashattn", "standard"]
                    } else {
                        &["flashattn"]
                    };
                    // The backward's inputs and the gradients it writes into.
                    let mut fwd = flashattn::forward(&qv, &kv, &vv, &p).map_err(err)?;
                    let mut grads = match args.pass.as_str() {
                        "forward" => None,
                        _ => Some(
                            flashattn::backward(&qv, &kv, &vv, &fwd.out, &fwd.lse, &dov, &p)
                                .map_err(err)?,
                        ),
                    };
                    for &method in methods {
                        let mut run = || -> flashattn::Result<()> {
                            if method == "standard" {
                                return standard::forward(&qv, &kv, &vv, &p).map(drop);
                            }
                            if args.pass != "backward" {
                                flashattn::forward_into(
                                    &qv,
                                    &kv,
                                    &vv,
                                    &p,
                                    &mut fwd.out,
                                    &mut fwd.lse,
                                )?;
                            }
                            match grads.as_mut() {
                                Some(g) => flashattn::backward_into(
                                    &qv, &kv, &vv, &fwd.out, &fwd.lse, &dov, &p, g,
                                ),
                                None => Ok(()),
                            }
                        };
                        let timed = flashattn::cuda::time_ms(
                            args.device,
                            args.warmup,
                            args.samples,
                            &mut run,
                        )
                        .and_then(|t| flashattn::cuda::synchronize(args.device).map(|_| t));
                        let (time_ms, samples, error) = match timed {
                            Ok(t) => (median(&t), t, None),
                            Err(e) => (f64::NAN, Vec::new(), Some(e.to_string())),
                        };
                        let tflops = flops / (time_ms * 1e-3) / 1e12;
                        cells.push(match &error {
                            None => format!("{time_ms:>10.3} {tflops:>8.1}"),
                            Some(_) => format!("{:>10} {:>8}", "error", "-"),
                        });
                        if let Some(e) = &error {
                            eprintln!("{method} D={d} N={n} causal={causal}: {e}");
                        }
                        rows.push(json!({
                            "method": method,
                            "device": info,
                            "dtype": args.dtype.name(),
                            "pass": args.pass,
                            "batch": b,
                            "heads": h,
                            "seqlen_q": n,
                            "seqlen_k": n,
                            "head_dim": d,
                            "causal": causal,
                            "time_ms": if error.is_none() { json!(time_ms) } else { json!(null) },
                            "tflops": if error.is_none() { json!(tflops) } else { json!(null) },
                            "samples_ms": samples,
                            "error": error,
                        }));
                    }
                    println!(
                        "{d:>5} {causal:>6} {b:>3} {n:>6} {h:>4} | {}",
                        cells.join(" | ")
                    );
                }
            }
        }
        let records: Vec<_> = flashattn::cuda::compile_records()
            .into_iter()
            .map(|r| {
                println!(
                    "kernel {:<44} {:<7} compile {:>9} load {:>7.2} ms{}",
                    r.name,
                    r.arch,
                    r.compile_ms.map_or("-".into(), |c| format!("{c:.1} ms")),
                    r.load_ms,
                    if r.from_disk { " (disk cache)" } else { "" }
                );
                json!({"name": r.name, "arch": r.arch, "compile_ms": r.compile_ms,
                       "load_ms": r.load_ms, "from_disk": r.from_disk})
            })
            .collect();
        if let Some(path) = &args.json {
            let doc = json!({"device": info, "results": rows, "compile_records": records});
            let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
            std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    match bench::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_bench needs the `cuda` feature");
    std::process::exit(1);
}
