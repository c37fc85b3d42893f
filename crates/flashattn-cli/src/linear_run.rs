//! `flashattn run --kind linear`: linear attention of q, k, v (and its backward with `dout`),
//! writing `out` (and `dq`, `dk`, `dv`); no lse. The interface is fixed by issue 67.

use flashattn::{FeatureMap, LinearParams, linear_backward, linear_forward};

use super::args::{FeatureMapArg, RunArgs};
use super::run::{named, qkv_inputs, warn_non_finite};
use super::tensor_files::{self, Format, NamedTensor};
use super::{CliResult, device, fail, output};

/// The tensors linear attention reads.
const KNOWN: [&str; 4] = ["q", "k", "v", "dout"];

/// Reads, computes and writes; nothing is written unless everything succeeded.
pub fn run(a: &RunArgs, tensors: &[NamedTensor], out_format: Format) -> CliResult<()> {
    if let Some(t) = tensors.iter().find(|t| !KNOWN.contains(&t.name.as_str())) {
        return Err(fail(format!(
            "unexpected tensor `{}` (--kind linear reads {})",
            t.name,
            KNOWN.join(", ")
        )));
    }
    let m = &a.mask;
    let softmax_only = [
        (m.window_left.is_some(), "--window-left"),
        (m.window_right.is_some(), "--window-right"),
        (m.softcap.is_some(), "--softcap"),
        (m.scale.is_some(), "--scale"),
        (m.diagonal.is_some(), "--diagonal"),
    ];
    if let Some((_, opt)) = softmax_only.iter().find(|(given, _)| *given) {
        return Err(fail(format!(
            "{opt} is an option of softmax attention; --kind linear takes --causal, \
             --feature-map and --linear-eps"
        )));
    }
    if let Some(opt) = a.layer.first_given() {
        return Err(fail(format!(
            "{opt} is an option of the fused layer, not of --kind linear"
        )));
    }
    let params = LinearParams {
        causal: m.causal,
        feature_map: match a.linear.feature_map.unwrap_or_default() {
            FeatureMapArg::Elu1 => FeatureMap::Elu1,
            FeatureMapArg::Relu => FeatureMap::Relu,
        },
        eps: a.linear.linear_eps.unwrap_or(LinearParams::default().eps),
    };
    let (q, k, v, dout, dtype) = qkv_inputs(tensors, a.layout)?;
    warn_non_finite(tensors);
    tensor_files::check_storable(&a.output, out_format, dtype)?;
    let out_file = output::PendingFile::create(&a.output)?;
    let on = |t| device::to_device(t, a.device);
    let (q, k, v) = (on(&q)?, on(&k)?, on(&v)?);
    let out = linear_forward(&q, &k, &v, &params)?;
    let mut results = vec![named("out", &out, a.layout, true)?];
    if let Some(dout) = &dout {
        let g = linear_backward(&q, &k, &v, &on(dout)?, &params)?;
        results.push(named("dq", &g.dq, a.layout, true)?);
        results.push(named("dk", &g.dk, a.layout, true)?);
        results.push(named("dv", &g.dv, a.layout, true)?);
    }
    tensor_files::write(out_file, &results)?;
    Ok(())
}
