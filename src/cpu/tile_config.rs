//! Tile sizes of the CPU forward, as a pure function of the head dimensions.

/// How the forward cuts one (sequence, head) into tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ForwardTiles {
    /// Query rows per task (Br): the rows whose Q tile and output accumulator stay in cache.
    pub block_q: usize,
    /// Keys per tile (Bc): the width of one score tile, one exp pass and one rescale per row.
    pub block_k: usize,
    /// Rows per strip in the tiles that cross a mask boundary: each strip multiplies only the
    /// keys it can see, so a causal diagonal tile wastes about `strip / 2` keys per row.
    pub strip: usize,
}

/// Tiles for head dims `d` (Q, K) and `dv` (V).
///
/// The key tile (Kᵀ and V packed as f32, `block_k · (d + dv) · 4` bytes) is kept near 128 KiB so
/// that it, the Q tile and the score tile fit in the 1 MiB L2 of one core together.
/// Measured with `cargo bench --bench attention` on the 2-core AVX2 VM (AMD EPYC, 2026-11-22),
/// f32, B=1, H=8, D=64: see BENCHMARKS.md.
pub(crate) fn forward_tiles(d: usize, dv: usize) -> ForwardTiles {
    let key_floats = 32 * 1024;
    // A multiple of 16 (two 8-lane vectors per exp step).
    let block_k = (key_floats / (d + dv)).clamp(32, 256) / 16 * 16;
    ForwardTiles {
        block_q: 64,
        block_k,
        strip: 16,
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
