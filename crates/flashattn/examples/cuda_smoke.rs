//! One small GPU forward per kernel variant, for `compute-sanitizer` (memcheck, racecheck) and a
//! quick check: every dtype, head dims from 1 to 512, plain, causal, all options at once, GQA and
//! packed varlen, each compared with the CPU forward on the same inputs. Also runs the GPU
//! standard attention once per dtype. Prints the kernel variants it loaded and those of
//! `flashattn::cuda::kernel_sources()` it did not reach.
//!
//! `cargo run --release --example cuda_smoke` (exit status 1 on any error or mismatch)

#[cfg(feature = "cuda")]
mod smoke {
    use flashattn::reference::standard;
    use flashattn::{AttentionParams, DType, Device, Tensor};
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    const GPU: Device = Device::Cuda(0);
    /// Head dims every configuration runs at.
    const MAIN_DIMS: [usize; 8] = [1, 32, 64, 80, 96, 128, 256, 512];
    /// Further head dims (each padded multiple of 32 has its own variants), run plain and with
    /// every option.
    const EXTRA_DIMS: [usize; 10] = [160, 192, 224, 288, 320, 352, 384, 416, 448, 480];

    fn random(rng: &mut StdRng, shape: &[usize], dtype: DType) -> flashattn::Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.7f32..1.7)).collect();
        Tensor::from_vec(data, shape)?.to_dtype(dtype)
    }

    fn rel(a: &Tensor, b: &Tensor) -> flashattn::Result<f64> {
        let (a, b) = (a.to_f64_vec()?, b.to_f64_vec()?);
        if a.iter().any(|x| !x.is_finite()) {
            return Ok(f64::INFINITY);
        }
        let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        Ok(if num == 0.0 { 0.0 } else { (num / den).sqrt() })
    }

    /// Bound on the difference to the CPU forward (both are FlashAttention in f32 arithmetic; the
    /// outputs differ by the rounding of the output dtype).
    fn bound(dtype: DType) -> f64 {
        match dtype {
            DType::F32 => 1e-5,
            DType::F16 => 2e-3,
            DType::BF16 => 1.6e-2,
        }
    }

    /// A random relative-position table of `h` heads and `l` entries each side: `h · (2l − 1)`.
    fn table(rng: &mut StdRng, h: usize, l: usize) -> Vec<f32> {
        (0..h * (2 * l - 1))
            .map(|_| rng.random_range(-1f32..1.0))
            .collect()
    }

    struct Config {
        name: &'static str,
        /// Run at every head dim (else only at [`MAIN_DIMS`]).
        all_dims: bool,
        /// Place q one element into its buffer, so its rows are not 16-byte aligned (f16/bf16
        /// then take the CUDA-core path).
        unaligned: bool,
        heads: (usize, usize),
        lens: (usize, usize),
        varlen: Option<(Vec<i32>, Vec<i32>)>,
        params: fn(&mut StdRng, usize, usize, usize, usize) -> AttentionParams,
    }

    fn configs() -> Vec<Config> {
        vec![
            Config {
                name: "plain",
                all_dims: true,
                unaligned: false,
                heads: (2, 2),
                lens: (40, 72),
                varlen: None,
                params: |_, _, _, _, _| AttentionParams::default(),
            },
            Config {
                name: "plain, over 1024 keys",
                all_dims: false,
                unaligned: false,
                heads: (2, 1),
                lens: (16, 1030),
                varlen: None,
                params: |_, _, _, _, _| AttentionParams::default(),
            },
            Config {
                name: "causal",
                all_dims: false,
                unaligned: false,
                heads: (2, 2),
                lens: (72, 40),
                varlen: None,
                params: |_, _, _, _, _| AttentionParams::default().causal(),
            },
            Config {
                name: "window+alibi+softcap+bias gqa",
                all_dims: false,
                unaligned: false,
                heads: (4, 2),
                lens: (40, 72),
                varlen: None,
                params: |rng, b, h, nq, nk| {
                    let slopes: Vec<f32> = (0..h).map(|_| rng.random_range(0.01f32..0.3)).collect();
                    let bias: Vec<f32> = (0..b * nq * nk)
                        .map(|_| rng.random_range(-1f32..1.0))
                        .collect();
                    AttentionParams::default()
                        .window(20, 5)
                        .softcap(5.0)
                        .alibi(Tensor::from_vec(slopes, &[h]).expect("slopes"))
                        .bias(Tensor::from_vec(bias, &[b, 1, nq, nk]).expect("bias"))
                },
            },
            Config {
                name: "causal+alibi+softcap+bias+rel_bias, negative scale",
                all_dims: true,
                unaligned: false,
                heads: (2, 2),
                lens: (40, 72),
                varlen: None,
                params: |rng, b, h, nq, nk| {
                    let slopes: Vec<f32> =
                        (0..b * h).map(|_| rng.random_range(0.01f32..0.3)).collect();
                    let bias: Vec<f32> = (0..h * nq * nk)
                        .map(|_| rng.random_range(-1f32..1.0))
                        .collect();
                    AttentionParams::default()
                        .causal()
                        .scale(-0.2)
                        .softcap(8.0)
                        .alibi(Tensor::from_vec(slopes, &[b, h]).expect("slopes"))
                        .bias(Tensor::from_vec(bias, &[1, h, nq, nk]).expect("bias"))
                        .rel_bias(Tensor::from_vec(table(rng, h, 9), &[h, 17]).expect("table"))
                },
            },
            Config {
                name: "plain, unaligned q",
                all_dims: false,
                unaligned: true,
                heads: (2, 2),
                lens: (40, 72),
                varlen: None,
                params: |_, _, _, _, _| AttentionParams::default(),
            },
            Config {
                name: "softcap+alibi+bias+rel_bias, negative scale, unaligned q",
                all_dims: true,
                unaligned: true,
                heads: (2, 1),
                lens: (40, 72),
                varlen: None,
                params: |rng, _, h, nq, nk| {
                    let slopes: Vec<f32> = (0..h).map(|_| rng.random_range(0.01f32..0.3)).collect();
                    let bias: Vec<f32> =
                        (0..nq * nk).map(|_| rng.random_range(-1f32..1.0)).collect();
                    AttentionParams::default()
                        .window(9, 3)
                        .scale(-0.2)
                        .softcap(8.0)
                        .alibi(Tensor::from_vec(slopes, &[h]).expect("slopes"))
                        .bias(Tensor::from_vec(bias, &[1, 1, nq, nk]).expect("bias"))
                        .rel_bias(Tensor::from_vec(table(rng, h, 100), &[h, 199]).expect("table"))
                },
            },
            Config {
                name: "varlen causal mqa",
                all_dims: false,
                unaligned: false,
                heads: (4, 1),
                lens: (0, 0),
                varlen: Some((vec![0, 5, 5, 90, 160], vec![0, 40, 41, 60, 200])),
                params: |_, _, _, _, _| AttentionParams::default().causal(),
            },
        ]
    }

    pub fn main() -> Result<(), String> {
        let e = |e: flashattn::Error| e.to_string();
        println!("device: {}", flashattn::cuda::device_info(0).map_err(e)?);
        flashattn::internals::set_poison_outputs(true);
        let mut rng = StdRng::seed_from_u64(7);
        let mut failures = Vec::new();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for d in MAIN_DIMS.iter().chain(&EXTRA_DIMS).copied() {
                for c in configs()
                    .into_iter()
                    .filter(|c| c.all_dims || MAIN_DIMS.contains(&d))
                {
                    let (h, hk) = c.heads;
                    let (qs, ks, b, nq, nk) = match &c.varlen {
                        None => (
                            vec![2, c.lens.0, h, d],
                            vec![2, c.lens.1, hk, d],
                            2,
                            c.lens.0,
                            c.lens.1,
                        ),
                        Some((cq, ck)) => {
                            let (tq, tk) =
                                (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
                            (vec![tq, h, d], vec![tk, hk, d], cq.len() - 1, 0, 0)
                        }
                    };
                    let mut q = random(&mut rng, &qs, dtype).map_err(e)?;
                    if c.unaligned {
                        let n: usize = qs.iter().product();
                        let strides: Vec<usize> = (0..qs.len())
                            .map(|a| qs[a + 1..].iter().product())
                            .collect();
                        q = random(&mut rng, &[n + 1], dtype)
                            .and_then(|t| t.view(&qs, &strides, 1))
                            .map_err(e)?;
                    }
                    let k = random(&mut rng, &ks, dtype).map_err(e)?;
                    let v = random(&mut rng, &ks, dtype).map_err(e)?;
                    let mut p = (c.params)(&mut rng, b, h, nq, nk);
                    if let Some((cq, ck)) = &c.varlen {
                        p = p.varlen(cq.clone(), ck.clone());
                    }
                    let cpu = flashattn::forward(&q, &k, &v, &p).map_err(e)?;
                    let up = |t: &Tensor| t.to_device(GPU);
                    let mut gp = p.clone();
                    gp.bias = p.bias.as_ref().map(up).transpose().map_err(e)?;
                    gp.rel_bias = p.rel_bias.as_ref().map(up).transpose().map_err(e)?;
                    let (gq, gk, gv) = (up(&q).map_err(e)?, up(&k).map_err(e)?, up(&v).map_err(e)?);
                    let what = format!("{dtype} D={d} {}", c.name);
                    match flashattn::forward(&gq, &gk, &gv, &gp) {
                        Ok(g) => {
                            let err = rel(&g.out, &cpu.out).map_err(e)?;
                            let ok = err <= bound(dtype);
                            println!(
                                "[{}] {what}: rel to cpu {err:.2e}",
                                if ok { "PASS" } else { "FAIL" }
                            );
                            if !ok {
                                failures.push(what);
                            }
                        }
                        Err(err) => {
                            println!("[FAIL] {what}: {err}");
                            failures.push(what);
                        }
                    }
                }
            }
            // The standard attention's kernels, once per dtype.
            let q = random(&mut rng, &[2, 70, 2, 64], dtype).map_err(e)?;
            let p = AttentionParams::default().causal().softcap(3.0);
            let cpu = standard::forward(&q, &q, &q, &p).map_err(e)?;
            let g = q.to_device(GPU).map_err(e)?;
            let s = standard::forward(&g, &g, &g, &p).map_err(e)?;
            let err = rel(&s.out, &cpu.out).map_err(e)?;
            let ok = err <= bound(dtype);
            println!(
                "[{}] standard {dtype}: rel to cpu standard {err:.2e}",
                if ok { "PASS" } else { "FAIL" }
            );
            if !ok {
                failures.push(format!("standard {dtype}"));
            }
        }
        flashattn::cuda::synchronize(0).map_err(e)?;
        let loaded: Vec<String> = flashattn::cuda::compile_records()
            .into_iter()
            .map(|r| r.name)
            .collect();
        println!("variants loaded: {}", loaded.join(" "));
        let missed: Vec<String> = flashattn::cuda::kernel_sources()
            .into_iter()
            .map(|s| s.name)
            .filter(|n| !loaded.contains(n))
            .collect();
        println!(
            // Variants for GPUs with less shared memory per block (99 KB parts) cannot be
            // reached on larger ones.
            "variants not reached on this GPU: {}",
            if missed.is_empty() {
                "none".into()
            } else {
                missed.join(" ")
            }
        );
        if failures.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} failures: {}",
                failures.len(),
                failures.join(", ")
            ))
        }
    }
}

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    match smoke::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_smoke: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_smoke needs the `cuda` feature");
    std::process::exit(1);
}
