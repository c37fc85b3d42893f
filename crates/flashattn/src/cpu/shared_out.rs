//! An output buffer that parallel tasks write at disjoint indices.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use crate::cpu::CpuElement;
use crate::cpu::prefetch::RowsAhead;
use crate::cpu::simd::cpu_simd;
use crate::cpu::simd::transpose::{ColScale, transpose_to};
use crate::dtype::{DType, Element};
use crate::problem::RowLayout;

/// A `&mut [T]` shared by rayon tasks that each own a disjoint set of rows (one task per
/// (sequence, head, query block), say). Writes are bounds-checked.
pub(crate) struct SharedOut<'a, T> {
    ptr: *mut T,
    len: usize,
    /// Where rows of the buffer sit (it is shaped like q or k).
    pub layout: RowLayout,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: tasks write disjoint elements (the callers' contract on `write_row`), so sharing the
// pointer across threads is a data race only if that contract is broken.
unsafe impl<T: Send> Send for SharedOut<'_, T> {}
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T: Copy> SharedOut<'a, T> {
    pub(crate) fn new(buf: &'a mut [T], layout: RowLayout) -> Self {
        SharedOut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            layout,
            _borrow: PhantomData,
        }
    }

    /// Over a buffer not yet initialized: the tasks only write (the `write_*` methods never
    /// read), and the caller may take the buffer as initialized once they have written every
    /// element.
    pub(crate) fn uninit(buf: &'a mut [MaybeUninit<T>], layout: RowLayout) -> Self {
        SharedOut {
            ptr: buf.as_mut_ptr().cast::<T>(),
            len: buf.len(),
            layout,
            _borrow: PhantomData,
        }
    }

    /// Another writer of the same buffer with its rows at `layout` (the fused layer's dq, dk
    /// and dv, disjoint columns of one packed buffer); the `write_*` contracts then cover the
    /// elements every writer of the buffer touches.
    pub(crate) fn with_layout(&self, layout: RowLayout) -> SharedOut<'_, T> {
        SharedOut {
            ptr: self.ptr,
            len: self.len,
            layout,
            _borrow: PhantomData,
        }
    }

    /// For a loop that writes `rows` rows of `len` elements, the first at `start` and each
    /// `stride` after the last: the rows a few on from the one it writes (see
    /// [`RowsAhead::ahead_of`]).
    pub(crate) fn rows_ahead(
        &self,
        (start, stride): (usize, usize),
        rows: usize,
        len: usize,
    ) -> RowsAhead {
        let at = (start, stride);
        RowsAhead::raw_ahead_of(self.ptr.cast_const(), self.len, at, (rows, len))
    }

    /// Writes `values` at `start..start + values.len()`.
    ///
    /// # Safety
    /// No other task may read or write these indices during the parallel region, and `values`
    /// yields exactly `values.len()` items (the bounds check trusts it).
    #[inline]
    pub(crate) unsafe fn write_row(&self, start: usize, values: impl ExactSizeIterator<Item = T>) {
        assert!(
            start + values.len() <= self.len,
            "row {start}+{} outside the output of {}",
            values.len(),
            self.len
        );
        for (o, x) in values.enumerate() {
            // SAFETY: in bounds (checked above); exclusive by the caller's contract.
            unsafe { self.ptr.add(start + o).write(x) };
        }
    }
}

impl<T: CpuElement> SharedOut<'_, T> {
    /// Writes `src · factor` as `T` at `start..start + src.len()`. f16 and bf16 are narrowed by
    /// [`CpuElement::narrow_into`] (vector conversions a row at a time), straight into
    /// the row when `factor` is 1, else a chunk at a time (not one conversion call per element,
    /// each with its run-time F16C check).
    ///
    /// # Safety
    /// No other task may read or write these indices during the parallel region.
    pub(crate) unsafe fn write_f32_row(&self, start: usize, src: &[f32], factor: f32) {
        const CHUNK: usize = 64;
        assert!(
            start + src.len() <= self.len,
            "row {start}+{} outside the output of {}",
            src.len(),
            self.len
        );
        if T::DTYPE == DType::F32 {
            for (o, &x) in src.iter().enumerate() {
                // SAFETY: in bounds (checked above); exclusive by the caller's contract.
                unsafe { self.ptr.add(start + o).write(T::from_f32(x * factor)) };
            }
            return;
        }
        if factor == 1.0 {
            // SAFETY: in bounds (checked above); exclusive by the caller's contract, so no
            // other reference to these elements exists while this one lives.
            let row = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), src.len()) };
            T::narrow_into(src, row);
            return;
        }
        let mut scaled = [0f32; CHUNK];
        let mut narrow = [T::from_f32(0.0); CHUNK];
        for (c, part) in src.chunks(CHUNK).enumerate() {
            let n = part.len();
            for (s, &x) in scaled.iter_mut().zip(part) {
                *s = x * factor;
            }
            T::narrow_into(&scaled[..n], &mut narrow[..n]);
            // SAFETY: in bounds (checked above); exclusive by the caller's contract; `narrow` is
            // a local array.
            unsafe {
                std::ptr::copy_nonoverlapping(narrow.as_ptr(), self.ptr.add(start + c * CHUNK), n)
            };
        }
    }
}

impl<T: Element> SharedOut<'_, T> {
    /// Writes the transpose of `src` (`rows × cols`, row stride `src_rs`) at `start`, its
    /// column `c` times `f[c % 16]` becoming the row at `start + c · row_stride`, when the
    /// buffer holds f32; returns false (writing nothing) otherwise.
    ///
    /// # Safety
    /// No other task may read or write those `cols` rows of `rows` elements during the
    /// parallel region.
    pub(crate) unsafe fn write_transposed_f32(
        &self,
        start: usize,
        row_stride: usize,
        src: &[f32],
        src_rs: usize,
        (rows, cols): (usize, usize),
        f: &ColScale,
    ) -> bool {
        if T::DTYPE != DType::F32 {
            return false;
        }
        if rows == 0 || cols == 0 {
            return true;
        }
        assert!(
            start + (cols - 1) * row_stride + rows <= self.len,
            "rows at {start} (stride {row_stride}) outside the output of {}",
            self.len
        );
        // SAFETY: T is f32 (its DTYPE); the rows are inside the buffer (checked above) and this
        // task's alone (the caller's contract), and `src` is not part of the buffer, which is
        // borrowed mutably for the region.
        unsafe {
            transpose_to(
                cpu_simd(),
                self.ptr.cast::<f32>().add(start),
                row_stride,
                (src, src_rs, Some(f)),
                rows,
                cols,
            )
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// Chunked, straight or inline, each element is `T::from_f32(x · factor)`, and nothing
    /// outside the row is touched.
    fn write_f32_row_narrows_like_from_f32<T: CpuElement + PartialEq + std::fmt::Debug>() {
        // More than two chunks, not a multiple of one; values that round in every direction.
        let src: Vec<f32> = (0..150)
            .map(|i| (i as f32 * 0.731).sin() * 1e3 / 7.0)
            .collect();
        for factor in [0.37, 1.0] {
            let sentinel = T::from_f32(-5.0);
            let mut buf = vec![sentinel; src.len() + 10];
            let out = SharedOut::new(&mut buf, RowLayout::default());
            // SAFETY: no other writer.
            unsafe { out.write_f32_row(3, &src, factor) };
            for (i, &x) in buf.iter().enumerate() {
                let want = match i.checked_sub(3).and_then(|j| src.get(j)) {
                    Some(&s) => T::from_f32(s * factor),
                    None => sentinel,
                };
                assert_eq!(x, want, "{} element {i}, factor {factor}", T::DTYPE);
            }
        }
    }

    #[test]
    fn write_f32_row_narrows_each_dtype_like_from_f32() {
        write_f32_row_narrows_like_from_f32::<f32>();
        write_f32_row_narrows_like_from_f32::<f16>();
        write_f32_row_narrows_like_from_f32::<bf16>();
    }
}
