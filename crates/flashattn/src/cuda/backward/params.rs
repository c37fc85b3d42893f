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

/// Elements of the f32 dQ accumulator of `p`: one `head_dim` row per query row and head.
pub(crate) fn accum_len(p: &Problem) -> usize {
    p.total_q * p.heads_q * p.head_dim
}

impl BwdParams {
    /// The parameters of `p`'s backward: `f` the forward's (with `o` at the forward's output).
    pub(crate) fn new(p: &Problem, f: FlashParams, ptr: BwdPointers, l: &BwdLayouts) -> Self {
        let bias_shape = p.bias.as_ref().map(|(t, _)| t.shape().to_vec());
        let (dbias_strides, dbias_len) = match &bias_shape {
            Some(shape) => (broadcast_strides(shape), shape.iter().product::<usize>()),
            None => ([0; 4], 0),
        };
        let accum_batch = if p.varlen {
            0
        } else {
            (p.max_nq * p.heads_q * p.head_dim) as i64
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
            accum_len: accum_len(p) as i64,
            dbias_len: dbias_len as i64,
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
        // 7 pointers, 16 strides, 3 sizes after the forward's parameters.
        assert_eq!(std::mem::size_of::<BwdParams>(), f + 8 * (7 + 16 + 3));
        assert_eq!(std::mem::offset_of!(BwdParams, dout), f);
        assert_eq!(std::mem::offset_of!(BwdParams, dout_strides), f + 8 * 7);
        assert_eq!(std::mem::offset_of!(BwdParams, accum_batch), f + 8 * 23);
    }

    #[test]
    fn broadcast_dims_have_stride_zero() {
        assert_eq!(broadcast_strides(&[2, 3, 4, 5]), [60, 20, 5, 1]);
        assert_eq!(broadcast_strides(&[1, 3, 1, 5]), [0, 5, 0, 1]);
        assert_eq!(broadcast_strides(&[2, 1, 4, 1]), [4, 0, 1, 0]);
    }
}
