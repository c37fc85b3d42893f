//! The native module of the `flashattn` Python package: forward and backward over tensors that
//! the Python side allocates, described by their data pointers (see [`host_tensor`]) and used
//! where they lie, with the GIL released while flashattn computes.

mod host_tensor;

use flashattn::{AttentionParams, Error, Gradients, Tensor, Window};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use host_tensor::{Desc, host_tensor};

/// The options of a call, as a Python tuple: `(scale, (window_left, window_right), softcap,
/// alibi_slopes, bias, (cu_seqlens_q, cu_seqlens_k))`, `None` where unset.
type Opts = (
    Option<f32>,
    (Option<usize>, Option<usize>),
    Option<f32>,
    Option<Desc>,
    Option<Desc>,
    Option<(Vec<i32>, Vec<i32>)>,
);

/// The Python exception for a flashattn error: `TypeError` for a dtype, `ValueError` for a bad
/// argument, `RuntimeError` for a device failure; `what` names the tensor when the library's
/// message does not.
pub(crate) fn py_error(e: Error, what: &str) -> PyErr {
    let msg = match e.argument() {
        Some(_) => e.to_string(),
        None => format!("{what}: {e}"),
    };
    match e {
        Error::DType { .. } => PyTypeError::new_err(msg),
        Error::InvalidArgument { .. }
        | Error::DeviceMismatch { .. }
        | Error::Unsupported { .. } => PyValueError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// The library's params for `opts`, wrapping the ALiBi slopes and bias.
///
/// # Safety
/// As [`host_tensor`], for the slopes and bias `opts` describes.
unsafe fn params(py: Python<'_>, opts: &Opts) -> PyResult<AttentionParams> {
    let (scale, (left, right), softcap, alibi, bias, varlen) = opts;
    let mut p = AttentionParams {
        scale: *scale,
        window: Window::new(*left, *right),
        softcap: *softcap,
        ..AttentionParams::default()
    };
    if let Some(a) = alibi {
        // SAFETY: the caller's contract.
        p.alibi_slopes = Some(unsafe { host_tensor(py, "alibi_slopes", a) }?);
    }
    if let Some(b) = bias {
        // SAFETY: the caller's contract.
        p.bias = Some(unsafe { host_tensor(py, "bias", b) }?);
    }
    if let Some((cq, ck)) = varlen {
        p = p.varlen(cq.clone(), ck.clone());
    }
    Ok(p)
}

/// Wraps each of `descs` under its name.
///
/// # Safety
/// As [`host_tensor`], for every tensor.
unsafe fn wrap<const N: usize>(
    py: Python<'_>,
    names: [&str; N],
    descs: [&Desc; N],
) -> PyResult<[Tensor; N]> {
    let mut out = Vec::with_capacity(N);
    for (name, d) in names.into_iter().zip(descs) {
        // SAFETY: the caller's contract.
        out.push(unsafe { host_tensor(py, name, d) }?);
    }
    out.try_into()
        .map_err(|_| PyRuntimeError::new_err("flashattn: tensor count mismatch"))
}

/// Attention of `q`, `k`, `v` written into `out` and `lse`, freshly allocated tensors of the
/// shapes `flashattn::forward_into` expects (no other Python object may read them meanwhile).
#[pyfunction]
fn forward(
    py: Python<'_>,
    qkv: (Desc, Desc, Desc),
    outputs: (Desc, Desc),
    opts: Opts,
) -> PyResult<()> {
    // SAFETY: the Python package passes live CPU tensors that it does not touch during the call;
    // the outputs are fresh allocations that no input shares.
    let ([q, k, v], [mut out, mut lse], p) = unsafe {
        (
            wrap(py, ["q", "k", "v"], [&qkv.0, &qkv.1, &qkv.2])?,
            wrap(py, ["out", "lse"], [&outputs.0, &outputs.1])?,
            params(py, &opts)?,
        )
    };
    py.detach(|| flashattn::forward_into(&q, &k, &v, &p, &mut out, &mut lse))
        .map_err(|e| py_error(e, "forward"))
}

/// Gradients of `forward` written into `grads` (`dq`, `dk`, `dv` and, exactly when the call has
/// a bias, `dbias`), freshly allocated tensors of the shapes `flashattn::backward_into` expects.
#[pyfunction]
fn backward(
    py: Python<'_>,
    inputs: (Desc, Desc, Desc, Desc, Desc, Desc),
    grads: (Desc, Desc, Desc, Option<Desc>),
    opts: Opts,
) -> PyResult<()> {
    let (q, k, v, out, lse, dout) = &inputs;
    // SAFETY: as in `forward`: live CPU tensors, the gradients fresh allocations.
    let ([q, k, v, out, lse, dout], [dq, dk, dv], p) = unsafe {
        (
            wrap(
                py,
                ["q", "k", "v", "out", "lse", "dout"],
                [q, k, v, out, lse, dout],
            )?,
            wrap(py, ["dq", "dk", "dv"], [&grads.0, &grads.1, &grads.2])?,
            params(py, &opts)?,
        )
    };
    let dbias = match &grads.3 {
        // SAFETY: as above.
        Some(d) => Some(unsafe { host_tensor(py, "dbias", d) }?),
        None => None,
    };
    let mut g = Gradients { dq, dk, dv, dbias };
    py.detach(|| flashattn::backward_into(&q, &k, &v, &out, &lse, &dout, &p, &mut g))
        .map_err(|e| py_error(e, "backward"))
}

/// The module `flashattn._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    Ok(())
}
