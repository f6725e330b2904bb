"""Closed forms for choosing between parallelism strategies (2026 handout §8, "Analyzing Parallelism
Strategies"), with the simulations that check them.

The setting is the handout's: ``N`` devices, every pair linked, each device sending ``W`` bytes/s (egress)
and computing ``C`` FLOP/s; one SwiGLU FFN ``y = (f(x W1) * (x W2)) W3`` with ``x: (B, D)``,
``W1, W2: (D, F)``, ``W3: (F, D)`` (``F`` = D_FF); weights and activations in 16-bit (2 bytes); only
matmuls count as FLOPs (``(a, b) @ (b, c)`` = ``2abc``). Ring collectives on ``n`` devices over a tensor
of ``S`` bytes: all-gather and reduce-scatter take ``(n-1)/n * S/W``, all-reduce twice that.

Every formula is a ``sympy`` expression (:data:`FORMULAS`), so the writeup prints the same object that the
tests evaluate and that :func:`max_devices` solves; each "how large can N become" bound is derived from its
time formulas by solving *communication time ≤ computation time* (see :func:`bound_from_times`), and
checked against the hand-derived closed form. FLOPs per device (what sets its compute time).

Numerical checks (``tests/test_parallelism_calcs.py``): :func:`simulate_ring` runs the ring collectives
and the "alternate" all-reduce on real arrays, counting the bytes each device sends per step;
:func:`sharded_ffn_step` runs the DP, FSDP and TP strategies device by device in one process, with the
handout's equations (and our TP backward), counting FLOPs with ``torch.utils.flop_counter`` and the
collectives' bytes, and compares the gradients with the unsharded FFN's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy as sp
import torch

B, D, F, W, C = sp.symbols("B D D_FF W C", positive=True)
N, N_DP, N_FSDP, N_TP = sp.symbols("N N_DP N_FSDP N_TP", positive=True)
S = sp.Symbol("S", positive=True)
#: Bytes per weight and activation element (the handout's FP16).
ELEM = 2


def ring_gather(n: sp.Expr, nbytes: sp.Expr) -> sp.Expr:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total over ``n`` devices."""
    return (n - 1) / n * nbytes / W


def ring_all_reduce(n: sp.Expr, nbytes: sp.Expr) -> sp.Expr:
    """Reduce-scatter then all-gather."""
    return 2 * ring_gather(n, nbytes)


#: The alternate all-reduce: each of the ``N - 1`` steps every device forwards one whole input ``x^(k)``
#: (``S`` bytes) to its right neighbour and adds what it receives into its sum.
ALTERNATE_ALL_REDUCE = (N - 1) * S / W

_WEIGHT_BYTES = ELEM * D * F  # one of W1, W2, W3
_ACT_BYTES = ELEM * B * D  # x, y or dx for the whole batch


def _fsdp_tp_times(nf: sp.Expr, nt: sp.Expr) -> dict[str, sp.Expr]:
    """2D forward: FSDP-axis all-gathers of the three TP shards, TP-axis all-reduce of the batch shard's y."""
    return {"fsdp_axis": 3 * ring_gather(nf, _WEIGHT_BYTES / nt),
            "tp_axis": ring_all_reduce(nt, _ACT_BYTES / nf)}


@dataclass(frozen=True)
class Strategy:
    """FLOPs per device and communication time of one pass, and the bound on the device count."""

    name: str
    devices: sp.Symbol
    pass_: str  # "forward" or "backward"
    flops: sp.Expr
    comm_time: sp.Expr
    bound: sp.Expr  # the device count may grow while it is at most this (hand-derived, exact)

    @property
    def compute_time(self) -> sp.Expr:
        return self.flops / C


_MATMUL_FWD = 6 * B * D * F  # x W1, x W2, z W3: three (B, D, F)-sized products
_MATMUL_BWD = 12 * B * D * F  # dz, dW3, dx1 W1^T + dx2 W2^T (two), dW1, dW2

STRATEGIES: tuple[Strategy, ...] = (
    # DP: the batch is split; gradients of all three weights are all-reduced in the backward pass.
    Strategy("dp", N_DP, "backward", _MATMUL_BWD / N_DP, ring_all_reduce(N_DP, 3 * _WEIGHT_BYTES), 1 + B * W / C),
    # FSDP: forward all-gathers three weights; backward all-gathers them again and reduce-scatters gradients.
    Strategy("fsdp", N_FSDP, "forward", _MATMUL_FWD / N_FSDP, 3 * ring_gather(N_FSDP, _WEIGHT_BYTES), 1 + B * W / C),
    Strategy("fsdp", N_FSDP, "backward", _MATMUL_BWD / N_FSDP, 6 * ring_gather(N_FSDP, _WEIGHT_BYTES),
             1 + B * W / C),
    # TP (W1, W2 column-parallel, W3 row-parallel): one all-reduce of y forward, one of dx backward.
    Strategy("tp", N_TP, "forward", _MATMUL_FWD / N_TP, ring_all_reduce(N_TP, _ACT_BYTES),
             1 + sp.Rational(3, 2) * F * W / C),
    Strategy("tp", N_TP, "backward", _MATMUL_BWD / N_TP, ring_all_reduce(N_TP, _ACT_BYTES), 1 + 3 * F * W / C),
)

#: FSDP x TP forward: FLOPs per device, the two axes' times, and the device-count bounds when the axes'
#: collectives overlap (product of the per-axis bounds) and when they share the network (the sum of both
#: times must fit; optimum at 3 F N_FSDP = 2 B N_TP, in the large-N approximation (n-1)/n -> 1).
FSDP_TP = {
    "flops": _MATMUL_FWD / (N_FSDP * N_TP),
    **_fsdp_tp_times(N_FSDP, N_TP),
    "bound_overlapped": (1 + B * W / C) * (1 + sp.Rational(3, 2) * F * W / C),
    "bound_overlapped_large_n": sp.Rational(3, 2) * B * F * W**2 / C**2,
    "bound_shared_large_n": sp.Rational(3, 8) * B * F * W**2 / C**2,
    "best_split_shared": {"N_FSDP": B * W / (2 * C), "N_TP": sp.Rational(3, 4) * F * W / C},
}


def strategy(name: str, pass_: str) -> Strategy:
    for s in STRATEGIES:
        if s.name == name and s.pass_ == pass_:
            return s
    known = ", ".join(f"{s.name}/{s.pass_}" for s in STRATEGIES)
    raise ValueError(f"no strategy {name!r} for the {pass_} pass; known: {known}")


def bound_from_times(comm_time: sp.Expr, compute_time: sp.Expr, devices: sp.Symbol) -> sp.Expr:
    """The device count at which communication time equals computation time (the largest compute-bound
    count: communication per device shrinks more slowly than compute as devices are added)."""
    roots = [r for r in sp.solve(sp.Eq(comm_time, compute_time), devices) if r.is_positive is not False]
    if len(roots) != 1:
        raise ValueError(f"expected one positive crossing for {devices}, got {roots}")
    return sp.simplify(roots[0])


def shared_network_bound() -> tuple[sp.Expr, dict[str, sp.Expr]]:
    """(d): maximize N = N_FSDP N_TP subject to fsdp_axis + tp_axis <= compute time, in the large-N limit,
    by Lagrange conditions solved with sympy (an independent check of :data:`FSDP_TP`'s closed form)."""
    nf, nt = sp.symbols("n_f n_t", positive=True)
    times = _fsdp_tp_times(nf, nt)
    # (n-1)/n -> 1 along each axis: the time each axis would take with many devices on it
    t_f = sp.limit(times["fsdp_axis"] * nt, nf, sp.oo) / nt
    t_t = sp.limit(times["tp_axis"] * nf, nt, sp.oo) / nf
    large = {N_FSDP: nf, N_TP: nt}
    compute = FSDP_TP["flops"].subs(large) / C
    lam = sp.Symbol("lam")
    lagrangian = nf * nt - lam * (t_f + t_t - compute)
    sols = sp.solve([sp.diff(lagrangian, nf), sp.diff(lagrangian, nt), t_f + t_t - compute], [nf, nt, lam],
                    dict=True)
    best = next(s for s in sols if s[nf].is_positive and s[nt].is_positive)
    return sp.simplify(best[nf] * best[nt]), {"N_FSDP": sp.simplify(best[nf]), "N_TP": sp.simplify(best[nt])}


def max_devices(expr: sp.Expr, *, batch: float, d_model: float, d_ff: float, flops: float, egress: float) -> float:
    """A bound evaluated at numbers (FLOP/s, bytes/s)."""
    return float(expr.subs({B: batch, D: d_model, F: d_ff, C: flops, W: egress}))


# --------------------------------------------------------------------------------------------------
# Simulated collectives: correctness and bytes sent per device per step
# --------------------------------------------------------------------------------------------------


def simulate_ring(kind: str, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
    """Run ``kind`` ("all_gather", "reduce_scatter", "all_reduce", "alternate_all_reduce") on ``n`` devices'
    ``inputs`` (chunks for all-gather, full tensors otherwise) and return every device's result and the
    time in units of "bytes / W": per step, the most bytes any device sends (all send at once)."""
    n = len(inputs)
    if n < 2:
        raise ValueError(f"a ring needs at least 2 devices, got {n}")
    if kind == "all_gather":
        have = [{i: inputs[i].copy()} for i in range(n)]
        elapsed = 0.0
        for t in range(n - 1):
            sent = [(i, (i - t) % n, have[i][(i - t) % n]) for i in range(n)]
            elapsed += max(chunk.nbytes for _, _, chunk in sent)
            for i, k, chunk in sent:
                have[(i + 1) % n][k] = chunk
        return [np.concatenate([h[k] for k in range(n)]) for h in have], elapsed
    if kind in ("reduce_scatter", "all_reduce"):
        partial = [np.array_split(x.astype(np.float64), n) for x in inputs]
        elapsed = 0.0
        for t in range(1, n):
            sent = [(i, (i - t) % n, partial[i][(i - t) % n].copy()) for i in range(n)]
            elapsed += max(chunk.nbytes for _, _, chunk in sent)
            for i, k, chunk in sent:
                partial[(i + 1) % n][k] = partial[(i + 1) % n][k] + chunk
        owned = [partial[i][i] for i in range(n)]  # the last chunk device i updated, (i - n) mod n, is its own
        if kind == "reduce_scatter":
            return owned, elapsed
        gathered, more = simulate_ring("all_gather", owned)
        return gathered, elapsed + more
    if kind == "alternate_all_reduce":
        total = [x.astype(np.float64).copy() for x in inputs]
        elapsed = 0.0
        for t in range(1, n):
            sent = [(i, inputs[(i - t + 1) % n]) for i in range(n)]  # forward x^((i-t+1) mod n)
            elapsed += max(x.nbytes for _, x in sent)
            for i, x in sent:
                total[(i + 1) % n] = total[(i + 1) % n] + x
        return total, elapsed
    raise ValueError(f"unknown collective {kind!r}")


# --------------------------------------------------------------------------------------------------
# The strategies run device by device: FLOPs, bytes, and gradients against the unsharded FFN
# --------------------------------------------------------------------------------------------------


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _dsilu(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def ffn_step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, dy: torch.Tensor):
    """The handout's forward (20)-(23) and backward (24)-(30): ``y, dx, (dW1, dW2, dW3)``. On one TP rank's
    shards (``dy`` replicated) the same equations give that rank's partial ``y`` and ``dx`` (summed by the
    forward and backward all-reduces) and its own weight gradients: the TP backward of tp_calcs (a)."""
    x1, x2 = x @ w1, x @ w2
    z = _silu(x1) * x2
    y = z @ w3
    dz = dy @ w3.T
    dx2 = dz * _silu(x1)
    dx1 = dz * _dsilu(x1) * x2
    dx = dx1 @ w1.T + dx2 @ w2.T
    return y, dx, (x.T @ dx1, x.T @ dx2, z.T @ dy)


@dataclass
class ShardedStep:
    """Per device: matmul FLOPs of the forward and of the backward; bytes each collective moves in total
    (``S`` of the ring formulas); the assembled outputs and gradients."""

    forward_flops: list[int]
    backward_flops: list[int]
    collective_bytes: dict[str, float]
    y: torch.Tensor
    dx: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _flops(fn: Callable[[], object]) -> tuple[object, int]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def sharded_ffn_step(strategy_name: str, n: int, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     w3: torch.Tensor, dy: torch.Tensor) -> ShardedStep:
    """Run ``strategy_name`` ("dp", "fsdp" or "tp") over ``n`` simulated devices; the collectives are
    computed exactly (sums and concatenations), their sizes recorded at 2 bytes per element."""
    batch, _ = x.shape
    if strategy_name in ("dp", "fsdp"):
        if batch % n:
            raise ValueError(f"batch {batch} does not split over {n} devices")
        fwd, bwd, ys, dxs, grads = [], [], [], [], []
        for xs, dys in zip(x.chunk(n), dy.chunk(n), strict=True):
            (y,), f_flops = _flops(lambda xs=xs: ((_silu(xs @ w1) * (xs @ w2)) @ w3,))
            (_, dx, g), total = _flops(lambda xs=xs, dys=dys: ffn_step(xs, w1, w2, w3, dys))
            fwd.append(f_flops)
            bwd.append(total - f_flops)
            ys.append(y)
            dxs.append(dx)
            grads.append(g)
        summed = tuple(sum(g[k] for g in grads) for k in range(3))  # all-reduce (DP) / reduce-scatter (FSDP)
        weights = 3 * ELEM * w1.numel()
        comm = ({"backward_all_reduce": weights} if strategy_name == "dp" else
                {"forward_all_gather": weights, "backward_all_gather": weights, "backward_reduce_scatter": weights})
        return ShardedStep(fwd, bwd, comm, torch.cat(ys), torch.cat(dxs), summed)
    if strategy_name == "tp":
        d_ff = w1.shape[1]
        if d_ff % n:
            raise ValueError(f"d_ff {d_ff} does not split over {n} devices")
        fwd, bwd, y_parts, dx_parts, shards = [], [], [], [], []
        for a, b_, c in zip(w1.chunk(n, dim=1), w2.chunk(n, dim=1), w3.chunk(n, dim=0), strict=True):
            (y_part,), f_flops = _flops(lambda a=a, b_=b_, c=c: ((_silu(x @ a) * (x @ b_)) @ c,))
            (_, dx_part, g), total = _flops(lambda a=a, b_=b_, c=c: ffn_step(x, a, b_, c, dy))
            fwd.append(f_flops)
            bwd.append(total - f_flops)
            y_parts.append(y_part)
            dx_parts.append(dx_part)
            shards.append(g)
        grads = tuple(torch.cat([s[k] for s in shards], dim=1 if k < 2 else 0) for k in range(3))
        acts = ELEM * x.numel()
        return ShardedStep(fwd, bwd, {"forward_all_reduce": acts, "backward_all_reduce": acts},
                           sum(y_parts), sum(dx_parts), grads)
    raise ValueError(f"unknown strategy {strategy_name!r}; choose dp, fsdp or tp")


__all__ = [
    "ALTERNATE_ALL_REDUCE", "B", "C", "D", "F", "FSDP_TP", "N", "N_DP", "N_FSDP", "N_TP", "S", "STRATEGIES", "W",
    "ShardedStep", "Strategy", "bound_from_times", "ffn_step", "max_devices", "ring_all_reduce", "ring_gather",
    "shared_network_bound", "sharded_ffn_step", "simulate_ring", "strategy",
]  # fmt: skip
