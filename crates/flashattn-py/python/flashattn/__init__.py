"""flashattn: exact FlashAttention on the CPU from PyTorch, with FlashAttention-2's API.

``from flashattn import flash_attn_func`` in place of ``from flash_attn import flash_attn_func``.
CPU tensors only for now: CUDA tensors raise a ``ValueError``.
"""

from .interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
