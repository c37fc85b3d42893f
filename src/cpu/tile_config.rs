//! Tile sizes of the CPU forward, as a pure function of the head dimensions.

/// How the forward cuts one (sequence, head) into tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ForwardTiles {
    /// Query rows per task (Br, a multiple of the 16-query panel): their Qᵀ and Oᵀ panels stay
    /// in cache while the task walks the keys.
    pub block_q: usize,
    /// Keys per block (Bc): one score panel, one exp pass and at most one rescale per query.
    pub block_k: usize,
    /// Copy each key block of K and V into packed rows even when they are f32 (see
    /// [`forward_tiles`]).
    pub pack_kv: bool,
}

/// The per-core L2 size the tiles are chosen for (1 MiB on the Zen 5 machines measured; larger
/// on most server CPUs, where the split below only moves to longer sequences).
const L2_BYTES: usize = 1 << 20;

/// Tiles for head dims `d` (Q, K) and `dv` (V), at most `nk` keys per sequence, and K and V
/// rows `kv_stride` elements apart (the larger of the two strides).
///
/// The key block (`block_k` rows of K and V, `block_k · (d + dv) · 4` bytes, read in place or
/// converted once) is kept near 128 KiB so it stays in the 1 MiB L2 of a core while each of the
/// task's panels passes over it; the score panels (`block_k × 16` each) stay near L1.
///
/// The query block depends on whether one head's keys and values fit in L2. If they do, tasks
/// of 128 queries read K and V in place: a head's rows stay in L2 (and its pages in the TLB)
/// from one task to the next. If they do not, every task streams its head's K and V again
/// through the caches and the TLB (rows `[B, N, H, D]`-interleaved touch a new 4 KiB page every
/// row or two), so tasks take 512 queries, four times fewer streams, and copy each key block
/// into packed rows once for all their panels.
///
/// Measured on the 2-core Zen 5 VM (AMD EPYC, 2026-11-22, AVX2 kernels), f32, B=1, H=8, D=64,
/// in GFLOP per CPU-second on 2 cores (noise about ±5): block_q 64 / 128 / 256 with block_k 256
/// gave 205 / 211 / 202 at N=1024 and 201 / 209 / 215 at N=4096, and 185 / 196 / 194 at N=1024
/// causal; block_k 512 (block_q 64) gave no gain (199, 205, 184). With the AVX-512 kernels
/// (2026-11-23, % of the AVX-512 sgemm rate, A/B runs interleaved): block_k 128 1-4 points below
/// 256 at every shape; at N=16384 (a head's K and V 8 MiB) block_q 128 in place gave 61-67%
/// full and 66-73% causal, copied 73-74%, block_q 512 in place 82-84%, block_q 512 copied
/// 89-93% and 88-95%; at N=4096 (2 MiB) block_q 512 copied gained 2-4 points, at N=1024
/// (512 KiB) it lost 3.
pub(crate) fn forward_tiles(d: usize, dv: usize, nk: usize, kv_stride: usize) -> ForwardTiles {
    let key_floats = 32 * 1024;
    let block_k = (key_floats / (d + dv)).clamp(32, 256);
    let head_bytes = nk.saturating_mul(d + dv).saturating_mul(size_of::<f32>());
    let streams = head_bytes > L2_BYTES;
    ForwardTiles {
        block_q: if streams { 512 } else { 128 },
        block_k,
        pack_kv: streams && kv_stride > d.max(dv),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_shrink_with_the_head_dim() {
        assert_eq!(forward_tiles(64, 64, 1024, 512).block_k, 256);
        assert!(forward_tiles(512, 512, 1024, 512).block_k >= 32);
        for d in [1, 8, 80, 96, 512] {
            let t = forward_tiles(d, d, 1024, d);
            assert!(t.block_k * (2 * d) * 4 <= 256 * 1024 || t.block_k == 32);
        }
    }

    #[test]
    fn long_heads_take_bigger_query_blocks_and_pack_interleaved_rows() {
        // [B, N, H, D] with H = 8, D = 64: rows 512 apart.
        let short = forward_tiles(64, 64, 1024, 512);
        assert_eq!((short.block_q, short.pack_kv), (128, false));
        let long = forward_tiles(64, 64, 16384, 512);
        assert_eq!((long.block_q, long.pack_kv), (512, true));
        // [B, H, N, D]: rows already packed.
        assert!(!forward_tiles(64, 64, 16384, 64).pack_kv);
    }
}
