//! Whether the NVRTC-only tests can run here: CI (`FLASHATTN_REQUIRE_NVRTC=1`) requires it,
//! elsewhere its absence is a printed note.

use flashattn::cuda;

/// True when NVRTC can be used; otherwise prints why and, if it is required, fails.
pub fn nvrtc_here() -> bool {
    match cuda::nvrtc_version() {
        Ok((major, minor)) => {
            println!("NVRTC {major}.{minor}");
            true
        }
        Err(e) => {
            let required = std::env::var("FLASHATTN_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
            assert!(!required, "FLASHATTN_REQUIRE_NVRTC=1 but {e}");
            println!("NOTE: skipped, {e}");
            false
        }
    }
}
