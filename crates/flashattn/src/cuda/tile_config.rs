//! Which kernel and which tile shape a problem runs with: pure functions of head dims, dtype,
//! options, sequence length, strides and the device's shared-memory limit, so they can be read
//! (and tested) apart from the kernels.
//!
//! The choices, one line each (the measurements behind them: kernels/README.md, BENCHMARKS.md):
//! - D ≤ 64: 128×128, 4 warps, Q re-read from shared memory; 128×64 with Q in registers when
//!   score mods are compiled in (128×128 spills with them).
//! - D ≤ 128: 128×64, 4 warps.
//! - D ≤ 256: one 16-row slice per warp (two would not fit the O accumulator in registers):
//!   128×64 with 8 warps; 64×32 with 4 warps with score mods (128×64 spills a little with them).
//! - Any D where the preferred tile's shared memory does not fit (sm_86/89: 99 KiB; at D = 256
//!   the 198 KiB of 128×64 exceed the A100's 163 KiB): 64×32 with 4 warps.
//! - Two 16-row slices per warp elsewhere: one slice needs 256 bytes of `ldmatrix` traffic per
//!   m16n8k16, above shared memory's 128 B/clock at the tensor-core rate.
//!
//! On Hopper (sm_90a) the warp-specialized TMA + wgmma kernel runs f16/bf16 problems with head dims
//! up to 256 whose q, k, v TMA can load; the rest as above. Its tiles ([`wgmma_tile`]; figures in
//! kernels/README.md, versions 6 and 9), a 2-deep K/V ring everywhere:
//! - Padded D ≤ 64: 3 consumer warpgroups × 128 keys (192 rows; 1.2× the 2-warpgroup tile from
//!   N = 2048, and 1.04-1.07× under a causal mask at N = 512 and 1024 since each consumer computes
//!   only the key blocks its rows see); 2 warpgroups (128 rows) with score mods (which spill with 3).
//! - D ≤ 128: 128×128 (1.1-1.2× 128×64); 128×64 with score mods (128×128 spills with them).
//! - D ≤ 192, and D = 256 without score mods: 128×64 (the O accumulator takes DV/2 registers);
//!   128×32 at D = 256 with score mods.

use super::tensor_map::qkv_layouts;
use crate::dtype::DType;
use crate::problem::Problem;

/// The largest head dim (of Q/K and of V) the tensor-core kernel handles.
pub(crate) const MMA_MAX_HEAD_DIM: usize = 256;

/// A tile shape of the tensor-core kernel (`kernels/flash_fwd_mma.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MmaTile {
    /// Head dims padded to a multiple of 32 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Query rows per block.
    pub br: usize,
    /// Keys per K/V block.
    pub bc: usize,
    pub warps: usize,
    /// Keep the warp's Q fragments in registers for the whole key loop.
    pub q_in_regs: bool,
    /// `__launch_bounds__` minimum blocks per SM (a register budget).
    pub min_blocks: usize,
}

impl MmaTile {
    /// Dynamic shared memory: Q, two K buffers, two V buffers, rows padded by 8 elements.
    pub(crate) fn shared_bytes(&self) -> usize {
        2 * (self.br * (self.dqk + 8) + 2 * self.bc * (self.dqk + 8) + 2 * self.bc * (self.dv + 8))
    }

    pub(crate) fn threads(&self) -> usize {
        self.warps * 32
    }
}

/// A tile shape of the CUDA-core kernel (`kernels/flash_fwd_general.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GeneralTile {
    /// Head dims rounded up to a multiple of 32 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Keys per K/V block.
    pub bc: usize,
    /// Query rows per lane group: a block owns `16 · rows_per_group` rows.
    pub rows_per_group: usize,
    /// K staged in shared memory as f64 (the dot products then convert only Q).
    pub k_f64: bool,
}

/// Threads per block of the CUDA-core kernel (16 groups of 8 lanes).
pub(crate) const GENERAL_THREADS: usize = 128;

impl GeneralTile {
    /// Query rows per block.
    pub(crate) fn rows(&self) -> usize {
        16 * self.rows_per_group
    }

    /// Dynamic shared memory: K (f32 or f64) and Q with odd pitch, V, and P (f32).
    pub(crate) fn shared_bytes(&self) -> usize {
        let k_bytes = if self.k_f64 { 8 } else { 4 };
        k_bytes * self.bc * (self.dqk + 1)
            + 4 * (self.rows() * (self.dqk + 1) + self.bc * self.dv + self.rows() * self.bc)
    }
}

/// The largest head dim (of Q/K and of V) the Hopper kernel handles.
pub(crate) const WGMMA_MAX_HEAD_DIM: usize = 256;

/// A tile shape of the Hopper kernel (`kernels/flash_fwd_wgmma.cu`): one producer warpgroup loads
/// Q and a ring of K/V blocks by TMA, `nwg` consumer warpgroups own 64 query rows each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WgmmaTile {
    /// Head dims padded to a multiple of 64 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Query rows per block (`64 · nwg`).
    pub br: usize,
    /// Keys per K/V block.
    pub bc: usize,
    /// Consumer warpgroups.
    pub nwg: usize,
    /// Depth of the K/V ring.
    pub stages: usize,
}

impl WgmmaTile {
    /// Dynamic shared memory: 1 KiB of alignment slack for the 128B-swizzled tiles, Q and the
    /// K/V ring (unpadded), and 1 KiB for the barriers.
    pub(crate) fn shared_bytes(&self) -> usize {
        1024 + 2 * (self.br * self.dqk + self.stages * self.bc * (self.dqk + self.dv)) + 1024
    }

    /// The consumer warpgroups and the producer's.
    pub(crate) fn threads(&self) -> usize {
        128 * (self.nwg + 1)
    }

    /// The query tiles of `p` (`br` rows of one query head of one sequence) that the blocks of the
    /// persistent kernel walk.
    pub(crate) fn tiles(&self, p: &Problem) -> usize {
        p.max_nq.div_ceil(self.br) * p.heads_q * p.batch
    }
}

/// The Hopper tile for padded head dims `dqk`, `dv` (multiples of 64 up to 256); the choices are
/// listed in the module docs.
pub(crate) fn wgmma_tile(dqk: usize, dv: usize, hints: Hints) -> WgmmaTile {
    let tile = |nwg: usize, bc| WgmmaTile {
        dqk,
        dv,
        br: 64 * nwg,
        bc,
        nwg,
        stages: 2,
    };
    match (dqk.max(dv), hints.score_mods) {
        (..=64, false) => tile(3, 128),
        (..=64, _) | (..=128, false) => tile(2, 128),
        (..=192, _) | (_, false) => tile(2, 64),
        (_, true) => tile(2, 32),
    }
}

/// The kernel a problem runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Path {
    Mma(MmaTile),
    General(GeneralTile),
    Wgmma(WgmmaTile),
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// What besides the head dims and the shared-memory limit steers the tensor-core tile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Hints {
    /// Softcap, ALiBi, bias or a non-positive scale is compiled in (more registers).
    pub score_mods: bool,
}

impl Hints {
    fn of(p: &Problem) -> Self {
        Hints {
            score_mods: p.has_score_mods() || p.scale <= 0.0,
        }
    }
}

/// The tensor-core tile for padded head dims `dqk`, `dv` (multiples of 32, at most 256), within
/// `max_shared` bytes of shared memory per block.
pub(crate) fn mma_tile(dqk: usize, dv: usize, hints: Hints, max_shared: usize) -> MmaTile {
    let d = dqk.max(dv);
    let tile = |br, bc, q_in_regs, min_blocks| MmaTile {
        dqk,
        dv,
        br,
        bc,
        warps: 4,
        q_in_regs,
        min_blocks,
    };
    let preferred = if d <= 64 {
        if hints.score_mods {
            tile(128, 64, true, 2)
        } else {
            tile(128, 128, false, 1)
        }
    } else if d <= 128 {
        tile(128, 64, false, 1)
    } else if hints.score_mods {
        tile(64, 32, false, 1)
    } else {
        MmaTile {
            warps: 8,
            ..tile(128, 64, false, 1)
        }
    };
    if preferred.shared_bytes() <= max_shared {
        return preferred;
    }
    // Smaller parts (sm_86/89: 99 KB per block): one 16-row slice per warp, 32-key blocks.
    tile(64, 32, false, 1)
}

/// Every tile [`mma_tile`] can return for padded head dims `dqk`, `dv`, once with and once without
/// score mods where both pick it, with hints that pick it.
pub(crate) fn all_mma_tiles(dqk: usize, dv: usize) -> Vec<(MmaTile, Hints)> {
    let mut out: Vec<(MmaTile, Hints)> = Vec::new();
    for score_mods in [false, true] {
        for max_shared in [227 * 1024, 99 * 1024] {
            let h = Hints { score_mods };
            let t = mma_tile(dqk, dv, h, max_shared);
            if !out
                .iter()
                .any(|(u, g)| *u == t && g.score_mods == score_mods)
            {
                out.push((t, h));
            }
        }
    }
    out
}

/// The CUDA-core tile for head dims `dqk`, `dv` (1..=512).
///
/// Head dims ≤ 128: 64 rows per block (each K and V value feeds 4 rows) with K staged as f64,
/// which removes the f32 → f64 conversion of K from every f64 FMA (see kernels/README.md). Larger
/// head dims keep 16 rows and f32 K, within the 99 KiB of shared memory of sm_86/89 parts.
pub(crate) fn general_tile(dqk: usize, dv: usize) -> GeneralTile {
    let (dqk, dv) = (round_up(dqk, 32), round_up(dv, 32));
    let small = dqk.max(dv) <= 128;
    GeneralTile {
        dqk,
        dv,
        bc: if dqk.max(dv) <= 256 { 32 } else { 16 },
        rows_per_group: if small { 4 } else { 1 },
        k_f64: small,
    }
}

/// Element strides and first-element addresses of q, k, v and the output, to decide whether
/// 16-byte copies (and TMA) work.
pub(crate) struct Alignment {
    /// The strides (batch, row, head) of q, k, v and the output, in elements.
    pub strides: [[usize; 3]; 4],
    /// The device address of each operand's first element: q, k, v, the output.
    pub addresses: [u64; 4],
}

/// Whether the Hopper kernel may run `p`: f16/bf16 head dims that are multiples of 8 up to 256,
/// a padded batch, q, k, v that TMA can load, an output of 16-byte-aligned rows, fewer than 2^31
/// query tiles (the kernel numbers them in 32 bits), and its tile's shared memory within
/// `max_shared`.
fn wgmma_path(p: &Problem, align: &Alignment, max_shared: usize) -> Option<WgmmaTile> {
    let half = matches!(p.dtype, DType::F16 | DType::BF16);
    let dims_ok = [p.head_dim, p.head_dim_v]
        .iter()
        .all(|&d| d % 8 == 0 && d <= WGMMA_MAX_HEAD_DIM);
    let out_aligned =
        align.strides[3].iter().all(|s| s % 8 == 0) && align.addresses[3].is_multiple_of(16);
    let [q, k, v, _] = align.addresses;
    if !(half && dims_ok && out_aligned) || qkv_layouts(p, [q, k, v]).is_none() {
        return None;
    }
    let tile = wgmma_tile(
        round_up(p.head_dim, 64),
        round_up(p.head_dim_v, 64),
        Hints::of(p),
    );
    (tile.shared_bytes() <= max_shared && tile.tiles(p) <= i32::MAX as usize).then_some(tile)
}

/// The kernel and tile for `p`. On Hopper (`hopper`: an sm_90a device with the Hopper forward
/// switched on) the wgmma kernel takes what [`wgmma_path`] allows. The tensor-core kernel needs
/// f16/bf16, head dims that are multiples of 8 up to 256, and rows that start on 16-byte
/// boundaries; everything else runs on the CUDA-core kernel.
pub(crate) fn choose(p: &Problem, align: &Alignment, max_shared: usize, hopper: bool) -> Path {
    if hopper && let Some(tile) = wgmma_path(p, align, max_shared) {
        return Path::Wgmma(tile);
    }
    let half = matches!(p.dtype, DType::F16 | DType::BF16);
    let dims_ok = [p.head_dim, p.head_dim_v]
        .iter()
        .all(|&d| d % 8 == 0 && d <= MMA_MAX_HEAD_DIM);
    let aligned = align.strides.iter().flatten().all(|s| s % 8 == 0)
        && align.addresses.iter().all(|a| a % 16 == 0);
    if half && dims_ok && aligned {
        let hints = Hints::of(p);
        let tile = mma_tile(
            round_up(p.head_dim, 32),
            round_up(p.head_dim_v, 32),
            hints,
            max_shared,
        );
        if tile.shared_bytes() <= max_shared {
            return Path::Mma(tile);
        }
    }
    Path::General(general_tile(p.head_dim, p.head_dim_v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::AttentionParams;
    use crate::problem::RowLayout;
    use crate::tensor::Tensor;

    #[test]
    fn tiles_fit_ampere_and_hopper() {
        for dqk in (32..=256).step_by(32) {
            for dv in (32..=256).step_by(32) {
                for max in [99 * 1024, 163 * 1024, 227 * 1024] {
                    for (t, h) in all_mma_tiles(dqk, dv) {
                        let t = if t.shared_bytes() <= max {
                            t
                        } else {
                            mma_tile(dqk, dv, h, max)
                        };
                        assert!(t.shared_bytes() <= max, "{t:?} at {max}");
                        assert_eq!(t.br % (16 * t.warps), 0);
                        assert_eq!(t.bc % 16, 0);
                    }
                }
            }
        }
        for d in [1, 8, 64, 100, 128, 129, 257, 512] {
            assert!(general_tile(d, d).shared_bytes() <= 99 * 1024);
        }
    }

    #[test]
    fn wgmma_tiles_fit_hopper() {
        for dqk in (64..=256).step_by(64) {
            for dv in (64..=256).step_by(64) {
                for score_mods in [false, true] {
                    let t = wgmma_tile(dqk, dv, Hints { score_mods });
                    assert!(t.shared_bytes() <= 227 * 1024, "{t:?}");
                    assert_eq!(t.br, 64 * t.nwg);
                    // A wgmma N of 8..=256 in steps of 8; P.V takes k16 steps.
                    assert!(
                        t.bc.is_multiple_of(16) && t.bc <= 256 && t.br <= 256,
                        "{t:?}"
                    );
                }
            }
        }
    }

    /// A `[b, nq, h, d]` / `[b, nk, hk, dv]` problem of CPU tensors in `dtype`.
    fn problem(
        dtype: DType,
        [b, nq, nk, h, hk, d, dv]: [usize; 7],
        params: &AttentionParams,
    ) -> Problem {
        let t = |shape: &[usize]| {
            let n = shape.iter().product();
            Tensor::from_vec(vec![0.5f32; n], shape)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let (q, k, v) = (t(&[b, nq, h, d]), t(&[b, nk, hk, d]), t(&[b, nk, hk, dv]));
        Problem::new(&q, &k, &v, params).unwrap()
    }

    /// The alignment of `p` with a contiguous output and every operand at a 4 KiB boundary.
    fn aligned(p: &Problem) -> Alignment {
        let dv = p.head_dim_v;
        let o = [p.max_nq * p.heads_q * dv, p.heads_q * dv, dv];
        let s = |l: &RowLayout| [l.batch, l.row, l.head];
        Alignment {
            strides: [s(&p.q), s(&p.k), s(&p.v), o],
            addresses: [0x1000, 0x2000, 0x3000, 0x4000],
        }
    }

    const HOPPER_SHARED: usize = 227 * 1024;

    fn pick(p: &Problem, hopper: bool) -> Path {
        choose(p, &aligned(p), HOPPER_SHARED, hopper)
    }

    #[test]
    fn hopper_takes_half_head_dims_up_to_256() {
        let params = AttentionParams::default().causal().softcap(20.0);
        for (dtype, d, dv, want) in [
            (DType::BF16, 128, 64, Some((128, 64))),
            (DType::F16, 64, 128, Some((64, 128))),
            (DType::BF16, 80, 80, Some((128, 128))),
            (DType::F16, 8, 8, Some((64, 64))),
            (DType::BF16, 136, 64, Some((192, 64))),
            (DType::F16, 256, 200, Some((256, 256))),
            (DType::BF16, 264, 64, None),
            (DType::BF16, 36, 36, None),
            (DType::F32, 64, 64, None),
        ] {
            let p = problem(dtype, [2, 65, 200, 4, 2, d, dv], &params);
            let got = pick(&p, true);
            match want {
                Some((dqk, dv)) => {
                    let hints = Hints { score_mods: true };
                    assert_eq!(got, Path::Wgmma(wgmma_tile(dqk, dv, hints)), "{dtype} {d}");
                }
                None => assert!(!matches!(got, Path::Wgmma(_)), "{dtype} {d}: {got:?}"),
            }
            // Off Hopper (or switched off): today's choice.
            assert!(!matches!(pick(&p, false), Path::Wgmma(_)));
        }
    }

    #[test]
    fn hopper_falls_back_where_tma_cannot_load() {
        let full = AttentionParams::default();
        let p = problem(DType::BF16, [2, 65, 200, 4, 2, 64, 64], &full);
        assert!(matches!(pick(&p, true), Path::Wgmma(_)));
        // Broadcast key heads (stride 0 along a dimension of 2): the tensor-core kernel.
        let mut broadcast = p.clone();
        broadcast.k.head = 0;
        assert!(matches!(pick(&broadcast, true), Path::Mma(_)));
        // A misaligned output, too little shared memory, no keys, a packed batch.
        let mut a = aligned(&p);
        a.addresses[3] += 8;
        assert!(matches!(
            choose(&p, &a, HOPPER_SHARED, true),
            Path::General(_)
        ));
        assert!(matches!(
            choose(&p, &aligned(&p), 64 * 1024, true),
            Path::Mma(_)
        ));
        let empty = problem(DType::BF16, [1, 9, 0, 1, 1, 64, 64], &full);
        assert!(!matches!(pick(&empty, true), Path::Wgmma(_)));
        let cu = vec![0, 5, 9];
        let q = Tensor::from_vec(vec![0.5f32; 9 * 64], &[9, 1, 64]).unwrap();
        let q = q.to_dtype(DType::BF16).unwrap();
        let packed = Problem::new(&q, &q, &q, &full.clone().varlen(cu.clone(), cu)).unwrap();
        assert!(matches!(pick(&packed, true), Path::Mma(_)));
        // One query row with an odd row stride (a size-1 dimension's stride is never used).
        let mut decode = problem(DType::F16, [3, 1, 300, 8, 8, 128, 128], &full);
        decode.q.row = 3;
        assert!(matches!(pick(&decode, true), Path::Wgmma(_)));
        assert!(matches!(pick(&decode, false), Path::General(_)));
    }
}
