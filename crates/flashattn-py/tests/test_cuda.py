"""CUDA tensors: outputs and gradients against the float64 oracle (on the CPU) over awkward
shapes, dtypes and every option; ordering on PyTorch's current stream; torch.compile, opcheck and
the errors of mixed devices and dtypes. Skipped where PyTorch sees no GPU.

Until the library has a CUDA backward, a gradient check ends in ``xfail`` once the forward has
been checked, after asserting that the error is a ``NotImplementedError`` naming the pass; with a
CUDA backward the same tests check the gradients."""

import pytest
import torch

from check import compare, randn
from test_attention import DIAGONALS, DTYPES, OPTIONS, SHAPES
from test_varlen import check_varlen
from flashattn import flash_attn_func, flash_attn_varlen_func

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# More shapes (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal): the head dims the
# tensor-core kernels are built for and sequence lengths that are no multiple of a tile.
GPU_SHAPES = SHAPES + [
    (2, 113, 203, 8, 2, 128, True),
    (1, 239, 239, 4, 4, 256, False),
    (2, 128, 128, 8, 8, 64, False),
    (1, 1, 203, 8, 1, 64, True),
    (1, 203, 113, 2, 2, 96, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_shapes(shape, dtype):
    b, nq, nk, h, hk, d, causal = shape
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    compare(q, k, v, dtype, causal=causal, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype):
    """q and v stored [B, H, N, D] on the GPU and passed as transposed views, k a slice of a wider
    head dim: used where they lie."""
    b, n, h, d = 2, 65, 4, 64
    q = randn(b, h, n, d, dtype=dtype).cuda().transpose(1, 2)
    k = randn(b, n, h, d + 32, dtype=dtype).cuda()[..., 16 : 16 + d]
    v = randn(b, h, n, d, dtype=dtype).cuda().transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    compare(q, k, v, dtype, causal=True, device="cuda")


def test_head_dim_of_v_may_differ():
    bf16 = torch.bfloat16
    q, k, v = randn(2, 7, 2, 64, dtype=bf16), randn(2, 65, 2, 64, dtype=bf16), randn(2, 65, 2, 128, dtype=bf16)
    compare(q, k, v, bf16, causal=True, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(name, dtype):
    """Every option, the ALiBi slopes and the bias on the GPU too."""
    b, nq, nk, h, hk, d = 2, 65, 130, 4, 2, 64
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    opts = dict(OPTIONS[name])
    slopes = {"heads": (h,), "batch_heads": (b, h)}
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = (torch.rand(*slopes[opts["alibi_slopes"]]) * 0.5).cuda()
    bias = None
    if "bias" in opts:
        bias_shape = {"full": (b, h, nq, nk), "broadcast": (1, h, 1, nk)}[opts.pop("bias")]
        bias = randn(*bias_shape, dtype=dtype).cuda()
    compare(q, k, v, dtype, bias=bias, **opts, device="cuda")


def test_causal_rows_that_see_no_key():
    q, k, v = randn(1, 9, 2, 64), randn(1, 4, 2, 64), randn(1, 4, 2, 64)
    compare(q, k, v, torch.float32, causal=True, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal, dtype):
    check_varlen(causal, dtype, device="cuda")


def test_side_stream_is_followed_both_ways():
    """On a side stream behind a long sleep, flashattn reads inputs written on that stream after
    the sleep, and the stream's next kernel reads the finished output (its memory NaN before)."""
    b, n, h, d = 2, 2048, 8, 128
    q, k, v = (randn(b, n, h, d, dtype=torch.bfloat16).cuda() for _ in range(3))
    want = flash_attn_func(q * 2, k, v, causal=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # NaN in the memory the caching allocator hands q2 and the output next, on this stream.
        nans = [torch.full_like(want, float("nan")) for _ in range(2)]
        del nans
        torch.cuda._sleep(200_000_000)
        q2 = q * 2
        out = flash_attn_func(q2, k, v, causal=True)
        got = out.clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    # Once more with the default stream idle and the side stream busy: nothing waits on the host.
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        out = flash_attn_func(q2, k, v, causal=True)
        assert not side.query(), "the call waited for the side stream on the host"
        got = out.clone()
    side.synchronize()
    assert torch.equal(got, want)


def test_torch_compile_fullgraph():
    q, k, v = (randn(2, 65, 4, 64, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    bias = randn(1, 4, 1, 65, dtype=torch.bfloat16).cuda().requires_grad_()

    def f(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=True, softcap=3.0, bias=bias) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v, bias), f(q, k, v, bias))
    dout = randn(2, 65, 4, 64, dtype=torch.bfloat16).cuda()
    grads = [torch.autograd.grad(fn(q, k, v, bias), (q, k, v, bias), dout) for fn in (f, compiled)]
    for eager, comp in zip(*grads):
        assert torch.equal(eager, comp)


def test_torch_compile_fullgraph_varlen():
    q, k = randn(12, 2, 64).cuda(), randn(15, 2, 64).cuda()
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32, device="cuda")

    def f(q, k):
        return flash_attn_varlen_func(q, k, k, cu_q, cu_k, 7, 9, causal=True)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k), f(q, k))


def test_opcheck():
    q, k, v = (randn(2, 7, 4, 64, dtype=torch.float16).cuda() for _ in range(3))
    bias = randn(2, 4, 7, 7, dtype=torch.float16).cuda()
    slopes = torch.rand(4, device="cuda")
    fwd_args = (q, k, v, bias, slopes, None, None, 0.3, 20, -1, 5.0)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, fwd_args)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v, None, None, None, None, None, -1, 0, 0.0))
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 30, 65], dtype=torch.int32, device="cuda")
    vq, vk = randn(7, 4, 64).cuda(), randn(65, 2, 64).cuda()
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (vq, vk, vk, None, None, cu_q, cu_k, None, -1, 0, 0.0))
    out, lse = torch.ops.flashattn.fwd(*fwd_args)
    grad_args = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone(), bias.clone())]
    torch.library.opcheck(torch.ops.flashattn.fwd.default, tuple(grad_args) + fwd_args[4:])
    bwd_args = (randn(*out.shape, dtype=torch.float16).cuda(), q, k, v, out, lse, bias, slopes,
                None, None, 0.3, 20, -1, 5.0)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, bwd_args)


def test_deterministic_gradients_repeat_bit_for_bit():
    q, k, v = (randn(2, 300, 4, 64, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    bias = randn(1, 4, 300, 300).cuda().requires_grad_()
    dout = randn(2, 300, 4, 64, dtype=torch.bfloat16).cuda()
    grads = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True, bias=bias)
        grads.append(torch.autograd.grad(out, (q, k, v, bias), dout))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_mixed_devices_and_dtypes_are_refused_naming_the_argument():
    q, k, v = (randn(2, 7, 4, 64).cuda() for _ in range(3))
    with pytest.raises(ValueError, match="device mismatch for `k`: expected cuda:0, got cpu"):
        flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match="`bias`"):
        flash_attn_func(q, k, v, bias=randn(1, 4, 1, 7))
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match="device mismatch for `k`"):
        flash_attn_func(q.cpu(), k, v.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_another_gpu_is_a_device_mismatch_and_keeps_the_current_device():
    q, k, v = (randn(2, 7, 4, 64).cuda() for _ in range(3))
    with pytest.raises(ValueError, match="device mismatch for `k`: expected cuda:0, got cuda:1"):
        flash_attn_func(q, k.to("cuda:1"), v)
    q1, k1, v1 = (t.to("cuda:1") for t in (q, k, v))
    assert torch.equal(flash_attn_func(q1, k1, v1).cpu(), flash_attn_func(q, k, v).cpu())
    assert torch.cuda.current_device() == 0


# Diagonals past every key (the kernels get them clamped where that changes nothing): all seen
# reading the table's first or last entry, or none seen under the window.
FAR_DIAGONALS = [
    (65, 130, 2**40, {"causal": True, "rel_bias": 6}),
    (40, 65, -(2**40), {"softcap": 3.0, "rel_bias": 3}),
    (40, 65, -(2**40), {"window_size": (-1, 5)}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(DIAGONALS + FAR_DIAGONALS)))
def test_diagonal(case, dtype):
    """Query i's diagonal at key i + diagonal on the GPU: the mask, ALiBi and the table measure
    from it, output, log-sum-exp and every gradient against the oracle."""
    nq, nk, diagonal, opts = (DIAGONALS + FAR_DIAGONALS)[case]
    b, h, hk, d = 2, 4, 2, 64
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    opts = dict(opts)
    slopes = {"heads": (h,), "batch_heads": (b, h)}
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = (torch.rand(*slopes[opts["alibi_slopes"]]) * 0.5).cuda()
    L = opts.pop("rel_bias", None)
    rel_bias = None if L is None else randn(h, 2 * L - 1)
    compare(q, k, v, dtype, rel_bias=rel_bias, diagonal=diagonal, **opts, device="cuda")


@pytest.mark.parametrize("diagonal", [-6, 0, 40])
def test_varlen_diagonal(diagonal):
    check_varlen(True, torch.bfloat16, device="cuda", diagonal=diagonal)


class Capsule:
    """An array known only through the DLPack protocol, as CuPy's and JAX's are."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_dlpack_objects_on_the_gpu():
    q, k, v = (randn(1, 65, 2, 64, dtype=torch.float16).cuda() for _ in range(3))
    got = flash_attn_func(Capsule(q), Capsule(k), Capsule(v), causal=True)
    assert got.device == q.device and torch.equal(got, flash_attn_func(q, k, v, causal=True))
