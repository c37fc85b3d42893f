"""One comparison of flashattn against the oracle: output, log-sum-exp and every gradient."""

import torch

from flashattn import flash_attn_func
from reference import attention, max_err, tolerance


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def compare(q, k, v, dtype=torch.float32, bias=None, device="cpu", rel_bias=None, **opts):
    """Runs flashattn on q, k, v (whatever their strides) on ``device`` and checks it against the
    float64 oracle (on the CPU) with tolerances from the plain implementation in ``dtype``
    (float32 for the f32 log-sum-exp): the output and log-sum-exp first, then the gradients of
    q, k, v and the biases (``bias``, the table ``rel_bias``), for a random upstream gradient."""
    alibi = opts.get("alibi_slopes")
    ref_opts = {
        "scale": opts.get("softmax_scale"),
        "causal": opts.get("causal", False),
        "window": opts.get("window_size", (-1, -1)),
        "softcap": opts.get("softcap", 0.0),
        "alibi": None if alibi is None else alibi.cpu(),
        "diagonal": opts.get("diagonal"),
    }
    extras = [(name, t) for name, t in (("bias", bias), ("rel_bias", rel_bias)) if t is not None]
    inputs = [t.cpu() for t in (q, k, v)] + [t.cpu() for _, t in extras]
    # Tensors already on `device` are used as they are (keeping their strides).
    mine = [t.detach().to(device).requires_grad_() for t in (q, k, v) + tuple(t for _, t in extras)]
    named = lambda xs: {name: x for (name, _), x in zip(extras, xs[3:])}
    out, lse, none = flash_attn_func(*mine[:3], **named(mine), return_attn_probs=True, **opts)
    assert none is None and out.dtype == dtype and lse.dtype == torch.float32
    assert out.device == mine[0].device and lse.device == mine[0].device
    dout = randn(*out.shape, dtype=dtype)
    results = {}
    for prec in (torch.float64, dtype, torch.float32):
        xs = [leaf(t, prec) for t in inputs]
        o, l = attention(*xs[:3], **named(xs), **ref_opts)
        o.backward(dout.to(prec))
        results[prec] = (o, l, [x.grad for x in xs])
    exact, plain, plain32 = results[torch.float64], results[dtype], results[torch.float32]
    out_h, lse_h = out.detach().cpu(), lse.cpu()
    assert out_h.shape == exact[0].shape and lse_h.shape == exact[1].shape
    (b, nq, h, d), nk, hk = q.shape, k.shape[1], k.shape[2]
    # The unit products each result sums (see `tolerance`): a dot product, times the rows a
    # gradient sums over (keys for dq, query heads and queries for dk and dv, broadcast
    # dimensions for dbias).
    terms = {"out": d, "lse": d, "dq": d * nk, "dk": d * nq * h // hk, "dv": d * nq * h // hk}
    for name, t in extras:
        terms["d" + name] = d * b * h * nq * nk // t.numel()
    finite = torch.isfinite(exact[1])
    assert torch.equal(torch.isfinite(lse_h), finite), "rows that see no key have lse -inf"
    assert_close([("out", out_h, exact[0], plain[0], dtype, terms["out"]),
                  ("lse", lse_h[finite], exact[1][finite], plain32[1][finite], torch.float32, terms["lse"])])
    out.backward(dout.to(out.device))
    checks = []
    names = ["dq", "dk", "dv"] + ["d" + name for name, _ in extras]
    for name, t, e, p in zip(names, mine, exact[2], plain[2]):
        grad_dtype = dtype if name in ("dq", "dk", "dv") else t.dtype
        checks.append((name, t.grad.cpu(), e, p, grad_dtype, terms[name]))
    assert_close(checks)


def assert_close(checks, where=""):
    """Each check is (name, result, float64 oracle, plain implementation, dtype, terms)."""
    for name, got, want, plain, dtype, terms in checks:
        assert got.shape == want.shape, f"{where}{name}"
        err, tol = max_err(got, want), tolerance(plain, want, dtype, terms)
        assert err <= tol, f"{where}{name}: error {err:.3g} > tolerance {tol:.3g}"
