//! `bench --json`: every figure, one object per configuration and method.

use std::path::Path;

use serde::Serialize;

use super::bench::{Outcome, Pass, Row};
use super::inputs::Config;
use super::output::write_bytes_atomic;
use super::timing::Measurement;
use super::{CliResult, fail};

/// One configuration and method.
#[derive(Serialize)]
struct Record {
    /// `flashattn`, `standard` or `linear` (linear attention, with `--linear`).
    method: &'static str,
    device: String,
    dtype: &'static str,
    /// Memory layout of q, k, v (and dout): `bnhd` or `bhnd`.
    layout: &'static str,
    /// `forward` or `backward`.
    pass: &'static str,
    batch: usize,
    heads: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    /// Fastest run; `null` when skipped.
    time_ms: Option<f64>,
    /// FLOP rate of the fastest run in GFLOP/s (linear attention's by its own count,
    /// `2·B·D·Dv·(HK·Nk + H·Nq)` a forward); `null` when skipped.
    gflops: Option<f64>,
    /// Memory beyond inputs and outputs; `null` when skipped or not measured.
    extra_memory_bytes: Option<u64>,
    /// How `extra_memory_bytes` was obtained (`measured host heap peak` on the CPU, `measured
    /// device memory pool peak` on a GPU, `planned device allocation` for the GPU baseline where
    /// the pool cannot be read), `null` when unknown.
    extra_memory_source: Option<&'static str>,
    /// Why the method did not run, when it did not.
    skipped: Option<String>,
    /// flashattn's rate as a percentage of the sgemm rate timed around it (median over the
    /// rounds), with `--gemm`; `null` otherwise and for the standard attention.
    gemm_percent: Option<f64>,
    /// The sgemm rate `gemm_percent` is a share of, in GFLOP/s: the mean of the sgemm timed just
    /// before and just after flashattn (median over the rounds); `null` where `gemm_percent` is.
    gemm_gflops: Option<f64>,
}

fn record(r: &Row, method: &'static str, device: String, m: Option<&Measurement>) -> Record {
    let mut rec = config_record(&r.config, r.pass, method, device);
    rec.time_ms = m.map(|m| m.time_ms);
    rec.gflops = m.map(|m| m.gflops);
    rec.extra_memory_bytes = m.and_then(|m| m.extra.bytes());
    rec.extra_memory_source = m.and_then(|m| m.extra.source());
    rec
}

/// A record of configuration `c` with no figures yet.
fn config_record(c: &Config, pass: Pass, method: &'static str, device: String) -> Record {
    Record {
        method,
        device,
        dtype: c.dtype.name(),
        layout: c.layout.name(),
        pass: pass.name(),
        batch: c.batch,
        heads: c.heads,
        heads_kv: c.heads_kv,
        seqlen_q: c.nq,
        seqlen_k: c.nk,
        head_dim: c.d,
        causal: c.is_causal(),
        time_ms: None,
        gflops: None,
        extra_memory_bytes: None,
        extra_memory_source: None,
        skipped: None,
        gemm_percent: None,
        gemm_gflops: None,
    }
}

/// The records of `rows` as a JSON array.
pub fn to_json(rows: &[Row]) -> CliResult<String> {
    let mut records = Vec::new();
    for r in rows {
        let mut flash = record(r, "flashattn", r.device.to_string(), Some(&r.flash));
        (flash.gemm_percent, flash.gemm_gflops) = (r.gemm_percent, r.gemm_ceiling);
        records.push(flash);
        let baselines = [
            ("standard", r.standard_device, Some(&r.standard)),
            ("linear", r.device, r.linear.as_ref()),
        ];
        for (method, device, outcome) in baselines {
            match outcome {
                None => {}
                Some(Outcome::Ran(m)) => {
                    records.push(record(r, method, device.to_string(), Some(m)))
                }
                Some(Outcome::Skipped(why)) => {
                    let mut rec = record(r, method, device.to_string(), None);
                    rec.skipped = Some(why.clone());
                    records.push(rec);
                }
            }
        }
    }
    serde_json::to_string_pretty(&records).map_err(|e| fail(format!("json: {e}")))
}

/// Writes the records of `rows` to `path` (atomically).
pub fn write(path: &Path, rows: &[Row]) -> CliResult<()> {
    let mut text = to_json(rows)?;
    text.push('\n');
    write_bytes_atomic(path, text.as_bytes())
}
