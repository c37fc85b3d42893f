//! `flashattn bench --paired P`: causal against full attention, call for call.
//!
//! The second target, causal as fast per FLOP as full, compares two rates. Timed apart,
//! each the fastest of a few calls, they drift by several percent from one run to the next on a
//! shared machine whose clock moves: on the 2-vCPU Zen 1 VM of 2026-11-29, six one-thread runs
//! of `bench --seqlens 1024 --gemm` within an hour (four with the `profile` feature) gave
//! 85.0–86.9% of the sgemm causal and 86.7–94.1% full. Here the two masks' calls alternate in
//! one loop, so that a slow spell weighs on both: each pair of calls gives the ratio of causal's
//! time per visible (query, key) pair to full's, and the table gives the median and the
//! quartiles of those ratios. On that VM (forward, f32, B=1, H=8, D=64, N=1024) the median was
//! 1.056 and 1.058 in two one-thread runs of 40 pairs, 1.052–1.066 in four two-thread runs of 60.

use std::time::Instant;

use indicatif::ProgressBar;

use super::args::{BenchArgs, Layout};
use super::bench::{FlashCall, Pass, flash_call, forward_flops};
use super::inputs::Config;
use super::table::Table;
use super::{CliResult, fail};

/// One configuration's ratios: causal's time per visible pair over full's.
#[derive(Clone, Debug)]
pub struct PairedRow {
    pub pass: Pass,
    /// The full-attention configuration (the causal one differs by its mask alone).
    pub config: Config,
    /// Quartiles of the ratios over the pairs of calls: lower, median, upper.
    pub quartiles: [f64; 3],
    /// Pairs of calls timed.
    pub pairs: u32,
}

/// Times `pairs` pairs of calls of each full-attention configuration and of the same with a
/// causal mask (full first in even pairs, causal first in odd ones), advancing `bar` by one per
/// configuration.
pub fn measure(
    a: &BenchArgs,
    pairs: u32,
    configs: &[(Pass, Config)],
    bar: &ProgressBar,
) -> CliResult<Vec<PairedRow>> {
    let mut rows = Vec::new();
    for (i, (pass, cfg)) in configs.iter().enumerate() {
        bar.set_message(format!("paired {} {}", pass.name(), cfg.describe()));
        let seed = a.seed + i as u64;
        let (full, causal) = (cfg.inputs(seed)?, cfg.clone().causal().inputs(seed)?);
        let (full_work, causal_work) = (
            forward_flops(&full, *pass)?.1,
            forward_flops(&causal, *pass)?.1,
        );
        let (mut full_call, mut causal_call) =
            (flash_call(&full, *pass)?, flash_call(&causal, *pass)?);
        let timed = |call: &mut FlashCall<'_>| -> CliResult<f64> {
            let t = Instant::now();
            call()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let mut ratios = Vec::with_capacity(pairs as usize);
        for k in 0..pairs {
            let (t_full, t_causal) = if k % 2 == 0 {
                let t = timed(&mut full_call)?;
                (t, timed(&mut causal_call)?)
            } else {
                let t = timed(&mut causal_call)?;
                (timed(&mut full_call)?, t)
            };
            ratios.push(per_pair_ratio((t_causal, causal_work), (t_full, full_work)));
        }
        let quartiles = quartiles(ratios).ok_or_else(|| fail("--paired: no pairs timed"))?;
        rows.push(PairedRow {
            pass: *pass,
            config: cfg.clone(),
            quartiles,
            pairs,
        });
        bar.inc(1);
    }
    Ok(rows)
}

/// Causal's time per unit of work over full's, each given as (seconds, work): the work being
/// FLOPs, in proportion to the (query, key) pairs a mask lets a call see.
fn per_pair_ratio((t_causal, causal): (f64, f64), (t_full, full): (f64, f64)) -> f64 {
    (t_causal / causal) / (t_full / full)
}

/// The lower quartile, the median and the upper quartile of `v` (nearest rank), or `None`
/// when it is empty.
fn quartiles(mut v: Vec<f64>) -> Option<[f64; 3]> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Some([at(0.25), at(0.5), at(0.75)])
}

/// The table of ratios, with its heading.
pub fn render(rows: &[PairedRow]) -> String {
    let Some(first) = rows.first() else {
        return String::new();
    };
    // The layout gets a column where a row is not in the default one (as in the sweep's table).
    let layouts = rows.iter().any(|r| r.config.layout != Layout::Bnhd);
    let mut head = vec!["pass", "dtype"];
    if layouts {
        head.push("layout");
    }
    head.extend(["B", "H", "N", "Nk", "D", "causal/full", "quartiles"]);
    let mut t = Table::new(&head);
    for r in rows {
        let c = &r.config;
        let [lo, mid, hi] = r.quartiles;
        let mut cells = vec![r.pass.name().to_string(), c.dtype.to_string()];
        if layouts {
            cells.push(c.layout.name().to_string());
        }
        cells.extend([
            c.batch.to_string(),
            c.heads_label(),
            c.nq.to_string(),
            c.nk.to_string(),
            c.d.to_string(),
            format!("{mid:.3}"),
            format!("{lo:.3}-{hi:.3}"),
        ]);
        t.push(cells);
    }
    format!(
        "causal against full, time per visible (query, key) pair, {} interleaved pairs of \
         calls: median ratio and quartiles (1.000 = as fast per FLOP)\n{}",
        first.pairs,
        t.render()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_per_visible_pair_and_quartiles_by_rank() {
        // Causal does half the work in 0.55 of the time: 1.1 times full's time per pair.
        let r = per_pair_ratio((0.55, 1.0), (1.0, 2.0));
        assert!((r - 1.1).abs() < 1e-12, "{r}");
        assert_eq!(quartiles(vec![]), None);
        assert_eq!(quartiles(vec![2.0]), Some([2.0; 3]));
        assert_eq!(
            quartiles(vec![5.0, 1.0, 4.0, 2.0, 3.0]),
            Some([2.0, 3.0, 4.0])
        );
    }
}
