"""Outputs and gradients against the float64 oracle over awkward shapes, dtypes, layouts and
every option of flash_attn_func."""

import pytest
import torch

from check import compare, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal)
SHAPES = [
    (1, 1, 1, 1, 1, 8, False),
    (2, 7, 7, 4, 4, 40, True),
    (1, 65, 130, 4, 2, 64, True),
    (2, 130, 65, 3, 1, 80, True),
    (1, 7, 65, 2, 2, 8, False),
    (3, 65, 65, 8, 2, 64, False),
    (1, 130, 1, 2, 1, 40, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(shape, dtype):
    b, nq, nk, h, hk, d, causal = shape
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    compare(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype):
    """q and v stored [B, H, N, D] and passed as transposed views, k a slice of a wider head dim."""
    b, n, h, d = 2, 65, 4, 40
    q = randn(b, h, n, d, dtype=dtype).transpose(1, 2)
    k = randn(b, n, h, d + 24, dtype=dtype)[..., 8 : 8 + d]
    v = randn(b, h, n, d, dtype=dtype).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    compare(q, k, v, dtype, causal=True)


def test_head_dim_of_v_may_differ():
    q, k, v = randn(2, 7, 2, 40), randn(2, 65, 2, 40), randn(2, 65, 2, 64)
    compare(q, k, v, causal=True)


OPTIONS = {
    "scale": {"softmax_scale": 0.3},
    "window": {"window_size": (3, 2)},
    "window_left_only": {"window_size": (5, -1)},
    "window_causal": {"window_size": (9, 4), "causal": True},
    "softcap": {"softcap": 2.0},
    "alibi_heads": {"alibi_slopes": "heads"},
    "alibi_batch_heads": {"alibi_slopes": "batch_heads", "causal": True},
    "bias_full": {"bias": "full"},
    "bias_broadcast": {"bias": "broadcast", "causal": True},
    "everything": {"softmax_scale": 0.2, "window_size": (20, 3), "softcap": 3.0, "alibi_slopes": "heads",
                   "bias": "broadcast", "deterministic": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(name, dtype):
    b, nq, nk, h, hk, d = 2, 65, 130, 4, 2, 64
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    opts = dict(OPTIONS[name])
    slopes = {"heads": (h,), "batch_heads": (b, h)}
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = torch.rand(*slopes[opts["alibi_slopes"]]) * 0.5
    bias = None
    if "bias" in opts:
        bias_shape = {"full": (b, h, nq, nk), "broadcast": (1, h, 1, nk)}[opts.pop("bias")]
        bias = randn(*bias_shape, dtype=dtype)
    compare(q, k, v, dtype, bias=bias, **opts)


# (seqlen_q, seqlen_k, heads, heads_k, L, options)
REL_BIAS = [
    (65, 130, 4, 2, 5, {"causal": True}),
    (130, 65, 3, 1, 200, {"window_size": (20, 3), "softcap": 3.0, "alibi_slopes": "heads", "bias": True}),
    (7, 7, 2, 2, 2, {}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(REL_BIAS)))
def test_rel_bias(case, dtype):
    """The relative-position table (f32 [heads, 2L - 1]) alone and with every other option: output,
    log-sum-exp and every gradient, the table's included."""
    nq, nk, h, hk, L, opts = REL_BIAS[case]
    b, d = 2, 40
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    opts = dict(opts)
    if opts.pop("alibi_slopes", None):
        opts["alibi_slopes"] = torch.rand(h) * 0.5
    bias = randn(1, h, 1, nk, dtype=dtype) if opts.pop("bias", False) else None
    compare(q, k, v, dtype, bias=bias, rel_bias=randn(h, 2 * L - 1), **opts)


# (seqlen_q, seqlen_k, diagonal, options): the first rows' diagonals before every key, a diagonal
# past the default (65), negative ones with a window and ALiBi, 0 with everything.
DIAGONALS = [
    (65, 130, -20, {"causal": True}),
    (65, 130, 100, {"causal": True, "alibi_slopes": "heads"}),
    (40, 40, -7, {"window_size": (9, 3), "alibi_slopes": "heads"}),
    (40, 65, 0, {"causal": True, "alibi_slopes": "batch_heads", "softcap": 3.0, "rel_bias": 6}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(DIAGONALS)))
def test_diagonal(case, dtype):
    """Query i's diagonal at key i + diagonal, which the mask, ALiBi and the table measure from:
    output, log-sum-exp and every gradient."""
    nq, nk, diagonal, opts = DIAGONALS[case]
    b, h, hk, d = 2, 4, 2, 40
    q, k, v = randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)
    opts = dict(opts)
    slopes = {"heads": (h,), "batch_heads": (b, h)}
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = torch.rand(*slopes[opts["alibi_slopes"]]) * 0.5
    L = opts.pop("rel_bias", None)
    rel_bias = None if L is None else randn(h, 2 * L - 1)
    compare(q, k, v, dtype, rel_bias=rel_bias, diagonal=diagonal, **opts)


def test_causal_rows_that_see_no_key():
    """With more queries than keys, the first causal rows see none: output 0, lse -inf, grads 0."""
    q, k, v = randn(1, 9, 2, 8), randn(1, 4, 2, 8), randn(1, 4, 2, 8)
    compare(q, k, v, causal=True)
