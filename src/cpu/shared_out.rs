//! An output buffer that parallel tasks write at disjoint indices.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use super::simd::cpu_simd;
use super::transpose::{ColScale, transpose_to};
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

    /// Writes `values` at `start..start + values.len()`.
    ///
    /// # Safety
    /// No other task may read or write these indices during the parallel region.
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
