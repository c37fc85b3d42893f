//! The FlashAttention forward on the GPU: picks the kernel and tile ([`super::tile_config`]),
//! builds the variant's source (defines pasted before the shared headers), compiles it on first
//! use through the cached loader, and launches it with a [`FlashParams`] on the GPU's stream (and,
//! for the Hopper kernel, the TMA maps of q, k and v: [`super::tensor_map`]).

use cudarc::driver::sys::CUfunction_attribute;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::compile::{KernelSource, TYPES_HEADER, function};
use super::device::{Gpu, gpu};
use super::params::{Extras, FlashParams, Pointers};
use super::storage::CudaStorage;
use super::tensor_map::forward_maps;
use super::tile_config::{Alignment, GENERAL_THREADS, Hints, Path, choose, wgmma_tile};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::outputs::ForwardOutput;
use crate::problem::{Problem, row_layout, strides_like};
use crate::tensor::{Device, Tensor, contiguous_strides};

/// The vocabulary every forward kernel is pasted after, in order (NVRTC gets no include path).
pub(crate) const HEADERS: [&str; 4] = [
    TYPES_HEADER,
    include_str!("../../kernels/block_info.cuh"),
    include_str!("../../kernels/mask.cuh"),
    include_str!("../../kernels/softmax.cuh"),
];
const MMA: &str = include_str!("../../kernels/mma.cuh");
const FWD_MMA: &str = include_str!("../../kernels/flash_fwd_mma.cu");
const FWD_GENERAL: &str = include_str!("../../kernels/flash_fwd_general.cu");
const HOPPER: &str = include_str!("../../kernels/hopper.cuh");
const FWD_WGMMA: &str = include_str!("../../kernels/flash_fwd_wgmma.cu");

/// The padded head dims (of Q/K and of V) the Hopper kernel is built for.
const WGMMA_DIMS: [usize; 4] = [64, 128, 192, 256];

/// How far (log2 units) a row's running max may rise before O is rescaled: exp2 of scores up to
/// 2^8 above the reference is exact in f32, and O and l share the reference, so the result is the
/// same while most key blocks skip the rescale.
const RESCALE_SLACK: u32 = 8;

/// The compile-time options of a variant: each one removes its code when off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Options {
    pub softcap: bool,
    pub alibi: bool,
    pub bias: bool,
    /// A relative-position table.
    pub rel_bias: bool,
    /// A window (causal included) hides some keys.
    pub mask: bool,
    /// `scale <= 0`: the row max must be taken after scaling.
    pub nonpos_scale: bool,
}

impl Options {
    pub(crate) fn of(p: &Problem) -> Self {
        Options {
            softcap: p.softcap.is_some(),
            alibi: p.alibi.is_some(),
            bias: p.bias.is_some(),
            rel_bias: p.rel_bias.is_some(),
            mask: !p.window.is_full(),
            nonpos_scale: p.scale <= 0.0,
        }
    }

    const MASK: Options = Options {
        softcap: false,
        alibi: false,
        bias: false,
        rel_bias: false,
        mask: true,
        nonpos_scale: false,
    };

    pub(crate) const ALL: Options = Options {
        softcap: true,
        alibi: true,
        bias: true,
        rel_bias: true,
        mask: true,
        nonpos_scale: true,
    };

    pub(crate) fn defines(&self) -> String {
        let flag = |name: &str, on: bool| format!("#define {name} {}\n", on as u8);
        [
            flag("HAS_SOFTCAP", self.softcap),
            flag("HAS_ALIBI", self.alibi),
            flag("HAS_BIAS", self.bias),
            flag("HAS_REL_BIAS", self.rel_bias),
            flag("HAS_MASK", self.mask),
            flag("NONPOS_SCALE", self.nonpos_scale),
        ]
        .concat()
    }

    /// What steers the tile of a variant with these options.
    fn hints(&self) -> Hints {
        Hints {
            score_mods: self.softcap
                || self.alibi
                || self.bias
                || self.rel_bias
                || self.nonpos_scale,
        }
    }

    pub(crate) fn suffix(&self) -> String {
        let tags = [
            (self.softcap, "_softcap"),
            (self.alibi, "_alibi"),
            (self.bias, "_bias"),
            (self.rel_bias, "_relbias"),
            (self.mask, "_mask"),
            (self.nonpos_scale, "_negscale"),
        ];
        tags.iter().filter(|t| t.0).map(|t| t.1).collect()
    }
}

pub(crate) fn dtype_define(dtype: DType) -> (&'static str, &'static str) {
    match dtype {
        DType::F32 => ("ELEM_F32", "f32"),
        DType::F16 => ("ELEM_F16", "f16"),
        DType::BF16 => ("ELEM_BF16", "bf16"),
    }
}

/// The translation unit of one variant.
pub(crate) fn kernel_source(path: &Path, dtype: DType, opts: Options) -> KernelSource {
    let (elem, tname) = dtype_define(dtype);
    let mut code = format!("#define {elem} 1\n{}", opts.defines());
    let (name, entry) = match path {
        Path::Mma(t) => {
            code += &format!(
                "#define DQK {}\n#define DV {}\n#define BR {}\n#define BC {}\n#define NWARPS {}\n\
                 #define Q_IN_REGS {}\n#define MIN_BLOCKS {}\n#define RESCALE_SLACK {}\n",
                t.dqk, t.dv, t.br, t.bc, t.warps, t.q_in_regs as u8, t.min_blocks, RESCALE_SLACK
            );
            code += &[&HEADERS[..], &[MMA, FWD_MMA]].concat().join("\n");
            let name = format!(
                "fwd_mma_{tname}_d{}x{}_{}x{}w{}{}",
                t.dqk,
                t.dv,
                t.br,
                t.bc,
                t.warps,
                if t.q_in_regs { "q" } else { "" }
            );
            (name, "flash_fwd_mma")
        }
        Path::General(t) => {
            code += &format!(
                "#define DQK_MAX {}\n#define DV_MAX {}\n#define BCG {}\n#define GRPT {}\n\
                 #define GK_F64 {}\n",
                t.dqk, t.dv, t.bc, t.rows_per_group, t.k_f64 as u8
            );
            code += &[&HEADERS[..], &[FWD_GENERAL]].concat().join("\n");
            (
                format!(
                    "fwd_general_{tname}_d{}x{}_bc{}r{}{}",
                    t.dqk,
                    t.dv,
                    t.bc,
                    t.rows(),
                    if t.k_f64 { "k64" } else { "" }
                ),
                "flash_fwd_general",
            )
        }
        Path::Wgmma(t) => {
            code += &format!(
                "#define DQK {}\n#define DV {}\n#define BR {}\n#define BC {}\n#define NWG {}\n\
                 #define STAGES {}\n#define RESCALE_SLACK {}\n",
                t.dqk, t.dv, t.br, t.bc, t.nwg, t.stages, RESCALE_SLACK
            );
            code += &[&HEADERS[..], &[MMA, HOPPER, FWD_WGMMA]]
                .concat()
                .join("\n");
            let name = format!(
                "fwd_wgmma_{tname}_d{}x{}_{}x{}s{}",
                t.dqk, t.dv, t.br, t.bc, t.stages
            );
            (name, "flash_fwd_wgmma")
        }
    };
    KernelSource {
        name: name + &opts.suffix(),
        code,
        entry: entry.into(),
        hopper_only: matches!(path, Path::Wgmma(_)),
    }
}

/// Every forward variant: each tile the tile table can pick (tensor-core: f16 and bf16, head dims
/// 32..=256, on 227 KB and 99 KB parts, for every hint; CUDA-core: every dtype, head dims
/// 32..=512). Tiles picked for score mods are listed with every option on (every `#if` branch
/// compiled); the others with no option and with the mask alone; the CUDA-core kernel with every
/// option, and with none at head dim 64; the Hopper kernel (sm_90a only) for f16 and bf16, padded
/// head dims 64 to 256 each, with no option, the mask alone, and every
/// option (on the tile picked for score mods).
pub fn kernel_sources() -> Vec<KernelSource> {
    let mut out: Vec<KernelSource> = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for (dqk, dv) in WGMMA_DIMS.iter().flat_map(|&a| WGMMA_DIMS.map(|b| (a, b))) {
            for opts in [Options::default(), Options::MASK, Options::ALL] {
                let t = Path::Wgmma(wgmma_tile(dqk, dv, opts.hints()));
                out.push(kernel_source(&t, dtype, opts));
            }
        }
    }
    for dtype in [DType::F16, DType::BF16] {
        for d in (32..=256).step_by(32) {
            for (t, hints) in super::tile_config::all_mma_tiles(d, d) {
                let opts = if hints.score_mods {
                    Options::ALL
                } else {
                    Options::MASK
                };
                out.push(kernel_source(&Path::Mma(t), dtype, opts));
                if !hints.score_mods {
                    out.push(kernel_source(&Path::Mma(t), dtype, Options::default()));
                }
            }
        }
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in (32..=512).step_by(32) {
            let t = Path::General(super::tile_config::general_tile(d, d));
            out.push(kernel_source(&t, dtype, Options::ALL));
        }
        let t = Path::General(super::tile_config::general_tile(64, 64));
        out.push(kernel_source(&t, dtype, Options::default()));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup_by(|a, b| a.name == b.name);
    out
}

/// Whether sm_90a devices run the Hopper kernel where it applies (on unless switched off).
static HOPPER_FORWARD: AtomicBool = AtomicBool::new(true);

/// Test and benchmark support: turns the Hopper (wgmma) forward on or off for this process; off,
/// sm_90a devices run the kernels every other GPU runs.
pub fn set_hopper_forward(on: bool) {
    HOPPER_FORWARD.store(on, Ordering::Relaxed);
}

thread_local! {
    /// The variant of this thread's last forward launch.
    static LAST_VARIANT: Cell<Option<(Path, DType, Options)>> = const { Cell::new(None) };
}

/// Test support: the name of the forward variant this thread launched last (`fwd_wgmma_…`,
/// `fwd_mma_…` or `fwd_general_…`), or `None` before any launch.
pub fn last_cuda_forward_kernel() -> Option<String> {
    LAST_VARIANT
        .get()
        .map(|(path, dtype, opts)| kernel_source(&path, dtype, opts).name)
}

type ReadyKey = (usize, Path, DType, Options);

/// The kernels [`launchable`] has made ready, by GPU and variant.
fn ready() -> &'static Mutex<HashMap<ReadyKey, CudaFunction>> {
    static READY: OnceLock<Mutex<HashMap<ReadyKey, CudaFunction>>> = OnceLock::new();
    READY.get_or_init(Default::default)
}

/// Forgets the kernels made ready (see [`super::forget_loaded_kernels`]).
pub(crate) fn forget_launchable() {
    ready().lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// A variant's loaded kernel with its shared-memory limit raised, by a small key: after the first
/// call a launch costs one hash lookup, not the building and comparing of its source.
fn launchable(
    g: &Gpu,
    path: &Path,
    dtype: DType,
    opts: Options,
    shared: usize,
) -> Result<CudaFunction> {
    let ready = ready();
    let key = (g.ordinal, *path, dtype, opts);
    if let Some(f) = ready.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let func = function(g, &kernel_source(path, dtype, opts))?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )
    .map_err(Gpu::err("setting the kernel's shared memory"))?;
    ready
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, func.clone());
    Ok(func)
}

fn too_large(what: &str, n: usize) -> Error {
    Error::Unsupported {
        device: "cuda",
        what: format!("{what} = {n} (the CUDA kernels index rows with 32-bit integers)"),
    }
}

pub(crate) fn device_ptr_of(t: &Tensor, arg: &'static str) -> Result<u64> {
    t.cuda_ptr().ok_or_else(|| Error::DeviceMismatch {
        arg,
        expected: "a CUDA tensor".into(),
        got: t.device().to_string(),
    })
}

/// Runs the forward of a validated problem whose tensors live on one GPU. The output (shaped like
/// `q` with `v`'s head dim, in `q`'s memory order) and the LSE are allocated on the device
/// (poisoned when tests ask for it) and fully written by the kernel.
pub(crate) fn forward(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ForwardOutput> {
    let g = gpu_for(p, k)?;
    let out_shape = Problem::shape_like(q, p.head_dim_v);
    let out_strides = strides_like(q, &out_shape);
    let out_len: usize = out_shape.iter().product();
    let out_store = CudaStorage::alloc_output(&g, p.dtype, out_len)?;
    let out = Tensor::from_cuda_storage(out_store, &out_shape, &out_strides, 0)?;
    let lse_shape = p.lse_shape();
    let lse_len: usize = lse_shape.iter().product();
    let lse_store = CudaStorage::alloc_output(&g, DType::F32, lse_len)?;
    let lse = Tensor::from_cuda_storage(lse_store, &lse_shape, &contiguous_strides(&lse_shape), 0)?;
    queue(&g, p, (q, k, v), &out, &lse)?;
    Ok(ForwardOutput { out, lse })
}

/// The forward into `out` and `lse` on the GPU, validated by `crate::outputs::expect_writable`
/// (shapes, dtypes, this GPU, buffers of their own; `out` in any row strides, `lse` contiguous).
pub(crate) fn forward_into(
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    let g = gpu_for(p, k)?;
    queue(&g, p, (q, k, v), out, lse)
}

/// The GPU of the problem's tensors, once its sizes are known to fit the kernels' 32-bit indices
/// and its diagonal to be theirs.
pub(crate) fn gpu_for(p: &Problem, k: &Tensor) -> Result<Arc<Gpu>> {
    let Device::Cuda(ordinal) = p.device else {
        return Err(Error::DeviceMismatch {
            arg: "q",
            expected: "a CUDA tensor".into(),
            got: p.device.to_string(),
        });
    };
    super::diagonal::kernel_diagonal(p)?;
    let limit = i32::MAX as usize;
    for (what, n) in [
        ("query rows", p.total_q.max(p.max_nq)),
        ("key rows", p.max_nk.max(k.shape()[0])),
        ("batch · heads", p.batch * p.heads_q),
    ] {
        if n > limit {
            return Err(too_large(what, n));
        }
    }
    gpu(ordinal)
}

/// The grid of a kernel with one block per `rows` query rows of each (batch, query head).
pub(crate) fn grid_of(p: &Problem, rows: usize) -> Result<(u32, u32, u32)> {
    for (what, n) in [("query heads", p.heads_q), ("batch", p.batch)] {
        if n > 65535 {
            return Err(Error::Unsupported {
                device: "cuda",
                what: format!("{what} = {n} (at most 65535: a dimension of the launch grid)"),
            });
        }
    }
    Ok((
        p.max_nq.div_ceil(rows) as u32,
        p.heads_q as u32,
        p.batch as u32,
    ))
}

/// Queues the kernel that writes every element of `out` and `lse` (device tensors of the
/// problem's output shapes).
fn queue(
    g: &Gpu,
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &Tensor,
) -> Result<()> {
    if out.numel() == 0 || lse.numel() == 0 {
        return Ok(());
    }
    let mut ptr = Pointers {
        q: device_ptr_of(q, "q")?,
        k: device_ptr_of(k, "k")?,
        v: device_ptr_of(v, "v")?,
        o: device_ptr_of(out, "out")?,
        lse: device_ptr_of(lse, "lse")?,
        ..Pointers::default()
    };
    let extras = Extras::upload(g, p, &mut ptr)?;
    let o_layout = row_layout(out);
    let params = FlashParams::new(p, ptr, &o_layout)?;

    let align = Alignment {
        strides: [&p.q, &p.k, &p.v, &o_layout].map(|l| [l.batch, l.row, l.head]),
        addresses: [ptr.q, ptr.k, ptr.v, ptr.o],
    };
    let max_shared = g.max_shared_per_block;
    let hopper = g.arch == "sm_90a" && HOPPER_FORWARD.load(Ordering::Relaxed);
    // Maps are encoded before the Hopper kernel is compiled: one the driver refuses sends the
    // problem to the other kernels, as on any other GPU.
    let (path, maps) = match choose(p, &align, max_shared, hopper) {
        // Each consumer warpgroup's Q rows are a box of their own.
        Path::Wgmma(t) => match forward_maps(p, [ptr.q, ptr.k, ptr.v], t.br / t.nwg, t.bc) {
            Some(maps) => (Path::Wgmma(t), Some(maps)),
            None => (choose(p, &align, max_shared, false), None),
        },
        other => (other, None),
    };
    let (grid, threads, shared) = match &path {
        Path::Mma(t) => (grid_of(p, t.br)?, t.threads(), t.shared_bytes()),
        Path::General(t) => (grid_of(p, t.rows())?, GENERAL_THREADS, t.shared_bytes()),
        // Persistent: at most one block per SM, each walking the query tiles.
        Path::Wgmma(t) => {
            let blocks = t.tiles(p).clamp(1, g.sm_count.max(1));
            ((blocks as u32, 1, 1), t.threads(), t.shared_bytes())
        }
    };
    let opts = Options::of(p);
    let func = launchable(g, &path, p.dtype, opts, shared)?;
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let sched = match path {
        Path::Wgmma(_) => g.tile_counter()?,
        _ => 0,
    };
    let mut launch = g.stream.launch_builder(&func);
    launch.arg(&params);
    if let Some(maps) = &maps {
        for map in maps {
            launch.arg(map);
        }
        launch.arg(&sched);
    }
    // SAFETY: every address in `params` points into a live device allocation of this GPU (q, k, v
    // and the bias are validated views whose elements lie inside their buffers; out and lse are
    // validated device views of exactly the shapes the kernel writes, in buffers of their own;
    // alibi and cu_seqlens are uploaded above and outlive the launch on this stream). The kernel
    // reads and writes only the elements the validated sizes and strides in `params` describe,
    // and `shared` bytes were allowed above. The Hopper kernel's tensor maps (passed after
    // `params`, in the order q, k, v) describe only elements of those same validated views: each
    // map's address, sizes and strides are its tensor's own (except the stride of a dimension of
    // size 1, never stepped along, which is replaced by a valid one); TMA zero-fills the parts of
    // a box outside them. Its tile counter (`sched`) is this GPU's, zero between launches and
    // used by one launch at a time (all are ordered on this stream).
    unsafe { launch.launch(cfg) }.map_err(Gpu::err("launching the forward kernel"))?;
    LAST_VARIANT.set(Some((path, p.dtype, opts)));
    drop(extras);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hopper_variants_are_hopper_only() {
        for src in kernel_sources() {
            assert_eq!(
                src.hopper_only,
                src.name.starts_with("fwd_wgmma_"),
                "{}",
                src.name
            );
        }
    }

    #[test]
    fn variant_names_are_unique() {
        let all = kernel_sources();
        let mut names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
    }

    #[test]
    fn every_pickable_variant_is_listed() {
        use crate::cuda::tile_config::{general_tile, mma_tile};
        let names: Vec<String> = kernel_sources().into_iter().map(|s| s.name).collect();
        let listed = |path: Path, dtype, opts| {
            let name = kernel_source(&path, dtype, opts).name;
            assert!(names.contains(&name), "{name} is not in kernel_sources()");
        };
        for dtype in [DType::F16, DType::BF16] {
            for d in (32..=256).step_by(32) {
                for (score_mods, mask) in [(false, false), (false, true), (true, true)] {
                    let hints = Hints { score_mods };
                    let opts = if score_mods {
                        Options::ALL
                    } else {
                        Options {
                            mask,
                            ..Options::default()
                        }
                    };
                    for max_shared in [227 * 1024, 99 * 1024] {
                        listed(Path::Mma(mma_tile(d, d, hints, max_shared)), dtype, opts);
                    }
                }
            }
        }
        for dtype in [DType::F16, DType::BF16] {
            for dqk in WGMMA_DIMS {
                for dv in WGMMA_DIMS {
                    for opts in [Options::default(), Options::MASK, Options::ALL] {
                        let t = wgmma_tile(dqk, dv, opts.hints());
                        listed(Path::Wgmma(t), dtype, opts);
                    }
                }
            }
        }
        listed(
            Path::General(general_tile(512, 512)),
            DType::F32,
            Options::ALL,
        );
        listed(Path::General(general_tile(1, 3)), DType::BF16, Options::ALL);
    }
}
