"""FlashAttention-2 in plain PyTorch: the readable version of the algorithm and the CPU fallback.

The forward pass is Algorithm 1 of FlashAttention-2 (Dao, 2023): for each query tile, walk the key tiles
keeping a running row maximum ``m``, a running softmax denominator ``l`` and an unnormalized output
accumulator, rescaling both whenever the maximum grows (the "online softmax"). Only tiles are ever
materialized, never the ``n_queries x n_keys`` score matrix; the forward keeps ``L = m + log l`` per query
row so that the backward pass can rebuild any tile of ``P = exp(S - L)`` exactly.

The backward pass recomputes instead of storing: ``D = rowsum(dO ∘ O)``, then per tile ``P = exp(S - L)``,
``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - D)``, ``dQ += dS K / √d``, ``dK += dSᵀ Q / √d``.

With ``is_causal`` key tiles entirely above the diagonal are skipped and only tiles that straddle it are
masked, exactly as the Triton kernels do (``flash_triton.py``), so the two can be read side by side.
Accumulation is in float32 (float64 for float64 inputs). Wrap ``FlashAttentionPytorch.apply`` in
``torch.compile`` to fuse the per-tile elementwise work.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._validation import FLOAT_DTYPES, validate_attention_inputs
from .reference import causal_mask

#: Tile sizes (rows of Q, rows of K/V). Any value >= 16 is correct; 64 keeps Python overhead low.
TILE_Q = 64
TILE_K = 64

#: float64 is accepted here (not by the Triton kernels) so that gradients can be checked to 1e-10.
PYTORCH_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tile_scores(
    q_tile: Tensor, k_tile: Tensor, q_start: int, k_start: int, scale: float, is_causal: bool
) -> Tensor:
    """``S = Q Kᵀ · scale`` for one tile, with the causal mask applied only if the tile straddles the
    diagonal (its last key is after its first query)."""
    s = (q_tile @ k_tile.transpose(-2, -1)) * scale
    if is_causal and k_start + k_tile.shape[-2] - 1 > q_start:
        mask = causal_mask(
            q_tile.shape[-2], k_tile.shape[-2], s.device, query_offset=q_start, key_offset=k_start
        )
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _key_end(q_end: int, n_keys: int, is_causal: bool) -> int:
    """Keys past ``q_end - 1`` are invisible to every query of a causal tile ending at ``q_end``."""
    return min(q_end, n_keys) if is_causal else n_keys


def _query_start(k_start: int, tile_q: int, is_causal: bool) -> int:
    """The first query tile that sees any key of a tile starting at ``k_start`` (causal: query >= key)."""
    return (k_start // tile_q) * tile_q if is_causal else 0


def flash_forward_pytorch(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, tile_q: int = TILE_Q, tile_k: int = TILE_K
) -> tuple[Tensor, Tensor]:
    """Tiled forward pass on ``(…, n, d)`` tensors; returns ``O`` (inputs' dtype) and ``L`` (float32 or
    float64), ``L`` shaped like ``Q`` without its last dimension."""
    acc_dtype = _accumulation_dtype(q.dtype)
    n_queries, n_keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for q_start in range(0, n_queries, tile_q):
        q_end = min(q_start + tile_q, n_queries)
        q_tile = q[..., q_start:q_end, :].to(acc_dtype)
        row_max = torch.full(q_tile.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_tile)
        for k_start in range(0, _key_end(q_end, n_keys, is_causal), tile_k):
            k_end = min(k_start + tile_k, n_keys)
            s = _tile_scores(
                q_tile, k[..., k_start:k_end, :].to(acc_dtype), q_start, k_start, scale, is_causal
            )
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            p = torch.exp(s - new_max[..., None])
            rescale = torch.exp(row_max - new_max)  # exp(-inf) = 0 on the first tile
            row_sum = rescale * row_sum + p.sum(dim=-1)
            acc = rescale[..., None] * acc + p @ v[..., k_start:k_end, :].to(acc_dtype)
            row_max = new_max
        o[..., q_start:q_end, :] = (acc / row_sum[..., None]).to(q.dtype)
        lse[..., q_start:q_end] = row_max + torch.log(row_sum)
    return o, lse


def flash_backward_pytorch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    is_causal: bool,
    tile_q: int = TILE_Q,
    tile_k: int = TILE_K,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tiled backward pass by recomputation; returns ``dQ, dK, dV`` in the inputs' dtype."""
    acc_dtype = _accumulation_dtype(q.dtype)
    n_queries, n_keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(dim=-1)  # D_i = rowsum(dO ∘ O)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    for k_start in range(0, n_keys, tile_k):
        k_end = min(k_start + tile_k, n_keys)
        k_tile = k[..., k_start:k_end, :].to(acc_dtype)
        v_tile = v[..., k_start:k_end, :].to(acc_dtype)
        dk_acc = torch.zeros_like(k_tile)
        dv_acc = torch.zeros_like(v_tile)
        for q_start in range(_query_start(k_start, tile_q, is_causal), n_queries, tile_q):
            q_end = min(q_start + tile_q, n_queries)
            q_tile = q[..., q_start:q_end, :].to(acc_dtype)
            do_tile = do[..., q_start:q_end, :].to(acc_dtype)
            s = _tile_scores(q_tile, k_tile, q_start, k_start, scale, is_causal)
            p = torch.exp(s - lse[..., q_start:q_end, None].to(acc_dtype))
            dv_acc += p.transpose(-2, -1) @ do_tile
            dp = do_tile @ v_tile.transpose(-2, -1)
            ds = p * (dp - delta[..., q_start:q_end, None])
            dq[..., q_start:q_end, :] += (ds @ k_tile) * scale
            dk_acc += (ds.transpose(-2, -1) @ q_tile) * scale
        dk[..., k_start:k_end, :] = dk_acc.to(k.dtype)
        dv[..., k_start:k_end, :] = dv_acc.to(v.dtype)
    return dq.to(q.dtype), dk, dv


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 as an autograd function: ``FlashAttentionPytorch.apply(Q, K, V, is_causal=False)``.

    Accepts ``(batch, n, d)`` or ``(batch, heads, n, d)`` in float32/float16/bfloat16 (and float64) on any
    device; saves ``Q, K, V, O, L`` for the backward pass.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False
    ) -> Tensor:
        validate_attention_inputs(
            q, k, v, is_causal, dtypes=PYTORCH_DTYPES, implementation="FlashAttention (PyTorch)"
        )
        o, lse = flash_forward_pytorch(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_pytorch(q, k, v, o, lse, do, ctx.is_causal)
        return dq, dk, dv, None
