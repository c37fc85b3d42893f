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
/// local-memory instructions (LDL, STL), a WARPGROUP.ARRIVE for every other HGMMA or more
/// (ptxas serialized the wgmma; it does not always warn when it does), or a clobbered A fragment
/// (see [`clobbered_fragments`]).
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
    faults.extend(
        clobbered_fragments(&sass)
            .into_iter()
            .map(|f| format!("{name}: {f}")),
    );
    let count = |op: &str| sass.matches(op).count();
    let (hgmma, arrive) = (count("HGMMA."), count("WARPGROUP.ARRIVE"));
    if 2 * arrive >= hgmma {
        faults.push(format!(
            "{name}: {arrive} WARPGROUP.ARRIVE for {hgmma} HGMMA: serialized wgmma"
        ));
    }
    faults
}

/// One SASS instruction: its address and its text (guard, opcode, operands), `;` dropped.
fn instructions(sass: &str) -> Vec<(u64, &str)> {
    sass.lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("/*")?;
            let (addr, rest) = rest.split_once("*/")?;
            let text = rest.split(';').next()?.trim();
            Some((u64::from_str_radix(addr, 16).ok()?, text))
        })
        .collect()
}

/// `text` without its guard predicate (`@P0 `, `@!UP1 `).
fn unguarded(text: &str) -> &str {
    match text.strip_prefix('@') {
        Some(guarded) => guarded.split_once(' ').map_or("", |(_, t)| t.trim_start()),
        None => text,
    }
}

/// The registers `text` writes: an HGMMA's accumulators (N/2 from its shape), else its first
/// register operand (after the predicate that SHFL and ATOM write first), two of them for 64-bit
/// forms (not funnel shifts, which write one) and CS2R, four for `.128`.
fn written(text: &str) -> Vec<u32> {
    let Some((op, operands)) = unguarded(text).split_once(' ') else {
        return Vec::new();
    };
    let mut operands = operands.split(',').map(str::trim);
    let mut first = operands.next().unwrap_or("");
    if ["SHFL", "ATOM"].iter().any(|o| op.starts_with(o)) && !first.starts_with('R') {
        first = operands.next().unwrap_or("");
    }
    let Some(reg) = first.strip_prefix('R').and_then(|n| n.parse::<u32>().ok()) else {
        return Vec::new();
    };
    let width = if let Some(shape) = op.strip_prefix("HGMMA.64x") {
        shape
            .split('x')
            .next()
            .and_then(|n| n.parse::<u32>().ok())
            .map_or(1, |n| n / 2)
    } else if op.contains(".128") {
        4
    } else if !op.starts_with("SHF")
        && (op.contains("64") || op.contains(".WIDE") || op.starts_with("CS2R"))
    {
        2
    } else {
        1
    };
    (reg..reg + width).collect()
}

/// A-operand registers of a register-A HGMMA inside a loop that were loaded from shared memory
/// before the loop and not rewritten before the HGMMA in the iteration, yet are overwritten later
/// in it: the next iteration's HGMMA would read the wrong values. ptxas (CUDA 13.0) did this to
/// the narrow backward's K and V fragments in its deterministic variants. (A fragment prefetched
/// by a shared load after its HGMMA would be flagged too; no kernel does that.)
pub fn clobbered_fragments(sass: &str) -> Vec<String> {
    let ins = instructions(sass);
    let writes: Vec<(u64, &str, Vec<u32>)> = ins.iter().map(|&(a, t)| (a, t, written(t))).collect();
    // Loops end in a conditional backward branch; the unconditional ones come back from the
    // retry blocks of mbarrier waits placed after the kernel's exits.
    let back_edges: Vec<(u64, u64)> = ins
        .iter()
        .filter_map(|&(a, t)| {
            let conditional = t.starts_with('@') && t.contains(" BRA");
            let target = t.rsplit(' ').next()?.strip_prefix("0x")?;
            let target = u64::from_str_radix(target, 16).ok()?;
            (conditional && target < a).then_some((target, a))
        })
        .collect();
    let register_a = |t: &str| {
        let operand = unguarded(t).strip_prefix("HGMMA")?.split(", ").nth(1)?;
        operand.strip_prefix('R')?.parse::<u32>().ok()
    };
    let hgmmas: Vec<(u64, u32)> = ins
        .iter()
        .filter_map(|&(x, t)| Some((x, register_a(t)?)))
        .collect();
    let mut faults = Vec::new();
    if !hgmmas.is_empty()
        && !hgmmas
            .iter()
            .any(|&(x, _)| back_edges.iter().any(|&(s, e)| (s..=e).contains(&x)))
    {
        faults.push(
            "no loop found around its register-A HGMMAs (has the SASS format changed?)".into(),
        );
    }
    for &(start, end) in &back_edges {
        for &(x, a) in hgmmas.iter().filter(|&&(x, _)| (start..=end).contains(&x)) {
            for r in a..a + 4 {
                let writes_in = |lo: u64, hi: u64| {
                    writes
                        .iter()
                        .filter(move |w| (lo..hi).contains(&w.0) && w.2.contains(&r))
                };
                let loaded_before = writes
                    .iter()
                    .rev()
                    .find(|w| w.0 < start && w.2.contains(&r));
                let shared = loaded_before.is_some_and(|w| unguarded(w.1).starts_with("LDS"));
                if shared
                    && writes_in(start, x).next().is_none()
                    && let Some(w) = writes_in(x + 1, end + 1).next()
                {
                    faults.push(format!(
                        "R{r}, an A fragment of the HGMMA at {x:#x} loaded before the loop at \
                         {start:#x}, is overwritten at {:#x} ({})",
                        w.0, w.1
                    ));
                    break; // one report an HGMMA
                }
            }
        }
    }
    faults
}
