//! Every CUDA kernel variant through NVRTC without a GPU (needs libnvrtc; without it a printed
//! note and a pass, unless `FLASHATTN_REQUIRE_NVRTC=1`, set by `.ci/run`, makes that a failure):
//! - every variant but the Hopper-only ones through the front end for sm_80 (the oldest GPU they
//!   run on; the sources have no arch-conditional code, so sm_80 is the strict target), and the
//!   first and last variant of each family (a kernel, dtype and option set, whatever the tile)
//!   through the whole compile to PTX; the GPU tests build what they reach for the device's arch;
//! - the Hopper-only variants (`KernelSource::hopper_only`) for sm_90a, through ptxas, which must
//!   neither serialize their wgmma nor spill, and (with `cuobjdump` on PATH) SASS with HGMMA, no
//!   local-memory instruction, and no A fragment kept in registers across a loop overwritten in it.
#![cfg(feature = "cuda")]

mod nvrtc_support;

use flashattn::cuda::{self, KernelSource};
use flashattn::{Device, Error, Tensor};
use nvrtc_support::{clobbered_fragments, cuobjdump, nvrtc_here, ptxas_faults, sass_faults};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// The architecture every variant but the Hopper-only ones must compile for.
const ARCH: &str = "sm_80";

#[test]
fn every_kernel_variant_compiles_for_sm80() {
    if !nvrtc_here() {
        return;
    }
    let sources = cuda::kernel_sources();
    assert!(!sources.is_empty(), "no kernel variants listed");
    let mut names: Vec<&str> = sources.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), sources.len(), "variant names must be unique");
    for src in &sources {
        assert!(
            !src.code.contains("#include"),
            "{}: kernels must not include headers (NVRTC gets no include path)",
            src.name
        );
    }
    // NVRTC programs are independent: compile on every core (hundreds of variants). The Hopper-only
    // ones go through ptxas in `hopper_variants_neither_serialize_wgmma_nor_spill`.
    let checked: Vec<&KernelSource> = sources.iter().filter(|s| !s.hopper_only).collect();
    let t0 = std::time::Instant::now();
    let mut failures: Vec<String> = checked
        .par_iter()
        .filter_map(|src| cuda::check_syntax(src, ARCH).err())
        .map(|e| e.to_string())
        .collect();
    let front_end = t0.elapsed().as_secs_f64();
    let t0 = std::time::Instant::now();
    let full = family_ends(&checked);
    let results: Vec<(String, std::result::Result<String, String>)> = full
        .par_iter()
        .map(|src| {
            let t = std::time::Instant::now();
            let r = match cuda::compile_ptx(src, ARCH) {
                Ok(ptx) if ptx.contains(&format!(".entry {}(", src.entry)) => Ok(format!(
                    "{:>7.1} ms {:>8} bytes of PTX",
                    t.elapsed().as_secs_f64() * 1e3,
                    ptx.len()
                )),
                Ok(_) => Err(format!("PTX has no entry `{}`", src.entry)),
                Err(e) => Err(e.to_string()),
            };
            (format!("{:<56} {ARCH:<7}", src.name), r)
        })
        .collect();
    for (what, r) in results {
        match r {
            Ok(line) => println!("{what} {line}"),
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    println!(
        "{} variants ({} sm_90a only, compiled by the Hopper test): {} through the front end in \
         {front_end:.1} s, {} to PTX in {:.1} s",
        sources.len(),
        sources.len() - checked.len(),
        checked.len(),
        full.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The first and last variant (in name order) of each family: the name without its tile and head
/// dim parts, the tokens with a digit (`fwd_mma_bf16_d128x128_128x64w4_mask` is `fwd_mma_bf16_mask`).
fn family_ends<'a>(sources: &[&'a KernelSource]) -> Vec<&'a KernelSource> {
    let mut families: BTreeMap<String, Vec<&KernelSource>> = BTreeMap::new();
    for &src in sources {
        let family: Vec<&str> = src
            .name
            .split('_')
            .filter(|t| {
                !t.contains(|c: char| c.is_ascii_digit())
                    || *t == "f16"
                    || *t == "bf16"
                    || *t == "f32"
            })
            .collect();
        families.entry(family.join("_")).or_default().push(src);
    }
    let mut ends = Vec::new();
    for mut members in families.into_values() {
        members.sort_by(|a, b| a.name.cmp(&b.name));
        ends.push(members[0]);
        if members.len() > 1 {
            ends.push(members[members.len() - 1]);
        }
    }
    ends
}

#[test]
fn hopper_variants_neither_serialize_wgmma_nor_spill() {
    if !nvrtc_here() {
        return;
    }
    let sources: Vec<KernelSource> = cuda::kernel_sources()
        .into_iter()
        .filter(|s| s.hopper_only)
        .collect();
    assert!(!sources.is_empty(), "no Hopper variants listed");
    let tool = cuobjdump();
    let faults: Vec<String> = sources
        .par_iter()
        .flat_map(|src| match cuda::ptxas_report(src, "sm_90a") {
            Ok((cubin, log)) => {
                let mut faults = ptxas_faults(&src.name, &log);
                if let Some(tool) = &tool {
                    faults.extend(sass_faults(tool, &src.name, &cubin));
                }
                faults
            }
            Err(e) => vec![format!("{}: {e}", src.name)],
        })
        .collect();
    let sass = match tool {
        Some(_) => "their SASS too",
        None => "not their SASS (no cuobjdump on PATH)",
    };
    println!("{} Hopper variants checked, {sass}", sources.len());
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

/// The clobber check on a made-up loop whose HGMMA reads R8..R11, loaded before the loop: a MOV
/// into R9 after the HGMMA is flagged; other writes, or R9 rewritten before the HGMMA, are not;
/// with no loop at all the check says it found none.
#[test]
fn an_a_fragment_overwritten_in_its_loop_is_flagged() {
    let sass = |before: &str, after: &str, branch: &str| {
        [
            "/*0000*/ LDS.128 R8, [R2] ;",
            "/*0010*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R3], R4 ;",
            &format!("/*0018*/ {before} ;"),
            "/*0020*/ HGMMA.64x64x16.F32.BF16 R24, R8, gdesc[UR4], RZ, !UPT, gsb0 ;",
            "/*0030*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            &format!("/*0040*/ {after} ;"),
            &format!("/*0050*/ {branch} ;"),
            "/*0060*/ EXIT ;",
        ]
        .map(|l| format!("        {l}   /* 0x0 */\n"))
        .concat()
    };
    let faults = clobbered_fragments(&sass("NOP", "MOV R9, R30", "@P0 BRA 0x10"));
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert!(
        faults[0].contains("R9") && faults[0].contains("0x40"),
        "{faults:?}"
    );
    for clean in [
        sass("NOP", "FADD R60, R24, R25", "@P0 BRA 0x10"),
        sass(
            "F2FP.BF16.F32.PACK_AB R9, R57, R56",
            "MOV R9, R30",
            "@P0 BRA 0x10",
        ),
    ] {
        assert_eq!(clobbered_fragments(&clean), Vec::<String>::new());
    }
    let no_loop = clobbered_fragments(&sass("NOP", "NOP", "BRA 0x10"));
    assert!(
        no_loop.len() == 1 && no_loop[0].contains("no loop"),
        "{no_loop:?}"
    );
}

#[test]
fn a_rejected_kernel_keeps_the_compile_log() {
    if !nvrtc_here() {
        return;
    }
    let src = KernelSource {
        name: "broken".into(),
        code: "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }".into(),
        entry: "broken".into(),
        hopper_only: false,
    };
    match cuda::compile_ptx(&src, "sm_80") {
        Err(Error::Compile { kernel, log }) => {
            assert!(kernel.contains("broken"), "{kernel}");
            assert!(
                log.contains("undeclared_name"),
                "log without the error: {log}"
            );
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn hopper_instructions_need_the_arch_specific_target() {
    if !nvrtc_here() {
        return;
    }
    // setmaxnreg exists on sm_90a only: the arch string reaches NVRTC.
    let src = KernelSource {
        name: "setmaxnreg".into(),
        code: "extern \"C\" __global__ void k() { asm volatile(\"setmaxnreg.inc.sync.aligned.u32 232;\"); }"
            .into(),
        entry: "k".into(),
        hopper_only: true,
    };
    let ptx = cuda::compile_ptx(&src, "sm_90a").expect("sm_90a accepts setmaxnreg");
    assert!(ptx.contains(".target sm_90a"), "{ptx}");
}

#[test]
fn no_gpu_is_a_typed_error_not_a_panic() {
    if cuda::is_available() {
        println!("NOTE: a GPU is present; the no-GPU path is not exercised here");
        return;
    }
    let t = Tensor::from_vec(vec![0.5f32, -1.25, 2.0, 3.5], &[2, 2]).unwrap();
    let err = t.to_device(Device::Cuda(0)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NoCudaDriver(_) | Error::NoCudaDevice { .. } | Error::Cuda(_)
        ),
        "{err:?}"
    );
    println!("{err}");
    // The CPU path keeps working after the failed upload.
    assert_eq!(
        t.to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap(),
        vec![0.5, -1.25, 2.0, 3.5]
    );
}
