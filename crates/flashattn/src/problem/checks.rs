//! The checks of single arguments that validation is made of, each failing with an error that
//! names the argument.

use super::MAX_HEAD_DIM;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Device, Tensor};

pub(super) fn expect_rank(t: &Tensor, arg: &'static str, rank: usize, what: &str) -> Result<()> {
    if t.rank() != rank {
        return Err(Error::arg(
            arg,
            format!("{rank} dimensions {what}"),
            format!("shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

pub(super) fn expect_dim(arg: &'static str, what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::arg(
            arg,
            format!("{what} = {expected}"),
            format!("{what} = {got}"),
        ));
    }
    Ok(())
}

pub(super) fn expect_device(t: &Tensor, arg: &'static str, device: Device) -> Result<()> {
    if t.device() != device {
        return Err(Error::DeviceMismatch {
            arg,
            expected: device.to_string(),
            got: t.device().to_string(),
        });
    }
    Ok(())
}

pub(super) fn expect_unit_last_stride(t: &Tensor, arg: &'static str) -> Result<()> {
    let last = t.rank() - 1;
    if t.shape()[last] > 1 && t.strides()[last] != 1 {
        return Err(Error::arg(
            arg,
            "a contiguous last dimension (stride 1)",
            format!("stride {}", t.strides()[last]),
        ));
    }
    Ok(())
}

pub(super) fn head_dim_ok(arg: &'static str, d: usize) -> Result<()> {
    if d == 0 || d > MAX_HEAD_DIM {
        return Err(Error::arg(
            arg,
            format!("head_dim in 1..={MAX_HEAD_DIM}"),
            format!("head_dim = {d}"),
        ));
    }
    Ok(())
}

/// Checks one cu_seqlens array against the packed tensor's row count and returns the lengths.
pub(super) fn seq_lengths(arg: &'static str, cu: &[i32], rows: usize) -> Result<Vec<usize>> {
    if cu.is_empty() {
        return Err(Error::arg(arg, "batch + 1 >= 1 entries", "0 entries"));
    }
    if cu[0] != 0 {
        return Err(Error::arg(arg, "first entry 0", cu[0]));
    }
    let mut lens = Vec::with_capacity(cu.len() - 1);
    for (b, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(Error::arg(
                arg,
                "non-decreasing offsets",
                format!("entry {} = {} after entry {} = {}", b + 1, w[1], b, w[0]),
            ));
        }
        lens.push((w[1] - w[0]) as usize);
    }
    let last = *cu.last().unwrap_or(&0);
    if last as usize != rows {
        return Err(Error::arg(
            arg,
            format!("last entry = total rows of the packed tensor = {rows}"),
            last,
        ));
    }
    Ok(lens)
}

/// Checks `t`'s device, shape, dtype (`why` follows the dtype in the error: where it comes
/// from) and contiguous last dimension.
pub(crate) fn expect_shaped(
    t: &Tensor,
    arg: &'static str,
    shape: &[usize],
    (dtype, why): (DType, &str),
    device: Device,
) -> Result<()> {
    expect_device(t, arg, device)?;
    if t.shape() != shape {
        return Err(Error::arg(
            arg,
            format!("shape {shape:?}"),
            format!("shape {:?}", t.shape()),
        ));
    }
    if t.dtype() != dtype {
        return Err(Error::DType {
            arg,
            expected: format!("{dtype}{why}"),
            got: t.dtype(),
        });
    }
    expect_unit_last_stride(t, arg)
}
