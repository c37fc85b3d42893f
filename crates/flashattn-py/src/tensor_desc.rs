//! Tensors as the Python side describes them (data pointer, dtype name, shape, strides, device,
//! owner), wrapped as flashattn tensors over the same memory, on the CPU or a GPU.

use flashattn::cuda::DeviceMemory;
use flashattn::{DType, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// What the Python side passes for a tensor: `(data_ptr, dtype, shape, strides, device, owner)`,
/// `data_ptr` the address of the view's first element, `strides` in elements, `device` -1 for
/// the CPU or the GPU's ordinal (torch's `get_device()`), `owner` the Python object holding the
/// memory.
pub(crate) type Desc = (usize, String, Vec<usize>, Vec<isize>, i64, Py<PyAny>);

/// The flashattn dtype of a torch dtype name (`float32`, `float16`, `bfloat16`).
fn dtype_of(arg: &str, name: &str) -> PyResult<DType> {
    match name {
        "float32" => Ok(DType::F32),
        "float16" => Ok(DType::F16),
        "bfloat16" => Ok(DType::BF16),
        _ => Err(PyTypeError::new_err(format!(
            "invalid dtype for `{arg}`: expected float32, float16 or bfloat16, got {name}"
        ))),
    }
}

/// Where a tensor's memory lives, from its device name.
enum Place {
    Cpu,
    Cuda(usize),
}

/// The place of the device number `device` (-1: the CPU, N: `cuda:N`).
fn place_of(arg: &str, device: i64) -> PyResult<Place> {
    match device {
        -1 => Ok(Place::Cpu),
        n => usize::try_from(n).map(Place::Cuda).map_err(|_| {
            PyValueError::new_err(format!(
                "invalid argument `{arg}`: expected a tensor on the CPU (-1) or a GPU (its \
                 ordinal), got device {n}"
            ))
        }),
    }
}

/// A flashattn tensor over the memory `desc` describes, keeping its owner alive.
///
/// # Safety
/// `desc` describes a live tensor (host memory, or device memory in the GPU's primary context)
/// whose elements are not written by anything else while flashattn's work on the returned tensor
/// is queued, nor read by anything else while it receives an output.
pub(crate) unsafe fn tensor(py: Python<'_>, arg: &str, desc: &Desc) -> PyResult<Tensor> {
    let (ptr, dtype, shape, strides, device, owner) = desc;
    let place = place_of(arg, *device)?;
    let dtype = dtype_of(arg, dtype)?;
    let strides: Vec<usize> = strides
        .iter()
        .map(|&s| usize::try_from(s))
        .collect::<Result<_, _>>()
        .map_err(|_| {
            PyValueError::new_err(format!(
                "invalid argument `{arg}`: expected non-negative strides, got {strides:?}"
            ))
        })?;
    if shape.len() != strides.len() {
        return Err(PyValueError::new_err(format!(
            "invalid argument `{arg}`: {} strides for shape {shape:?}",
            strides.len()
        )));
    }
    // The elements from the first to the last one the view reaches.
    let span = if shape.contains(&0) {
        0
    } else {
        shape
            .iter()
            .zip(&strides)
            .try_fold(1usize, |acc, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
            })
            .ok_or_else(|| {
                PyValueError::new_err(format!("invalid argument `{arg}`: shape too large"))
            })?
    };
    let keep = Box::new(owner.clone_ref(py));
    // SAFETY: the caller's contract; `span` elements from `ptr` are the view's own memory.
    unsafe {
        match place {
            Place::Cpu => {
                Tensor::from_host_raw(*ptr as *mut u8, dtype, span, shape, &strides, 0, keep)
            }
            Place::Cuda(ordinal) => {
                let memory = DeviceMemory {
                    ordinal,
                    ptr: *ptr as u64,
                    dtype,
                    len: span,
                };
                Tensor::from_device_raw(memory, shape, &strides, 0, keep)
            }
        }
    }
    .map_err(|e| crate::py_error(e, arg))
}
