//! Blocks of columns copied between row-major matrices on the GPU by the driver's 2-D copy,
//! queued on the GPU's stream: the separate-calls yardstick's Q and K copies and its gradient
//! concatenation.

use cudarc::driver::sys::{self, CUmemorytype};

use crate::cuda::device::Gpu;
use crate::dtype::DType;
use crate::error::Result;

/// A block of columns of a row-major device matrix.
pub(super) struct Columns {
    /// Device address of element (0, 0) of the matrix.
    pub ptr: u64,
    /// Elements from one row to the next.
    pub pitch: usize,
    /// The block's first column.
    pub first: usize,
}

/// Queues the copy of a `rows × width` block of elements of `dtype` from `src` to `dst`.
pub(super) fn copy_columns(
    g: &Gpu,
    dtype: DType,
    (rows, width): (usize, usize),
    dst: &Columns,
    src: &Columns,
) -> Result<()> {
    if rows == 0 || width == 0 {
        return Ok(());
    }
    debug_assert!(src.first + width <= src.pitch && dst.first + width <= dst.pitch);
    let e = dtype.size_in_bytes();
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: src.first * e,
        srcY: 0,
        srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.ptr,
        srcArray: std::ptr::null_mut(),
        srcPitch: src.pitch * e,
        dstXInBytes: dst.first * e,
        dstY: 0,
        dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.ptr,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.pitch * e,
        WidthInBytes: width * e,
        Height: rows,
    };
    g.ctx
        .bind_to_thread()
        .map_err(Gpu::err("binding the context"))?;
    // SAFETY: both matrices are live buffers of this GPU holding `rows` rows of `pitch` elements
    // (the caller's), and `first + width ≤ pitch` on each side, so the copy stays inside them;
    // it is ordered on the stream every other use of the buffers goes through.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, g.stream.cu_stream()) }
        .result()
        .map_err(Gpu::err("copying columns on the device"))
}
