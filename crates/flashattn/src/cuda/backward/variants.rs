//! The backward's kernel variants: what each launch is, its translation unit (defines pasted
//! before the shared headers), the list CI compiles, and the choice of the key-block kernel.

use super::tiles::{
    GENERAL_BWD_THREADS, GeneralBwdTile, MMA_BWD_MAX_HEAD_DIM, MMA_BWD_WARPS, MmaBwdTile,
    WGMMA_BWD_MAX_HEAD_DIM, WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM, WGMMA_BWD_THREADS, WgmmaBwdTile,
    all_general_bwd_tiles, general_bwd_tile, mma_bwd_tile, wgmma_bwd_tile,
};
use crate::cuda::compile::KernelSource;
use crate::cuda::forward::{HEADERS, Options, dtype_define};
use crate::dtype::DType;
use crate::problem::Problem;

const BWD_INFO: &str = include_str!("../../../kernels/bwd_info.cuh");
const BWD_ROWS: &str = include_str!("../../../kernels/flash_bwd_rows.cu");
const BWD_GENERAL: &str = include_str!("../../../kernels/flash_bwd_general.cu");
const BWD_DQ: &str = include_str!("../../../kernels/flash_bwd_dq.cu");
const MMA: &str = include_str!("../../../kernels/mma.cuh");
const BWD_MMA: &str = include_str!("../../../kernels/flash_bwd_mma.cu");
const HOPPER: &str = include_str!("../../../kernels/hopper.cuh");
const BWD_WGMMA: &str = include_str!("../../../kernels/flash_bwd_wgmma.cu");
const BWD_WGMMA_WIDE: &str = include_str!("../../../kernels/flash_bwd_wgmma_wide.cu");

/// Threads (and query rows × 32) per block of the row passes (`ROW_THREADS` in
/// `kernels/flash_bwd_rows.cu`).
pub(crate) const ROW_THREADS: usize = 128;

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
    /// The Hopper (sm_90a) key-block kernel.
    Wgmma(WgmmaBwdTile),
    /// The deterministic dQ (and bias gradient) pass, per query block.
    Dq(GeneralBwdTile),
    /// The deterministic sum of a row-broadcast bias gradient's partials.
    DbiasSum,
    /// The deterministic sum of the relative-position table gradient's partials.
    DrelSum,
}

impl BwdKernel {
    /// Rows (keys or queries) a block covers, threads a block and shared memory of the kernel.
    pub(crate) fn shape(&self) -> (usize, usize, usize) {
        match self {
            BwdKernel::General(t) => (t.keys, GENERAL_BWD_THREADS, t.shared_bytes()),
            BwdKernel::Dq(t) => (t.rows, GENERAL_BWD_THREADS, t.shared_bytes()),
            BwdKernel::Mma(t) => (t.keys(), 32 * MMA_BWD_WARPS, t.shared_bytes()),
            BwdKernel::Wgmma(t) => (t.keys(), WGMMA_BWD_THREADS, t.shared_bytes()),
            BwdKernel::Pre | BwdKernel::Post | BwdKernel::DbiasSum | BwdKernel::DrelSum => {
                (0, ROW_THREADS, 0)
            }
        }
    }
}

/// A kernel with its element type, score options and mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    pub kernel: BwdKernel,
    pub dtype: DType,
    pub opts: Options,
    /// The key-block kernels leave dQ and dbias to the deterministic pass.
    pub deterministic: bool,
}

/// The score options of the backward (a non-positive scale needs no code of its own here).
pub(crate) fn options_of(p: &Problem) -> Options {
    Options {
        nonpos_scale: false,
        ..Options::of(p)
    }
}

/// The key-block kernel for `p` (`strides` of q, k, v, dout, dk, dv in elements, their
/// `addresses` in bytes): with 16-byte-aligned rows, f16/bf16 and head dims that are multiples of
/// 8, the Hopper one (when `hopper`: an sm_90a GPU, switch on) for padded batches with head dims
/// up to [`WGMMA_BWD_MAX_HEAD_DIM`] (a softcap or a relative-position table up to
/// [`WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM`] or above 128, on the wide kernel), else the
/// tensor-core one (when `mma` allows it) up to [`MMA_BWD_MAX_HEAD_DIM`]; else the CUDA-core one.
/// The Hopper kernel also needs tensor maps, which the caller encodes and may fall back from.
pub(crate) fn choose(
    p: &Problem,
    (strides, addresses): (&[[usize; 3]], &[u64]),
    max_shared: usize,
    (mma, hopper): (bool, bool),
) -> BwdKernel {
    let half = matches!(p.dtype, DType::F16 | DType::BF16) && mma;
    let dims = |max: usize| {
        [p.head_dim, p.head_dim_v]
            .iter()
            .all(|&d| d % 8 == 0 && d <= max)
    };
    let aligned =
        strides.iter().flatten().all(|s| s % 8 == 0) && addresses.iter().all(|a| a % 16 == 0);
    if !(half && aligned) {
        return BwdKernel::General(general_bwd_tile(p.head_dim, p.head_dim_v, max_shared));
    }
    let wgmma = wgmma_bwd_tile(p.head_dim, p.head_dim_v);
    // The narrow kernel's softcap and table code spills above head dim 64; the wide one takes them.
    let mods_fit = (p.softcap.is_none() && p.rel_bias.is_none())
        || wgmma.wide()
        || dims(WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM);
    if hopper
        && !p.varlen
        && dims(WGMMA_BWD_MAX_HEAD_DIM)
        && mods_fit
        && wgmma.shared_bytes() <= max_shared
    {
        return BwdKernel::Wgmma(wgmma);
    }
    let tile = mma_bwd_tile(p.head_dim, p.head_dim_v);
    if dims(MMA_BWD_MAX_HEAD_DIM) && tile.shared_bytes() <= max_shared {
        return BwdKernel::Mma(tile);
    }
    BwdKernel::General(general_bwd_tile(p.head_dim, p.head_dim_v, max_shared))
}

fn general_defines(t: &GeneralBwdTile) -> String {
    format!(
        "#define DQK_MAX {}\n#define DV_MAX {}\n#define BKB {}\n#define BQB {}\n",
        t.dqk, t.dv, t.keys, t.rows
    )
}

/// The translation unit of one backward variant.
pub(crate) fn kernel_source(v: Variant) -> KernelSource {
    let (elem, tname) = dtype_define(v.dtype);
    let mut code = format!(
        "#define {elem} 1\n{}#define DETERMINISTIC {}\n",
        v.opts.defines(),
        v.deterministic as u8
    );
    let tail = format!(
        "{}{}",
        v.opts.suffix(),
        if v.deterministic { "_det" } else { "" }
    );
    let (name, entry, bodies): (String, &str, &[&str]) = match v.kernel {
        BwdKernel::Pre => (format!("bwd_pre_{tname}"), "flash_bwd_pre", &[BWD_ROWS]),
        BwdKernel::Post => (format!("bwd_post_{tname}"), "flash_bwd_post", &[BWD_ROWS]),
        BwdKernel::DbiasSum => (
            format!("bwd_dbias_sum_{tname}"),
            "flash_bwd_dbias_sum",
            &[BWD_ROWS],
        ),
        BwdKernel::DrelSum => (
            format!("bwd_drel_sum_{tname}"),
            "flash_bwd_drel_sum",
            &[BWD_ROWS],
        ),
        BwdKernel::General(t) => {
            code += &general_defines(&t);
            let name = format!(
                "bwd_general_{tname}_d{}x{}_k{}q{}{tail}",
                t.dqk, t.dv, t.keys, t.rows
            );
            (name, "flash_bwd_general", &[BWD_GENERAL])
        }
        BwdKernel::Dq(t) => {
            code += &general_defines(&t);
            let name = format!(
                "bwd_dq_{tname}_d{}x{}_k{}q{}{tail}",
                t.dqk, t.dv, t.keys, t.rows
            );
            (name, "flash_bwd_dq", &[BWD_DQ])
        }
        BwdKernel::Mma(t) => {
            code += &format!(
                "#define DQK {}\n#define DV {}\n#define BQB {}\n#define NWARPS {}\n",
                t.dqk, t.dv, t.rows, MMA_BWD_WARPS
            );
            let name = format!("bwd_mma_{tname}_d{}x{}_q{}{tail}", t.dqk, t.dv, t.rows);
            (name, "flash_bwd_mma", &[MMA, BWD_MMA])
        }
        BwdKernel::Wgmma(t) => {
            code += &format!("#define DQK {}\n#define DV {}\n", t.dqk, t.dv);
            if t.wide() {
                code += &format!(
                    "#define Q_STAGES {}\n#define DO_STAGES {}\n",
                    t.stages, t.do_stages
                );
                let name = format!(
                    "bwd_wgmma_{tname}_d{}x{}_s{}x{}{tail}",
                    t.dqk, t.dv, t.stages, t.do_stages
                );
                (name, "flash_bwd_wgmma_wide", &[MMA, HOPPER, BWD_WGMMA_WIDE])
            } else {
                code += &format!("#define STAGES {}\n", t.stages);
                let name = format!("bwd_wgmma_{tname}_d{}x{}_s{}{tail}", t.dqk, t.dv, t.stages);
                (name, "flash_bwd_wgmma", &[MMA, HOPPER, BWD_WGMMA])
            }
        }
    };
    code += &[&HEADERS[..], &[BWD_INFO], bodies].concat().join("\n");
    KernelSource {
        name,
        code,
        entry: entry.into(),
        hopper_only: matches!(v.kernel, BwdKernel::Wgmma(_)),
    }
}

/// Every backward variant: the row passes per dtype; the CUDA-core key-block kernel's and dQ
/// pass's tiles for every dtype at head dims 16, 80 and 32..=512 in steps of 32 with every score
/// option (every `#if` branch compiled), and with none at head dim 64; the tensor-core kernel's
/// for f16/bf16 at head dims 16..=128 in steps of 16 with every option, and with none and the
/// mask alone at 64 and 128; the key-block kernels with every option in deterministic mode too;
/// the Hopper kernels' (sm_90a) for f16/bf16 at padded head dims 64 and 128 (narrow) and 128/256
/// (wide) with none, the mask (also deterministic) and every option they take (also
/// deterministic: the softcap and the table at 64 and on the wide kernel only).
pub fn kernel_sources() -> Vec<KernelSource> {
    let mut out = Vec::new();
    let all = Options {
        nonpos_scale: false,
        ..Options::ALL
    };
    let mask = Options {
        mask: true,
        ..Options::default()
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mut push = |kernel, opts, deterministic| {
            out.push(kernel_source(Variant {
                kernel,
                dtype,
                opts,
                deterministic,
            }))
        };
        for kernel in [
            BwdKernel::Pre,
            BwdKernel::Post,
            BwdKernel::DbiasSum,
            BwdKernel::DrelSum,
        ] {
            push(kernel, Options::default(), false);
        }
        for d in [16, 80].into_iter().chain((32..=512).step_by(32)) {
            for t in all_general_bwd_tiles(d, d) {
                push(BwdKernel::General(t), all, false);
                push(BwdKernel::General(t), all, true);
                push(BwdKernel::Dq(t), all, false);
            }
        }
        for t in all_general_bwd_tiles(64, 64) {
            push(BwdKernel::General(t), Options::default(), false);
            push(BwdKernel::Dq(t), Options::default(), false);
        }
        if dtype == DType::F32 {
            continue;
        }
        for d in (16..=MMA_BWD_MAX_HEAD_DIM).step_by(16) {
            push(BwdKernel::Mma(mma_bwd_tile(d, d)), all, false);
            push(BwdKernel::Mma(mma_bwd_tile(d, d)), all, true);
        }
        for d in [64, 128] {
            push(
                BwdKernel::Mma(mma_bwd_tile(d, d)),
                Options::default(),
                false,
            );
            push(BwdKernel::Mma(mma_bwd_tile(d, d)), mask, false);
        }
        for (d, dv) in [
            (64, 64),
            (128, 128),
            (64, 128),
            (128, 64),
            (256, 256),
            (128, 256),
            (256, 128),
        ] {
            let tile = wgmma_bwd_tile(d, dv);
            let t = BwdKernel::Wgmma(tile);
            push(t, Options::default(), false);
            push(t, mask, false);
            push(t, mask, true);
            let takes_all = tile.wide() || d.max(dv) <= WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM;
            let mods = Options {
                softcap: takes_all,
                rel_bias: takes_all,
                ..all
            };
            push(t, mods, false);
            push(t, mods, true);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names_are_unique_and_say_the_mode() {
        let all = kernel_sources();
        let mut names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
        for s in &all {
            let det = s.code.contains("#define DETERMINISTIC 1");
            assert_eq!(det, s.name.ends_with("_det"), "{}", s.name);
        }
    }
}
