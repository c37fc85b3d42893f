//! Typed errors. Every invalid argument names the argument and says what was expected and what was given.

use crate::dtype::DType;

/// The result type of every fallible flashattn call.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong. Argument errors name the argument (`"q"`, `"cu_seqlens_k"`, `"softcap"`, ...).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument has the wrong shape, size or value.
    #[error("invalid argument `{arg}`: expected {expected}, got {got}")]
    InvalidArgument {
        /// The argument's name as in the API (`q`, `bias`, `cu_seqlens_q`, ...).
        arg: &'static str,
        /// What the call needed.
        expected: String,
        /// What it was given.
        got: String,
    },
    /// An argument has the wrong element type.
    #[error("invalid dtype for `{arg}`: expected {expected}, got {got}")]
    DType {
        /// The argument's name.
        arg: &'static str,
        /// The dtype(s) the call accepts here.
        expected: String,
        /// The dtype it was given.
        got: DType,
    },
    /// Tensors of one call live on different devices.
    #[error("device mismatch for `{arg}`: expected {expected}, got {got}")]
    DeviceMismatch {
        /// The argument on the wrong device.
        arg: &'static str,
        /// The device of `q`.
        expected: String,
        /// The device of this argument.
        got: String,
    },
    /// The operation is valid but this backend does not provide it.
    #[error("unsupported on {device}: {what}")]
    Unsupported {
        /// The backend, e.g. `"cuda"`.
        device: &'static str,
        /// What is missing.
        what: String,
    },
    /// A ring's transport failed (a peer stopped, or sent what the schedule does not expect).
    #[error("ring communication: {0}")]
    Comm(String),
    /// The CUDA driver, a GPU or NVRTC could not be found or failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// The CUDA driver library (`libcuda.so.1`) could not be loaded: no NVIDIA driver here.
    #[error("no CUDA driver: {0}")]
    NoCudaDriver(String),
    /// The driver is there but the requested GPU is not.
    #[error("no CUDA device {ordinal}: {count} device(s) found")]
    NoCudaDevice {
        /// The ordinal asked for (`Device::Cuda(ordinal)`).
        ordinal: usize,
        /// How many GPUs the driver reports.
        count: usize,
    },
    /// NVRTC (`libnvrtc.so`) could not be loaded, so kernels cannot be compiled.
    #[error("no NVRTC: {0}")]
    NoNvrtc(String),
    /// NVRTC rejected a kernel; the compile log is kept.
    #[error("nvrtc failed to compile `{kernel}`:\n{log}")]
    Compile {
        /// The kernel variant that failed.
        kernel: String,
        /// NVRTC's log.
        log: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn arg(arg: &'static str, expected: impl Into<String>, got: impl ToString) -> Self {
        Error::InvalidArgument {
            arg,
            expected: expected.into(),
            got: got.to_string(),
        }
    }

    /// The argument this error is about, if it is about one.
    pub fn argument(&self) -> Option<&'static str> {
        match self {
            Error::InvalidArgument { arg, .. }
            | Error::DType { arg, .. }
            | Error::DeviceMismatch { arg, .. } => Some(arg),
            _ => None,
        }
    }
}
