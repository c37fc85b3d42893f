//! Working inside another CUDA library (PyTorch): tensors over its device memory, used where they
//! lie ([`Tensor::from_device_raw`]), and calls ordered on its stream ([`on_stream`]).
//!
//! flashattn keeps queueing every copy, allocation and launch on its own stream of the device
//! (`Gpu::stream`: the device's default stream), so its scratch buffers and the Hopper kernel's
//! tile counter stay ordered by one stream. [`on_stream`] joins that stream to the caller's with
//! two event waits, before and after the work: no host synchronization, and nothing to do when
//! the caller's stream is flashattn's own (PyTorch's default stream is).

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;

use cudarc::driver::sys::{self, CUpointer_attribute};
use cudarc::driver::{CudaEvent, CudaStream};

use super::device::{Gpu, gpu};
use super::storage::{CudaStorage, ForeignMemory};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{MAX_ELEMENTS, Tensor};

/// Device memory of another owner, as [`Tensor::from_device_raw`] takes it: `len` elements of
/// `dtype` at device address `ptr` on GPU `ordinal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The GPU (`Device::Cuda(ordinal)`).
    pub ordinal: usize,
    /// The device address of element 0.
    pub ptr: u64,
    /// The element type.
    pub dtype: DType,
    /// Elements from `ptr` on that belong to the memory.
    pub len: usize,
}

impl Tensor {
    /// A tensor over device memory that another owner holds (a PyTorch tensor's), used where it
    /// lies: `memory`, viewed with `shape`, `strides` (in elements) and `offset` as
    /// [`Tensor::from_host_raw`] checks them.
    /// `keep` is held until the last tensor over the memory is dropped; flashattn never frees the
    /// memory. A tensor no other shares may receive outputs
    /// ([`forward_into`](crate::forward_into), [`backward_into`](crate::backward_into)), written
    /// on flashattn's stream: see [`on_stream`] to order the call with the owner's work.
    ///
    /// # Safety
    /// Unless `memory.len` is 0, `memory.ptr` is the address of `len` elements of `dtype` in
    /// device memory of GPU `ordinal`, in its primary context, that stay allocated while the
    /// tensor (or a clone or view of it) lives, that nothing outside flashattn writes while
    /// flashattn's work on them is queued, and, when the tensor receives an output, that no input
    /// of the same call overlaps.
    pub unsafe fn from_device_raw(
        memory: DeviceMemory,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let DeviceMemory {
            ordinal,
            ptr,
            dtype,
            len,
        } = memory;
        if len > MAX_ELEMENTS {
            return Err(Error::arg("len", "at most 2^60 elements", len));
        }
        let align = dtype.size_in_bytes() as u64;
        if len > 0 && (ptr == 0 || !ptr.is_multiple_of(align)) {
            return Err(Error::arg(
                "ptr",
                format!("a non-null device address aligned to {align} bytes ({dtype})"),
                format!("{ptr:#x}"),
            ));
        }
        let gpu = gpu(ordinal)?;
        if len > 0 {
            expect_device_memory(&gpu, ptr)?;
        }
        let foreign = ForeignMemory {
            ptr,
            dtype,
            _keep: keep,
        };
        let storage = CudaStorage::foreign(&gpu, foreign, len);
        // A view reaching past the memory is the caller's `len`, as in `from_host_raw`.
        Tensor::from_cuda_storage(storage, shape, strides, offset).map_err(|e| match e {
            Error::InvalidArgument {
                arg: "storage",
                expected,
                got,
            } => Error::InvalidArgument {
                arg: "len",
                expected,
                got,
            },
            other => other,
        })
    }
}

/// Checks that the driver knows `ptr` as device memory of `gpu` (a host address, or another
/// GPU's memory, is an argument error).
fn expect_device_memory(gpu: &Gpu, ptr: u64) -> Result<()> {
    let mut ordinal: i32 = -1;
    gpu.ctx
        .bind_to_thread()
        .map_err(Gpu::err("binding the context"))?;
    // SAFETY: the device-ordinal attribute writes one i32 through the pointer, valid for the call.
    let got = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if got != sys::CUresult::CUDA_SUCCESS || ordinal != gpu.ordinal as i32 {
        let what = if got == sys::CUresult::CUDA_SUCCESS {
            format!("memory of cuda:{ordinal}")
        } else {
            format!("an address the driver does not know ({got:?})")
        };
        return Err(Error::arg(
            "ptr",
            format!("device memory of cuda:{}", gpu.ordinal),
            format!("{ptr:#x}, {what}"),
        ));
    }
    Ok(())
}

/// Runs `f`, which queues flashattn work on GPU `ordinal` (a [`forward_into`](crate::forward_into)
/// over tensors from [`Tensor::from_device_raw`], say), ordered on the caller's CUDA `stream` (a
/// raw `CUstream`, e.g. PyTorch's `torch.cuda.current_stream().cuda_stream`) as if launched on
/// it: flashattn's stream first waits for the work queued on `stream` so far, and `stream` then
/// waits for everything `f` queued. Neither waits on the host. `stream` is waited on even when
/// `f` fails, since `f` may have queued work before failing.
///
/// # Safety
/// `stream` is a live stream of GPU `ordinal`'s primary context (or 0, its default stream) that
/// stays alive during the call.
pub unsafe fn on_stream<R>(
    ordinal: usize,
    stream: usize,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let gpu = gpu(ordinal)?;
    let theirs = stream as sys::CUstream;
    if theirs == gpu.stream.cu_stream() {
        return f();
    }
    // SAFETY: the caller's contract: a live stream of this context, kept alive during the call;
    // the wrapper is dropped before returning and does not destroy the stream.
    let theirs = unsafe { gpu.ctx.wrap_borrowed_stream(theirs) };
    join(&gpu, &gpu.stream, &theirs).map_err(Gpu::err("waiting for the caller's stream"))?;
    let result = f();
    let joined = join(&gpu, &theirs, &gpu.stream)
        .map_err(Gpu::err("making the caller's stream wait for flashattn's"));
    let r = result?;
    joined?;
    Ok(r)
}

thread_local! {
    /// This thread's event of each GPU for [`join`]: a wait takes the state of the event's last
    /// record when it is queued, so one event recorded and waited on at once serves every join
    /// (no event created and destroyed per call).
    static JOIN_EVENTS: RefCell<HashMap<usize, CudaEvent>> = RefCell::new(HashMap::new());
}

/// Makes `waiter` wait for the work queued on `on` so far (two streams of `gpu`).
fn join(
    gpu: &Gpu,
    waiter: &CudaStream,
    on: &CudaStream,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    JOIN_EVENTS.with_borrow_mut(|events| {
        let event = match events.entry(gpu.ordinal) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(gpu.ctx.new_event(None)?),
        };
        event.record(on)?;
        waiter.wait(event)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Device, contiguous_strides};
    use crate::{AttentionParams, forward, forward_into};

    /// `len` f32 at `ptr` on GPU 0.
    fn f32_memory(ptr: u64, len: usize) -> DeviceMemory {
        DeviceMemory {
            ordinal: 0,
            ptr,
            dtype: DType::F32,
            len,
        }
    }

    /// A tensor over the device memory of `t` (which it keeps alive), or the call's error.
    fn over(t: &Tensor, len: usize, shape: &[usize]) -> Result<Tensor> {
        let ptr = t.cuda_ptr().expect("a device tensor");
        // SAFETY: `ptr` is `t`'s own device buffer of at least `len` elements, kept alive by the
        // clone in `keep`; nothing else writes it during the test.
        let memory = DeviceMemory {
            ordinal: 0,
            ptr,
            dtype: t.dtype(),
            len,
        };
        unsafe {
            Tensor::from_device_raw(
                memory,
                shape,
                &contiguous_strides(shape),
                0,
                Box::new(t.clone()),
            )
        }
    }

    /// Null and misaligned addresses are argument errors, on any machine; without a GPU a
    /// plausible one is the typed error of the missing driver or device.
    #[test]
    fn bad_addresses_are_argument_errors() {
        let raw = |ptr: u64, len: usize| {
            // SAFETY: every call fails before the address could be used.
            unsafe { Tensor::from_device_raw(f32_memory(ptr, len), &[len], &[1], 0, Box::new(())) }
        };
        assert_eq!(raw(0, 4).unwrap_err().argument(), Some("ptr"));
        assert_eq!(raw(0x1002, 4).unwrap_err().argument(), Some("ptr"));
        if !crate::cuda::is_available() {
            let e = raw(0x1000, 4).unwrap_err();
            assert!(
                matches!(e, Error::NoCudaDriver(_) | Error::NoCudaDevice { .. }),
                "{e}"
            );
        }
    }

    /// On a GPU: outputs written into foreign memory equal `forward`'s; host memory and views
    /// past the memory are refused, naming `ptr` and `len`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn outputs_are_written_into_foreign_device_memory() {
        let (b, n, h, d) = (2, 65, 4, 64);
        let x: Vec<f32> = (0..b * n * h * d)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let q = Tensor::from_vec(x, &[b, n, h, d])
            .unwrap()
            .to_device(Device::Cuda(0))
            .unwrap();
        let p = AttentionParams::default().causal();
        let want = forward(&q, &q, &q, &p).unwrap();
        let out_mem = Tensor::full(&[b, n, h, d], DType::F32, f32::NAN).unwrap();
        let lse_mem = Tensor::full(&[b, h, n], DType::F32, f32::NAN).unwrap();
        let (out_mem, lse_mem) = (
            out_mem.to_device(q.device()).unwrap(),
            lse_mem.to_device(q.device()).unwrap(),
        );
        let mut out = over(&out_mem, out_mem.numel(), &[b, n, h, d]).unwrap();
        let mut lse = over(&lse_mem, lse_mem.numel(), &[b, h, n]).unwrap();
        let q_raw = over(&q, q.numel(), &[b, n, h, d]).unwrap();
        forward_into(&q_raw, &q_raw, &q_raw, &p, &mut out, &mut lse).unwrap();
        assert_eq!(
            out.to_vec::<f32>().unwrap(),
            want.out.to_vec::<f32>().unwrap()
        );
        assert_eq!(
            lse.to_vec::<f32>().unwrap(),
            want.lse.to_vec::<f32>().unwrap()
        );
        assert_eq!(over(&q, 7, &[8]).unwrap_err().argument(), Some("len"));
        let host = [1.0f32; 4];
        // SAFETY: the call fails (host memory) before the address could be used.
        let e = unsafe {
            let memory = f32_memory(host.as_ptr() as u64, 4);
            Tensor::from_device_raw(memory, &[4], &[1], 0, Box::new(()))
        };
        assert_eq!(e.unwrap_err().argument(), Some("ptr"));
    }
}
