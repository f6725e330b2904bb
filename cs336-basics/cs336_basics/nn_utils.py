"""Numerically stable softmax / cross-entropy and gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim``; subtracting the max keeps ``exp`` from overflowing."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    shifted = x - x.amax(dim=dim, keepdim=True)
    return shifted - torch.logsumexp(shifted, dim=dim, keepdim=True)


def cross_entropy(inputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits ``inputs`` (..., vocab) against integer ``targets`` (...).

    Computed in float32 whatever the logits' dtype, since bf16 log-probabilities lose too many bits.
    """
    if inputs.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(inputs.shape)} do not match targets {tuple(targets.shape)}")
    logp = log_softmax(inputs.float(), dim=-1)
    picked = torch.gather(logp, -1, targets.long().unsqueeze(-1)).squeeze(-1)
    return -picked.mean()


@torch.no_grad()
def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients so their joint L2 norm is at most ``max_norm``; returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if total > max_norm:
        scale = max_norm / (total + eps)
        for g in grads:
            g.mul_(scale)
    return total
