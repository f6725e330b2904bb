"""Single-GPU benchmarking: timing helpers, the end-to-end model benchmark, OOM-tolerant sweeps,
the attention grid, mixed-precision experiments, and one runner per writeup section.

- :mod:`.timing` — ``time_calls`` (synchronize + ``timeit.default_timer``), ``cuda_event_times``,
  ``do_bench`` (``triton.testing.do_bench``), ``TimingStats``.
- :mod:`.end_to_end` — ``BenchmarkSpec``, ``ModelBenchmark``, ``benchmark_model``.
- :mod:`.sweep` — ``run_sweep`` (tqdm, OOM → "OOM", time budget), ``grid``, ``status_grid``.
- :mod:`.attention` — ``benchmark_attention`` and ``naive_attention_memory`` (§1.2.1).
- :mod:`.mixed_precision` — accumulation loops, ``ToyModel``, ``autocast_dtypes`` (§1.1.5).
- :mod:`.sections` — ``run_<section>`` for each notebook; ``python -m cs336_systems.benchmarking``.
"""

from .attention import benchmark_attention, naive_attention_memory, saved_tensor_bytes
from .end_to_end import MODES, PRECISIONS, BenchmarkSpec, ModelBenchmark, autocast_context, benchmark_model
from .mixed_precision import ToyModel, accumulation_experiments, autocast_dtypes
from .sweep import OOM, grid, is_oom, run_sweep, status_grid
from .timing import TimingStats, cuda_event_times, do_bench, synchronize, time_calls

__all__ = [
    "MODES",
    "OOM",
    "PRECISIONS",
    "BenchmarkSpec",
    "ModelBenchmark",
    "TimingStats",
    "ToyModel",
    "accumulation_experiments",
    "autocast_context",
    "autocast_dtypes",
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
