//! The FlashAttention-2 backward on the GPU, with recomputation, in three launches on the GPU's
//! stream:
//!
//! 1. `flash_bwd_pre` (one warp per query row): `D = rowsum(dO∘O)` in f32, and zeros into the f32
//!    dQ accumulator and the bias gradient, which the next kernel sums into with atomics.
//! 2. The key-block kernel (tensor cores or CUDA cores, [`tiles`]): one block per (key block, key/value head, sequence) walks
//!    the query rows of the group's heads that see its keys, keeps dK and dV in f32 and writes
//!    them once; dQ and dbias go by f32 atomics.
//! 3. `flash_bwd_post`: `dq = scale · dQ` in dq's dtype and strides.
//!
//! Every element of dq, dk, dv and dbias is written (dk/dv rows of keys no query sees as zeros).

mod params;
pub(crate) mod tiles;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::compile::{KernelSource, function};
use super::device::Gpu;
use super::forward::{Extras, HEADERS, Options, device_ptr_of, dtype_define, gpu_for, grid_of};
use super::params::{FlashParams, Pointers};
use super::storage::CudaStorage;
use crate::backend::BackwardInputs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::Gradients;
use crate::problem::{Problem, row_layout, strides_like};
use crate::tensor::{Tensor, contiguous_strides};
use params::{BwdLayouts, BwdParams, BwdPointers, accum_len};
use tiles::{
    GENERAL_BWD_THREADS, GeneralBwdTile, MMA_BWD_MAX_HEAD_DIM, MMA_BWD_WARPS, MmaBwdTile,
    all_general_bwd_tiles, general_bwd_tile, mma_bwd_tile,
};

const BWD_INFO: &str = include_str!("../../../kernels/bwd_info.cuh");
const BWD_ROWS: &str = include_str!("../../../kernels/flash_bwd_rows.cu");
const BWD_GENERAL: &str = include_str!("../../../kernels/flash_bwd_general.cu");
const MMA: &str = include_str!("../../../kernels/mma.cuh");
const BWD_MMA: &str = include_str!("../../../kernels/flash_bwd_mma.cu");

/// Threads (and query rows × 32) per block of the row passes (`ROW_THREADS` in
/// `kernels/flash_bwd_rows.cu`).
const ROW_THREADS: usize = 128;

/// One backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum BwdKernel {
    /// D and the zeroing of the accumulators.
    Pre,
    /// dQ from its f32 accumulator.
    Post,
    /// The CUDA-core key-block kernel.
    General(GeneralBwdTile),
    /// The tensor-core key-block kernel.
    Mma(MmaBwdTile),
}

impl BwdKernel {
    /// Keys a block, threads a block and shared memory of the kernel.
    fn shape(&self) -> (usize, usize, usize) {
        match self {
            BwdKernel::General(t) => (t.keys, GENERAL_BWD_THREADS, t.shared_bytes()),
            BwdKernel::Mma(t) => (t.keys(), 32 * MMA_BWD_WARPS, t.shared_bytes()),
            BwdKernel::Pre | BwdKernel::Post => (0, ROW_THREADS, 0),
        }
    }
}

/// The key-block kernel for `p`: the tensor-core one (unless switched off on this thread) for
/// f16/bf16 with head dims that are multiples of 8 up to [`MMA_BWD_MAX_HEAD_DIM`] and rows of q,
/// k, v, dout, dk, dv that start on 16-byte boundaries (`strides` in elements, `addresses` in
/// bytes), else the CUDA-core one.
fn choose(p: &Problem, strides: &[[usize; 3]], addresses: &[u64], max_shared: usize) -> BwdKernel {
    let half = matches!(p.dtype, DType::F16 | DType::BF16) && MMA_BACKWARD.get();
    let dims_ok = [p.head_dim, p.head_dim_v]
        .iter()
        .all(|&d| d % 8 == 0 && d <= MMA_BWD_MAX_HEAD_DIM);
    let aligned =
        strides.iter().flatten().all(|s| s % 8 == 0) && addresses.iter().all(|a| a % 16 == 0);
    let tile = mma_bwd_tile(p.head_dim, p.head_dim_v);
    if half && dims_ok && aligned && tile.shared_bytes() <= max_shared {
        return BwdKernel::Mma(tile);
    }
    BwdKernel::General(general_bwd_tile(p.head_dim, p.head_dim_v, max_shared))
}

/// The score options of the backward (a non-positive scale needs no code of its own here).
fn options_of(p: &Problem) -> Options {
    Options {
        nonpos_scale: false,
        ..Options::of(p)
    }
}

/// The translation unit of one backward variant.
pub(crate) fn kernel_source(kernel: BwdKernel, dtype: DType, opts: Options) -> KernelSource {
    let (elem, tname) = dtype_define(dtype);
    let mut code = format!("#define {elem} 1\n{}", opts.defines());
    let (name, entry, bodies): (String, &str, &[&str]) = match kernel {
        BwdKernel::Pre => (format!("bwd_pre_{tname}"), "flash_bwd_pre", &[BWD_ROWS]),
        BwdKernel::Post => (format!("bwd_post_{tname}"), "flash_bwd_post", &[BWD_ROWS]),
        BwdKernel::General(t) => {
            code += &format!(
                "#define DQK_MAX {}\n#define DV_MAX {}\n#define BKB {}\n#define BQB {}\n",
                t.dqk, t.dv, t.keys, t.rows
            );
            let name = format!(
                "bwd_general_{tname}_d{}x{}_k{}q{}{}",
                t.dqk,
                t.dv,
                t.keys,
                t.rows,
                opts.suffix()
            );
            (name, "flash_bwd_general", &[BWD_GENERAL])
        }
        BwdKernel::Mma(t) => {
            code += &format!(
                "#define DQK {}\n#define DV {}\n#define BQB {}\n#define NWARPS {}\n",
                t.dqk, t.dv, t.rows, MMA_BWD_WARPS
            );
            let name = format!(
                "bwd_mma_{tname}_d{}x{}_q{}{}",
                t.dqk,
                t.dv,
                t.rows,
                opts.suffix()
            );
            (name, "flash_bwd_mma", &[MMA, BWD_MMA])
        }
    };
    code += &[&HEADERS[..], &[BWD_INFO], bodies].concat().join("\n");
    KernelSource {
        name,
        code,
        entry: entry.into(),
        hopper_only: false,
    }
}

/// Every backward variant: the row passes per dtype, and the key-block kernel's tiles for every
/// dtype at head dims 16, 80 and 32..=512 in steps of 32, with every score option (every `#if`
/// branch compiled), and with none at head dim 64.
pub fn kernel_sources() -> Vec<KernelSource> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        out.push(kernel_source(BwdKernel::Pre, dtype, Options::default()));
        out.push(kernel_source(BwdKernel::Post, dtype, Options::default()));
        let all = Options {
            nonpos_scale: false,
            ..Options::ALL
        };
        for d in [16, 80].into_iter().chain((32..=512).step_by(32)) {
            for t in all_general_bwd_tiles(d, d) {
                out.push(kernel_source(BwdKernel::General(t), dtype, all));
            }
        }
        for t in all_general_bwd_tiles(64, 64) {
            out.push(kernel_source(
                BwdKernel::General(t),
                dtype,
                Options::default(),
            ));
        }
        if dtype == DType::F32 {
            continue;
        }
        for d in (16..=MMA_BWD_MAX_HEAD_DIM).step_by(16) {
            out.push(kernel_source(
                BwdKernel::Mma(mma_bwd_tile(d, d)),
                dtype,
                all,
            ));
        }
        let mask = Options {
            mask: true,
            ..Options::default()
        };
        for d in [64, 128] {
            let t = BwdKernel::Mma(mma_bwd_tile(d, d));
            out.push(kernel_source(t, dtype, Options::default()));
            out.push(kernel_source(t, dtype, mask));
        }
    }
    out
}

thread_local! {
    /// Whether this thread's backward calls may take the tensor-core kernel.
    static MMA_BACKWARD: Cell<bool> = const { Cell::new(true) };
    /// The key-block kernel of this thread's last backward launch.
    static LAST_VARIANT: Cell<Option<(BwdKernel, DType, Options)>> = const { Cell::new(None) };
}

/// Test support: on this thread, lets f16/bf16 backward problems take the tensor-core kernel
/// (on, the default) or sends every problem to the CUDA-core kernel (off).
pub fn set_mma_backward(on: bool) {
    MMA_BACKWARD.set(on);
}

/// Test support: the name of the key-block kernel this thread's last backward launched
/// (`bwd_mma_…` or `bwd_general_…`), or `None` before any.
pub fn last_cuda_backward_kernel() -> Option<String> {
    LAST_VARIANT
        .get()
        .map(|(kernel, dtype, opts)| kernel_source(kernel, dtype, opts).name)
}

type ReadyKey = (usize, BwdKernel, DType, Options);

/// The backward kernels made ready, by GPU and variant.
fn ready() -> &'static Mutex<HashMap<ReadyKey, CudaFunction>> {
    static READY: OnceLock<Mutex<HashMap<ReadyKey, CudaFunction>>> = OnceLock::new();
    READY.get_or_init(Default::default)
}

/// Forgets the kernels made ready (see [`super::forget_loaded_kernels`]).
pub(crate) fn forget_launchable() {
    ready().lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// A variant's loaded kernel with its shared-memory limit raised to `shared` bytes.
fn launchable(
    g: &Gpu,
    kernel: BwdKernel,
    dtype: DType,
    opts: Options,
    shared: usize,
) -> Result<CudaFunction> {
    let key = (g.ordinal, kernel, dtype, opts);
    if let Some(f) = ready().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let func = function(g, &kernel_source(kernel, dtype, opts))?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )
    .map_err(Gpu::err("setting the kernel's shared memory"))?;
    ready()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, func.clone());
    Ok(func)
}

/// A device output shaped `shape` in the memory order of `like` (poisoned when tests ask).
fn output_like(g: &Arc<Gpu>, dtype: DType, like: &Tensor) -> Result<Tensor> {
    let shape = like.shape();
    let store = CudaStorage::alloc_output(g, dtype, shape.iter().product())?;
    Tensor::from_cuda_storage(store, shape, &strides_like(like, shape), 0)
}

/// The backward into gradients it allocates on the problem's GPU, in the memory order of q, k, v
/// (dbias f32, contiguous, in the bias' shape).
pub(crate) fn backward(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    let [q, k, v, ..] = x;
    let g = gpu_for(p, k)?;
    let mut grads = Gradients {
        dq: output_like(&g, p.dtype, q)?,
        dk: output_like(&g, p.dtype, k)?,
        dv: output_like(&g, p.dtype, v)?,
        dbias: match &p.bias {
            Some((b, _)) => {
                let shape = b.shape();
                let store = CudaStorage::alloc_output(&g, DType::F32, shape.iter().product())?;
                Some(Tensor::from_cuda_storage(
                    store,
                    shape,
                    &contiguous_strides(shape),
                    0,
                )?)
            }
            None => None,
        },
    };
    queue(&g, p, x, &mut grads)?;
    Ok(grads)
}

/// The backward into gradients validated by `crate::outputs::expect_writable` (on this GPU, any
/// row strides; dbias contiguous).
pub(crate) fn backward_into(
    p: &Problem,
    x: BackwardInputs<'_>,
    grads: &mut Gradients,
) -> Result<()> {
    let g = gpu_for(p, x[1])?;
    queue(&g, p, x, grads)
}

/// Uninitialized f32 device scratch of `n` elements (at least one), which the kernels write before
/// they read it.
fn scratch(g: &Gpu, n: usize) -> Result<CudaSlice<f32>> {
    // SAFETY: D is written by `flash_bwd_pre` for every query row before the key-block kernel
    // reads it, and the dQ accumulator is zeroed by it; nothing reads either before.
    unsafe { g.stream.alloc::<f32>(n.max(1)) }.map_err(Gpu::err("allocating backward scratch"))
}

/// Queues the three kernels that write every element of `grads`.
fn queue(g: &Arc<Gpu>, p: &Problem, x: BackwardInputs<'_>, grads: &mut Gradients) -> Result<()> {
    let [q, k, v, out, lse, dout] = x;
    if p.batch == 0 || p.heads_q == 0 {
        return Ok(());
    }
    let lse = if lse.is_contiguous() {
        lse.clone()
    } else {
        lse.contiguous()?
    };
    let mut ptr = Pointers {
        q: device_ptr_of(q, "q")?,
        k: device_ptr_of(k, "k")?,
        v: device_ptr_of(v, "v")?,
        o: device_ptr_of(out, "out")?,
        lse: device_ptr_of(&lse, "lse")?,
        ..Pointers::default()
    };
    let extras = Extras::upload(g, p, &mut ptr)?;
    let delta = scratch(g, lse.numel())?;
    let accum = scratch(g, accum_len(p))?;
    let bptr = BwdPointers {
        dout: device_ptr_of(dout, "dout")?,
        dq: device_ptr_of(&grads.dq, "dq")?,
        dk: device_ptr_of(&grads.dk, "dk")?,
        dv: device_ptr_of(&grads.dv, "dv")?,
        dbias: grads
            .dbias
            .as_ref()
            .map(|t| device_ptr_of(t, "dbias"))
            .transpose()?
            .unwrap_or(0),
        delta: delta.device_ptr(&g.stream).0,
        dq_accum: accum.device_ptr(&g.stream).0,
    };
    let layouts = BwdLayouts {
        dout: row_layout(dout),
        dq: row_layout(&grads.dq),
        dk: row_layout(&grads.dk),
        dv: row_layout(&grads.dv),
    };
    let params = BwdParams::new(
        p,
        FlashParams::new(p, ptr, &row_layout(out)),
        bptr,
        &layouts,
    );

    let opts = options_of(p);
    let rows = grid_of(p, ROW_THREADS / 32)?;
    let strides = [&p.q, &p.k, &p.v, &layouts.dout, &layouts.dk, &layouts.dv]
        .map(|l| [l.batch, l.row, l.head]);
    let addresses = [ptr.q, ptr.k, ptr.v, bptr.dout, bptr.dk, bptr.dv];
    let main = choose(p, &strides, &addresses, g.max_shared_per_block);
    let (block_keys, main_threads, main_shared) = main.shape();
    let keys = (
        p.max_nk.div_ceil(block_keys) as u32,
        p.heads_kv as u32,
        p.batch as u32,
    );
    let steps = [
        (
            BwdKernel::Pre,
            (rows.0.max(1), rows.1, rows.2),
            ROW_THREADS,
            0,
        ),
        (main, keys, main_threads, main_shared),
        (BwdKernel::Post, rows, ROW_THREADS, 0),
    ];
    for (kernel, grid, threads, shared) in steps {
        if grid.0 == 0 {
            continue; // no key (or no query) rows: nothing for this kernel to write
        }
        if shared > g.max_shared_per_block {
            return Err(Error::Unsupported {
                device: "cuda",
                what: format!(
                    "backward at head dims {}/{}: {shared} bytes of shared memory a block, the GPU allows {}",
                    p.head_dim, p.head_dim_v, g.max_shared_per_block
                ),
            });
        }
        let func = launchable(g, kernel, p.dtype, opts, shared)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let mut launch = g.stream.launch_builder(&func);
        launch.arg(&params);
        // SAFETY: every address in `params` points into a live device allocation of this GPU: q,
        // k, v, out, dout and the bias are validated views whose elements lie inside their
        // buffers; lse is a contiguous view of the validated shape; dq, dk, dv and dbias are
        // device views of exactly the shapes the kernels write, in buffers of their own (allocated
        // here or validated by `expect_writable`); alibi, cu_seqlens, D and the dQ accumulator are
        // allocated above with the lengths `params` gives and outlive the launches on this
        // stream. The kernels touch only the elements the validated sizes and strides describe,
        // and `shared` bytes were allowed when the kernel was loaded.
        unsafe { launch.launch(cfg) }.map_err(Gpu::err("launching a backward kernel"))?;
    }
    LAST_VARIANT.set(Some((main, p.dtype, opts)));
    drop((extras, delta, accum, lse));
    Ok(())
}
