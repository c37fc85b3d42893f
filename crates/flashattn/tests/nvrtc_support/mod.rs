//! Whether the NVRTC-only tests can run here: CI (`FLASHATTN_REQUIRE_NVRTC=1`) requires it,
//! elsewhere its absence is a printed note; and what a Hopper build's ptxas report must not show.

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

/// What ptxas's verbose report `log` of the variant `name` shows that a wgmma build must not:
/// a warning such as "wgmma.mma_async instructions are serialized" (C7510, C7515, ...), or spills
/// (one report line per kernel gives them).
pub fn ptxas_faults(name: &str, log: &str) -> Vec<String> {
    let mut faults = Vec::new();
    let lower = log.to_lowercase();
    if lower.contains("serialized") || lower.contains("warning") {
        faults.push(format!("{name}: ptxas warned:\n{log}"));
    }
    for line in log.lines().filter(|l| l.contains("spill")) {
        if !line.contains("0 bytes spill stores, 0 bytes spill loads") {
            faults.push(format!("{name}: {line}"));
        }
    }
    faults
}
