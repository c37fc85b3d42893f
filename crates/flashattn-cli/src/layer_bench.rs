//! `bench --layer`: the fused layer (`layer_forward`, `layer_backward`) beside the same steps as
//! separate calls (`reference::unfused_layer`), time and peak memory, on the device of
//! `--device`: on the CPU the peak of heap bytes, on a GPU the peak of its memory pool (see
//! [`measure`]).

use flashattn::internals::Problem;
use flashattn::reference::unfused_layer;
use flashattn::{
    AttentionParams, Device, LayerGradients, LayerParams, LayerWeights, Rope, RopeStyle, Tensor,
    layer_backward, layer_forward,
};
use rand::{RngExt, SeedableRng, rngs::StdRng};

use super::args::{BenchArgs, Layout};
use super::bench::{
    BACKWARD_FLOP_FACTOR, Pass, causal_choices, median_measurement, passes, progress_bar,
};
use super::inputs::Config;
use super::memory::human;
use super::table::Table;
use super::timing::{Measurement, measure};
use super::{CliResult, device, fail};

/// Refuses the options `--layer` does not take.
pub fn validate(a: &BenchArgs) -> CliResult<()> {
    let others = [
        (a.linear, "--linear"),
        (a.gemm, "--gemm"),
        (a.no_standard, "--no-standard"),
        (a.plot.is_some(), "--plot"),
        (a.json.is_some(), "--json"),
        (a.seqlens_k.is_some(), "--seqlens-k"),
        (a.layout != [Layout::Bnhd], "--layout"),
    ];
    if let Some((_, opt)) = others.iter().find(|(given, _)| *given) {
        return Err(fail(format!("{opt} is not an option of bench --layer")));
    }
    if let Some(hk) = a.heads_kv.filter(|hk| !a.heads.is_multiple_of(*hk)) {
        return Err(fail(format!(
            "--heads-kv {hk}: the key/value heads must divide --heads {}",
            a.heads
        )));
    }
    Ok(())
}

/// One configuration: sizes, dtype, mask and pass.
struct LayerConfig {
    attention: Config,
    model_dim: usize,
    pass: Pass,
}

/// Random x, weights (scaled so the projections stay of order 1), dy, and the params, on the
/// device the call runs on.
struct LayerInputs {
    x: Tensor,
    w: LayerWeights,
    dy: Tensor,
    p: LayerParams,
}

fn inputs(c: &LayerConfig, seed: u64, dev: Device) -> CliResult<LayerInputs> {
    let a = &c.attention;
    let mut rng = StdRng::seed_from_u64(seed);
    let (m, hd) = (c.model_dim, a.heads * a.d);
    let cols = (a.heads + 2 * a.heads_kv) * a.d;
    let mut t = |shape: &[usize], amplitude: f32| -> CliResult<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-amplitude..amplitude))
            .collect();
        Ok(Tensor::from_vec(v, shape)?
            .to_dtype(a.dtype)?
            .to_device(dev)?)
    };
    let rows = [a.batch, a.nq, m];
    let w = LayerWeights {
        w_qkv: t(&[m, cols], 1.7 / (m as f32).sqrt())?,
        b_qkv: Some(t(&[cols], 0.5)?),
        w_o: t(&[hd, m], 1.7 / (hd as f32).sqrt())?,
        b_o: Some(t(&[m], 0.5)?),
    };
    let (x, dy) = (t(&rows, 1.7)?, t(&rows, 1.7)?);
    let attention = AttentionParams {
        window: a.window,
        ..Default::default()
    };
    let p = LayerParams::new(a.heads, a.heads_kv)
        .rope(Rope::new(RopeStyle::Half))
        .attention(attention);
    Ok(LayerInputs { x, w, dy, p })
}

/// The FLOPs of one call: the two projections' GEMMs and the attention (a backward counts the
/// GEMMs twice more and the attention [`BACKWARD_FLOP_FACTOR`] times more).
fn flops(c: &LayerConfig, seed: u64) -> CliResult<f64> {
    let a = &c.attention;
    let x = a.inputs(seed)?;
    let attention = Problem::new(&x.q, &x.k, &x.v, &x.p)?.forward_flops();
    let rows = (a.batch * a.nq) as f64;
    let cols = ((a.heads + 2 * a.heads_kv) * a.d) as f64;
    let gemms = 2.0 * rows * c.model_dim as f64 * (cols + (a.heads * a.d) as f64);
    Ok(match c.pass {
        Pass::Forward => gemms + attention,
        Pass::Backward => 3.0 * gemms + (1.0 + BACKWARD_FLOP_FACTOR) * attention,
    })
}

/// The gradients as the call's results.
fn grads(g: LayerGradients) -> Vec<Tensor> {
    [g.dx, g.dw_qkv, g.dw_o]
        .into_iter()
        .chain(g.db_qkv)
        .chain(g.db_o)
        .collect()
}

/// The fused layer's and the separate calls' figures for `c` on `dev`.
fn time(
    c: &LayerConfig,
    seed: u64,
    repeats: u32,
    dev: Device,
) -> CliResult<(Measurement, Measurement)> {
    let i = inputs(c, seed, dev)?;
    let f = flops(c, seed)?;
    let (x, w, p, dy) = (&i.x, &i.w, &i.p, &i.dy);
    let fused = match c.pass {
        Pass::Forward => measure(dev, repeats, f, || Ok(vec![layer_forward(x, w, p)?.y]))?,
        Pass::Backward => measure(dev, repeats, f, || {
            let fwd = layer_forward(x, w, p)?;
            Ok(grads(layer_backward(x, w, p, &fwd, dy)?))
        })?,
    };
    let separate = match c.pass {
        Pass::Forward => measure(dev, repeats, f, || {
            Ok(vec![unfused_layer::forward(x, w, p)?.y])
        })?,
        Pass::Backward => measure(dev, repeats, f, || {
            let fwd = unfused_layer::forward(x, w, p)?;
            Ok(grads(unfused_layer::backward(x, w, p, &fwd, dy)?))
        })?,
    };
    Ok((fused, separate))
}

/// The configurations of `a`, in table order (dtype, head dim, mask, pass, length).
fn configs(a: &BenchArgs) -> Vec<LayerConfig> {
    let (causal, passes) = (causal_choices(a), passes(a));
    let mut out = Vec::new();
    for &dtype in &a.dtype {
        for &d in &a.head_dims {
            for &c in causal {
                for &pass in passes {
                    for &n in &a.seqlens {
                        let mut cfg = Config::new(a.batch, a.heads, n, d)
                            .kv_heads(a.heads_kv.unwrap_or(a.heads))
                            .dtype(dtype);
                        if c {
                            cfg = cfg.causal();
                        }
                        out.push(LayerConfig {
                            model_dim: a.model_dim.unwrap_or(a.heads * d),
                            attention: cfg,
                            pass,
                        });
                    }
                }
            }
        }
    }
    out
}

/// Every configuration timed in each of `--rounds` rounds, one after the other; the medians.
fn rounds(
    a: &BenchArgs,
    configs: &[LayerConfig],
    bar: &indicatif::ProgressBar,
) -> CliResult<Vec<(Measurement, Measurement)>> {
    let mut timed = vec![(Vec::new(), Vec::new()); configs.len()];
    for _ in 0..a.rounds {
        for (i, c) in configs.iter().enumerate() {
            bar.set_message(format!("{} {}", c.pass.name(), c.attention.describe()));
            let (fused, sep) = time(c, a.seed + i as u64, a.repeats, a.device)?;
            timed[i].0.push(fused);
            timed[i].1.push(sep);
            bar.inc(1);
        }
    }
    Ok(timed
        .iter()
        .map(|(f, s)| (median_measurement(f), median_measurement(s)))
        .collect())
}

fn peak(m: &Measurement) -> String {
    m.extra.bytes().map_or("-".to_string(), human)
}

/// Times every configuration and prints the table.
pub fn run(a: &BenchArgs) -> CliResult<()> {
    device::ensure_available(a.device)?;
    let configs = configs(a);
    let mut t = Table::new(&[
        "pass", "mask", "dtype", "B", "H", "N", "M", "D", "fused ms", "GFLOP/s", "peak", "sep ms",
        "GFLOP/s", "peak", "speedup", "memory",
    ]);
    let bar = progress_bar(configs.len() * a.rounds as usize)?;
    let timed = rounds(a, &configs, &bar);
    bar.finish_and_clear();
    for (c, (fused, sep)) in configs.iter().zip(timed?) {
        let x = &c.attention;
        let ratio = match (fused.extra.bytes(), sep.extra.bytes()) {
            (Some(f), Some(s)) if f > 0 => format!("{:.2}x", s as f64 / f as f64),
            _ => "-".to_string(),
        };
        t.push(vec![
            match c.pass {
                Pass::Forward => "forward",
                Pass::Backward => "fwd+bwd",
            }
            .to_string(),
            if x.is_causal() { "causal" } else { "full" }.to_string(),
            x.dtype.to_string(),
            x.batch.to_string(),
            x.heads_label(),
            x.nq.to_string(),
            c.model_dim.to_string(),
            x.d.to_string(),
            format!("{:.2}", fused.time_ms),
            format!("{:.1}", fused.gflops),
            peak(&fused),
            format!("{:.2}", sep.time_ms),
            format!("{:.1}", sep.gflops),
            peak(&sep),
            format!("{:.2}x", sep.time_ms / fused.time_ms),
            ratio,
        ]);
    }
    let rounds = match a.rounds {
        1 => String::new(),
        r => format!(", median over {r} rounds"),
    };
    let (runs, memory) = match a.device {
        Device::Cpu => ("runs", "heap"),
        Device::Cuda(_) => ("batches", "device memory (the GPU's memory pool)"),
    };
    println!(
        "flashattn bench --layer on {}: the fused layer beside the same steps as separate calls \
         (rope half over the whole head, both biases); fastest of {} {runs}{rounds}; peak = peak \
         {memory} during the call beyond what it returns (forward: y; fwd+bwd: the gradients); \
         speedup = separate time / fused time; memory = separate peak / fused peak",
        a.device, a.repeats
    );
    print!("{}", t.render());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::Extra;
    use flashattn::DType;

    #[test]
    fn the_inputs_are_random_and_of_the_dtype() {
        let c = LayerConfig {
            attention: Config::new(1, 2, 5, 4).kv_heads(1).dtype(DType::BF16),
            model_dim: 6,
            pass: Pass::Forward,
        };
        let i = inputs(&c, 1, Device::Cpu).unwrap();
        assert_eq!(i.w.w_qkv.shape(), &[6, 16]);
        assert_eq!(i.x.dtype(), DType::BF16);
        let x = i.x.to_f64_vec().unwrap();
        assert!(x.iter().all(|v| *v != 0.0));
        assert!(matches!(
            time(&c, 1, 1, Device::Cpu).unwrap().0.extra,
            Extra::Measured(_)
        ));
    }
}
