//! `flashattn check`: configurations against the f64 oracle, one PASS/FAIL line per pass.

use std::time::Instant;

use flashattn::{DType, Error};

use super::accuracy::{self, BackwardCheck, ForwardCheck};
use super::args::{BenchArgs, CheckArgs};
use super::inputs::Config;
use super::{CliError, CliResult, bench, device, fail};

const ALL_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The default set: every mask kind, GQA/MQA, Nq ≠ Nk, varlen with an empty sequence, ALiBi,
/// softcap, bias, a relative-position table, both layouts and every dtype, at sizes the f64 oracle handles in a few seconds.
fn default_set(dtypes: &[DType]) -> Vec<Config> {
    let bhnd = super::args::Layout::Bhnd;
    let mut set = Vec::new();
    for &t in dtypes {
        let base = [
            Config::new(2, 4, 256, 64),
            Config::new(2, 8, 500, 64).kv_heads(2).causal(),
            Config::new(1, 4, 0, 80)
                .seqlens(200, 300)
                .causal()
                .layout(bhnd),
            Config::new(1, 4, 300, 64)
                .window(Some(64), Some(16))
                .softcap(30.0)
                .alibi(),
            Config::new(2, 2, 128, 32).kv_heads(1).bias(),
            Config::new(1, 4, 0, 64)
                .kv_heads(2)
                .varlen(&[(100, 120), (0, 50), (257, 257), (31, 7)])
                .causal(),
            Config::new(1, 2, 65, 256).seqlens(65, 113),
            Config::new(2, 4, 0, 64)
                .kv_heads(2)
                .seqlens(150, 200)
                .causal()
                .rel_bias(64),
        ];
        set.extend(base.into_iter().map(|c| c.dtype(t)));
    }
    set
}

/// The single configuration the options describe (for each dtype asked for).
fn single(a: &CheckArgs, dtypes: &[DType]) -> CliResult<Vec<Config>> {
    let window = a.mask.window()?;
    let n = a.seqlen.unwrap_or(512);
    let heads = a.heads.unwrap_or(8);
    let d = a.head_dim.unwrap_or(64);
    let configs = dtypes
        .iter()
        .map(|&t| {
            let mut c = Config::new(a.batch.unwrap_or(2), heads, n, d)
                .kv_heads(a.heads_kv.unwrap_or(heads))
                .seqlens(a.seqlen_q.unwrap_or(n), a.seqlen_k.unwrap_or(n))
                .layout(a.layout)
                .dtype(t);
            c.dv = a.head_dim_v.unwrap_or(d);
            c.window = window;
            c.softcap = a.mask.softcap;
            c.scale = a.mask.scale;
            c.diagonal = a.mask.diagonal;
            c.alibi = a.alibi;
            c.bias = a.bias;
            c.rel_bias = a.rel_bias.map(|l| l as usize);
            c
        })
        .collect::<Vec<_>>();
    Ok(configs)
}

fn verdict(pass: bool) -> &'static str {
    if pass { "[PASS]" } else { "[FAIL]" }
}

fn standard_note(standard: Option<f64>, bound: f64) -> String {
    match standard {
        Some(s) => format!("bound {bound:.1e}, standard {s:.1e}"),
        None => format!("bound {bound:.1e}"),
    }
}

fn forward_line(c: &Config, f: &ForwardCheck) -> String {
    format!(
        "{} forward {}: max abs error {:.1e}, rel {:.1e} ({}), lse {:.1e}",
        verdict(f.pass()),
        c.describe(),
        f.max_abs,
        f.rel,
        standard_note(f.standard, f.bound),
        f.lse
    )
}

fn backward_line(c: &Config, b: &BackwardCheck) -> String {
    let max_abs = b.grads.iter().map(|g| g.max_abs).fold(0.0, f64::max);
    let rel = b.grads.iter().map(|g| g.rel).fold(0.0, f64::max);
    let each: Vec<String> = b
        .grads
        .iter()
        .map(|g| format!("{} {:.1e}", g.name, g.rel))
        .collect();
    let bound = b.worst().map_or(String::new(), |g| {
        format!(
            "; closest to its bound: {}, {}",
            g.name,
            standard_note(g.standard, g.bound)
        )
    });
    format!(
        "{} backward {}: max abs error {:.1e}, rel {:.1e} ({}{bound})",
        verdict(b.pass()),
        c.describe(),
        max_abs,
        rel,
        each.join(", ")
    )
}

/// A pass the backend does not provide (an `Unsupported` error) is reported and skipped.
fn skipped(e: &CliError) -> bool {
    matches!(e, CliError::Lib(Error::Unsupported { .. }))
}

/// Runs the checks; `Ok(false)` when any configuration is out of bounds.
pub fn run(a: &CheckArgs) -> CliResult<bool> {
    device::ensure_available(a.device)?;
    let configs = if a.is_single() {
        let dtypes = if a.dtype.is_empty() {
            vec![DType::F32]
        } else {
            a.dtype.clone()
        };
        single(a, &dtypes)?
    } else {
        let dtypes = if a.dtype.is_empty() {
            ALL_DTYPES.to_vec()
        } else {
            a.dtype.clone()
        };
        default_set(&dtypes)
    };
    let tightened = if a.tighten > 1.0 {
        format!(", every bound divided by {}", a.tighten)
    } else {
        String::new()
    };
    println!(
        "flashattn check on {}: {} configuration(s) against the f64 oracle (seed {}); bounds: f32 \
         rel <= 1e-5, f16/bf16 <= 2x the standard attention's error in the same precision{tightened}",
        a.device,
        configs.len(),
        a.seed
    );
    let start = Instant::now();
    let (mut passed, mut failed, mut skips) = (0, 0, 0);
    let mut tally = |ok: bool, line: String| {
        println!("{line}");
        if ok { passed += 1 } else { failed += 1 }
    };
    for (i, c) in configs.iter().enumerate() {
        let x = c.inputs(a.seed + i as u64)?;
        // The oracle is single-threaded: the two passes run side by side.
        let (fwd, bwd) = rayon::join(
            || accuracy::check_forward(&x, c.dtype, a.device),
            || (!a.forward_only).then(|| accuracy::check_backward(&x, c.dtype, a.device)),
        );
        match fwd {
            Ok(f) => {
                let f = f.tightened(a.tighten);
                tally(f.pass(), forward_line(c, &f))
            }
            Err(e) if skipped(&e) => {
                println!("[SKIP] forward {}: {e}", c.describe());
                skips += 1;
            }
            Err(e) => return Err(fail(format!("forward {}: {e}", c.describe()))),
        }
        match bwd {
            None => {}
            Some(Ok(b)) => {
                let b = b.tightened(a.tighten);
                tally(b.pass(), backward_line(c, &b))
            }
            Some(Err(e)) if skipped(&e) => {
                println!("[SKIP] backward {}: {e}", c.describe());
                skips += 1;
            }
            Some(Err(e)) => return Err(fail(format!("backward {}: {e}", c.describe()))),
        }
    }
    let skip_note = if skips > 0 {
        format!(", {skips} skipped")
    } else {
        String::new()
    };
    println!(
        "check: {passed} passed, {failed} failed{skip_note} ({:.1} s)",
        start.elapsed().as_secs_f64()
    );
    if passed + failed == 0 {
        return Err(fail(format!(
            "nothing could be checked on {}: every pass was skipped",
            a.device
        )));
    }
    if failed > 0 {
        return Ok(false);
    }
    if a.bench {
        println!();
        bench::run(&BenchArgs::short(a.device))?;
    }
    Ok(true)
}
