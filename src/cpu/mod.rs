//! The CPU backend: tiled FlashAttention forward and backward, parallel with rayon.

mod backward;
mod backward_block;
mod bias_grad;
// Tile products and exp2 kernels shared by the forward and backward (until both use every
// item, some are unused in a given build).
#[allow(dead_code)]
mod exp;
mod forward;
mod lanes;
#[allow(dead_code)]
mod matmul;
mod microkernel;
mod online_softmax;
mod score_mods;
mod shared_out;
mod simd;
mod tile_config;
mod transpose;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::attention::{ForwardOutput, Gradients};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{Problem, RowLayout, row_layout, strides_like};
use crate::tensor::{CpuElement, CpuStorage, Tensor, contiguous_strides};

/// The vectorized row exp, also used by the standard attention baseline (one exp for both).
pub(crate) use exp::exp2_shifted_sum;
pub(crate) use shared_out::SharedOut;
pub use simd::{Simd, cpu_simd};

/// The host buffer of `t` as `T` (validated to be on the host with dtype `T`).
fn host<'a, T: CpuElement>(t: &'a Tensor, arg: &'static str) -> Result<&'a [T]> {
    t.cpu_slice::<T>().ok_or_else(|| Error::DType {
        arg,
        expected: T::DTYPE.to_string(),
        got: t.dtype(),
    })
}

/// A fresh tensor shaped `shape`, in the memory order of `like`, every element `poison`.
fn alloc_like<T: CpuElement>(like: &Tensor, shape: &[usize], poison: f32) -> Result<Tensor> {
    let strides = strides_like(like, shape);
    let n = shape.iter().product();
    Tensor::from_cpu_storage(
        T::wrap(filled(n, T::from_f32(poison))),
        shape,
        &strides,
        0,
        "out",
    )
}

/// Buffers of at least this many elements (256 KiB of f32) are filled by all threads; smaller
/// ones by the calling thread alone.
const PARALLEL_FILL: usize = 1 << 16;

/// `n` copies of `x`; large buffers are written by all threads, so that their fresh pages are
/// faulted in parallel rather than by the calling thread alone while the others wait. (Written,
/// not merely zeroed by the allocator: pages handed out untouched and then read before they are
/// written take a read fault on the shared zero page and then a copy-on-write fault that
/// flushes every thread's TLB.)
fn filled<T: Copy + Send + Sync>(n: usize, x: T) -> Vec<T> {
    if n < PARALLEL_FILL {
        return vec![x; n];
    }
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(x, n));
    v
}

fn alloc_f32(shape: &[usize], value: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_cpu_storage(
        CpuStorage::F32(filled(n, value)),
        shape,
        &contiguous_strides(shape),
        0,
        "lse",
    )
}

/// The host buffer of an output tensor whose buffer no other tensor shares (validated by the
/// caller: `crate::outputs::expect_writable`, or allocated here), as `T`.
fn writable<'a, T: CpuElement>(t: &'a mut Tensor, arg: &'static str) -> Result<&'a mut [T]> {
    let dtype = t.dtype();
    t.cpu_storage_mut()
        .and_then(T::slice_mut)
        .ok_or_else(|| Error::DType {
            arg,
            expected: format!("{} in a host buffer no other tensor shares", T::DTYPE),
            got: dtype,
        })
}

/// The elements of a contiguous tensor's view, within its buffer.
fn view_range(t: &Tensor) -> std::ops::Range<usize> {
    t.offset()..t.offset() + t.numel()
}

pub(crate) fn forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    match p.dtype {
        DType::F32 => forward_typed::<f32>(p, q, k, v),
        DType::F16 => forward_typed::<f16>(p, q, k, v),
        DType::BF16 => forward_typed::<bf16>(p, q, k, v),
    }
}

/// The forward into outputs validated by `crate::outputs::expect_writable` (not filled first:
/// every element is written).
pub(crate) fn forward_into(
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    match p.dtype {
        DType::F32 => forward_into_typed::<f32>(p, q, k, v, out, lse),
        DType::F16 => forward_into_typed::<f16>(p, q, k, v, out, lse),
        DType::BF16 => forward_into_typed::<bf16>(p, q, k, v, out, lse),
    }
}

/// The forward into buffers it allocates and does not fill first: the kernel writes every
/// element of both (each query row of each (sequence, head) once, and `strides_like` leaves no
/// gaps), which spares a pass over the output and a round trip through the thread pool.
fn forward_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    let out_shape = Problem::shape_like(q, p.head_dim_v);
    let out_strides = strides_like(q, &out_shape);
    let lse_shape = p.lse_shape();
    let n_out: usize = out_shape.iter().product();
    let n_lse: usize = lse_shape.iter().product();
    let mut out = Vec::<T>::with_capacity(n_out);
    let mut lse = Vec::<f32>::with_capacity(n_lse);
    run_forward::<T>(
        p,
        (q, k, v),
        SharedOut::uninit(
            &mut out.spare_capacity_mut()[..n_out],
            RowLayout::strided(&out_strides, 0),
        ),
        SharedOut::uninit(&mut lse.spare_capacity_mut()[..n_lse], RowLayout::default()),
    )?;
    // SAFETY: `run_forward` returned Ok, so the kernel wrote every element of both (see above).
    unsafe {
        out.set_len(n_out);
        lse.set_len(n_lse);
    }
    Ok(ForwardOutput {
        out: Tensor::from_cpu_storage(T::wrap(out), &out_shape, &out_strides, 0, "out")?,
        lse: Tensor::from_cpu_storage(
            CpuStorage::F32(lse),
            &lse_shape,
            &contiguous_strides(&lse_shape),
            0,
            "lse",
        )?,
    })
}

fn forward_into_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    let out_layout = row_layout(out);
    let lse_range = view_range(lse);
    run_forward::<T>(
        p,
        (q, k, v),
        SharedOut::new(writable::<T>(out, "out")?, out_layout),
        SharedOut::new(
            &mut writable::<f32>(lse, "lse")?[lse_range],
            RowLayout::default(),
        ),
    )
}

/// Runs the forward kernel into `out` and `lse` (every element written).
fn run_forward<T: CpuElement>(
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: SharedOut<'_, T>,
    lse: SharedOut<'_, f32>,
) -> Result<()> {
    let bias = p
        .bias
        .as_ref()
        .map(|(t, _)| host::<f32>(t, "bias"))
        .transpose()?;
    let inputs = forward::Inputs {
        q: host(q, "q")?,
        k: host(k, "k")?,
        v: host(v, "v")?,
        bias,
    };
    forward::run(p, inputs, out, lse);
    Ok(())
}

/// What the backward reads: q, k, v, the forward's out and lse, and dout.
pub(crate) type BackwardInputs<'a> = [&'a Tensor; 6];

pub(crate) fn backward(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    match p.dtype {
        DType::F32 => backward_typed::<f32>(p, x),
        DType::F16 => backward_typed::<f16>(p, x),
        DType::BF16 => backward_typed::<bf16>(p, x),
    }
}

/// The backward into gradients validated by `crate::outputs::expect_writable`: the bias
/// gradient is zeroed first (the backward adds into it), the others are written whole.
pub(crate) fn backward_into(p: &Problem, x: BackwardInputs<'_>, g: &mut Gradients) -> Result<()> {
    if let Some(dbias) = g.dbias.as_mut() {
        let range = view_range(dbias);
        let buf = &mut writable::<f32>(dbias, "dbias")?[range];
        if buf.len() < PARALLEL_FILL {
            buf.fill(0.0);
        } else {
            buf.par_iter_mut().for_each(|x| *x = 0.0);
        }
    }
    match p.dtype {
        DType::F32 => backward_run::<f32>(p, x, g),
        DType::F16 => backward_run::<f16>(p, x, g),
        DType::BF16 => backward_run::<bf16>(p, x, g),
    }
}

fn backward_typed<T: CpuElement>(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    let [q, k, v, ..] = x;
    let mut g = Gradients {
        dq: alloc_like::<T>(q, q.shape(), f32::NAN)?,
        dk: alloc_like::<T>(k, k.shape(), f32::NAN)?,
        dv: alloc_like::<T>(v, v.shape(), f32::NAN)?,
        dbias: match &p.bias {
            Some((b, _)) => Some(alloc_f32(b.shape(), 0.0)?),
            None => None,
        },
    };
    backward_run::<T>(p, x, &mut g)?;
    Ok(g)
}

fn backward_run<T: CpuElement>(
    p: &Problem,
    x: BackwardInputs<'_>,
    g: &mut Gradients,
) -> Result<()> {
    let [q, k, v, out, lse, dout] = x;
    let lse_c = lse.contiguous()?;
    let layouts = backward::Layouts {
        out: row_layout(out),
        dout: row_layout(dout),
        dq: row_layout(&g.dq),
        dk: row_layout(&g.dk),
        dv: row_layout(&g.dv),
    };
    let bias = p
        .bias
        .as_ref()
        .map(|(t, _)| host::<f32>(t, "bias"))
        .transpose()?;
    let dbias = match g.dbias.as_mut() {
        Some(t) => {
            let range = view_range(t);
            Some(&mut writable::<f32>(t, "dbias")?[range])
        }
        None => None,
    };
    backward::run(
        p,
        backward::Inputs {
            q: host(q, "q")?,
            k: host(k, "k")?,
            v: host(v, "v")?,
            bias,
            out: host(out, "out")?,
            lse: host(&lse_c, "lse")?,
            dout: host(dout, "dout")?,
        },
        &layouts,
        backward::Outputs {
            dq: writable::<T>(&mut g.dq, "dq")?,
            dk: writable::<T>(&mut g.dk, "dk")?,
            dv: writable::<T>(&mut g.dv, "dv")?,
            dbias,
        },
    );
    Ok(())
}
