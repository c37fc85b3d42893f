//! The two products of a decoding step's block, by SIMD level: the AVX-512 and AVX2 kernels
//! read K's and V's rows in place in their own dtype ([`avx512`], [`avx2`]); elsewhere K's
//! block is transposed into panels and multiplied by the panel microkernel with the heads as
//! its rows, and the value panels likewise.

use super::BLOCK;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
#[cfg(target_arch = "x86_64")]
use crate::cpu::CpuElement;
use crate::cpu::forward::key_rows::KeyRows;
use crate::cpu::prefetch::RowsAhead;
use crate::cpu::simd::exp::LANES;
#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::kernels;
use crate::cpu::simd::microkernel::{PairOffsets, PanelStrides, Write, panels_product};
use crate::cpu::simd::transpose::transpose;
#[cfg(target_arch = "x86_64")]
use half::{bf16, f16};

/// Which kernels a decoding step's blocks run on x86-64 (elsewhere: the panels).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// [`avx512`], rows in place.
    Avx512,
    /// [`avx2`], rows in place (F16C too).
    Avx2,
    /// K transposed into panels; the panel microkernel at the CPU's level.
    Panels,
}

/// The kernels of this CPU's SIMD level (from its [`kernels`] table).
#[cfg(target_arch = "x86_64")]
pub(super) fn level() -> Level {
    kernels().decode
}

/// An element type the in-place kernels of both levels read.
#[cfg(target_arch = "x86_64")]
pub(super) trait InPlace: avx512::Load + avx2::Load {}

#[cfg(target_arch = "x86_64")]
impl InPlace for f32 {}
#[cfg(target_arch = "x86_64")]
impl InPlace for bf16 {}
#[cfg(target_arch = "x86_64")]
impl InPlace for f16 {}

/// What the decoding kernels add to [`KeyRows`]: rows read in their own dtype, and checked.
impl<'a, E> KeyRows<'a, E> {
    /// The rows `(x, at, stride)` of an input whose dtype is `E`'s (the caller matched
    /// `T::DTYPE`), seen as `E`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn cast<T: CpuElement>((x, at, stride): (&'a [T], usize, usize)) -> Self {
        assert_eq!(
            size_of::<T>(),
            size_of::<E>(),
            "decode: element sizes differ"
        );
        // SAFETY: same size and alignment class (f16 and bf16 are both 2-byte values for which
        // every bit pattern is valid), same length, and the borrow of `x` carries over.
        let data = unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<E>(), x.len()) };
        KeyRows { data, at, stride }
    }

    /// The rows from the first on, checked to hold `n ≥ 1` rows of `width` (panics naming
    /// `what` otherwise: an internal bug).
    #[cfg(target_arch = "x86_64")]
    fn checked(&self, n: usize, width: usize, what: &str) -> &'a [E] {
        let rows = self.skip(0);
        assert!(
            n >= 1 && (n - 1) * self.stride + width <= rows.len(),
            "decode: {what} block out of bounds"
        );
        rows
    }
}

/// `S = Q · Kᵀ` (`q`: heads × d, `s`: heads × BLOCK) by the panel microkernel: K's block
/// transposed into `d × 16` panels of keys (`kt`), the heads as the rows; `ahead`'s rows are
/// fetched as K's are transposed.
pub(super) fn scores_panels(
    q: &[f32],
    kt: &mut [f32],
    s: &mut [f32],
    (d, n): (usize, usize),
    k: KeyRows,
    ahead: &RowsAhead,
) {
    let heads = q.len() / d;
    let panels = n.div_ceil(LANES);
    for c in 0..panels {
        for r in c * LANES..(c + 1) * LANES {
            ahead.fetch(r);
        }
        let rows = LANES.min(n - c * LANES);
        let panel = &mut kt[c * d * LANES..(c + 1) * d * LANES];
        transpose(panel, LANES, k.skip(c * LANES), k.stride, rows, d);
    }
    ahead.fetch_from(panels * LANES);
    for c in (0..panels).step_by(2) {
        panels_product(
            &mut s[c * LANES..],
            q,
            &kt[c * d * LANES..],
            heads,
            d,
            PanelStrides {
                a_rs: d,
                a_cs: 1,
                b_rs: LANES,
                c_rs: BLOCK,
            },
            (c + 1 < panels).then_some(PairOffsets {
                b: d * LANES,
                c: LANES,
            }),
            Write::Overwrite,
        );
    }
}

/// `O += P · V` (`o`: heads × dv, `p`: heads × BLOCK) by the panel microkernel: the heads as
/// the rows, 16 value dims a panel, V's rows in place; `ahead`'s rows are fetched in equal
/// shares before each pair of panels.
pub(super) fn values_panels(
    o: &mut [f32],
    p: &[f32],
    (dv, n): (usize, usize),
    v: KeyRows,
    ahead: &RowsAhead,
) {
    let heads = o.len() / dv;
    let rows = v.skip(0);
    let pairs = (dv / LANES).div_ceil(2);
    for c in (0..dv / LANES).step_by(2) {
        // An equal share of the rows to fetch before each pair of panels.
        for r in c / 2 * n / pairs..(c / 2 + 1) * n / pairs {
            ahead.fetch(r);
        }
        panels_product(
            &mut o[c * LANES..],
            p,
            &rows[c * LANES..],
            heads,
            n,
            PanelStrides {
                a_rs: BLOCK,
                a_cs: 1,
                b_rs: v.stride,
                c_rs: dv,
            },
            (c + 1 < dv / LANES).then_some(PairOffsets { b: LANES, c: LANES }),
            Write::Accumulate,
        );
    }
    ahead.fetch_from(n);
}

/// `S = Q · Kᵀ` as dot products of K's rows in place with the kernels of this CPU's [`level`]
/// (not [`Level::Panels`]), a few heads at a time (see [`avx512::scores`], [`avx2::scores`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn scores_in_place<E: InPlace>(
    q: &[f32],
    s: &mut [f32],
    (d, n): (usize, usize),
    k: KeyRows<E>,
    ahead: &RowsAhead,
) {
    let level = level();
    assert!(level != Level::Panels, "decode: no in-place kernels");
    let heads = q.len() / d;
    let (rows, k_rs) = (k.checked(n, d, "K"), k.stride);
    assert!(s.len() >= heads * BLOCK, "decode: score rows out of bounds");
    let hp = if heads.is_multiple_of(4) {
        4
    } else if heads.is_multiple_of(2) {
        2
    } else {
        1
    };
    for g0 in (0..heads).step_by(hp) {
        // The first pass over the block fetches the rows read later.
        let ahead = if g0 == 0 { ahead } else { &RowsAhead::NONE };
        let q = (q[g0 * d..].as_ptr(), d);
        let s = (s[g0 * BLOCK..].as_mut_ptr(), BLOCK);
        let k = (rows.as_ptr(), k_rs);
        // SAFETY: `level` is this CPU's ([`level`]); heads g0..g0 + hp have rows
        // of q (d each) and of s (BLOCK each, a multiple of 16 and at least n), and the n rows
        // of K lie inside `rows` (asserted above).
        unsafe {
            match (level, hp) {
                (Level::Avx512, 4) => avx512::scores::<4, E>(q, k, s, d, n, ahead),
                (Level::Avx512, 2) => avx512::scores::<2, E>(q, k, s, d, n, ahead),
                (Level::Avx512, _) => avx512::scores::<1, E>(q, k, s, d, n, ahead),
                (_, 4) => avx2::scores::<4, E>(q, k, s, d, n, ahead),
                (_, 2) => avx2::scores::<2, E>(q, k, s, d, n, ahead),
                (_, _) => avx2::scores::<1, E>(q, k, s, d, n, ahead),
            }
        }
    }
}

/// One of a kernel module's `accumulate::<GH, CW, E>` for `(gh, cw)` (see
/// [`values_in_place`] for the pairs it is given).
#[cfg(target_arch = "x86_64")]
macro_rules! accumulate {
    ($m:ident, ($gh:expr, $cw:expr), $args:tt) => {
        match ($gh, $cw) {
            (1, 8) => $m::accumulate::<1, 8, E> $args,
            (1, 4) => $m::accumulate::<1, 4, E> $args,
            (1, 2) => $m::accumulate::<1, 2, E> $args,
            (1, _) => $m::accumulate::<1, 1, E> $args,
            (2, 8) => $m::accumulate::<2, 8, E> $args,
            (2, 4) => $m::accumulate::<2, 4, E> $args,
            (2, 2) => $m::accumulate::<2, 2, E> $args,
            (2, _) => $m::accumulate::<2, 1, E> $args,
            (3, 4) => $m::accumulate::<3, 4, E> $args,
            (3, 2) => $m::accumulate::<3, 2, E> $args,
            (3, _) => $m::accumulate::<3, 1, E> $args,
            (_, 4) => $m::accumulate::<4, 4, E> $args,
            (_, 2) => $m::accumulate::<4, 2, E> $args,
            (_, _) => $m::accumulate::<4, 1, E> $args,
        }
    };
}

/// `O += P · V` with the kernels of this CPU's [`level`] (not [`Level::Panels`]): `GH × CW`
/// blocks of accumulators, up to 4 heads by up to 8 vectors of value dims (see
/// [`avx512::accumulate`], [`avx2::accumulate`]), at most 16 accumulators with AVX-512's 32
/// registers and 12 with AVX2's 16.
#[cfg(target_arch = "x86_64")]
pub(super) fn values_in_place<E: InPlace>(
    o: &mut [f32],
    p: &[f32],
    (dv, n): (usize, usize),
    v: KeyRows<E>,
    ahead: &RowsAhead,
) {
    let level = level();
    assert!(level != Level::Panels, "decode: no in-place kernels");
    let heads = o.len() / dv;
    let (rows, v_rs) = (v.checked(n, dv, "V"), v.stride);
    assert!(
        p.len() >= heads * BLOCK,
        "decode: probability rows out of bounds"
    );
    let lanes = if level == Level::Avx512 { 16 } else { 8 };
    let chunks = dv / lanes;
    for g0 in (0..heads).step_by(4) {
        let gh = (heads - g0).min(4);
        let widest = match (level, gh) {
            (Level::Avx512, 1 | 2) | (_, 1) => 8,
            (Level::Avx512, _) | (_, 2 | 3) => 4,
            _ => 2,
        };
        let mut c0 = 0;
        while c0 < chunks {
            let cw = [8, 4, 2, 1]
                .into_iter()
                .find(|&w| w <= widest && w <= chunks - c0)
                .unwrap_or(1);
            // The first pass over the block fetches the rows read later.
            let ahead = if g0 == 0 && c0 == 0 {
                ahead
            } else {
                &RowsAhead::NONE
            };
            let o = (o[g0 * dv + c0 * lanes..].as_mut_ptr(), dv);
            let p = (p[g0 * BLOCK..].as_ptr(), BLOCK);
            let v = (rows[c0 * lanes..].as_ptr(), v_rs);
            // SAFETY: `level` is this CPU's ([`level`]); heads g0..g0 + gh have
            // rows of o (dv each, of which columns lanes·c0.. + lanes·cw) and of p (n
            // probabilities each), and the n rows of V lie inside `rows` (asserted above).
            unsafe {
                if level == Level::Avx512 {
                    accumulate!(avx512, (gh, cw), (o, p, v, n, ahead))
                } else {
                    accumulate!(avx2, (gh, cw), (o, p, v, n, ahead))
                }
            }
            c0 += cw;
        }
    }
}
