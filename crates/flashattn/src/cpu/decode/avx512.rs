//! AVX-512F kernels of a decoding step: the scores as dot products (lanes along the head dim,
//! 16 dot products reduced together by a tree of lane shuffles), and `O += P · V` with
//! the value dims as lanes. K and V rows are read in place in their own dtype and widened to f32
//! as they are loaded.

use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::cpu::prefetch::RowsAhead;

/// Lanes of a vector.
const L: usize = 16;

/// An element type the kernels read in place: 16 of them widened to f32.
pub(super) trait Load: Copy {
    /// The `n ≤ 16` elements at `p` as the first `n` lanes, zeros after.
    ///
    /// # Safety
    /// AVX-512F must be available and `p..p + n` readable.
    unsafe fn load(p: *const Self, n: usize) -> __m512;
}

/// 16 two-byte elements (f16 or bf16 bits) at `p` as 16-bit lanes: loaded directly when
/// `n ≥ 16` are readable, else the first `n` from a zero-padded copy (a row's last, short chunk).
///
/// # Safety
/// AVX-512F must be available and `p..p + min(n, 16)` readable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn halves(p: *const u16, n: usize) -> __m256i {
    // SAFETY: the caller's contract; `a` holds 16 elements of 2 bytes.
    unsafe {
        if n >= L {
            return _mm256_loadu_si256(p.cast());
        }
        let mut a = [0u16; L];
        std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), n);
        _mm256_loadu_si256(a.as_ptr().cast())
    }
}

impl Load for f32 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f32, n: usize) -> __m512 {
        // SAFETY: 16 readable f32, or the n under the mask.
        unsafe {
            if n >= L {
                _mm512_loadu_ps(p)
            } else {
                _mm512_maskz_loadu_ps((1 << n) - 1, p)
            }
        }
    }
}

impl Load for bf16 {
    /// A bf16 is the upper half of the f32 of the same value.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const bf16, n: usize) -> __m512 {
        // SAFETY: the caller's contract.
        let raw = unsafe { halves(p.cast(), n) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
    }
}

impl Load for f16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f16, n: usize) -> __m512 {
        // SAFETY: the caller's contract.
        _mm512_cvtph_ps(unsafe { halves(p.cast(), n) })
    }
}

/// Where the score of (head `g`, key `kk`) of a pass over `16 / HP` keys and `HP` heads leaves
/// the reduction tree of [`reduce16`]: lane `(16 / HP)·g + kk`, which the tree fills from
/// accumulator `4·(lane % 4) + lane / 4`.
const fn slot<const HP: usize>(g: usize, kk: usize) -> usize {
    let lane = (L / HP) * g + kk;
    4 * (lane % 4) + lane / 4
}

/// Lane `4i + e` of the result is the sum of the 16 lanes of `acc[4e + i]`: 30 shuffles and 15
/// adds for 16 sums.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16(acc: [__m512; 16]) -> __m512 {
    // 16 → 8: each 256-bit half holds 8 partial sums of one accumulator.
    let t: [__m512; 8] = std::array::from_fn(|k| {
        let (a, b) = (acc[2 * k], acc[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // 8 → 4: 128-bit lane i of u[m] holds 4 partial sums of acc[4m + i].
    let u: [__m512; 4] = std::array::from_fn(|m| {
        let (a, b) = (t[2 * m], t[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // 4 → 2: in 128-bit lane i, elements 0-1 hold acc[8n + i], elements 2-3 acc[8n + 4 + i].
    let w: [__m512; 2] = std::array::from_fn(|n| {
        let (a, b) = (u[2 * n], u[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(w[0], w[1]),
        _mm512_shuffle_ps::<0xDD>(w[0], w[1]),
    )
}

/// `s[g·s_rs + j] = q[g·q_rs..][..d] · k[j·k_rs..][..d]` for `HP` heads and `n` keys
/// (`j < n`); lanes `n..` of each head's last group of `16 / HP` keys get values of no meaning.
/// Row `j` of `ahead` is fetched as key `j` is read, its rows past `n` at the end.
///
/// # Safety
/// AVX-512F must be available; `q` must hold `HP` rows of `d` at stride `q_rs`, `k` `n ≥ 1`
/// rows of `d` at stride `k_rs`, and `s` `HP` rows at stride `s_rs` of at least `n` rounded up
/// to `16 / HP`.
#[target_feature(enable = "avx512f")]
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
        let mut acc = [_mm512_setzero_ps(); L];
        for c in 0..chunks {
            let width = d - c * L;
            // SAFETY: the first min(width, 16) elements of chunk c lie inside each row of d.
            let qv: [__m512; HP] =
                std::array::from_fn(|g| unsafe { f32::load(q.add(g * q_rs + c * L), width) });
            for kk in 0..keys {
                // SAFETY: as above, for a row of K.
                let kv = unsafe { E::load(row(kk).add(c * L), width) };
                for (g, qv) in qv.iter().enumerate() {
                    let a = slot::<HP>(g, kk);
                    acc[a] = _mm512_fmadd_ps(*qv, kv, acc[a]);
                }
            }
        }
        let z = reduce16(acc);
        let mut lanes = [0f32; L];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), z) };
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

/// `o[g·o_rs + 16c..][..16] += Σ_j p[g·p_rs + j] · v[j·v_rs + 16c..][..16]` for `GH` heads,
/// `CW` chunks of 16 value dims and `n` keys, the block of `GH × CW` accumulators kept in
/// registers over the keys. Row `j` of `ahead` is fetched as key `j` is read, its rows past `n`
/// at the end.
///
/// # Safety
/// AVX-512F must be available; `o` must hold `GH` writable rows of `16·CW` at stride `o_rs`,
/// `p` `GH` rows of `n` at stride `p_rs`, `v` `n` rows of `16·CW` at stride `v_rs`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn accumulate<const GH: usize, const CW: usize, E: Load>(
    (o, o_rs): (*mut f32, usize),
    (p, p_rs): (*const f32, usize),
    (v, v_rs): (*const E, usize),
    n: usize,
    ahead: &RowsAhead,
) {
    // SAFETY: rows g < GH of o hold 16·CW values (the caller's contract).
    let mut acc: [[__m512; CW]; GH] = std::array::from_fn(|g| {
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(o.add(g * o_rs + c * L)) })
    });
    for j in 0..n {
        ahead.fetch(j);
        // SAFETY: row j < n of v holds 16·CW values, row g < GH of p n values.
        unsafe {
            let vv: [__m512; CW] = std::array::from_fn(|c| E::load(v.add(j * v_rs + c * L), L));
            for (g, acc) in acc.iter_mut().enumerate() {
                let pb = _mm512_set1_ps(*p.add(g * p_rs + j));
                for (a, x) in acc.iter_mut().zip(&vv) {
                    *a = _mm512_fmadd_ps(pb, *x, *a);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(o.add(g * o_rs + c * L), *a) };
        }
    }
    ahead.fetch_from(n);
}
