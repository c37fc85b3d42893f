//! The "standard attention" baseline on the GPU, the way attention is written without
//! FlashAttention: gather q, k, v into contiguous `[batch, heads, seqlen, dim]` buffers, one
//! cuBLAS product for the whole `[batch, heads, seqlen_q, seqlen_k]` score matrix
//! `S = q·kᵀ·scale`, the softmax kernel of `kernels/standard_softmax.cu` (score mods, mask,
//! `P = softmax(S)` in place, log-sum-exp), a second cuBLAS product `O = P·V`, and a scatter into
//! the output's layout.
//!
//! Every materialized value is rounded to the input dtype (products accumulate in f32, the softmax
//! runs in f32), as on the CPU baseline ([`crate::reference::standard`]); it is the same-precision
//! yardstick for the GPU tests and the materializing method of the benchmarks.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::blas::{Gemm, blas};
use super::compile::{self, KernelSource, TYPES_HEADER};
use super::device::{Gpu, gpu};
use super::storage::CudaStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::ForwardOutput;
use crate::problem::{Problem, RowLayout, strides_like};
use crate::tensor::{Device, Tensor, contiguous_strides};

/// Host mirror of `CopyParams` in `kernels/standard_softmax.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CopyParams {
    strided: u64,
    packed: u64,
    seq_row0: u64,
    seq_len: u64,
    offset: i64,
    stride_b: i64,
    stride_row: i64,
    stride_head: i64,
    batch: i32,
    heads: i32,
    max_n: i32,
    dim: i32,
    to_packed: i32,
}

// SAFETY: plain `repr(C)` data laid out exactly as the kernel's struct (u64/i64 then i32 fields).
unsafe impl DeviceRepr for CopyParams {}

/// Host mirror of `SoftmaxParams` in `kernels/standard_softmax.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SoftmaxParams {
    scores: u64,
    lse: u64,
    bias: u64,
    rel_bias: u64,
    slopes: u64,
    seq_nq: u64,
    seq_nk: u64,
    seq_q_row0: u64,
    bias_offset: i64,
    bias_stride: [i64; 4],
    window_left: i64,
    window_right: i64,
    diagonal: i64,
    batch: i32,
    heads: i32,
    max_nq: i32,
    max_nk: i32,
    total_q: i32,
    rel_radius: i32,
    diagonal_given: i32,
    softcap: f32,
}

// SAFETY: plain `repr(C)` data laid out exactly as the kernel's struct.
unsafe impl DeviceRepr for SoftmaxParams {}

const SOFTMAX_THREADS: u32 = 256;
const COPY_THREADS: u32 = 256;

pub(crate) fn dtype_tag(dtype: DType) -> (&'static str, &'static str) {
    match dtype {
        DType::F32 => ("f32", "ELEM_F32"),
        DType::F16 => ("f16", "ELEM_F16"),
        DType::BF16 => ("bf16", "ELEM_BF16"),
    }
}

fn source(entry: &str, dtype: DType) -> KernelSource {
    let (tag, define) = dtype_tag(dtype);
    KernelSource {
        name: format!("{entry}_{tag}"),
        code: format!(
            "#define {define}\n{TYPES_HEADER}\n{}",
            include_str!("../../kernels/standard_softmax.cu")
        ),
        entry: entry.to_string(),
        hopper_only: false,
    }
}

/// The baseline's kernels: copy and softmax for each dtype.
pub(crate) fn kernel_sources() -> Vec<KernelSource> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .flat_map(|d| [source("standard_copy", d), source("standard_softmax", d)])
        .collect()
}

/// Elements of the contiguous buffers the forward allocates: packed q, k, v, the score matrix and
/// the packed output (padded to the longest sequence with varlen).
fn buffer_elements(p: &Problem) -> [usize; 5] {
    let (b, hq, hk) = (p.batch, p.heads_q, p.heads_kv);
    let (nq, nk) = (p.max_nq, p.max_nk);
    let m = |xs: &[usize]| xs.iter().fold(1usize, |a, &x| a.saturating_mul(x));
    [
        m(&[b, hq, nq, p.head_dim]),
        m(&[b, hk, nk, p.head_dim]),
        m(&[b, hk, nk, p.head_dim_v]),
        m(&[b, hq, nq, nk]),
        m(&[b, hq, nq, p.head_dim_v]),
    ]
}

/// Bytes the GPU forward allocates beyond its inputs and outputs: the contiguous copies of q, k,
/// v and the output and the `[batch, heads, seqlen_q, seqlen_k]` score matrix, all in the input
/// dtype (cuBLAS's own workspace not counted). Saturates at `usize::MAX`.
pub(crate) fn forward_extra_memory_bytes(p: &Problem) -> usize {
    buffer_elements(p)
        .iter()
        .fold(0usize, |a, &x| a.saturating_add(x))
        .saturating_mul(p.dtype.size_in_bytes())
        .saturating_add(p.batch.saturating_mul(16))
}

fn to_i32(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Unsupported {
        device: "cuda",
        what: format!("standard attention with {what} = {x} (over 2^31)"),
    })
}

fn upload_i32(gpu: &Gpu, v: &[i32]) -> Result<CudaSlice<i32>> {
    let v = if v.is_empty() { &[0][..] } else { v };
    gpu.stream
        .clone_htod(v)
        .map_err(Gpu::err("copying sequence lengths"))
}

fn ptr_i32(gpu: &Gpu, s: &CudaSlice<i32>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(&gpu.stream).0
}

/// The standard attention forward of a validated problem on one GPU.
pub(crate) fn forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    let Device::Cuda(ordinal) = p.device else {
        return Err(Error::DeviceMismatch {
            arg: "q",
            expected: "a cuda device".into(),
            got: p.device.to_string(),
        });
    };
    let gpu = gpu(ordinal)?;
    let g = &*gpu;
    let dt = p.dtype;
    let esize = dt.size_in_bytes() as u64;
    let (batch, hq, hk) = (
        to_i32("batch", p.batch)?,
        to_i32("heads", p.heads_q)?,
        to_i32("heads", p.heads_kv)?,
    );
    let (nq, nk) = (to_i32("seqlen_q", p.max_nq)?, to_i32("seqlen_k", p.max_nk)?);
    let (d, dv) = (p.head_dim as i32, p.head_dim_v as i32);
    let [q_el, k_el, v_el, s_el, o_el] = buffer_elements(p);
    to_i32("batch·heads·seqlen_q", p.batch * p.heads_q * p.max_nq)?;

    let out_shape = Problem::shape_like(q, p.head_dim_v);
    let out_strides = strides_like(q, &out_shape);
    let out_store = CudaStorage::alloc_output(&gpu, dt, out_shape.iter().product())?;
    let lse_shape = p.lse_shape();
    let lse_store = CudaStorage::alloc_output(&gpu, DType::F32, lse_shape.iter().product())?;
    let out_layout = RowLayout {
        offset: 0,
        batch: if p.varlen { 0 } else { out_strides[0] },
        row: out_strides[out_strides.len() - 3],
        head: out_strides[out_strides.len() - 2],
    };

    let seq = |f: fn(&crate::problem::Seq) -> usize| -> Vec<i32> {
        p.seqs.iter().map(|s| f(s) as i32).collect()
    };
    let len_q = upload_i32(g, &seq(|s| s.nq))?;
    let len_k = upload_i32(g, &seq(|s| s.nk))?;
    let row0_q = upload_i32(g, &seq(|s| s.q_row0))?;
    let row0_k = upload_i32(g, &seq(|s| s.k_row0))?;
    let (row0_q_ptr, row0_k_ptr) = if p.varlen {
        (ptr_i32(g, &row0_q), ptr_i32(g, &row0_k))
    } else {
        (0, 0)
    };

    let copy_fn = compile::function(g, &source("standard_copy", dt))?;
    let softmax_fn = compile::function(g, &source("standard_softmax", dt))?;
    let copy = |strided: u64,
                l: &RowLayout,
                packed: u64,
                rows: (&CudaSlice<i32>, u64),
                heads: i32,
                max_n: i32,
                dim: i32,
                to_packed: bool|
     -> Result<()> {
        let total = (p.batch * heads as usize * max_n as usize * dim as usize) as u64;
        if total == 0 {
            return Ok(());
        }
        let params = CopyParams {
            strided,
            packed,
            seq_row0: rows.1,
            seq_len: ptr_i32(g, rows.0),
            offset: l.offset as i64,
            stride_b: if p.varlen { 0 } else { l.batch as i64 },
            stride_row: l.row as i64,
            stride_head: l.head as i64,
            batch,
            heads,
            max_n,
            dim,
            to_packed: i32::from(to_packed),
        };
        let blocks = total
            .div_ceil(u64::from(COPY_THREADS))
            .min(g.sm_count as u64 * 32)
            .max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (COPY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `params` matches the kernel's struct; every address it holds is a live buffer
        // of this GPU covering the indices the kernel computes from the same sizes.
        unsafe { g.stream.launch_builder(&copy_fn).arg(&params).launch(cfg) }
            .map(|_| ())
            .map_err(Gpu::err("launching standard_copy"))
    };

    let packed_q = CudaStorage::alloc_output(&gpu, dt, q_el)?;
    let packed_k = CudaStorage::alloc_output(&gpu, dt, k_el)?;
    let packed_v = CudaStorage::alloc_output(&gpu, dt, v_el)?;
    let scores = CudaStorage::alloc_output(&gpu, dt, s_el)?;
    let mut packed_o = CudaStorage::alloc_output(&gpu, dt, o_el)?;
    let input_ptr = |t: &Tensor| t.cuda_ptr().map(|a| a - t.offset() as u64 * esize);
    let (Some(q_ptr), Some(k_ptr), Some(v_ptr)) = (input_ptr(q), input_ptr(k), input_ptr(v)) else {
        return Err(Error::Cuda(
            "an input of a cuda problem is not on the GPU".into(),
        ));
    };
    copy(
        q_ptr,
        &p.q,
        packed_q.device_ptr(),
        (&len_q, row0_q_ptr),
        hq,
        nq,
        d,
        true,
    )?;
    copy(
        k_ptr,
        &p.k,
        packed_k.device_ptr(),
        (&len_k, row0_k_ptr),
        hk,
        nk,
        d,
        true,
    )?;
    copy(
        v_ptr,
        &p.v,
        packed_v.device_ptr(),
        (&len_k, row0_k_ptr),
        hk,
        nk,
        dv,
        true,
    )?;

    let group = (p.heads_q / p.heads_kv) as i64;
    let (nq64, nk64, d64, dv64) = (nq as i64, nk as i64, d as i64, dv as i64);
    let e = esize as i64;
    let blas = blas(g)?;
    let blas = blas.lock().unwrap_or_else(|p| p.into_inner());
    if nq > 0 && nk > 0 {
        // S[b, h] = scale · Q[b, h] · K[b, h / group]ᵀ, query head h = hk · group + gi.
        for gi in 0..group {
            Gemm {
                trans_a: true,
                trans_b: false,
                beta: 0.0,
                m: nk,
                n: nq,
                k: d,
                alpha: p.scale,
                a: (packed_k.device_ptr(), d, nk64 * d64 * e),
                b: (
                    packed_q.device_ptr() + (gi * nq64 * d64 * e) as u64,
                    d,
                    group * nq64 * d64 * e,
                ),
                c: (
                    scores.device_ptr() + (gi * nq64 * nk64 * e) as u64,
                    nk,
                    group * nq64 * nk64 * e,
                ),
                batch: batch * hk,
            }
            .run(&blas, dt)?;
        }
    }
    if nq > 0 {
        let (bias, bias_offset, bias_stride) = match &p.bias {
            Some((t, l)) => (
                t.cuda_ptr()
                    .map(|a| a - t.offset() as u64 * 4)
                    .ok_or_else(|| Error::Cuda("the bias is not on the GPU".into()))?,
                l.offset as i64,
                l.strides.map(|s| s as i64),
            ),
            None => (0, 0, [0; 4]),
        };
        let rel_bias = match &p.rel_bias {
            Some(r) => r
                .table
                .cuda_ptr()
                .ok_or_else(|| Error::Cuda("the rel_bias table is not on the GPU".into()))?,
            None => 0,
        };
        let slopes = p
            .alibi
            .as_ref()
            .map(|s| g.stream.clone_htod(s))
            .transpose()
            .map_err(Gpu::err("copying ALiBi slopes"))?;
        let huge = i64::MAX / 4;
        let params = SoftmaxParams {
            scores: scores.device_ptr(),
            lse: lse_store.device_ptr(),
            bias,
            rel_bias,
            slopes: slopes.as_ref().map_or(0, |s| {
                use cudarc::driver::DevicePtr;
                s.device_ptr(&g.stream).0
            }),
            seq_nq: ptr_i32(g, &len_q),
            seq_nk: ptr_i32(g, &len_k),
            seq_q_row0: row0_q_ptr,
            bias_offset,
            bias_stride,
            window_left: p.window.left.map_or(huge, |w| w.min(huge as usize) as i64),
            window_right: p.window.right.map_or(huge, |w| w.min(huge as usize) as i64),
            // Every sequence shares a diagonal that is not the default (`seqs[0]` then exists).
            diagonal: if p.is_bottom_right() {
                0
            } else {
                p.seqs[0].diag
            },
            batch,
            heads: hq,
            max_nq: nq,
            max_nk: nk,
            total_q: to_i32("total_q", p.total_q)?,
            rel_radius: p.rel_bias.as_ref().map_or(0, |r| r.radius as i32),
            diagonal_given: i32::from(!p.is_bottom_right()),
            softcap: p.softcap.unwrap_or(0.0),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                to_i32("batch·heads·seqlen_q", p.batch * p.heads_q * p.max_nq)? as u32,
                1,
                1,
            ),
            block_dim: (SOFTMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `params` matches the kernel's struct; the score matrix, LSE, bias, slopes and
        // sequence arrays are live buffers of this GPU sized for the indices the kernel computes.
        unsafe {
            g.stream
                .launch_builder(&softmax_fn)
                .arg(&params)
                .launch(cfg)
        }
        .map_err(Gpu::err("launching standard_softmax"))?;
        // O[b, h] = P[b, h] · V[b, h / group].
        for gi in 0..group {
            if nk == 0 {
                break;
            }
            Gemm {
                trans_a: false,
                trans_b: false,
                beta: 0.0,
                m: dv,
                n: nq,
                k: nk,
                alpha: 1.0,
                a: (packed_v.device_ptr(), dv, nk64 * dv64 * e),
                b: (
                    scores.device_ptr() + (gi * nq64 * nk64 * e) as u64,
                    nk,
                    group * nq64 * nk64 * e,
                ),
                c: (
                    packed_o.device_ptr() + (gi * nq64 * dv64 * e) as u64,
                    dv,
                    group * nq64 * dv64 * e,
                ),
                batch: batch * hk,
            }
            .run(&blas, dt)?;
        }
        // The launch that reads the slopes is queued before they are freed (stream order).
        drop(slopes);
    }
    drop(blas);
    if nk == 0 {
        // No keys at all: every output row is 0 (its log-sum-exp is −∞, written above).
        packed_o.fill_bytes(0)?;
    }
    copy(
        out_store.device_ptr(),
        &out_layout,
        packed_o.device_ptr(),
        (&len_q, row0_q_ptr),
        hq,
        nq,
        dv,
        false,
    )?;
    // No synchronization: later uses of the outputs are ordered on the same stream, and a
    // download waits for them.
    Ok(ForwardOutput {
        out: Tensor::from_cuda_storage(out_store, &out_shape, &out_strides, 0)?,
        lse: Tensor::from_cuda_storage(lse_store, &lse_shape, &contiguous_strides(&lse_shape), 0)?,
    })
}
