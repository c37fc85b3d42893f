"""flashattn: exact FlashAttention on CPU and CUDA tensors from PyTorch, with FlashAttention-2's
API.

``from flashattn import flash_attn_func`` in place of ``from flash_attn import flash_attn_func``.
CUDA tensors run on PyTorch's current stream; the kernels are compiled at first use by NVRTC
(the system's, or the one PyTorch's CUDA wheels install: see ``flashattn._cuda``).
"""

from .interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
