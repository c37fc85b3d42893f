//! AVX2 kernels of a decoding step, the same two products as [`super::avx512`]'s on 8-lane
//! vectors: the scores as dot products (lanes along the head dim, 8 dot products reduced
//! together by horizontal adds), and `O += P · V` with the value dims as lanes. K and V rows
//! are read in place in their own dtype and widened to f32 as they are loaded (f16 by F16C,
//! which every AVX2 processor has and [`super::kernels::level`] checks).

use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::cpu::prefetch::RowsAhead;

/// Lanes of a vector.
const L: usize = 8;

/// An element type the kernels read in place: 8 of them widened to f32.
pub(super) trait Load: Copy {
    /// The `n ≤ 8` elements at `p` as the first `n` lanes, zeros after.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available and `p..p + min(n, 8)` readable.
    unsafe fn load(p: *const Self, n: usize) -> __m256;
}

/// The first `min(n, 8)` elements at `p`, zeros after: read directly when 8 are readable, else
/// from a zero-padded copy (a row's last, short chunk).
///
/// # Safety
/// `p..p + min(n, 8)` must be readable.
#[inline]
unsafe fn padded<E: Copy + Default>(p: *const E, n: usize) -> [E; L] {
    let mut a = [E::default(); L];
    // SAFETY: the caller's contract; `a` holds 8 elements.
    unsafe { std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), n.min(L)) };
    a
}

/// 8 two-byte elements (f16 or bf16 bits) at `p` as 16-bit lanes.
///
/// # Safety
/// AVX2 must be available and `p..p + min(n, 8)` readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(p: *const u16, n: usize) -> __m128i {
    // SAFETY: the caller's contract.
    unsafe {
        if n >= L {
            return _mm_loadu_si128(p.cast());
        }
        let a = padded(p, n);
        _mm_loadu_si128(a.as_ptr().cast())
    }
}

impl Load for f32 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const f32, n: usize) -> __m256 {
        // SAFETY: 8 readable f32, or the n copied.
        unsafe {
            if n >= L {
                _mm256_loadu_ps(p)
            } else {
                let a = padded(p, n);
                _mm256_loadu_ps(a.as_ptr())
            }
        }
    }
}

impl Load for bf16 {
    /// A bf16 is the upper half of the f32 of the same value.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const bf16, n: usize) -> __m256 {
        // SAFETY: the caller's contract.
        let raw = unsafe { halves(p.cast(), n) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
    }
}

impl Load for f16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const f16, n: usize) -> __m256 {
        // SAFETY: the caller's contract.
        _mm256_cvtph_ps(unsafe { halves(p.cast(), n) })
    }
}

/// Lane `i` of the result is the sum of the 8 lanes of `acc[i]`: 6 horizontal adds, 2 lane
/// permutes and an add for 8 sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce8(acc: [__m256; L]) -> __m256 {
    // Lanes 0-3 of each 128-bit half: partial sums of acc[2k] and acc[2k + 1].
    let t: [__m256; 4] = std::array::from_fn(|k| _mm256_hadd_ps(acc[2 * k], acc[2 * k + 1]));
    // Lane i of each half holds a partial sum of acc[4m + i].
    let u = [_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3])];
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u[0], u[1]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[1]),
    )
}

/// `s[g·s_rs + j] = q[g·q_rs..][..d] · k[j·k_rs..][..d]` for `HP` heads (1, 2 or 4) and `n`
/// keys (`j < n`); lanes `n..` of each head's last group of `8 / HP` keys get values of no
/// meaning. Row `j` of `ahead` is fetched as key `j` is read, its rows past `n` at the end.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `q` must hold `HP` rows of `d` at stride `q_rs`, `k`
/// `n ≥ 1` rows of `d` at stride `k_rs`, and `s` `HP` rows at stride `s_rs` of at least `n`
/// rounded up to `8 / HP`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<const HP: usize, E: Load>(
    (q, q_rs): (*const f32, usize),
    (k, k_rs): (*const E, usize),
    (s, s_rs): (*mut f32, usize),
    d: usize,
    n: usize,
    ahead: &RowsAhead,
) {
    let keys = L / HP;
    let chunks = d.div_ceil(L);
    for j0 in (0..n).step_by(keys) {
        for kk in 0..keys {
            ahead.fetch(j0 + kk);
        }
        // Keys past n repeat the group's first row (read, never stored past the row's end).
        let row = |kk: usize| {
            let j = if j0 + kk < n { j0 + kk } else { j0 };
            // SAFETY: key j < n is a row of K.
            unsafe { k.add(j * k_rs) }
        };
        let mut acc = [_mm256_setzero_ps(); L];
        for c in 0..chunks {
            let width = d - c * L;
            // SAFETY: the first min(width, 8) elements of chunk c lie inside each row of d.
            let qv: [__m256; HP] =
                std::array::from_fn(|g| unsafe { f32::load(q.add(g * q_rs + c * L), width) });
            for kk in 0..keys {
                // SAFETY: as above, for a row of K.
                let kv = unsafe { E::load(row(kk).add(c * L), width) };
                for (g, qv) in qv.iter().enumerate() {
                    let a = g * keys + kk;
                    acc[a] = _mm256_fmadd_ps(*qv, kv, acc[a]);
                }
            }
        }
        let mut lanes = [0f32; L];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), reduce8(acc)) };
        for g in 0..HP {
            // SAFETY: row g of s holds at least j0 + keys values (the caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    lanes.as_ptr().add(g * keys),
                    s.add(g * s_rs + j0),
                    keys,
                )
            };
        }
    }
    ahead.fetch_from(n.next_multiple_of(keys));
}

/// `o[g·o_rs + 8c..][..8] += Σ_j p[g·p_rs + j] · v[j·v_rs + 8c..][..8]` for `GH` heads, `CW`
/// chunks of 8 value dims and `n` keys, the block of `GH × CW` accumulators kept in registers
/// over the keys. Row `j` of `ahead` is fetched as key `j` is read, its rows past `n` at the
/// end.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `o` must hold `GH` writable rows of `8·CW` at stride
/// `o_rs`, `p` `GH` rows of `n` at stride `p_rs`, `v` `n` rows of `8·CW` at stride `v_rs`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate<const GH: usize, const CW: usize, E: Load>(
    (o, o_rs): (*mut f32, usize),
    (p, p_rs): (*const f32, usize),
    (v, v_rs): (*const E, usize),
    n: usize,
    ahead: &RowsAhead,
) {
    // SAFETY: rows g < GH of o hold 8·CW values (the caller's contract).
    let mut acc: [[__m256; CW]; GH] = std::array::from_fn(|g| {
        std::array::from_fn(|c| unsafe { _mm256_loadu_ps(o.add(g * o_rs + c * L)) })
    });
    for j in 0..n {
        ahead.fetch(j);
        // SAFETY: row j < n of v holds 8·CW values, row g < GH of p n values.
        unsafe {
            let vv: [__m256; CW] = std::array::from_fn(|c| E::load(v.add(j * v_rs + c * L), L));
            for (g, acc) in acc.iter_mut().enumerate() {
                let pb = _mm256_set1_ps(*p.add(g * p_rs + j));
                for (a, x) in acc.iter_mut().zip(&vv) {
                    *a = _mm256_fmadd_ps(pb, *x, *a);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(o.add(g * o_rs + c * L), *a) };
        }
    }
    ahead.fetch_from(n);
}
