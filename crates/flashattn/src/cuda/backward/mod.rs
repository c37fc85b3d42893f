//! The FlashAttention-2 backward on the GPU, with recomputation, launched on the GPU's stream:
//!
//! 1. `flash_bwd_pre` (one warp per query row): `D = rowsum(dO∘O)` in f32, and zeros into the f32
//!    dQ accumulator and the bias gradient, which the next kernels sum into.
//! 2. The key-block kernel (wgmma on sm_90a, tensor cores or CUDA cores, [`tiles`]): one block
//!    per (key block, key/value head, sequence) walks the query rows of the group's heads that
//!    see its keys, keeps dK and dV in f32 and writes them once; dQ and dbias go by f32 atomics
//!    (the Hopper kernel adds dQ a tile at a time by bulk reductions).
//! 3. `flash_bwd_post`: `dq = scale · dQ` in dq's dtype and strides.
//!
//! Deterministic (`AttentionParams::deterministic`), step 2 leaves out dQ and dbias, and
//! `flash_bwd_dq` computes them per query block over its key blocks in a fixed order instead of 3
//! (then `flash_bwd_dbias_sum` adds up the partials of a bias broadcast over query rows).
//! Every element of dq, dk, dv and dbias is written (dk/dv rows of keys no query sees as zeros).

mod params;
pub(crate) mod tiles;
mod variants;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::compile::function;
use super::device::Gpu;
use super::forward::{device_ptr_of, gpu_for, grid_of};
use super::params::{Extras, FlashParams, Pointers};
use super::storage::CudaStorage;
use super::tensor_map::{accum_layout, backward_maps, encode_accum};
use crate::backend::BackwardInputs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::Gradients;
use crate::problem::{Problem, row_layout, strides_like};
use crate::tensor::{Tensor, contiguous_strides};
use params::{
    BiasParts, BwdLayouts, BwdParams, BwdPointers, accum_len, accum_pitch, bias_parts,
    rel_parts_len,
};
use tiles::{WGMMA_BWD_ROWS, general_bwd_tile};
pub use variants::kernel_sources;
use variants::{BwdKernel, ROW_THREADS, Variant, choose, kernel_source, options_of};

thread_local! {
    /// Whether this thread's backward calls may take the tensor-core kernel.
    static MMA_BACKWARD: Cell<bool> = const { Cell::new(true) };
    /// Whether this thread's backward calls on sm_90a may take the Hopper kernel.
    static HOPPER_BACKWARD: Cell<bool> = const { Cell::new(true) };
    /// The key-block kernel of this thread's last backward launch.
    static LAST_VARIANT: Cell<Option<Variant>> = const { Cell::new(None) };
}

/// Test support: on this thread, lets f16/bf16 backward problems take the tensor-core kernel
/// (on, the default) or sends every problem to the CUDA-core kernel (off).
pub fn set_mma_backward(on: bool) {
    MMA_BACKWARD.set(on);
}

/// Test support: on this thread, lets backward problems on sm_90a GPUs take the Hopper kernel
/// (on, the default) or sends them to the kernels every other GPU runs (off).
pub fn set_hopper_backward(on: bool) {
    HOPPER_BACKWARD.set(on);
}

/// Test support: the name of the key-block kernel this thread's last backward launched
/// (`bwd_mma_…` or `bwd_general_…`, `…_det` in deterministic mode), or `None` before any.
pub fn last_cuda_backward_kernel() -> Option<String> {
    LAST_VARIANT.get().map(|v| kernel_source(v).name)
}

type ReadyKey = (usize, Variant);

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
fn launchable(g: &Gpu, v: Variant, shared: usize) -> Result<CudaFunction> {
    let key = (g.ordinal, v);
    if let Some(f) = ready().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let func = function(g, &kernel_source(v))?;
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

/// A contiguous f32 tensor of `shape` on `g` (a bias gradient), not filled.
fn f32_output(g: &Arc<Gpu>, shape: &[usize]) -> Result<Tensor> {
    let store = CudaStorage::alloc_output(g, DType::F32, shape.iter().product())?;
    Tensor::from_cuda_storage(store, shape, &contiguous_strides(shape), 0)
}

/// The backward into gradients it allocates on the problem's GPU, in the memory order of q, k, v
/// (dbias and drel_bias f32, contiguous, in their biases' shapes).
pub(crate) fn backward(p: &Problem, x: BackwardInputs<'_>) -> Result<Gradients> {
    let [q, k, v, ..] = x;
    let g = gpu_for(p, k)?;
    let mut grads = Gradients {
        dq: output_like(&g, p.dtype, q)?,
        dk: output_like(&g, p.dtype, k)?,
        dv: output_like(&g, p.dtype, v)?,
        dbias: p
            .bias
            .as_ref()
            .map(|(b, _)| f32_output(&g, b.shape()))
            .transpose()?,
        drel_bias: p
            .rel_bias
            .as_ref()
            .map(|r| f32_output(&g, r.table.shape()))
            .transpose()?,
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
    // reads it, and the dQ accumulator and the partial table gradients are zeroed by it; nothing
    // reads any of them before.
    unsafe { g.stream.alloc::<f32>(n.max(1)) }.map_err(Gpu::err("allocating backward scratch"))
}

/// A launch: the kernel and its grid.
type Step = (BwdKernel, (u32, u32, u32));

/// The launches of `p`'s backward with `main` as the key-block kernel, the f32 partial bias
/// gradients the deterministic dQ pass needs, and its query blocks (0 when not deterministic).
fn plan(
    p: &Problem,
    main: BwdKernel,
    max_shared: usize,
) -> Result<(Vec<Step>, Option<BiasParts>, usize)> {
    let rows = grid_of(p, ROW_THREADS / 32)?;
    let (block_keys, _, _) = main.shape();
    let keys = (
        p.max_nk.div_ceil(block_keys) as u32,
        p.heads_kv as u32,
        p.batch as u32,
    );
    let mut steps = vec![
        (BwdKernel::Pre, (rows.0.max(1), rows.1, rows.2)),
        (main, keys),
    ];
    if !p.deterministic {
        steps.push((BwdKernel::Post, rows));
        return Ok((steps, None, 0));
    }
    let tile = general_bwd_tile(p.head_dim, p.head_dim_v, max_shared);
    let blocks = p.max_nq.div_ceil(tile.rows);
    // A bias broadcast over batch or heads: each block walks them all (grid size 1 there).
    let shape = p.bias.as_ref().map(|(b, _)| b.shape().to_vec());
    let spans = |dim: usize, n: usize| {
        if shape.as_ref().is_some_and(|s| s[dim] == 1) {
            1
        } else {
            n
        }
    };
    steps.push((
        BwdKernel::Dq(tile),
        (
            blocks as u32,
            spans(1, p.heads_q) as u32,
            spans(0, p.batch) as u32,
        ),
    ));
    let parts = bias_parts(p, blocks);
    if parts.is_some() {
        steps.push((BwdKernel::DbiasSum, (rows.0.max(1), rows.1, rows.2)));
    }
    if p.rel_bias.is_some() {
        steps.push((BwdKernel::DrelSum, (rows.0.max(1), rows.1, rows.2)));
    }
    Ok((steps, parts, blocks))
}

/// Queues the kernels that write every element of `grads`.
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
    let mut bptr = BwdPointers {
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
        drel_bias: grads
            .drel_bias
            .as_ref()
            .map(|t| device_ptr_of(t, "drel_bias"))
            .transpose()?
            .unwrap_or(0),
        ..BwdPointers::default()
    };
    let layouts = BwdLayouts {
        dout: row_layout(dout),
        dq: row_layout(&grads.dq),
        dk: row_layout(&grads.dk),
        dv: row_layout(&grads.dv),
    };
    let strides = [&p.q, &p.k, &p.v, &layouts.dout, &layouts.dk, &layouts.dv]
        .map(|l| [l.batch, l.row, l.head]);
    let addresses = [ptr.q, ptr.k, ptr.v, bptr.dout, bptr.dk, bptr.dv];
    let max_shared = g.max_shared_per_block;
    let switches = (
        MMA_BACKWARD.get(),
        g.arch == "sm_90a" && HOPPER_BACKWARD.get(),
    );
    let mut main = choose(p, (&strides, &addresses), max_shared, switches);
    // Maps are encoded before the Hopper kernel is compiled: one the driver refuses sends the
    // problem to the other kernels, as on any other GPU.
    let maps = match main {
        BwdKernel::Wgmma(t) => {
            let addresses = [ptr.q, ptr.k, ptr.v, bptr.dout];
            let maps = backward_maps(p, addresses, &layouts.dout, WGMMA_BWD_ROWS, t.keys())
                .filter(|_| p.deterministic || accum_layout(p, 0, accum_pitch(p)).is_some());
            if maps.is_none() {
                main = choose(p, (&strides, &addresses), max_shared, (switches.0, false));
            }
            maps
        }
        _ => None,
    };
    let (steps, parts, dq_blocks) = plan(p, main, max_shared)?;

    let extras = Extras::upload(g, p, &mut ptr)?;
    let delta = scratch(g, lse.numel())?;
    // The dQ accumulator, or in deterministic mode the partial bias gradients (if any).
    let accum_elems = match (p.deterministic, parts) {
        (false, _) => accum_len(p),
        (true, parts) => parts.map_or(0, |b| b.len),
    };
    let accum = scratch(g, accum_elems)?;
    let rel_part = scratch(g, rel_parts_len(p, dq_blocks))?;
    bptr.delta = delta.device_ptr(&g.stream).0;
    bptr.dq_accum = accum.device_ptr(&g.stream).0;
    bptr.drel_part = rel_part.device_ptr(&g.stream).0;
    let f = FlashParams::new(p, ptr, &row_layout(out))?;
    let sizes = (accum_elems, parts);
    let params = BwdParams::new(p, (f, bptr), &layouts, sizes, dq_blocks);
    // The Hopper kernel's map of the accumulator, which its dQ tiles are added into (checked
    // above); in deterministic mode it takes none, and q's map stands in for the parameter.
    let accum_map = match (&maps, p.deterministic) {
        (Some(_), false) => {
            let layout = accum_layout(p, bptr.dq_accum, accum_pitch(p))
                .ok_or_else(|| Error::Cuda("the dQ accumulator is not TMA-aligned".into()))?;
            Some(encode_accum(&layout, WGMMA_BWD_ROWS as u32)?)
        }
        _ => None,
    };

    let opts = options_of(p);
    for (kernel, grid) in steps {
        if grid.0 == 0 {
            continue; // no key (or no query) rows: nothing for this kernel to write
        }
        let (_, threads, shared) = kernel.shape();
        if shared > max_shared {
            return Err(Error::Unsupported {
                device: "cuda",
                what: format!(
                    "backward at head dims {}/{}: {shared} bytes of shared memory a block, the \
                     GPU allows {max_shared}",
                    p.head_dim, p.head_dim_v
                ),
            });
        }
        let keyed = matches!(
            kernel,
            BwdKernel::General(_) | BwdKernel::Mma(_) | BwdKernel::Wgmma(_)
        );
        let variant = Variant {
            kernel,
            dtype: p.dtype,
            opts,
            deterministic: keyed && p.deterministic,
        };
        let func = launchable(g, variant, shared)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let mut launch = g.stream.launch_builder(&func);
        launch.arg(&params);
        if let (BwdKernel::Wgmma(_), Some(maps)) = (kernel, &maps) {
            for map in maps {
                launch.arg(map);
            }
            launch.arg(accum_map.as_ref().unwrap_or(&maps[0]));
        }
        // SAFETY: every address in `params` points into a live device allocation of this GPU: q,
        // k, v, out, dout and the biases are validated views whose elements lie inside their
        // buffers; lse is a contiguous view of the validated shape; dq, dk, dv, dbias and
        // drel_bias are device views of exactly the shapes the kernels write, in buffers of their
        // own (allocated here or validated by `expect_writable`); alibi, cu_seqlens, D, the dQ
        // accumulator (or partial bias gradients) and the partial table gradients are allocated
        // above with the lengths `params` gives and outlive the launches on this stream. The kernels touch only the elements the validated
        // sizes and strides describe, and `shared` bytes were allowed when the kernel was loaded.
        // The Hopper kernel's tensor maps (after `params`: q, k, v, dout) describe only elements
        // of those same validated views (see `forward::queue`); TMA zero-fills outside them. Its
        // last map covers the first `head_dim` elements of each row of the accumulator allocated
        // above (`accum_len` elements), and TMA skips what lies outside it.
        unsafe { launch.launch(cfg) }.map_err(Gpu::err("launching a backward kernel"))?;
        if keyed {
            LAST_VARIANT.set(Some(variant));
        }
    }
    drop((extras, delta, accum, rel_part, lse));
    Ok(())
}
