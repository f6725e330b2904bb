"""FlashAttention-2: a tiled PyTorch reference and Triton forward/backward kernels.

Both are ``torch.autograd.Function`` subclasses called as ``Fn.apply(Q, K, V, is_causal=False)`` on
``(batch, n, d)`` or ``(batch, heads, n, d)`` tensors. Importing this package registers them as the
``cs336_basics`` model's attention implementations ``flash_pytorch`` and ``flash_triton``.

- :mod:`.reference`: float64 ground truth and the naive (materializing) baseline.
- :mod:`.flash_pytorch`: Algorithm 1 of FlashAttention-2 in plain PyTorch; runs anywhere.
- :mod:`.flash_triton` + :mod:`.triton_kernels`: the Triton version (CUDA, or CPU under
  ``TRITON_INTERPRET=1``); :mod:`.flash_fwd_sm90`: its warp-specialized forward on Hopper.
- :mod:`.flash_qkvpacked`: the Triton version over a fused QKV projection's output, RoPE included, whose
  gradient is one buffer (no concatenation for the fused weight).
- :mod:`.options`: tiles, tuning, the exponential and the Gluon switch, as values
  (``with options.use(autotune=False): ...``).
"""

from __future__ import annotations

from cs336_basics.model import register_attention
from torch import Tensor

from . import options
from ._validation import validate_attention_inputs
from .flash_pytorch import FlashAttentionPytorch
from .flash_qkvpacked import FlashAttentionQKVPacked, flash_attention_qkvpacked
from .flash_triton import SUPPORTED_HEAD_DIMS, FlashAttentionTriton, flash_attention, interpreter_enabled
from .reference import causal_mask, naive_attention, reference_attention

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "FlashAttentionPytorch",
    "FlashAttentionQKVPacked",
    "FlashAttentionTriton",
    "causal_mask",
    "flash_attention",
    "flash_attention_qkvpacked",
    "get_flashattention_autograd_function_pytorch",
    "get_flashattention_autograd_function_triton",
    "interpreter_enabled",
    "naive_attention",
    "options",
    "reference_attention",
    "validate_attention_inputs",
]


def get_flashattention_autograd_function_pytorch() -> type[FlashAttentionPytorch]:
    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> type[FlashAttentionTriton]:
    return FlashAttentionTriton


def _flash_pytorch_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    return FlashAttentionPytorch.apply(q, k, v, is_causal)


def _flash_triton_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    return flash_attention(q, k, v, is_causal)


register_attention("flash_pytorch", _flash_pytorch_attention)
register_attention("flash_triton", _flash_triton_attention)
