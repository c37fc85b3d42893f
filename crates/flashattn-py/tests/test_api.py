"""numpy input, errors, torch.compile, opcheck, and the eager path beside the operators."""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import flashattn._native as native
from check import randn
from flashattn import _ops, flash_attn_func, flash_attn_varlen_func


def qkv(b=2, nq=7, nk=65, h=4, hk=2, d=40, dtype=torch.float32):
    return randn(b, nq, h, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype), randn(b, nk, hk, d, dtype=dtype)


def test_numpy_in_numpy_out():
    q, k, v = qkv()
    out, lse, _ = flash_attn_func(q.numpy(), k.numpy(), v.numpy(), causal=True, return_attn_probs=True)
    want, want_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert np.array_equal(out, want.numpy()) and np.array_equal(lse, want_lse.numpy())
    # A transposed numpy view, used where it lies.
    qt = np.ascontiguousarray(q.numpy().transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert np.array_equal(flash_attn_func(qt, k.numpy(), v.numpy(), causal=True), want.numpy())


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "`q`"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "dtype"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "float64"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "`k`"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "head"),
    ],
    ids=["rank", "mismatched_dtypes", "float64", "head_dim", "heads_not_a_multiple"],
)
def test_bad_arguments_raise_python_errors(change, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*change(*qkv()))


def test_bad_options_raise_python_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="bias"):
        flash_attn_func(q, k, v, bias=torch.zeros(2, 4, 7, 64))
    with pytest.raises(TypeError, match="alibi"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q, k, v, softcap=-1.0)
    too_far = r"invalid argument `diagonal`: expected a key offset of magnitude at most 2\^40"
    with pytest.raises(ValueError, match=too_far):
        flash_attn_func(q, k, v, diagonal=2**40 + 1)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=too_far):
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 7, 7, diagonal=-(2**40) - 1)
    with pytest.raises(ValueError, match="`diagonal`: expected a 64-bit integer"):
        flash_attn_func(q, k, v, diagonal=2**70)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="`diagonal`"):
            flash_attn_func(q, k, v, diagonal=bad)


def test_other_devices_are_refused_with_a_clear_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="only CPU and CUDA tensors"):
        flash_attn_func(q.to("meta"), k, v)
    # The native module checks the device number itself, before any memory is touched.
    desc = lambda t, dev=-1: (t.data_ptr(), "float32", list(t.shape), list(t.stride()), dev, t)
    opts = (None, (None, None), None, None, None, None, False, None, None)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 7)
    with pytest.raises(ValueError, match=r"`q`: expected a tensor on the CPU \(-1\) or a GPU \(its ordinal\), got device -2"):
        native.forward((desc(q, -2), desc(k), desc(v)), (desc(out), desc(lse)), opts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_cuda_without_a_gpu_is_a_runtime_error():
    q, k, v = qkv()
    desc = lambda t, dev=-1: (t.data_ptr(), "float32", list(t.shape), list(t.stride()), dev, t)
    opts = (None, (None, None), None, None, None, None, False, None, None)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 7)
    with pytest.raises(RuntimeError, match="q: no CUDA driver"):
        native.forward((desc(q, 0), desc(k), desc(v)), (desc(out), desc(lse)), opts)


def test_nvrtc_of_the_loader_or_of_the_nvidia_wheels_is_found():
    from flashattn import _cuda

    where = _cuda.load_nvrtc()
    if where is None:
        pytest.skip("no NVRTC on the loader's path nor in an nvidia wheel")
    major, minor = _cuda.nvrtc_version()
    assert major >= 12 and minor >= 0, where


class Capsule:
    """An array known only through the DLPack protocol, as CuPy's and JAX's are."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_objects_are_read_where_they_lie():
    q, k, v = qkv()
    got = flash_attn_func(*(Capsule(t.numpy()) for t in (q, k, v)), causal=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, flash_attn_func(q, k, v, causal=True))


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = (t.requires_grad_() for t in qkv())
    bias = randn(1, 4, 1, 65).requires_grad_()

    def f(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=True, softcap=3.0, bias=bias) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    dout = randn(2, 7, 4, 40)
    grads = []
    for fn in (f, compiled):
        out = fn(q, k, v, bias)
        grads.append((out,) + torch.autograd.grad(out, (q, k, v, bias), dout))
    for eager, comp in zip(*grads):
        assert torch.equal(eager, comp)


def test_torch_compile_fullgraph_with_a_diagonal():
    q, k, v = (t.requires_grad_() for t in qkv())
    slopes = torch.rand(4)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, diagonal=-2)

    dout = randn(2, 7, 4, 40)
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        out = fn(q, k, v)
        grads.append((out,) + torch.autograd.grad(out, (q, k, v), dout))
    for eager, comp in zip(*grads):
        assert torch.equal(eager, comp)


def test_torch_compile_fullgraph_varlen():
    q, k = randn(12, 2, 8), randn(15, 2, 8)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 15], dtype=torch.int32)

    def f(q, k):
        return flash_attn_varlen_func(q, k, k, cu_q, cu_k, 7, 9, causal=True)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k), f(q, k))


def test_opcheck():
    q, k, v = (t.requires_grad_() for t in qkv())
    bias = randn(2, 4, 7, 65).requires_grad_()
    slopes = torch.rand(4)
    fwd_args = (q, k, v, bias, slopes, None, None, 0.3, 20, -1, 5.0)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, fwd_args)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v, None, None, None, None, None, -1, 0, 0.0))
    out, lse = torch.ops.flashattn.fwd(*fwd_args)
    bwd_args = (randn(*out.shape), q.detach(), k.detach(), v.detach(), out.detach(), lse, bias.detach(), slopes,
                None, None, 0.3, 20, -1, 5.0)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, bwd_args)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, bwd_args + (True,))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, fwd_args + (True,))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, fwd_args + (False, None, -3))
    torch.library.opcheck(torch.ops.flashattn.bwd.default, bwd_args + (False, None, -3))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 30, 65], dtype=torch.int32)
    vq, vk = randn(7, 4, 40).requires_grad_(), randn(65, 2, 40).requires_grad_()
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (vq, vk, vk, None, None, cu_q, cu_k, None, -1, 0, 0.0))


def test_eager_calls_equal_the_operator_with_gradients():
    """flash_attn_func skips the dispatcher in plain eager code: the same outputs and gradients as
    the operator with its registered autograd."""
    q, k, v = (t.requires_grad_() for t in qkv())
    bias = randn(1, 4, 7, 65).requires_grad_()
    args = (q, k, v, bias, torch.rand(4), None, None, 0.3, 20, -1, 5.0, False)
    dout = randn(2, 7, 4, 40)
    got, want = (_ops.attention(*args), _ops.fwd(*args))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    grads = [torch.autograd.grad(out, (q, k, v, bias), dout) for out, _ in (got, want)]
    for g, w in zip(*grads):
        assert torch.equal(g, w)


class OpNames(TorchDispatchMode):
    """Records the name of every operator dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_modes_see_the_operators():
    q, k, v = (t.requires_grad_() for t in qkv())
    with OpNames() as mode:
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert "flashattn.fwd.default" in mode.names and "flashattn.bwd.default" in mode.names, mode.names
    with FakeTensorMode() as fake:
        out = flash_attn_func(*(fake.from_tensor(t) for t in qkv()))
    assert isinstance(out, FakeTensor) and out.shape == (2, 7, 4, 40)
