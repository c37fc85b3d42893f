"""What a call on CUDA tensors takes from PyTorch: its current stream and device, and the NVRTC
library that PyTorch's CUDA wheels install.

NVRTC is found as the Rust crate finds it (the loader's search path: ``LD_LIBRARY_PATH``, the
system's folders), and else here: the first CUDA call loads the ``libnvrtc.so.*`` of the
``nvidia`` wheels in site-packages (``nvidia/cu13/lib`` beside PyTorch's cu13 builds,
``nvidia/cuda_nvrtc/lib`` beside its cu12 builds), after which the crate's ``dlopen`` of the same
name finds the library already loaded.
"""

import contextlib
import ctypes
import importlib.util
import pathlib
from typing import List, Optional, Tuple

import torch

from . import _native

# The names the crate's loader tries (cudarc's list, newest first), as the loader resolves them.
_NVRTC_NAMES = ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12")
# The NVIDIA wheels' library folders, relative to a root of the `nvidia` namespace package.
_WHEEL_DIRS = ("cu13/lib", "cuda_nvrtc/lib")

_nvrtc_ready = False
# The guard of a call on the current device (or the CPU): a null context, reusable.
_NO_GUARD = contextlib.nullcontext()


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def nvrtc_wheel_dirs() -> List[pathlib.Path]:
    """The folders of the installed NVIDIA wheels that hold a ``libnvrtc.so.*``."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    dirs = [pathlib.Path(r) / d for r in roots for d in _WHEEL_DIRS]
    return [d for d in dirs if any(d.glob("libnvrtc.so.*"))]


def load_nvrtc() -> Optional[str]:
    """Makes NVRTC loadable by the crate: nothing when the loader already finds it, else loads the
    wheel's (its builtins first, which NVRTC opens by name when it compiles). Returns where it
    came from (a name for the loader's own, a path for a wheel's), or None when there is none:
    the first compile then raises the crate's error saying how to install it."""
    for name in _NVRTC_NAMES:
        if _loadable(name):
            return name
    for d in nvrtc_wheel_dirs():
        libs = sorted(d.glob("libnvrtc-builtins.so.*")) + sorted(d.glob("libnvrtc.so.*"))
        for lib in libs:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        return str(libs[-1])
    return None


def _raw_stream(index: int) -> int:
    """The raw ``CUstream`` of PyTorch's current stream on GPU ``index``: the C function that
    ``torch.compile``'s generated code calls (no ``torch.cuda.Stream`` object made), else the
    public API."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


def stream(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(device ordinal, raw CUstream)`` of PyTorch's current stream on ``t``'s GPU, which the
    call is ordered on; None for a CPU tensor. Loads NVRTC before the first CUDA call."""
    global _nvrtc_ready
    if not t.is_cuda:
        return None
    if not _nvrtc_ready:
        load_nvrtc()
        _nvrtc_ready = True
    index = t.get_device()
    return index, _raw_stream(index)


def on_device(t: torch.Tensor):
    """A context in which ``t``'s GPU is PyTorch's current device. flashattn makes the primary
    context of the GPU it works on current on the calling thread, so for a GPU other than the
    current one the guard puts PyTorch's current device back afterwards."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def nvrtc_version() -> Tuple[int, int]:
    """The version of the NVRTC that flashattn compiles its CUDA kernels with (loading it as the
    first CUDA call does); a ``RuntimeError`` when there is none."""
    load_nvrtc()
    return _native.nvrtc_version()
