"""torch.profiler runs and per-kernel summary tables, filterable by annotated range.

:func:`profile_steps` profiles a few calls of a step function with NVTX/``record_function`` annotation
switched on, so the profile contains the ranges ``step``, ``forward``, ``backward``, ``optimizer`` (from
the benchmark loop) and ``attention (<impl>)``, ``computing attention scores``, ``computing softmax``,
``final matmul`` (from ``cs336_basics.model``).

:func:`kernel_records` flattens the profile into one row per device activity:

- with CUDA activity, one row per GPU kernel (and memcpy/memset), attributed to the CPU operator that
  launched it. A kernel belongs to a range when its *launch* happened inside the range on the host: the
  GPU runs asynchronously, so GPU timestamps of different ranges interleave, while launches do not.
  Backward kernels are launched from autograd's worker thread, still inside the host's ``backward`` range
  in time, so ranges are matched by time, not thread.
- without CUDA (a CPU-only run), one row per operator with its *self* CPU time, so the same tables can be
  built and tested on a laptop.

:func:`kernel_table` aggregates rows by name: calls, total and average time, and share of the selection.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_basics import nvtx


@contextlib.contextmanager
def annotations(enabled: bool = True) -> Iterator[None]:
    """Switch ``cs336_basics.nvtx`` ranges on (or off) for the duration of the block."""
    previous = nvtx.is_enabled()
    nvtx.set_enabled(enabled)
    try:
        yield
    finally:
        nvtx.set_enabled(previous)


def default_activities() -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


def profile_steps(
    step: Callable[[], Any],
    *,
    warmup: int = 1,
    steps: int = 1,
    activities: list[ProfilerActivity] | None = None,
    record_shapes: bool = False,
    with_stack: bool = False,
    profile_memory: bool = False,
) -> profile:
    """Run ``step`` ``warmup`` times unprofiled, then ``steps`` times under torch.profiler, each call in a
    ``step`` range. Annotation ranges are on throughout."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got {warmup}, {steps}")
    with annotations(True):
        for _ in range(warmup):
            step()
        _wait_for_gpu()
        with profile(
            activities=activities or default_activities(),
            record_shapes=record_shapes,
            with_stack=with_stack,
            profile_memory=profile_memory,
        ) as prof:
            for _ in range(steps):
                with record_function("step"):
                    step()
                _wait_for_gpu()
    return prof


def _wait_for_gpu() -> None:
    """Profiling sits below the benchmarking tools, so it waits for queued CUDA work itself; a process that
    never initialized CUDA has none queued, and asking would initialize it (in a forked CPU rank, an error)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _events(prof: Any) -> list[Any]:
    return list(prof.events()) if hasattr(prof, "events") else list(prof)


def _is_cpu(evt: Any) -> bool:
    return str(getattr(evt, "device_type", "DeviceType.CPU")).endswith("CPU")


def _is_annotation(evt: Any) -> bool:
    return bool(getattr(evt, "is_user_annotation", False)) or evt.name in _ANNOTATION_NAMES


# record_function scopes we (and the benchmark loop) open; excluded from CPU "kernel" rows in case an
# older torch does not flag them as user annotations.
_ANNOTATION_NAMES = {"step", "warmup", "measured", "forward", "backward", "optimizer"}


def kernel_records(prof: Any) -> pd.DataFrame:
    """One row per device activity: ``name``, ``duration_us``, ``launch_us`` (host time of the launching
    operator; NaN where the profiler could not link the kernel to one), ``device`` (``cuda`` or ``cpu``),
    ``op`` (launching operator). On a GPU the rows are reconciled with the GPU's activity records: each kernel
    the GPU ran appears exactly once."""
    events = _events(prof)
    cpu_ops = [e for e in events if _is_cpu(e) and not getattr(e, "is_async", False)]
    # With CUDA activity a record_function range also yields a GPU-side "user annotation" spanning its
    # kernels; it can be linked to the range like a kernel, so drop anything named like a range. Real
    # kernels linked to a range are kept: a kernel launched straight from Python (a Triton kernel, such as
    # FlatAdamW's inside the optimizer's range) has no operator around it, only the range.
    range_names_ = {e.name for e in cpu_ops if _is_annotation(e)}
    rows = [
        {"name": k.name, "duration_us": float(k.duration), "launch_us": e.time_range.start, "device": "cuda",
         "op": e.name}
        for e in cpu_ops
        for k in getattr(e, "kernels", [])
        if k.name not in range_names_
    ]
    device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA") and not _is_annotation(e)
              and e.name not in range_names_]
    if device:
        rows = _reconciled(rows, device)
    if not rows:  # CPU-only profile: operators' self time is the work
        rows = [
            {"name": e.name, "duration_us": float(e.self_cpu_time_total), "launch_us": e.time_range.start,
             "device": "cpu", "op": e.name}
            for e in cpu_ops
            if not _is_annotation(e) and e.self_cpu_time_total > 0
        ]
    return pd.DataFrame(rows, columns=["name", "duration_us", "launch_us", "device", "op"])


def _reconciled(linked: list[dict[str, Any]], device: list[Any]) -> list[dict[str, Any]]:
    """The linked kernel rows made to agree with the GPU's own activity records, kernel by kernel (same name
    and duration): a kernel linked to more than one operator is kept once, and a kernel linked to none (a
    launch the profiler could not tie to an operator) is added with an unknown launch time (``NaN``), so the
    table holds every kernel the GPU ran, each once."""
    from collections import Counter

    ran = Counter((e.name, float(e.time_range.end - e.time_range.start)) for e in device)
    kept = []
    for row in linked:
        key = (row["name"], row["duration_us"])
        if ran[key] > 0:
            ran[key] -= 1
            kept.append(row)
    unlinked = [{"name": name, "duration_us": us, "launch_us": float("nan"), "device": "cuda", "op": ""}
                for (name, us), n in ran.items() for _ in range(n)]
    return kept + unlinked


def range_intervals(prof: Any, pattern: str) -> list[tuple[float, float]]:
    """Host time intervals ``(start_us, end_us)`` of every annotated range whose name fully matches the
    regular expression ``pattern``."""
    rx = re.compile(pattern)
    return [
        (e.time_range.start, e.time_range.end)
        for e in _events(prof)
        if _is_cpu(e) and rx.fullmatch(e.name)
    ]


def range_names(prof: Any) -> list[str]:
    """Names of the annotated ranges present in a profile (for discovering what to filter by)."""
    return sorted({e.name for e in _events(prof) if _is_cpu(e) and _is_annotation(e)})


def select_within(records: pd.DataFrame, intervals: list[tuple[float, float]]) -> pd.DataFrame:
    """Rows whose launch time falls in any of ``intervals``."""
    if not intervals or records.empty:
        return records.iloc[0:0]
    inside = pd.Series(False, index=records.index)
    for start, end in intervals:
        inside |= records["launch_us"].between(start, end)
    return records[inside]


def kernel_table(
    prof_or_records: Any,
    within: str | None = None,
    *,
    per: int = 1,
    top: int | None = None,
) -> pd.DataFrame:
    """Per-kernel summary: ``name``, ``calls``, ``total_ms``, ``avg_us``, ``percent`` (of the selection's
    device time), ``category``, sorted by total time.

    ``within`` is a regular expression over range names (``"forward"``, ``"step"``, ``"attention.*"``);
    ``None`` keeps everything. ``per`` divides calls and totals, e.g. by the number of profiled steps to
    report "per step" numbers.
    """
    if isinstance(prof_or_records, pd.DataFrame):
        if within is not None:
            raise ValueError("filtering by range needs the profile itself, not its records")
        records = prof_or_records
    else:
        records = kernel_records(prof_or_records)
        if within is not None:
            records = select_within(records, range_intervals(prof_or_records, within))
    if per < 1:
        raise ValueError(f"per must be >= 1, got {per}")
    columns = ["name", "calls", "total_ms", "avg_us", "percent", "category"]
    if records.empty:
        return pd.DataFrame(columns=columns)
    table = (
        records.groupby("name", sort=False)["duration_us"]
        .agg(calls="count", total_us="sum")
        .reset_index()
    )
    table["avg_us"] = table["total_us"] / table["calls"]
    table["percent"] = 100 * table["total_us"] / table["total_us"].sum()
    table["calls"] = table["calls"] / per
    table["total_ms"] = table["total_us"] / 1e3 / per
    table["category"] = table["name"].map(classify_kernel)
    table = table.sort_values("total_ms", ascending=False, ignore_index=True)[columns]
    return table.head(top) if top else table


_CATEGORIES = [
    # order matters: first match wins
    ("matmul", r"gemm|cutlass|xmma|nvjet|wgmma|matmul|aten::(mm|bmm|addmm|matmul|linear)$|sm\d+_.*_(tn|nt|nn|tt)"),
    ("softmax", r"softmax"),
    ("reduction", r"reduce|amax|amin|\bsum\b|aten::(sum|mean|max|logsumexp)|norm"),
    ("copy", r"memcpy|memset|copy|aten::(copy_|to|_to_copy|contiguous|clone)"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|aten::(add|mul|sub|div|exp|silu|"
     r"masked_fill|where|neg|rsqrt|pow|addcmul|addcdiv|lerp|sqrt)"),
]


def classify_kernel(name: str) -> str:
    """A coarse category for a kernel or operator name: matmul, softmax, reduction, copy, elementwise or
    other. Matches cuBLAS/CUTLASS GEMM names, PyTorch's elementwise/reduce templates, Triton kernels from
    torch.compile (``triton_poi``/``triton_red``), and aten operator names on CPU."""
    lowered = name.lower()
    if lowered.startswith("triton_red") or lowered.startswith("triton_per"):
        return "reduction"
    for category, pattern in _CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def category_shares(table: pd.DataFrame) -> pd.Series:
    """Percent of selected device time per kernel category."""
    if table.empty:
        return pd.Series(dtype=float)
    return table.groupby("category")["percent"].sum().sort_values(ascending=False)


def export_chrome_trace(prof: profile, path: str | Path) -> Path:
    """Write the profile as a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


_KERNEL_PARTS = re.compile(r"\b(\w*Functor\w*|\w+_kernel\w*|\w+_sgemm\w*|\w*[Ss]oftmax\w*|\w*[Rr]educe\w*)\b")


_GENERIC_KERNEL_PARTS = {"gpu_kernel_impl_nocast", "gpu_kernel_impl", "BinaryFunctor", "AUnaryFunctor",
                         "BUnaryFunctor", "unrolled_elementwise_kernel", "vectorized_elementwise_kernel"}


def short_kernel(name: object, limit: int = 64) -> str:
    """A readable name for a demangled CUDA kernel: ``void at::native::elementwise_kernel<128, 2,
    …DivFunctor<float>…>(…)`` → ``elementwise_kernel<DivFunctor>``; long cuBLAS names are cut to
    ``limit`` characters. The full names stay in the CSV."""
    text = re.sub(r"^void\s+", "", str(name)).replace("(anonymous namespace)::", "")
    if "<" in text or "(" in text:
        head = text.split("<")[0].split("(")[0]
        base = head.split("::")[-1].strip() or head
        inner = [m for m in dict.fromkeys(_KERNEL_PARTS.findall(text[len(head):]))
                 if m != base and m not in _GENERIC_KERNEL_PARTS]
        text = f"{base}<{', '.join(inner[-2:])}>" if inner else base
    text = re.sub(r"_stage\d+_warpsize.*$", "", text)  # cuBLAS: keep arch, dtypes, layout and tile
    return text if len(text) <= limit else text[: limit - 1] + "…"
