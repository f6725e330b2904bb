"""An analytic model of bucketed DDP's communication overhead, and the bucket size that minimises it.

Symbols (as in the handout's §2.3.3):

- ``s`` — total bytes of gradients to all-reduce (the model's trainable parameters);
- ``w`` — all-reduce *algorithm* bandwidth, bytes of each rank's data per second of all-reduce;
- ``o`` — fixed overhead of one communication call, seconds;
- ``n_b`` — number of equal buckets, each ``s / n_b`` bytes.

Assume, as the handout does, that backward computes a bucket's gradients in the same time it takes to
communicate them, ``c = s / (n_b w)``. Bucket ``i`` (1-based) is ready at ``i c``. Each all-reduce
takes ``o + c`` and they run one after another, so communication is always behind compute: the first
starts at ``c`` and the last ends at ``c + n_b (o + c)``. Backward ends at ``n_b c``, leaving

    overhead(n_b) = c + n_b o = s / (n_b w) + n_b o

of communication after backward: the last bucket (which can never overlap) plus every call's fixed
cost. Setting the derivative ``-s / (n_b² w) + o`` to zero gives

    n_b* = sqrt(s / (w o)),      bucket* = s / n_b* = sqrt(s w o),      overhead* = 2 sqrt(s o / w).

:func:`fit_latency_bandwidth` estimates ``o`` and ``w`` from measured all-reduce times
(``t(size) = o + size / w``), and :func:`simulate_overhead` replays the same pipeline for arbitrary,
unequal buckets, which the closed form cannot describe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be positive and finite, got {value}")


def ddp_overhead_s(s: float, w: float, o: float, n_b: float) -> float:
    """Communication time left after backward: ``s / (n_b w) + n_b o`` seconds."""
    _check_positive(s=s, w=w, n_b=n_b)
    if o < 0:
        raise ValueError(f"o must be non-negative, got {o}")
    return s / (n_b * w) + n_b * o


def optimal_num_buckets(s: float, w: float, o: float) -> float:
    """``n_b* = sqrt(s / (w o))`` (a real number; round to an integer ≥ 1 to use it)."""
    _check_positive(s=s, w=w, o=o)
    return math.sqrt(s / (w * o))


def optimal_bucket_size_bytes(s: float, w: float, o: float) -> float:
    """``s / n_b* = sqrt(s w o)`` bytes, capped at ``s`` (one bucket) when calls are very expensive."""
    return min(s, math.sqrt(s * w * o)) if o > 0 else 0.0


def minimal_overhead_s(s: float, w: float, o: float) -> float:
    """``2 sqrt(s o / w)``: the overhead at the optimal bucket count."""
    _check_positive(s=s, w=w, o=o)
    return 2.0 * math.sqrt(s * o / w)


def fit_latency_bandwidth(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = o + size / w``; returns ``(o, w)``.

    Small messages pin down ``o``, large ones ``w``; fit on all-reduce measurements that span both.
    A negative intercept (noise when ``o`` is tiny) is clipped to zero.
    """
    x = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if x.shape != t.shape or x.size < 2 or np.unique(x).size < 2:
        raise ValueError("need at least two distinct message sizes with one time each")
    slope, intercept = np.polyfit(x, t, 1)
    if not slope > 0:
        raise ValueError("times do not grow with message size; cannot estimate a bandwidth")
    return max(float(intercept), 0.0), float(1.0 / slope)


def simulate_overhead(bucket_bytes: Sequence[float], w: float, o: float, compute_s_per_byte: float | None = None) -> float:
    """Overhead after backward for buckets of the given sizes (in launch order), when bucket ``i`` is
    ready after backward has produced ``bucket_bytes[:i+1]`` at ``compute_s_per_byte`` (default ``1/w``,
    the handout's assumption) and all-reduces run one at a time, each taking ``o + bytes / w``."""
    _check_positive(w=w)
    if not bucket_bytes:
        raise ValueError("need at least one bucket")
    rate = 1.0 / w if compute_s_per_byte is None else compute_s_per_byte
    ready = 0.0
    comm_free = 0.0
    for b in bucket_bytes:
        ready += b * rate
        comm_free = max(comm_free, ready) + o + b / w
    return comm_free - ready


def compare_with_sweep(steps: Any, allreduce: Any) -> tuple[Any, dict[str, float]]:
    """Model vs measurement for a bucket-size sweep.

    ``steps``: the DDP benchmark table (rows ``mode == "bucketed"`` with ``num_buckets``, ``grad_bytes``,
    ``comm_dtype``, ``overhead_ms``); ``allreduce``: all-reduce timings (``size_bytes``, ``time_ms``) on
    the same process group. Fits ``o`` and ``w``, then predicts each swept configuration's overhead from
    its actual number of buckets. Returns the table and the fitted/optimal quantities (fp32 wire).
    """
    import pandas as pd

    o, w = fit_latency_bandwidth(allreduce["size_bytes"].tolist(), (allreduce["time_ms"] / 1e3).tolist())
    sweep = steps[steps["mode"] == "bucketed"].copy()
    wire_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}
    s = sweep["grad_bytes"] * sweep["comm_dtype"].map(wire_bytes).fillna(4) / 4
    sweep["predicted_overhead_ms"] = [ddp_overhead_s(si, w, o, nb) * 1e3 for si, nb in zip(s, sweep["num_buckets"])]
    s_fp32 = float(sweep["grad_bytes"].iloc[0]) if len(sweep) else float(steps["grad_bytes"].iloc[0])
    summary = {
        "o_us": o * 1e6,
        "w_GBps": w / 1e9,
        "s_GB": s_fp32 / 1e9,
        "optimal_num_buckets": optimal_num_buckets(s_fp32, w, o) if o > 0 else float("inf"),
        "optimal_bucket_size_mb": optimal_bucket_size_bytes(s_fp32, w, o) / 2**20,
        "minimal_overhead_ms": minimal_overhead_s(s_fp32, w, o) * 1e3 if o > 0 else float("nan"),
    }
    cols = ["variant", "bucket_size_mb", "comm_dtype", "num_buckets", "step_ms", "overhead_ms", "predicted_overhead_ms"]
    return pd.DataFrame(sweep[[c for c in cols if c in sweep.columns]]).reset_index(drop=True), summary
