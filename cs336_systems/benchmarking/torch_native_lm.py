"""The reference our Transformer LM is measured against: the same shapes built only from PyTorch's own
modules, the way a torch-native training stack would write them.

Same parameters as :class:`cs336_basics.model.BasicsTransformerLM` for every preset (embedding, pre-norm
blocks of causal attention with RoPE and a SwiGLU feed-forward, final RMSNorm, untied LM head, no biases),
so the same FLOPs per token; the differences are all implementation:

- ``nn.Linear`` (bias-free) with Q, K, V as one ``d → 3d`` projection and SwiGLU's gate and up as one
  ``d → 2·d_ff`` projection: one GEMM each instead of three and two;
- ``nn.RMSNorm`` (``F.rms_norm``), ``nn.Embedding``;
- ``F.scaled_dot_product_attention(is_causal=True)``; the caller pins a backend (cuDNN, flash) with
  ``torch.nn.attention.sdpa_kernel``;
- RoPE in the rotate-half form on precomputed cos/sin tables (real arithmetic, which Inductor fuses);
- ``F.cross_entropy`` and ``torch.optim.AdamW(fused=True)`` in the benchmark's step
  (:mod:`cs336_systems.benchmarking.train_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cs336_systems.configs import ModelConfig, get_config


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class NativeBlock(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, eps: float = 1e-5):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.d_head = num_heads, d_model // num_heads
        self.attn_norm = nn.RMSNorm(d_model, eps=eps)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = nn.RMSNorm(d_model, eps=eps)
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.num_heads, self.d_head).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, d_head)
        q = (q * cos + _rotate_half(q) * sin).to(v.dtype)
        k = (k * cos + _rotate_half(k) * sin).to(v.dtype)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, d_model))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TorchNativeLM(nn.Module):
    """Token embedding → blocks → final RMSNorm → LM head; logits ``(batch, seq, vocab)``."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                 d_ff: int, rope_theta: float = 10000.0):
        super().__init__()
        self.context_length = context_length
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(NativeBlock(d_model, num_heads, d_ff) for _ in range(num_layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        d_head = d_model // num_heads
        inv_freq = rope_theta ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
        angles = torch.arange(context_length, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # rotate-half layout: (seq, d_head)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @classmethod
    def from_config(cls, cfg: str | ModelConfig, context_length: int | None = None) -> TorchNativeLM:
        c = get_config(cfg)
        kwargs = c.model_kwargs()
        if context_length is not None:
            kwargs["context_length"] = context_length
        return cls(**kwargs)

    def forward(self, token_ids: Tensor) -> Tensor:
        seq = token_ids.shape[-1]
        if seq > self.context_length:
            raise ValueError(f"sequence of {seq} tokens exceeds context_length={self.context_length}")
        x = self.embed(token_ids)
        cos, sin = self.cos[:seq], self.sin[:seq]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


__all__ = ["NativeBlock", "TorchNativeLM"]
