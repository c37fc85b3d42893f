//! The host buffers behind tensors: a caller's `Vec` or foreign memory (another library's tensor,
//! kept alive by its owner), used where they lie, or a buffer flashattn allocates itself ([`Tensor::full`](crate::Tensor::full),
//! [`Tensor::from_slice`](crate::Tensor::from_slice), conversions, the outputs of `forward` and
//! `backward`). Those start on a 64-byte cache line; from 2 MiB on they start on a 2 MiB
//! boundary and, on Linux, their whole 2 MiB stretches are advised as transparent huge pages
//! (`madvise(MADV_HUGEPAGE)`) before any of their pages is touched ([`set_huge_pages`] turns
//! that off).
//!
//! Why: the kernels walk the rows of one head, `H·D` elements apart (2 KiB at H=8, D=64 in
//! f32), so on 4 KiB pages every second row misses the TLB (in a virtual machine each miss is a
//! nested page walk); the backward runs about 1% faster on huge pages, and about 1.5% faster
//! from buffers that start on a line than from the allocator's (see BENCHMARKS.md).

use std::any::Any;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use aligned_vec::{AVec, RuntimeAlign};
use rayon::prelude::*;

/// Bytes of a cache line: where every buffer flashattn allocates starts.
pub(crate) const LINE_BYTES: usize = 64;

/// Bytes of a huge page (x86-64, aarch64 with 4 KiB base pages): buffers of at least this many
/// bytes start on one and are advised as huge pages.
pub(crate) const HUGE_BYTES: usize = 2 << 20;

/// Buffers of at least this many bytes are written by all threads, so that their fresh pages
/// are faulted in parallel rather than by the calling thread alone while the others wait;
/// smaller ones by the calling thread. (Written, not merely zeroed by the allocator: pages
/// handed out untouched and then read before they are written take a read fault on the shared
/// zero page and then a copy-on-write fault that flushes every thread's TLB.)
pub(crate) const PARALLEL_FILL_BYTES: usize = 256 << 10;

/// Bytes a thread writes at a time when a buffer is filled by all threads.
const FILL_CHUNK_BYTES: usize = 64 << 10;

/// Whether large buffers are advised as huge pages: 0 = not decided yet, 1 = no, 2 = yes.
static HUGE_PAGES: AtomicU8 = AtomicU8::new(0);

/// Whether the buffers flashattn allocates from now on, when they take 2 MiB or more, start on
/// a 2 MiB boundary and are advised as transparent huge pages on Linux (on, the default, unless
/// the environment variable `FLASHATTN_HUGE_PAGES=0`): the kernels walk strided rows a head at a
/// time, which on 4 KiB pages misses the TLB every second row. Whether the kernel grants them is
/// up to its setting (`/sys/kernel/mm/transparent_hugepage/enabled`: `always` or `madvise`, not
/// `never`); buffers of your own (`Tensor::from_vec`) are used as they are.
pub fn set_huge_pages(on: bool) {
    HUGE_PAGES.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether large buffers are advised as huge pages (see [`set_huge_pages`]).
pub(crate) fn huge_pages() -> bool {
    match HUGE_PAGES.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("FLASHATTN_HUGE_PAGES").map_or(true, |v| v != "0");
            set_huge_pages(on);
            on
        }
        v => v == 2,
    }
}

/// A tensor's host buffer; it derefs to the elements.
#[derive(Debug)]
pub(crate) enum HostBuf<T> {
    /// A caller's vector, used where it lies.
    Taken(Vec<T>),
    /// A buffer flashattn allocated (see the module doc).
    Own(AVec<T, RuntimeAlign>),
    /// Memory another owner holds, used where it lies.
    Foreign(Foreign<T>),
}

/// `len` elements at `ptr` that `keep` holds alive: dropping the buffer drops `keep`.
pub(crate) struct Foreign<T> {
    ptr: NonNull<T>,
    len: usize,
    _keep: Box<dyn Any + Send + Sync>,
}

impl<T> Foreign<T> {
    /// The `len` elements at `ptr` (ignored when `len` is 0), alive as long as `keep` is.
    ///
    /// # Safety
    /// Unless `len` is 0, `ptr` is non-null, aligned for `T` and points to `len` initialized
    /// elements that stay valid while `keep` lives, and that nothing else writes while the buffer
    /// lives (nor reads while the buffer is written through `DerefMut`).
    pub(crate) unsafe fn new(ptr: *mut T, len: usize, keep: Box<dyn Any + Send + Sync>) -> Self {
        let ptr = match NonNull::new(ptr) {
            Some(p) if len > 0 => p,
            _ => NonNull::dangling(),
        };
        Foreign {
            ptr,
            len,
            _keep: keep,
        }
    }
}

// SAFETY: the buffer is used like an owned `[T]` (shared reads through `&`, writes only through
// `&mut`); the owner `keep` is itself `Send + Sync`.
unsafe impl<T: Send> Send for Foreign<T> {}
// SAFETY: as above; `&Foreign` only hands out `&[T]`.
unsafe impl<T: Sync> Sync for Foreign<T> {}

impl<T> std::fmt::Debug for Foreign<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Foreign({:p}, {} elements)", self.ptr, self.len)
    }
}

impl<T: Copy + Send + Sync> HostBuf<T> {
    /// `n` copies of `x`, written by all threads from [`PARALLEL_FILL_BYTES`] on.
    pub(crate) fn filled(n: usize, x: T) -> Self {
        let mut buf = allocate::<T>(n);
        fill_with(spare(&mut buf, n), |_, dst| dst.fill(MaybeUninit::new(x)));
        // SAFETY: the first n elements were just written, within the capacity.
        unsafe { buf.set_len(n) };
        HostBuf::Own(buf)
    }

    /// A copy of `src`, written by all threads from [`PARALLEL_FILL_BYTES`] on.
    pub(crate) fn copied(src: &[T]) -> Self {
        let mut buf = allocate::<T>(src.len());
        fill_with(spare(&mut buf, src.len()), |at, dst| {
            for (d, &s) in dst.iter_mut().zip(&src[at..]) {
                *d = MaybeUninit::new(s);
            }
        });
        // SAFETY: the first src.len() elements were just written, within the capacity.
        unsafe { buf.set_len(src.len()) };
        HostBuf::Own(buf)
    }

    /// The `n` elements of `items` (which must yield exactly `n`), in order.
    pub(crate) fn collected(n: usize, items: impl Iterator<Item = T>) -> Self {
        let mut buf = allocate::<T>(n);
        for x in items.take(n) {
            buf.push(x);
        }
        debug_assert_eq!(buf.len(), n, "fewer items than promised");
        HostBuf::Own(buf)
    }
}

impl<T> Deref for HostBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            HostBuf::Taken(v) => v,
            HostBuf::Own(v) => v,
            // SAFETY: `Foreign::new`'s contract: `len` valid elements (or a dangling, aligned
            // pointer for none), not written elsewhere while `self` is borrowed.
            HostBuf::Foreign(f) => unsafe { std::slice::from_raw_parts(f.ptr.as_ptr(), f.len) },
        }
    }
}

impl<T> DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostBuf::Taken(v) => v,
            HostBuf::Own(v) => v,
            // SAFETY: as in `deref`; the contract also forbids other reads while it is written,
            // and `&mut self` excludes every other borrow of this buffer.
            HostBuf::Foreign(f) => unsafe { std::slice::from_raw_parts_mut(f.ptr.as_ptr(), f.len) },
        }
    }
}

impl<T: Copy + Send + Sync> Clone for HostBuf<T> {
    /// A copy in a buffer of flashattn's own, whichever the original was: a clone of foreign
    /// memory never aliases it.
    fn clone(&self) -> Self {
        HostBuf::copied(self)
    }
}

/// An empty buffer with room for `n` elements, aligned as the module doc says and, when large,
/// advised as huge pages before anything touches it.
pub(crate) fn allocate<T>(n: usize) -> AVec<T, RuntimeAlign> {
    let bytes = n.saturating_mul(size_of::<T>());
    let huge = bytes >= HUGE_BYTES && huge_pages();
    let mut buf =
        AVec::<T, RuntimeAlign>::with_capacity(if huge { HUGE_BYTES } else { LINE_BYTES }, n);
    if huge {
        advise_huge(buf.as_mut_ptr().cast(), bytes / HUGE_BYTES * HUGE_BYTES);
    }
    buf
}

/// The first `n` elements of `buf`'s room past its (empty) contents, to write before
/// `set_len(n)`.
pub(crate) fn spare<T>(buf: &mut AVec<T, RuntimeAlign>, n: usize) -> &mut [MaybeUninit<T>] {
    assert!(
        buf.is_empty() && n <= buf.capacity(),
        "spare room: {n} elements"
    );
    // SAFETY: the allocation holds `capacity ≥ n` elements, none of them initialized (the vector
    // is empty), and the slice borrows the vector mutably.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<MaybeUninit<T>>(), n) }
}

/// Runs `f(at, piece)` over `dst` in pieces, `at` the index of the piece's first element: in
/// one piece, or from [`PARALLEL_FILL_BYTES`] on in chunks on rayon's threads (the CPU backend
/// fills its own buffers through its task queue instead: `cpu::fill_with`).
pub(crate) fn fill_with<T: Send>(dst: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    match parallel_chunk::<T>(dst.len()) {
        None => f(0, dst),
        Some(chunk) => dst
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, piece)| f(i * chunk, piece)),
    }
}

/// The elements a thread writes at a time when `len` elements of `T` are written by all
/// threads, or `None` when they are few enough for the calling thread alone.
pub(crate) fn parallel_chunk<T>(len: usize) -> Option<usize> {
    (len.saturating_mul(size_of::<T>()) >= PARALLEL_FILL_BYTES)
        .then(|| (FILL_CHUNK_BYTES / size_of::<T>().max(1)).max(1))
}

/// Asks the kernel to back `bytes` bytes from `at` (a 2 MiB boundary) with huge pages.
#[cfg(target_os = "linux")]
fn advise_huge(at: *mut u8, bytes: usize) {
    // SAFETY: the range lies inside one allocation of ours, starts on a page boundary and spans
    // whole pages; the advice changes how its pages are backed, never their contents. The result
    // is not checked: a kernel without transparent huge pages refuses (EINVAL), and the buffer
    // works the same on small pages.
    unsafe { libc::madvise(at.cast(), bytes, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_at: *mut u8, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn start<T>(b: &HostBuf<T>) -> usize {
        b.as_ptr() as usize
    }

    /// Every buffer flashattn allocates starts on a line, and from 2 MiB on a huge page; filled,
    /// copied and collected buffers hold what they were given.
    #[test]
    fn own_buffers_are_aligned_and_hold_their_elements() {
        for n in [
            0,
            1,
            33,
            1000,
            PARALLEL_FILL_BYTES / 4 + 5,
            (HUGE_BYTES / 4) + 17,
        ] {
            let f = HostBuf::filled(n, 2.5f32);
            assert_eq!((f.len(), start(&f) % LINE_BYTES), (n, 0), "{n}");
            assert!(f.iter().all(|&x| x == 2.5));
            let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let c = HostBuf::copied(&src);
            assert_eq!((&c[..], start(&c) % LINE_BYTES), (&src[..], 0), "{n}");
            let l = HostBuf::collected(n, src.iter().map(|x| x + 1.0));
            assert!(l.iter().zip(&src).all(|(a, b)| *a == b + 1.0) && l.len() == n);
            let h = HostBuf::filled(n, half::f16::ONE);
            assert_eq!(start(&h) % LINE_BYTES, 0);
            if n * 4 >= HUGE_BYTES && huge_pages() {
                assert_eq!(start(&f) % HUGE_BYTES, 0, "{n}");
                assert_eq!(start(&c.clone()) % HUGE_BYTES, 0, "{n}");
            }
        }
    }

    /// A caller's vector is kept where it lies; its clone is flashattn's own.
    #[test]
    fn taken_vectors_stay_where_they_are() {
        let v = vec![1.0f32, 2.0, 3.0];
        let at = v.as_ptr();
        let t = HostBuf::Taken(v);
        assert_eq!(t.as_ptr(), at);
        let c = t.clone();
        assert!(matches!(c, HostBuf::Own(_)) && c[..] == t[..]);
    }

    /// Foreign memory is read and written where it lies, its owner dropped with the buffer; a
    /// clone is a copy that writes do not reach.
    #[test]
    fn foreign_memory_stays_with_its_owner() {
        use std::sync::Arc;
        let mut mem = vec![1.0f32, 2.0, 3.0];
        let owner = Arc::new(());
        // SAFETY: `mem` outlives the buffer and is touched only through it meanwhile.
        let mut f =
            HostBuf::Foreign(unsafe { Foreign::new(mem.as_mut_ptr(), 3, Box::new(owner.clone())) });
        assert_eq!((f.as_ptr(), &f[..]), (mem.as_ptr(), &[1.0, 2.0, 3.0][..]));
        let c = f.clone();
        f[1] = 7.0;
        assert!(matches!(c, HostBuf::Own(_)) && c[..] == [1.0, 2.0, 3.0]);
        assert_eq!(Arc::strong_count(&owner), 2);
        drop(f);
        assert_eq!((Arc::strong_count(&owner), mem[1]), (1, 7.0));
        // No elements: the pointer is not used, null or not.
        // SAFETY: nothing is read through a buffer of no elements.
        let empty =
            HostBuf::Foreign(unsafe { Foreign::<f32>::new(std::ptr::null_mut(), 0, Box::new(())) });
        assert!(empty.is_empty());
    }
}
