//! Buffers that start on a 64-byte cache line: `LineBuf`, the kernels' growable f32 tiles, and
//! [`line_aligned`] and [`line_filled`], the vectors behind the tensors flashattn allocates.
//!
//! The tile buffers hold 16-float panel rows that one AVX-512 load or store moves whole, and
//! the tensors hold rows of a head dim of f32 or 16-bit floats. In a `Vec` (16-byte aligned by
//! the allocator) each such row may straddle one more line than it fills, and whether it does
//! changes from one allocation to the next.

use std::ops::{Deref, DerefMut};

use rayon::prelude::*;

/// Bytes of a cache line.
const LINE_BYTES: usize = 64;

/// Floats in a cache line.
const LINE_FLOATS: usize = LINE_BYTES / size_of::<f32>();

/// Buffers of at least this many elements (256 KiB of f32) are filled by all threads; smaller
/// ones by the calling thread alone. Large buffers are written by all threads so that their
/// fresh pages are faulted in parallel rather than by the calling thread alone while the others
/// wait. (Written, not merely zeroed by the allocator: pages handed out untouched and then read
/// before they are written take a read fault on the shared zero page and then a copy-on-write
/// fault that flushes every thread's TLB.)
pub(crate) const PARALLEL_FILL: usize = 1 << 16;

/// `n` copies of `x` from the returned offset on, which starts a cache line (the elements before
/// it are `x` too): the buffer of a tensor of `n` elements at that offset.
pub(crate) fn line_filled<T: Copy + Send + Sync>(n: usize, x: T) -> (Vec<T>, usize) {
    let (mut data, offset) = line_aligned(n, x);
    extend_filled(&mut data, n, x, n >= PARALLEL_FILL);
    (data, offset)
}

/// Appends `count` copies of `x` to `v`, written by all threads when `parallel`.
fn extend_filled<T: Copy + Send + Sync>(v: &mut Vec<T>, count: usize, x: T, parallel: bool) {
    if parallel {
        v.par_extend(rayon::iter::repeat_n(x, count));
    } else {
        v.resize(v.len() + count, x);
    }
}

/// An empty vector with room for `offset + n` elements whose element `offset` starts a cache
/// line, with its first `offset` elements (fewer than a line's worth) set to `pad`: the buffer
/// of a tensor of `n` elements at that offset.
pub(crate) fn line_aligned<T: Copy>(n: usize, pad: T) -> (Vec<T>, usize) {
    let size = size_of::<T>().max(1);
    let mut data = Vec::with_capacity(n.saturating_add(LINE_BYTES / size));
    // The allocator aligns to `align_of::<T>()`, which for the element types is their size, so
    // the distance to the next line is a whole number of elements.
    let offset = (LINE_BYTES - data.as_ptr() as usize % LINE_BYTES) % LINE_BYTES / size;
    data.resize(offset, pad);
    (data, offset)
}

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
    /// `n` copies of `x`, written by all threads when there are at least [`PARALLEL_FILL`].
    pub(crate) fn filled(n: usize, x: f32) -> Self {
        let count = n.div_ceil(LINE_FLOATS);
        let mut lines = Vec::with_capacity(count);
        extend_filled(
            &mut lines,
            count,
            Line([x; LINE_FLOATS]),
            n >= PARALLEL_FILL,
        );
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

    #[test]
    fn line_aligned_pads_to_a_line_in_every_dtype() {
        for n in [0, 1, 33, 1000] {
            let (v, at) = line_aligned(n, 2.5f32);
            assert!(v.capacity() >= at + n && at < 16);
            assert_eq!(v[..].as_ptr().wrapping_add(at) as usize % 64, 0);
            assert!(v.iter().all(|&x| x == 2.5));
            let (h, at) = line_aligned(n, half::f16::ONE);
            assert!(h.capacity() >= at + n && at < 32);
            assert_eq!(h[..].as_ptr().wrapping_add(at) as usize % 64, 0);
        }
    }

    /// The outputs of `forward` and `backward` and the tensors of `Tensor::full` start on a line,
    /// in every dtype.
    #[test]
    fn tensors_flashattn_allocates_start_on_a_line() {
        use crate::{AttentionParams, DType, Tensor, backward, forward};
        fn first_byte(t: &Tensor) -> usize {
            let at = t.offset();
            match t.dtype() {
                DType::F32 => t.cpu_slice::<f32>().unwrap()[at..].as_ptr() as usize,
                DType::F16 => t.cpu_slice::<half::f16>().unwrap()[at..].as_ptr() as usize,
                DType::BF16 => t.cpu_slice::<half::bf16>().unwrap()[at..].as_ptr() as usize,
            }
        }
        let data: Vec<f32> = (0..2 * 5 * 3 * 8)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let p = AttentionParams::default().causal();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let x = Tensor::from_vec(data.clone(), &[2, 5, 3, 8])
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let f = forward(&x, &x, &x, &p).unwrap();
            let g = backward(&x, &x, &x, &f.out, &f.lse, &x, &p).unwrap();
            let full = Tensor::full(&[3, 7], dtype, 1.0).unwrap();
            for (name, t) in [
                ("out", &f.out),
                ("lse", &f.lse),
                ("dq", &g.dq),
                ("dk", &g.dk),
                ("dv", &g.dv),
                ("full", &full),
            ] {
                assert_eq!(first_byte(t) % 64, 0, "{dtype} {name}");
            }
        }
    }
}
