//! Tile sizes of the CPU forward, as a pure function of the head dimensions.

/// How the forward cuts one (sequence, head) into tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ForwardTiles {
    /// Query rows per task (Br, a multiple of the 16-query panel): their Qᵀ and Oᵀ panels stay
    /// in cache while the task walks the keys.
    pub block_q: usize,
    /// Keys per block (Bc): one score panel, one exp pass and at most one rescale per query.
    pub block_k: usize,
}

/// Tiles for head dims `d` (Q, K) and `dv` (V).
///
/// The key block (`block_k` rows of K and V, `block_k · (d + dv) · 4` bytes, read in place or
/// converted once) is kept near 128 KiB so it stays in the 1 MiB L2 of a core while each of the
/// task's panels passes over it; the score panel (`block_k × 16`, 16 KiB at D=64) stays in L1.
///
/// Measured on the 2-core Zen 5 VM (AMD EPYC, 2026-11-22, AVX2 kernels), f32, B=1, H=8, D=64,
/// in GFLOP per CPU-second on 2 cores (noise about ±5): block_q 64 / 128 / 256 with block_k 256
/// gave 205 / 211 / 202 at N=1024 and 201 / 209 / 215 at N=4096, and 185 / 196 / 194 at N=1024
/// causal; block_k 512 (block_q 64) gave no gain (199, 205, 184). block_q = 128 is kept: fewer
/// tasks than 64 and less imbalance than 256 on short causal rows. Re-measured with the AVX-512
/// kernels (2026-11-23, % of the AVX-512 sgemm rate, A/B runs interleaved): block_q 256 within
/// the ±2-point noise of 128; block_k 128 1-4 points below 256 at every shape.
pub(crate) fn forward_tiles(d: usize, dv: usize) -> ForwardTiles {
    let key_floats = 32 * 1024;
    let block_k = (key_floats / (d + dv)).clamp(32, 256);
    ForwardTiles {
        block_q: 128,
        block_k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_shrink_with_the_head_dim() {
        assert_eq!(forward_tiles(64, 64).block_k, 256);
        assert!(forward_tiles(512, 512).block_k >= 32);
        for d in [1, 8, 80, 96, 512] {
            let t = forward_tiles(d, d);
            assert!(t.block_k * (2 * d) * 4 <= 256 * 1024 || t.block_k == 32);
        }
    }
}
