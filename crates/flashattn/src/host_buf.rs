//! The host buffers behind tensors: a caller's `Vec`, used where it lies, or a buffer flashattn
//! allocates itself ([`Tensor::full`](crate::Tensor::full),
//! [`Tensor::from_slice`](crate::Tensor::from_slice), conversions, the outputs of `forward` and
//! `backward`). Those start on a 64-byte cache line; from 2 MiB on they start on a 2 MiB
//! boundary and, on Linux, their whole 2 MiB stretches are advised as transparent huge pages
//! (`madvise(MADV_HUGEPAGE)`) before any of their pages is touched ([`set_huge_pages`] turns
//! that off).
//!
//! Why: the kernels walk the rows of one head, `H·D` elements apart (2 KiB at H=8, D=64 in f32),
//! so on 4 KiB pages every second row misses the TLB, and in a virtual machine each miss is a
//! nested page walk. The backward reads each row of Q, K, V, O and dO and writes each of dQ, dK
//! and dV once per call, a head at a time. f32, B=1, H=8, D=64, `[B, N, H, D]`, every tensor of
//! the call (inputs and outputs) allocated here with huge pages on against off (both on a line),
//! 2 threads, median over 5–25 interleaved rounds of each call's fastest of three (Zen 4 VM,
//! 2026-11-24): `backward_into` N=1024 full 1.006–1.014×, causal 0.997–1.014× (three runs),
//! N=4096 full 1.012×, causal 1.008×; `forward_into` within ±0.6% (N=1024 and 4096). Starting on
//! a line matters as much: the same backward on `Vec`s of the allocator's (16 bytes past a line)
//! against buffers from here on small pages ran 1.018× (full) and 1.015× (causal) slower.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU8, Ordering};

use aligned_vec::{AVec, RuntimeAlign};

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
/// the environment variable `FLASHATTN_HUGE_PAGES=0`). The kernels walk strided rows a head at a
/// time, which on 4 KiB pages misses the TLB every second row; the backward runs about 1% faster
/// on huge pages. Whether the kernel grants them is up to its setting
/// (`/sys/kernel/mm/transparent_hugepage/enabled`: `always` or `madvise`, not `never`); buffers
/// of your own (`Tensor::from_vec`) are used as they are.
pub fn set_huge_pages(on: bool) {
    HUGE_PAGES.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether large buffers are advised as huge pages (see [`set_huge_pages`]).
fn huge_pages() -> bool {
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
        }
    }
}

impl<T> DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostBuf::Taken(v) => v,
            HostBuf::Own(v) => v,
        }
    }
}

impl<T: Copy + Send + Sync> Clone for HostBuf<T> {
    /// A copy in a buffer of flashattn's own, whichever the original was.
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
/// one piece, or from [`PARALLEL_FILL_BYTES`] on in chunks on all threads (those that run the
/// kernels' tasks: `cpu::for_each_chunk`).
pub(crate) fn fill_with<T: Send>(dst: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    if size_of_val(dst) < PARALLEL_FILL_BYTES {
        f(0, dst);
    } else {
        let chunk = (FILL_CHUNK_BYTES / size_of::<T>().max(1)).max(1);
        crate::cpu::for_each_chunk(dst, chunk, |i, piece| f(i * chunk, piece));
    }
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
    /// The outputs of `forward` and `backward`, the tensors of `Tensor::full`, `from_slice` and
    /// conversions start on a line in every dtype, and from 2 MiB on on a huge page.
    #[test]
    fn tensors_flashattn_allocates_are_aligned() {
        use crate::{AttentionParams, DType, Tensor, backward, forward};
        fn first_byte(t: &Tensor) -> usize {
            let at = t.offset();
            match t.dtype() {
                DType::F32 => t.cpu_slice::<f32>().unwrap()[at..].as_ptr() as usize,
                DType::F16 => t.cpu_slice::<half::f16>().unwrap()[at..].as_ptr() as usize,
                DType::BF16 => t.cpu_slice::<half::bf16>().unwrap()[at..].as_ptr() as usize,
            }
        }
        let p = AttentionParams::default().causal();
        // [B, N, H, D]: 2 MiB in f32 for the second.
        for shape in [[2, 5, 3, 8], [4, 16, 64, 128]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let x = Tensor::from_vec(data.clone(), &shape)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let f = forward(&x, &x, &x, &p).unwrap();
                let g = backward(&x, &x, &x, &f.out, &f.lse, &x, &p).unwrap();
                let full = Tensor::full(&shape, dtype, 1.0).unwrap();
                let copy = Tensor::from_slice(&data, &shape).unwrap();
                let tensors = [
                    ("x", &x),
                    ("out", &f.out),
                    ("lse", &f.lse),
                    ("dq", &g.dq),
                    ("dk", &g.dk),
                    ("dv", &g.dv),
                    ("full", &full),
                    ("from_slice", &copy),
                ];
                for (name, t) in tensors {
                    let bytes = t.numel() * t.dtype().size_in_bytes();
                    let huge = bytes >= HUGE_BYTES && huge_pages();
                    let align = if huge { HUGE_BYTES } else { LINE_BYTES };
                    assert_eq!(first_byte(t) % align, 0, "{dtype} {name} {shape:?}");
                }
            }
        }
    }
}
