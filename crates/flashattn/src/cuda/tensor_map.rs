//! TMA tensor maps of the Hopper kernels' q, k, v (and the backward's dout and f32 dQ accumulator): which layouts TMA can describe (a pure
//! function, so the tile choice can ask it), and the `CUtensorMap` each is passed to the kernel as.
//!
//! Each map has rank 4, innermost first: {head dim, rows, heads, batch}, boxes of 64 elements × the
//! rows a box loads (the forward's Q: one consumer warpgroup's 64), 128-byte swizzle, zeros out of
//! bounds. TMA needs a 16-byte-aligned address and byte strides that are multiples of 16 below
//! 2^40; a dimension of size 1 never uses its stride, so any valid one stands in for it (broadcast
//! or odd strides there do not block the path).

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::{DeviceRepr, sys};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{Problem, RowLayout};

/// Bytes of one element (TMA maps only f16 and bf16 here).
const ELEM_BYTES: u64 = 2;
/// Elements of a box's innermost dimension: one 128-byte swizzle row.
const BOX_COLS: u32 = 64;
/// TMA's bound on a byte stride (exclusive) and on a dimension (inclusive).
const MAX_STRIDE: u64 = 1 << 40;
const MAX_DIM: u64 = 1 << 32;

/// One operand as TMA sees it: its first element's address, its sizes innermost first, and the
/// byte strides of the outer three dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TmaLayout {
    pub address: u64,
    pub dims: [u64; 4],
    pub strides: [u64; 3],
}

/// The layout of a `[batch, rows, heads, head_dim]` operand with element strides `l`, or `None`
/// when TMA cannot load it (misaligned address, a zero or unaligned stride of a dimension longer
/// than 1, an empty or oversized dimension).
pub(crate) fn tma_layout(
    address: u64,
    head_dim: usize,
    [rows, heads, batch]: [usize; 3],
    l: &RowLayout,
) -> Option<TmaLayout> {
    let dims = [head_dim, rows, heads, batch].map(|d| d as u64);
    if !address.is_multiple_of(16) || dims.iter().any(|&d| d == 0 || d > MAX_DIM) {
        return None;
    }
    let mut strides = [0u64; 3];
    // The extent in bytes of everything inside the current dimension (as if contiguous).
    let mut inner = dims[0] * ELEM_BYTES;
    for (i, elements) in [l.row, l.head, l.batch].into_iter().enumerate() {
        let stride = if dims[i + 1] == 1 {
            inner.next_multiple_of(16)
        } else {
            (elements as u64).checked_mul(ELEM_BYTES)?
        };
        if stride == 0 || !stride.is_multiple_of(16) || stride >= MAX_STRIDE {
            return None;
        }
        strides[i] = stride;
        inner = stride.checked_mul(dims[i + 1])?;
    }
    Some(TmaLayout {
        address,
        dims,
        strides,
    })
}

/// The layouts of q, k and v of a padded (not packed) problem whose first elements sit at
/// `addresses`, or `None` when TMA cannot load one of them.
pub(crate) fn qkv_layouts(p: &Problem, addresses: [u64; 3]) -> Option<[TmaLayout; 3]> {
    if p.varlen {
        return None;
    }
    let q = tma_layout(
        addresses[0],
        p.head_dim,
        [p.max_nq, p.heads_q, p.batch],
        &p.q,
    )?;
    let kv = [p.max_nk, p.heads_kv, p.batch];
    let k = tma_layout(addresses[1], p.head_dim, kv, &p.k)?;
    let v = tma_layout(addresses[2], p.head_dim_v, kv, &p.v)?;
    Some([q, k, v])
}

/// A `CUtensorMap` passed by value as a `const __grid_constant__ TmaMap` kernel parameter.
#[repr(transparent)]
pub(crate) struct TensorMap(sys::CUtensorMap);

// SAFETY: CUtensorMap is a plain 128-byte `repr(C)` value the kernel reads as its parameter bytes.
unsafe impl DeviceRepr for TensorMap {}

/// Encodes the map of `layout` (a live device tensor of `dtype`, f16 or bf16) loaded in boxes of
/// 64 elements × `box_rows` rows; a driver refusal is an error the caller may fall back on.
pub(crate) fn encode(dtype: DType, layout: &TmaLayout, box_rows: u32) -> Result<TensorMap> {
    let data_type = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::F32 => {
            return Err(Error::Cuda(
                "the Hopper kernels' tensor maps take f16 or bf16".into(),
            ));
        }
    };
    encode_tiled(data_type, layout, [BOX_COLS, box_rows, 1, 1])
}

/// `cuTensorMapEncodeTiled` of `layout` in `boxes`, 128-byte swizzle, zeros out of bounds.
fn encode_tiled(
    data_type: sys::CUtensorMapDataType,
    layout: &TmaLayout,
    boxes: [u32; 4],
) -> Result<TensorMap> {
    let element_strides: [u32; 4] = [1; 4];
    let mut map = MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays hold rank (4) entries (strides: rank - 1) and outlive the call; `map` is
    // written by the call. The map only describes the address and extents; nothing is accessed.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            4,
            layout.address as *mut c_void,
            layout.dims.as_ptr(),
            layout.strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| Error::Cuda(format!("cuTensorMapEncodeTiled: {e:?}")))?;
    // SAFETY: the call succeeded, so it wrote the map.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// The layout of the backward's f32 dQ accumulator of a padded problem (`[batch][rows][heads]`
/// rows of `pitch` elements, a multiple of 4, of which the first `head_dim` are used) at
/// `address`, or `None` when TMA cannot describe it (misaligned, or a dimension too large).
pub(crate) fn accum_layout(p: &Problem, address: u64, pitch: usize) -> Option<TmaLayout> {
    let dims = [p.head_dim, p.max_nq, p.heads_q, p.batch].map(|d| d as u64);
    let row = (p.heads_q * pitch * 4) as u64;
    let strides = [row, (pitch * 4) as u64, row * dims[1]];
    let fits = address.is_multiple_of(16)
        && pitch.is_multiple_of(4)
        && dims.iter().all(|&d| d > 0 && d <= MAX_DIM)
        && strides.iter().all(|&s| s < MAX_STRIDE);
    fits.then_some(TmaLayout {
        address,
        dims,
        strides,
    })
}

/// The map of the dQ accumulator `layout` for reductions of boxes of 32 columns (128 bytes) ×
/// `box_rows` rows.
pub(crate) fn encode_accum(layout: &TmaLayout, box_rows: u32) -> Result<TensorMap> {
    let f32_type = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    encode_tiled(f32_type, layout, [32, box_rows, 1, 1])
}

/// The maps of q, k and v of `p` (first elements at `addresses`) for boxes of `q_rows` query rows
/// and `bc` keys, or `None` when TMA cannot load one (the caller then takes another kernel).
pub(crate) fn forward_maps(
    p: &Problem,
    addresses: [u64; 3],
    q_rows: usize,
    bc: usize,
) -> Option<[TensorMap; 3]> {
    let [q, k, v] = qkv_layouts(p, addresses)?;
    let map = |l: &TmaLayout, rows: usize| encode(p.dtype, l, rows as u32).ok();
    Some([map(&q, q_rows)?, map(&k, bc)?, map(&v, bc)?])
}

/// The maps of q, k, v and dout (`dout` its row layout) of `p` for the Hopper backward's blocks of
/// `bc` keys and steps of `br` query rows (first elements at `addresses`), or `None` when TMA
/// cannot load one.
pub(crate) fn backward_maps(
    p: &Problem,
    addresses: [u64; 4],
    dout: &RowLayout,
    br: usize,
    bc: usize,
) -> Option<[TensorMap; 4]> {
    let [q, k, v] = qkv_layouts(p, [addresses[0], addresses[1], addresses[2]])?;
    let o = tma_layout(
        addresses[3],
        p.head_dim_v,
        [p.max_nq, p.heads_q, p.batch],
        dout,
    )?;
    let map = |l: &TmaLayout, rows: usize| encode(p.dtype, l, rows as u32).ok();
    Some([map(&q, br)?, map(&k, bc)?, map(&v, bc)?, map(&o, br)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(row: usize, head: usize, batch: usize) -> RowLayout {
        RowLayout {
            offset: 0,
            batch,
            row,
            head,
        }
    }

    #[test]
    fn strides_in_bytes_and_size_one_dims_stand_in() {
        // [2, 100, 4, 64] contiguous.
        let t = tma_layout(256, 64, [100, 4, 2], &layout(256, 64, 25600)).unwrap();
        assert_eq!(t.dims, [64, 100, 4, 2]);
        assert_eq!(t.strides, [512, 128, 51200]);
        // One row, one head, one batch: odd and zero strides are replaced by valid ones.
        let t = tma_layout(0, 80, [1, 1, 1], &layout(3, 0, 7)).unwrap();
        assert_eq!(t.strides, [160, 160, 160]);
        // Head dim 8: a row of 16 bytes.
        assert!(tma_layout(0, 8, [5, 1, 1], &layout(8, 40, 40)).is_some());
    }

    #[test]
    fn accumulator_rows_are_pitch_apart() {
        use crate::{AttentionParams, Tensor};
        let q = Tensor::full(&[3, 10, 4, 33], DType::F32, 0.5).unwrap();
        let k = Tensor::full(&[3, 7, 2, 33], DType::F32, 0.5).unwrap();
        let p = Problem::new(&q, &k, &k, &AttentionParams::default()).unwrap();
        let l = accum_layout(&p, 256, 36).unwrap();
        assert_eq!(l.dims, [33, 10, 4, 3]);
        assert_eq!(l.strides, [4 * 36 * 4, 36 * 4, 10 * 4 * 36 * 4]);
        assert!(accum_layout(&p, 8, 36).is_none());
        assert!(accum_layout(&p, 256, 33).is_none());
    }

    #[test]
    fn layouts_tma_cannot_load() {
        let ok = layout(64, 64 * 100, 64 * 100 * 2);
        assert!(tma_layout(0, 64, [100, 2, 3], &ok).is_some());
        // Misaligned address, a row stride of 4 elements (8 bytes), a broadcast (0) head stride.
        assert!(tma_layout(8, 64, [100, 2, 3], &ok).is_none());
        assert!(tma_layout(0, 64, [100, 2, 3], &layout(4, 6400, 12800)).is_none());
        assert!(tma_layout(0, 64, [100, 2, 3], &layout(64, 0, 6400)).is_none());
        // No rows (no keys), a stride of 2^40 bytes.
        assert!(tma_layout(0, 64, [0, 2, 3], &ok).is_none());
        assert!(tma_layout(0, 64, [100, 2, 3], &layout(64, 1 << 39, 64)).is_none());
    }
}
