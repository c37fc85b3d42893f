//! What the entry points return ([`ForwardOutput`], [`Gradients`]); checks of the tensors a
//! caller hands to [`forward_into`](crate::forward_into) and
//! [`backward_into`](crate::backward_into) to be written: the right shape, dtype and device, a
//! buffer no other tensor shares, and strides that never reach one element twice; and the
//! switch that has the outputs flashattn allocates itself poisoned, for tests.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::expect_shaped;
use crate::tensor::{Device, Tensor};

/// What [`forward`](crate::forward) returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// The attention output: shaped like `q` with the head dimension of `v`, in `q`'s dtype and
    /// memory order (a `[batch, heads, seqlen, dim]`-strided q gives a like-strided output).
    pub out: Tensor,
    /// Log-sum-exp of each query's scores (natural log, f32): `[batch, heads, seqlen_q]`, or
    /// `[heads, total_q]` with packed variable-length input. −∞ for a query that sees no key.
    pub lse: Tensor,
}

/// What [`backward`](crate::backward) returns: gradients in the dtype and memory order of their
/// inputs.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// Gradient of `q`.
    pub dq: Tensor,
    /// Gradient of `k` (summed over the query heads that share each key head).
    pub dk: Tensor,
    /// Gradient of `v`.
    pub dv: Tensor,
    /// Gradient of the bias, f32, in the bias' shape (summed over its broadcast dimensions).
    pub dbias: Option<Tensor>,
    /// Gradient of the relative-position bias table, f32, `[heads, 2L − 1]`: each entry sums
    /// `dS` over the (query, key) pairs that read it.
    pub drel_bias: Option<Tensor>,
}

/// How an output's elements must be laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Any strides with a contiguous last dimension (`out`, `dq`, `dk`, `dv`: q's dtype).
    Rows,
    /// Row-major (`lse`, `dbias`, `drel_bias`: f32), as the kernels index them.
    Contiguous,
}

/// Checks that `t` can receive an output shaped `shape` of `dtype` on `device`, laid out as
/// `layout`, and that nothing else reads or writes its buffer.
pub(crate) fn expect_writable(
    t: &mut Tensor,
    arg: &'static str,
    shape: &[usize],
    dtype: DType,
    device: Device,
    layout: Layout,
) -> Result<()> {
    let why = match layout {
        Layout::Rows => " (the dtype of q)",
        Layout::Contiguous => "",
    };
    expect_shaped(t, arg, shape, (dtype, why), device)?;
    if layout == Layout::Contiguous && !t.is_contiguous() {
        return Err(Error::arg(
            arg,
            "a contiguous (row-major) tensor",
            format!("strides {:?}", t.strides()),
        ));
    }
    if !is_disjoint(t.shape(), t.strides()) {
        return Err(Error::arg(
            arg,
            "strides that reach every element once",
            format!("shape {:?} with strides {:?}", t.shape(), t.strides()),
        ));
    }
    if !t.is_exclusive() {
        return Err(Error::arg(
            arg,
            "a tensor whose buffer no other tensor shares (not a clone or view of another)",
            "a shared buffer",
        ));
    }
    Ok(())
}

/// True when no two indices of a view with this shape and these strides reach the same element:
/// taken by increasing stride, every dimension's stride is at least the span of the dimensions
/// inside it. (A sufficient condition, met by every permutation of a contiguous or padded
/// layout.)
pub(crate) fn is_disjoint(shape: &[usize], strides: &[usize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n > 1)
        .map(|(&n, &s)| (s, n))
        .collect();
    dims.sort_unstable();
    // One past the largest offset the inner dimensions reach.
    let mut span = 1usize;
    for (stride, n) in dims {
        if stride < span {
            return false;
        }
        span = stride.saturating_mul(n - 1).saturating_add(span);
    }
    true
}

/// Whether the outputs flashattn allocates are poisoned: 0 = not decided yet, 1 = no, 2 = yes.
static POISON_OUTPUTS: AtomicU8 = AtomicU8::new(0);

/// Fills every output buffer that [`forward`](crate::forward) and [`backward`](crate::backward)
/// allocate, on either device, with NaN before the kernels run (on) or leaves it unwritten
/// (off, the default unless the environment variable `FLASHATTN_POISON_OUTPUTS=1`). The kernels
/// write every element either way; tests turn it on so that an element one fails to write shows
/// up, and benchmarks leave it off (it is an extra pass over memory).
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether output buffers are poisoned (see [`set_poison_outputs`]).
pub(crate) fn poison_outputs() -> bool {
    match POISON_OUTPUTS.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("FLASHATTN_POISON_OUTPUTS").is_ok_and(|v| v == "1");
            set_poison_outputs(on);
            on
        }
        v => v == 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a brute-force count of the offsets every index reaches.
    #[test]
    fn disjoint_strides_reach_each_element_once() {
        let cases: [(&[usize], &[usize]); 10] = [
            (&[2, 3, 4], &[12, 4, 1]),
            (&[2, 3, 4], &[4, 8, 1]),
            (&[2, 3, 4], &[30, 5, 1]),
            (&[2, 3, 4], &[12, 3, 1]),
            (&[2, 3, 4], &[0, 4, 1]),
            (&[1, 3, 4], &[0, 4, 1]),
            (&[2, 1, 4], &[4, 0, 1]),
            (&[3, 2], &[1, 3]),
            (&[3, 2], &[1, 2]),
            (&[0, 5], &[0, 0]),
        ];
        for (shape, strides) in cases {
            let mut seen = std::collections::HashSet::new();
            let numel: usize = shape.iter().product();
            let mut all_once = true;
            for n in 0..numel {
                let (mut rest, mut at) = (n, 0);
                for d in (0..shape.len()).rev() {
                    at += rest % shape[d] * strides[d];
                    rest /= shape[d];
                }
                all_once &= seen.insert(at);
            }
            assert_eq!(
                is_disjoint(shape, strides),
                all_once,
                "{shape:?} {strides:?}"
            );
        }
    }
}
