"""The GPU half of kernels/harness.py: launches a compiled variant on torch tensors through the
driver API (ctypes), checks it against a float64 reference and times it beside SDPA."""
import ctypes, math, os, statistics, sys
import torch
import harness as H

cu = ctypes.CDLL("libcuda.so.1")

def ck(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")

class FlashParams(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ["q", "k", "v", "o", "lse", "bias", "rel_bias", "alibi", "cu_q", "cu_k"]] + \
        [(n, ctypes.c_longlong) for n in ["q_batch", "q_row", "q_head", "k_batch", "k_row", "k_head",
                                          "v_batch", "v_row", "v_head", "o_batch", "o_row", "o_head",
                                          "bias_batch", "bias_head", "bias_row", "bias_col", "lse_batch", "lse_head"]] + \
        [(n, ctypes.c_int) for n in ["batch", "heads_q", "group", "nq", "nk", "head_dim", "head_dim_v",
                                     "window_left", "window_right", "rel_radius", "diag_given", "diag"]] + \
        [(n, ctypes.c_float) for n in ["scale", "scale_log2", "softcap"]]

_cache = {}
def function(kernel, defines):
    key = (kernel, tuple(sorted(defines.items())))
    if key not in _cache:
        cubin, _, _ = H.compile_cubin(H.source(kernel, defines), "sm_90a")
        mod = ctypes.c_void_p()
        ck(cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        f = ctypes.c_void_p()
        ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, f"flash_fwd_{kernel}".encode()), "getfunc")
        _cache[key] = f
    return _cache[key]

BIG = 1 << 30

class TmaMap(ctypes.Structure):
    _align_ = 64
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]

def tensor_map(x, box_rows):
    """The rank-4 TMA map (head dim, rows, heads, batch) of a [B, N, H, D] view, 64 x box_rows boxes,
    128B swizzle, zeros outside."""
    m = TmaMap()
    dtype = {torch.bfloat16: 9, torch.float16: 6}[x.dtype]  # CU_TENSOR_MAP_DATA_TYPE_{BFLOAT16,FLOAT16}
    B, N, Hh, D = x.shape
    dims = (ctypes.c_uint64 * 4)(D, N, Hh, B)
    strides = (ctypes.c_uint64 * 3)(*(2 * s for s in (x.stride(1), x.stride(2), x.stride(0))))
    box = (ctypes.c_uint32 * 4)(64, box_rows, 1, 1)
    es = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    # interleave none, swizzle 128B (3), L2 promotion 128B (2), OOB fill none (zeros)
    ck(cu.cuTensorMapEncodeTiled(ctypes.byref(m), dtype, 4, ctypes.c_void_p(x.data_ptr()), dims, strides, box,
                                 es, 0, 3, 2, 0), "cuTensorMapEncodeTiled")
    return m

def launch(kernel, tile, q, k, v, causal=False, window=None, softcap=None, alibi=None, bias=None, scale=None):
    """q, k, v: [B, N, H, D] views (last dim contiguous). Returns out [B, Nq, H, Dv], lse [B, H, Nq]."""
    B, Nq, Hq, D = q.shape
    Nk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.full((B, Nq, Hq, Dv), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32, device=q.device)
    scale = 1 / math.sqrt(D) if scale is None else scale
    left, right = (BIG, BIG) if window is None else window
    if causal:
        left, right = BIG, 0
    defines = dict(tile)
    defines.update(H.options(int(softcap is not None), int(alibi is not None), int(bias is not None),
                             int(left < BIG or right < BIG), int(scale <= 0)))
    p = FlashParams()
    p.q, p.k, p.v, p.o, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    p.q_batch, p.q_row, p.q_head = q.stride(0), q.stride(1), q.stride(2)
    p.k_batch, p.k_row, p.k_head = k.stride(0), k.stride(1), k.stride(2)
    p.v_batch, p.v_row, p.v_head = v.stride(0), v.stride(1), v.stride(2)
    p.o_batch, p.o_row, p.o_head = out.stride(0), out.stride(1), out.stride(2)
    p.lse_batch, p.lse_head = lse.stride(0), lse.stride(1)
    if bias is not None:
        bias = bias.float()
        p.bias = bias.data_ptr()
        p.bias_batch, p.bias_head, p.bias_row, p.bias_col = [0 if bias.shape[i] == 1 else bias.stride(i) for i in range(4)]
    if alibi is not None:
        al = alibi.float().expand(B, Hq).contiguous()
        p.alibi = al.data_ptr()
    p.batch, p.heads_q, p.group, p.nq, p.nk = B, Hq, Hq // Hk, Nq, Nk
    p.head_dim, p.head_dim_v, p.window_left, p.window_right = D, Dv, left, right
    p.scale, p.scale_log2, p.softcap = scale, scale * 1.4426950408889634, softcap or 0.0
    f = function(kernel, defines)
    if kernel == "mma":
        br, bc, nt = tile["BR"], tile["BC"], tile["NWARPS"] * 32
        smem = (br * (tile["DQK"] + 8) + 2 * bc * (tile["DQK"] + 8) + 2 * bc * (tile["DV"] + 8)) * 2
    elif kernel == "wgmma":  # WGMMA_SMEM: 1024 (alignment) + Q + the K/V ring + 1024 (mbarriers)
        br, bc, nt = tile["BR"], tile["BC"], 128 * (tile["NWG"] + 1)
        smem = 2048 + (br * tile["DQK"] + tile["STAGES"] * bc * (tile["DQK"] + tile["DV"])) * 2
    else:
        br, bc, nt = 16, tile["BCG"], 128
        smem = (16 * (tile["DQK_MAX"] + 1) + bc * (tile["DQK_MAX"] + 1) + bc * tile["DV_MAX"] + 16 * bc) * 4
    ck(cu.cuFuncSetAttribute(f, 8, smem), "set smem")  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if kernel == "wgmma":
        # Q: a box of 64 rows a consumer from version 8 on (QW_BYTES), of the tile's rows before it.
        main = open(tile.get("_FILE", os.path.join(H.HERE, "flash_fwd_wgmma.cu"))).read()
        maps = [tensor_map(x, box) for x, box in ((q, 64 if "QW_BYTES" in main else br), (k, bc), (v, bc))]
        sched = torch.zeros(2, dtype=torch.int32, device=q.device)  # the tile counter (left 0 by each launch)
        sched_ptr = ctypes.c_void_p(sched.data_ptr())
        ptrs = [p] + maps + [sched_ptr]
        args = (ctypes.c_void_p * 5)(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in ptrs])
        p = (p, maps, sched, sched_ptr)
    else:
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p))
    stream = torch.cuda.current_stream().cuda_stream
    grid = ((Nq + br - 1) // br, Hq, B)
    if kernel == "wgmma":  # persistent: one block per SM at most
        grid = (min(grid[0] * Hq * B, torch.cuda.get_device_properties(0).multi_processor_count), 1, 1)
    ck(cu.cuLaunchKernel(f, *grid, nt, 1, 1, smem, ctypes.c_void_p(stream), args, None), "launch")
    return out, lse, (f, *grid, nt, smem, args, p, bias, alibi)

def reference(q, k, v, causal=False, window=None, softcap=None, alibi=None, bias=None, scale=None):
    B, Nq, Hq, D = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(Hq // Hk, 1)
    vd = vd.repeat_interleave(Hq // Hk, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq, device=q.device).view(-1, 1)
    j = torch.arange(Nk, device=q.device).view(1, -1)
    d = j - (i + Nk - Nq)
    if alibi is not None:
        s = s - alibi.double().expand(B, Hq).view(B, Hq, 1, 1) * d.abs().double()
    if bias is not None:
        s = s + bias.double()
    left, right = (BIG, BIG) if window is None else window
    if causal:
        left, right = BIG, 0
    vis = (d >= -left) & (d <= right)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    pr = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (pr @ vd).transpose(1, 2), lse

def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()

def check_one(kernel, tile, dtype, B, Nq, Nk, Hq, Hk, D, Dv, **opt):
    dev = "cuda"
    q = torch.randn(B, Nq, Hq, D, device=dev).to(dtype)
    k = torch.randn(B, Nk, Hk, D, device=dev).to(dtype)
    v = torch.randn(B, Nk, Hk, Dv, device=dev).to(dtype)
    if opt.get("bias") == "make":
        opt["bias"] = torch.randn(1, Hq, Nq, Nk, device=dev)
    if opt.get("alibi") == "make":
        opt["alibi"] = torch.rand(Hq, device=dev)
    out, lse, _ = launch(kernel, tile, q, k, v, **opt)
    torch.cuda.synchronize()
    ro, rl = reference(q, k, v, **opt)
    e_out = rel(out, ro)
    # the same-precision yardstick: reference computed from rounded inputs, rounded output
    e_std = rel(ro.to(dtype), ro)
    fin = torch.isfinite(rl)
    lse_ok = bool(torch.equal(torch.isinf(lse), torch.isinf(rl))) and (lse[fin] - rl[fin].float()).abs().max().item() < 1e-2 if fin.any() else bool(torch.isinf(lse).all())
    nan = bool(torch.isnan(out).any())
    return e_out, e_std, lse_ok, nan

def cmd_check(names, quick=False):
    """Every variant on odd sizes and options against float64; `quick`: bf16 and three cases only
    (a run short enough for compute-sanitizer)."""
    torch.manual_seed(0)
    cases = [
        dict(B=2, Nq=128, Nk=128, Hq=4, Hk=4),
        dict(B=1, Nq=113, Nk=203, Hq=4, Hk=2),
        dict(B=2, Nq=203, Nk=65, Hq=6, Hk=2, causal=True),
        dict(B=1, Nq=1000, Nk=1000, Hq=2, Hk=1, causal=True),
        dict(B=1, Nq=77, Nk=333, Hq=2, Hk=1, causal=True),
        dict(B=1, Nq=257, Nk=300, Hq=2, Hk=2, window=(37, 5)),
        dict(B=1, Nq=130, Nk=130, Hq=2, Hk=2, softcap=5.0, alibi="make", bias="make", causal=True),
        dict(B=1, Nq=65, Nk=1, Hq=2, Hk=2, causal=True),
        dict(B=1, Nq=64, Nk=64, Hq=2, Hk=2, scale=-0.1),
    ]
    if quick:
        cases = [cases[1], cases[2], cases[6]]
    bad = 0
    for name in names:
        kernel, tile = H.kernel_of(name)
        D = tile.get("DQK", tile.get("DQK_MAX"))
        dims = [(D, D)] if kernel in ("mma", "wgmma") else [(1, 1), (80, 96), (D, D)]
        dtypes = [torch.bfloat16, torch.float16] if kernel in ("mma", "wgmma") else [torch.float32, torch.float16]
        dtypes = dtypes[:1] if quick else dtypes
        for c in cases:
            for dt in dtypes:
                for (dq, dv) in dims:
                    t = dict(tile)
                    if "ELEM_BF16" in t or "ELEM_F16" in t or "ELEM_F32" in t:
                        for e in ["ELEM_BF16", "ELEM_F16", "ELEM_F32"]:
                            t.pop(e, None)
                        t[{torch.bfloat16: "ELEM_BF16", torch.float16: "ELEM_F16", torch.float32: "ELEM_F32"}[dt]] = 1
                    e, es, lok, nan = check_one(kernel, t, dt, D=dq, Dv=dv, **c)
                    tol = 1e-5 if dt == torch.float32 else 2 * es
                    ok = e <= tol and lok and not nan
                    bad += not ok
                    print(f"[{'PASS' if ok else 'FAIL'}] {name} {dt} D={dq}/{dv} {c}: err {e:.2e} (bound {tol:.2e}) lse_ok={lok} nan={nan}")
    print("check failures:", bad)
    return bad

def time_ms(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)

def cmd_bench(names, seqlens, dims, sdpa=True):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    rows = []
    for D in dims:
        for causal in [False, True]:
            for N in seqlens:
                B, Hh = 16384 // N, 2048 // D
                q, k, v = (torch.randn(B, N, Hh, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * B * Hh * N * N * D / (2 if causal else 1)
                res = {}
                for name in names:
                    kernel, tile = H.kernel_of(name)
                    if tile["DQK"] != D:
                        continue
                    _, _, l = launch(kernel, tile, q, k, v, causal=causal)
                    f, gx, gy, gz, nt, smem, args, *_keep = l
                    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
                    ms = time_ms(lambda: cu.cuLaunchKernel(f, gx, gy, gz, nt, 1, 1, smem, stream, args, None))
                    res[name] = flops / ms / 1e9
                if sdpa:
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                    for be, bn in [(SDPBackend.FLASH_ATTENTION, "fa2"), (SDPBackend.CUDNN_ATTENTION, "cudnn")]:
                        with sdpa_kernel(be):
                            ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                        res[bn] = flops / ms / 1e9
                line = f"D={D} causal={int(causal)} N={N}: " + " ".join(f"{k}={v:.0f}" for k, v in res.items())
                if "fa2" in res:
                    best = max((v, k) for k, v in res.items() if k not in ("fa2", "cudnn")) if len(res) > 2 else None
                    if best:
                        line += f" | best {best[1]} {best[0] / res['fa2']:.3f}x fa2, {best[0] / res['cudnn']:.3f}x cudnn"
                print(line, flush=True)
                rows.append(line)
    return rows

def cmd_prof(names, N, D, causal):
    """One launch of each variant and of SDPA's FlashAttention-2 and cuDNN backends, for a profiler."""
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    B, Hh = 16384 // N, 2048 // D
    q, k, v = (torch.randn(B, N, Hh, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in names:
        launch(*H.kernel_of(name), q, k, v, causal=causal)
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel(be):
            F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    torch.cuda.synchronize()

def main(args):
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    names = args.variants.split(",") if args.variants else list(H.VARIANTS) + list(H.WGMMA)
    if args.cmd == "check":
        sys.exit(1 if cmd_check(names, args.quick) else 0)
    elif args.cmd == "bench":
        cmd_bench(names, [512, 1024, 2048, 4096, 8192, 16384], [int(d) for d in args.dims.split(",")])
    elif args.cmd == "prof":
        cmd_prof(names, args.n, int(args.dims.split(",")[0]), args.causal)
