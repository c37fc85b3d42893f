//! An output buffer that parallel tasks write at disjoint indices.

use std::marker::PhantomData;

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
