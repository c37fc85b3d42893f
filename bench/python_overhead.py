#!/usr/bin/env python3
"""Where the host time of one flash_attn_func call goes, layer by layer, on the CPU or a GPU:
the whole call, the operator through torch's dispatcher, the operator's implementation called
directly, its pieces (output allocation, tensor descriptions, the stream), the native call alone,
and SDPA's call beside them; then the same for the backward (the gradients' allocation, their
descriptions, the native backward alone, the implementation, autograd's share) and
forward+backward.

Each figure is the host time per call in microseconds, the best of --rounds means of --calls
back-to-back calls (on a GPU they queue kernels; the GPU is synchronized after each round, not
counted), at B=1, H=8, N=128, D=64 by default (--shape B,N,H,D). With --thread-time the CPU time
of this thread is counted instead of the wall clock (steadier on a busy machine; the native
call's pool threads are not counted).

    python3 bench/python_overhead.py --device cuda --dtype bfloat16
    python3 bench/python_overhead.py --device cuda --profile 300   # + cProfile of 300 fwd+bwd
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

from flashattn import _cuda, _native, _ops, flash_attn_func


def per_call_us(fn, calls, rounds, clock, sync):
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t) / calls)
        sync()
    return best * 1e6


def layers(q, k, v):
    """(name, call) for each layer of a forward on q, k, v; layers this version of the package
    lacks are left out."""
    args = (q, k, v, None, None, None, None, None, -1, -1, 0.0, False)
    impl = getattr(_ops, "_fwd", None)
    out, lse = _ops._fwd_outputs(q, v, False)
    names = ("q", "k", "v", "out", "lse")
    descs = [_ops._desc(n, t) for n, t in zip(names, (q, k, v, out, lse))]
    opts = _ops._opts(None, None, None, None, None, -1, -1, 0.0)
    stream = _cuda.stream(q)
    heads_first = [t.transpose(1, 2) for t in (q, k, v)]
    rows = [
        ("flash_attn_func", lambda: flash_attn_func(q, k, v)),
        ("torch.ops.flashattn.fwd (dispatcher)", lambda: torch.ops.flashattn.fwd.default(*args)),
    ]
    if hasattr(_ops, "attention"):
        rows.append(("_ops.attention (eager path)", lambda: _ops.attention(*args)))
    if impl is not None:
        rows.append(("_ops._fwd (the implementation)", lambda: impl(*args)))
    rows += [
        ("  two output allocations", lambda: _ops._fwd_outputs(q, v, False)),
        ("  five tensor descriptions", lambda: [_ops._desc(n, t) for n, t in zip(names, (q, k, v, out, lse))]),
        ("  the options tuple", lambda: _ops._opts(None, None, None, None, None, -1, -1, 0.0)),
        ("  stream and device guard", lambda: (_cuda.stream(q), _cuda.on_device(q))),
        ("  _native.forward", lambda: _native.forward(tuple(descs[:3]), tuple(descs[3:]), opts, stream)),
        ("SDPA (on [B, H, N, D] views made before)", lambda: F.scaled_dot_product_attention(*heads_first)),
    ]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--shape", default="1,128,8,64", help="B,N,H,D")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch's and flashattn's CPU threads")
    p.add_argument("--thread-time", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="also profile CALLS forward+backward calls with cProfile")
    p.add_argument("--trace", type=int, default=0, metavar="CALLS",
                   help="on a GPU, also trace CALLS native backwards and CALLS forward+backward calls (torch.profiler)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    b, n, h, d = map(int, args.shape.split(","))
    q, k, v = (torch.randn(b, n, h, d, device=args.device, dtype=getattr(torch, args.dtype)) for _ in range(3))
    clock = time.thread_time if args.thread_time else time.perf_counter
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"{args.device}, {args.dtype}, B={b} N={n} H={h} D={d}: host us per call, best of {args.rounds} means "
          f"of {args.calls} calls ({'thread CPU time' if args.thread_time else 'wall clock'})")
    with torch.no_grad():
        for name, fn in layers(q, k, v):
            print(f"{name:<40} {per_call_us(fn, args.calls, args.rounds, clock, sync):>8.1f}")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    with torch.no_grad():
        rows = backward_layers(q, k, v, dout)
    for name, fn in rows:
        print(f"{name:<40} {per_call_us(fn, args.calls, args.rounds, clock, sync):>8.1f}")
    sdpa = lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves))
    kept = flash_attn_func(*leaves)
    kept_sdpa = sdpa().transpose(1, 2)
    grad_rows = [
        ("flash_attn_func building a graph", lambda: flash_attn_func(*leaves)),
        ("SDPA building a graph (3 transposes)", sdpa),
        ("flash_attn_func backward of a kept graph", lambda: torch.autograd.grad(kept, leaves, dout, retain_graph=True)),
        ("SDPA backward of a kept graph", lambda: torch.autograd.grad(kept_sdpa, leaves, dout, retain_graph=True)),
        ("flash_attn_func forward+backward", lambda: torch.autograd.grad(flash_attn_func(*leaves), leaves, dout)),
        ("SDPA forward+backward (4 transposes)",
         lambda: torch.autograd.grad(sdpa().transpose(1, 2), leaves, dout)),
    ]
    for name, fn in grad_rows:
        print(f"{name:<40} {per_call_us(fn, args.calls, args.rounds, clock, sync):>8.1f}")
    if args.profile:
        profile(lambda: torch.autograd.grad(flash_attn_func(*leaves), leaves, dout), args.profile, sync)
    if args.trace and args.device == "cuda":
        with torch.no_grad():
            native = dict(backward_layers(q, k, v, dout))["  _native.backward"]
        trace("the native backward", native, args.trace)
        trace("flash_attn_func forward+backward", lambda: torch.autograd.grad(flash_attn_func(*leaves), leaves, dout),
              args.trace)


def backward_layers(q, k, v, dout):
    """(name, call) for each layer of a backward of a forward on q, k, v (no autograd)."""
    args = (None, None, None, None, None, -1, -1, 0.0)
    out, lse = _ops._fwd(q, k, v, *args)
    inputs = (dout, q, k, v, out, lse)
    names = ("q", "k", "v", "out", "lse", "dout")
    descs = tuple(_ops._desc(n, t) for n, t in zip(names, (q, k, v, out, lse, dout)))
    dq, dk, dv, _, _ = _ops._bwd_outputs(q, k, v, None, None)
    grads = (_ops._desc("dq", dq), _ops._desc("dk", dk), _ops._desc("dv", dv), None, None)
    opts = _ops._opts(*args)
    stream = _cuda.stream(q)
    return [
        ("_ops._bwd (the implementation)", lambda: _ops._bwd(*inputs, *args)),
        ("  five gradient allocations", lambda: _ops._bwd_outputs(q, k, v, None, None)),
        ("  nine tensor descriptions",
         lambda: [_ops._desc(n, t) for n, t in zip(names + ("dq", "dk", "dv"), (q, k, v, out, lse, dout, dq, dk, dv))]),
        ("  _native.backward", lambda: _native.backward(descs, grads, opts, stream)),
    ]


def profile(fn, calls, sync):
    """cProfile of ``calls`` calls of ``fn``: the functions with the most time of their own."""
    fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    print(f"\ncProfile of {calls} forward+backward calls (tottime is the function's own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def trace(name, fn, calls):
    """torch.profiler's view of ``calls`` calls of ``fn`` on a GPU: torch's operators on every
    thread and the CUDA driver and runtime calls (CUPTI sees those of any library), by host time."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"\ntorch.profiler over {calls} calls of {name}:")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))

if __name__ == "__main__":
    main()
