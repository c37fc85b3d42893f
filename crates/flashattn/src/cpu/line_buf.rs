//! `LineBuf`, the kernels' growable f32 tiles, which start on a 64-byte cache line (the tensors
//! flashattn allocates do too: `crate::host_buf`).
//!
//! The tile buffers hold 16-float panel rows that one AVX-512 load or store moves whole. In a
//! `Vec` (16-byte aligned by the allocator) each such row may straddle one more line than it
//! fills, and whether it does changes from one allocation to the next.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

use crate::cpu::fill_with;
use crate::host_buf::LINE_BYTES;

/// Floats in a cache line.
const LINE_FLOATS: usize = LINE_BYTES / size_of::<f32>();

/// One cache line of floats, aligned to its size.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; LINE_FLOATS]);

/// A growable f32 buffer whose elements start on a cache line (see the module doc). It derefs
/// to `[f32]` and resizes like a `Vec<f32>`.
#[derive(Clone, Default)]
pub(crate) struct LineBuf {
    lines: Vec<Line>,
    len: usize,
}

impl LineBuf {
    /// `n` copies of `x`, written by all threads from `host_buf::PARALLEL_FILL_BYTES` on.
    pub(crate) fn filled(n: usize, x: f32) -> Self {
        let count = n.div_ceil(LINE_FLOATS);
        let line = MaybeUninit::new(Line([x; LINE_FLOATS]));
        let mut lines = Vec::with_capacity(count);
        fill_with(&mut lines.spare_capacity_mut()[..count], |_, dst| {
            dst.fill(line)
        });
        // SAFETY: the first `count` lines were just written, within the capacity.
        unsafe { lines.set_len(count) };
        LineBuf { lines, len: n }
    }

    /// Makes the length `n`: the first `min(len, n)` elements are kept, any new ones are `x`.
    pub(crate) fn resize(&mut self, n: usize, x: f32) {
        let lines = n.div_ceil(LINE_FLOATS);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0.0; LINE_FLOATS]));
        }
        let old = self.len;
        self.len = n;
        if n > old {
            self[old..].fill(x);
        }
    }

    /// The bytes it holds (its capacity).
    pub(crate) fn bytes(&self) -> usize {
        self.lines.capacity() * size_of::<Line>()
    }

    /// Makes the length 0, keeping the memory.
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }
}

impl Deref for LineBuf {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds at least `len` initialized floats (`resize`), and `Line` is
        // `repr(C)` over an f32 array, so its floats lie back to back.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for LineBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resizes_like_a_vec_and_starts_on_a_line() {
        let mut b = LineBuf::default();
        let mut v: Vec<f32> = Vec::new();
        for (n, x) in [
            (5, 1.0),
            (40, 2.0),
            (17, 3.0),
            (100, 4.0),
            (0, 5.0),
            (33, 6.0),
        ] {
            b.resize(n, x);
            v.resize(n, x);
            assert_eq!(&b[..], &v[..], "after resize({n})");
            assert_eq!(b.as_ptr() as usize % 64, 0);
            for (i, e) in b.iter_mut().enumerate() {
                *e = i as f32;
            }
            v.iter_mut().enumerate().for_each(|(i, e)| *e = i as f32);
        }
        b.clear();
        assert!(b.is_empty());
        b.resize(3, 7.0);
        assert_eq!(&b[..], &[7.0; 3]);
    }
}
