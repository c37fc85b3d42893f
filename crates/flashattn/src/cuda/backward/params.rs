//! The backward kernels' parameter struct (`BwdParams` in `kernels/bwd_info.cuh`): the forward's
//! [`FlashParams`] plus dout, the gradients, D and the f32 dQ accumulator.

use cudarc::driver::DeviceRepr;

use crate::cuda::params::FlashParams;
use crate::problem::{Problem, RowLayout};

/// Mirrors `struct BwdParams` in `kernels/bwd_info.cuh` field by field (a `FlashParams`, whose
/// size is a multiple of 8, then 8-byte fields only), so `#[repr(C)]` gives the same layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BwdParams {
    pub f: FlashParams,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dbias: u64,
    pub delta: u64,
    pub dq_accum: u64,
    pub dout_strides: [i64; 3],
    pub dq_strides: [i64; 3],
    pub dk_strides: [i64; 3],
    pub dv_strides: [i64; 3],
    pub dbias_strides: [i64; 4],
    pub accum_batch: i64,
    pub accum_len: i64,
    pub dbias_len: i64,
    pub part_strides: [i64; 3],
    pub part_blocks: i64,
    pub dbias_heads: i64,
    pub dbias_cols: i64,
    pub drel_bias: u64,
    pub drel_part: u64,
    pub drel_len: i64,
    pub drel_part_len: i64,
    pub drel_blocks: i64,
    pub accum_pitch: i64,
}

// SAFETY: `BwdParams` is `#[repr(C)]`, `Copy`, holds only integers and floats (device addresses as
// u64) and a `FlashParams` (itself a valid kernel argument), and matches the CUDA struct's layout.
unsafe impl DeviceRepr for BwdParams {}

/// Device addresses of what the backward reads and writes beyond the forward's tensors (0 for
/// what the call lacks), each at its tensor's first element.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BwdPointers {
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dbias: u64,
    pub delta: u64,
    pub dq_accum: u64,
    pub drel_bias: u64,
    pub drel_part: u64,
}

/// The row layouts of dout and of the three gradients.
pub(crate) struct BwdLayouts {
    pub dout: RowLayout,
    pub dq: RowLayout,
    pub dk: RowLayout,
    pub dv: RowLayout,
}

fn strides(l: &RowLayout) -> [i64; 3] {
    [l.batch as i64, l.row as i64, l.head as i64]
}

/// Strides of a contiguous tensor of `shape` (rank 4), 0 along its dimensions of size 1.
fn broadcast_strides(shape: &[usize]) -> [i64; 4] {
    let mut out = [0i64; 4];
    let mut step = 1i64;
    for d in (0..4).rev() {
        let n = shape.get(d).copied().unwrap_or(1);
        out[d] = if n == 1 { 0 } else { step };
        step *= n as i64;
    }
    out
}

/// Elements of a row of the f32 dQ accumulator: `head_dim` rounded up to 4, so rows start 16
/// bytes apart as TMA needs.
pub(crate) fn accum_pitch(p: &Problem) -> usize {
    p.head_dim.next_multiple_of(4)
}

/// Elements of the f32 dQ accumulator of `p`: one row per query row and head.
pub(crate) fn accum_len(p: &Problem) -> usize {
    p.total_q * p.heads_q * accum_pitch(p)
}

/// The deterministic dQ pass's partial gradients of `p`'s relative-position table over `blocks`
/// query blocks: `[batch][heads_q][blocks][2L − 1]` elements (0 without a table or blocks).
pub(crate) fn rel_parts_len(p: &Problem, blocks: usize) -> usize {
    p.rel_bias
        .as_ref()
        .map_or(0, |r| p.batch * p.heads_q * blocks * r.width())
}

/// The deterministic dQ pass's partial bias gradients, for a bias broadcast over query rows:
/// `[batch or 1][heads or 1][blocks][seqlen_k or 1]`, contiguous, one row per query block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BiasParts {
    /// Strides of batch, head and query block (0 along the bias' broadcast dims).
    pub strides: [i64; 3],
    /// Elements.
    pub len: usize,
    /// Query blocks.
    pub blocks: usize,
}

/// The partials of `p`'s bias over `blocks` query blocks, or `None` when the bias has query rows
/// (or there is none).
pub(crate) fn bias_parts(p: &Problem, blocks: usize) -> Option<BiasParts> {
    let shape = p.bias.as_ref()?.0.shape();
    if shape[2] != 1 {
        return None;
    }
    let (b1, h1, k1) = (shape[0], shape[1], shape[3]);
    let stride = |n: usize, s: usize| if n == 1 { 0 } else { s as i64 };
    Some(BiasParts {
        strides: [
            stride(b1, h1 * blocks * k1),
            stride(h1, blocks * k1),
            k1 as i64,
        ],
        len: b1 * h1 * blocks * k1,
        blocks,
    })
}

impl BwdParams {
    /// The parameters of `p`'s backward: `f` the forward's (with `o` at the forward's output);
    /// `accum`: the elements of `dq_accum` (zeroed first); `parts`: the partial bias gradients of
    /// [`bias_parts`], if any (`dq_accum` then holds them); `rel_blocks`: the query blocks of
    /// the deterministic dQ pass (0 otherwise), whose partial table gradients `drel_part` holds.
    pub(crate) fn new(
        p: &Problem,
        (f, ptr): (FlashParams, BwdPointers),
        l: &BwdLayouts,
        (accum, parts): (usize, Option<BiasParts>),
        rel_blocks: usize,
    ) -> Self {
        let bias_shape = p.bias.as_ref().map(|(t, _)| t.shape().to_vec());
        let (dbias_strides, dbias_len) = match &bias_shape {
            Some(shape) => (broadcast_strides(shape), shape.iter().product::<usize>()),
            None => ([0; 4], 0),
        };
        let accum_batch = if p.varlen {
            0
        } else {
            (p.max_nq * p.heads_q * accum_pitch(p)) as i64
        };
        BwdParams {
            f,
            dout: ptr.dout,
            dq: ptr.dq,
            dk: ptr.dk,
            dv: ptr.dv,
            dbias: ptr.dbias,
            delta: ptr.delta,
            dq_accum: ptr.dq_accum,
            dout_strides: strides(&l.dout),
            dq_strides: strides(&l.dq),
            dk_strides: strides(&l.dk),
            dv_strides: strides(&l.dv),
            dbias_strides,
            accum_batch,
            accum_len: accum as i64,
            dbias_len: dbias_len as i64,
            part_strides: parts.map_or([0; 3], |b| b.strides),
            part_blocks: parts.map_or(0, |b| b.blocks as i64),
            dbias_heads: bias_shape.as_ref().map_or(1, |s| s[1] as i64),
            dbias_cols: bias_shape.as_ref().map_or(1, |s| s[3] as i64),
            drel_bias: ptr.drel_bias,
            drel_part: ptr.drel_part,
            drel_len: p.rel_bias.as_ref().map_or(0, |r| r.table.numel() as i64),
            drel_part_len: rel_parts_len(p, rel_blocks) as i64,
            drel_blocks: rel_blocks as i64,
            accum_pitch: accum_pitch(p) as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_cuda_struct() {
        let f = std::mem::size_of::<FlashParams>();
        assert_eq!(
            f % 8,
            0,
            "BwdParams' 8-byte fields follow FlashParams unpadded"
        );
        // 7 pointers, 16 strides, 3 sizes, 3 strides and 3 sizes after the forward's parameters,
        // then the table gradient's 2 pointers and 3 sizes, then the accumulator's pitch.
        assert_eq!(
            std::mem::size_of::<BwdParams>(),
            f + 8 * (7 + 16 + 3 + 3 + 3 + 5 + 1)
        );
        assert_eq!(std::mem::offset_of!(BwdParams, accum_pitch), f + 8 * 37);
        assert_eq!(std::mem::offset_of!(BwdParams, drel_bias), f + 8 * 32);
        assert_eq!(std::mem::offset_of!(BwdParams, part_strides), f + 8 * 26);
        assert_eq!(std::mem::offset_of!(BwdParams, dbias_cols), f + 8 * 31);
        assert_eq!(std::mem::offset_of!(BwdParams, dout), f);
        assert_eq!(std::mem::offset_of!(BwdParams, dout_strides), f + 8 * 7);
        assert_eq!(std::mem::offset_of!(BwdParams, accum_batch), f + 8 * 23);
    }

    /// The partials of a bias broadcast over query rows: one row per query block, contiguous,
    /// stride 0 along the other broadcast dims; none when the bias has query rows.
    #[test]
    fn bias_parts_cover_each_query_block() {
        use crate::{AttentionParams, Tensor};
        let q = Tensor::full(&[2, 9, 4, 8], crate::DType::F32, 0.5).unwrap();
        let k = Tensor::full(&[2, 7, 4, 8], crate::DType::F32, 0.5).unwrap();
        let problem = |shape: &[usize]| {
            let bias = Tensor::full(shape, crate::DType::F32, 0.25).unwrap();
            Problem::new(&q, &k, &k, &AttentionParams::default().bias(bias)).unwrap()
        };
        let parts = |strides, len, blocks| {
            Some(BiasParts {
                strides,
                len,
                blocks,
            })
        };
        assert_eq!(
            bias_parts(&problem(&[1, 4, 1, 7]), 3),
            parts([0, 21, 7], 84, 3)
        );
        assert_eq!(
            bias_parts(&problem(&[2, 1, 1, 1]), 5),
            parts([5, 0, 1], 10, 5)
        );
        assert_eq!(bias_parts(&problem(&[2, 4, 9, 7]), 3), None);
    }

    #[test]
    fn broadcast_dims_have_stride_zero() {
        assert_eq!(broadcast_strides(&[2, 3, 4, 5]), [60, 20, 5, 1]);
        assert_eq!(broadcast_strides(&[1, 3, 1, 5]), [0, 5, 0, 1]);
        assert_eq!(broadcast_strides(&[2, 1, 4, 1]), [4, 0, 1, 0]);
    }
}
