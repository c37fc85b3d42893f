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
"""
import argparse
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flashattn", default="target/release/flashattn", help="the release CLI")
    p.add_argument("--seqlens", default="1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every shape this many times, Python and CLI in alternating order; report medians")
    p.add_argument("--overhead-repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
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
