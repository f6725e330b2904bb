"""Attention computed the obvious way: the ground truth for tests and the baseline for benchmarks.

:func:`reference_attention` materializes the full score matrix in float64 and returns both the output and
the log-sum-exp ``L``, which is what the flash implementations are checked against.
:func:`naive_attention` is the same computation in the inputs' own dtype, the "what you would write
without FlashAttention" baseline whose memory grows with ``n_queries * n_keys``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def causal_mask(
    n_queries: int,
    n_keys: int,
    device: torch.device | str | None = None,
    *,
    query_offset: int = 0,
    key_offset: int = 0,
) -> Tensor:
    """Boolean ``(n_queries, n_keys)`` mask, True where query ``i`` may see key ``j``: ``j <= i``.

    Top-left aligned (query 0 sees key 0), the convention of PyTorch's SDPA, also when the lengths differ.
    The offsets give the mask of one tile: rows ``query_offset …``, columns ``key_offset …``.
    """
    rows = query_offset + torch.arange(n_queries, device=device)[:, None]
    cols = key_offset + torch.arange(n_keys, device=device)[None, :]
    return cols <= rows


def _scores(q: Tensor, k: Tensor, is_causal: bool) -> Tensor:
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s


def reference_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> tuple[Tensor, Tensor]:
    """``(O, L)`` in float64: ``O = softmax(S) V`` and ``L = logsumexp(S, -1)``, ``S = Q Kᵀ / √d``.

    Differentiable, so ``O.backward(dO)`` gives float64 reference gradients for the inputs (pass leaf
    tensors already converted with ``.double()`` to read them).
    """
    q, k, v = q.double(), k.double(), v.double()
    s = _scores(q, k, is_causal)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
    """Attention in the inputs' dtype with the ``(…, n_queries, n_keys)`` matrices kept for autograd."""
    return torch.softmax(_scores(q, k, is_causal), dim=-1) @ v
