"""Input checks shared by every FlashAttention implementation.

Both the PyTorch and the Triton version call :func:`validate_attention_inputs`, so a bad call fails with
the same ``ValueError`` whichever implementation is behind it. What differs between them (which dtypes,
head dimensions and devices a backend can run) is passed in as policy.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

#: Dtypes every implementation accepts; on-chip accumulation is float32 for all of them.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionShape:
    """The problem size of one call, with 3-D inputs seen as 4-D inputs of one head."""

    batch: int
    heads: int
    n_queries: int
    n_keys: int
    head_dim: int
    has_heads: bool  # True for (batch, heads, n, d) inputs, False for (batch, n, d)


def validate_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    *,
    dtypes: Collection[torch.dtype] = FLOAT_DTYPES,
    head_dims: Collection[int] | None = None,
    implementation: str = "FlashAttention",
) -> AttentionShape:
    """Check ``q (…, n_queries, d)``, ``k``/``v`` ``(…, n_keys, d)`` and return the problem size.

    Raises ``ValueError`` for: a rank other than 3 or 4, ranks that differ, leading dimensions that differ,
    ``k`` and ``v`` of different lengths, head dimensions that differ or are not in ``head_dims``,
    empty sequences, dtypes that differ or are not in ``dtypes``, tensors on different devices, and a
    non-bool ``is_causal``.
    """
    tensors = {"Q": q, "K": k, "V": v}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{implementation}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"{implementation}: is_causal must be a bool, got {type(is_causal).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(
            f"{implementation}: Q must be (batch, n_queries, d) or (batch, heads, n_queries, d), "
            f"got shape {tuple(q.shape)}"
        )
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"{implementation}: Q, K, V must have the same rank, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"{implementation}: Q, K, V must share their leading (batch[, heads]) dimensions, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{implementation}: K and V must have the same number of keys, "
            f"got {k.shape[-2]} and {v.shape[-2]}"
        )
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(
            f"{implementation}: Q, K, V must have the same head dimension, got "
            f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
        )
    if head_dims is not None and not _contains(head_dims, d):
        raise ValueError(
            f"{implementation}: head dimension {d} is not supported; supported: {_describe(head_dims)}"
        )
    if d == 0 or q.shape[-2] == 0 or k.shape[-2] == 0 or q.numel() == 0:
        raise ValueError(
            f"{implementation}: empty inputs are not supported (attention over zero keys is undefined), "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{implementation}: Q, K, V must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.dtype not in dtypes:
        raise ValueError(
            f"{implementation}: dtype {q.dtype} is not supported; supported: "
            f"{', '.join(str(t).removeprefix('torch.') for t in dtypes)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{implementation}: Q, K, V must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if q.dim() == 4:
        batch, heads, n_queries, _ = q.shape
    else:
        (batch, n_queries, _), heads = q.shape, 1
    return AttentionShape(batch, heads, n_queries, k.shape[-2], d, has_heads=q.dim() == 4)


def _contains(values: Collection[int], d: int) -> bool:
    # A range is tested by its bounds: under torch.compile with dynamic shapes ``d`` is symbolic, and
    # ``in range(...)`` would need its value, while two comparisons only add guards.
    if isinstance(values, range) and values.step == 1:
        return values.start <= d < values.stop
    return d in values


def _describe(values: Collection[int]) -> str:
    """``[16, 32, 64]``, or ``1..128`` for a range."""
    if isinstance(values, range) and values.step == 1:
        return f"{values.start}..{values.stop - 1}"
    return str(sorted(values))
