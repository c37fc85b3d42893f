//! `flashattn run` on the fused layer's tensors (input `x` instead of q, k, v): inputs `x`,
//! `w_qkv`, `b_qkv`, `w_o`, `b_o`, `positions`, `rel_bias`, `dy` (and `alibi_slopes`, `bias`,
//! both cu_seqlens as for attention); outputs `y` and, with `dy`, `dx`, `dw_qkv`, `db_qkv`,
//! `dw_o`, `db_o` (and `dbias` with a bias, `drel_bias` with `rel_bias`). The interface is fixed
//! by issue 67.

use flashattn::{
    LayerParams, LayerWeights, Rope, RopeStyle, Tensor, layer_backward, layer_forward,
};

use super::args::{Layout, RopeArg, RunArgs};
use super::run::{cu_seqlens, f32_tensor, float_dtype, named, tensor_of, warn_non_finite};
use super::tensor_files::{self, Data, Format, NamedTensor};
use super::{CliResult, device, fail, output};

/// Every tensor name the layer reads.
const KNOWN: [&str; 12] = [
    "x",
    "w_qkv",
    "b_qkv",
    "w_o",
    "b_o",
    "positions",
    "rel_bias",
    "dy",
    "alibi_slopes",
    "bias",
    "cu_seqlens_q",
    "cu_seqlens_k",
];

fn get<'a>(tensors: &'a [NamedTensor], name: &str) -> Option<&'a NamedTensor> {
    tensors.iter().find(|t| t.name == name)
}

fn require<'a>(tensors: &'a [NamedTensor], name: &str) -> CliResult<&'a NamedTensor> {
    get(tensors, name).ok_or_else(|| {
        fail(format!(
            "tensor `{name}` is missing (the fused layer reads x, w_qkv, w_o; optional b_qkv, \
             b_o, positions, rel_bias, dy)"
        ))
    })
}

/// The rotary positions: int32, one per row of `x`.
fn positions(t: &NamedTensor, x: &NamedTensor) -> CliResult<Vec<i32>> {
    let rows = &x.shape[..x.shape.len().saturating_sub(1)];
    match &t.data {
        Data::I32(v) if t.shape == rows => Ok(v.clone()),
        Data::I32(_) => Err(fail(format!(
            "tensor `positions`: expected shape {rows:?} (x's rows), found {:?}",
            t.shape
        ))),
        d => Err(fail(format!(
            "tensor `positions`: expected dtype int32, found {}",
            d.dtype_name()
        ))),
    }
}

/// The layer's params from the options and the file.
fn params(a: &RunArgs, tensors: &[NamedTensor], x: &NamedTensor) -> CliResult<LayerParams> {
    let l = &a.layer;
    let heads = l.heads.ok_or_else(|| {
        fail("--heads: the fused layer (tensor `x`) needs the number of query heads")
    })?;
    let mut p = LayerParams::new(heads, l.heads_kv.unwrap_or(heads));
    p.rope = match l.rope {
        None => {
            if let Some(opt) = [
                (l.rope_base.is_some(), "--rope-base"),
                (l.rope_dim.is_some(), "--rope-dim"),
            ]
            .into_iter()
            .find_map(|(given, name)| given.then_some(name))
            {
                return Err(fail(format!(
                    "{opt} needs --rope half or --rope interleaved"
                )));
            }
            None
        }
        Some(style) => {
            let style = match style {
                RopeArg::Half => RopeStyle::Half,
                RopeArg::Interleaved => RopeStyle::Interleaved,
            };
            let mut r = Rope::new(style).base(l.rope_base.unwrap_or(10000.0));
            r.dim = l.rope_dim;
            Some(r)
        }
    };
    if let Some(t) = get(tensors, "positions") {
        p.positions = Some(positions(t, x)?);
    }
    let mut att = a.mask.params()?;
    if let Some(s) = get(tensors, "alibi_slopes") {
        att.alibi_slopes = Some(tensor_of(s)?);
    }
    if let Some(t) = get(tensors, "rel_bias") {
        att.rel_bias = Some(f32_tensor(t)?);
    }
    if let Some(b) = get(tensors, "bias") {
        float_dtype(b)?;
        att.bias = Some(tensor_of(b)?);
    }
    if let (Some(cq), Some(ck)) = (get(tensors, "cu_seqlens_q"), get(tensors, "cu_seqlens_k")) {
        att = att.varlen(cu_seqlens(cq)?, cu_seqlens(ck)?);
    }
    p.attention = att;
    Ok(p)
}

/// Reads the layer's tensors, runs it (and its backward with `dy`) and writes the results;
/// nothing is written unless everything succeeded.
pub fn run(a: &RunArgs, tensors: &[NamedTensor], out_format: Format) -> CliResult<()> {
    if let Some(t) = tensors.iter().find(|t| !KNOWN.contains(&t.name.as_str())) {
        return Err(fail(format!(
            "unexpected tensor `{}` (with x, run reads {})",
            t.name,
            KNOWN.join(", ")
        )));
    }
    if a.layout == Layout::Bhnd {
        return Err(fail(
            "--layout bhnd: the fused layer's x is [batch, seqlen, model_dim]; --layout applies \
             to q, k, v",
        ));
    }
    if a.mask.diagonal.is_some() {
        return Err(fail(
            "--diagonal is an option of attention on q, k, v, not of the fused layer (tensor `x`)",
        ));
    }
    let x_file = require(tensors, "x")?;
    let dtype = float_dtype(x_file)?;
    let mut p = params(a, tensors, x_file)?;
    let floats =
        |name: &str| -> CliResult<Option<Tensor>> { get(tensors, name).map(tensor_of).transpose() };
    let on = |t: &Tensor| device::to_device(t, a.device);
    let on_opt = |t: Option<Tensor>| t.as_ref().map(on).transpose();
    let w = LayerWeights {
        w_qkv: on(&tensor_of(require(tensors, "w_qkv")?)?)?,
        b_qkv: on_opt(floats("b_qkv")?)?,
        w_o: on(&tensor_of(require(tensors, "w_o")?)?)?,
        b_o: on_opt(floats("b_o")?)?,
    };
    let dy = on_opt(floats("dy")?)?;
    p.attention.alibi_slopes = p.attention.alibi_slopes.as_ref().map(on).transpose()?;
    p.attention.bias = p.attention.bias.as_ref().map(on).transpose()?;
    p.attention.rel_bias = p.attention.rel_bias.as_ref().map(on).transpose()?;
    warn_non_finite(tensors);
    tensor_files::check_storable(&a.output, out_format, dtype)?;
    let out_file = output::PendingFile::create(&a.output)?;

    let x = on(&tensor_of(x_file)?)?;
    let f = layer_forward(&x, &w, &p)?;
    let mut results = vec![named("y", &f.y, Layout::Bnhd, false)?];
    if let Some(dy) = &dy {
        let g = layer_backward(&x, &w, &p, &f, dy)?;
        let grads = [
            ("dx", Some(&g.dx)),
            ("dw_qkv", Some(&g.dw_qkv)),
            ("db_qkv", g.db_qkv.as_ref()),
            ("dw_o", Some(&g.dw_o)),
            ("db_o", g.db_o.as_ref()),
            ("dbias", g.dbias.as_ref()),
            ("drel_bias", g.drel_bias.as_ref()),
        ];
        for (name, t) in grads {
            if let Some(t) = t {
                results.push(named(name, t, Layout::Bnhd, false)?);
            }
        }
    }
    tensor_files::write(out_file, &results)?;
    let names: Vec<String> = results
        .iter()
        .map(|t| format!("{} {:?} {}", t.name, t.shape, t.data.dtype_name()))
        .collect();
    println!("wrote {}: {}", a.output.display(), names.join(", "));
    Ok(())
}
