//! The native module of the `flashattn` Python package: forward and backward over tensors that
//! the Python side allocates, described by their data pointers (see [`tensor_desc`]) and used
//! where they lie, on the CPU or a GPU, with the GIL released while flashattn computes. CUDA calls
//! are ordered on the caller's stream (PyTorch's current one) with `flashattn::cuda::on_stream`.

mod tensor_desc;

use flashattn::{AttentionParams, Error, Gradients, Tensor, Window};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use tensor_desc::{Desc, tensor};

/// The options of a call, as a Python tuple: `(scale, (window_left, window_right), softcap,
/// alibi_slopes, bias, (cu_seqlens_q, cu_seqlens_k), deterministic, rel_bias, diagonal)`, `None`
/// where unset.
type Opts = (
    Option<f32>,
    (Option<usize>, Option<usize>),
    Option<f32>,
    Option<Desc>,
    Option<Desc>,
    Option<(Vec<i32>, Vec<i32>)>,
    bool,
    Option<Desc>,
    Option<i64>,
);

/// The Python exception for a flashattn error: `TypeError` for a dtype, `ValueError` for a bad
/// argument or devices that differ, `NotImplementedError` for what a backend does not provide
/// (yet), `RuntimeError` for a device failure; `what` names the tensor or pass when the
/// library's message does not.
pub(crate) fn py_error(e: Error, what: &str) -> PyErr {
    let msg = match e.argument() {
        Some(_) => e.to_string(),
        None => format!("{what}: {e}"),
    };
    match e {
        Error::DType { .. } => PyTypeError::new_err(msg),
        Error::InvalidArgument { .. } | Error::DeviceMismatch { .. } => PyValueError::new_err(msg),
        Error::Unsupported { .. } => PyNotImplementedError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// The library's params for `opts`, wrapping the ALiBi slopes and biases.
///
/// # Safety
/// As [`tensor`], for the slopes and biases `opts` describes.
unsafe fn params(py: Python<'_>, opts: &Opts) -> PyResult<AttentionParams> {
    let (scale, (left, right), softcap, alibi, bias, varlen, deterministic, rel_bias, diagonal) =
        opts;
    let mut p = AttentionParams {
        scale: *scale,
        window: Window::new(*left, *right),
        softcap: *softcap,
        deterministic: *deterministic,
        diagonal: *diagonal,
        ..AttentionParams::default()
    };
    if let Some(a) = alibi {
        // SAFETY: the caller's contract.
        p.alibi_slopes = Some(unsafe { tensor(py, "alibi_slopes", a) }?);
    }
    if let Some(b) = bias {
        // SAFETY: the caller's contract.
        p.bias = Some(unsafe { tensor(py, "bias", b) }?);
    }
    if let Some(r) = rel_bias {
        // SAFETY: the caller's contract.
        p.rel_bias = Some(unsafe { tensor(py, "rel_bias", r) }?);
    }
    if let Some((cq, ck)) = varlen {
        p = p.varlen(cq.clone(), ck.clone());
    }
    Ok(p)
}

/// Wraps each of `descs` under its name.
///
/// # Safety
/// As [`tensor`], for every tensor.
unsafe fn wrap<const N: usize>(
    py: Python<'_>,
    names: [&str; N],
    descs: [&Desc; N],
) -> PyResult<[Tensor; N]> {
    let mut out = Vec::with_capacity(N);
    for (name, d) in names.into_iter().zip(descs) {
        // SAFETY: the caller's contract.
        out.push(unsafe { tensor(py, name, d) }?);
    }
    out.try_into()
        .map_err(|_| PyRuntimeError::new_err("flashattn: tensor count mismatch"))
}

/// The caller's CUDA stream of a call on a GPU: the device ordinal and the raw `CUstream`.
type Stream = Option<(usize, usize)>;

/// Runs `f` with the GIL released, ordered on `stream` when there is one.
fn run(
    py: Python<'_>,
    stream: Stream,
    f: impl FnOnce() -> flashattn::Result<()> + Send,
) -> flashattn::Result<()> {
    py.detach(|| match stream {
        // SAFETY: the Python package passes PyTorch's current stream of the device the call's
        // tensors live on, a stream of its primary context that outlives the call.
        Some((ordinal, s)) => unsafe { flashattn::cuda::on_stream(ordinal, s, f) },
        None => f(),
    })
}

/// Attention of `q`, `k`, `v` written into `out` and `lse`, freshly allocated tensors of the
/// shapes `flashattn::forward_into` expects (no other Python object may read them meanwhile),
/// on `stream` for CUDA tensors.
#[pyfunction]
#[pyo3(signature = (qkv, outputs, opts, stream=None))]
fn forward(
    py: Python<'_>,
    qkv: (Desc, Desc, Desc),
    outputs: (Desc, Desc),
    opts: Opts,
    stream: Stream,
) -> PyResult<()> {
    // SAFETY: the Python package passes live tensors that it does not touch during the call (on a
    // GPU, the work is ordered on the stream of the Python code that uses them); the outputs are
    // fresh allocations that no input shares.
    let ([q, k, v], [mut out, mut lse], p) = unsafe {
        (
            wrap(py, ["q", "k", "v"], [&qkv.0, &qkv.1, &qkv.2])?,
            wrap(py, ["out", "lse"], [&outputs.0, &outputs.1])?,
            params(py, &opts)?,
        )
    };
    run(py, stream, || {
        flashattn::forward_into(&q, &k, &v, &p, &mut out, &mut lse)
    })
    .map_err(|e| py_error(e, "forward"))
}

/// Gradients of `forward` written into `grads` (`dq`, `dk`, `dv` and, exactly when the call has
/// a bias or a relative-position table, `dbias` and `drel_bias`), freshly allocated tensors of the shapes `flashattn::backward_into` expects,
/// on `stream` for CUDA tensors.
#[pyfunction]
#[pyo3(signature = (inputs, grads, opts, stream=None))]
fn backward(
    py: Python<'_>,
    inputs: (Desc, Desc, Desc, Desc, Desc, Desc),
    grads: (Desc, Desc, Desc, Option<Desc>, Option<Desc>),
    opts: Opts,
    stream: Stream,
) -> PyResult<()> {
    let (q, k, v, out, lse, dout) = &inputs;
    // SAFETY: as in `forward`: live tensors, the gradients fresh allocations.
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
    // SAFETY: as above.
    let optional = |name, d: &Option<Desc>| d.as_ref().map(|d| unsafe { tensor(py, name, d) });
    let mut g = Gradients {
        dq,
        dk,
        dv,
        dbias: optional("dbias", &grads.3).transpose()?,
        drel_bias: optional("drel_bias", &grads.4).transpose()?,
    };
    run(py, stream, || {
        flashattn::backward_into(&q, &k, &v, &out, &lse, &dout, &p, &mut g)
    })
    .map_err(|e| py_error(e, "backward"))
}

/// The `(major, minor)` version of the NVRTC that compiles the CUDA kernels, loaded as the crate
/// loads it; a `RuntimeError` saying how to install it when there is none.
#[pyfunction]
fn nvrtc_version() -> PyResult<(i32, i32)> {
    flashattn::cuda::nvrtc_version().map_err(|e| py_error(e, "nvrtc"))
}

/// The module `flashattn._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    Ok(())
}
