"""A pre-norm Transformer language model, readable top to bottom.

Building blocks first (``Linear``, ``Embedding``, ``RMSNorm``, ``RotaryEmbedding``, ``SwiGLU``), then
attention (with a registry of interchangeable implementations), the block, and the LM.

Attention implementations share one signature, ``fn(q, k, v, is_causal) -> out`` on tensors shaped
``(batch, heads, seq, d_head)``. ``naive`` and ``sdpa`` are registered here; other packages (for example
``cs336_systems.attention``) add their own with :func:`register_attention`, and a model picks one by
name: ``BasicsTransformerLM(..., attention_impl="sdpa")`` or ``model.set_attention_impl("sdpa")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import nvtx
from .nn_utils import softmax

# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


class Linear(nn.Module):
    """``y = x W^T`` without bias; weight ``(d_out, d_in)``, truncated-normal init with
    std = sqrt(2 / (d_in + d_out)) clipped at ±3 std."""

    def __init__(self, d_in: int, d_out: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(d_out, d_in, device=device, dtype=dtype), std=std, a=-3 * std, b=3 * std)
        )

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """Lookup table ``(vocab_size, d_model)``, truncated-normal init with std 1 clipped at ±3."""

    def __init__(
        self, vocab_size: int, d_model: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.weight = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(vocab_size, d_model, device=device, dtype=dtype), std=1.0, a=-3, b=3)
        )

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """RMS layer norm with a learned gain. Computes in float32 (squares of bf16 activations lose
    precision) and returns the input dtype."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        # ``F.rms_norm`` is ``x * rsqrt(mean(x²) + eps) * weight`` in one fused kernel per direction when
        # input and weight share a dtype (here both float32), instead of six elementwise launches.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021) on interleaved pairs ``(x[2i], x[2i+1])``.

    Each pair ``(a, b)`` at position ``p`` becomes ``(a cos θ - b sin θ, b cos θ + a sin θ)`` with
    ``θ = p · theta^(-2i/dim)``. Written as ``pairs * cos + swap(pairs) * (-sin, +sin)`` with the tables
    laid out per pair, a rotation is twelve kernels forward and backward together, against twenty-one for
    the slice/multiply/stack form; in a launch-bound step (bf16 autocast of a large model at a small
    batch) every kernel costs host time. The arithmetic is in float32 (the tables' dtype);
    the result has the input's dtype. No complex numbers, which Inductor does not generate code for.
    The tables are non-persistent buffers (a function of the hyperparameters, so they stay out of
    checkpoints).
    """

    def __init__(self, context_length: int, dim: int, theta: float = 10000.0, device: torch.device | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding needs an even dimension, got {dim}")
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        angles = torch.arange(context_length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("_cos", torch.stack((cos, cos), dim=-1), persistent=False)  # (ctx, dim/2, 2)
        self.register_buffer("_sin", torch.stack((-sin, sin), dim=-1), persistent=False)

    def forward(self, x: Tensor, pos_ids: Tensor | None = None) -> Tensor:
        """Rotate ``x`` (..., seq, dim) by the angles of ``pos_ids`` (broadcastable to (..., seq));
        ``None`` means positions ``0 .. seq-1``, a slice of the tables rather than a gather."""
        if pos_ids is None:
            cos, sin = self._cos[: x.shape[-2]], self._sin[: x.shape[-2]]
        else:
            cos, sin = self._cos[pos_ids], self._sin[pos_ids]
        pairs = x.unflatten(-1, (-1, 2))
        rotated = pairs * cos + pairs.flip(-1) * sin
        return rotated.flatten(-2).to(x.dtype)


class SwiGLU(nn.Module):
    """Position-wise feed-forward ``W2 (SiLU(W1 x) * W3 x)``."""

    def __init__(self, d_model: int, d_ff: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------------------------------
# Attention and the registry of implementations
# --------------------------------------------------------------------------------------------------


def scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d)) V with our own softmax. ``mask`` is boolean, True where a query may
    attend to a key (the convention of the course and of PyTorch's SDPA)."""
    d = Q.shape[-1]
    with nvtx.range("computing attention scores"):
        scores = Q @ K.transpose(-2, -1) / math.sqrt(d)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
    with nvtx.range("computing softmax"):
        probs = softmax(scores, dim=-1)
    with nvtx.range("final matmul"):
        return probs @ V


AttentionFn = Callable[[Tensor, Tensor, Tensor, bool], Tensor]
_ATTENTION_IMPLS: dict[str, AttentionFn] = {}


def register_attention(name: str, fn: AttentionFn, *, overwrite: bool = False) -> None:
    """Make ``fn(q, k, v, is_causal) -> out`` selectable as ``attention_impl=name``."""
    if name in _ATTENTION_IMPLS and not overwrite and _ATTENTION_IMPLS[name] is not fn:
        raise ValueError(f"attention implementation {name!r} is already registered")
    _ATTENTION_IMPLS[name] = fn


def available_attention_impls() -> list[str]:
    _load_plugins()
    return sorted(_ATTENTION_IMPLS)


def get_attention(name: str) -> AttentionFn:
    if name not in _ATTENTION_IMPLS:
        _load_plugins()
    if name not in _ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; available: {sorted(_ATTENTION_IMPLS)}")
    return _ATTENTION_IMPLS[name]


def _load_plugins() -> None:
    """Import the attention plugins installed under the entry-point group ``cs336_basics.attention`` (each
    registers its implementations when imported), so a name resolves without the caller importing the
    plugin first. This package names no plugin: an installed distribution declares itself."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="cs336_basics.attention"):
        try:
            entry.load()
        except ImportError:
            pass


def _naive_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    mask = None
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    return scaled_dot_product_attention(q, k, v, mask)


def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


register_attention("naive", _naive_attention)
register_attention("sdpa", _sdpa_attention)


class CausalMultiHeadSelfAttention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        positional_encoder: RotaryEmbedding | None = None,
        attention_impl: str = "naive",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model, self.num_heads, self.d_head = d_model, num_heads, d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.positional_encoder = positional_encoder
        self.attention_impl = attention_impl
        get_attention(attention_impl)  # fail early on a bad name

    def _split_heads(self, x: Tensor) -> Tensor:
        *lead, seq, _ = x.shape
        return x.view(*lead, seq, self.num_heads, self.d_head).transpose(-3, -2)

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.positional_encoder is not None:  # token_positions None: positions 0 .. seq-1
            q = self.positional_encoder(q, token_positions)
            k = self.positional_encoder(k, token_positions)
        with nvtx.range(f"attention ({self.attention_impl})"):
            out = get_attention(self.attention_impl)(q, k, v, True)
        out = out.transpose(-3, -2).reshape(*x.shape[:-1], self.d_model)
        return self.output_proj(out)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        positional_encoder: RotaryEmbedding | None,
        attention_impl: str = "naive",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(
            d_model, num_heads, positional_encoder, attention_impl, device=device, dtype=dtype
        )
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), token_positions)
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    """Token embedding → ``num_layers`` pre-norm blocks → final RMSNorm → LM head; returns logits
    ``(..., seq, vocab_size)``."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        attention_impl: str = "naive",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.vocab_size, self.context_length = vocab_size, context_length
        self.d_model, self.num_layers, self.num_heads, self.d_ff = d_model, num_layers, num_heads, d_ff
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        rope = RotaryEmbedding(context_length, d_model // num_heads, rope_theta, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, rope, attention_impl, device=device, dtype=dtype)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)

    @property
    def attention_impl(self) -> str:
        return self.layers[0].attn.attention_impl if len(self.layers) else "naive"

    def set_attention_impl(self, name: str) -> None:
        """Switch every layer to the registered attention ``name``."""
        get_attention(name)
        for layer in self.layers:
            layer.attn.attention_impl = name

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; with ``non_embedding`` the token-embedding table is left out (the LM head,
        which is not tied to it, still counts)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.token_embeddings.weight.numel()
        return n

    def forward(self, token_ids: Tensor) -> Tensor:
        seq = token_ids.shape[-1]
        if seq > self.context_length:
            raise ValueError(f"sequence of {seq} tokens exceeds context_length={self.context_length}")
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x)  # positions 0 .. seq-1
        return self.lm_head(self.ln_final(x))

    @torch.no_grad()
    def generate(
        self, token_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> Tensor:
        """Sample ``max_new_tokens`` continuations of a 1-D or 2-D prompt."""
        squeeze = token_ids.dim() == 1
        x = token_ids[None] if squeeze else token_ids
        for _ in range(max_new_tokens):
            logits = self(x[:, -self.context_length :])[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(softmax(logits, dim=-1), 1)
            x = torch.cat([x, nxt], dim=-1)
        return x[0] if squeeze else x
