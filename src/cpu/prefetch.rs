//! Software prefetch of strided rows, for the forward's query rows before it packs them and its
//! output rows before it writes them: rows a head apart (`[B, N, H, D]`: 2 KiB at H=8, D=64)
//! are sixteen short streams a panel, which the hardware prefetchers do not follow, so without
//! a hint each 16×16 transpose waits on its rows coming from L3 or memory. Decoding tasks also
//! fetch their next key block's K and V rows into L2 (`key_rows`).

/// The cache level a prefetch fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cache {
    /// For what the next few hundred cycles use.
    L1,
    /// For what is used after the work at hand.
    L2,
}

/// Asks for the cache lines of `rows` rows of `len` elements of the buffer of `buf_len`
/// elements at `buf`, the first row at element `start` and each `stride` after the last, to be
/// brought into `cache`; what lies outside the buffer is skipped. A hint only: no result
/// depends on it, and it does nothing on CPUs other than x86-64.
pub(crate) fn prefetch_rows<T>(
    buf: *const T,
    buf_len: usize,
    (start, stride): (usize, usize),
    (rows, len): (usize, usize),
    cache: Cache,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        /// Bytes one prefetch brings in (a cache line).
        const LINE: usize = 64;
        for r in 0..rows {
            let first = start + r * stride;
            let end = (first + len).min(buf_len);
            if first >= end {
                return;
            }
            let bytes = buf.wrapping_add(first).cast::<i8>();
            for at in (0..(end - first) * size_of::<T>()).step_by(LINE) {
                // SAFETY: `at` bytes into row `r`, inside the buffer; a prefetch neither reads
                // nor writes memory as far as the program can observe.
                unsafe {
                    match cache {
                        Cache::L1 => _mm_prefetch::<_MM_HINT_T0>(bytes.wrapping_add(at)),
                        Cache::L2 => _mm_prefetch::<_MM_HINT_T1>(bytes.wrapping_add(at)),
                    }
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (buf, buf_len, start, stride, rows, len, cache);
}
