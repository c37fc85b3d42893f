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
use crate::problem::{Problem, row_layout, strides_like};
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

/// `n` copies of `x`; large buffers are written by all threads, so that their fresh pages are
/// faulted in parallel rather than by the calling thread alone while the others wait. (Written,
/// not merely zeroed by the allocator: pages handed out untouched and then read before they are
/// written take a read fault on the shared zero page and then a copy-on-write fault that
/// flushes every thread's TLB.)
fn filled<T: Copy + Send + Sync>(n: usize, x: T) -> Vec<T> {
    if n < 1 << 16 {
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

/// Mutable access to a tensor this module just allocated (its buffer is not shared yet).
fn fresh_mut<T: CpuElement>(t: &mut Tensor) -> &mut [T] {
    T::slice_mut(t.cpu_storage_mut().expect("freshly allocated host tensor"))
        .expect("allocated with dtype T")
}

pub(crate) fn forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    match p.dtype {
        DType::F32 => forward_typed::<f32>(p, q, k, v),
        DType::F16 => forward_typed::<f16>(p, q, k, v),
        DType::BF16 => forward_typed::<bf16>(p, q, k, v),
    }
}

fn forward_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    let mut out = alloc_like::<T>(q, &Problem::shape_like(q, p.head_dim_v), f32::NAN)?;
    let mut lse = alloc_f32(&p.lse_shape(), f32::NAN)?;
    let out_layout = row_layout(&out);
    let bias = p
        .bias
        .as_ref()
        .map(|(t, _)| host::<f32>(t, "bias"))
        .transpose()?;
    forward::run(
        p,
        forward::Inputs {
            q: host(q, "q")?,
            k: host(k, "k")?,
            v: host(v, "v")?,
            bias,
        },
        SharedOut::new(fresh_mut::<T>(&mut out), out_layout),
        fresh_mut::<f32>(&mut lse),
    );
    Ok(ForwardOutput { out, lse })
}

pub(crate) fn backward(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
) -> Result<Gradients> {
    match p.dtype {
        DType::F32 => backward_typed::<f32>(p, q, k, v, out, lse, dout),
        DType::F16 => backward_typed::<f16>(p, q, k, v, out, lse, dout),
        DType::BF16 => backward_typed::<bf16>(p, q, k, v, out, lse, dout),
    }
}

fn backward_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
) -> Result<Gradients> {
    let mut dq = alloc_like::<T>(q, q.shape(), f32::NAN)?;
    let mut dk = alloc_like::<T>(k, k.shape(), f32::NAN)?;
    let mut dv = alloc_like::<T>(v, v.shape(), f32::NAN)?;
    let mut dbias = match &p.bias {
        Some((b, _)) => Some(alloc_f32(b.shape(), 0.0)?),
        None => None,
    };
    let lse_c = lse.contiguous()?;
    let layouts = backward::Layouts {
        out: row_layout(out),
        dout: row_layout(dout),
        dq: row_layout(&dq),
        dk: row_layout(&dk),
        dv: row_layout(&dv),
    };
    let bias = p
        .bias
        .as_ref()
        .map(|(t, _)| host::<f32>(t, "bias"))
        .transpose()?;
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
            dq: fresh_mut::<T>(&mut dq),
            dk: fresh_mut::<T>(&mut dk),
            dv: fresh_mut::<T>(&mut dv),
            dbias: dbias.as_mut().map(fresh_mut::<f32>),
        },
    );
    Ok(Gradients { dq, dk, dv, dbias })
}
