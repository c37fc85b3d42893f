"""The torch operators ``flashattn::fwd`` and ``flashattn::bwd``: the native forward and backward
on CPU and CUDA tensors, with fake (meta) implementations for ``torch.compile`` and autograd
through ``bwd``. On a GPU the work is ordered on PyTorch's current stream, with no host
synchronization (except for what the library reads on the host: ``cu_seqlens`` and ALiBi slopes
that live on the GPU are copied to the host first).

:func:`attention` is what ``flash_attn_func`` calls: in plain eager code it runs the operators'
implementations straight away (autograd through :class:`_Attention`), since the dispatcher's
Python layers cost several times the native call; whatever must see the operators (tracing,
modes, tensor subclasses) gets them."""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _cuda, _native

# The dtype names the native module knows; others reach it by their torch names, to be refused.
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def expect_device(name: str, t: Optional[Tensor]) -> None:
    """Raises a ``ValueError`` unless ``t`` is None or on the CPU or a GPU (tensors of one call on
    different devices are refused by the library, naming the argument)."""
    if t is not None and not (t.is_cuda or t.is_cpu):
        raise ValueError(f"`{name}` is on {t.device}: only CPU and CUDA tensors are supported")


def _desc(name: str, t: Tensor):
    """The native module's description of ``t``: its memory, used where it lies, on the GPU of
    that ordinal or (-1) the CPU."""
    expect_device(name, t)
    dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
    return (t.data_ptr(), dtype, t.shape, t.stride(), t.get_device(), t)


def _opts(bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap,
          deterministic=False, rel_bias=None, diagonal=None):
    """The native module's options tuple; negative window sides and a zero softcap mean none,
    ``diagonal`` None the bottom-right one."""
    window = (window_left if window_left >= 0 else None, window_right if window_right >= 0 else None)
    varlen = None
    if cu_seqlens_q is not None and cu_seqlens_k is not None:
        varlen = (cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
    return (
        scale,
        window,
        softcap if softcap != 0.0 else None,
        None if alibi_slopes is None else _desc("alibi_slopes", alibi_slopes),
        None if bias is None else _desc("bias", bias),
        varlen,
        bool(deterministic),
        None if rel_bias is None else _desc("rel_bias", rel_bias),
        diagonal,
    )


def _lse_shape(q: Tensor, varlen: bool) -> List[int]:
    """FlashAttention-2's log-sum-exp shape: [batch, heads, seqlen_q], varlen [heads, total_q]."""
    if varlen:
        return [q.shape[1], q.shape[0]]
    return [q.shape[0], q.shape[2], q.shape[1]]


def _fwd_outputs(q: Tensor, v: Tensor, varlen: bool) -> Tuple[Tensor, Tensor]:
    """The forward's output (q's dtype, v's head dim) and log-sum-exp (f32), unwritten."""
    out = q.new_empty(list(q.shape[:-1]) + [v.shape[-1]])
    return out, q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)


def _bwd_outputs(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], rel_bias: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward's dq, dk, dv (their inputs' shapes and dtypes), dbias and drel_bias (f32; empty
    without that bias), unwritten."""
    dbias = q.new_empty(bias.shape if bias is not None else [0], dtype=torch.float32)
    drel = q.new_empty(rel_bias.shape if rel_bias is not None else [0], dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, drel


def _fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
    rel_bias: Optional[Tensor] = None,
    diagonal: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention output (contiguous, q's dtype, v's head dim) and log-sum-exp (f32);
    ``deterministic`` is kept for the backward; ``rel_bias`` a relative-position table (f32
    ``[heads, 2L - 1]``); ``diagonal``: query i's diagonal at key i + diagonal (None: the
    bottom-right one)."""
    out, lse = _fwd_outputs(q, v, cu_seqlens_q is not None)
    opts = _opts(
        bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap, False, rel_bias,
        diagonal,
    )
    with _cuda.on_device(q):
        qkv, outputs = (_desc("q", q), _desc("k", k), _desc("v", v)), (_desc("out", out), _desc("lse", lse))
        _native.forward(qkv, outputs, opts, _cuda.stream(q))
    return out, lse


fwd = torch.library.custom_op("flashattn::fwd", mutates_args=(), device_types=("cpu", "cuda"))(_fwd)


@fwd.register_fake
def _fwd_fake(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap,
              deterministic=False, rel_bias=None, diagonal=None):
    return _fwd_outputs(q, v, cu_seqlens_q is not None)


def _bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bias: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
    rel_bias: Optional[Tensor] = None,
    diagonal: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (contiguous, in their inputs' dtype), dbias and drel_bias (f32, in their
    biases' shapes; empty without that bias); ``deterministic``: the same bits on every run (the
    library's mode)."""
    dq, dk, dv, dbias, drel = _bwd_outputs(q, k, v, bias, rel_bias)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    opts = _opts(
        bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap, deterministic,
        rel_bias, diagonal,
    )
    inputs = tuple(_desc(n, t) for n, t in zip(("q", "k", "v", "out", "lse", "dout"), (q, k, v, out, lse, dout)))
    grads = (
        _desc("dq", dq),
        _desc("dk", dk),
        _desc("dv", dv),
        None if bias is None else _desc("dbias", dbias),
        None if rel_bias is None else _desc("drel_bias", drel),
    )
    with _cuda.on_device(q):
        _native.backward(inputs, grads, opts, _cuda.stream(q))
    return dq, dk, dv, dbias, drel


bwd = torch.library.custom_op("flashattn::bwd", mutates_args=(), device_types=("cpu", "cuda"))(_bwd)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, wl, wr, softcap,
              deterministic=False, rel_bias=None, diagonal=None):
    return _bwd_outputs(q, k, v, bias, rel_bias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, wl, wr, softcap, deterministic = inputs[:12]
    rel_bias, diagonal = inputs[12:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rel_bias)
    ctx.options = (scale, wl, wr, softcap, deterministic)
    ctx.diagonal = diagonal
    ctx.mark_non_differentiable(lse)
    # No zeros for lse's gradient (never used) or an unused output's: a tensor and a fill kernel
    # less per backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    if dout is None:  # only the log-sum-exp was used, which has no gradient
        return (None,) * 14
    q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rel_bias = ctx.saved_tensors
    args = (dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv, dbias, drel = (_bwd if _eager(args + (rel_bias,)) else bwd)(
        *args, *ctx.options, rel_bias, ctx.diagonal
    )
    dbias = dbias.to(bias.dtype) if bias is not None else None
    drel = drel if rel_bias is not None else None
    return dq, dk, dv, dbias, None, None, None, None, None, None, None, None, drel, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def _eager(tensors) -> bool:
    """True when the operators' implementations may run without the dispatcher: plain tensors (or
    None) on the CPU or a GPU, and nothing that must see the operators: no ``torch.compile``
    tracing, no dispatch or torch-function mode (fake tensors, ``make_fx``, ``torch.device``
    contexts), no functorch transform, no ``torch.jit`` tracing."""
    C = torch._C
    if (torch.compiler.is_compiling() or C._len_torch_dispatch_stack() or C._is_torch_function_mode_enabled()
            or C._are_functorch_transforms_active() or C._get_tracing_state()):
        return False
    return all(t is None or (type(t) is Tensor and (t.is_cuda or t.is_cpu)) for t in tensors)


class _Attention(torch.autograd.Function):
    """``flashattn::fwd`` with its registered autograd, for eager calls that need gradients. The
    forward takes ``ctx`` itself: with a separate ``setup_context`` every ``apply`` binds its
    arguments through ``inspect.signature``, tens of microseconds (functorch, which would need
    that form, gets the operator)."""

    @staticmethod
    def forward(ctx, *args):
        output = _fwd(*args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward)


def attention(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap,
              deterministic, rel_bias=None, diagonal=None):
    """``flashattn::fwd(...)``'s result, the same as calling the operator: in plain eager code
    (:func:`_eager`) its implementation, through :class:`_Attention` when a gradient is needed;
    else the operator."""
    args = (q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, window_left, window_right, softcap,
            deterministic, rel_bias, diagonal)
    if not _eager(args[:7] + (rel_bias,)):
        return fwd(*args)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias, rel_bias)):
        return _Attention.apply(*args)
    return _fwd(*args)
