"""Timing ``torch.distributed.all_reduce``: message sizes, the bandwidth conventions of nccl-tests, and a
worker that times every size on the current process group (or spawns local ranks to do so).

Conventions follow nccl-tests (``doc/PERFORMANCE.md``): **algbw** = ``size / time``; **busbw** = ``algbw ×
2(n−1)/n``, the per-rank link bandwidth a ring all-reduce actually used; time is the slowest rank's mean
over the timed iterations. Used by the all-reduce section (§2.1) and by the DDP step benchmark, which
times all-reduces on its own process group for the bucket-size model.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed import launch

DEFAULT_SIZES = ["1MB", "10MB", "100MB", "1GB"]
SMOKE_SIZES = ["1KB", "10KB", "100KB", "1MB"]
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}

# --------------------------------------------------------------------------------------------------
# Sizes and bandwidth conventions
# --------------------------------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """``"1MB"`` → 1_000_000 (decimal units, as in GB/s), ``"1MiB"`` → 1_048_576, ``"4096"`` → 4096."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS | {"": 1}:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 1MB, 100MB, 1GB, 64MiB or a byte count")
    value = int(float(m.group(1)) * _UNITS.get(m.group(2).upper(), 1))
    if value < 4 or value % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (fp32 elements)")
    return value


def size_label(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def bus_bandwidth_factor(world_size: int) -> float:
    """``2(n−1)/n``: bytes each rank sends (and receives) per byte of buffer in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


# --------------------------------------------------------------------------------------------------
# Measurement (inside an initialised process group)
# --------------------------------------------------------------------------------------------------


def default_iterations(size_bytes: int, backend: str) -> tuple[int, int]:
    """(warm-up, timed) iterations: many for small GPU messages, few for gigabyte all-reduces on CPU."""
    if backend == "nccl":
        return (5, 50) if size_bytes <= 10**8 else (3, 20)
    return (2, 10) if size_bytes <= 10**7 else (1, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(size_bytes: int, warmup: int | None = None, iters: int | None = None) -> dict[str, Any]:
    """Mean seconds per fp32 all-reduce of ``size_bytes`` on this process group (slowest rank)."""
    ctx = launch.current_context()
    default_warmup, default_iters = default_iterations(size_bytes, ctx.backend)
    warmup = default_warmup if warmup is None else warmup
    iters = default_iters if iters is None else iters
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    data = torch.randn(size_bytes // 4, dtype=torch.float32, device=ctx.device)
    for _ in range(warmup):
        dist.all_reduce(data)
    _sync(ctx.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    _sync(ctx.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = float(elapsed.item())
    algbw = size_bytes / seconds / 1e9
    del data
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "backend": ctx.backend,
        "device": "cuda" if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size,
        "size_bytes": size_bytes,
        "size": size_label(size_bytes),
        "time_ms": seconds * 1e3,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * bus_bandwidth_factor(ctx.world_size),
        "iters": iters,
    }


def benchmark_worker(sizes_bytes: list[int], warmup: int | None, iters: int | None) -> list[dict[str, Any]]:
    """All sizes on the current process group (run on every rank; rows are identical across ranks)."""
    return [time_all_reduce(s, warmup, iters) for s in sizes_bytes]


def run_allreduce_benchmark(
    backend: str,
    world_size: int,
    sizes: list[str | int],
    warmup: int | None = None,
    iters: int | None = None,
) -> list[dict[str, Any]]:
    """Spawn ``world_size`` local processes on ``backend`` and measure every size."""
    sizes_bytes = [parse_size(s) for s in sizes]
    results = launch.spawn(benchmark_worker, world_size, sizes_bytes, warmup, iters, backend=backend)
    return results[0]
