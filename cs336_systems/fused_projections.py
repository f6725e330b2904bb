"""Fused input projections for a ``cs336_basics`` model: Q, K, V as one weight, and SwiGLU's W1, W3 as one.

The ``cs336_basics`` blocks keep five separate input weights per layer (``q_proj``, ``k_proj``, ``v_proj``,
``w1``, ``w3``), each a GEMM of its own and, under autocast, a bf16 cast of its own in the forward and again in
the backward. A block that multiplies by ``[W_q; W_k; W_v]`` and ``[W_1; W_3]`` instead does the same FLOPs in
two larger GEMMs, which run closer to the matmul ceiling, and casts two weights instead of five. §1.4's
per-kernel profile (``docs/training_step/NOTES.md``) puts half of what our training step still loses to the
torch-native reference, which fuses exactly these, in the matmuls.

:func:`fuse_projections` swaps each block's attention and feed-forward modules for fused ones in place,
keeping the weights' values, the attention implementation and the rotary embedding. With ``flash_triton``
attention and RoPE the fused block attends over the QKV output whole
(:func:`~cs336_systems.attention.flash_qkvpacked.flash_attention_qkvpacked`): RoPE and the packing of
dQ, dK, dV into the fused weight's gradient happen in its kernels, where autograd would otherwise
concatenate them (the kernel that made fused projections a loss at first: ``docs/training_step/NOTES.md``).
State dicts keep the unfused names (``attn.q_proj.weight`` …, ``ffn.w1.weight`` …) both ways, so
checkpoints load into either model:

    model = fuse_projections(BasicsTransformerLM(**cfg.model_kwargs(), attention_impl="flash_triton"))
    optimizer = FlatAdamW(model.parameters())     # build optimizers after fusing: the parameters are new
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cs336_basics import nvtx
from cs336_basics.model import CausalMultiHeadSelfAttention, Linear, RotaryEmbedding, SwiGLU, get_attention

from cs336_systems.attention import flash_attention_qkvpacked

_QKV = ("q_proj", "k_proj", "v_proj")
_W13 = ("w1", "w3")


def _stacked(linears: list[Linear]) -> Linear:
    """One ``Linear`` whose weight is the given weights stacked along the output dimension."""
    first = linears[0]
    fused = Linear(first.d_in, sum(lin.d_out for lin in linears), device=first.weight.device,
                   dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
    return fused


def _store_unfused(module: nn.Module, fused: str, parts: tuple[str, ...]) -> None:
    """State-dict hooks: ``module``'s ``<fused>.weight`` is saved as the equal row blocks ``<part>.weight``, and
    loads from either form."""

    def save(mod: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        weight = state.pop(f"{prefix}{fused}.weight")
        for name, piece in zip(parts, weight.split(weight.shape[0] // len(parts))):
            state[f"{prefix}{name}.weight"] = piece

    def load(mod: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        names = [f"{prefix}{name}.weight" for name in parts]
        if all(n in state for n in names):
            state[f"{prefix}{fused}.weight"] = torch.cat([state.pop(n) for n in names])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


class PackedRopeTables(nn.Module):
    """``cos θ`` and ``sin θ`` of a ``RotaryEmbedding`` as contiguous ``(context, d/2)`` float32 tables for the
    packed kernels. The embedding keeps ``(context, d/2, 2)`` per-pair tables, whose columns read at stride 2
    slow the rotation kernel down (measured in ``docs/training_step/NOTES.md``). One per embedding, shared by
    the blocks as the embedding is; non-persistent buffers, so checkpoints do not change."""

    def __init__(self, rope: RotaryEmbedding):
        super().__init__()
        self.register_buffer("cos", rope._cos[..., 0].contiguous(), persistent=False)  # _cos[..., 0] is cos θ
        self.register_buffer("sin", rope._sin[..., 1].contiguous(), persistent=False)  # _sin[..., 1] is +sin θ

    def _apply(self, fn: Any, recurse: bool = True) -> PackedRopeTables:
        """Device moves apply; dtype casts (``model.to(torch.bfloat16)``) do not: the kernels take float32 angles."""
        for name, table in self._buffers.items():
            moved = fn(table)
            self._buffers[name] = moved if moved.dtype == table.dtype else table.to(moved.device)
        return self

    def lookup(self, seq: int, positions: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """``(cos θ, sin θ)`` as ``(seq, d/2)`` or ``(batch, seq, d/2)``. Positions broadcast against the
        ``(batch, heads, seq)`` head views, as in the split path: ``(seq,)``, ``(1, seq)`` or
        ``(batch or 1, 1, seq)``; None for any other shape (positions that vary by head), which the split
        path handles."""
        if positions is None:
            return self.cos[:seq], self.sin[:seq]
        shape = tuple(positions.shape)
        if not (shape in ((seq,), (1, seq)) or (len(shape) == 3 and shape[1:] == (1, seq))):
            return None
        rows = positions.reshape(-1, seq)
        return self.cos[rows], self.sin[rows]


class FusedQKVSelfAttention(nn.Module):
    """Causal multi-head self-attention as ``cs336_basics``' ``CausalMultiHeadSelfAttention`` computes it,
    with Q, K and V from one ``(3·d_model, d_model)`` weight: one GEMM instead of three."""

    def __init__(self, attn: CausalMultiHeadSelfAttention, packed: bool = True,
                 rope_tables: PackedRopeTables | None = None):
        super().__init__()
        self.d_model, self.num_heads, self.d_head = attn.d_model, attn.num_heads, attn.d_head
        self.qkv_proj = _stacked([getattr(attn, name) for name in _QKV])
        self.output_proj = attn.output_proj
        self.positional_encoder = attn.positional_encoder
        self.attention_impl = attn.attention_impl
        #: Whether the ``flash_triton`` attention takes the projection output whole (RoPE and the gradient's
        #: packing in its kernels, :mod:`cs336_systems.attention.flash_qkvpacked`) rather than split heads.
        self.packed = packed and self.attention_impl == "flash_triton" and isinstance(
            self.positional_encoder, RotaryEmbedding)
        #: The packed path's tables (``rope_tables`` if given, to share one set among blocks); None unpacked.
        self.rope_tables = None
        if self.packed:
            self.rope_tables = rope_tables if rope_tables is not None else PackedRopeTables(self.positional_encoder)
        _store_unfused(self, "qkv_proj", _QKV)

    _split_heads = CausalMultiHeadSelfAttention._split_heads  # a column slice of the QKV output views alike

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        qkv = self.qkv_proj(x)
        packed = self.packed and self.rope_tables is not None  # ``packed`` may be switched off after fusing
        tables = self.rope_tables.lookup(x.shape[-2], token_positions) if packed else None
        if tables is not None and qkv.dim() == 3:
            with nvtx.range("attention (flash_triton, packed QKV)"):
                out = flash_attention_qkvpacked(qkv, self.num_heads, *tables, True)
            return self.output_proj(out.transpose(-3, -2).reshape(*x.shape[:-1], self.d_model))
        q, k, v = (self._split_heads(t) for t in qkv.split(self.d_model, dim=-1))
        if self.positional_encoder is not None:
            q = self.positional_encoder(q, token_positions)
            k = self.positional_encoder(k, token_positions)
        with nvtx.range(f"attention ({self.attention_impl})"):
            out = get_attention(self.attention_impl)(q, k, v, True)
        return self.output_proj(out.transpose(-3, -2).reshape(*x.shape[:-1], self.d_model))


class FusedSwiGLU(nn.Module):
    """``W2 (SiLU(W1 x) * W3 x)`` with ``[W1; W3]`` as one ``(2·d_ff, d_model)`` weight."""

    def __init__(self, ffn: SwiGLU):
        super().__init__()
        self.d_ff = ffn.w1.d_out
        self.w13 = _stacked([ffn.w1, ffn.w3])
        self.w2 = ffn.w2
        _store_unfused(self, "w13", _W13)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.d_ff, dim=-1)
        return self.w2(F.silu(gate) * up)


def fuse_projections(model: nn.Module, packed_attention: bool = True) -> nn.Module:
    """Replace, in place, every ``CausalMultiHeadSelfAttention`` and ``SwiGLU`` submodule of ``model`` (a
    ``cs336_basics`` LM or any module holding them) by its fused form; returns ``model``. Modules already
    fused are left alone. Build optimizers, wrappers (DDP, FSDP, checkpointing) and ``torch.compile`` after
    this call: the fused weights are new parameters. ``packed_attention``: with ``flash_triton`` attention and
    RoPE, attend over the QKV output whole (:class:`FusedQKVSelfAttention`'s ``packed``)."""
    shared: dict[int, PackedRopeTables] = {}  # one set of packed tables per rotary embedding

    def fused_attention(attn: CausalMultiHeadSelfAttention) -> FusedQKVSelfAttention:
        fused = FusedQKVSelfAttention(attn, packed_attention, shared.get(id(attn.positional_encoder)))
        if fused.rope_tables is not None:
            shared[id(attn.positional_encoder)] = fused.rope_tables
        return fused

    swaps = {CausalMultiHeadSelfAttention: fused_attention, SwiGLU: FusedSwiGLU}
    targets = [(name, module) for name, module in model.named_modules() if type(module) in swaps]
    if any(name == "" for name, _ in targets):
        raise ValueError(f"fuse_projections: pass the module that holds the {type(model).__name__}, not the "
                         "module itself (it is replaced in its parent)")
    if not targets and not any(isinstance(m, (FusedQKVSelfAttention, FusedSwiGLU)) for m in model.modules()):
        raise ValueError(f"fuse_projections: {type(model).__name__} holds no CausalMultiHeadSelfAttention or "
                         "SwiGLU to fuse")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, swaps[type(module)](module))
    return model


__all__ = ["FusedQKVSelfAttention", "FusedSwiGLU", "fuse_projections"]
