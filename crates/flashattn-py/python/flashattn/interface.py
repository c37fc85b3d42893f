"""FlashAttention-2's Python API (``flash_attn_func``, ``flash_attn_varlen_func``) over the
``flashattn::fwd`` operator: same arguments, defaults, layouts and return values, on CPU and CUDA
tensors."""

import operator
from typing import Optional, Tuple

import numpy as np
import torch

from . import _ops


def _window(causal: bool, window_size: Tuple[int, int]) -> Tuple[int, int]:
    """The window's (left, right), -1 unbounded; causal is right = 0, aligned bottom-right."""
    left, right = window_size
    return left, (0 if causal else right)


def _diagonal(diagonal) -> Optional[int]:
    """``diagonal`` as an int (None stays None), within 64 bits; the library checks its range."""
    if diagonal is None:
        return None
    if isinstance(diagonal, bool) or not hasattr(type(diagonal), "__index__"):
        raise TypeError(f"invalid type for `diagonal`: expected an int or None, got {type(diagonal).__name__}")
    d = operator.index(diagonal)
    if not -(2**63) <= d < 2**63:
        raise ValueError(f"invalid argument `diagonal`: expected a 64-bit integer, got {d}")
    return d


def _check(dropout_p: float, *tensors) -> None:
    if dropout_p > 0.0:
        raise ValueError(f"invalid argument `dropout_p`: expected 0.0 (dropout is not implemented yet), got {dropout_p}")
    for name, t in tensors:
        _ops.expect_device(name, t)


def _torch(x):
    """``x`` as a torch tensor and whether it came from numpy: numpy arrays and other DLPack
    objects (CuPy, JAX) without a copy, where they lie."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x), True
    if x is not None and not isinstance(x, torch.Tensor) and hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x), False
    return x, False


def _rows(t):
    """``t`` with a contiguous last dimension, as the kernels read it (a copy only when not)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _finish(out, lse, numpy: bool, return_attn_probs: bool):
    if numpy:
        out, lse = out.detach().numpy(), lse.detach().numpy()
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    bias=None,
    rel_bias=None,
    diagonal=None,
):
    """Exact attention of ``q`` ``[batch, seqlen_q, heads, head_dim]`` over ``k``, ``v``
    ``[batch, seqlen_k, heads_k, head_dim]`` (``heads`` a multiple of ``heads_k``: MQA/GQA).

    As FlashAttention-2's: ``causal`` is aligned bottom-right, ``window_size`` -1 is unbounded,
    ``softcap`` 0 is none, ``alibi_slopes`` f32 ``[heads]`` or ``[batch, heads]``; with
    ``return_attn_probs`` the result is ``(out, softmax_lse, None)``, ``softmax_lse`` f32
    ``[batch, heads, seqlen_q]``. ``bias`` (keyword only) is an additive bias broadcastable to
    ``[batch, heads, seqlen_q, seqlen_k]``, differentiable. ``rel_bias`` (keyword only) is a
    relative-position table, f32 ``[heads, 2L - 1]``, differentiable: query ``i`` and key ``j`` add
    ``rel_bias[h, clamp(j - (i + seqlen_k - seqlen_q), -(L-1), L-1) + L - 1]`` to their score
    (after softcap, with ALiBi and the bias). ``diagonal`` (keyword only, an int) puts query
    ``i``'s diagonal at key ``i + diagonal`` instead of ``i + seqlen_k - seqlen_q``: the causal
    mask, the window, ALiBi and ``rel_bias`` measure from it (a block of queries at global position
    ``qo`` against keys at ``ko``: ``qo - ko``), on the CPU and the GPU. ``deterministic=True``
    makes the CUDA backward give the same bits on every run (dQ and the bias gradient in a fixed
    order instead of by atomics); the CPU backward already does for a thread count. CUDA tensors
    run on PyTorch's current stream.
    numpy arrays in, numpy arrays out; other DLPack objects (CuPy, JAX arrays) are read where
    they lie and give torch tensors (``cupy.from_dlpack(out)`` takes them back without a copy).
    """
    (q, numpy), (k, _), (v, _) = _torch(q), _torch(k), _torch(v)
    bias, alibi_slopes, rel_bias = _torch(bias)[0], _torch(alibi_slopes)[0], _torch(rel_bias)[0]
    _check(
        dropout_p, ("q", q), ("k", k), ("v", v), ("bias", bias), ("alibi_slopes", alibi_slopes), ("rel_bias", rel_bias)
    )
    left, right = _window(causal, window_size)
    out, lse = _ops.attention(
        _rows(q), _rows(k), _rows(v), bias, alibi_slopes, None, None, softmax_scale, left, right, float(softcap),
        bool(deterministic), rel_bias, _diagonal(diagonal),
    )
    return _finish(out, lse, numpy, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    rel_bias=None,
    diagonal=None,
):
    """Attention over packed variable-length sequences: ``q`` ``[total_q, heads, head_dim]``,
    ``k``, ``v`` ``[total_k, heads_k, head_dim]``, sequence ``b`` the rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, ``batch + 1`` entries from 0). ``max_seqlen_q``
    and ``max_seqlen_k`` are accepted as FlashAttention-2 takes them; the lengths come from the
    ``cu_seqlens``. Otherwise as :func:`flash_attn_func` (``rel_bias`` too, each sequence aligned
    by its own lengths; ``diagonal``, the same for every sequence); ``softmax_lse`` is
    ``[heads, total_q]``.
    """
    (q, numpy), (k, _), (v, _) = _torch(q), _torch(k), _torch(v)
    cu_q, cu_k, alibi_slopes = _torch(cu_seqlens_q)[0], _torch(cu_seqlens_k)[0], _torch(alibi_slopes)[0]
    rel_bias = _torch(rel_bias)[0]
    _check(dropout_p, ("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("rel_bias", rel_bias))
    left, right = _window(causal, window_size)
    out, lse = _ops.attention(
        _rows(q), _rows(k), _rows(v), None, alibi_slopes, cu_q, cu_k, softmax_scale, left, right, float(softcap),
        bool(deterministic), rel_bias, _diagonal(diagonal),
    )
    return _finish(out, lse, numpy, return_attn_probs)
