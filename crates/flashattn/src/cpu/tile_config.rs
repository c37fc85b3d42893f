//! Tile sizes of the CPU forward, as a pure function of the head dimensions, the operands'
//! strides and the CPU's vendor.

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

/// The per-core L2 size assumed where the CPU does not report one (1 MiB, the Zen 4 and Zen 5
/// machines' L2, on which the rules below were first measured).
const DEFAULT_L2_BYTES: usize = 1 << 20;

/// The most bytes of one head's converted or packed K and V rows a thread keeps for its next
/// task on that head. Packed per task instead, every 512-query task of a head copied all its
/// rows again: f32, B=1, H=8, D=64, N=4096 (K and V 2 MiB a head), 2 threads, `flashattn bench`
/// GFLOP/s over three interleaved rounds, per task → kept: full 414–429 → 435–438, causal
/// 402–415 → 423–427; one thread full 214–219 → 225, causal 208 → 216–219 (2026-11-23).
const KEPT_HEAD_BYTES: usize = 2 << 20;

/// Tiles for head dims `d` (Q, K) and `dv` (V), at most `nk` keys per sequence of which one
/// task's queries see at most `span` (a bounded window's width and a task, else `nk`), K and V
/// rows `kv_strides` elements apart and f32 or not (`f32_inputs`), `rows_per_thread` query
/// rows (over all heads and sequences) per rayon thread, and a per-core L2 of `l2` bytes
/// ([`l2_bytes`]).
///
/// The key block takes 512 keys, or fewer where its rows of K and V (`block_k · (d + dv) · 4`
/// bytes, read in place or converted once) would pass the L2 of a core, which each of the
/// task's panel pairs passes over it from. Every block costs each panel an online-softmax step
/// and each pair its setup, so longer blocks are cheaper as long as they stay in L2. Measured on
/// the 2-core Zen 4 VM (2026-11-24, f32, B=1, H=8, N=1024, `[B, N, H, D]` unless noted; median
/// over 5-14 interleaved rounds of each rate over the old one in the same round), `block_k` from
/// the old rule (K and V near 128 KiB, at most 256) to this one, full / causal: D=32 256→512
/// 1.044 / 1.037; D=64 256→512 1.009-1.011 / 1.008-1.012 (1024: 0.994 / 1.006), at N=4096
/// 1.013 / 1.011, `[B, H, N, D]` 1.014 / 1.011 (N=4096 1.011 / 1.009), f16 inputs 1.079 / 1.028;
/// D=128 128→512 1.060 / 1.066 (256: 1.009 / 1.027); D=256 64→512 1.046 / 1.049 (256:
/// 1.038 / 1.040); D=512 32→256 1.057 / 1.081 (128: 1.059 / 1.070).
///
/// Tasks take 128 queries and read f32 K and V in place when the keys and values a task sees (a
/// head's, or a sliding window's) take less than the L2 and their rows do not alias in L1: a head's
/// rows stay in L2 (and its pages in the TLB) from one task to the next. Otherwise every task
/// streams its head's K and V through the caches again, or its in-place rows keep evicting each
/// other from L1, so tasks take 512 queries (four times fewer streams), and copy each key block
/// into packed rows once for all their panels when the rows are not packed already or alias.
/// f16/bf16 inputs, whose key blocks every task converts to f32, take 512-query tasks too. Tasks of
/// 512 queries only when every thread gets at least four of them: on many cores, more tasks beat
/// cheaper ones. Judged by a sliding window's keys rather than the whole head's (B=1, H=8, N=4096,
/// D=64, f32, 2 threads, windows of 128, 256, 512, 1024 and 2048 keys to the left, median over 8
/// interleaved rounds): 1.063×, 1.070×, 1.035×, 1.014× and 1.003× as fast (2026-11-24).
///
/// Measured on the 2-core Zen 5 VM (AMD EPYC, 2026-11-22, AVX2 kernels), f32, B=1, H=8, D=64,
/// in GFLOP per CPU-second on 2 cores (noise about ±5): block_q 64 / 128 / 256 with block_k 256
/// gave 205 / 211 / 202 at N=1024 and 201 / 209 / 215 at N=4096, and 185 / 196 / 194 at N=1024
/// causal; block_k 512 (block_q 64) gave no gain (199, 205, 184). With the AVX-512 kernels
/// (2026-11-23, % of the AVX-512 sgemm rate, A/B runs interleaved): block_k 128 1-4 points below
/// 256 at every shape; at N=16384 (a head's K and V 8 MiB) block_q 128 in place gave 61-67%
/// full and 66-73% causal, copied 73-74%, block_q 512 in place 82-84%, block_q 512 copied
/// 89-93% and 88-95%; at N=4096 (2 MiB) block_q 512 copied gained 2-4 points, at N=1024
/// (512 KiB) it lost 3. Aliasing rows (`[B, N, H, D]` with H·D·4 bytes a multiple of 4 KiB),
/// N=1024 and 2048, full and causal, GFLOP per CPU-second, 128-query tasks copying each block
/// → 512-query tasks: H=16 D=64 377→416, 318→360, 390→429, 347→399; H=32 D=64 364→407,
/// 307→353, 382→425, 330→390; H=32 D=128 404→438, 344→386 (N=2048 unchanged: already long);
/// H=8 D=128 429→455, 398→415; bf16 and f16 inputs (H=8, D=64, N=1024, wall clock), full
/// 328–369→415–420 and 329–359→384–397, causal 298–329→331–348 and 300–309→324–330
/// (2026-11-23).
///
/// On Intel cores ([`Vendor::Intel`]) K and V rows that are not packed already (`[B, N, H, D]`)
/// are copied whatever the sequence's length: measured on a 2-core Xeon VM with AVX-512 (two
/// 512-bit FMA pipes, 48 KiB L1, 2 MiB L2; 2026-11-25), f32, B=1, H=8, D=64, N=1024, 2 threads,
/// GFLOP/s over two runs each, in place → copied: full 309–323 → 346–358, causal 271–279 →
/// 285–294; at N=4096 (copied already, by the rule above) alike. The cores' FMAs take half the
/// time of Zen 4's per vector, and the strided rows' misses no longer hide behind them.
///
/// The L2 is the core's own, not a constant: on a 2-core Zen 1 VM (AMD EPYC family 23 model 1,
/// 512 KiB L2 a core, AVX2 on 128-bit units; 2026-11-28), f32, B=1, H=8, D=64, N=1024, a
/// head's K and V (512 KiB) fill the whole L2, and the tiles chosen for a 1 MiB L2 (128-query
/// tasks reading K and V in place) ran at 74.7–75.1% of the GEMM rate full and 73.0–73.2%
/// causal, the tiles for its own L2 (512-query tasks copying each key block) at 87.3–87.7% and
/// 82.6–82.8% (three interleaved runs of `flashattn bench --gemm --rounds 5`, sgemm 73–74
/// GFLOP/s).
///
/// On such a core (less than 1 MiB of L2) strided K and V rows are also copied when the keys a
/// task sees do not fit in the share of the L2's sets that their lines fall into (rows `s`
/// floats apart of which `d` are read: about `d / s` of the sets). On the Zen 1 VM
/// (2026-11-29, f32, D=64, `[B, N, H, D]`, % of the GEMM rate, `flashattn bench --gemm`, two or
/// three interleaved runs), in place → copied: H=8 (an eighth of the sets, 64 KiB), full N=256
/// 77.7–79.1 → 84.6–87.2, N=512 78.1–79.4 → 88.2–89.4, causal N=256 65.3–69.2 → 73.0–74.8, N=512
/// 72.6–76.3 → 79.7–81.7; B=4 N=512 full 79.7–80.1 → 89.3–90.0, causal 73.9–74.2 → 81.4–81.7;
/// N=1024 queries on 512 keys full 79.4–79.6 → 88.6–88.9; but N=64 full 71.0–71.7 → 67.6–68.2
/// and N=128 causal 62.3–63.3 → 60.4–61.2, whose 32–64 KiB fit. H=4 (a quarter, 128 KiB): N=256
/// full 87.9–88.2 → 86.2–86.3, N=512 88.1–88.4 → 89.6–90.2. The 1 MiB L2 of the Zen 4 and Zen 5
/// VMs read such rows faster in place (above).
pub(crate) fn forward_tiles(
    d: usize,
    dv: usize,
    (nk, span): (usize, usize),
    (kv_strides, f32_inputs): ([usize; 2], bool),
    rows_per_thread: usize,
    (vendor, l2): (Vendor, usize),
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
        pack_kv: aliases || (strided && (long || vendor == Vendor::Intel || crowded)),
        keep_kv: head_bytes <= KEPT_HEAD_BYTES,
    }
}

/// Whose cores the tiles are chosen for (see [`forward_tiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vendor {
    Intel,
    /// AMD (where the rules above were measured first), or not x86-64.
    Other,
}

/// The vendor of this CPU, from `cpuid`.
pub(crate) fn vendor() -> Vendor {
    static VENDOR: OnceLock<Vendor> = OnceLock::new();
    *VENDOR.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let id = std::arch::x86_64::__cpuid(0);
            let name: Vec<u8> = [id.ebx, id.edx, id.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            if name == b"GenuineIntel" {
                return Vendor::Intel;
            }
        }
        Vendor::Other
    })
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
/// sets of 64 bytes: a 4 KiB period), so a key block read in place keeps evicting itself.
///
/// Measured on the 2-core Zen 5 VM (2026-11-22, AVX2 kernels), f32 forward, D=64,
/// `[B, N, H, D]` (row stride H·D), GFLOP per CPU-second, K/V read in place vs copied per
/// block: H=4 (1 KiB) 220 vs 204, H=8 (2 KiB) 213 vs 200, H=16 (4 KiB) 165 vs 191, H=32
/// (8 KiB) 172 vs 191. With the AVX-512 kernels (2026-11-23, H=8): copying both K and V cost
/// 3-5 points of the GEMM rate, copying K alone (even with block_q 256) gained nothing,
/// although a 2 KiB stride alone makes `Sᵀ = K·Qᵀ` 5% slower than a packed K in a cache-hot
/// test (the copy's first touch of each row costs as much).
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

    /// [`forward_tiles`] on AMD cores.
    fn tiles(
        d: usize,
        dv: usize,
        keys: (usize, usize),
        rows: ([usize; 2], bool),
        per_thread: usize,
    ) -> ForwardTiles {
        forward_tiles(d, dv, keys, rows, per_thread, (Vendor::Other, L2))
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
        let small = (Vendor::Other, 512 << 10);
        let t = forward_tiles(64, 64, (1024, 1024), ([512; 2], true), MANY, small);
        assert_eq!((t.block_q, t.block_k, t.pack_kv), (512, 512, true));
    }

    #[test]
    fn a_smaller_l2_packs_strided_rows_that_crowd_its_sets() {
        let on = |l2: usize, n: usize, stride: usize| {
            let rows = ([stride; 2], true);
            forward_tiles(64, 64, (n, n), rows, MANY, (Vendor::Other, l2))
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
    fn intel_cores_pack_strided_rows_of_short_heads_too() {
        let intel = |strides| {
            let rows = (strides, true);
            forward_tiles(64, 64, (1024, 1024), rows, MANY, (Vendor::Intel, L2))
        };
        let strided = intel([512; 2]);
        assert_eq!((strided.block_q, strided.pack_kv), (128, true));
        assert!(!intel([64; 2]).pack_kv);
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
