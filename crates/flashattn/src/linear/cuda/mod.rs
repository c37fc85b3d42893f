//! Linear attention on the GPU: the launches of `kernels/linear_attention.cu`, the chunked scans
//! of [`super`]'s table on operands prepared in device buffers.

mod kernels;

pub(crate) use kernels::kernel_sources;
use kernels::{
    CHUNK, FINISH_COPY, FINISH_DIVIDE, FINISH_GRAD, FinishParams, GradParams, PrepParams,
    ScanParams, Scratch, THREADS, TILE, count, int, launch, map_code, stride_blocks,
};

use super::{FeatureMap, LinearGradients, LinearParams, LinearShape};
use crate::cuda::device::{Gpu, gpu};
use crate::cuda::storage::CudaStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Device, Tensor, contiguous_strides};

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
    let dst = Scratch::new(g, total)?;
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

/// State slots of a non-causal scan, which needs only each group's total: `source_chunks`
/// chunks summed into partial sums, enough for about eight blocks an SM (a full one) over
/// `blocks_a_slot` blocks a slot, so that its states take O(D²) memory a group, not one a chunk.
fn partial_sums(g: &Gpu, source_chunks: usize, blocks_a_slot: usize) -> usize {
    (8 * g.sm_count)
        .div_ceil(blocks_a_slot.max(1))
        .clamp(1, source_chunks.max(1))
}

/// The rows' y `[batch, rows, hk·gr, w.width]` of scan `s`.
fn scan(g: &Gpu, sh: &LinearShape, dtype: DType, causal: bool, s: &Scan) -> Result<Scratch> {
    let (du, dw) = (s.x.width, s.w.width);
    let c = CHUNK;
    let groups = count("batch·heads_k", &[sh.b, sh.hk])?;
    let y = Scratch::new(
        g,
        count("the elements of a result", &[groups, s.rows, s.gr, dw])?,
    )?;
    if groups == 0 || s.rows == 0 {
        return Ok(y);
    }
    let source_chunks = s.sources.div_ceil(c);
    let tiles = du.div_ceil(TILE) * dw.div_ceil(TILE);
    let chunks = if causal {
        source_chunks
    } else {
        partial_sums(g, source_chunks, groups * tiles)
    };
    let states = Scratch::new(g, count("the chunk states", &[groups, chunks + 1, du, dw])?)?;
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
        source_chunks: source_chunks as i64,
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
    let gc = Scratch::new(g, count("[g, c]", &[vectors, sh.dv + 1])?)?;
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
