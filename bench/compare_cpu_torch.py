#!/usr/bin/env python3
"""flashattn's CPU forward and backward next to PyTorch's CPU flash attention, in one run on one
machine.

Times torch.nn.functional.scaled_dot_product_attention forced to the CPU flash-attention backend
(sdpa_kernel(SDPBackend.FLASH_ATTENTION)) on --threads threads, and the release CLI (`flashattn
bench --json`, its rayon pool set to the same number of threads by RAYON_NUM_THREADS) on the same
shapes: f32, B=1, H=8, D=64, N in {1024, 4096}, causal and not; the forward, the backward or both
(--pass). q, k, v are fresh random values (torch.randn; the CLI draws its own from --seed) stored as
[B, N, H, D], the CLI's default layout; torch gets the transposed [B, H, N, D] view of that memory
(--contiguous: both take contiguous [B, H, N, D] tensors, the CLI by its --layout bhnd). Once per
shape the torch flash output is checked against the math backend (max abs error; for the backward,
of dq, dk and dv against the math backend's gradients for the same random dout), so the flash kernel
is known to have run and to be right. torch's backward is timed as torch.autograd.grad of one
retained forward graph (its flash backward kernel, no forward), as the CLI's --pass backward times
only the backward.

The methods are interleaved shape by shape, torch first in even rounds and flashattn first in odd
ones (--rounds), and the same run times torch.matmul on a 1024x1024x1024 f32 GEMM each round as
the machine's ceiling. FLOPs = 4*B*H*N^2*D (causal: half), times 2.5 for the backward; GEMM
FLOPs = 2*M*N*K. torch rates are
given three ways: from the fastest wall-clock sample, from the median sample, and from the
process CPU time of all timed calls counted as if each thread had a core to itself
(flops * calls / (cpu_seconds / threads), as the Rust bench does). The CLI reports only the
fastest wall-clock run of each invocation, so the side-by-side ratio is fastest against fastest.

Needs a PyTorch outside the repository, for example (PyPI's torch wheel carries CUDA libraries
but runs on a machine without a GPU; the CPU-only index is download.pytorch.org/whl/cpu):

    python3 -m venv /work/torch-cpu-venv
    /work/torch-cpu-venv/bin/pip install torch numpy
    cargo build --release
    /work/torch-cpu-venv/bin/python bench/compare_cpu_torch.py --seqlens 1024,4096 --rounds 3
    # two builds side by side: --flashattn before=/tmp/old/flashattn,after=target/release/flashattn
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flashattn", default="target/release/flashattn",
                   help="the release CLI, or several as LABEL=PATH,LABEL=PATH (e.g. two commits' "
                        "builds, timed in the same interleaved rounds)")
    p.add_argument("--seqlens", default="1024,4096")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--pass", dest="passes", default="forward",
                   choices=["forward", "backward", "both"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads and RAYON_NUM_THREADS")
    p.add_argument("--warmup", type=int, default=2, help="untimed torch calls per shape and round")
    p.add_argument("--samples", type=int, default=10,
                   help="timed calls per method, shape and round (the CLI's --repeats)")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of the interleaved sweep")
    p.add_argument("--gemm-size", type=int, default=1024, help="M = N = K of the ceiling GEMM")
    p.add_argument("--contiguous", action="store_true",
                   help="store q, k, v as contiguous [B, H, N, D] on both sides (flashattn "
                        "--layout bhnd) instead of [B, N, H, D]")
    p.add_argument("--json", help="write every figure here")
    return p.parse_args()


def attention_flops(b, h, n, d, causal, pass_):
    f = 4.0 * b * h * n * n * d
    f = f / 2 if causal else f
    return 2.5 * f if pass_ == "backward" else f


def time_calls(fn, warmup, samples):
    """Wall-clock seconds of each timed call, and the process CPU seconds of all of them."""
    for _ in range(warmup):
        fn()
    wall = []
    cpu0 = time.process_time()
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
    return wall, time.process_time() - cpu0


def qkv(torch, args, n, gen, grad=False):
    """q, k, v as torch wants them ([B, H, N, D] views) and the tensors that own their memory
    (the ones gradients are taken of)."""
    b, h, d = args.batch, args.heads, args.head_dim
    shape = (b, h, n, d) if args.contiguous else (b, n, h, d)
    owners = [torch.randn(*shape, generator=gen).requires_grad_(grad) for _ in range(3)]
    views = owners if args.contiguous else [t.transpose(1, 2) for t in owners]
    return views, owners


def attention(torch, backend, q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check_flash(torch, args, n, causal, pass_, gen):
    """Max abs difference of the flash backend's output (or gradients) from the math backend's."""
    from torch.nn.attention import SDPBackend
    (q, k, v), owners = qkv(torch, args, n, gen, grad=pass_ == "backward")
    flash = attention(torch, SDPBackend.FLASH_ATTENTION, q, k, v, causal)
    math = attention(torch, SDPBackend.MATH, q, k, v, causal)
    if pass_ == "forward":
        return (flash - math).abs().max().item()
    dout = torch.randn(flash.shape, generator=gen)
    gf = torch.autograd.grad(flash, owners, dout)
    gm = torch.autograd.grad(math, owners, dout)
    return max((a - b).abs().max().item() for a, b in zip(gf, gm))


def run_torch(torch, args, n, causal, pass_, gen):
    from torch.nn.attention import SDPBackend
    (q, k, v), owners = qkv(torch, args, n, gen, grad=pass_ == "backward")
    if pass_ == "forward":
        with torch.no_grad():
            return time_calls(
                lambda: attention(torch, SDPBackend.FLASH_ATTENTION, q, k, v, causal),
                args.warmup, args.samples)
    out = attention(torch, SDPBackend.FLASH_ATTENTION, q, k, v, causal)
    dout = torch.randn(out.shape, generator=gen)
    return time_calls(lambda: torch.autograd.grad(out, owners, dout, retain_graph=True),
                      args.warmup, args.samples)


def run_gemm(torch, args, gen):
    s = args.gemm_size
    a, b = torch.randn(s, s, generator=gen), torch.randn(s, s, generator=gen)
    return time_calls(lambda: torch.matmul(a, b), args.warmup, 2 * args.samples)


def binaries(spec):
    """The CLIs to time, as (label, path): `PATH` alone is labelled flashattn."""
    out = []
    for item in spec.split(","):
        label, _, path = item.rpartition("=")
        out.append((label or "flashattn", path))
    return out


def run_flashattn(args, binary, n, causal, pass_, seed):
    """GFLOP/s of the CLI's fastest of --samples runs (after its one untimed run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fa.json")
        cmd = [binary, "bench", "--device", "cpu", "--dtype", "f32",
               "--seqlens", str(n), "--head-dims", str(args.head_dim), "--pass", pass_,
               "--causal", "yes" if causal else "no", "--batch", str(args.batch),
               "--heads", str(args.heads), "--repeats", str(args.samples), "--no-standard",
               "--seed", str(seed), "--json", out,
               "--layout", "bhnd" if args.contiguous else "bnhd"]
        env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            sys.exit(f"$ {' '.join(cmd)}\nfailed with status {r.returncode}:\n{r.stdout}{r.stderr}")
        with open(out) as f:
            rows = [x for x in json.load(f) if x["method"] == "flashattn" and x["pass"] == pass_]
    return rows[0]["gflops"]


def rates(flops, wall, cpu, threads):
    """GFLOP/s from the fastest sample, the median sample and the CPU time of all samples."""
    return {"fastest": flops / min(wall) / 1e9, "median": flops / statistics.median(wall) / 1e9,
            "cpu_time": flops * len(wall) / (cpu / threads) / 1e9}


def main():
    args = parse_args()
    import torch
    bins = binaries(args.flashattn)
    for _, path in bins:
        if not os.access(path, os.X_OK):
            sys.exit(f"{path} not found: run `cargo build --release` (or pass --flashattn)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(2026)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    masks = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    passes = ["forward", "backward"] if args.passes == "both" else [args.passes]
    shapes = [(n, c, p) for p in passes for n in seqlens for c in masks]
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; flashattn {args.flashattn}, "
          f"RAYON_NUM_THREADS={args.threads}", flush=True)

    errors = {s: check_flash(torch, args, *s, gen) for s in shapes}
    gemm = {"wall": [], "cpu": 0.0}
    th = {s: {"wall": [], "cpu": 0.0} for s in shapes}
    fa = {(label, s): [] for label, _ in bins for s in shapes}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1} of {args.rounds}", flush=True)
        wall, cpu = run_gemm(torch, args, gen)
        gemm["wall"] += wall
        gemm["cpu"] += cpu
        for s in shapes:
            def torch_side():
                wall, cpu = run_torch(torch, args, *s, gen)
                th[s]["wall"] += wall
                th[s]["cpu"] += cpu

            def fa_side():
                # The binaries' order turns with the rounds too.
                for label, path in (bins if rnd % 2 == 0 else bins[::-1]):
                    fa[(label, s)].append(run_flashattn(args, path, *s, seed=2026 + rnd))

            for side in ((torch_side, fa_side) if rnd % 2 == 0 else (fa_side, torch_side)):
                side()

    g = args.gemm_size
    gemm_rates = rates(2.0 * g ** 3, gemm["wall"], gemm["cpu"], args.threads)
    b, h, d = args.batch, args.heads, args.head_dim
    if args.contiguous:
        layout = "contiguous [B, H, N, D] on both sides"
    else:
        layout = "stored [B, N, H, D] (torch: its [B, H, N, D] view)"
    print()
    print(f"f32, B={b}, H={h}, D={d}; q/k/v {layout}; "
          f"{args.rounds} rounds x {args.samples} samples (torch after {args.warmup} warm-up "
          f"calls, flashattn after 1), FLOPs = 4*B*H*N^2*D (causal /2, backward x2.5)")
    print(f"f32 GEMM {g}x{g}x{g} (torch.matmul): fastest {gemm_rates['fastest']:.1f}, median "
          f"{gemm_rates['median']:.1f}, CPU time {gemm_rates['cpu_time']:.1f} GFLOP/s")
    print("GFLOP/s from the FASTEST WALL-CLOCK sample on both sides (the flashattn CLI reports "
          "no CPU-time rate); torch's median and CPU-time rates beside them")
    heads = "".join(f" {label:>9} {label[:5] + '/torch':>11}" for label, _ in bins)
    print(f"{'pass':>8} {'N':>6} {'causal':>6} | {'torch':>7}{heads} | "
          f"{'torch med':>9} {'torch CPU':>9} | {'max|flash-math|':>15}")
    rows = []
    for s in shapes:
        n, causal, pass_ = s
        tr = rates(attention_flops(b, h, n, d, causal, pass_), th[s]["wall"], th[s]["cpu"],
                   args.threads)
        best = {label: max(fa[(label, s)]) for label, _ in bins}
        cols = "".join(f" {best[label]:>9.1f} {best[label] / tr['fastest']:>10.2f}x"
                       for label, _ in bins)
        print(f"{pass_:>8} {n:>6} {str(causal):>6} | {tr['fastest']:>7.1f}{cols} | "
              f"{tr['median']:>9.1f} {tr['cpu_time']:>9.1f} | {errors[s]:>15.2e}")
        rows.append({"pass": pass_, "batch": b, "heads": h, "seqlen": n, "head_dim": d,
                     "causal": causal,
                     "torch_gflops": tr, "torch_samples_s": th[s]["wall"],
                     "torch_cpu_s": th[s]["cpu"], "flashattn_gflops_fastest_per_round": {label: fa[(label, s)] for label, _ in bins},
                     "max_abs_err_flash_vs_math": errors[s]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "threads": args.threads, "layout": layout,
                       "gemm": dict(size=g, gflops=gemm_rates), "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
