//! The backward's tile table: which kernel runs, which keys a block owns and how many query rows
//! pass by at a time, per padded head dim, as plain functions of the head dims and the
//! shared-memory limit. f16/bf16 with head dims that are multiples of 8 up to
//! [`MMA_BWD_MAX_HEAD_DIM`] and 16-byte-aligned rows run on the tensor-core kernel; the rest on the
//! CUDA-core kernel.
//!
//! CUDA-core kernel (`kernels/flash_bwd_general.cu`, 128 threads), keys × query rows:
//! - D ≤ 64: 64 × 64 (each thread keeps 32 + 32 f32 of dK/dV: 2 threads a key).
//! - D ≤ 128: 32 × 32 (4 threads a key: 32 + 32 f32).
//! - D ≤ 256: 16 × 16 (8 threads a key: 32 + 32 f32).
//! - D ≤ 512: 16 × 8 (8 threads a key: 64 + 64 f32; 8 query rows keep dQ's share at 32).
//! - Where a tile's shared memory (K, V, Q, dO as f32, P and dS) does not fit: the next smaller
//!   one listed for that head dim.

/// Tensor-core kernel (`kernels/flash_bwd_mma.cu`, f16/bf16, 4 warps, 16 keys a warp: 64 keys a
/// block), query rows a step:
/// - D ≤ 64: 64 (a warp keeps 32 + 32 f32 of dK/dV and 32 + 32 of Sᵀ, dPᵀ).
/// - D ≤ 128: 32 (64 + 64 f32 of dK/dV; Sᵀ, dPᵀ 16 + 16).
/// - D > 128: the CUDA-core kernel (dK and dV of 16 keys no longer fit a warp's registers).
pub(crate) const MMA_BWD_MAX_HEAD_DIM: usize = 128;

/// Warps per block of the tensor-core backward kernel.
pub(crate) const MMA_BWD_WARPS: usize = 4;

/// A tile of the tensor-core backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MmaBwdTile {
    /// Head dims padded to a multiple of 16 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Query rows per step.
    pub rows: usize,
}

impl MmaBwdTile {
    /// Keys per block.
    pub(crate) fn keys(&self) -> usize {
        16 * MMA_BWD_WARPS
    }

    /// Dynamic shared memory: K, V, two Q and dO buffers, dS (16-bit, rows padded by 8), LSE and
    /// D (f32).
    pub(crate) fn shared_bytes(&self) -> usize {
        let (pqk, pv, ps) = (self.dqk + 8, self.dv + 8, self.keys() + 8);
        2 * ((self.keys() + 2 * self.rows) * (pqk + pv) + self.rows * ps) + 8 * self.rows
    }
}

/// The tensor-core tile for head dims `dqk`, `dv` (at most [`MMA_BWD_MAX_HEAD_DIM`]).
pub(crate) fn mma_bwd_tile(dqk: usize, dv: usize) -> MmaBwdTile {
    let (dqk, dv) = (padded(dqk), padded(dv));
    let rows = if dqk.max(dv) <= 64 { 64 } else { 32 };
    MmaBwdTile { dqk, dv, rows }
}

/// Hopper kernels (sm_90a, f16/bf16, a producer warp and two consumer warpgroups, 64 query rows a
/// step, head dims up to [`WGMMA_BWD_MAX_HEAD_DIM`]; in the narrow kernel a softcap or a
/// relative-position table only up to [`WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM`], as their code spills at
/// 128, while the wide kernel, with a quarter of the scores a thread, takes them):
/// - head dims up to [`WGMMA_BWD_NARROW_MAX`] (`kernels/flash_bwd_wgmma.cu`): 128 keys a block,
///   64 a warpgroup; head dims padded to 64.
/// - above (`kernels/flash_bwd_wgmma_wide.cu`): 64 keys a block, the warpgroups splitting the head
///   dims (dK and dV of 128 keys would not fit their registers); head dims padded to 128, so each
///   half is whole 64-column blocks (192 runs as 256).
pub(crate) const WGMMA_BWD_MAX_HEAD_DIM: usize = 256;
pub(crate) const WGMMA_BWD_NARROW_MAX: usize = 128;
pub(crate) const WGMMA_BWD_SOFTCAP_MAX_HEAD_DIM: usize = 64;
/// Threads and query rows a step of the Hopper kernels' blocks.
pub(crate) const WGMMA_BWD_THREADS: usize = 384;
pub(crate) const WGMMA_BWD_ROWS: usize = 64;

/// A tile of the Hopper backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WgmmaBwdTile {
    /// Head dims padded (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Slots of the Q/dO ring (the wide kernel: of Q's ring).
    pub stages: usize,
    /// Slots of the wide kernel's dO ring (the narrow kernel: `stages`).
    pub do_stages: usize,
}

impl WgmmaBwdTile {
    /// Whether this is the wide kernel's tile.
    pub(crate) fn wide(&self) -> bool {
        self.dqk.max(self.dv) > WGMMA_BWD_NARROW_MAX
    }

    /// Keys per block.
    pub(crate) fn keys(&self) -> usize {
        if self.wide() { 64 } else { 128 }
    }

    /// Dynamic shared memory (`WGMMA_BWD_SMEM` of the kernels): 1024 for alignment, K and V, the
    /// rings of Q and of dO with its rows' LSE and D, then the narrow kernel's dSᵀ (16-bit) and dQ
    /// f32 tiles (one shared at head dim 128, one a warpgroup below), or the wide kernel's Pᵀ and
    /// dSᵀ twice and a dQ tile of 64 columns a warpgroup; the mbarriers.
    pub(crate) fn shared_bytes(&self) -> usize {
        let (keys, rows) = (self.keys(), WGMMA_BWD_ROWS);
        let q_ring = self.stages * 2 * rows * self.dqk;
        let do_ring = self.do_stages * (2 * rows * self.dv + 8 * rows);
        let kv = 1024 + 2 * keys * (self.dqk + self.dv) + q_ring + do_ring;
        let barriers = 8 * (1 + 2 * (self.stages + self.do_stages));
        if self.wide() {
            // Pᵀ, dSᵀ twice; a 64-column f32 dQ tile a warpgroup.
            kv + 4 * 2 * keys * rows + 2 * 4 * rows * 64 + barriers
        } else {
            let dq_tiles = if self.dqk >= 128 { 1 } else { 2 };
            kv + 2 * keys * rows + dq_tiles * 4 * rows * self.dqk + barriers
        }
    }
}

/// The H100/H200's shared memory a block (227 KiB), which the Hopper tiles are sized for.
const HOPPER_SHARED: usize = 227 * 1024;

/// The Hopper tile for head dims `dqk`, `dv` (at most [`WGMMA_BWD_MAX_HEAD_DIM`]): two ring slots
/// each, but one dO slot in the wide kernel at head dims 256 (all that fits beside two Q slots).
pub(crate) fn wgmma_bwd_tile(dqk: usize, dv: usize) -> WgmmaBwdTile {
    let step = if dqk.max(dv) > WGMMA_BWD_NARROW_MAX {
        128
    } else {
        64
    };
    let pad = |d: usize| d.max(1).div_ceil(step) * step;
    let tile = |do_stages| WgmmaBwdTile {
        dqk: pad(dqk),
        dv: pad(dv),
        stages: 2,
        do_stages,
    };
    let two = tile(2);
    if two.shared_bytes() <= HOPPER_SHARED {
        two
    } else {
        tile(1)
    }
}

/// Threads per block of the CUDA-core backward kernel.
pub(crate) const GENERAL_BWD_THREADS: usize = 128;

/// A tile of the CUDA-core backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GeneralBwdTile {
    /// Head dims padded to a multiple of 16 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Keys per block.
    pub keys: usize,
    /// Query rows per step.
    pub rows: usize,
}

impl GeneralBwdTile {
    /// Dynamic shared memory: K, V, Q, dO (f32, rows one element wider), P and dS, LSE and D.
    pub(crate) fn shared_bytes(&self) -> usize {
        let (pqk, pv) = (self.dqk + 1, self.dv + 1);
        4 * (self.keys * (pqk + pv)
            + self.rows * (pqk + pv)
            + 2 * self.rows * self.keys
            + 2 * self.rows)
    }
}

/// `n` rounded up to a multiple of 16 (at least 16).
fn padded(n: usize) -> usize {
    n.max(1).div_ceil(16) * 16
}

/// The (keys, rows) tiles for a padded head dim, preferred first.
fn candidates(dmax: usize) -> &'static [(usize, usize)] {
    match dmax {
        0..=64 => &[(64, 64), (32, 32)],
        65..=128 => &[(32, 32), (16, 16)],
        129..=256 => &[(16, 16), (8, 8)],
        _ => &[(16, 8), (8, 8)],
    }
}

/// The tile for head dims `dqk`, `dv` on a device allowing `max_shared` bytes a block: the
/// preferred one that fits, else the smallest listed (whose launch then reports the limit).
pub(crate) fn general_bwd_tile(dqk: usize, dv: usize, max_shared: usize) -> GeneralBwdTile {
    let (dqk, dv) = (padded(dqk), padded(dv));
    let tile = |&(keys, rows): &(usize, usize)| GeneralBwdTile {
        dqk,
        dv,
        keys,
        rows,
    };
    let all = candidates(dqk.max(dv));
    all.iter()
        .map(tile)
        .find(|t| t.shared_bytes() <= max_shared)
        .unwrap_or_else(|| tile(all.last().expect("every head dim lists a tile")))
}

/// Every tile [`general_bwd_tile`] can pick for these head dims.
pub(crate) fn all_general_bwd_tiles(dqk: usize, dv: usize) -> Vec<GeneralBwdTile> {
    let (dqk, dv) = (padded(dqk), padded(dv));
    candidates(dqk.max(dv))
        .iter()
        .map(|&(keys, rows)| GeneralBwdTile {
            dqk,
            dv,
            keys,
            rows,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Hopper tiles fit the H100/H200's 227 KiB, pad to whole 64-column blocks (whole halves
    /// of them in the wide kernel) and keep two dO slots wherever they fit.
    #[test]
    fn wgmma_tiles_fit() {
        for d in (8..=WGMMA_BWD_MAX_HEAD_DIM).step_by(8) {
            for dv in [8, d, WGMMA_BWD_MAX_HEAD_DIM] {
                let t = wgmma_bwd_tile(d, dv);
                assert!(t.shared_bytes() <= HOPPER_SHARED, "{t:?}");
                let block = if t.wide() { 128 } else { 64 };
                assert!(
                    t.dqk.is_multiple_of(block) && t.dv.is_multiple_of(block),
                    "{t:?}"
                );
                assert!(t.dqk >= d && t.dv >= dv, "{t:?}");
                assert_eq!(t.wide(), d.max(dv) > WGMMA_BWD_NARROW_MAX, "{t:?}");
                let two = WgmmaBwdTile { do_stages: 2, ..t };
                assert_eq!(
                    t.do_stages == 2,
                    two.shared_bytes() <= HOPPER_SHARED,
                    "{t:?}"
                );
                assert!(t.stages == 2 && (t.wide() || t.do_stages == 2), "{t:?}");
            }
        }
        assert_eq!(wgmma_bwd_tile(256, 256).do_stages, 1);
        assert_eq!(wgmma_bwd_tile(128, 256).do_stages, 2);
    }

    /// The tensor-core tiles fit 99 KiB and split dQ's 16-row slices evenly among the warps.
    #[test]
    fn mma_tiles_fit_and_share_dq_evenly() {
        for d in (8..=MMA_BWD_MAX_HEAD_DIM).step_by(8) {
            for dv in [8, d, MMA_BWD_MAX_HEAD_DIM] {
                let t = mma_bwd_tile(d, dv);
                assert!(t.shared_bytes() <= 99 * 1024, "{t:?}");
                assert_eq!(t.rows % 16, 0);
                assert_eq!(MMA_BWD_WARPS % (t.rows / 16), 0, "{t:?}");
            }
        }
    }

    /// Every head dim up to 512 gets a tile that fits 99 KiB (sm_86/89) and divides the block's
    /// threads evenly among its keys and rows and their columns.
    #[test]
    fn every_head_dim_fits_the_smallest_parts() {
        for d in 1..=512 {
            for dv in [1, d, 64, 512] {
                let t = general_bwd_tile(d, dv, 99 * 1024);
                assert!(t.shared_bytes() <= 99 * 1024, "d {d} dv {dv}: {t:?}");
                let (tpk, tpr) = (GENERAL_BWD_THREADS / t.keys, GENERAL_BWD_THREADS / t.rows);
                assert_eq!(tpk * t.keys, GENERAL_BWD_THREADS);
                assert_eq!(tpr * t.rows, GENERAL_BWD_THREADS);
                for w in [t.dqk, t.dv] {
                    assert_eq!((w % tpk, w % tpr), (0, 0), "d {d} dv {dv}: {t:?}");
                }
            }
        }
    }
}
