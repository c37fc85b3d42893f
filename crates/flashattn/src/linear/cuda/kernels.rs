//! The kernels of `kernels/linear_attention.cu`: their sources, the host mirrors of their
//! parameter structs, the scratch buffers they sum into, and one launch.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::super::FeatureMap;
use crate::cuda::compile::{self, KernelSource, TYPES_HEADER};
use crate::cuda::device::Gpu;
use crate::cuda::standard::dtype_tag;
use crate::dtype::DType;
use crate::error::{Error, Result};

pub(super) const THREADS: u32 = 256;
pub(super) const TILE: usize = 32;

const ENTRIES: [&str; 6] = [
    "linear_prepare",
    "linear_finish",
    "linear_grad_prep",
    "linear_chunk_states",
    "linear_prefix",
    "linear_rows",
];

/// Sources a chunk and rows a block of `linear_rows`: the largest power of two whose four f64
/// tiles fit 48 KiB of static shared memory.
pub(super) const CHUNK: usize = 32;

fn source(entry: &str, dtype: DType) -> KernelSource {
    let (tag, define) = dtype_tag(dtype);
    KernelSource {
        name: format!("{entry}_{tag}"),
        code: format!(
            "#define {define}\n#define LIN_CHUNK {CHUNK}\n{TYPES_HEADER}\n{}",
            include_str!("../../../kernels/linear_attention.cu")
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
pub(super) struct PrepParams {
    pub src: u64,
    pub dst: u64,
    pub stride: [i64; 4],
    pub vectors: i64,
    pub n: i32,
    pub heads: i32,
    pub dim: i32,
    pub ld: i32,
    pub map: i32,
    pub pad: i32,
}

/// Host mirror of `FinishParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FinishParams {
    pub y: u64,
    pub x: u64,
    pub out: u64,
    pub stride: [i64; 4],
    pub vectors: i64,
    pub eps: f64,
    pub n: i32,
    pub heads: i32,
    pub dim: i32,
    pub ld: i32,
    pub mode: i32,
    pub map: i32,
}

/// Host mirror of `GradParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct GradParams {
    pub y: u64,
    pub dout: u64,
    pub gc: u64,
    pub stride: [i64; 4],
    pub vectors: i64,
    pub eps: f64,
    pub n: i32,
    pub heads: i32,
    pub dv: i32,
    pub pad: i32,
}

/// Host mirror of `ScanParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ScanParams {
    pub x: u64,
    pub u: u64,
    pub w: u64,
    pub y: u64,
    pub states: u64,
    pub nr: i64,
    pub ns: i64,
    pub off: i64,
    pub first_block: i64,
    pub row_blocks: i64,
    pub chunks: i64,
    pub source_chunks: i64,
    pub groups: i32,
    pub hk: i32,
    pub gr: i32,
    pub gs: i32,
    pub du: i32,
    pub dw: i32,
    pub ldx: i32,
    pub ldu: i32,
    pub ldw: i32,
    pub ldy: i32,
    pub causal: i32,
    pub reverse: i32,
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

pub(super) const FINISH_DIVIDE: i32 = 0;
pub(super) const FINISH_GRAD: i32 = 1;
pub(super) const FINISH_COPY: i32 = 2;

pub(super) fn map_code(m: Option<FeatureMap>) -> i32 {
    match m {
        None => 0,
        Some(FeatureMap::Elu1) => 1,
        Some(FeatureMap::Relu) => 2,
    }
}

pub(super) fn too_large(what: &str, n: usize) -> Error {
    Error::Unsupported {
        device: "cuda",
        what: format!("linear attention with {what} = {n} (over 2^31)"),
    }
}

pub(super) fn int(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| too_large(what, n))
}

/// The product of `xs`, or the typed error when it passes 2^62 (no kernel index gets near).
pub(super) fn count(what: &str, xs: &[usize]) -> Result<usize> {
    xs.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .filter(|&n| n < 1 << 62)
        .ok_or_else(|| too_large(what, usize::MAX))
}

/// f64 accumulators on the GPU, which a kernel writes before any read.
pub(super) struct Scratch(CudaSlice<f64>);

impl Scratch {
    pub(super) fn new(g: &Gpu, len: usize) -> Result<Self> {
        // SAFETY: uninitialized device memory; every element a kernel reads is written first by
        // an earlier kernel on the same stream.
        let buf = unsafe { g.stream.alloc::<f64>(len.max(1)) }
            .map_err(Gpu::err("allocating linear attention's scratch memory"))?;
        Ok(Scratch(buf))
    }

    pub(super) fn ptr(&self, g: &Gpu) -> u64 {
        self.0.device_ptr(&g.stream).0
    }
}

/// Queues `entry` of `dtype` on `blocks` blocks of [`THREADS`]; none when `blocks` is 0.
///
/// # Safety
/// Every address in `params` must be a live buffer of `g` covering the indices the kernel
/// computes from the sizes in `params`.
pub(super) unsafe fn launch<P: DeviceRepr>(
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
pub(super) fn stride_blocks(g: &Gpu, total: usize, per_block: usize) -> usize {
    total.div_ceil(per_block).min(g.sm_count * 32)
}
