"""Where a training step's time goes: matmul, attention, norms and elementwise, optimizer, and host/idle.

From a torch.profiler trace of ``steps`` training steps whose optimizer calls run inside a
``record_function("optimizer")`` range: every device kernel is put in one bucket (kernels launched inside an
optimizer range, or named like an Adam kernel, are ``optimizer``; otherwise attention kernels by name, GEMMs
as ``matmul``, the rest as ``norms & elementwise``), summed and divided by the steps. The name rule covers
kernels whose launch the profiler cannot tie to the range (a Triton kernel launched through the driver API
has no launch time in the records: see
:func:`~cs336_systems.profiling.torch_profiler.kernel_records`). What remains of the measured step time is
``host / idle``: time the GPU waited for the host (launch-bound steps) or for synchronisation. Kernels of one
stream run one after another, so the buckets add up to the GPU's busy time.

A multi-GPU step overlaps communication with compute on other streams: :func:`overlapped_time_split` reads the
kernels' GPU times from a Chrome trace and counts communication only where it ran alone (exposed), the kernels of
marked host ranges (``recompute``, ``optimizer``) in buckets of their own, and the rest of the window as idle;
:func:`plot_time_split` draws splits side by side.
"""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.profiling.torch_profiler import classify_kernel

BUCKETS = ("matmul", "attention", "norms & elementwise", "optimizer", "host / idle")
#: Attention kernels: our FlashAttention-2 (Triton and Gluon), SDPA's flash / cuDNN / efficient backends.
_ATTENTION = re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*(mha|sdp)", re.IGNORECASE)
#: Optimizer kernels by name: FlatAdamW's ``adamw_kernel``, torch's ``FusedAdamMathFunctor`` (AdamW fused).
_OPTIMIZER = re.compile(r"adam", re.IGNORECASE)


def bucket(name: str) -> str:
    """The bucket of a kernel launched outside the optimizer."""
    if _ATTENTION.search(name):
        return "attention"
    return "matmul" if classify_kernel(name) == "matmul" else "norms & elementwise"


def step_time_split(records: pd.DataFrame, optimizer_intervals: list[tuple[float, float]], steps: int,
                    step_ms: float) -> pd.DataFrame:
    """Milliseconds per step in each of :data:`BUCKETS` (and their share of ``step_ms``) from kernel records
    (``name``, ``duration_us``, ``launch_us``: :func:`~cs336_systems.profiling.torch_profiler.kernel_records`)."""
    if steps < 1 or step_ms <= 0:
        raise ValueError(f"need steps >= 1 and step_ms > 0, got {steps}, {step_ms}")
    if records.empty:
        ms = dict.fromkeys(BUCKETS[:-1], 0.0)
    else:
        in_optimizer = pd.Series(False, index=records.index)
        for start, end in optimizer_intervals:
            in_optimizer |= records["launch_us"].between(start, end)
        in_optimizer |= records["name"].str.contains(_OPTIMIZER)
        kind = records["name"].map(bucket).where(~in_optimizer, "optimizer")
        ms = (records.groupby(kind)["duration_us"].sum() / 1e3 / steps).to_dict()
    row = {b: float(ms.get(b, 0.0)) for b in BUCKETS[:-1]}
    row["host / idle"] = max(step_ms - sum(row.values()), 0.0)
    table = pd.DataFrame({"bucket": list(row), "ms_per_step": list(row.values())})
    table["share"] = table["ms_per_step"] / step_ms
    return table




# --------------------------------------------------------------------------------------------------
# Steps whose communication overlaps compute (FSDP, DDP): from a Chrome trace with kernels' GPU times
# --------------------------------------------------------------------------------------------------

#: Where a multi-GPU step's time goes on one GPU: compute kernels by what they do (and recomputation, when its
#: host ranges are marked), communication only where no compute kernel ran beside it, and time no kernel ran.
OVERLAP_BUCKETS = ("matmul", "attention", "norms & elementwise", "recomputation", "optimizer",
                   "communication (exposed)", "idle")
#: Host ranges (``record_function`` names) whose kernels count in a bucket of their own, whatever their names.
RANGE_BUCKETS = {"recompute": "recomputation", "optimizer": "optimizer"}


def overlapped_time_split(trace: dict, steps: int, range_buckets: dict[str, str] | None = None) -> pd.DataFrame:
    """Milliseconds per step in each of :data:`OVERLAP_BUCKETS` from a Chrome trace (``torch.profiler``'s
    ``export_chrome_trace``) of ``steps`` steps, with each bucket's share of the profiled window.

    A compute kernel launched inside a host range named in ``range_buckets`` (default :data:`RANGE_BUCKETS`)
    goes to that range's bucket; otherwise it is bucketed by name (:func:`bucket`; Adam kernels are the
    optimizer's). Compute durations are summed (one compute stream). A communication kernel (NCCL, gloo) counts
    only for the time no compute kernel ran: what the step waited for. ``idle`` is the part of the window, from
    the first kernel's start to the last one's end, that no kernel covered: the GPU waiting for the host.
    """
    import numpy as np

    from cs336_systems.profiling.timeline import _COMM_KERNEL, _intersection, _length, _union

    if steps < 1:
        raise ValueError(f"need steps >= 1, got {steps}")
    ranges = RANGE_BUCKETS if range_buckets is None else range_buckets
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise ValueError("the trace has no GPU kernels (profile with ProfilerActivity.CUDA on a GPU)")
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    marked = {}  # range name -> disjoint (starts, ends) of its host ranges
    for name in ranges:
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") == "user_annotation" and e.get("name") == name]
        if spans:
            marked[name] = _union(np.array([s for s, _ in spans]), np.array([t for _, t in spans]))

    def kind(kernel: dict) -> str:
        name = kernel.get("name", "")
        if _COMM_KERNEL.search(name):
            return "comm"
        at = launched.get(kernel.get("args", {}).get("correlation"))
        if at is not None:
            for range_name, (starts, ends) in marked.items():
                i = int(np.searchsorted(starts, at, side="right")) - 1
                if i >= 0 and at <= ends[i]:
                    return ranges[range_name]
        return "optimizer" if _OPTIMIZER.search(name) else bucket(name)

    kinds = [kind(k) for k in kernels]
    start = np.array([float(k["ts"]) for k in kernels])
    end = start + np.array([float(k["dur"]) for k in kernels])
    is_comm = np.array([k == "comm" for k in kinds])
    compute, comm = _union(start[~is_comm], end[~is_comm]), _union(start[is_comm], end[is_comm])
    window = float(end.max() - start.min())
    us = dict.fromkeys(OVERLAP_BUCKETS, 0.0)
    for k, s, e in zip(kinds, start, end):
        if k != "comm":
            us[k] += float(e - s)
    us["communication (exposed)"] = _length(*comm) - _intersection(comm, compute)
    us["idle"] = window - _length(*_union(start, end))
    table = pd.DataFrame({"bucket": list(us), "ms_per_step": [v / 1e3 / steps for v in us.values()]})
    table["share"] = table["ms_per_step"] * steps * 1e3 / window
    table.attrs.update(window_ms=window / 1e3, steps=steps)
    return table


def plot_time_split(splits: dict[str, pd.DataFrame]):  # -> matplotlib Figure
    """One horizontal stacked bar per labelled split (:func:`overlapped_time_split`), ms per step by bucket."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.7 + 0.6 * len(splits)))
    colors = plt.get_cmap("tab10").colors
    for row, (label, table) in enumerate(splits.items()):
        left = 0.0
        for i, bucket_name in enumerate(OVERLAP_BUCKETS):
            ms = float(table.set_index("bucket")["ms_per_step"].get(bucket_name, 0.0))
            ax.barh(row, ms, left=left, color=colors[i % len(colors)], label=bucket_name if row == 0 else None)
            left += ms
    ax.set_yticks(range(len(splits)), list(splits))
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (one GPU)")
    ax.legend(ncols=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(splits) < 3 else -0.2))
    fig.tight_layout()
    return fig


__all__ = ["BUCKETS", "OVERLAP_BUCKETS", "RANGE_BUCKETS", "bucket", "overlapped_time_split", "plot_time_split",
           "step_time_split"]
