//! Software prefetch of strided rows into L2. The decoding kernels fetch the K and V rows they
//! read later as they go ([`RowsAhead`]), and the loops that read or write strided rows once a
//! call (the forward's K/V packing, the backward's packing and gradient writes) a few rows ahead
//! ([`RowsAhead::ahead_of`]): rows a head apart (`[B, N, H, D]`: 2 KiB at H=8, D=64) are short
//! streams that the hardware prefetchers do not follow.
//!
//! Every prefetch here fills L2, none L1 (the microkernels fetch their next operand values into
//! L1 themselves, a line a step): rows 2 KiB apart fall into 8 of the L1 data cache's 64 sets,
//! so rows fetched into L1 ahead of their use evict the rows in use.

/// Rows that a kernel asks for one at a time, each as it reads a row of its own, so that
/// memory works on the next operand at the pace the current one is consumed: a burst of
/// prefetches for a whole block at once stalls the core while the misses queue up. Row `r` is
/// `bytes` long at `at + r·stride` bytes; `rows` of them, brought into L2.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowsAhead {
    at: *const u8,
    stride: usize,
    bytes: usize,
    rows: usize,
}

impl RowsAhead {
    /// Nothing to fetch.
    pub(crate) const NONE: RowsAhead = RowsAhead {
        at: std::ptr::null(),
        stride: 0,
        bytes: 0,
        rows: 0,
    };

    /// `rows` rows of `len` elements of `buf`, the first at element `start` and each `stride`
    /// after the last, for L2; the rows that do not lie wholly inside `buf` are left out.
    pub(crate) fn new<T>(
        buf: &[T],
        (start, stride): (usize, usize),
        (rows, len): (usize, usize),
    ) -> Self {
        Self::raw(buf.as_ptr(), buf.len(), (start, stride), (rows, len))
    }

    /// For a loop over `rows` rows of `len` elements of `buf` (the first at element `start`,
    /// each `stride` after the last) that calls `fetch(r)` as it reads or writes row `r`: the
    /// rows [`ROWS_AHEAD`] on, into L2.
    pub(crate) fn ahead_of<T>(
        buf: &[T],
        (start, stride): (usize, usize),
        (rows, len): (usize, usize),
    ) -> Self {
        Self::raw_ahead_of(buf.as_ptr(), buf.len(), (start, stride), (rows, len))
    }

    /// [`Self::ahead_of`] for the buffer of `buf_len` elements at `buf`.
    pub(crate) fn raw_ahead_of<T>(
        buf: *const T,
        buf_len: usize,
        (start, stride): (usize, usize),
        (rows, len): (usize, usize),
    ) -> Self {
        let first = start.saturating_add(ROWS_AHEAD.saturating_mul(stride));
        let rows = rows.saturating_sub(ROWS_AHEAD);
        Self::raw(buf, buf_len, (first, stride), (rows, len))
    }

    /// [`Self::new`] for the buffer of `buf_len` elements at `buf`.
    fn raw<T>(
        buf: *const T,
        buf_len: usize,
        (start, stride): (usize, usize),
        (rows, len): (usize, usize),
    ) -> Self {
        let inside = match buf_len.checked_sub(start.saturating_add(len)) {
            Some(room) => rows.min(room.checked_div(stride).map_or(rows, |r| r + 1)),
            None => 0,
        };
        RowsAhead {
            at: buf.wrapping_add(start).cast(),
            stride: stride * size_of::<T>(),
            bytes: len * size_of::<T>(),
            rows: inside,
        }
    }

    /// Asks for row `r` (nothing past the last row).
    #[inline(always)]
    pub(crate) fn fetch(&self, r: usize) {
        if r < self.rows {
            let row = self.at.wrapping_add(r * self.stride);
            for at in (0..self.bytes).step_by(LINE) {
                prefetch_line(row.wrapping_add(at));
            }
        }
    }

    /// Asks for rows `r..` (a kernel's rows past its own count).
    pub(crate) fn fetch_from(&self, r: usize) {
        for r in r..self.rows {
            self.fetch(r);
        }
    }
}

/// How many rows ahead of the one it reads or writes a loop over strided rows asks for the next
/// ([`RowsAhead::ahead_of`]). With rows a head apart (`[B, N, H, D]`) each row's first touch
/// otherwise waits on memory (see BENCHMARKS.md).
pub(crate) const ROWS_AHEAD: usize = 8;

/// Bytes one prefetch brings in (a cache line).
pub(crate) const LINE: usize = 64;

/// Asks for the cache line of `at` in L2 (a hint: nothing on CPUs other than x86-64).
#[inline(always)]
fn prefetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: a prefetch neither reads nor writes memory as far as the program can
        // observe, and does not fault on any address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_ahead_keep_to_the_buffer() {
        let buf = [0f32; 100];
        // Row r at 10 + 20r, 8 long: rows 0..=4 end at or before 100.
        let ahead = RowsAhead::new(&buf, (10, 20), (10, 8));
        assert_eq!((ahead.rows, ahead.stride, ahead.bytes), (5, 80, 32));
        assert_eq!(RowsAhead::new(&buf, (10, 20), (3, 8)).rows, 3);
        assert_eq!(RowsAhead::new(&buf, (95, 20), (3, 8)).rows, 0);
        assert_eq!(RowsAhead::new(&buf, (0, 0), (4, 100)).rows, 4);
        assert_eq!(RowsAhead::new(&buf, (usize::MAX, 1), (4, 8)).rows, 0);
        // Fetching any row, inside or not, has no effect on the program.
        for r in 0..20 {
            ahead.fetch(r);
        }
        ahead.fetch_from(3);
        RowsAhead::NONE.fetch(0);
    }

    #[test]
    fn ahead_of_starts_rows_ahead_and_keeps_to_the_buffer() {
        let buf = [0f32; 1000];
        // 20 rows of 8, 30 apart: the loop's row r asks for row r + ROWS_AHEAD.
        let ahead = RowsAhead::ahead_of(&buf, (10, 30), (20, 8));
        assert_eq!(ahead.rows, 20 - ROWS_AHEAD);
        assert_eq!(
            ahead.at,
            buf.as_ptr().wrapping_add(10 + ROWS_AHEAD * 30).cast()
        );
        // Fewer rows than ROWS_AHEAD: nothing to fetch; rows past the buffer are left out.
        assert_eq!(RowsAhead::ahead_of(&buf, (0, 30), (ROWS_AHEAD, 8)).rows, 0);
        assert_eq!(RowsAhead::ahead_of(&buf, (900, 30), (20, 8)).rows, 0);
        assert_eq!(RowsAhead::ahead_of(&buf, (usize::MAX, 30), (20, 8)).rows, 0);
    }
}
