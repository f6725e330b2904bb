"""The LM head and cross-entropy in one autograd function that never holds the ``[tokens, vocab]`` logits.

A training step's largest activation is often the logits: batch × context × vocab floats (2.7B at context
512, batch 4, vocab 10,000: 78 MiB in fp32; an 8B model at context 32,768 with a 151,936 vocabulary:
37 GiB in bf16). ``loss = CE(hidden @ Wᵀ, targets)`` only needs, per token, the log-sum-exp of its logits
and its target's logit, so the forward walks over chunks of tokens, keeping one chunk's logits at a
time and saving only ``hidden``, ``W``, the targets and one float per token. The backward recomputes
each chunk's logits (one more ``hidden @ Wᵀ`` GEMM: the price of the memory) and turns them into
``dlogits = (softmax - onehot) · dloss / tokens`` in place, from which ``dhidden = dlogits @ W`` and
``dW += dlogitsᵀ @ hidden``.

Logits are formed in the matmul's dtype (bf16 under autocast, as ``nn.Linear`` would) and reduced in
float32 (float64 for float64 inputs); ``dW`` accumulates in that precision across chunks.

    loss = linear_cross_entropy(hidden, model.lm_head.weight, targets, chunk_size=4096)
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 4096


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, d_model), got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dimension {hidden.shape[-1]} does not match weight's d_model {weight.shape[1]}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match hidden's tokens {tuple(hidden.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer class indices, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, "
                         f"{targets.device}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def _acc_dtype(t: Tensor) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(t.dtype, torch.float32)


def _logits(h: Tensor, weight: Tensor) -> Tensor:
    return (h @ weight.t()).to(_acc_dtype(h))


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``targets``, chunked over tokens (2-D ``hidden``)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=_acc_dtype(hidden), device=hidden.device)
        total = torch.zeros((), dtype=_acc_dtype(hidden), device=hidden.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            logits = _logits(hidden[start:stop], weight)
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[start:stop, None].long()).squeeze(1)
            total += (lse[start:stop] - target_logit).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        ctx.autocast = torch.is_autocast_enabled(hidden.device.type)
        ctx.autocast_dtype = torch.get_autocast_dtype(hidden.device.type)
        return total / max(n, 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        n = hidden.shape[0]
        scale = grad.to(lse.dtype) / max(n, 1)
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        rows = torch.arange(min(ctx.chunk_size, n), device=hidden.device)
        # Recompute under the forward's autocast state, so the logits are formed as they were.
        with torch.autocast(hidden.device.type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            for start in range(0, n, ctx.chunk_size):
                stop = min(start + ctx.chunk_size, n)
                h = hidden[start:stop]
                dlogits = _logits(h, weight).sub_(lse[start:stop, None]).exp_()  # softmax, in place
                dlogits[rows[: stop - start], targets[start:stop].long()] -= 1.0
                dlogits.mul_(scale)
                low = dlogits.to(torch.promote_types(h.dtype, weight.dtype) if not ctx.autocast else ctx.autocast_dtype)
                dhidden[start:stop] = (low @ weight.to(low.dtype)).to(hidden.dtype)
                dweight += (low.t() @ h.to(low.dtype)).to(dweight.dtype)
        return dhidden, dweight.to(weight.dtype), None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` (mean over tokens) without materializing the logits.

    ``hidden``: ``(..., d_model)``; ``weight``: ``(vocab, d_model)`` (an LM head's ``weight``); ``targets``:
    ``hidden.shape[:-1]`` class indices. Peak extra memory: ``chunk_size × vocab`` float32 logits."""
    _check(hidden, weight, targets, chunk_size)
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_size)


def hidden_states(model: torch.nn.Module, token_ids: Tensor) -> Tensor:
    """A ``cs336_basics`` LM's forward up to, not including, its LM head: the ``hidden`` that
    :func:`linear_cross_entropy` takes with ``model.lm_head.weight``."""
    x = model.token_embeddings(token_ids)
    for layer in model.layers:
        x = layer(x)
    return model.ln_final(x)


class FusedLMLoss(torch.nn.Module):
    """A ``cs336_basics`` LM whose forward returns the mean cross-entropy through the fused head:
    ``loss = FusedLMLoss(lm)(token_ids, targets)``. One module for wrappers that must see the whole step's
    forward, such as FSDP (keep ``"lm.lm_head"`` replicated there: the fused loss reads its weight directly)."""

    def __init__(self, lm: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK):
        super().__init__()
        self.lm, self.chunk_size = lm, chunk_size

    def forward(self, token_ids: Tensor, targets: Tensor) -> Tensor:
        return linear_cross_entropy(hidden_states(self.lm, token_ids), self.lm.lm_head.weight, targets,
                                    self.chunk_size)


__all__ = ["DEFAULT_CHUNK", "FusedLMLoss", "LinearCrossEntropy", "hidden_states", "linear_cross_entropy"]
