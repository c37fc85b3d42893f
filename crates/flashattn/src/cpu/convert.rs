//! bf16 ↔ f32 and f16 ↔ f32 conversions of whole rows, compiled for the widest SIMD level the
//! CPU has, and [`CpuElement`], the element type of the CPU kernels, which converts with them:
//! the forward widens each query row and key/value block it packs and narrows each output row
//! it writes, the backward likewise with its inputs and gradients. The `half` crate's slice
//! conversions give the same results but run bf16 one element at a time and f16 eight at a
//! time through a call with its own F16C check, which cost the kernels a few percent (see
//! BENCHMARKS.md).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::simd::{kernels, multiversion};
use crate::tensor::HostElement;

/// An element type of the CPU kernels: a host element with the row conversions of this module.
pub(crate) trait CpuElement: HostElement {
    /// `x` itself when `Self` is `f32` (kernels then read it in place), `None` otherwise.
    fn as_f32_slice(x: &[Self]) -> Option<&[f32]>;
    /// Widens `src` into `dst` (equal lengths) with the CPU's vector conversions.
    fn widen_into(src: &[Self], dst: &mut [f32]);
    /// Narrows `src` into `dst` (equal lengths), rounding to nearest even, likewise.
    fn narrow_into(src: &[f32], dst: &mut [Self]);
}

impl CpuElement for f32 {
    fn as_f32_slice(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }
    fn widen_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl CpuElement for f16 {
    fn as_f32_slice(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn widen_into(src: &[f16], dst: &mut [f32]) {
        widen_f16(src, dst);
    }
    fn narrow_into(src: &[f32], dst: &mut [f16]) {
        narrow_f16(src, dst);
    }
}

impl CpuElement for bf16 {
    fn as_f32_slice(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn widen_into(src: &[bf16], dst: &mut [f32]) {
        widen_bf16(src, dst);
    }
    fn narrow_into(src: &[f32], dst: &mut [bf16]) {
        narrow_bf16(src, dst);
    }
}

/// `dst[i] = src[i]` as f32 (exact). Equal lengths. With AVX-512F, 16 elements per
/// `vcvtph2ps`; otherwise `half`'s slice conversion (F16C where the CPU has it). Panics if the
/// lengths differ (every level checks).
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    (kernels().widen_f16)(src, dst);
}

/// `dst[i] = src[i]` rounded to the nearest f16, ties to even. Equal lengths. With AVX-512F,
/// 16 elements per `vcvtps2ph`; otherwise `half`'s slice conversion.
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    (kernels().narrow_f16)(src, dst);
}

/// [`widen_f16`] by `half` (F16C where the CPU has it), the levels below AVX-512.
pub(crate) fn widen_f16_half(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}

/// [`narrow_f16`] by `half`, the levels below AVX-512.
pub(crate) fn narrow_f16_half(src: &[f32], dst: &mut [f16]) {
    dst.convert_from_f32_slice(src);
}

/// [`widen_f16`] with AVX-512F. Safety: AVX-512F available. Panics if the lengths differ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn widen_f16_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert_eq!(src.len(), dst.len(), "widen_f16: lengths differ");
    let whole = src.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: elements i..i + 16 lie inside both slices (i + 16 ≤ whole ≤ len).
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    src[whole..].convert_to_f32_slice(&mut dst[whole..]);
}

/// [`narrow_f16`] with AVX-512F. Safety: AVX-512F available. Panics if the lengths differ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn narrow_f16_avx512(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::*;
    assert_eq!(src.len(), dst.len(), "narrow_f16: lengths differ");
    let whole = src.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: elements i..i + 16 lie inside both slices (i + 16 ≤ whole ≤ len).
        unsafe {
            let v = _mm512_loadu_ps(src.as_ptr().add(i));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    dst[whole..].convert_from_f32_slice(&src[whole..]);
}

multiversion! {
    /// `dst[i] = src[i]` as f32 (exact: a bf16 is the upper half of an f32). Equal lengths.
    pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) = widen_rows;
}

multiversion! {
    /// `dst[i] = src[i]` rounded to the nearest bf16, ties to even, as `half`'s
    /// `bf16::from_f32` rounds (a NaN stays a NaN of the same sign, quieted). Equal lengths.
    pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) = narrow_rows;
}

#[inline(always)]
fn widen_rows(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_bf16: lengths differ");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

#[inline(always)]
fn narrow_rows(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "narrow_bf16: lengths differ");
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        // Adding 0x7FFF plus the last kept bit rounds the 16 dropped bits to nearest, ties to
        // even (a carry into the exponent gives the next binade, or infinity).
        let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
        let nan = (b >> 16) | 0x40;
        let bits = if b & 0x7FFF_FFFF > 0x7F80_0000 {
            nan
        } else {
            rounded
        };
        *d = bf16::from_bits(bits as u16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::{Kernels, Simd};
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    /// f16 rows against `half`'s scalar conversions, bit for bit, at every level the CPU has:
    /// every f16 widened, and a million random f32 bit patterns narrowed (every class: zeros,
    /// subnormals, normals, infinities, NaNs of both signs), plus the edges of f16 rounding;
    /// rows of every length up to 40, so that the 16-element steps and the tails both run.
    #[test]
    fn f16_conversions_match_half() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let seed = 0x05EE_DF16;
        println!("seed {seed:#x}");
        let mut rng = StdRng::seed_from_u64(seed);
        let mut bits: Vec<u32> = vec![0x3380_0000, 0x3380_0001, 0x477F_E000, 0x477F_F000];
        bits.extend([
            0x3F80_1000u32,
            0x3F80_3000,
            0x3F80_0FFF,
            0x387F_C000,
            0xC77F_F000,
        ]);
        bits.extend((0..1 << 20).map(|_| rng.random::<u32>()));
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        for level in Simd::available() {
            let k = Kernels::of(level);
            let mut wide = vec![f32::NAN; all.len()];
            (k.widen_f16)(&all, &mut wide);
            for (&got, &h) in wide.iter().zip(&all) {
                assert_eq!(
                    got.to_bits(),
                    h.to_f32().to_bits(),
                    "{level} {:#x}",
                    h.to_bits()
                );
            }
            let mut narrow = vec![f16::from_bits(0x1234); x.len()];
            (k.narrow_f16)(&x, &mut narrow);
            for (i, (&got, &v)) in narrow.iter().zip(&x).enumerate() {
                let want = f16::from_f32(v).to_bits();
                assert_eq!(got.to_bits(), want, "{level} {:#x} (#{i})", bits[i]);
            }
            for len in 0..=40 {
                let mut w = vec![f32::NAN; len];
                (k.widen_f16)(&narrow[7..7 + len], &mut w);
                let mut n = vec![f16::from_bits(0x1234); len];
                (k.narrow_f16)(&w, &mut n);
                assert_eq!(n, &narrow[7..7 + len], "{level} length {len}");
            }
        }
    }

    /// Against `half`'s scalar conversions: special values, the edges of rounding, and a
    /// million random bit patterns (every class of f32: zeros, subnormals, normals, infinities,
    /// NaNs of both signs).
    #[test]
    fn conversions_match_half() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x0000_0001,
            0x007F_FFFF,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F7F_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
        ];
        let seed = 0x05EE_DB16;
        println!("seed {seed:#x}");
        let mut rng = StdRng::seed_from_u64(seed);
        bits.extend((0..1 << 20).map(|_| rng.random::<u32>()));
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut narrow = vec![bf16::from_bits(0x1234); x.len()];
        narrow_bf16(&x, &mut narrow);
        for (i, (&got, &v)) in narrow.iter().zip(&x).enumerate() {
            assert_eq!(
                got.to_bits(),
                bf16::from_f32(v).to_bits(),
                "{:#x} (#{i})",
                bits[i]
            );
        }
        let mut wide = vec![f32::NAN; x.len()];
        widen_bf16(&narrow, &mut wide);
        for (&got, &h) in wide.iter().zip(&narrow) {
            assert_eq!(got.to_bits(), h.to_f32().to_bits(), "{:#x}", h.to_bits());
        }
    }
}
