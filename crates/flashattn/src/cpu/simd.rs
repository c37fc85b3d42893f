//! Which SIMD kernels the CPU path runs, decided once per process.
//!
//! The widest level the CPU supports is used (AVX-512F, then AVX2 with FMA, then portable Rust),
//! unless the environment variable `FLASHATTN_CPU_SIMD` asks for a lower one (`avx2` or
//! `portable`): for comparing the kernels on one machine and for testing every path there. A
//! request above what the CPU supports, or a value not listed, leaves the detected level.

use std::sync::OnceLock;

/// A family of CPU kernels, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 AVX2 and FMA: 8-lane vectors.
    Avx2,
    /// x86-64 AVX-512F: 16-lane vectors, one per row of a 16-query panel.
    Avx512,
}

impl Simd {
    /// The name `FLASHATTN_CPU_SIMD` takes.
    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512",
        }
    }
}

impl Simd {
    /// Every level, lowest first.
    pub(crate) const ALL: [Simd; 3] = [Simd::Portable, Simd::Avx2, Simd::Avx512];

    /// Every level this CPU runs, lowest first: the unit tests check each kernel at each of
    /// them against one f64 reference and one tolerance, since every level promises the same
    /// results (up to rounding) and the same column maxima.
    #[cfg(test)]
    pub(crate) fn available() -> impl Iterator<Item = Simd> {
        Simd::ALL.into_iter().filter(|&s| s <= cpu_simd())
    }
}

impl std::fmt::Display for Simd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The widest level this CPU supports.
fn detected() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        // The AVX-512 level also runs AVX2 kernels (for odd sizes), as every AVX-512 CPU can.
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            return Simd::Avx512;
        }
        if avx2 {
            return Simd::Avx2;
        }
    }
    Simd::Portable
}

/// The level the CPU kernels use (see the module documentation).
pub fn cpu_simd() -> Simd {
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cpu = detected();
        let asked = std::env::var("FLASHATTN_CPU_SIMD").ok().and_then(|v| {
            Simd::ALL
                .into_iter()
                .find(|s| s.name() == v.trim().to_ascii_lowercase())
        });
        asked.map_or(cpu, |a| a.min(cpu))
    })
}

/// Defines `fn $name(args) -> ret` (the return type may be left out) that runs `$body` (a function marked `#[inline(always)]`)
/// compiled for AVX-512F, for AVX2 with FMA, or for the baseline, by [`cpu_simd`]: plain Rust
/// loops in `$body` then vectorize as wide as the CPU allows (the crate's baseline is SSE2).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                match $crate::cpu::simd::cpu_simd() {
                    // SAFETY: the CPU supports AVX-512F.
                    $crate::cpu::simd::Simd::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: the CPU supports AVX2 and FMA.
                    $crate::cpu::simd::Simd::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::simd::Simd::Portable => {}
                }
            }
            $body($($arg),*)
        }
    };
}

pub(crate) use multiversion;
