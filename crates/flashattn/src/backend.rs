//! The interface between the public entry points and the backends: every backend (the CPU's,
//! the GPU's) implements [`Backend`] on validated [`Problem`]s, and the entry points pick one
//! by the device the tensors live on. A backend that lacks a pass keeps the default method, a
//! typed [`Error::Unsupported`].

use crate::error::{Error, Result};
use crate::outputs::{ForwardOutput, Gradients};
use crate::problem::Problem;
use crate::tensor::Tensor;

/// What the backward reads: q, k, v, the forward's out and lse, and dout.
pub(crate) type BackwardInputs<'a> = [&'a Tensor; 6];

/// The passes of one device. Every method receives a problem validated against its tensors
/// (and, for the `_into` methods, outputs validated by `crate::outputs::expect_writable`), all on
/// this backend's device.
pub(crate) trait Backend: Sync {
    /// The device kind, as errors name it (`"cpu"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// The forward into outputs it allocates.
    fn forward(&self, p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput>;

    /// The forward into `out` and `lse`, every element of which it writes.
    fn forward_into(
        &self,
        p: &Problem,
        qkv: (&Tensor, &Tensor, &Tensor),
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()>;

    /// The backward into gradients it allocates.
    fn backward(&self, _p: &Problem, _x: BackwardInputs<'_>) -> Result<Gradients> {
        Err(self.unsupported("backward"))
    }

    /// The backward into `g`, every element of which it writes.
    fn backward_into(
        &self,
        _p: &Problem,
        _x: BackwardInputs<'_>,
        _g: &mut Gradients,
    ) -> Result<()> {
        Err(self.unsupported("backward"))
    }

    /// The error for a pass this backend does not provide.
    fn unsupported(&self, what: &str) -> Error {
        Error::Unsupported {
            device: self.name(),
            what: what.into(),
        }
    }
}
