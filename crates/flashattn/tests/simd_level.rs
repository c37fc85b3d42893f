//! `FLASHATTN_CPU_SIMD` forces a lower kernel level, never a higher one (CI runs the numeric
//! tests once per level with it).

use flashattn::{Simd, cpu_simd};

#[test]
fn the_environment_lowers_the_level_and_never_raises_it() {
    let asked = std::env::var("FLASHATTN_CPU_SIMD").ok();
    let level = cpu_simd();
    println!("FLASHATTN_CPU_SIMD={asked:?}: {level}");
    match asked.as_deref() {
        Some("portable") => assert_eq!(level, Simd::Portable),
        Some("avx2") => assert!(level <= Simd::Avx2),
        _ => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    assert_eq!(level, Simd::Portable);
    #[cfg(target_arch = "x86_64")]
    if level == Simd::Avx512 {
        assert!(std::arch::is_x86_feature_detected!("avx512f"));
    }
}
