//! The CPU backend: tiled FlashAttention forward and backward, parallel with rayon.

mod backward;
pub(crate) mod convert;
mod decode;
mod forward;
pub(crate) mod line_buf;
pub(crate) mod matmul;
mod online_softmax;
mod planning;
mod prefetch;
pub(crate) mod profile;
mod score_mods;
mod shared_out;
mod simd;

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::LocalKey;

use aligned_vec::{AVec, RuntimeAlign};
use half::{bf16, f16};

use crate::backend::{Backend, BackwardInputs};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::host_buf::{self, HostBuf};
use crate::outputs::{ForwardOutput, Gradients, poison_outputs};
use crate::problem::{Problem, RowLayout, row_layout, strides_like};
use crate::tensor::{CpuStorage, Tensor, contiguous_strides};

pub(crate) use convert::CpuElement;
use planning::schedule;
pub use profile::report as forward_profile;
use score_mods::Biases;
pub(crate) use shared_out::SharedOut;
/// The vectorized row exp, also used by the standard attention baseline (one exp for both).
pub(crate) use simd::exp::exp2_shifted_sum;
pub use simd::{Simd, cpu_simd};

/// The CPU backend.
pub(crate) struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward(&self, p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
        forward(p, q, k, v)
    }

    fn forward_into(
        &self,
        p: &Problem,
        qkv: (&Tensor, &Tensor, &Tensor),
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()> {
        forward_into(p, qkv, out, lse)
    }

    fn backward(&self, p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
        backward(p, x)
    }

    fn backward_into(&self, p: &Problem, x: BackwardInputs<'_>, g: &mut Gradients) -> Result<()> {
        backward_into(p, x, g)
    }
}

/// [`host_buf::fill_with`] through the kernels' task queue ([`schedule::for_each_chunk`]: one
/// job a thread, each taking chunks in order), for the buffers of the CPU backend.
pub(crate) fn fill_with<T: Send>(dst: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    match host_buf::parallel_chunk::<T>(dst.len()) {
        None => f(0, dst),
        Some(chunk) => schedule::for_each_chunk(dst, chunk, |i, piece| f(i * chunk, piece)),
    }
}

/// The host buffer of `t` as `T` (validated to be on the host with dtype `T`).
fn host<'a, T: CpuElement>(t: &'a Tensor, arg: &'static str) -> Result<&'a [T]> {
    t.cpu_slice::<T>().ok_or_else(|| Error::DType {
        arg,
        expected: T::DTYPE.to_string(),
        got: t.dtype(),
    })
}

/// Runs `f` on this thread's buffers kept in `key` from task to task and call to call (a task
/// never waits on other tasks, so it cannot run inside another on the same thread; should that
/// ever change, `f` gets fresh buffers).
fn with_thread_scratch<S: Default, R>(
    key: &'static LocalKey<RefCell<S>>,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut S::default()),
    })
}

/// A number no earlier kernel call got: what a thread's kept buffers are tagged with, so that a
/// later call never takes rows packed from another call's inputs for its own.
fn call_number() -> u64 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    CALLS.fetch_add(1, Ordering::Relaxed)
}

/// A contiguous f32 tensor of zeros (for `arg`, a gradient the kernels add into).
fn zeros_f32(shape: &[usize], arg: &'static str) -> Result<Tensor> {
    let data = HostBuf::filled(shape.iter().product(), 0.0);
    Tensor::from_cpu_storage(
        CpuStorage::F32(data),
        shape,
        &contiguous_strides(shape),
        0,
        arg,
    )
}

/// The host buffer of an output tensor whose buffer no other tensor shares (validated by the
/// caller: `crate::outputs::expect_writable`, or allocated here), as `T`.
fn writable<'a, T: CpuElement>(t: &'a mut Tensor, arg: &'static str) -> Result<&'a mut [T]> {
    let dtype = t.dtype();
    t.cpu_storage_mut()
        .and_then(T::slice_mut)
        .ok_or_else(|| Error::DType {
            arg,
            expected: format!("{} in a host buffer no other tensor shares", T::DTYPE),
            got: dtype,
        })
}

/// The elements of a contiguous tensor's view, within its buffer.
fn view_range(t: &Tensor) -> std::ops::Range<usize> {
    t.offset()..t.offset() + t.numel()
}

fn forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    match p.dtype {
        DType::F32 => forward_typed::<f32>(p, q, k, v),
        DType::F16 => forward_typed::<f16>(p, q, k, v),
        DType::BF16 => forward_typed::<bf16>(p, q, k, v),
    }
}

/// The forward into outputs validated by `crate::outputs::expect_writable` (not filled first:
/// every element is written).
fn forward_into(
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    match p.dtype {
        DType::F32 => forward_into_typed::<f32>(p, q, k, v, out, lse),
        DType::F16 => forward_into_typed::<f16>(p, q, k, v, out, lse),
        DType::BF16 => forward_into_typed::<bf16>(p, q, k, v, out, lse),
    }
}

/// The forward into buffers it allocates and does not fill first (see [`Unwritten`]).
fn forward_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    let mut out = Unwritten::<T>::like(q, &Problem::shape_like(q, p.head_dim_v));
    let mut lse = Unwritten::<f32>::contiguous(&p.lse_shape());
    run_forward::<T>(p, (q, k, v), out.shared(), lse.shared())?;
    // SAFETY: `run_forward` returned Ok, so the kernel wrote every element of both (each query
    // row of each (sequence, head) once).
    unsafe {
        Ok(ForwardOutput {
            out: out.written("out")?,
            lse: lse.written("lse")?,
        })
    }
}

fn forward_into_typed<T: CpuElement>(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    let out_layout = row_layout(out);
    let lse_range = view_range(lse);
    run_forward::<T>(
        p,
        (q, k, v),
        SharedOut::new(writable::<T>(out, "out")?, out_layout),
        SharedOut::new(
            &mut writable::<f32>(lse, "lse")?[lse_range],
            RowLayout::default(),
        ),
    )
}

/// Runs the forward kernel into `out` and `lse` (every element written).
fn run_forward<T: CpuElement>(
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: SharedOut<'_, T>,
    lse: SharedOut<'_, f32>,
) -> Result<()> {
    let inputs = forward::Inputs {
        q: host(q, "q")?,
        k: host(k, "k")?,
        v: host(v, "v")?,
        biases: biases(p)?,
    };
    forward::run(p, inputs, out, lse);
    Ok(())
}

/// The f32 buffers of `p`'s biases.
fn biases(p: &Problem) -> Result<Biases<'_>> {
    Ok(Biases {
        bias: p.bias.as_ref().map(|(t, _)| host(t, "bias")).transpose()?,
        rel: p
            .rel_bias
            .as_ref()
            .map(|r| host(&r.table, "rel_bias"))
            .transpose()?,
    })
}

fn backward(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    match p.dtype {
        DType::F32 => backward_typed::<f32>(p, x),
        DType::F16 => backward_typed::<f16>(p, x),
        DType::BF16 => backward_typed::<bf16>(p, x),
    }
}

/// The backward into gradients validated by `crate::outputs::expect_writable`: the bias
/// gradient is zeroed first (the backward adds into it), the others are written whole.
fn backward_into(p: &Problem, x: BackwardInputs<'_>, g: &mut Gradients) -> Result<()> {
    for (grad, arg) in [(&mut g.dbias, "dbias"), (&mut g.drel_bias, "drel_bias")] {
        if let Some(t) = grad.as_mut() {
            let range = view_range(t);
            fill_with(&mut writable::<f32>(t, arg)?[range], |_, c| c.fill(0.0));
        }
    }
    match p.dtype {
        DType::F32 => backward_into_typed::<f32>(p, x, g),
        DType::F16 => backward_into_typed::<f16>(p, x, g),
        DType::BF16 => backward_into_typed::<bf16>(p, x, g),
    }
}

fn backward_into_typed<T: CpuElement>(
    p: &Problem,
    x: BackwardInputs<'_>,
    g: &mut Gradients,
) -> Result<()> {
    let layouts = [&g.dq, &g.dk, &g.dv].map(row_layout);
    let outputs = backward::Outputs {
        dq: SharedOut::new(writable::<T>(&mut g.dq, "dq")?, layouts[0]),
        dk: SharedOut::new(writable::<T>(&mut g.dk, "dk")?, layouts[1]),
        dv: SharedOut::new(writable::<T>(&mut g.dv, "dv")?, layouts[2]),
        dbias: dbias_view(&mut g.dbias, "dbias")?,
        drel_bias: dbias_view(&mut g.drel_bias, "drel_bias")?,
    };
    backward_run::<T>(p, x, outputs)
}

/// The backward into one host buffer no other tensor shares (`dqkv`, the fused layer's packed
/// gradient), dq, dk and dv written at the disjoint `layouts` in it; returns the gradients of the
/// bias and of the relative-position table (allocated zeroed, the backward adds into them) that
/// the call has.
pub(crate) fn backward_packed(
    p: &Problem,
    x: BackwardInputs<'_>,
    dqkv: &mut Tensor,
    layouts: [RowLayout; 3],
) -> Result<[Option<Tensor>; 2]> {
    let mut biases = bias_grads(p)?;
    match p.dtype {
        DType::F32 => backward_packed_typed::<f32>(p, x, dqkv, layouts, &mut biases)?,
        DType::F16 => backward_packed_typed::<f16>(p, x, dqkv, layouts, &mut biases)?,
        DType::BF16 => backward_packed_typed::<bf16>(p, x, dqkv, layouts, &mut biases)?,
    }
    Ok(biases)
}

/// The zeroed gradients of the bias and of the relative-position table that `p` has.
fn bias_grads(p: &Problem) -> Result<[Option<Tensor>; 2]> {
    let dbias = match &p.bias {
        Some((b, _)) => Some(zeros_f32(b.shape(), "dbias")?),
        None => None,
    };
    let drel_bias = match &p.rel_bias {
        Some(r) => Some(zeros_f32(r.table.shape(), "drel_bias")?),
        None => None,
    };
    Ok([dbias, drel_bias])
}

fn backward_packed_typed<T: CpuElement>(
    p: &Problem,
    x: BackwardInputs<'_>,
    dqkv: &mut Tensor,
    [dq, dk, dv]: [RowLayout; 3],
    [dbias, drel_bias]: &mut [Option<Tensor>; 2],
) -> Result<()> {
    let whole = SharedOut::new(writable::<T>(dqkv, "dqkv")?, RowLayout::default());
    let outputs = backward::Outputs {
        dq: whole.with_layout(dq),
        dk: whole.with_layout(dk),
        dv: whole.with_layout(dv),
        dbias: dbias_view(dbias, "dbias")?,
        drel_bias: dbias_view(drel_bias, "drel_bias")?,
    };
    backward_run::<T>(p, x, outputs)
}

/// The backward into gradients it allocates: dq, dk and dv not filled first (see
/// [`Unwritten`]), the bias gradient zeroed (the backward adds into it).
fn backward_typed<T: CpuElement>(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    let [q, k, v, ..] = x;
    let mut dq = Unwritten::<T>::like(q, q.shape());
    let mut dk = Unwritten::<T>::like(k, k.shape());
    let mut dv = Unwritten::<T>::like(v, v.shape());
    let [mut dbias, mut drel_bias] = bias_grads(p)?;
    let outputs = backward::Outputs {
        dq: dq.shared(),
        dk: dk.shared(),
        dv: dv.shared(),
        dbias: dbias_view(&mut dbias, "dbias")?,
        drel_bias: dbias_view(&mut drel_bias, "drel_bias")?,
    };
    backward_run::<T>(p, x, outputs)?;
    // SAFETY: `backward_run` returned Ok, so the kernels wrote every element of dq (each query
    // row of each (sequence, head) once), dk and dv (each key row of each key block once).
    unsafe {
        Ok(Gradients {
            dq: dq.written("dq")?,
            dk: dk.written("dk")?,
            dv: dv.written("dv")?,
            dbias,
            drel_bias,
        })
    }
}

/// The elements of a bias gradient's view (argument `arg`), when there is one.
fn dbias_view<'t>(
    dbias: &'t mut Option<Tensor>,
    arg: &'static str,
) -> Result<Option<&'t mut [f32]>> {
    match dbias.as_mut() {
        Some(t) => {
            let range = view_range(t);
            Ok(Some(&mut writable::<f32>(t, arg)?[range]))
        }
        None => Ok(None),
    }
}

fn backward_run<T: CpuElement>(
    p: &Problem,
    x: BackwardInputs<'_>,
    outputs: backward::Outputs<'_, T>,
) -> Result<()> {
    let [q, k, v, out, lse, dout] = x;
    // Our own forward's lse is contiguous at an offset (its buffer starts on a line): read in
    // place; other views are copied.
    let lse_copy;
    let lse_rows: &[f32] = if lse.is_contiguous() {
        &host::<f32>(lse, "lse")?[view_range(lse)]
    } else {
        lse_copy = lse.contiguous()?;
        host(&lse_copy, "lse")?
    };
    let layouts = backward::Layouts {
        out: row_layout(out),
        dout: row_layout(dout),
    };
    backward::run(
        p,
        backward::Inputs {
            q: host(q, "q")?,
            k: host(k, "k")?,
            v: host(v, "v")?,
            biases: biases(p)?,
            out: host(out, "out")?,
            lse: lse_rows,
            dout: host(dout, "dout")?,
        },
        &layouts,
        outputs,
    );
    Ok(())
}

/// A tensor's buffer for outputs whose kernels write every element once (only write:
/// [`SharedOut`] never reads): allocated but not written, so the call spares the pass that
/// filling it first would take and, for large buffers, a round through the thread pool (a
/// short causal forward 1.1–1.4× faster; see BENCHMARKS.md). Filled with NaN
/// when poisoning is on ([`crate::outputs::set_poison_outputs`], for tests), as on the GPU.
struct Unwritten<T> {
    /// Room for the elements ([`host_buf::allocate`]: aligned, huge pages when large), empty
    /// until [`Self::written`].
    data: AVec<T, RuntimeAlign>,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<T: CpuElement> Unwritten<T> {
    /// Shaped `shape`, in the memory order of `like` (no gaps: see `strides_like`).
    fn like(like: &Tensor, shape: &[usize]) -> Self {
        Unwritten::with_strides(shape, strides_like(like, shape))
    }

    fn contiguous(shape: &[usize]) -> Self {
        Unwritten::with_strides(shape, contiguous_strides(shape))
    }

    fn with_strides(shape: &[usize], strides: Vec<usize>) -> Self {
        let n: usize = shape.iter().product();
        let mut data = host_buf::allocate::<T>(n);
        if poison_outputs() {
            let nan = MaybeUninit::new(T::from_f32(f32::NAN));
            fill_with(host_buf::spare(&mut data, n), |_, dst| dst.fill(nan));
        }
        Unwritten {
            data,
            shape: shape.to_vec(),
            strides,
        }
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// The buffer for the kernels' tasks to write (poisoned or not: they only write).
    fn shared(&mut self) -> SharedOut<'_, T> {
        let n = self.len();
        let layout = RowLayout::strided(&self.strides, 0);
        SharedOut::uninit(host_buf::spare(&mut self.data, n), layout)
    }

    /// The tensor, once written.
    ///
    /// # Safety
    /// Every element must have been written through [`Self::shared`].
    unsafe fn written(mut self, arg: &'static str) -> Result<Tensor> {
        let n = self.len();
        // SAFETY: the n elements are initialized (poisoned, or written: the caller's contract),
        // within the capacity (`host_buf::allocate`).
        unsafe { self.data.set_len(n) };
        let data = T::wrap(HostBuf::Own(self.data));
        Tensor::from_cpu_storage(data, &self.shape, &self.strides, 0, arg)
    }
}
