//! bf16 ↔ f32 conversions of whole rows, compiled for the widest SIMD level the CPU has: the
//! forward widens each bf16 query row and key/value block it packs and narrows each output row
//! it writes. The `half` crate's slice conversions give the same results but run bf16 one
//! element at a time (its f16 conversions use F16C and are kept). bf16, B=1, H=8, D=64, causal,
//! 2 threads, three alternating rounds with the K/V rows fetched ahead as they are converted
//! (`key_rows`), fastest of 30 calls: N=1024 2703–3115 → 2630–2739 µs, N=4096 40.5–41.6 →
//! 39.6–39.9 ms (2026-11-24).

use half::bf16;

use super::simd::multiversion;

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
    use rand::{RngExt, SeedableRng, rngs::StdRng};

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
