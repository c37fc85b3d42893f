//! `flashattn bench`: sweeps sizes and times flashattn next to the standard (materializing)
//! attention (and with `--linear` linear attention), with a progress bar, a table, and optional
//! chart and JSON.

use flashattn::Device;
use flashattn::internals::Problem;
use flashattn::reference::ceiling::Sgemm;
use flashattn::reference::standard;
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{BenchArgs, CausalChoice, PassChoice};
use super::inputs::{Config, Inputs};
use super::memory::{self, human};
use super::timing::{self, Extra, Measurement, measure};
use super::{CliResult, bench_table, device, fail, json, layer_bench, linear_bench, output, plot};

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

impl Pass {
    /// `forward` or `backward`.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

/// The backward's FLOPs per forward FLOP, by the usual count.
pub const BACKWARD_FLOP_FACTOR: f64 = 2.5;

/// Fraction of the available memory the standard attention may plan to use.
const MEMORY_HEADROOM: f64 = 0.8;

/// The size of the sgemm of `--gemm` (`n × n` times `n × n`), the ceiling of the issue's
/// benchmark.
pub const GEMM_N: usize = 1024;

/// A baseline's figures (the standard or the linear attention), or why it did not run.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// It ran: its figures.
    Ran(Measurement),
    /// It did not run: why.
    Skipped(String),
}

/// One configuration of the sweep and both methods' figures.
#[derive(Clone, Debug)]
pub struct Row {
    /// The pass timed.
    pub pass: Pass,
    /// Sizes, dtype and mask.
    pub config: Config,
    /// Where flashattn ran.
    pub device: Device,
    /// flashattn's figures.
    pub flash: Measurement,
    /// Where the standard attention ran.
    pub standard_device: Device,
    /// The standard attention's figures, or why it did not run.
    pub standard: Outcome,
    /// Linear attention's figures or why it did not run, with `--linear`.
    pub linear: Option<Outcome>,
    /// flashattn's rate as a percentage of the sgemm's timed around it (median over the
    /// rounds), with `--gemm`.
    pub gemm_percent: Option<f64>,
    /// The sgemm rate (GFLOP/s) that share is of: the mean of the sgemm's rates just before and
    /// just after flashattn's timing (median over the rounds), with `--gemm`.
    pub gemm_ceiling: Option<f64>,
}

/// What a sweep measured: a row per configuration, and the sgemm rate (GFLOP/s, median of
/// its timings) with `--gemm`.
pub struct Sweep {
    pub rows: Vec<Row>,
    pub gemm_gflops: Option<f64>,
}

/// Whether each configuration of `a` is causal, in table order.
pub(crate) fn causal_choices(a: &BenchArgs) -> &'static [bool] {
    match a.causal {
        CausalChoice::No => &[false],
        CausalChoice::Yes => &[true],
        CausalChoice::Both => &[false, true],
    }
}

/// The passes `a` times, in table order.
pub(crate) fn passes(a: &BenchArgs) -> &'static [Pass] {
    match a.pass {
        PassChoice::Forward => &[Pass::Forward],
        PassChoice::Backward => &[Pass::Backward],
        PassChoice::Both => &[Pass::Forward, Pass::Backward],
    }
}

/// The configurations of the sweep, in table order.
fn configs(a: &BenchArgs) -> Vec<(Pass, Config)> {
    let (causal, passes) = (causal_choices(a), passes(a));
    let lengths: Vec<(usize, usize)> = a
        .seqlens
        .iter()
        .flat_map(|&n| {
            let keys = a.seqlens_k.clone().unwrap_or_else(|| vec![n]);
            keys.into_iter().map(move |nk| (n, nk))
        })
        .collect();
    // The inner loops, outermost first: mask, pass, lengths.
    let mut inner = Vec::new();
    for &c in causal {
        for &pass in passes {
            inner.extend(lengths.iter().map(|&(n, nk)| (c, pass, n, nk)));
        }
    }
    let mut out = Vec::new();
    for &t in &a.dtype {
        for &layout in &a.layout {
            for &d in &a.head_dims {
                for &(c, pass, n, nk) in &inner {
                    let mut cfg = Config::new(a.batch, a.heads, n, d)
                        .seqlens(n, nk)
                        .kv_heads(a.heads_kv.unwrap_or(a.heads))
                        .dtype(t)
                        .layout(layout);
                    if c {
                        cfg = cfg.causal();
                    }
                    out.push((pass, cfg));
                }
            }
        }
    }
    out
}

/// The problem of `x`, and the FLOPs of one call of `pass` on it (the backward's counted as
/// [`BACKWARD_FLOP_FACTOR`] forwards).
fn forward_flops(x: &Inputs, pass: Pass) -> CliResult<(Problem, f64)> {
    let p = Problem::new(&x.q, &x.k, &x.v, &x.p)?;
    let f = p.forward_flops();
    let f = match pass {
        Pass::Forward => f,
        Pass::Backward => f * BACKWARD_FLOP_FACTOR,
    };
    Ok((p, f))
}

/// One flashattn call of `pass` on `x`, ready to repeat.
type FlashCall<'a> = Box<dyn FnMut() -> CliResult<()> + 'a>;

/// flashattn's `pass` on `x` as a call to repeat: the untimed first call (`forward`,
/// `backward`) makes the results that each later call writes into (`forward_into`,
/// `backward_into`), as a training or inference loop would, so that timing it leaves out
/// allocating and first touching the outputs (what PyTorch's caching allocator spares its calls
/// too).
fn flash_call(x: &Inputs, pass: Pass) -> CliResult<FlashCall<'_>> {
    let (q, k, v, p) = (&x.q, &x.k, &x.v, &x.p);
    Ok(match pass {
        Pass::Forward => {
            let mut f = flashattn::forward(q, k, v, p)?;
            Box::new(move || Ok(flashattn::forward_into(q, k, v, p, &mut f.out, &mut f.lse)?))
        }
        Pass::Backward => {
            let f = flashattn::forward(q, k, v, p)?;
            let mut g = flashattn::backward(q, k, v, &f.out, &f.lse, &x.dout, p)?;
            Box::new(move || {
                Ok(flashattn::backward_into(
                    q, k, v, &f.out, &f.lse, &x.dout, p, &mut g,
                )?)
            })
        }
    })
}

/// Times flashattn's calls (see [`flash_call`]).
fn run_flash(x: &Inputs, pass: Pass, dev: Device, repeats: u32) -> CliResult<Measurement> {
    let (_, flops) = forward_flops(x, pass)?;
    let on = device::upload(x, dev)?;
    let mut call = flash_call(&on, pass)?;
    measure(dev, repeats, flops, || {
        call()?;
        Ok(Vec::new())
    })
}

/// The standard attention where flashattn runs (on a GPU: the library's cuBLAS baseline).
fn run_standard(
    x: &Inputs,
    pass: Pass,
    dev: Device,
    repeats: u32,
    skip: bool,
) -> CliResult<Outcome> {
    if skip {
        return Ok(Outcome::Skipped("not run (--no-standard)".into()));
    }
    let on = device::upload(x, dev)?;
    let (p, flops) = forward_flops(&on, pass)?;
    let need = match pass {
        Pass::Forward => standard::forward_extra_memory_bytes(&p),
        Pass::Backward => standard::backward_extra_memory_bytes(&p),
    } as u64;
    if dev == Device::Cpu
        && let Some(why) = too_big(need, memory::available_bytes())
    {
        return Ok(Outcome::Skipped(why));
    }
    let result = match pass {
        Pass::Forward => measure(dev, repeats, flops, || {
            let r = standard::forward(&on.q, &on.k, &on.v, &on.p)?;
            Ok(vec![r.out, r.lse])
        }),
        Pass::Backward => {
            let f = flashattn::forward(&on.q, &on.k, &on.v, &on.p)?;
            measure(dev, repeats, flops, || {
                let g = standard::backward(&on.q, &on.k, &on.v, &f.out, &f.lse, &on.dout, &on.p)?;
                Ok([g.dq, g.dk, g.dv].into_iter().chain(g.dbias).collect())
            })
        }
    };
    match (dev, result) {
        (Device::Cpu, r) => Ok(Outcome::Ran(r?)),
        // The GPU baseline holds the score matrix in device memory, which may not fit.
        (Device::Cuda(_), Err(e)) => Ok(Outcome::Skipped(format!("failed on the GPU: {e}"))),
        (Device::Cuda(_), Ok(mut m)) => {
            if m.extra == Extra::Unknown {
                m.extra = Extra::Planned(need);
            }
            Ok(Outcome::Ran(m))
        }
    }
}

/// Why the standard attention must not run when it needs `need` bytes and `avail` are
/// available (unknown: it runs).
fn too_big(need: u64, avail: Option<u64>) -> Option<String> {
    let avail = avail?;
    (need as f64 > avail as f64 * MEMORY_HEADROOM).then(|| {
        format!(
            "its score matrices would need {}, more than {:.0}% of the {} available",
            human(need),
            MEMORY_HEADROOM * 100.0,
            human(avail)
        )
    })
}

/// Measures every configuration in each of `--rounds` rounds, advancing `bar`, and keeps the
/// medians over the rounds. With `--gemm`, the sgemm is timed just before and just after each
/// flashattn timing (one sgemm timing serves as the "after" of one configuration and the
/// "before" of the next when nothing ran between them), and each flashattn rate is taken as a
/// share of the mean of the two: a slow spell of the shared machine that lasts a few seconds
/// then weighs on the rate and its ceiling alike, where one sgemm a round (timed up to a
/// minute before some configurations) could miss it or catch it alone.
fn sweep(a: &BenchArgs, configs: &[(Pass, Config)], bar: &ProgressBar) -> CliResult<Sweep> {
    let mut gemm = a.gemm.then(|| Sgemm::new(GEMM_N, a.seed));
    let mut ceilings = Vec::new();
    // The sgemm timed right after the last flashattn timing, with nothing run since.
    let mut last = None;
    let mut timed: Vec<Vec<Timed>> = vec![Vec::new(); configs.len()];
    for round in 1..=a.rounds {
        let of = if a.rounds > 1 {
            format!("round {round}/{}: ", a.rounds)
        } else {
            String::new()
        };
        for (i, (pass, cfg)) in configs.iter().enumerate() {
            let x = cfg.inputs(a.seed + i as u64)?;
            let mut sgemm = |last: Option<f64>, ceilings: &mut Vec<f64>| {
                let g = gemm.as_mut()?;
                Some(last.unwrap_or_else(|| {
                    bar.set_message(format!("{of}sgemm {GEMM_N}x{GEMM_N}x{GEMM_N}"));
                    let rate = g.gflops(a.repeats);
                    ceilings.push(rate);
                    rate
                }))
            };
            let before = sgemm(last.take(), &mut ceilings);
            bar.set_message(format!("{of}{} {}", pass.name(), cfg.describe()));
            let flash = run_flash(&x, *pass, a.device, a.repeats)?;
            let after = sgemm(None, &mut ceilings);
            let ceiling = before.zip(after).map(|(b, f)| (b + f) / 2.0);
            let standard = run_standard(&x, *pass, a.device, a.repeats, a.no_standard)?;
            let linear = match a.linear {
                true => Some(linear_bench::run(&x, *pass, a.device, a.repeats)?),
                false => None,
            };
            if matches!(standard, Outcome::Skipped(_)) && linear.is_none() {
                last = after;
            }
            timed[i].push(Timed {
                flash,
                standard,
                linear,
                ceiling,
            });
            bar.inc(1);
        }
    }
    let rows = configs
        .iter()
        .zip(timed)
        .map(|((pass, cfg), rounds)| {
            let flash: Vec<Measurement> = rounds.iter().map(|t| t.flash).collect();
            let shares: Option<Vec<f64>> = rounds
                .iter()
                .map(|t| t.ceiling.map(|g| 100.0 * t.flash.gflops / g))
                .collect();
            let gemm_percent = shares.filter(|s| !s.is_empty()).map(median);
            let around: Option<Vec<f64>> = rounds.iter().map(|t| t.ceiling).collect();
            let gemm_ceiling = around.filter(|g| !g.is_empty()).map(median);
            let linear: Option<Vec<Outcome>> = rounds.iter().map(|t| t.linear.clone()).collect();
            Row {
                pass: *pass,
                config: cfg.clone(),
                device: a.device,
                flash: median_measurement(&flash),
                standard_device: a.device,
                standard: median_outcome(rounds.into_iter().map(|t| t.standard).collect()),
                linear: linear.map(median_outcome),
                gemm_percent,
                gemm_ceiling,
            }
        })
        .collect();
    let gemm_gflops = (!ceilings.is_empty()).then(|| median(ceilings));
    Ok(Sweep { rows, gemm_gflops })
}

/// One round's figures of one configuration.
#[derive(Clone)]
struct Timed {
    flash: Measurement,
    standard: Outcome,
    linear: Option<Outcome>,
    /// The sgemm rate timed around flashattn, with `--gemm`.
    ceiling: Option<f64>,
}

/// The median of `v` (not empty; the lower middle of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) / 2]
}

/// The round of median time (the lower middle of an even count), with the largest extra
/// memory of any round.
pub fn median_measurement(rounds: &[Measurement]) -> Measurement {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(|x, y| x.time_ms.total_cmp(&y.time_ms));
    let mut m = sorted[(sorted.len() - 1) / 2];
    if let Some(most) = rounds.iter().map(|r| r.extra).max_by_key(|e| e.bytes()) {
        m.extra = most;
    }
    m
}

/// A baseline over the rounds: skipped when any round skipped it, else the median round.
fn median_outcome(rounds: Vec<Outcome>) -> Outcome {
    let mut ran = Vec::new();
    for outcome in rounds {
        match outcome {
            Outcome::Ran(m) => ran.push(m),
            skipped => return skipped,
        }
    }
    Outcome::Ran(median_measurement(&ran))
}

/// A progress bar of `steps` steps on stderr, its clock ticking on its own so that it moves
/// during long configurations.
pub fn progress_bar(steps: usize) -> CliResult<ProgressBar> {
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}",
        )
        .map_err(|e| fail(format!("progress bar template: {e}")))?,
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    Ok(bar)
}

/// Runs the sweep; prints the table and writes the chart and JSON asked for.
pub fn run(a: &BenchArgs) -> CliResult<()> {
    a.validate()?;
    if a.layer {
        return layer_bench::run(a);
    }
    device::ensure_available(a.device)?;
    for path in [&a.plot, &a.json].into_iter().flatten() {
        output::check_writable(path)?;
    }
    if let Some(p) = &a.plot {
        plot::check_extension(p)?;
    }
    let configs = configs(a);
    if let Some(note) = timing::load_note() {
        eprintln!("note: {note}");
    }
    let bar = progress_bar(configs.len() * a.rounds as usize)?;
    let swept = sweep(a, &configs, &bar);
    bar.finish_and_clear();
    let Sweep { rows, gemm_gflops } = swept?;
    print!("{}", bench_table::render(&rows, a, gemm_gflops));
    for line in device::compile_report(a.device)? {
        println!("kernel {line}");
    }
    // Built with the `profile` feature: where the CPU forward's cycles went.
    if let Some(profile) = flashattn::internals::forward_profile() {
        print!("{profile}");
    }
    if let Some(path) = &a.json {
        json::write(path, &rows)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &a.plot {
        plot::write(path, &rows)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_is_skipped_past_the_available_memory() {
        const GIB: u64 = 1 << 30;
        // B=1 H=8 N=32768: the f32 scores alone are 32 GiB.
        let why = too_big(32 * GIB, Some(20 * GIB)).expect("skipped");
        assert!(
            why.contains("32.0 GiB") && why.contains("20.0 GiB"),
            "{why}"
        );
        assert_eq!(too_big(GIB, Some(20 * GIB)), None);
        assert_eq!(too_big(32 * GIB, None), None);
    }

    fn timed(time_ms: f64, extra: u64) -> Measurement {
        Measurement {
            time_ms,
            gflops: 1.0 / time_ms,
            extra: Extra::Measured(extra),
        }
    }

    #[test]
    fn rounds_keep_the_median_time_and_the_largest_memory() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.0);
        let m = median_measurement(&[timed(5.0, 10), timed(2.0, 30), timed(4.0, 20)]);
        assert_eq!(
            (m.time_ms, m.gflops, m.extra),
            (4.0, 0.25, Extra::Measured(30))
        );
        let ran = || Outcome::Ran(timed(1.0, 1));
        let skipped = Outcome::Skipped("too big".into());
        assert!(matches!(
            median_outcome(vec![ran(), skipped, ran()]),
            Outcome::Skipped(why) if why == "too big"
        ));
        assert!(matches!(
            median_outcome(vec![ran(), ran()]),
            Outcome::Ran(m) if m.time_ms == 1.0
        ));
    }
}
