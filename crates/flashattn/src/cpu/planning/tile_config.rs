//! Tile sizes of the CPU forward, as a pure function of the head dimensions, the operands'
//! strides and the size of a core's L2.

use std::sync::OnceLock;

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
    /// Rows packed or converted to f32 (`pack_kv`, or f16/bf16 inputs) stay with the thread
    /// for its next task on the same head: a head's K and V take at most [`KEPT_HEAD_BYTES`].
    pub keep_kv: bool,
}

/// The most queries a forward task takes.
pub(crate) const MAX_BLOCK_Q: usize = 512;

/// The per-core L2 size assumed where the CPU does not report one (1 MiB, the L2 on which the
/// rules below were first measured).
const DEFAULT_L2_BYTES: usize = 1 << 20;

/// The most bytes of one head's converted or packed K and V rows a thread keeps for its next
/// task on that head, rather than every task of the head copying them again (see
/// BENCHMARKS.md).
const KEPT_HEAD_BYTES: usize = 2 << 20;

/// Tiles for head dims `d` (Q, K) and `dv` (V), at most `nk` keys per sequence of which one
/// task's queries see at most `span` (a bounded window's width and a task, else `nk`), K and V
/// rows `kv_strides` elements apart and f32 or not (`f32_inputs`), `rows_per_thread` query
/// rows (over all heads and sequences) per rayon thread, and a per-core L2 of `l2` bytes
/// ([`l2_bytes`]). Every rule reads the L2's size, none the CPU's make (see BENCHMARKS.md for
/// the measurements behind each):
///
/// * The key block takes 512 keys, or fewer where its rows of K and V would pass the L2, which
///   each of the task's panel pairs passes over it from: longer blocks cost fewer online-softmax
///   steps as long as they stay in L2.
/// * Tasks take 128 queries and read f32 K and V in place while the keys a task sees fit in the
///   L2 and their rows do not alias in L1 ([`aliases_in_l1`]); otherwise (and for f16/bf16,
///   whose key blocks every task converts) 512 queries, four times fewer streams of K and V,
///   but only when every thread gets at least four such tasks.
/// * Strided K and V rows (`[B, N, H, D]`) are copied into packed rows when the keys a task
///   sees pass the L2, or, on a core with less than 1 MiB of L2, the share of its sets that
///   the rows' lines fall into (rows `s` floats apart of which `d` are read: about `d / s`).
///   A 1 MiB L2 read such rows faster in place.
pub(crate) fn forward_tiles(
    d: usize,
    dv: usize,
    (nk, span): (usize, usize),
    (kv_strides, f32_inputs): ([usize; 2], bool),
    rows_per_thread: usize,
    l2: usize,
) -> ForwardTiles {
    let key_floats = l2 / size_of::<f32>();
    let block_k = (key_floats / (d + dv)).clamp(32, 512);
    let bytes = |keys: usize| keys.saturating_mul(d + dv).saturating_mul(size_of::<f32>());
    let head_bytes = bytes(nk);
    // The keys and values one task sees.
    let seen = bytes(span.min(nk));
    let long = seen >= l2;
    let aliases = kv_strides.iter().any(|&s| aliases_in_l1(s));
    let strided = kv_strides.iter().any(|&s| s > d.max(dv));
    // Rows `s` floats apart of which `w` are read fall into about `w / s` of the L2's sets; on a
    // core with less than 1 MiB of L2 the keys a task sees are copied when they do not fit there.
    let strided_l2 = kv_strides
        .iter()
        .zip([d, dv])
        .map(|(&s, w)| l2 / (s / w.max(1)).max(1))
        .fold(l2, usize::min);
    let crowded = l2 < DEFAULT_L2_BYTES && seen > strided_l2;
    // f16/bf16 key rows are converted to f32 by every task, or by every thread for heads it
    // keeps (see `forward`).
    let big = (long || aliases || !f32_inputs) && rows_per_thread >= 4 * 512;
    ForwardTiles {
        block_q: if big { MAX_BLOCK_Q } else { 128 },
        block_k,
        pack_kv: aliases || (strided && (long || crowded)),
        keep_kv: head_bytes <= KEPT_HEAD_BYTES,
    }
}

/// The L2 cache of one core, in bytes: `cpuid` leaf 0x8000_0006 (which AMD and Intel cores
/// both answer), else [`DEFAULT_L2_BYTES`].
pub(crate) fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            if __cpuid(0x8000_0000).eax >= 0x8000_0006 {
                let kib = (__cpuid(0x8000_0006).ecx >> 16) as usize;
                if kib > 0 {
                    return kib << 10;
                }
            }
        }
        DEFAULT_L2_BYTES
    })
}

/// True when rows `stride` f32 apart all fall into the same few sets of the L1 data cache (64
/// sets of 64 bytes: a 4 KiB period), so a key block read in place keeps evicting itself (see
/// BENCHMARKS.md: rows 4 and 8 KiB apart ran faster copied, 1 and 2 KiB in place).
fn aliases_in_l1(stride: usize) -> bool {
    stride > 0 && (stride * std::mem::size_of::<f32>()).is_multiple_of(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plenty of query rows per thread.
    const MANY: usize = 1 << 20;

    /// The L2 the rules were first measured with.
    const L2: usize = DEFAULT_L2_BYTES;

    /// [`forward_tiles`] with a 1 MiB L2.
    fn tiles(
        d: usize,
        dv: usize,
        keys: (usize, usize),
        rows: ([usize; 2], bool),
        per_thread: usize,
    ) -> ForwardTiles {
        forward_tiles(d, dv, keys, rows, per_thread, L2)
    }

    #[test]
    fn tiles_shrink_with_the_head_dim() {
        assert_eq!(
            tiles(64, 64, (1024, 1024), ([512; 2], true), MANY).block_k,
            512
        );
        assert_eq!(
            tiles(512, 512, (1024, 1024), ([512; 2], true), MANY).block_k,
            256
        );
        for d in [1, 8, 80, 96, 512] {
            let t = tiles(d, d, (1024, 1024), ([d; 2], true), MANY);
            assert!(t.block_k * (2 * d) * 4 <= L2, "d = {d}");
        }
    }

    #[test]
    fn long_heads_take_bigger_query_blocks_and_pack_interleaved_rows() {
        // [B, N, H, D] with H = 8, D = 64: rows 512 apart.
        let short = tiles(64, 64, (1024, 1024), ([512; 2], true), MANY);
        assert_eq!((short.block_q, short.pack_kv), (128, false));
        let long = tiles(64, 64, (16384, 16384), ([512; 2], true), MANY);
        assert_eq!((long.block_q, long.pack_kv), (512, true));
        // [B, H, N, D]: rows already packed.
        let packed = tiles(64, 64, (16384, 16384), ([64; 2], true), MANY);
        assert_eq!((packed.block_q, packed.pack_kv), (512, false));
        // A window of 256 keys on a long head: what a task sees fits, but the head is too
        // long to keep.
        let window = tiles(64, 64, (16384, 256 + 512 + 1), ([512; 2], true), MANY);
        assert_eq!(
            (window.block_q, window.pack_kv, window.keep_kv),
            (128, false, false)
        );
    }

    #[test]
    fn a_head_that_fills_a_smaller_l2_is_long() {
        // K and V of 1024 keys at D = 64: 512 KiB, the whole L2 of a Zen 1 core.
        let small = 512 << 10;
        let t = forward_tiles(64, 64, (1024, 1024), ([512; 2], true), MANY, small);
        assert_eq!((t.block_q, t.block_k, t.pack_kv), (512, 512, true));
    }

    #[test]
    fn a_smaller_l2_packs_strided_rows_that_crowd_its_sets() {
        let on = |l2: usize, n: usize, stride: usize| {
            let rows = ([stride; 2], true);
            forward_tiles(64, 64, (n, n), rows, MANY, l2)
        };
        let small = 512 << 10;
        // H = 8 (rows 512 floats apart, an eighth of the sets): 64 KiB of K and V fit.
        assert!(!on(small, 128, 512).pack_kv);
        let t = on(small, 256, 512);
        assert_eq!((t.block_q, t.pack_kv, t.keep_kv), (128, true, true));
        // H = 4 (a quarter of the sets): 128 KiB fit.
        assert!(!on(small, 256, 256).pack_kv);
        assert!(on(small, 512, 256).pack_kv);
        // Rows one after the other, and a 1 MiB L2: read in place.
        assert!(!on(small, 512, 64).pack_kv);
        assert!(!on(L2, 512, 512).pack_kv);
    }

    #[test]
    fn the_l2_is_read_from_the_cpu() {
        let l2 = l2_bytes();
        assert!((64 << 10..=1 << 30).contains(&l2), "{l2}");
    }

    #[test]
    fn rows_aliasing_in_l1_are_packed_by_bigger_tasks_unless_threads_would_idle() {
        // H = 32, D = 64: rows 8 KiB apart; and V alone aliasing.
        for strides in [[2048, 2048], [512, 1024]] {
            let t = tiles(64, 64, (1024, 1024), (strides, true), MANY);
            assert_eq!((t.block_q, t.pack_kv), (512, true), "{strides:?}");
        }
        // Fewer than four 512-query tasks a thread: 128-query tasks, still packed.
        let few = tiles(64, 64, (1024, 1024), ([2048; 2], true), 1024);
        assert_eq!((few.block_q, few.pack_kv), (128, true));
        let long_few = tiles(64, 64, (16384, 16384), ([512; 2], true), 1024);
        assert_eq!((long_few.block_q, long_few.pack_kv), (128, true));
        // f16/bf16: converted per block anyway, so bigger tasks (not "packed": converted).
        let half = tiles(64, 64, (1024, 1024), ([512; 2], false), MANY);
        assert_eq!((half.block_q, half.pack_kv), (512, false));
    }
}
