#!/usr/bin/env python3
"""flashattn's GPU attention next to PyTorch's scaled_dot_product_attention, in one run on one GPU.

Runs the Rust driver (examples/cuda_bench.rs, built with `cargo build --release --example
cuda_bench`) for flashattn's times and torch SDPA with the FlashAttention-2 backend
(SDPBackend.FLASH_ATTENTION) and the cuDNN backend (SDPBackend.CUDNN_ATTENTION) on the same shapes
and dtype. The methods are interleaved shape by shape and the sweep is repeated (--rounds, the
order of flashattn and torch swapped every round), so a GPU whose clock drifts or that slows down
for a while slows every method alike. Every time is the median of all CUDA-event samples of all
rounds, each round after a warm-up; inputs are fresh random values (torch.randn), never zeros.
TFLOP/s = 4·B·H·N²·D / time (causal: half the FLOPs), times 2.5 for the backward (--pass
backward: torch's autograd backward of one SDPA call against flashattn's backward_into) and 3.5
for the forward and backward together (--pass fwdbwd). Each round also times torch's GEMM of two
8192 × 8192 matrices in the same dtype, the ceiling every rate is put beside (fa/GEMM).

    python3 bench/compare_sdpa.py --bin target/release/examples/cuda_bench --json out.json

Prints a table (TFLOP/s per method, flashattn's ratio to each peer) and writes every figure as
JSON. Shapes default to the CUDA issues': bf16, D in {64, 128, 256}, causal and not,
N in {512, ..., 16384}, batch·N = 16384, heads·D = 2048.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release/examples/cuda_bench",
                   help="the cuda_bench driver binary")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--pass", dest="pass_", default="forward", choices=["forward", "backward", "fwdbwd"])
    p.add_argument("--tokens", type=int, default=16384, help="batch · seqlen")
    p.add_argument("--model-dim", type=int, default=2048, help="heads · head_dim")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--samples", type=int, default=20, help="timed calls per method, shape and round")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of the interleaved sweep")
    p.add_argument("--standard", action="store_true",
                   help="also time flashattn's GPU standard (materializing) attention")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers")
    p.add_argument("--json", help="write every figure here")
    return p.parse_args()


def run_flashattn(args, seqlens, head_dims, causal, standard, quiet=False):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fa.json")
        cmd = [args.bin, "--seqlens", seqlens, "--head-dims", head_dims,
               "--causal", causal, "--dtype", args.dtype, "--tokens", str(args.tokens),
               "--model-dim", str(args.model_dim), "--warmup", str(args.warmup),
               "--samples", str(args.samples), "--pass", args.pass_, "--json", out]
        if standard:
            cmd.append("--standard")
        if not quiet:
            print("$", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None)
        if r.returncode != 0 or not os.path.exists(out):
            sys.exit(f"cuda_bench failed with status {r.returncode}")
        with open(out) as f:
            return json.load(f)


def time_torch(fn, warmup, samples):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


GEMM_N = 8192


def time_gemm(args, gen):
    """CUDA-event samples (ms) of torch's GEMM of two fresh GEMM_N x GEMM_N matrices."""
    import torch
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    a, b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    t = time_torch(lambda: a @ b, args.warmup, args.samples)
    del a, b
    torch.cuda.empty_cache()
    return t


def run_torch(args, shapes, gen):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    backends = {"torch-fa2": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    grad = args.pass_ != "forward"
    for (b, n, h, d, causal) in shapes:
        q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                         for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(grad)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = None
        for name, backend in backends.items():
            row = {"method": name, "dtype": args.dtype, "pass": args.pass_, "batch": b,
                   "heads": h, "seqlen_q": n, "seqlen_k": n, "head_dim": d, "causal": causal}
            try:
                with sdpa_kernel(backend):
                    out = sdpa()
                    assert torch.isfinite(out).all(), "non-finite output"
                    call = {
                        "forward": sdpa,
                        "backward": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                        "fwdbwd": lambda: torch.autograd.grad(sdpa(), (q, k, v), dout),
                    }[args.pass_]
                    t = time_torch(call, args.warmup, args.samples)
                row.update(time_ms=statistics.median(t), samples_ms=t, error=None)
            except Exception as e:  # a backend that does not take this shape: reported, not fatal
                row.update(time_ms=None, samples_ms=[], error=f"{type(e).__name__}: {e}")
                print(f"{name} B={b} N={n} H={h} D={d} causal={causal}: {row['error']}",
                      file=sys.stderr)
            rows.append(row)
        del q, k, v, dout, out
        torch.cuda.empty_cache()
    return rows


def shape_of(r):
    return (r["batch"], r["seqlen_q"], r["heads"], r["head_dim"], r["causal"])


def merge_rounds(rows):
    """One row per (method, shape): every round's samples, their median as the time."""
    merged = {}
    for r in rows:
        key = (r["method"], shape_of(r))
        if key not in merged:
            merged[key] = dict(r, samples_ms=list(r["samples_ms"]), rounds=1)
        else:
            m = merged[key]
            m["samples_ms"] += r["samples_ms"]
            m["rounds"] += 1
            m["error"] = m["error"] or r.get("error")
    for m in merged.values():
        m["time_ms"] = statistics.median(m["samples_ms"]) if m["samples_ms"] and not m["error"] \
            else None
    return list(merged.values())


def main():
    args = parse_args()
    # The whole sweep once first: compiles (or loads) every variant, times the standard attention.
    fa = run_flashattn(args, args.seqlens, args.head_dims, args.causal, args.standard)
    rows = list(fa["results"])
    shapes = sorted({shape_of(r) for r in rows}, key=lambda s: (s[3], s[4], s[1]))
    gemm_ms = []
    if not args.no_torch:
        # Its flashattn times are replaced by the interleaved rounds' (the standard's are kept).
        rows = [r for r in rows if r["method"] != "flashattn"]
        import torch
        print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
              f"{torch.cuda.get_device_name()}", flush=True)
        gen = torch.Generator(device="cuda").manual_seed(2026)
        for rnd in range(args.rounds):
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
            gemm_ms += time_gemm(args, gen)
            for s in shapes:
                b, n, h, d, causal = s
                fa_rows = lambda: [r for r in run_flashattn(
                    args, str(n), str(d), str(causal).lower(), False, quiet=True)["results"]
                    if r["method"] == "flashattn"]
                if rnd % 2 == 0:
                    rows += run_torch(args, [s], gen)
                    rows += fa_rows()
                else:
                    rows += fa_rows()
                    rows += run_torch(args, [s], gen)
    rows = merge_rounds(rows)
    for r in rows:
        flops = {"forward": 1.0, "backward": 2.5, "fwdbwd": 3.5}[args.pass_] * 4.0 * r["batch"] * r["heads"] * r["seqlen_q"] * r["seqlen_k"] * r["head_dim"]
        if r["causal"]:
            flops /= 2
        r["flops"] = flops
        r["tflops"] = flops / (r["time_ms"] * 1e-3) / 1e12 if r.get("time_ms") else None

    def rate(method, s):
        for r in rows:
            if r["method"] == method and (r["batch"], r["seqlen_q"], r["heads"],
                                          r["head_dim"], r["causal"]) == s:
                return r["tflops"]
        return None

    gemm = 2.0 * GEMM_N ** 3 / (statistics.median(gemm_ms) * 1e-3) / 1e12 if gemm_ms else None
    methods = ["flashattn"] + (["standard"] if args.standard else []) + \
        ([] if args.no_torch else ["torch-fa2", "torch-cudnn"])
    fmt = lambda x: f"{x:8.1f}" if x else f"{'-':>8}"
    ratio = lambda a, b: f"{a / b:7.2f}x" if a and b else f"{'-':>8}"
    print()
    print(f"device: {fa['device']}")
    rounds = 1 if args.no_torch else args.rounds
    print(f"{args.dtype}, batch·N = {args.tokens}, heads·D = {args.model_dim}; TFLOP/s (median of "
          f"{rounds}×{args.samples} samples, interleaved rounds of {args.warmup} warm-up + "
          f"{args.samples}), {args.pass_}, FLOPs = 4·B·H·N²·D (causal /2) × "
          f"{ {'forward': 1, 'backward': 2.5, 'fwdbwd': 3.5}[args.pass_]}")
    if gemm:
        print(f"torch {args.dtype} GEMM {GEMM_N}³: {gemm:.1f} TFLOP/s (median of {len(gemm_ms)} samples)")
    head = f"{'D':>4} {'causal':>6} {'N':>6} {'B':>3} {'H':>3} |" + \
        "".join(f" {m:>11}" for m in methods)
    if not args.no_torch:
        head += " | fa/FA2   fa/cuDNN  fa/GEMM"
    print(head)
    summary = []
    for s in shapes:
        b, n, h, d, causal = s
        rates = [rate(m, s) for m in methods]
        line = f"{d:>4} {str(causal):>6} {n:>6} {b:>3} {h:>3} |" + \
            "".join(f"    {fmt(x)}" for x in rates)
        if not args.no_torch:
            fa_rate = rate("flashattn", s)
            r_fa2, r_cudnn = rate("torch-fa2", s), rate("torch-cudnn", s)
            line += f" | {ratio(fa_rate, r_fa2)} {ratio(fa_rate, r_cudnn)} {ratio(fa_rate, gemm)}"
            summary.append({"batch": b, "seqlen": n, "heads": h, "head_dim": d, "causal": causal,
                            "flashattn_tflops": fa_rate, "torch_fa2_tflops": r_fa2,
                            "torch_cudnn_tflops": r_cudnn,
                            "ratio_to_fa2": fa_rate / r_fa2 if fa_rate and r_fa2 else None,
                            "ratio_to_cudnn": fa_rate / r_cudnn if fa_rate and r_cudnn else None,
                            "ratio_to_gemm": fa_rate / gemm if fa_rate and gemm else None})
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": fa["device"], "dtype": args.dtype, "pass": args.pass_, "results": rows,
                       "gemm_tflops": gemm, "gemm_samples_ms": gemm_ms,
                       "summary": summary, "compile_records": fa.get("compile_records", [])},
                      f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
