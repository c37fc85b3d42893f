//! Which kernel and which tile shape a problem runs with: pure functions of head dims, dtype,
//! strides and the device's shared-memory limit, so they can be read (and tested) apart from the
//! kernels.
//!
//! Measured on an NVIDIA H100 80GB HBM3 (sm_90a), 2026-11-22, bf16, batch·N = 16384,
//! heads·D = 2048, by `kernels/harness.py bench` (TFLOP/s at N = 2048 / 8192, non-causal; every
//! variant and shape is in kernels/README.md):
//! - D = 64: Br×Bc = 128×64 with 4 warps (two 16-row slices per warp, Q in registers) 269 / 263;
//!   128×128 / 4 warps 238 / 243 (spills); 128×64 / 8 warps 201 / 229; 64×64 / 4 warps 173 / 200.
//! - D = 128: 128×64 / 4 warps (Q re-read from shared memory) 264 / 265; 128×32 / 4 warps
//!   239 / 259; 128×64 / 8 warps 240 / 266; 64×64 / 4 warps 186 / 223.
//!
//! Two 16-row slices per warp halve the shared-memory reads of K and V per tensor-core
//! instruction; at one slice per warp the ldmatrix traffic (256 bytes per m16n8k16) exceeds the
//! 128 B/clock of shared memory before the tensor cores are busy.

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

/// A tile shape of the CUDA-core kernel (`kernels/flash_fwd_general.cu`): 16 query rows per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GeneralTile {
    /// Head dims rounded up to a multiple of 32 (Q/K, V).
    pub dqk: usize,
    pub dv: usize,
    /// Keys per K/V block.
    pub bc: usize,
}

/// Query rows per block of the CUDA-core kernel.
pub(crate) const GENERAL_ROWS: usize = 16;
/// Threads per block of the CUDA-core kernel.
pub(crate) const GENERAL_THREADS: usize = 128;

impl GeneralTile {
    /// Dynamic shared memory (f32): Q and K with odd pitch, V, and P.
    pub(crate) fn shared_bytes(&self) -> usize {
        4 * (GENERAL_ROWS * (self.dqk + 1)
            + self.bc * (self.dqk + 1)
            + self.bc * self.dv
            + GENERAL_ROWS * self.bc)
    }
}

/// The kernel a problem runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Path {
    Mma(MmaTile),
    General(GeneralTile),
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// The tensor-core tile for padded head dims `dqk`, `dv` (multiples of 32, at most 256), within
/// `max_shared` bytes of shared memory per block.
pub(crate) fn mma_tile(dqk: usize, dv: usize, max_shared: usize) -> MmaTile {
    let d = dqk.max(dv);
    let preferred = if d <= 64 {
        MmaTile {
            dqk,
            dv,
            br: 128,
            bc: 64,
            warps: 4,
            q_in_regs: true,
            min_blocks: 2,
        }
    } else if d <= 128 {
        MmaTile {
            dqk,
            dv,
            br: 128,
            bc: 64,
            warps: 4,
            q_in_regs: false,
            min_blocks: 1,
        }
    } else {
        MmaTile {
            dqk,
            dv,
            br: 64,
            bc: 32,
            warps: 4,
            q_in_regs: false,
            min_blocks: 1,
        }
    };
    if preferred.shared_bytes() <= max_shared {
        return preferred;
    }
    // Smaller parts (sm_86/89: 99 KB per block): one 16-row slice per warp, 32-key blocks.
    MmaTile {
        dqk,
        dv,
        br: 64,
        bc: 32,
        warps: 4,
        q_in_regs: false,
        min_blocks: 1,
    }
}

/// The CUDA-core tile for head dims `dqk`, `dv` (1..=512).
pub(crate) fn general_tile(dqk: usize, dv: usize) -> GeneralTile {
    let (dqk, dv) = (round_up(dqk, 32), round_up(dv, 32));
    GeneralTile {
        dqk,
        dv,
        bc: if dqk.max(dv) <= 256 { 32 } else { 16 },
    }
}

/// Element strides and first-element addresses of q, k, v, to decide whether 16-byte copies work.
pub(crate) struct Alignment {
    /// Every stride (batch, row, head) of q, k and v, in elements.
    pub strides: Vec<usize>,
    /// The device address of each operand's first element.
    pub addresses: Vec<u64>,
}

/// The kernel and tile for `p`. The tensor-core kernel needs f16/bf16, head dims that are
/// multiples of 8 up to 256, and rows that start on 16-byte boundaries; everything else runs on
/// the CUDA-core kernel.
pub(crate) fn choose(p: &Problem, align: &Alignment, max_shared: usize) -> Path {
    let half = matches!(p.dtype, DType::F16 | DType::BF16);
    let dims_ok = [p.head_dim, p.head_dim_v]
        .iter()
        .all(|&d| d % 8 == 0 && d <= MMA_MAX_HEAD_DIM);
    let aligned =
        align.strides.iter().all(|s| s % 8 == 0) && align.addresses.iter().all(|a| a % 16 == 0);
    if half && dims_ok && aligned {
        let tile = mma_tile(
            round_up(p.head_dim, 32),
            round_up(p.head_dim_v, 32),
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

    #[test]
    fn tiles_fit_ampere_and_hopper() {
        for dqk in (32..=256).step_by(32) {
            for dv in (32..=256).step_by(32) {
                for max in [99 * 1024, 163 * 1024, 227 * 1024] {
                    let t = mma_tile(dqk, dv, max);
                    assert!(t.shared_bytes() <= max, "{t:?} at {max}");
                    assert_eq!(t.br % (16 * t.warps), 0);
                    assert_eq!(t.bc % 16, 0);
                }
            }
        }
        for d in [1, 8, 100, 257, 512] {
            assert!(general_tile(d, d).shared_bytes() <= 99 * 1024);
        }
    }
}
