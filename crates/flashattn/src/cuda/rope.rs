//! The launch of `kernels/rope.cu`: the fused layer's rotary embedding in place in a packed
//! buffer on the GPU.

use cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::compile::{self, KernelSource, TYPES_HEADER};
use super::device::Gpu;
use super::standard::dtype_tag;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Host mirror of `RopeParams` in `kernels/rope.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeParams {
    data: u64,
    positions: u64,
    inv_freq: u64,
    rows: i64,
    cols: i32,
    heads: i32,
    head_dim: i32,
    half: i32,
    interleaved: i32,
    inverse: i32,
}

// SAFETY: plain `repr(C)` data laid out exactly as the kernel's struct (u64/i64 then i32 fields).
unsafe impl DeviceRepr for RopeParams {}

const THREADS: u32 = 256;

fn source(dtype: DType) -> KernelSource {
    let (tag, define) = dtype_tag(dtype);
    KernelSource {
        name: format!("rope_rotate_{tag}"),
        code: format!(
            "#define {define}\n{TYPES_HEADER}\n{}",
            include_str!("../../kernels/rope.cu")
        ),
        entry: "rope_rotate".into(),
        hopper_only: false,
    }
}

/// The rotation kernel for each dtype.
pub(crate) fn kernel_sources() -> Vec<KernelSource> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(source)
        .collect()
}

/// One rotation: the buffer and its shape, and the rotary arguments.
pub(crate) struct Rotation<'a> {
    /// Device address of element 0 of the contiguous `[rows, cols]` buffer.
    pub data: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Heads rotated in each row (from column 0), each `head_dim` wide.
    pub heads: usize,
    pub head_dim: usize,
    /// One position a row.
    pub positions: &'a [i32],
    /// One frequency a pair (`R / 2` of them).
    pub inv_freq: &'a [f64],
    pub interleaved: bool,
    pub inverse: bool,
}

/// Queues the rotation on `g`'s stream.
pub(crate) fn rotate(g: &Gpu, r: &Rotation<'_>) -> Result<()> {
    let total = r.rows as u64 * (r.heads * r.inv_freq.len()) as u64;
    if total == 0 {
        return Ok(());
    }
    let narrow = |what: &str, n: usize| {
        i32::try_from(n).map_err(|_| Error::Unsupported {
            device: "cuda",
            what: format!("the rotary embedding with {what} = {n} (over 2^31)"),
        })
    };
    let positions = g
        .stream
        .clone_htod(r.positions)
        .map_err(Gpu::err("copying rotary positions"))?;
    let freqs = g
        .stream
        .clone_htod(r.inv_freq)
        .map_err(Gpu::err("copying rotary frequencies"))?;
    let params = RopeParams {
        data: r.data,
        positions: positions.device_ptr(&g.stream).0,
        inv_freq: freqs.device_ptr(&g.stream).0,
        rows: r.rows as i64,
        cols: narrow("columns", r.cols)?,
        heads: narrow("heads", r.heads)?,
        head_dim: narrow("head_dim", r.head_dim)?,
        half: narrow("rotary pairs", r.inv_freq.len())?,
        interleaved: i32::from(r.interleaved),
        inverse: i32::from(r.inverse),
    };
    let func = compile::function(g, &source(r.dtype))?;
    let blocks = total
        .div_ceil(u64::from(THREADS))
        .min(g.sm_count as u64 * 32)
        .max(1) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches the kernel's struct; `data` is a live buffer of this GPU of
    // `rows · cols` elements of `dtype` (the caller's), the positions (`rows`) and frequencies
    // (`half`) were copied above and live until the launch is done (freed after it on the
    // same stream); the kernel touches only the first `heads · head_dim ≤ cols` columns.
    unsafe { g.stream.launch_builder(&func).arg(&params).launch(cfg) }
        .map_err(Gpu::err("launching rope_rotate"))?;
    drop((positions, freqs));
    Ok(())
}
