#!/usr/bin/env python3
"""The Python package's flash_attn_func beside torch.nn.functional.scaled_dot_product_attention and
beside the Rust CLI's own bench, in one run on the CPU: how much the binding costs.

For each shape (f32, B=1, H=8, D=64, N in --seqlens, causal and not) it times, fastest of
--repeats calls after one untimed call: flashattn's forward (inputs without grad), its backward
alone (torch.autograd.grad of one retained forward graph, as the CLI's --pass backward times only
the backward) and forward+backward; torch's SDPA the same three ways on the [B, H, N, D] view of
the same memory (the CPU backend torch picks); and `flashattn bench --pass both --json` on the same
shape, whose forward and backward times are what the binding should keep (the issue asks for
within 3% at N >= 1024). Last, the per-call overhead at B=1, H=8, N=128, D=64: the Python forward
minus the CLI's forward, both fastest of --overhead-repeats calls, and the time of a call with
next to no work (B=H=N=1, D=8) beside SDPA's.

    cargo build --release && pip install ./crates/flashattn-py
    python bench/compare_python.py --seqlens 1024,2048 --rounds 3

With --device cuda (no CLI needed) it times CUDA tensors instead, in --dtype (bf16 by default) at
B=--batch, H=--heads, D=--head-dim: flashattn's and SDPA's forward and forward+backward (median
device time of --repeats calls, CUDA events around each; TFLOP/s counting 4·B·H·N²·D, half of it
causal, 3.5 times that for forward+backward), and the per-call overhead at B=1, H=8, N=128, D=64:
the host time to queue one call, flashattn's beside SDPA's (calls back to back, the mean).

    python bench/compare_python.py --device cuda --seqlens 1024,4096
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

from flashattn import flash_attn_func


def fastest(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def cli_times(cli, n, causal, repeats, threads):
    """The CLI's fastest forward and backward times (ms) at B=1, H=8, N=n, D=64, f32."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        subprocess.run([cli, "bench", "--seqlens", str(n), "--causal", "yes" if causal else "no",
                        "--pass", "both", "--no-standard", "--repeats", str(repeats), "--json", path],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "RAYON_NUM_THREADS": str(threads)})
        rows = json.load(open(path))
    return {r["pass"]: r["time_ms"] for r in rows if r["method"] == "flashattn"}


def python_times(n, causal, repeats):
    """flashattn's and SDPA's forward, backward and forward+backward times (ms)."""
    q, k, v = (torch.randn(1, n, 8, 64) for _ in range(3))
    dout = torch.randn(1, n, 8, 64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa = lambda *x: flash_attn_func(*x, causal=causal)
    sdpa = lambda *x: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=causal).transpose(1, 2)
    times = {}
    for name, fn in (("flashattn", fa), ("sdpa", sdpa)):
        with torch.no_grad():
            times[name, "forward"] = fastest(lambda: fn(q, k, v), repeats)
        out = fn(*leaves)
        times[name, "backward"] = fastest(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), repeats)
        times[name, "fwd+bwd"] = fastest(lambda: torch.autograd.grad(fn(*leaves), leaves, dout), repeats)
    return times


def gpu_ms(fn, repeats):
    """Median device time (ms) of ``fn``: CUDA events around each of ``repeats`` calls."""
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_us(fn, repeats):
    """Host time (us) to queue one call of ``fn``: ``repeats`` calls back to back from an idle GPU."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def cuda_rows(args):
    """flashattn's and SDPA's forward and forward+backward on CUDA tensors: (N, causal, pass,
    flashattn ms or None when there is no CUDA backward, SDPA ms, TFLOP/s of each)."""
    dtype = getattr(torch, args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    fa = lambda *x: flash_attn_func(*x, causal=causal)
    sdpa = lambda *x: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=causal).transpose(1, 2)
    rows = []
    for n in map(int, args.seqlens.split(",")):
        for causal in (False, True):
            q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            for ps, mult in (("forward", 1.0), ("fwd+bwd", 3.5)):
                times = []
                for fn in (fa, sdpa):
                    if ps == "forward":
                        run = lambda: fn(q, k, v)
                    else:
                        run = lambda: torch.autograd.grad(fn(*leaves), leaves, dout)
                    try:
                        with torch.no_grad() if ps == "forward" else contextlib.nullcontext():
                            times.append(gpu_ms(run, args.repeats))
                    except NotImplementedError:
                        times.append(None)
                tflops = [None if t is None else flops * mult / t / 1e9 for t in times]
                rows.append((n, causal, ps, *times, *tflops))
    return rows


def cuda_main(args):
    name = torch.cuda.get_device_name()
    print(f"{name}, {args.dtype}, B={args.batch} H={args.heads} D={args.head_dim}; median of {args.repeats} "
          f"calls (CUDA events); SDPA's backend as torch picks it")
    print(f"{'N':>6} {'mask':>6} {'pass':>8} {'flashattn ms':>13} {'SDPA ms':>9} {'fa TFLOP/s':>11} "
          f"{'SDPA TFLOP/s':>13} {'SDPA/fa':>8}")
    fmt = lambda x, w, p: f"{'n/a':>{w}}" if x is None else f"{x:>{w}.{p}f}"
    for n, causal, ps, fa_ms, sd_ms, fa_tf, sd_tf in cuda_rows(args):
        ratio = None if fa_ms is None else sd_ms / fa_ms
        print(f"{n:>6} {'causal' if causal else 'full':>6} {ps:>8} {fmt(fa_ms, 13, 3)} {fmt(sd_ms, 9, 3)} "
              f"{fmt(fa_tf, 11, 1)} {fmt(sd_tf, 13, 1)} {fmt(ratio, 8, 2)}")
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=getattr(torch, args.dtype)) for _ in range(3))
    with torch.no_grad():
        fa_us = host_us(lambda: flash_attn_func(q, k, v), args.overhead_repeats)
        sd_us = host_us(lambda: F.scaled_dot_product_attention(q, k, v), args.overhead_repeats)
        fa_dev = gpu_ms(lambda: flash_attn_func(q, k, v), args.overhead_repeats) * 1e3
        with torch.cuda.stream(torch.cuda.Stream()):
            side_us = host_us(lambda: flash_attn_func(q, k, v), args.overhead_repeats)
    print(f"per-call overhead at B=1 H=8 N=128 D=64 (forward, host time to queue one call, mean of "
          f"{args.overhead_repeats}): flashattn {fa_us:.1f} us, SDPA {sd_us:.1f} us; flashattn on a side "
          f"stream (two event joins) {side_us:.1f} us; flashattn's device time {fa_dev:.1f} us")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flashattn", default="target/release/flashattn", help="the release CLI")
    p.add_argument("--seqlens", default="1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every shape this many times, Python and CLI in alternating order; report medians")
    p.add_argument("--overhead-repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="with --device cuda: float16, bfloat16 or float32")
    p.add_argument("--batch", type=int, default=4, help="with --device cuda")
    p.add_argument("--heads", type=int, default=16, help="with --device cuda")
    p.add_argument("--head-dim", type=int, default=128, help="with --device cuda")
    args = p.parse_args()
    if args.device == "cuda":
        return cuda_main(args)
    torch.set_num_threads(args.threads)
    shapes = [(n, causal) for n in map(int, args.seqlens.split(",")) for causal in (False, True)]
    samples = {shape: [] for shape in shapes}
    for r in range(args.rounds):
        for n, causal in shapes:
            run_py = lambda: python_times(n, causal, args.repeats)
            run_cli = lambda: cli_times(args.flashattn, n, causal, args.repeats, args.threads)
            if r % 2:
                cli, py = run_cli(), run_py()
            else:
                py, cli = run_py(), run_cli()
            cli["fwd+bwd"] = cli["forward"] + cli["backward"]
            samples[n, causal].append((py, cli))
    print(f"CPU, f32, B=1 H=8 D=64, {args.threads} threads; ms, fastest of {args.repeats} calls, "
          f"median of {args.rounds} rounds (py/CLI: median of the rounds' ratios)")
    print(f"{'N':>6} {'mask':>6} {'pass':>8} {'python':>9} {'CLI':>9} {'py/CLI':>7} {'SDPA':>9} {'SDPA/py':>8}")
    med = statistics.median
    for (n, causal), rounds in samples.items():
        for ps in ("forward", "backward", "fwd+bwd"):
            mine = med(py["flashattn", ps] for py, _ in rounds)
            sd = med(py["sdpa", ps] for py, _ in rounds)
            ratio = med(py["flashattn", ps] / cli[ps] for py, cli in rounds)
            cli_ms = med(cli[ps] for _, cli in rounds)
            print(f"{n:>6} {'causal' if causal else 'full':>6} {ps:>8} {mine:>9.2f} {cli_ms:>9.2f} "
                  f"{ratio:>7.3f} {sd:>9.2f} {sd / mine:>8.2f}")
    q, k, v = (torch.randn(1, 128, 8, 64) for _ in range(3))
    with torch.no_grad():
        py_ms = fastest(lambda: flash_attn_func(q, k, v), args.overhead_repeats)
    cli_ms = cli_times(args.flashattn, 128, False, args.overhead_repeats, args.threads)["forward"]
    print(f"per-call overhead at B=1 H=8 N=128 D=64 (forward, fastest of {args.overhead_repeats}): python "
          f"{py_ms * 1e3:.1f} us, CLI {cli_ms * 1e3:.1f} us, overhead {(py_ms - cli_ms) * 1e3:.1f} us")
    q = torch.randn(1, 1, 1, 8)
    with torch.no_grad():
        tiny_ms = fastest(lambda: flash_attn_func(q, q, q), args.overhead_repeats)
        sdpa_ms = fastest(lambda: F.scaled_dot_product_attention(q, q, q), args.overhead_repeats)
    print(f"a call with next to no work (B=H=N=1, D=8): python {tiny_ms * 1e3:.1f} us, SDPA {sdpa_ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
