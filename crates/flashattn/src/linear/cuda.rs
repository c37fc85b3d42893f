//! Linear attention on the GPU: the launches of `kernels/linear_attention.cu`. Every result is
//! one chunked scan `y_r = Σ_{s visible to r} (x_r·u_s)·w_s` over prepared operands: φ(q), φ(k),
//! `[v, 1]` (v and a column of ones, so that one scan gives the numerator and the denominator)
//! and, in the backward, `[g, c]` with `g_i = dout_i / den_i`, `c_i = −g_i·out_i`:
//!
//! | result | rows | x | sources | u | w |
//! |---|---|---|---|---|---|
//! | num, den − eps | queries | φ(q) | keys | φ(k) | [v, 1] |
//! | dq / φ'(q) | queries | [g, c] | keys | [v, 1] | φ(k) |
//! | dk / φ'(k) | keys, from the end | [v, 1] | queries, from the end | [g, c] | φ(q) |
//! | dv | keys, from the end | φ(k) | queries, from the end | φ(q) | g |
//!
//! Counted from their ends, key j sees query i when i ≤ j: the reverse scan is the forward one.
//! Sums are in f64 for f32 inputs (as good as the CPU's) and in f32 for f16/bf16.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{FeatureMap, LinearGradients, LinearParams, LinearShape};
use crate::cuda::compile::{self, KernelSource, TYPES_HEADER};
use crate::cuda::device::{Gpu, gpu};
use crate::cuda::standard::dtype_tag;
use crate::cuda::storage::CudaStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Device, Tensor, contiguous_strides};

const THREADS: u32 = 256;
const TILE: usize = 32;

const ENTRIES: [&str; 6] = [
    "linear_prepare",
    "linear_finish",
    "linear_grad_prep",
    "linear_chunk_states",
    "linear_prefix",
    "linear_rows",
];

/// Sources a chunk and rows a block of `linear_rows`: 64 with f32 sums, 32 with f64 sums, so that
/// the block's four tiles fit 48 KiB of static shared memory.
fn chunk(dtype: DType) -> usize {
    if dtype == DType::F32 { 32 } else { 64 }
}

/// Bytes of one accumulator: f64 for f32 inputs, f32 for f16 and bf16.
fn acc_bytes(dtype: DType) -> usize {
    if dtype == DType::F32 { 8 } else { 4 }
}

fn source(entry: &str, dtype: DType) -> KernelSource {
    let (tag, define) = dtype_tag(dtype);
    let acc = if dtype == DType::F32 {
        "#define ACC_F64\n"
    } else {
        ""
    };
    KernelSource {
        name: format!("{entry}_{tag}"),
        code: format!(
            "#define {define}\n#define LIN_CHUNK {}\n{acc}{TYPES_HEADER}\n{}",
            chunk(dtype),
            include_str!("../../kernels/linear_attention.cu")
        ),
        entry: entry.into(),
        hopper_only: false,
    }
}

/// Every linear-attention kernel for each dtype.
pub(crate) fn kernel_sources() -> Vec<KernelSource> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .flat_map(|d| ENTRIES.map(|e| source(e, d)))
        .collect()
}

/// Host mirror of `PrepParams` in `kernels/linear_attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PrepParams {
    src: u64,
    dst: u64,
    stride: [i64; 4],
    vectors: i64,
    n: i32,
    heads: i32,
    dim: i32,
    ld: i32,
    map: i32,
    pad: i32,
}

/// Host mirror of `FinishParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FinishParams {
    y: u64,
    x: u64,
    out: u64,
    stride: [i64; 4],
    vectors: i64,
    eps: f64,
    n: i32,
    heads: i32,
    dim: i32,
    ld: i32,
    mode: i32,
    map: i32,
}

/// Host mirror of `GradParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GradParams {
    y: u64,
    dout: u64,
    gc: u64,
    stride: [i64; 4],
    vectors: i64,
    eps: f64,
    n: i32,
    heads: i32,
    dv: i32,
    pad: i32,
}

/// Host mirror of `ScanParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScanParams {
    x: u64,
    u: u64,
    w: u64,
    y: u64,
    states: u64,
    nr: i64,
    ns: i64,
    off: i64,
    first_block: i64,
    row_blocks: i64,
    chunks: i64,
    groups: i32,
    hk: i32,
    gr: i32,
    gs: i32,
    du: i32,
    dw: i32,
    ldx: i32,
    ldu: i32,
    ldw: i32,
    ldy: i32,
    causal: i32,
    reverse: i32,
}

// SAFETY: plain `repr(C)` data laid out exactly as the kernel's structs (u64/i64/f64 fields, then
// an even number of i32 fields).
unsafe impl DeviceRepr for PrepParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for FinishParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for GradParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ScanParams {}

const FINISH_DIVIDE: i32 = 0;
const FINISH_GRAD: i32 = 1;
const FINISH_COPY: i32 = 2;

fn map_code(m: Option<FeatureMap>) -> i32 {
    match m {
        None => 0,
        Some(FeatureMap::Elu1) => 1,
        Some(FeatureMap::Relu) => 2,
    }
}

fn too_large(what: &str, n: usize) -> Error {
    Error::Unsupported {
        device: "cuda",
        what: format!("linear attention with {what} = {n} (over 2^31)"),
    }
}

fn int(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| too_large(what, n))
}

/// The product of `xs`, or the typed error when it passes 2^62 (no kernel index gets near).
fn count(what: &str, xs: &[usize]) -> Result<usize> {
    xs.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .filter(|&n| n < 1 << 62)
        .ok_or_else(|| too_large(what, usize::MAX))
}

/// Accumulators on the GPU (f32 or f64 as [`acc_bytes`] says), which a kernel writes before any
/// read.
struct Scratch(CudaSlice<u8>);

impl Scratch {
    fn new(g: &Gpu, dtype: DType, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(acc_bytes(dtype))
            .ok_or_else(|| too_large("a scratch buffer's length", len))?;
        // SAFETY: uninitialized device memory; every element a kernel reads is written first by
        // an earlier kernel on the same stream.
        let buf = unsafe { g.stream.alloc::<u8>(bytes.max(8)) }
            .map_err(Gpu::err("allocating linear attention's scratch memory"))?;
        Ok(Scratch(buf))
    }

    fn ptr(&self, g: &Gpu) -> u64 {
        self.0.device_ptr(&g.stream).0
    }
}

/// Queues `entry` of `dtype` on `blocks` blocks of [`THREADS`]; none when `blocks` is 0.
///
/// # Safety
/// Every address in `params` must be a live buffer of `g` covering the indices the kernel
/// computes from the sizes in `params`.
unsafe fn launch<P: DeviceRepr>(
    g: &Gpu,
    dtype: DType,
    entry: &str,
    params: &P,
    blocks: usize,
) -> Result<()> {
    if blocks == 0 {
        return Ok(());
    }
    let grid = u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| too_large("blocks of one launch", blocks))?;
    let func = compile::function(g, &source(entry, dtype))?;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller guarantees the buffers; `params` matches the kernel's struct.
    unsafe { g.stream.launch_builder(&func).arg(params).launch(cfg) }
        .map(|_| ())
        .map_err(Gpu::err(entry))
}

/// Blocks of a grid-stride kernel over `total` items (`per_block` a block).
fn stride_blocks(g: &Gpu, total: usize, per_block: usize) -> usize {
    total.div_ceil(per_block).min(g.sm_count * 32)
}

/// A tensor's device address and element strides (`[batch, seqlen, heads, dim]`).
fn view(t: &Tensor) -> Result<(u64, [i64; 4])> {
    let ptr = t
        .cuda_ptr()
        .ok_or_else(|| Error::Cuda("an input of linear attention is not on the GPU".into()))?;
    let s = t.strides();
    Ok((ptr, [s[0], s[1], s[2], s[3]].map(|x| x as i64)))
}

/// φ(t) (or t itself, and a column of ones with `ones`) as contiguous accumulators.
fn prepare(g: &Gpu, t: &Tensor, map: Option<FeatureMap>, ones: bool) -> Result<Scratch> {
    let s = t.shape();
    let (b, n, h, d) = (s[0], s[1], s[2], s[3]);
    let ld = d + usize::from(ones);
    let vectors = count("batch·seqlen·heads", &[b, n, h])?;
    let total = count("the elements of an operand", &[vectors, ld])?;
    let dst = Scratch::new(g, t.dtype(), total)?;
    let (src, stride) = view(t)?;
    let params = PrepParams {
        src,
        dst: dst.ptr(g),
        stride,
        vectors: vectors as i64,
        n: int("seqlen", n)?,
        heads: int("heads", h)?,
        dim: int("head_dim", d)?,
        ld: int("head_dim", ld)?,
        map: map_code(map),
        pad: 0,
    };
    // SAFETY: `src` is `t`'s view (every element its strides reach lies in its buffer), `dst`
    // holds `vectors · ld` accumulators.
    unsafe {
        launch(
            g,
            t.dtype(),
            "linear_prepare",
            &params,
            stride_blocks(g, total, THREADS as usize),
        )?
    };
    Ok(dst)
}

/// An accumulator buffer `[batch, n, heads, ld]` and the leading columns an operand uses.
#[derive(Clone, Copy)]
struct Operand {
    ptr: u64,
    ld: usize,
    width: usize,
}

impl Operand {
    fn all(g: &Gpu, s: &Scratch, width: usize) -> Self {
        Operand {
            ptr: s.ptr(g),
            ld: width,
            width,
        }
    }
}

/// One scan: rows (x) and sources (u, w) of `hk` groups, `gr` row heads and `gs` source heads
/// a group; causal row r sees sources s < r + 1 + off.
struct Scan {
    x: Operand,
    u: Operand,
    w: Operand,
    rows: usize,
    sources: usize,
    gr: usize,
    gs: usize,
    off: i64,
    reverse: bool,
}

/// The rows' y `[batch, rows, hk·gr, w.width]` of scan `s`.
fn scan(g: &Gpu, sh: &LinearShape, dtype: DType, causal: bool, s: &Scan) -> Result<Scratch> {
    let (du, dw) = (s.x.width, s.w.width);
    let c = chunk(dtype);
    let groups = count("batch·heads_k", &[sh.b, sh.hk])?;
    let y = Scratch::new(
        g,
        dtype,
        count("the elements of a result", &[groups, s.rows, s.gr, dw])?,
    )?;
    if groups == 0 || s.rows == 0 {
        return Ok(y);
    }
    let chunks = s.sources.div_ceil(c);
    let states = Scratch::new(
        g,
        dtype,
        count("the chunk states", &[groups, chunks + 1, du, dw])?,
    )?;
    let (rows, cc) = (s.rows as i64, c as i64);
    let (first_block, row_blocks) = if causal {
        let lo = s.off.div_euclid(cc);
        (lo, (rows - 1 + s.off).div_euclid(cc) - lo + 1)
    } else {
        (0, s.rows.div_ceil(c) as i64)
    };
    let params = ScanParams {
        x: s.x.ptr,
        u: s.u.ptr,
        w: s.w.ptr,
        y: y.ptr(g),
        states: states.ptr(g),
        nr: rows,
        ns: s.sources as i64,
        off: s.off,
        first_block,
        row_blocks,
        chunks: chunks as i64,
        groups: int("batch·heads_k", groups)?,
        hk: int("heads_k", sh.hk)?,
        gr: int("heads", s.gr)?,
        gs: int("heads", s.gs)?,
        du: int("head_dim", du)?,
        dw: int("head_dim", dw)?,
        ldx: int("head_dim", s.x.ld)?,
        ldu: int("head_dim", s.u.ld)?,
        ldw: int("head_dim", s.w.ld)?,
        ldy: int("head_dim", dw)?,
        causal: i32::from(causal),
        reverse: i32::from(s.reverse),
    };
    let tiles = du.div_ceil(TILE) * dw.div_ceil(TILE);
    let state_blocks = count("chunk-state blocks", &[chunks, groups, tiles])?;
    let row_block_count = count("row blocks", &[row_blocks as usize, groups, s.gr])?;
    let elements = count("the chunk states", &[groups, du, dw])?;
    // SAFETY: x, u, w are prepared operands of `groups · rows · gr` and `groups · sources · gs`
    // vectors of at least `ld` accumulators; y and the states were sized above from the same
    // numbers; the three kernels run in stream order.
    unsafe {
        launch(g, dtype, "linear_chunk_states", &params, state_blocks)?;
        launch(
            g,
            dtype,
            "linear_prefix",
            &params,
            stride_blocks(g, elements, THREADS as usize),
        )?;
        launch(g, dtype, "linear_rows", &params, row_block_count)?;
    }
    Ok(y)
}

/// The output or a gradient `[shape]` in `dtype` from a scan's y (`ld` accumulators a vector):
/// `mode` a `FINISH_*`, `x` the input whose φ' `FINISH_GRAD` multiplies by.
fn finish(
    g: &std::sync::Arc<Gpu>,
    dtype: DType,
    shape: [usize; 4],
    (y, ld): (&Scratch, usize),
    (mode, x, map): (i32, Option<&Tensor>, FeatureMap),
    eps: f64,
) -> Result<Tensor> {
    let vectors = count("batch·seqlen·heads", &shape[..3])?;
    let total = count("the elements of a result", &shape)?;
    let out = CudaStorage::alloc_output(g, dtype, total)?;
    let (xp, stride) = x.map(view).transpose()?.unwrap_or((0, [0; 4]));
    let params = FinishParams {
        y: y.ptr(g),
        x: xp,
        out: out.device_ptr(),
        stride,
        vectors: vectors as i64,
        eps,
        n: int("seqlen", shape[1])?,
        heads: int("heads", shape[2])?,
        dim: int("head_dim", shape[3])?,
        ld: int("head_dim", ld)?,
        mode,
        map: map_code(Some(map)),
    };
    // SAFETY: y holds `vectors · ld` accumulators, `out` `vectors · dim` elements; `x`, when
    // given, is an input view of this shape.
    unsafe {
        launch(
            g,
            dtype,
            "linear_finish",
            &params,
            stride_blocks(g, total, THREADS as usize),
        )?
    };
    Tensor::from_cuda_storage(out, &shape, &contiguous_strides(&shape), 0)
}

/// The GPU of a validated call.
fn device_of(q: &Tensor) -> Result<std::sync::Arc<Gpu>> {
    match q.device() {
        Device::Cuda(ordinal) => gpu(ordinal),
        Device::Cpu => Err(Error::DeviceMismatch {
            arg: "q",
            expected: "a cuda device".into(),
            got: "cpu".into(),
        }),
    }
}

/// φ(q), φ(k), [v, 1] and the forward's scan: numerators and denominators − eps.
struct Forward {
    fq: Scratch,
    fk: Scratch,
    v1: Scratch,
    y: Scratch,
}

fn forward_scan(
    g: &Gpu,
    sh: &LinearShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &LinearParams,
) -> Result<Forward> {
    let map = Some(p.feature_map);
    let (fq, fk, v1) = (
        prepare(g, q, map, false)?,
        prepare(g, k, map, false)?,
        prepare(g, v, None, true)?,
    );
    let y = scan(
        g,
        sh,
        q.dtype(),
        p.causal,
        &Scan {
            x: Operand::all(g, &fq, sh.d),
            u: Operand::all(g, &fk, sh.d),
            w: Operand::all(g, &v1, sh.dv + 1),
            rows: sh.nq,
            sources: sh.nk,
            gr: sh.h / sh.hk,
            gs: 1,
            off: sh.nk as i64 - sh.nq as i64,
            reverse: false,
        },
    )?;
    Ok(Forward { fq, fk, v1, y })
}

/// The output `[b, nq, h, dv]` of validated CUDA q, k, v.
pub(super) fn forward(
    sh: LinearShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &LinearParams,
) -> Result<Tensor> {
    let gpu = device_of(q)?;
    let f = forward_scan(&gpu, &sh, q, k, v, p)?;
    finish(
        &gpu,
        q.dtype(),
        [sh.b, sh.nq, sh.h, sh.dv],
        (&f.y, sh.dv + 1),
        (FINISH_DIVIDE, None, p.feature_map),
        p.eps,
    )
}

/// dq, dk, dv of validated CUDA q, k, v and dout.
pub(super) fn backward(
    sh: LinearShape,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    dout: &Tensor,
    p: &LinearParams,
) -> Result<LinearGradients> {
    let gpu = device_of(q)?;
    let g = &*gpu;
    let dt = q.dtype();
    let f = forward_scan(g, &sh, q, k, v, p)?;
    let vectors = count("batch·seqlen·heads", &[sh.b, sh.nq, sh.h])?;
    let gc = Scratch::new(g, dt, count("[g, c]", &[vectors, sh.dv + 1])?)?;
    let (dout_ptr, stride) = view(dout)?;
    let params = GradParams {
        y: f.y.ptr(g),
        dout: dout_ptr,
        gc: gc.ptr(g),
        stride,
        vectors: vectors as i64,
        eps: p.eps,
        n: int("seqlen_q", sh.nq)?,
        heads: int("heads", sh.h)?,
        dv: int("head_dim_v", sh.dv)?,
        pad: 0,
    };
    // SAFETY: y and gc hold `vectors · (dv + 1)` accumulators; dout is a view of the output's shape.
    unsafe {
        launch(
            g,
            dt,
            "linear_grad_prep",
            &params,
            stride_blocks(g, vectors, THREADS as usize / 32),
        )?
    };
    let group = sh.h / sh.hk;
    let gcs = Operand::all(g, &gc, sh.dv + 1);
    let v1 = Operand::all(g, &f.v1, sh.dv + 1);
    let (fq, fk) = (Operand::all(g, &f.fq, sh.d), Operand::all(g, &f.fk, sh.d));
    let by_query = |x, u, w| Scan {
        x,
        u,
        w,
        rows: sh.nq,
        sources: sh.nk,
        gr: group,
        gs: 1,
        off: sh.nk as i64 - sh.nq as i64,
        reverse: false,
    };
    let by_key = |x, u, w| Scan {
        x,
        u,
        w,
        rows: sh.nk,
        sources: sh.nq,
        gr: 1,
        gs: group,
        off: 0,
        reverse: true,
    };
    let ydq = scan(g, &sh, dt, p.causal, &by_query(gcs, v1, fk))?;
    let ydk = scan(g, &sh, dt, p.causal, &by_key(v1, gcs, fq))?;
    let g_only = Operand {
        width: sh.dv,
        ..gcs
    };
    let ydv = scan(g, &sh, dt, p.causal, &by_key(fk, fq, g_only))?;
    let map = p.feature_map;
    Ok(LinearGradients {
        dq: finish(
            &gpu,
            dt,
            [sh.b, sh.nq, sh.h, sh.d],
            (&ydq, sh.d),
            (FINISH_GRAD, Some(q), map),
            p.eps,
        )?,
        dk: finish(
            &gpu,
            dt,
            [sh.b, sh.nk, sh.hk, sh.d],
            (&ydk, sh.d),
            (FINISH_GRAD, Some(k), map),
            p.eps,
        )?,
        dv: finish(
            &gpu,
            dt,
            [sh.b, sh.nk, sh.hk, sh.dv],
            (&ydv, sh.dv),
            (FINISH_COPY, None, map),
            p.eps,
        )?,
    })
}
