"""flash_attn_varlen_func against the oracle run on each sequence alone."""

import pytest
import torch

from check import assert_close, leaf, randn
from flashattn import flash_attn_varlen_func
from reference import attention


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence(causal, dtype):
    check_varlen(causal, dtype)


@pytest.mark.parametrize("diagonal", [-6, 0, 40])
def test_varlen_diagonal_applies_to_every_sequence(diagonal):
    check_varlen(True, torch.float32, diagonal=diagonal)


def check_varlen(causal, dtype, device="cpu", diagonal=None):
    """flash_attn_varlen_func on ``device`` (its cu_seqlens and ALiBi slopes there too) against the
    oracle on the CPU: outputs and log-sum-exp of every sequence first, then the gradients.
    ``diagonal`` applies to every sequence."""
    lens_q, lens_k, h, hk, d = [1, 7, 65, 130], [7, 65, 1, 130], 4, 2, 40
    q = randn(sum(lens_q), h, d, dtype=dtype).to(device).requires_grad_()
    k = randn(sum(lens_k), hk, d, dtype=dtype).to(device).requires_grad_()
    v = randn(sum(lens_k), hk, d, dtype=dtype).to(device).requires_grad_()
    slopes = torch.rand(h) * 0.3
    opts = {"causal": causal, "softcap": 4.0, "alibi_slopes": slopes.to(device), "window_size": (50, -1),
            "diagonal": diagonal}
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu(lens_q).to(device), cu(lens_k).to(device), max(lens_q),
                                         max(lens_k), return_attn_probs=True, **opts)
    assert out.shape == q.shape and lse.shape == (h, sum(lens_q)) and out.device == q.device
    dout = randn(*out.shape, dtype=dtype)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    xs_h = [t.detach().cpu() for t in (q, k, v)]
    out_h, lse_h = out.detach().cpu(), lse.cpu()
    refs = []
    for s in range(len(lens_q)):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        res = {}
        for prec in (torch.float64, dtype, torch.float32):
            xs = [leaf(t[r][None], prec) for t, r in zip(xs_h, (rq, rk, rk))]
            o, l = attention(*xs, causal=causal, softcap=4.0, alibi=slopes, window=(50, -1), diagonal=diagonal)
            o.backward(dout[rq][None].to(prec))
            res[prec] = (o[0], l[0], [x.grad[0] for x in xs])
        exact, plain = res[torch.float64], res[dtype]
        checks = [("out", out_h[rq], exact[0], plain[0], dtype, d)]
        fin = torch.isfinite(exact[1])
        assert torch.equal(torch.isfinite(lse_h[:, rq]), fin)
        checks.append(("lse", lse_h[:, rq][fin], exact[1][fin], res[torch.float32][1][fin], torch.float32, d))
        assert_close(checks, f"sequence {s} ")
        refs.append((rq, rk, exact, plain))
    out.backward(dout.to(out.device))
    for s, (rq, rk, exact, plain) in enumerate(refs):
        checks = []
        for name, t, r, e, p, rows in zip(("dq", "dk", "dv"), (q, k, v), (rq, rk, rk), exact[2], plain[2],
                                          (lens_k[s], lens_q[s] * h // hk, lens_q[s] * h // hk)):
            checks.append((name, t.grad[r].cpu(), e, p, dtype, d * rows))
        assert_close(checks, f"sequence {s} ")


def test_bad_cu_seqlens_is_a_value_error():
    q = randn(10, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 6, 4], dtype=torch.int32),
                               torch.tensor([0, 5, 10], dtype=torch.int32), 6, 5)
