//! The kernels' parameter struct (`FlashParams` in `kernels/block_info.cuh`), built from a validated
//! [`Problem`] and the device addresses of its tensors, and passed to the kernel by value; and the
//! device copies of the small inputs a launch reads beside the tensors ([`Extras`]).

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};

use super::device::Gpu;
use super::diagonal::kernel_diagonal;
use super::forward::device_ptr_of;
use crate::error::Result;
use crate::problem::{Problem, RowLayout};
use crate::tensor::Tensor;

/// Mirrors `struct FlashParams` in `kernels/block_info.cuh` field by field: 8-byte fields first, then
/// 4-byte ones, so `#[repr(C)]` gives the same layout on both sides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FlashParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub bias: u64,
    pub rel_bias: u64,
    pub alibi: u64,
    pub cu_q: u64,
    pub cu_k: u64,
    pub q_strides: [i64; 3],
    pub k_strides: [i64; 3],
    pub v_strides: [i64; 3],
    pub o_strides: [i64; 3],
    pub bias_strides: [i64; 4],
    pub lse_batch: i64,
    pub lse_head: i64,
    pub batch: i32,
    pub heads_q: i32,
    pub group: i32,
    pub nq: i32,
    pub nk: i32,
    pub head_dim: i32,
    pub head_dim_v: i32,
    pub window_left: i32,
    pub window_right: i32,
    pub rel_radius: i32,
    pub diag_given: i32,
    pub diag: i32,
    pub scale: f32,
    pub scale_log2: f32,
    pub softcap: f32,
}

// SAFETY: `FlashParams` is `#[repr(C)]`, `Copy`, holds only integers and floats (device addresses
// as u64), and matches the CUDA struct's layout, so its bytes are a valid kernel argument.
unsafe impl DeviceRepr for FlashParams {}

/// Device addresses of everything a launch reads or writes (0 for what the call lacks). Each
/// points at its tensor's first element (view offsets applied).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Pointers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub bias: u64,
    pub rel_bias: u64,
    pub alibi: u64,
    pub cu_q: u64,
    pub cu_k: u64,
}

/// The device copies of what a launch reads beside the tensors: the ALiBi slopes, the
/// cu_seqlens offsets and the biases (moved to the GPU). Kept alive until the launch is queued;
/// their frees are ordered after it on the stream.
pub(crate) struct Extras {
    _alibi: Option<CudaSlice<f32>>,
    _cu: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
    _bias: Option<Tensor>,
    _rel_bias: Option<Tensor>,
}

impl Extras {
    /// Uploads them and sets their addresses in `ptr`.
    pub(crate) fn upload(g: &Gpu, p: &Problem, ptr: &mut Pointers) -> Result<Self> {
        let alibi = p.alibi.as_ref().map(|s| upload(g, s)).transpose()?;
        let cu = if p.varlen {
            let mut cu_q: Vec<i32> = p.seqs.iter().map(|s| s.q_row0 as i32).collect();
            let mut cu_k: Vec<i32> = p.seqs.iter().map(|s| s.k_row0 as i32).collect();
            let last = p.seqs.last();
            cu_q.push(last.map_or(0, |s| (s.q_row0 + s.nq) as i32));
            cu_k.push(last.map_or(0, |s| (s.k_row0 + s.nk) as i32));
            Some((upload(g, &cu_q)?, upload(g, &cu_k)?))
        } else {
            None
        };
        let bias = match &p.bias {
            Some((t, _)) => Some(t.to_device(p.device)?),
            None => None,
        };
        if let Some(a) = &alibi {
            ptr.alibi = a.device_ptr(&g.stream).0;
        }
        if let Some((cq, ck)) = &cu {
            ptr.cu_q = cq.device_ptr(&g.stream).0;
            ptr.cu_k = ck.device_ptr(&g.stream).0;
        }
        if let Some(b) = &bias {
            ptr.bias = device_ptr_of(b, "bias")?;
        }
        let rel_bias = match &p.rel_bias {
            Some(r) => Some(r.table.to_device(p.device)?),
            None => None,
        };
        if let Some(t) = &rel_bias {
            ptr.rel_bias = device_ptr_of(t, "rel_bias")?;
        }
        Ok(Extras {
            _alibi: alibi,
            _cu: cu,
            _bias: bias,
            _rel_bias: rel_bias,
        })
    }
}

fn upload<T: DeviceRepr>(g: &Gpu, v: &[T]) -> Result<CudaSlice<T>> {
    g.stream
        .clone_htod(v)
        .map_err(Gpu::err("copying kernel inputs to the device"))
}

fn strides(l: &RowLayout) -> [i64; 3] {
    [l.batch as i64, l.row as i64, l.head as i64]
}

impl FlashParams {
    /// The parameters of `p` with output rows laid out as `o` (same batch/row/head meaning as q);
    /// `Error::Unsupported` for a diagonal the kernels cannot hold (see [`kernel_diagonal`]).
    pub(crate) fn new(p: &Problem, ptr: Pointers, o: &RowLayout) -> Result<Self> {
        let diag = kernel_diagonal(p)?;
        let bias_strides = p
            .bias
            .as_ref()
            .map_or([0; 4], |(_, l)| l.strides.map(|s| s as i64));
        let (lse_batch, lse_head) = if p.varlen {
            (0, p.total_q as i64)
        } else {
            ((p.heads_q * p.max_nq) as i64, p.max_nq as i64)
        };
        Ok(FlashParams {
            q: ptr.q,
            k: ptr.k,
            v: ptr.v,
            o: ptr.o,
            lse: ptr.lse,
            bias: ptr.bias,
            rel_bias: ptr.rel_bias,
            alibi: ptr.alibi,
            cu_q: ptr.cu_q,
            cu_k: ptr.cu_k,
            q_strides: strides(&p.q),
            k_strides: strides(&p.k),
            v_strides: strides(&p.v),
            o_strides: strides(o),
            bias_strides,
            lse_batch,
            lse_head,
            batch: p.batch as i32,
            heads_q: p.heads_q as i32,
            group: p.group() as i32,
            nq: p.max_nq as i32,
            nk: p.max_nk as i32,
            head_dim: p.head_dim as i32,
            head_dim_v: p.head_dim_v as i32,
            window_left: diag.window_left,
            window_right: diag.window_right,
            rel_radius: p.rel_bias.as_ref().map_or(0, |r| r.radius as i32),
            diag_given: i32::from(diag.diag.is_some()),
            diag: diag.diag.unwrap_or(0),
            scale: p.scale,
            scale_log2: p.scale * std::f32::consts::LOG2_E,
            softcap: p.softcap.unwrap_or(0.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_cuda_struct() {
        // 10 pointers, 18 strides, 12 ints, 3 floats: 8·28 + 4·15 bytes, and 4 of padding to
        // a multiple of 8 (on both sides).
        assert_eq!(std::mem::size_of::<FlashParams>(), 8 * 28 + 4 * 16);
        assert_eq!(std::mem::offset_of!(FlashParams, batch), 8 * 28);
        assert_eq!(std::mem::offset_of!(FlashParams, scale), 8 * 28 + 4 * 12);
    }
}
