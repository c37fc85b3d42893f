//! Which SIMD kernels the CPU path runs, decided once per process, and the one place that maps
//! a level to its kernels: [`Kernels`], a table of function pointers per level (`avx512`,
//! `avx2`, `portable`, one file each), of which [`kernels`] returns the process's.
//!
//! The widest level the CPU supports is used (AVX-512F, then AVX2 with FMA and F16C, then
//! portable Rust), unless the environment variable `FLASHATTN_CPU_SIMD` asks for a lower one
//! (`avx2` or `portable`): for comparing the kernels on one machine and for testing every path
//! there. A request above what the CPU supports, or a value not listed, leaves the detected
//! level. Every level promises the same results up to rounding, so the unit tests check each
//! kernel at every level the CPU has (`Simd::available`) against one reference.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod elementwise;
pub(crate) mod exp;
pub(crate) mod lanes;
pub(crate) mod microkernel;
mod portable;
pub(crate) mod softcap;
pub(crate) mod transpose;

use std::sync::OnceLock;

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::decode::Level as DecodeLevel;
use exp::LANES;
use microkernel::PanelKernels;

/// A square transpose kernel of one block size: the block at `src` (row stride `src_rs`) into
/// `dst` (row stride `dst_rs`), its column `c` times `f[c]` when `f` is given.
///
/// # Safety
/// The level's CPU features must be available (they are wherever its table is used); the
/// block's rows must be readable at `src` and writable at `dst`, apart, and `f` must hold a
/// factor per column.
pub(crate) type TransposeBlock =
    unsafe fn(dst: *mut f32, dst_rs: usize, src: *const f32, src_rs: usize, f: Option<*const f32>);

/// The kernels of one level: each operation that the CPU path runs at more than one level.
pub(crate) struct Kernels {
    /// `x[j] = 2^(x[j] − shift)`, returning their sum (see `exp::exp2_shifted_sum`).
    pub(crate) exp2_shifted_sum: fn(&mut [f32], f32) -> f32,
    /// The same per lane of a `rows × 16` panel (see `exp::exp2_shifted_panel`).
    pub(crate) exp2_shifted_panel: fn(&mut [f32], &[f32; LANES]) -> [f32; LANES],
    /// See `lanes::lane_max`, `lanes::scale_lanes`, `lanes::lane_lse`.
    pub(crate) lane_max: fn(&[f32]) -> [f32; LANES],
    pub(crate) scale_lanes: fn(&mut [f32], &[f32; LANES]),
    pub(crate) lane_lse: fn(&[f32; LANES], &[f32; LANES]) -> [f32; LANES],
    /// See `softcap::softcap`.
    pub(crate) softcap: fn(&mut [f32], f32, Option<&mut [f32]>),
    /// See `elementwise::dot`.
    pub(crate) dot: fn(&[f32], &[f32]) -> f32,
    /// See `convert::widen_f16` and `convert::narrow_f16`.
    pub(crate) widen_f16: fn(&[f16], &mut [f32]),
    pub(crate) narrow_f16: fn(&[f32], &mut [f16]),
    /// The square blocks a transpose moves in registers, widest first (see `transpose`).
    pub(crate) transpose_blocks: &'static [(usize, TransposeBlock)],
    /// The panel products (see `microkernel`).
    pub(crate) panels: PanelKernels,
    /// A decoding step's block products (see `decode`).
    #[cfg(target_arch = "x86_64")]
    pub(crate) decode: DecodeLevel,
}

impl Kernels {
    /// The kernels of `level`. Panics above the CPU's level ([`cpu_simd`]): the x86-64 tables
    /// call functions compiled for their level's features, which only that check makes sound.
    pub(crate) fn of(level: Simd) -> &'static Kernels {
        assert!(level <= cpu_simd(), "no {level} kernels on this CPU");
        match level {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => &avx512::KERNELS,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => &avx2::KERNELS,
            _ => &portable::KERNELS,
        }
    }
}

/// The kernels of the process's level ([`cpu_simd`]).
pub(crate) fn kernels() -> &'static Kernels {
    static KERNELS: OnceLock<&'static Kernels> = OnceLock::new();
    KERNELS.get_or_init(|| Kernels::of(cpu_simd()))
}

/// Safe functions over target-feature kernels, for the tables of the x86-64 levels: each calls
/// `$path` with its arguments. Expanded only in the files of those tables, which
/// [`Kernels::of`] hands out only where the CPU has their features.
#[cfg(target_arch = "x86_64")]
macro_rules! checked {
    ($($name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $path:path;)*) => {
        $(
            fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: this table is used only where the CPU has its level's features
                // (`Kernels::of`).
                unsafe { $path($($arg),*) }
            }
        )*
    };
}
#[cfg(target_arch = "x86_64")]
use checked;

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
        // F16C, which every AVX2 processor has, for the decoding kernels' f16 rows.
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
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
