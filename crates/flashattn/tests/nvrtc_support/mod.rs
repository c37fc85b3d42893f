//! Whether the NVRTC-only tests can run here: CI (`FLASHATTN_REQUIRE_NVRTC=1`) requires it,
//! elsewhere its absence is a printed note; and what a Hopper build's ptxas report and SASS must
//! not show.

use std::path::{Path, PathBuf};
use std::process::Command;

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
/// a warning such as "wgmma.mma_async instructions are serialized" (C7510, C7515, ...), a
/// warpgroup arrive or wait it injected (C7517, C7519: an "info" line), or spills (one report
/// line per kernel gives them).
pub fn ptxas_faults(name: &str, log: &str) -> Vec<String> {
    let mut faults = Vec::new();
    let lower = log.to_lowercase();
    if lower.contains("serialized") || lower.contains("warning") || lower.contains("is injected") {
        faults.push(format!("{name}: ptxas warned:\n{log}"));
    }
    for line in log.lines().filter(|l| l.contains("spill")) {
        if !line.contains("0 bytes spill stores, 0 bytes spill loads") {
            faults.push(format!("{name}: {line}"));
        }
    }
    faults
}

/// `cuobjdump` when it is on PATH (the SASS checks need it).
pub fn cuobjdump() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("cuobjdump"))
        .find(|tool| tool.is_file())
}

/// What the SASS of the wgmma build `cubin` of `name` shows that it must not: no HGMMA at all,
/// local-memory instructions (LDL, STL), or a WARPGROUP.ARRIVE for every other HGMMA or more
/// (ptxas serialized the wgmma; it does not always warn when it does).
pub fn sass_faults(tool: &Path, name: &str, cubin: &[u8]) -> Vec<String> {
    let file = std::env::temp_dir().join(format!("flashattn-{}-{name}.cubin", std::process::id()));
    if let Err(e) = std::fs::write(&file, cubin) {
        return vec![format!("{name}: cannot write {}: {e}", file.display())];
    }
    let run = Command::new(tool).arg("-sass").arg(&file).output();
    let _ = std::fs::remove_file(&file);
    let sass = match run {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => {
            return vec![format!(
                "{name}: cuobjdump: {}",
                String::from_utf8_lossy(&out.stderr)
            )];
        }
        Err(e) => return vec![format!("{name}: cuobjdump: {e}")],
    };
    let mut faults = Vec::new();
    if !sass.contains("HGMMA") {
        faults.push(format!("{name}: no HGMMA in the SASS"));
    }
    let local = sass
        .split_whitespace()
        .filter(|t| {
            ["LDL", "STL"]
                .iter()
                .any(|op| t == op || t.starts_with(&format!("{op}.")))
        })
        .count();
    if local > 0 {
        faults.push(format!(
            "{name}: {local} local-memory instructions in the SASS"
        ));
    }
    let count = |op: &str| sass.matches(op).count();
    let (hgmma, arrive) = (count("HGMMA."), count("WARPGROUP.ARRIVE"));
    if 2 * arrive >= hgmma {
        faults.push(format!(
            "{name}: {arrive} WARPGROUP.ARRIVE for {hgmma} HGMMA: serialized wgmma"
        ));
    }
    faults
}
