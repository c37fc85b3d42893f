"""One CUDA call of each kind, timed, before the test suite: where NVRTC came from, the first
call's time (kernel compile included), the error against SDPA's math backend in float64."""
import time

import torch
import torch.nn.functional as F

import flashattn
from flashattn import _cuda, flash_attn_func

print("flashattn from", flashattn.__file__)
print("nvrtc", _cuda.load_nvrtc(), _cuda.nvrtc_version())
for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 64)):
    q, k, v = (torch.randn(2, 1000, 8, d, device="cuda").to(dtype) for _ in range(3))
    t = time.perf_counter()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    ref = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)), is_causal=True)
    plain = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    err = (out.double() - ref.transpose(1, 2)).abs().max().item()
    sdpa_err = (plain.double() - ref).abs().max().item()
    print(f"{dtype} D={d}: first call {first:.2f} s, max error {err:.3g} (SDPA in {dtype}: {sdpa_err:.3g})")
