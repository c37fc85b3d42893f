//! `flashattn bench`'s table: time, rate and extra memory of flashattn, the standard attention
//! and (with `--linear`) linear attention, and the notes under it.

use flashattn::Device;

use super::args::{BenchArgs, Layout};
use super::bench::{GEMM_N, Outcome, Row};
use super::linear_bench;
use super::memory::human;
use super::table::Table;
use super::timing::{Extra, Measurement};

/// The FLOP rate in the table's unit for runs on `device` (GFLOP/s on the CPU, TFLOP/s on a GPU).
fn rate(m: &Measurement, device: Device) -> String {
    match device {
        Device::Cpu => format!("{:.1}", m.gflops),
        Device::Cuda(_) => format!("{:.1}", m.gflops / 1e3),
    }
}

/// An extra-memory cell: measured bytes, planned bytes marked `*`, or `n/a`.
fn extra_cell(e: Extra) -> String {
    match e {
        Extra::Measured(b) | Extra::Device(b) => human(b),
        Extra::Planned(b) => format!("{}*", human(b)),
        Extra::Unknown => "n/a".into(),
    }
}

/// The table and the notes under it; `gemm_gflops` is the sgemm rate of `--gemm`.
pub fn render(rows: &[Row], a: &BenchArgs, gemm_gflops: Option<f64>) -> String {
    let unit = match a.device {
        Device::Cpu => "GFLOP/s",
        Device::Cuda(_) => "TFLOP/s",
    };
    // The key length gets a column of its own where it may differ from the query length.
    let keys = a.seqlens_k.is_some();
    // So does the layout where a row is not in the default one.
    let layouts = rows.iter().any(|r| r.config.layout != Layout::Bnhd);
    let mut head = vec!["pass", "mask", "dtype"];
    if layouts {
        head.push("layout");
    }
    head.extend(["B", "H", "N"]);
    if keys {
        head.push("Nk");
    }
    head.extend(["D", "flash ms", unit]);
    if gemm_gflops.is_some() {
        head.push("% GEMM");
    }
    head.extend(["extra", "std ms", unit, "extra", "speedup", "memory"]);
    if a.linear {
        head.extend(["lin ms", "extra", "flash/lin"]);
    }
    let mut t = Table::new(&head);
    let mut notes = Vec::new();
    // Why linear attention did not run, each reason once (on a GPU it is every row's).
    let mut linear_skips: Vec<&str> = Vec::new();
    for r in rows {
        let c = &r.config;
        let mut cells = vec![
            r.pass.name().to_string(),
            if c.is_causal() { "causal" } else { "full" }.to_string(),
            c.dtype.to_string(),
        ];
        if layouts {
            cells.push(c.layout.name().to_string());
        }
        cells.extend([c.batch.to_string(), c.heads_label(), c.nq.to_string()]);
        if keys {
            cells.push(c.nk.to_string());
        }
        cells.extend([
            c.d.to_string(),
            format!("{:.2}", r.flash.time_ms),
            rate(&r.flash, r.device),
        ]);
        cells.extend(r.gemm_percent.map(|p| format!("{p:.1}")));
        cells.push(extra_cell(r.flash.extra));
        match &r.standard {
            Outcome::Ran(s) => cells.extend([
                format!("{:.2}", s.time_ms),
                rate(s, a.device),
                extra_cell(s.extra),
                format!("{:.2}x", s.time_ms / r.flash.time_ms),
                match (s.extra.bytes(), r.flash.extra.bytes()) {
                    (Some(a), Some(b)) if b > 0 => format!("{:.0}x", a as f64 / b as f64),
                    _ => "-".into(),
                },
            ]),
            Outcome::Skipped(why) => {
                cells.extend([
                    "skipped".to_string(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ]);
                notes.push(format!(
                    "standard attention skipped at {} {}: {why}",
                    r.pass.name(),
                    c.describe()
                ));
            }
        }
        match &r.linear {
            None => {}
            Some(Outcome::Ran(l)) => cells.extend([
                format!("{:.2}", l.time_ms),
                extra_cell(l.extra),
                format!("{:.2}x", r.flash.time_ms / l.time_ms),
            ]),
            Some(Outcome::Skipped(why)) => {
                cells.extend(["skipped".to_string(), "-".into(), "-".into()]);
                if !linear_skips.contains(&why.as_str()) {
                    linear_skips.push(why);
                }
            }
        }
        t.push(cells);
    }
    let heap = match a.device {
        Device::Cpu => "peak heap",
        Device::Cuda(_) => "peak device memory (the GPU's memory pool)",
    };
    let rounds = match a.rounds {
        1 => String::new(),
        r => format!(", median over {r} rounds"),
    };
    let mut out = format!(
        "flashattn bench on {}: fastest of {} runs{rounds}; extra = {heap} beyond inputs and \
         outputs; speedup = standard time / flashattn time; memory = standard extra / flashattn \
         extra\n",
        a.device, a.repeats
    );
    if a.linear {
        out += "linear attention (elu+1, eps 1e-6): flash/lin = flashattn time / linear time (> 1: \
                linear is faster)\n";
    }
    if let Some(g) = gemm_gflops {
        out += &format!(
            "sgemm {GEMM_N}x{GEMM_N}x{GEMM_N} f32 on {} threads: {g:.1} GFLOP/s (median of its \
             timings); % GEMM = flashattn's rate / the mean of the sgemm rates timed just before \
             and after it\n",
            rayon::current_num_threads()
        );
    }
    out += &t.render();
    if rows
        .iter()
        .any(|r| matches!(r.standard, Outcome::Ran(m) if matches!(m.extra, Extra::Planned(_))))
    {
        out += "*: device memory the standard attention allocates by design (this GPU has no \
                memory pool to measure it); flashattn's is not measured (n/a)\n";
    }
    if rows.iter().any(|r| r.flash.extra.bytes() == Some(0)) {
        out += "memory -: flashattn allocated nothing beyond its inputs and outputs (the ratio has \
                no finite value)\n";
    }
    for n in notes {
        out += &format!("note: {n}\n");
    }
    for why in linear_skips {
        out += &format!("note: linear attention skipped: {why}\n");
    }
    for line in linear_bench::crossover(rows) {
        out += &format!("linear vs flashattn, {line}\n");
    }
    out
}
