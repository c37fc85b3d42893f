"""The oracle of the tests: attention straight from its definition, softmax(Q·Kᵀ·scale + mods)·V
with FlashAttention-2's conventions, in whatever dtype its inputs have (float64 for the oracle,
the inputs' own dtype for the plain implementation whose error sets the tolerances). Its backward
forms dS = P∘(dP − D) with D = rowsum(dO∘O), FlashAttention's identity, as the kernels do: where the
textbook rowsum(P∘dP) cancels exactly (a row that sees one key), D still differs from dP by the
roundings of two sums, and so do the kernels' gradients."""

import math

import torch


def attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None, bias=None,
              rel_bias=None, diagonal=None):
    """Output [B, Nq, H, Dv] and log-sum-exp [B, H, Nq] of q [B, Nq, H, D] over k, v
    [B, Nk, Hk, _]; keys per query head repeated for MQA/GQA; rows that see no key give 0, -inf.
    Query i's diagonal is key i + diagonal (None: Nk - Nq); the mask and ALiBi measure from it.
    ``rel_bias`` [H, 2L - 1]: query i and key j add entry clamp(j - (i + diagonal), -(L-1), L-1) + L-1."""
    nq, nk, h = q.shape[1], k.shape[1], q.shape[2]
    diagonal = nk - nq if diagonal is None else diagonal
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rel = torch.arange(nk)[None, :] - (torch.arange(nq)[:, None] + diagonal)
    if alibi is not None:
        slopes = alibi.to(s.dtype).reshape(-1 if alibi.dim() == 2 else 1, h, 1, 1)
        s = s - slopes * rel.abs().to(s.dtype)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if rel_bias is not None:
        r = rel_bias.shape[1] // 2
        s = s + rel_bias.to(s.dtype)[:, rel.clamp(-r, r) + r]
    left = window[0] if window[0] >= 0 else math.inf
    right = 0 if causal else (window[1] if window[1] >= 0 else math.inf)
    visible = (rel >= -left) & (rel <= right)
    seen = visible.any(-1)[:, None]
    s = torch.where(visible, s, float("-inf"))
    lse = torch.where(seen[:, 0], torch.logsumexp(torch.where(seen, s, 0.0), -1), float("-inf"))
    lse = lse.expand(q.shape[0], h, nq)
    return SoftmaxV.apply(torch.where(seen, s, 0.0), seen, v), lse


class SoftmaxV(torch.autograd.Function):
    """softmax(s)·V over the rows ``seen`` marks (0 elsewhere), differentiated as FlashAttention does."""

    @staticmethod
    def forward(ctx, s, seen, v):
        p = torch.softmax(s, -1) * seen
        o = torch.einsum("bhij,bjhd->bihd", p, v)
        ctx.save_for_backward(p, v, o)
        return o

    @staticmethod
    def backward(ctx, do):
        p, v, o = ctx.saved_tensors
        dp = torch.einsum("bihd,bjhd->bhij", do, v)
        # A row sum of dO∘O, not the einsum that forms dP: with one key the two would round alike.
        d = (do * o).sum(-1).permute(0, 2, 1)[..., None]
        return p * (dp - d), None, torch.einsum("bhij,bihd->bjhd", p, do)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def tolerance(plain, exact, dtype, terms):
    """FlashAttention's test rule: within twice the error of the plain implementation in the
    same precision, plus a few roundings of the dtype (for when the plain error happens to be
    near 0, as in gradients that cancel exactly) at the larger of the result's magnitude and
    √terms, the magnitude of a sum of `terms` unit products (head_dim of them in a dot product,
    times the rows a gradient sums over)."""
    scale = max(exact.abs().max().item() if exact.numel() else 0.0, terms**0.5)
    return 2 * max_err(plain, exact) + 4 * torch.finfo(dtype).eps * scale
