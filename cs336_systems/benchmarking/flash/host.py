"""The host's cost per attention call: ours against SDPA pinned to each fast backend, shape by shape and
layout by layout (the harness is :mod:`cs336_systems.benchmarking.flash_host_overhead`)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

#: What the host-cost table compares: ours, then SDPA pinned to each fast backend.
HOST_IMPLS = ("ours", "sdpa_flash", "sdpa_cudnn")
#: One row of the host-cost summary.
HOST_KEYS = ("batch", "heads", "seq_len", "head_dim", "layout")


def run_host_overhead(shapes: Sequence[Sequence[int]], layouts: Sequence[str], dtype: str = "bfloat16",
                      rounds: int = 5, calls: int = 20, impls: Sequence[str] = HOST_IMPLS) -> pd.DataFrame:
    """Host µs, GPU µs and wall µs per causal forward+backward, every round of every implementation
    (:func:`cs336_systems.benchmarking.flash_host_overhead.measure`: alternating, in rotating order), per
    (batch, heads, seq, head_dim) shape and memory layout."""
    from cs336_systems.benchmarking import flash_host_overhead

    frames = [flash_host_overhead.measure(tuple(shape), getattr(torch, dtype), True, tuple(impls),  # type: ignore[arg-type]
                                          rounds, calls, layout=layout)
              for shape in shapes for layout in layouts]
    return pd.concat(frames, ignore_index=True)


def summarize_host_overhead(rows: pd.DataFrame) -> pd.DataFrame:
    """Per shape, layout and implementation: median host, GPU and wall µs over the rounds, the host time's
    spread (max - min), and ``bound``: ``host`` when issuing a call takes longer than the GPU runs it."""
    from cs336_systems.benchmarking.flash_host_overhead import summarize

    out = summarize(rows, by=HOST_KEYS)
    out["bound"] = ["host" if h > gpu else "GPU" for h, gpu in zip(out["host_us"], out["gpu_us"])]
    return out


# --------------------------------------------------------------------------------------------------
# Where the losing shapes lose: ours' kernels against cuDNN's at the worst shapes of the grid (a profile)
# --------------------------------------------------------------------------------------------------
