//! The "standard attention" baseline: materializes the score matrix of every (sequence, head),
//! applies the softmax to it, and multiplies by V — the way attention is written without
//! FlashAttention, in the precision of the inputs.
//!
//! For inputs of dtype `T` every materialized value is rounded to `T`, as a framework computing in
//! `T` would store it: `S = q·kᵀ·scale` (accumulated in f32), then each of softcap and ALiBi + bias,
//! then `P = softmax(S)` (computed in f32), then `O = P·V` (accumulated in f32). The backward
//! rounds `dP`, `dS` and the softcap's `dS` likewise, and accumulates its products in f32.
//!
//! The matrices are held in f32 buffers (whose values are rounded to `T`), one
//! `[batch, heads, seqlen_q, seqlen_k]` matrix for the forward and two for the backward; see
//! [`forward_extra_memory_bytes`] and [`backward_extra_memory_bytes`]. It is a yardstick for tests (the error a plain implementation
//! makes in the same precision) and for benchmarks (speed and memory of the materializing method),
//! so its products run through the `gemm` crate, parallel over (sequence, head) with rayon.

mod backward;
mod score_matrix;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::outputs::{ForwardOutput, Gradients};
use crate::params::AttentionParams;
use crate::problem::Problem;
use crate::tensor::{Tensor, contiguous_strides};

use score_matrix::{
    MatMul, SeqInputs, bias_data, layout_like, map_tasks, seq_inputs, softmax, split_scores,
    tensor_like, widen,
};

/// Bytes [`forward`] allocates beyond its inputs and output for problem `p`. On a GPU: contiguous
/// copies of q, k, v and the output and the score matrix, in the input dtype. On the CPU (contiguous
/// inputs): the `[batch, heads, seqlen_q, seqlen_k]` score matrix in f32, and two f32 working
/// copies each of q, k, v and the output (widened buffers, per-head rows), and the `gemm`
/// crate's packing buffers ([`GEMM_WORKSPACE_BYTES`] per worker thread). Saturates at
/// `usize::MAX`.
pub fn forward_extra_memory_bytes(p: &Problem) -> usize {
    #[cfg(feature = "cuda")]
    if let crate::tensor::Device::Cuda(_) = p.device {
        return crate::cuda::standard::forward_extra_memory_bytes(p);
    }
    let [q, k, v, o] = operand_elements(p);
    score_elements(p)
        .saturating_add(
            q.saturating_add(k)
                .saturating_add(v)
                .saturating_add(o)
                .saturating_mul(2),
        )
        .saturating_mul(4)
        .saturating_add(gemm_workspace())
}

/// What the `gemm` crate may allocate per thread on its first product there: a buffer the size
/// of the L2 cache (1 MiB on the machines measured) kept for the thread's life, and the packed
/// operands of a product; 4 MiB covers both.
pub const GEMM_WORKSPACE_BYTES: usize = 4 << 20;

fn gemm_workspace() -> usize {
    rayon::current_num_threads().saturating_mul(GEMM_WORKSPACE_BYTES)
}

/// Bytes [`backward()`] allocates beyond its inputs and gradients for problem `p` (contiguous
/// inputs): `P` and `dS` of every (sequence, head) in f32, two f32 working copies each of q, k,
/// v and dout, and two of the gradients, and the `gemm` crate's packing buffers; with a
/// softcap, add one `seqlen_q × seqlen_k` f32 scratch per worker thread. Saturates at
/// `usize::MAX`.
pub fn backward_extra_memory_bytes(p: &Problem) -> usize {
    let [q, k, v, o] = operand_elements(p);
    let inputs = q.saturating_add(k).saturating_add(v).saturating_add(o);
    let grads = q.saturating_add(k).saturating_add(v);
    score_elements(p)
        .saturating_mul(2)
        .saturating_add(inputs.saturating_add(grads).saturating_mul(2))
        .saturating_mul(4)
        .saturating_add(gemm_workspace())
}

/// Elements of one `[batch, heads, nq, nk]` matrix (per-sequence lengths with varlen), saturating.
pub(super) fn score_elements(p: &Problem) -> usize {
    p.seqs
        .iter()
        .fold(0usize, |n, s| n.saturating_add(s.nq.saturating_mul(s.nk)))
        .saturating_mul(p.heads_q)
}

/// Elements of q, k, v and the output (or dout).
fn operand_elements(p: &Problem) -> [usize; 4] {
    let rows_q: usize = p.seqs.iter().map(|s| s.nq).sum();
    let rows_k: usize = p.seqs.iter().map(|s| s.nk).sum();
    let (hq, hk) = (p.heads_q, p.heads_kv);
    [
        rows_q.saturating_mul(hq).saturating_mul(p.head_dim),
        rows_k.saturating_mul(hk).saturating_mul(p.head_dim),
        rows_k.saturating_mul(hk).saturating_mul(p.head_dim_v),
        rows_q.saturating_mul(hq).saturating_mul(p.head_dim_v),
    ]
}

/// Standard attention forward: same arguments, validation and outputs (`out` in `q`'s dtype and
/// memory order, `lse` f32) as [`crate::forward`].
///
/// ```
/// use flashattn::{AttentionParams, Tensor, reference::standard};
/// let x: Vec<f32> = (0..3 * 2 * 4).map(|i| (i as f32 * 0.3).sin()).collect();
/// let t = Tensor::from_vec(x, &[1, 3, 2, 4])?;
/// let res = standard::forward(&t, &t, &t, &AttentionParams::default().causal())?;
/// let fa = flashattn::forward(&t, &t, &t, &AttentionParams::default().causal())?;
/// let (a, b) = (res.out.to_vec::<f32>()?, fa.out.to_vec::<f32>()?);
/// assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    let p = Problem::new(q, k, v, params)?;
    if let crate::tensor::Device::Cuda(_) = p.device {
        return gpu_forward(&p, q, k, v);
    }
    match p.dtype {
        DType::F32 => forward_typed::<f32>(&p, q, k, v),
        DType::F16 => forward_typed::<f16>(&p, q, k, v),
        DType::BF16 => forward_typed::<bf16>(&p, q, k, v),
    }
}

/// Standard attention backward: materializes `P` and `dS` and applies the textbook formulas
/// (`dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(P∘dP))`, `dQ = dS·K·scale`,
/// `dK = dSᵀ·Q·scale`). Same arguments, validation and outputs as [`crate::backward`]; `P` is
/// recomputed exactly as [`forward`] computes it, so `out` and `lse` are only validated.
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<Gradients> {
    let p = crate::problem::backward_problem([q, k, v, out, lse, dout], params)?;
    host_only(&p)?;
    match p.dtype {
        DType::F32 => backward::backward_typed::<f32>(&p, q, k, v, dout),
        DType::F16 => backward::backward_typed::<f16>(&p, q, k, v, dout),
        DType::BF16 => backward::backward_typed::<bf16>(&p, q, k, v, dout),
    }
}

/// The GPU baseline (cuBLAS products and a softmax kernel, see `src/cuda/standard.rs`).
#[cfg(feature = "cuda")]
fn gpu_forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    crate::cuda::standard::forward(p, q, k, v)
}

#[cfg(not(feature = "cuda"))]
fn gpu_forward(_: &Problem, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<ForwardOutput> {
    Err(Error::Unsupported {
        device: "cuda",
        what: "this build has no CUDA backend (cargo feature `cuda`)".into(),
    })
}

fn host_only(p: &Problem) -> Result<()> {
    if p.device != crate::tensor::Device::Cpu {
        return Err(Error::Unsupported {
            device: "cuda",
            what: "the standard attention backward runs on the CPU only".into(),
        });
    }
    Ok(())
}

struct HeadForward {
    out: Vec<f32>,
    lse: Vec<f32>,
}

fn forward_typed<T: Element>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    let (qd, kd, vd) = (widen(q)?, widen(k)?, widen(v)?);
    let biases = bias_data(p)?;
    let mut scores_buf = score_matrix::score_matrix(p)?;
    let tasks: Vec<(usize, usize, &mut [f32])> = (0..p.batch)
        .flat_map(|b| (0..p.heads_q).map(move |h| (b, h)))
        .zip(split_scores(p, &mut scores_buf, 1))
        .map(|((b, h), s)| (b, h, s))
        .collect();
    let inputs: Vec<SeqInputs> = (0..p.batch)
        .into_par_iter()
        .map(|b| seq_inputs(p, b, &qd, &kd, &vd))
        .collect();
    let heads: Vec<HeadForward> = map_tasks(tasks, |(b, h, s)| {
        let (nq, nk, dv) = (p.seqs[b].nq, p.seqs[b].nk, p.head_dim_v);
        let x = &inputs[b];
        score_matrix::scores::<T>(p, &biases, b, h, x, s, None);
        let lse = softmax::<T>(s, nq, nk);
        let mut out = vec![0f32; nq * dv];
        MatMul {
            m: nq,
            n: dv,
            k: nk,
            lhs_strides: (nk, 1),
            rhs_strides: (dv, 1),
            alpha: 1.0,
            accumulate: false,
        }
        .run(&mut out, s, &x.v[p.kv_head(h)]);
        HeadForward { out, lse }
    });

    let out_shape = Problem::shape_like(q, p.head_dim_v);
    let out_layout = layout_like(q, &out_shape);
    let mut out = vec![0f32; out_shape.iter().product()];
    let mut lse = vec![f32::NEG_INFINITY; p.lse_shape().iter().product()];
    let dv = p.head_dim_v;
    for (t, r) in heads.iter().enumerate() {
        let (b, h) = (t / p.heads_q, t % p.heads_q);
        for i in 0..p.seqs[b].nq {
            let o = p.query_at(&out_layout, b, i, h);
            out[o..o + dv].copy_from_slice(&r.out[i * dv..(i + 1) * dv]);
            lse[p.lse_at(b, h, i)] = r.lse[i];
        }
    }
    let lse_shape = p.lse_shape();
    Ok(ForwardOutput {
        out: tensor_like::<T>(out, q, &out_shape)?,
        lse: Tensor::from_vec_strided(lse, &lse_shape, &contiguous_strides(&lse_shape), 0)?,
    })
}
