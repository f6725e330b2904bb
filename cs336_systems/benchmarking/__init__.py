"""Measurement tools the sections are built from: timing helpers, the end-to-end model benchmark,
OOM-tolerant sweeps, the attention grid, and the DDP step benchmark.

- :mod:`.timing` — ``time_calls`` (synchronize + ``timeit.default_timer``), ``cuda_event_times``,
  ``do_bench`` (``triton.testing.do_bench``), ``TimingStats``.
- :mod:`.end_to_end` — ``BenchmarkSpec``, ``ModelBenchmark``, ``benchmark_model``.
- :mod:`.sweep` — ``run_sweep`` (tqdm, OOM → "OOM", time budget), ``grid``, ``status_grid``.
- :mod:`.attention` — ``benchmark_attention`` and ``naive_attention_memory`` (§1.2.1).
- :mod:`.ddp_steps` — time per training step of each DDP strategy next to torch DDP (§2.2–§2.3), with
  :mod:`.ddp_overhead_model` (the bucket-size model) and :mod:`.ddp_host_overhead` (host time per step).

The writeup's sections, built from these, are :mod:`cs336_systems.experiments`.
"""

from .attention import benchmark_attention, naive_attention_memory, saved_tensor_bytes
from .end_to_end import MODES, PRECISIONS, BenchmarkSpec, ModelBenchmark, autocast_context, benchmark_model
from .sweep import OOM, grid, is_oom, run_sweep, status_grid
from .timing import TimingStats, cuda_event_times, do_bench, synchronize, time_calls

__all__ = [
    "MODES",
    "OOM",
    "PRECISIONS",
    "BenchmarkSpec",
    "ModelBenchmark",
    "TimingStats",
    "autocast_context",
    "benchmark_attention",
    "benchmark_model",
    "cuda_event_times",
    "do_bench",
    "grid",
    "is_oom",
    "naive_attention_memory",
    "run_sweep",
    "saved_tensor_bytes",
    "status_grid",
    "synchronize",
    "time_calls",
]
