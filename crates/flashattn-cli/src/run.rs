//! `flashattn run`: attention on tensors read from a file, results written to another.
//!
//! The interface is fixed (other tools rely on it): inputs `q`, `k`, `v`, optional
//! `alibi_slopes`, `bias`, `rel_bias`, `cu_seqlens_q` + `cu_seqlens_k`, `dout`; outputs `out`,
//! `lse`, and with `dout` also `dq`, `dk`, `dv` (and `dbias`, `drel_bias` with those biases). See
//! `flashattn run --help`.

use std::path::Path;

use flashattn::{AttentionParams, DType, Tensor};

use super::args::{KindArg, Layout, RunArgs};
use super::tensor_files::{self, Data, NamedTensor};
use super::{CliResult, device, fail, output};

/// Every tensor name `run` reads.
const KNOWN: [&str; 9] = [
    "q",
    "k",
    "v",
    "alibi_slopes",
    "bias",
    "rel_bias",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "dout",
];

/// The tensors of the input file, by name.
struct FileInputs<'a> {
    tensors: &'a [NamedTensor],
    layout: Layout,
    varlen: bool,
}

impl<'a> FileInputs<'a> {
    fn get(&self, name: &str) -> Option<&'a NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn require(&self, name: &str) -> CliResult<&'a NamedTensor> {
        self.get(name).ok_or_else(|| {
            let found: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
            fail(format!(
                "tensor `{name}` is missing (the file holds: {})",
                if found.is_empty() {
                    "nothing".to_string()
                } else {
                    found.join(", ")
                }
            ))
        })
    }

    /// The dimension names of q/k/v/dout in the file, for messages.
    fn dims(&self, seqlen: &str, heads: &str, dim: &str) -> String {
        let d = match (self.varlen, self.layout) {
            (false, Layout::Bnhd) => vec!["batch", seqlen, heads, dim],
            (false, Layout::Bhnd) => vec!["batch", heads, seqlen, dim],
            (true, Layout::Bnhd) => vec!["total", heads, dim],
            (true, Layout::Bhnd) => vec![heads, "total", dim],
        };
        format!("[{}]", d.join(", "))
    }

    /// The file's shape of a q/k/v-like tensor in the logical `[.., seqlen, heads, dim]` order.
    fn logical(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        if self.layout == Layout::Bhnd && s.len() >= 3 {
            let r = s.len();
            s.swap(r - 3, r - 2);
        }
        s
    }
}

pub(super) fn float_dtype(t: &NamedTensor) -> CliResult<DType> {
    t.data.float_dtype().ok_or_else(|| {
        fail(format!(
            "tensor `{}`: expected dtype f32, f16 or bf16, found {}",
            t.name,
            t.data.dtype_name()
        ))
    })
}

pub(super) fn tensor_of(t: &NamedTensor) -> CliResult<Tensor> {
    t.data.to_tensor(&t.shape).unwrap_or_else(|| {
        Err(fail(format!(
            "tensor `{}`: expected a float dtype, found {}",
            t.name,
            t.data.dtype_name()
        )))
    })
}

pub(super) fn cu_seqlens(t: &NamedTensor) -> CliResult<Vec<i32>> {
    match (&t.data, t.shape.len()) {
        (Data::I32(v), 1) => Ok(v.clone()),
        (Data::I32(_), _) => Err(fail(format!(
            "tensor `{}`: expected 1 dimension [batch + 1], found shape {:?}",
            t.name, t.shape
        ))),
        (d, _) => Err(fail(format!(
            "tensor `{}`: expected dtype int32, found {}",
            t.name,
            d.dtype_name()
        ))),
    }
}

/// Validated inputs, as tensors in the logical layout, and the output shapes in the file's.
struct Prepared {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Option<Tensor>,
    params: AttentionParams,
    dtype: DType,
}

/// Reads the tensors of the file into attention inputs, checking names, dtypes and shapes.
fn prepare(f: &FileInputs, mask: &AttentionParams) -> CliResult<Prepared> {
    if let Some(t) = f.tensors.iter().find(|t| !KNOWN.contains(&t.name.as_str())) {
        return Err(fail(format!(
            "unexpected tensor `{}` (run reads {})",
            t.name,
            KNOWN.join(", ")
        )));
    }
    let (q, k, v) = (f.require("q")?, f.require("k")?, f.require("v")?);
    let dtype = float_dtype(q)?;
    let rank = if f.varlen { 3 } else { 4 };
    let expected = [
        (q, f.dims("seqlen_q", "heads", "head_dim")),
        (k, f.dims("seqlen_k", "heads_kv", "head_dim")),
        (v, f.dims("seqlen_k", "heads_kv", "head_dim_v")),
    ];
    for (t, dims) in &expected {
        if t.shape.len() != rank {
            let packed = if f.varlen {
                " (packed varlen input, as cu_seqlens are given)"
            } else {
                ""
            };
            return Err(fail(format!(
                "tensor `{}`: expected {rank} dimensions {dims}{packed}, found shape {:?}",
                t.name, t.shape
            )));
        }
        let t_dtype = float_dtype(t)?;
        if t_dtype != dtype {
            return Err(fail(format!(
                "tensor `{}`: expected dtype {dtype} (the dtype of q), found {t_dtype}",
                t.name
            )));
        }
    }
    let (lq, lk, lv) = (
        f.logical(&q.shape),
        f.logical(&k.shape),
        f.logical(&v.shape),
    );
    let mismatch = |t: &NamedTensor, what: &str, want: usize, other: &str| {
        fail(format!(
            "tensor `{}`: expected {what} = {want} (as in {other}), found shape {:?} {}",
            t.name,
            t.shape,
            expected
                .iter()
                .find(|e| e.0.name == t.name)
                .map_or(String::new(), |e| e.1.clone())
        ))
    };
    if !f.varlen && lk[0] != lq[0] {
        return Err(mismatch(k, "batch", lq[0], "q"));
    }
    if !f.varlen && lv[0] != lq[0] {
        return Err(mismatch(v, "batch", lq[0], "q"));
    }
    let r = rank;
    if lv[r - 3] != lk[r - 3] {
        let what = if f.varlen { "total" } else { "seqlen_k" };
        return Err(mismatch(v, what, lk[r - 3], "k"));
    }
    if lv[r - 2] != lk[r - 2] {
        return Err(mismatch(v, "heads_kv", lk[r - 2], "k"));
    }
    if lk[r - 1] != lq[r - 1] {
        return Err(mismatch(k, "head_dim", lq[r - 1], "q"));
    }

    let view = |t: Tensor| -> CliResult<Tensor> {
        match f.layout {
            Layout::Bnhd => Ok(t),
            Layout::Bhnd => Ok(t.transpose(r - 3, r - 2)?),
        }
    };
    let mut params = mask.clone();
    if let Some(s) = f.get("alibi_slopes") {
        params.alibi_slopes = Some(f32_tensor(s)?);
    }
    if let Some(t) = f.get("rel_bias") {
        params.rel_bias = Some(f32_tensor(t)?);
    }
    if let Some(b) = f.get("bias") {
        float_dtype(b)?;
        params.bias = Some(tensor_of(b)?);
    }
    if f.varlen {
        let (cq, ck) = (f.require("cu_seqlens_q")?, f.require("cu_seqlens_k")?);
        params = params.varlen(cu_seqlens(cq)?, cu_seqlens(ck)?);
    }
    let dout = match f.get("dout") {
        None => None,
        Some(d) => {
            let mut want = q.shape.clone();
            want[r - 1] = lv[r - 1];
            let d_dtype = float_dtype(d)?;
            if d_dtype != dtype {
                return Err(fail(format!(
                    "tensor `dout`: expected dtype {dtype} (the dtype of q), found {d_dtype}"
                )));
            }
            if d.shape != want {
                return Err(fail(format!(
                    "tensor `dout`: expected shape {want:?} (the output's: q's with v's head_dim), \
                     found {:?}",
                    d.shape
                )));
            }
            Some(view(tensor_of(d)?)?)
        }
    };
    Ok(Prepared {
        q: view(tensor_of(q)?)?,
        k: view(tensor_of(k)?)?,
        v: view(tensor_of(v)?)?,
        dout,
        params,
        dtype,
    })
}

/// q, k, v and dout (the file holds no other tensor) in the logical layout, and their dtype.
pub(super) fn qkv_inputs(
    tensors: &[NamedTensor],
    layout: Layout,
) -> CliResult<(Tensor, Tensor, Tensor, Option<Tensor>, DType)> {
    let file = FileInputs {
        tensors,
        layout,
        varlen: false,
    };
    let x = prepare(&file, &AttentionParams::default())?;
    Ok((x.q, x.k, x.v, x.dout, x.dtype))
}

/// An input that must be f32 (the ALiBi slopes, the relative-position table) as a tensor.
pub(super) fn f32_tensor(t: &NamedTensor) -> CliResult<Tensor> {
    if !matches!(t.data, Data::F32(_)) {
        return Err(fail(format!(
            "tensor `{}`: expected dtype f32, found {}",
            t.name,
            t.data.dtype_name()
        )));
    }
    tensor_of(t)
}

/// Warns on stderr about each input tensor that holds NaN or infinite values: attention does not
/// refuse them, and the results they reach are not finite.
pub(super) fn warn_non_finite(tensors: &[NamedTensor]) {
    for t in tensors {
        let (nan, inf) = t.data.non_finite();
        if nan + inf > 0 {
            eprintln!(
                "warning: tensor `{}` holds {nan} NaN and {inf} infinite values (of {}): the \
                 results they reach will not be finite",
                t.name,
                t.shape.iter().product::<usize>()
            );
        }
    }
}

/// A result in the file's layout (q/k/v-like results are transposed back for `bhnd`).
pub(super) fn named(
    name: &str,
    t: &Tensor,
    layout: Layout,
    qkv_like: bool,
) -> CliResult<NamedTensor> {
    let host = device::download(t)?;
    let r = host.rank();
    let stored = if qkv_like && layout == Layout::Bhnd {
        host.transpose(r - 3, r - 2)?
    } else {
        host
    };
    Ok(NamedTensor {
        name: name.to_string(),
        shape: stored.shape().to_vec(),
        data: Data::from_tensor(&stored)?,
    })
}

/// Reads, computes and writes; nothing is written unless everything succeeded.
pub fn run(a: &RunArgs) -> CliResult<()> {
    let out_format = tensor_files::format_of(&a.output, "--output")?;
    output::check_writable(&a.output)?;
    device::ensure_available(a.device)?;
    if same_file(&a.input, &a.output) {
        return Err(fail(format!(
            "--output {} is the input file: choose another name",
            a.output.display()
        )));
    }
    let tensors = tensor_files::read(&a.input)?;
    let has = |n: &str| tensors.iter().any(|t| t.name == n);
    let varlen = has("cu_seqlens_q") || has("cu_seqlens_k");
    if varlen && !(has("cu_seqlens_q") && has("cu_seqlens_k")) {
        let missing = if has("cu_seqlens_q") {
            "cu_seqlens_k"
        } else {
            "cu_seqlens_q"
        };
        return Err(fail(format!(
            "tensor `{missing}` is missing: packed varlen input needs both cu_seqlens_q and \
             cu_seqlens_k (int32, batch + 1 entries)"
        )));
    }
    if a.linear.kind == KindArg::Linear {
        return super::linear_run::run(a, &tensors, out_format);
    }
    if let Some(opt) = a.linear.first_given() {
        return Err(fail(format!(
            "{opt} is an option of linear attention: add --kind linear"
        )));
    }
    if has("x") {
        return super::layer_run::run(a, &tensors, out_format);
    }
    if let Some(opt) = a.layer.first_given() {
        return Err(fail(format!(
            "{opt} is an option of the fused layer: the input needs tensor `x` (and w_qkv, w_o)"
        )));
    }
    let file = FileInputs {
        tensors: &tensors,
        layout: a.layout,
        varlen,
    };
    let x = prepare(&file, &a.mask.params()?)?;
    warn_non_finite(&tensors);
    tensor_files::check_storable(&a.output, out_format, x.dtype)?;
    let out_file = output::PendingFile::create(&a.output)?;

    let on = |t: &Tensor| device::to_device(t, a.device);
    let mut params = x.params.clone();
    params.alibi_slopes = params.alibi_slopes.as_ref().map(on).transpose()?;
    params.bias = params.bias.as_ref().map(on).transpose()?;
    params.rel_bias = params.rel_bias.as_ref().map(on).transpose()?;
    let (q, k, v) = (on(&x.q)?, on(&x.k)?, on(&x.v)?);
    let fwd = flashattn::forward(&q, &k, &v, &params)?;
    let mut results = vec![
        named("out", &fwd.out, a.layout, true)?,
        named("lse", &fwd.lse, a.layout, false)?,
    ];
    if let Some(dout) = &x.dout {
        let g = flashattn::backward(&q, &k, &v, &fwd.out, &fwd.lse, &on(dout)?, &params)?;
        results.push(named("dq", &g.dq, a.layout, true)?);
        results.push(named("dk", &g.dk, a.layout, true)?);
        results.push(named("dv", &g.dv, a.layout, true)?);
        if let Some(db) = &g.dbias {
            results.push(named("dbias", db, a.layout, false)?);
        }
        if let Some(dr) = &g.drel_bias {
            results.push(named("drel_bias", dr, a.layout, false)?);
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

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}
