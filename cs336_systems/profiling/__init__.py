"""Profiling: torch.profiler kernel tables by annotated range, Nsight Systems runs, CUDA memory snapshots.

- :mod:`.torch_profiler` — ``profile_steps``, ``kernel_table`` (per-kernel summary filtered by range),
  ``export_chrome_trace``, ``annotations`` (switch ``cs336_basics.nvtx`` ranges on).
- :mod:`.nsys` — ``run_nsys`` / ``nsys_command``: the same benchmark under ``nsys profile``.
- :mod:`.memory` — ``record_memory_snapshot`` and offline analysis of the snapshot: active memory
  timeline (PNG), largest allocations with their user-code origin.
"""

from .memory import (
    active_memory_timeline,
    allocation_events,
    largest_allocations,
    load_snapshot,
    plot_active_memory_timeline,
    plot_memory_timelines,
    record_memory_snapshot,
)
from .nsys import nsys_available, nsys_command, run_nsys
from .torch_profiler import (
    annotations,
    category_shares,
    classify_kernel,
    export_chrome_trace,
    kernel_records,
    kernel_table,
    profile_steps,
    range_intervals,
    range_names,
)

__all__ = [
    "active_memory_timeline",
    "allocation_events",
    "annotations",
    "category_shares",
    "classify_kernel",
    "export_chrome_trace",
    "kernel_records",
    "kernel_table",
    "largest_allocations",
    "load_snapshot",
    "nsys_available",
    "nsys_command",
    "plot_active_memory_timeline",
    "plot_memory_timelines",
    "profile_steps",
    "range_intervals",
    "range_names",
    "record_memory_snapshot",
    "run_nsys",
]
