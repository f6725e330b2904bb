"""FlashAttention on a fused QKV projection's output, rotary embedding included: one gradient, no concatenation.

A model that projects Q, K and V with one ``(3·d_model, d_model)`` weight (``cs336_systems.fused_projections``)
splits the product, rotates Q and K, and attends. Autograd then has to concatenate dQ, dK and dV into the
fused weight's ``(batch, seq, 3·d_model)`` gradient, and Inductor fuses that concatenation with RoPE's
backward into one pointwise kernel that ran at about a fifth of the H100's memory bandwidth (122 µs a layer
at small 1024, more than the fused GEMMs save: ``docs/training_step/NOTES.md``).

:class:`FlashAttentionQKVPacked` takes the projection's output whole, as flash-attention's ``qkvpacked``
functions do, plus the rotary tables:

- forward: one kernel rotates Q and K into a ``(batch, seq, 2, heads, d)`` buffer (:mod:`.rope_qk`); the
  attention kernels read Q, K from it and V from the projection's output in place, as strided head views;
- backward: the dK/dV and dQ kernels write straight into head views of one ``(batch, seq, 3, heads, d)``
  gradient, and one more kernel applies RoPE's inverse to its Q and K parts in place. That buffer *is* the
  projection output's gradient.

RoPE here is the ``cs336_basics`` convention: interleaved pairs ``(x[2i], x[2i+1])`` rotated by ``θ_i``;
``cos`` and ``sin`` are ``(seq, d/2)`` or ``(batch, seq, d/2)`` float32 tables of ``cos θ``, ``sin θ``
for each position. Under ``torch.compile`` the two halves are custom operators, as in :mod:`.flash_triton`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .flash_triton import (
    _IMPL_NAME,
    HEAD_DIMS,
    _backward,
    _cdiv,
    _check_device,
    _device_guard,
    _eager,
    _forward,
    _kernels,
    _unit_stride_d,
    stored_head_dim,
)
from .launch_cache import FLASH_LAUNCHES

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _views(qkv: Tensor, num_heads: int) -> tuple[int, int, int, int]:
    """``(batch, seq, heads, d)`` of a ``(batch, seq, 3·heads·d)`` projection output."""
    batch, seq, width = qkv.shape
    return batch, seq, num_heads, width // (3 * num_heads)


def _heads(packed: Tensor, part: int) -> Tensor:
    """Part ``part`` of a ``(batch, seq, parts, heads, d)`` tensor as a ``(batch, heads, seq, d)`` head view."""
    return packed[:, :, part].transpose(1, 2)


def _rotate(x: Tensor, y: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> None:
    """RoPE (or its inverse) of parts 0 and 1 of ``(batch, seq, parts, heads, d)`` ``x`` into ``y`` (may be
    ``x``); within a token both are laid out whole (views of token-major buffers, as every caller's are)."""
    kernels = _kernels()
    batch, seq, _, heads, d = x.shape
    cos, sin = (t.expand(batch, seq, d // 2) for t in (cos, sin))
    width = 2 * heads * d
    grid = (_cdiv(seq, kernels.ROPE_BLOCK_T), batch, _cdiv(width, 2 * kernels.ROPE_BLOCK_P))
    with _device_guard(x):
        FLASH_LAUNCHES.launch(kernels.rope_qk_kernel, grid, (
            x, y, cos, sin, *x.stride()[:2], *y.stride()[:2], *cos.stride(), *sin.stride(), seq, width,
        ), dict(HALF=d // 2, BLOCK_T=kernels.ROPE_BLOCK_T, BLOCK_P=kernels.ROPE_BLOCK_P, INVERSE=inverse))  # fmt: skip


def _packed_forward(qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor, is_causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(O, L, QK)``: the rotated Q and K as ``(batch, seq, 2, heads, d)``, then attention over them and V."""
    batch, seq, heads, d = _views(qkv, num_heads)
    packed = qkv.view(batch, seq, 3, heads, d)
    qk = qkv.new_empty(batch, seq, 2, heads, d)
    _rotate(packed, qk, cos, sin, inverse=False)
    o, lse = _forward(_heads(qk, 0), _heads(qk, 1), _heads(packed, 2), is_causal, scale)
    return o, lse, qk


def _packed_backward(do: Tensor, qkv: Tensor, qk: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor,
                     is_causal: bool, scale: float) -> Tensor:
    """The projection output's gradient ``(batch, seq, 3·heads·d)``, written in place by the attention
    backward and then rotated back (RoPE's transpose) in its Q and K parts."""
    batch, seq, heads, d = qk.shape[0], qk.shape[1], qk.shape[3], qk.shape[4]
    dqkv = qkv.new_empty(batch, seq, 3, heads, d)
    grads = tuple(_heads(dqkv, part) for part in range(3))
    _backward(do, _heads(qk, 0), _heads(qk, 1), _heads(qkv.view(batch, seq, 3, heads, d), 2), o, lse,
              is_causal, scale, out=grads)  # type: ignore[arg-type]
    _rotate(dqkv, dqkv, cos, sin, inverse=True)
    return dqkv.view(batch, seq, 3 * heads * d)


@torch.library.custom_op("cs336_systems::flash_attention_qkvpacked_forward", mutates_args=())
def flash_attention_qkvpacked_forward(qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor, is_causal: bool,
                                      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The packed forward as a custom operator: what ``torch.compile`` sees."""
    return _packed_forward(qkv, num_heads, cos, sin, is_causal, scale)


@flash_attention_qkvpacked_forward.register_fake
def _(qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor, is_causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    batch, seq, heads, d = _views(qkv, num_heads)
    qk = qkv.new_empty(batch, seq, 2, heads, d)
    q = _heads(qk, 0)
    return torch.empty_like(q), q.new_empty((batch, heads, seq), dtype=torch.float32), qk


@torch.library.custom_op("cs336_systems::flash_attention_qkvpacked_backward", mutates_args=())
def flash_attention_qkvpacked_backward(do: Tensor, qkv: Tensor, qk: Tensor, o: Tensor, lse: Tensor, cos: Tensor,
                                       sin: Tensor, is_causal: bool, scale: float) -> Tensor:
    """The packed backward as a custom operator: what ``torch.compile`` sees."""
    return _packed_backward(do, qkv, qk, o, lse, cos, sin, is_causal, scale)


@flash_attention_qkvpacked_backward.register_fake
def _(do: Tensor, qkv: Tensor, qk: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor, is_causal: bool,
      scale: float) -> Tensor:
    return qkv.new_empty(qkv.shape)


def _setup_backward(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
    qkv, _, cos, sin, is_causal, scale = inputs
    o, lse, qk = output
    ctx.save_for_backward(qkv, qk, o, lse, cos, sin)
    ctx.is_causal, ctx.scale = is_causal, scale


def _operator_backward(ctx, do: Tensor, *_: Tensor | None) -> tuple[Tensor | None, ...]:
    qkv, qk, o, lse, cos, sin = ctx.saved_tensors
    dqkv = flash_attention_qkvpacked_backward(_unit_stride_d(do), qkv, qk, o, lse, cos, sin, ctx.is_causal, ctx.scale)
    return dqkv, None, None, None, None, None


# The forward operator's own autograd, for :func:`flash_attention_qkvpacked` under torch.compile.
flash_attention_qkvpacked_forward.register_autograd(_operator_backward, setup_context=_setup_backward)


def _check(qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor) -> int:
    """One-line errors for inputs the kernels cannot take; returns the head dim."""
    name = f"{_IMPL_NAME}, packed QKV"
    if qkv.dim() != 3:
        raise ValueError(f"{name}: qkv must be (batch, seq, 3·heads·d), got shape {tuple(qkv.shape)}")
    if num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"{name}: qkv's last dimension {qkv.shape[-1]} is not 3 × num_heads ({num_heads}) × d")
    d = qkv.shape[-1] // (3 * num_heads)
    if d not in HEAD_DIMS or d % 2 or stored_head_dim(d, qkv.element_size()) != d:
        raise ValueError(f"{name}: head dimension {d} is not supported (even, at most {HEAD_DIMS[-1]}, rows of "
                         "whole 16-byte units)")
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"{name}: qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"{name}: qkv's last dimension must be contiguous, got strides {qkv.stride()}")
    batch, seq = qkv.shape[:2]
    for label, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.device != qkv.device:
            raise ValueError(f"{name}: {label} must be float32 on {qkv.device}, got {table.dtype} on {table.device}")
        if table.shape not in ((seq, d // 2), (1, seq, d // 2), (batch, seq, d // 2)):
            raise ValueError(f"{name}: {label} must be (seq, d/2) or (batch, seq, d/2) = ({batch}, {seq}, {d // 2}), "
                             f"got {tuple(table.shape)}")
    _check_device(qkv)
    return d


class FlashAttentionQKVPacked(torch.autograd.Function):
    """``FlashAttentionQKVPacked.apply(qkv, num_heads, cos, sin, is_causal=True)``: attention over a fused
    projection's output ``(batch, seq, 3·heads·d)`` (Q, K, V blocks in that order), with RoPE on Q and K.

    Returns ``(batch, heads, seq, d)`` (a head view of token-major memory: ``.transpose(1, 2).reshape(batch,
    seq, heads·d)`` is free). The gradient is the projection output's, in one buffer. Equal, up to rounding
    order, to rotating Q and K with ``cs336_basics``' ``RotaryEmbedding`` and calling ``FlashAttentionTriton``.
    """

    @staticmethod
    def forward(ctx, qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor,  # type: ignore[override]
                is_causal: bool = True) -> Tensor:
        d = _check(qkv, num_heads, cos, sin)
        scale = 1.0 / math.sqrt(d)
        forward = _packed_forward if _eager(qkv) else flash_attention_qkvpacked_forward
        o, lse, qk = forward(qkv, num_heads, cos, sin, is_causal, scale)
        ctx.save_for_backward(qkv, qk, o, lse, cos, sin)
        ctx.is_causal, ctx.scale = is_causal, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        qkv, qk, o, lse, cos, sin = ctx.saved_tensors
        do = _unit_stride_d(do)
        backward = _packed_backward if _eager(do) else flash_attention_qkvpacked_backward
        return backward(do, qkv, qk, o, lse, cos, sin, ctx.is_causal, ctx.scale), None, None, None, None


def flash_attention_qkvpacked(qkv: Tensor, num_heads: int, cos: Tensor, sin: Tensor,
                              is_causal: bool = True) -> Tensor:
    """:class:`FlashAttentionQKVPacked` as a function (``attention.options`` apply as to ``FlashAttentionTriton``).
    Under ``torch.compile`` it calls the forward operator, whose backward is registered on it, rather than
    the autograd function: then dO reaches the backward in the layout the step made it, not copied to the
    contiguous one Dynamo assumes for an ``autograd.Function`` (see ``flash_triton.flash_attention``)."""
    if torch.compiler.is_compiling():
        d = _check(qkv, num_heads, cos, sin)
        return flash_attention_qkvpacked_forward(qkv, num_heads, cos, sin, is_causal, 1.0 / math.sqrt(d))[0]
    return FlashAttentionQKVPacked.apply(qkv, num_heads, cos, sin, is_causal)


__all__ = ["FlashAttentionQKVPacked", "flash_attention_qkvpacked"]
