"""Variant harness for the forward kernels (llm.c style): validates each variant against a float64
reference, then times it beside PyTorch SDPA. Needs only torch and the CUDA driver + NVRTC (ctypes),
so kernel variants can be tried on the device before the Rust side runs them.

    python3 kernels/harness.py compile [--arch sm_90a] [--kernels wgmma]   # every listed variant compiles
    python3 kernels/harness.py check [--quick]                 # correctness of each variant (GPU)
    python3 kernels/harness.py bench [--variants a,b] [--dims 64,128]   # TFLOP/s, bf16, the issue's shapes
    python3 kernels/harness.py prof --variants a --dims 128 --n 4096 [--causal]   # one launch each, for ncu

Variants: VARIANTS (flash_fwd_mma.cu), WGMMA (flash_fwd_wgmma.cu, sm_90a; `compile` flags serialized
wgmma and spills), GENERAL (flash_fwd_general.cu).
"""
import argparse, ctypes, math, os, re, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))

def source(kernel, defines):
    """The translation unit; a `_FILE` entry replaces the kernel's own file (see HARNESS_AB)."""
    defines = dict(defines)
    main = defines.pop("_FILE", None)
    parts = [f"#define {k} {v}" for k, v in defines.items()]
    headers = ["types.cuh", "block_info.cuh", "mask.cuh", "softmax.cuh"]
    files = headers + {"mma": ["mma.cuh", "flash_fwd_mma.cu"], "general": ["flash_fwd_general.cu"],
                       "wgmma": ["mma.cuh", "hopper.cuh", "flash_fwd_wgmma.cu"]}[kernel]
    if main:
        files[-1] = main
    for f in files:
        parts.append(open(os.path.join(HERE, f)).read())
    return "\n".join(parts)

def load_nvrtc():
    for name in ["libnvrtc.so.13", "libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    raise SystemExit("libnvrtc not found")

def compile_cubin(src, arch, name="k.cu"):
    nv = load_nvrtc()
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert rc == 0, rc
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=true", "-lineinfo", "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    t0 = time.time()
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    dt = time.time() - t0
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(f"NVRTC failed ({rc}):\n{log.value.decode()}")
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log.value.decode(), dt

# name -> (kernel, defines). The tensor-core variants differ in tiles only; options are defines too.
def mma_defines(dqk, dv, br, bc, nwarps, q_in_regs, min_blocks, slack=8, dtype="bf16"):
    return {f"ELEM_{dtype.upper()}": 1, "DQK": dqk, "DV": dv, "BR": br, "BC": bc, "NWARPS": nwarps,
            "Q_IN_REGS": q_in_regs, "MIN_BLOCKS": min_blocks, "RESCALE_SLACK": slack}

VARIANTS = {
    "d64_128x64_w4": mma_defines(64, 64, 128, 64, 4, 1, 2),
    "d64_128x64_w4_exact": mma_defines(64, 64, 128, 64, 4, 1, 2, 0),
    "d64_128x128_w4_qs": mma_defines(64, 64, 128, 128, 4, 0, 1),
    "d64_128x128_w4_qs_exact": mma_defines(64, 64, 128, 128, 4, 0, 1, 0),
    "d128_128x64_w4": mma_defines(128, 128, 128, 64, 4, 0, 1),
    "d128_128x64_w4_exact": mma_defines(128, 128, 128, 64, 4, 0, 1, 0),
    "d128_128x32_w4": mma_defines(128, 128, 128, 32, 4, 0, 2),
    "d128_128x32_w4_exact": mma_defines(128, 128, 128, 32, 4, 0, 2, 0),
    "d256_64x32_w4": mma_defines(256, 256, 64, 32, 4, 0, 1),
    "d256_64x64_w4": mma_defines(256, 256, 64, 64, 4, 0, 1),
    "d256_128x32_w8": mma_defines(256, 256, 128, 32, 8, 0, 1),
    "d256_128x64_w8": mma_defines(256, 256, 128, 64, 8, 0, 1),
}

# The wgmma variants (sm_90a, flash_fwd_wgmma.cu): a producer warpgroup and NWG consumer
# warpgroups of 64 rows each, BC keys a block, a K/V ring of STAGES slots.
def wgmma_defines(d, bc, nwg=2, stages=2, section_mb=8, slack=8, dtype="bf16"):
    return {f"ELEM_{dtype.upper()}": 1, "DQK": d, "DV": d, "BR": 64 * nwg, "BC": bc, "NWG": nwg,
            "STAGES": stages, "SECTION_MB": section_mb, "RESCALE_SLACK": slack}

WGMMA = {
    "wgmma_d64_128x128": wgmma_defines(64, 128),
    "wgmma_d64_192x128": wgmma_defines(64, 128, nwg=3),
    "wgmma_d128_128x128": wgmma_defines(128, 128),
    "wgmma_d128_128x64": wgmma_defines(128, 64),
    "wgmma_d192_128x64": wgmma_defines(192, 64),
    "wgmma_d256_128x32": wgmma_defines(256, 32),
    "wgmma_d256_128x64": wgmma_defines(256, 64),
}

# HARNESS_AB=<path>: every wgmma variant gets a twin `<name>@ab` built from that file instead of
# flash_fwd_wgmma.cu (e.g. the last committed version), so both are timed in one run.
if os.environ.get("HARNESS_AB"):
    WGMMA.update({f"{n}@ab": {**d, "_FILE": os.path.abspath(os.environ["HARNESS_AB"])}
                  for n, d in list(WGMMA.items())})

# The option sets each wgmma tile is built with: none, the mask, and every score mod where the tile
# table uses them (other tiles spill with them).
WGMMA_SCORE_MODS = {"wgmma_d64_128x128", "wgmma_d128_128x64", "wgmma_d192_128x64", "wgmma_d256_128x32"}

def wgmma_option_sets(name):
    return [options(), options(mask=1)] + ([options(1, 1, 1, 1, 1, 1)] if name.split("@")[0] in WGMMA_SCORE_MODS else [])

def kernel_of(name):
    """(kernel, defines) of a variant name."""
    if name in VARIANTS:
        return "mma", VARIANTS[name]
    if name in WGMMA:
        return "wgmma", WGMMA[name]
    return "general", GENERAL[name]

GENERAL = {
    "general_64": {"ELEM_F32": 1, "DQK_MAX": 128, "DV_MAX": 128, "BCG": 32},
    "general_512": {"ELEM_F32": 1, "DQK_MAX": 512, "DV_MAX": 512, "BCG": 16},
}

def options(softcap=0, alibi=0, bias=0, mask=0, nonpos=0, rel_bias=0):
    return {"HAS_SOFTCAP": softcap, "HAS_ALIBI": alibi, "HAS_BIAS": bias, "HAS_MASK": mask, "NONPOS_SCALE": nonpos,
            "HAS_REL_BIAS": rel_bias}

def sass_problems(cubin):
    """What the SASS of a wgmma build shows that it must not (no HGMMA, local-memory traffic), or
    None when cuobjdump is not on PATH."""
    import shutil, subprocess, tempfile
    tool = shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        return [f"cuobjdump failed: {run.stderr.strip()}"]
    sass = run.stdout
    problems = [] if "HGMMA" in sass else ["no HGMMA"]
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    return problems + ([f"{local} local-memory instructions"] if local else [])

def cmd_compile(args):
    """Compiles every variant; exits 1 if a wgmma variant serializes its wgmma or spills, or (with
    cuobjdump on PATH) if its SASS has no HGMMA or touches local memory."""
    bad_count = 0
    for name, d in (VARIANTS.items() if args.kernels in ("all", "mma") else []):
        for opt in [options(), options(1, 1, 1, 1, 1)]:
            _, log, dt = compile_cubin(source("mma", {**d, **opt}), args.arch)
            print(f"{name} opts={sum(opt.values())}: {dt:.2f}s {log.strip()[:200]}")
    for name, d in (WGMMA.items() if args.kernels in ("all", "wgmma") else []):
        for dt_ in ["bf16", "f16"]:
            for opt in wgmma_option_sets(name):
                dd = {k: v for k, v in d.items() if not k.startswith("ELEM_")}
                dd[f"ELEM_{dt_.upper()}"] = 1
                cubin, log, dt = compile_cubin(source("wgmma", {**dd, **opt}), args.arch)
                # ptxas -v: flag serialized wgmma (C7510-C7515) and any spill or stack frame
                bad = "C751" in log or re.search(r"[1-9]\d* bytes (stack frame|spill)", log)
                sass = sass_problems(cubin)
                bad = bad or bool(sass)
                used = re.findall(r"Used \d+ registers", log)
                note = "no cuobjdump" if sass is None else "SASS ok" if not sass else f"SASS: {', '.join(sass)}"
                print(f"{name} {dt_} opts={sum(opt.values())}: {dt:.2f}s {used} {note} {'BAD: ' + log if bad else 'ok'}")
                bad_count += bool(bad)
    for dt_ in (["f32", "f16"] if args.kernels in ("all", "general") else []):
        for dmax in [64, 512]:
            d = {f"ELEM_{dt_.upper()}": 1, "DQK_MAX": dmax, "DV_MAX": dmax, "BCG": 32 if dmax <= 256 else 16}
            _, log, t = compile_cubin(source("general", {**d, **options(1, 1, 1, 1, 1)}), args.arch)
            print(f"general {dt_} {dmax}: {t:.2f}s {log.strip()[:200]}")
    if bad_count:
        sys.exit(f"{bad_count} wgmma builds serialized their wgmma or spilled")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--variants", default="")
    ap.add_argument("--dims", default="64,128", help="head dims for bench")
    ap.add_argument("--quick", action="store_true", help="check: bf16, three cases (for compute-sanitizer)")
    ap.add_argument("--n", type=int, default=4096, help="sequence length for prof")
    ap.add_argument("--causal", action="store_true", help="prof: causal")
    ap.add_argument("--kernels", default="all", choices=["all", "mma", "wgmma", "general"],
                    help="which kernel's variants compile builds")
    args = ap.parse_args()
    if args.cmd == "compile":
        cmd_compile(args)
    else:
        import harness_gpu
        harness_gpu.main(args)
