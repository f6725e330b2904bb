"""The DDP benchmark's kernel timelines, written and read in one place: is the step GPU-bound or
host-bound, and what does launching communication *during* backward cost?

:func:`profile_timeline` reduces one profiled step to interval rows
``variant, lane, kind, name, start_ms, dur_ms`` (``kind`` = ``compute`` | ``comm`` | ``phase``; compute
kernels closer than 5 µs are merged into one row named ``"<n> kernels"``). From those rows:

- :func:`stream_summary` — per variant and phase, how long the GPU phase lasted and how much of it the
  compute stream was actually busy. A phase whose busy time is far below its span is *host-bound*:
  the GPU waits for the CPU to launch the next kernel, so any host work added inside that phase (gradient
  hooks, collective launches) lengthens the step one for one.
- :func:`launch_stalls` — for each communication kernel launched during backward: how long the compute
  stream had been idle before it started and how long after its start compute resumed. If compute
  resumed in step with the NCCL kernel's *end*, the GPU would be serialising the two streams; if the
  resume delay is unrelated to the kernel's duration, the stall is on the host.
- :func:`busy_by_kind` — over the whole step: the time the GPU ran compute, communication, both, and
  nothing; needs no host phases, so it also reads steps replayed from a CUDA graph.
- :func:`kernel_contention` — durations of the same named compute kernels (GEMMs) in different variants,
  split by whether a communication kernel was resident: the test for SM contention.
- :func:`gaps_around` — the idle time around chosen kernels (the gradient staging copies).
- :func:`backward_stretch` — from a step table: how much longer forward+backward got than in a reference
  variant (``flat``, whose communication starts after backward), per collective launched inside backward.

``python -m cs336_systems.benchmarking timeline`` prints all six for the committed H200 results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

DEFAULT_GEMM_PATTERN = r"gemm|nvjet|cutlass|xmma|sm90_|sm80_"
_MERGED = r"^\d+ kernels$"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Writing timelines: one profiled step -> interval rows (what the readers below take)
# --------------------------------------------------------------------------------------------------

_COMM_KERNEL = re.compile(r"nccl|gloo|all_?reduce|allreduce", re.IGNORECASE)
_PHASES = ("forward", "backward", "grad_sync", "optimizer")


def profile_timeline(step: Callable[[], Any], device: torch.device, label: str, *, export: bool = True,
                     merge_gap_us: float = 5.0) -> list[dict[str, Any]]:
    """Profile one step (after one more warm-up) and reduce its trace to intervals.

    Rows: ``variant, lane, kind, name, start_ms, dur_ms`` where ``lane`` is ``cuda:<stream>`` (or
    ``cpu:<thread>`` without CUDA) and ``kind`` is ``compute``, ``comm`` or ``phase`` (when the GPU ran
    ``forward``/``backward``/``grad_sync``/``optimizer``; the host ranges on CPU). Consecutive compute kernels on a stream are
    merged when separated by less than ``merge_gap_us``, which turns tens of thousands of kernels into a
    few hundred bars without changing the picture.
    """
    step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    if not export:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return trace_to_intervals(trace, label, merge_gap_us=merge_gap_us)


def _gpu_phase_spans(events: list[dict[str, Any]], kernels: list[dict[str, Any]],
                     host_phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """When the GPU ran each phase: the span of the *compute* kernels launched inside the phase's host
    range (launch → kernel via the trace's correlation ids).

    Host ranges alone mislead: the host runs ahead of the GPU, so the host's ``backward`` ends long before
    the GPU finishes it. Communication kernels are left out, or the hooks' all-reduces (launched during
    backward) would stretch the backward span over the communication they overlap with.
    """
    launched_at = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    spans = []
    for phase in host_phases:
        inside = [
            k for k in kernels
            if not _COMM_KERNEL.search(k.get("name", ""))
            and phase["start"] <= launched_at.get(k.get("args", {}).get("correlation"), float("-inf")) <= phase["end"]
        ]
        if inside:
            spans.append({"name": phase["name"], "start": min(float(k["ts"]) for k in inside),
                          "end": max(float(k["ts"]) + float(k["dur"]) for k in inside)})
    return spans


def trace_to_intervals(trace: dict[str, Any], label: str, *, merge_gap_us: float = 5.0) -> list[dict[str, Any]]:
    """Chrome-trace events → compact interval rows (see :func:`profile_timeline`)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_phases = [
        {"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])}
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") in _PHASES
    ]
    if kernels:
        work = [(f"cuda:{e.get('args', {}).get('stream', e.get('tid'))}", e) for e in kernels]
        phases = _gpu_phase_spans(events, kernels, host_phases)
    else:  # CPU-only: operators on each thread (backward and gloo's threads show up separately)
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        work = [(f"cpu:{e.get('tid')}", e) for e in ops]
        phases = host_phases
    all_ts = [e["ts"] for _, e in work] + [p["start"] for p in phases]
    if not all_ts:
        return []
    t0 = min(all_ts)
    rows: list[dict[str, Any]] = []
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for lane, e in work:
        by_lane.setdefault(lane, []).append(e)
    for lane, evs in by_lane.items():
        evs.sort(key=lambda e: e["ts"])
        current: dict[str, Any] | None = None
        for e in evs:
            kind = "comm" if _COMM_KERNEL.search(e.get("name", "")) else "compute"
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if kind == "compute" and current is not None and current["kind"] == "compute" and start - current["end"] <= merge_gap_us:
                current["end"] = max(current["end"], end)
                current["count"] += 1
                continue
            if current is not None:
                rows.append(current)
            current = {"lane": lane, "kind": kind, "name": e.get("name", "")[:60], "start": start, "end": end, "count": 1}
        if current is not None:
            rows.append(current)
    for p in phases:
        rows.append({"lane": "phase", "kind": "phase", "name": p["name"], "start": p["start"], "end": p["end"], "count": 1})
    return [
        {"variant": label, "lane": r["lane"], "kind": r["kind"], "name": r["name"] if r["count"] == 1 else f"{r['count']} kernels",
         "start_ms": (r["start"] - t0) / 1e3, "dur_ms": (r["end"] - r["start"]) / 1e3}
        for r in sorted(rows, key=lambda r: (r["lane"], r["start"]))
    ]


def plot_timeline(df: Any, variants: list[str] | None = None) -> Any:
    """One panel per variant: phases (forward, backward, ...) on top, each stream's kernels below
    (compute grey, communication red)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    variants = variants or list(dict.fromkeys(df["variant"]))
    fig, axes = plt.subplots(len(variants), 1, figsize=(12, 1.6 + 1.1 * len(variants) * 2), squeeze=False)
    colors = {"compute": "#7f7f7f", "comm": "#d62728"}
    phase_colors = {"forward": "#1f77b4", "backward": "#2ca02c", "grad_sync": "#ff7f0e", "optimizer": "#9467bd"}
    for ax, v in zip(axes[:, 0], variants):
        sub = df[df["variant"] == v]
        lanes = ["phase"] + sorted(ln for ln in sub["lane"].unique() if ln != "phase")
        for y, lane in enumerate(lanes):
            part = sub[sub["lane"] == lane]
            if lane == "phase":
                for _, r in part.iterrows():
                    ax.broken_barh([(r.start_ms, r.dur_ms)], (y - 0.4, 0.8), color=phase_colors.get(r["name"], "k"), alpha=0.6)
            else:
                for kind, grp in part.groupby("kind"):
                    ax.broken_barh(list(zip(grp.start_ms, grp.dur_ms)), (y - 0.4, 0.8), color=colors.get(kind, "k"))
        ax.set_yticks(range(len(lanes)), [_lane_label(lane, sub[sub["lane"] == lane]) for lane in lanes])
        ax.invert_yaxis()
        ax.set_title(v, loc="left", fontsize=10)
        ax.set_xlabel("time since step start (ms)")
    handles = [Patch(color=c, label=k) for k, c in {**phase_colors, **{"GPU compute": colors["compute"], "communication": colors["comm"]}}.items()]
    fig.legend(handles=handles, loc="upper right", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _lane_label(lane: str, rows: Any) -> str:
    """A lane named by what ran on it (``cuda:7`` → ``compute (stream 7)``, ``NCCL (stream 20)``): the stream
    ids alone mean nothing to a reader, and differ between runs."""
    if lane == "phase":
        return "phase"
    where, _, ident = lane.partition(":")
    kinds = set(rows["kind"])
    what = "NCCL" if kinds == {"comm"} else "compute" if "comm" not in kinds else "compute + NCCL"
    return f"{what} ({'stream' if where == 'cuda' else 'thread'} {ident})"


def overlap_summary(df: Any) -> Any:
    """Per variant: communication kernel time, and how much of it ran during the backward phase."""
    import pandas as pd

    out = []
    for v, sub in df.groupby("variant", sort=False):
        comm = sub[sub["kind"] == "comm"]
        bwd = sub[(sub["kind"] == "phase") & (sub["name"] == "backward")]
        total = float(comm["dur_ms"].sum())
        overlapped = 0.0
        for _, b in bwd.iterrows():
            lo, hi = b.start_ms, b.start_ms + b.dur_ms
            overlapped += float((comm.start_ms + comm.dur_ms).clip(upper=hi).sub(comm.start_ms.clip(lower=lo)).clip(lower=0).sum())
        out.append({"variant": v, "comm_kernels": len(comm), "comm_ms": total, "comm_during_backward_ms": overlapped})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------------------------------
# Reading timelines
# --------------------------------------------------------------------------------------------------


def _phases(sub: pd.DataFrame) -> dict[str, tuple[float, float]]:
    ph = sub[sub["kind"] == "phase"]
    return {r["name"]: (float(r["start_ms"]), float(r["start_ms"] + r["dur_ms"])) for _, r in ph.iterrows()}


def _backward_windows(tl: pd.DataFrame) -> Iterator[tuple[str, pd.DataFrame, tuple[float, float]]]:
    """``(variant, its rows, (start, end) of its backward phase)`` for every variant that has one."""
    for variant, sub in tl.groupby("variant", sort=False):
        phases = _phases(sub)
        if "backward" in phases:
            yield variant, sub, phases["backward"]


def busy_ms(intervals: pd.DataFrame, lo: float, hi: float) -> float:
    """Time within ``[lo, hi)`` covered by ``intervals`` (rows of one stream, which do not overlap)."""
    start = intervals["start_ms"].clip(lower=lo)
    end = (intervals["start_ms"] + intervals["dur_ms"]).clip(upper=hi)
    return float((end - start).clip(lower=0).sum())


def _check(tl: pd.DataFrame) -> None:
    missing = {"variant", "lane", "kind", "name", "start_ms", "dur_ms"} - set(tl.columns)
    if missing:
        raise ValueError(f"not a timeline table (missing columns {sorted(missing)})")


def stream_summary(tl: pd.DataFrame) -> pd.DataFrame:
    """Per variant and GPU phase: span, compute-stream busy time, idle fraction; plus the communication
    kernels' count and total time inside the phase."""
    _check(tl)
    rows = []
    for variant, sub in tl.groupby("variant", sort=False):
        compute, comm = sub[sub["kind"] == "compute"], sub[sub["kind"] == "comm"]
        for phase, (lo, hi) in _phases(sub).items():
            busy = busy_ms(compute, lo, hi)
            inside = comm[(comm["start_ms"] >= lo) & (comm["start_ms"] < hi)]
            rows.append({
                "variant": variant, "phase": phase, "span_ms": hi - lo, "compute_busy_ms": busy,
                "idle_fraction": 1 - busy / (hi - lo) if hi > lo else float("nan"),
                "comm_kernels": len(inside), "comm_kernel_ms": float(inside["dur_ms"].sum()),
                "comm_kernel_median_us": float(inside["dur_ms"].median() * 1e3) if len(inside) else float("nan"),
            })
    return pd.DataFrame(rows)


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint intervals covering the same time as ``[starts, ends)`` (which may overlap)."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts)
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]  # an interval starts a new group after a gap
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _length(s: np.ndarray, e: np.ndarray) -> float:
    return float((e - s).sum())


def _intersection(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Total time covered by both of two disjoint, sorted interval sets."""
    total, i, j = 0.0, 0, 0
    (as_, ae), (bs, be) = a, b
    while i < len(as_) and j < len(bs):
        total += max(0.0, min(ae[i], be[j]) - max(as_[i], bs[j]))
        if ae[i] < be[j]:
            i += 1
        else:
            j += 1
    return total


def busy_by_kind(tl: pd.DataFrame) -> pd.DataFrame:
    """Per variant, over its whole profiled step (every stream): how long the GPU ran compute kernels,
    communication kernels, both at once, and nothing.

    This needs no host phases, so it also reads steps replayed from a CUDA graph, where the question is
    no longer host launches but what the collectives cost the GPU: if ``compute_ms`` exceeds the
    single-GPU step's, compute ran slower beside the collectives (SM and memory contention); ``idle_ms``
    is time the GPU waited, e.g. for the last all-reduce before the optimizer step.
    """
    _check(tl)
    rows = []
    for variant, sub in tl.groupby("variant", sort=False):
        kernels = sub[sub["kind"].isin(("compute", "comm"))]
        if kernels.empty:
            continue
        start = kernels["start_ms"].to_numpy(float)
        end = start + kernels["dur_ms"].to_numpy(float)
        is_comm = (kernels["kind"] == "comm").to_numpy()
        compute, comm, anything = _union(start[~is_comm], end[~is_comm]), _union(start[is_comm], end[is_comm]), _union(start, end)
        span = float(end.max() - start.min())
        rows.append({"variant": variant, "span_ms": span, "compute_ms": _length(*compute), "comm_ms": _length(*comm),
                     "both_ms": _intersection(compute, comm), "idle_ms": span - _length(*anything),
                     "comm_kernels": int(is_comm.sum())})
    return pd.DataFrame(rows)


def launch_stalls(tl: pd.DataFrame) -> pd.DataFrame:
    """Per variant, over the communication kernels that start during backward: the compute stream's idle
    time before each (``idle_before_us``: previous compute end → comm start), the delay until compute
    resumed (``resume_after_us``: comm start → next compute start), the compute gap around each launch,
    and the correlation of the resume delay with the comm kernel's duration (≈ 1: the GPU serialises the
    streams; ≈ 0: the delay comes from the host)."""
    _check(tl)
    rows = []
    for variant, sub, (lo, hi) in _backward_windows(tl):
        compute = sub[sub["kind"] == "compute"].sort_values("start_ms")
        comm = sub[(sub["kind"] == "comm") & (sub["start_ms"] >= lo) & (sub["start_ms"] < hi)]
        if comm.empty or compute.empty:
            continue
        cs = compute["start_ms"].to_numpy()
        ce = cs + compute["dur_ms"].to_numpy()
        s = comm["start_ms"].to_numpy()
        d = comm["dur_ms"].to_numpy()
        j = np.searchsorted(cs, s)  # first compute kernel starting at or after each comm kernel
        valid = (j > 0) & (j < len(cs))
        idle_before = s[valid] - ce[j[valid] - 1]
        resume_after = cs[j[valid]] - s[valid]
        varies = valid.sum() > 2 and np.std(d[valid]) > 0 and np.std(resume_after) > 0
        corr = float(np.corrcoef(resume_after, d[valid])[0, 1]) if varies else float("nan")
        rows.append({
            "variant": variant, "comm_kernels_in_backward": int(len(s)),
            "idle_before_us_median": float(np.median(idle_before) * 1e3) if valid.any() else float("nan"),
            "resume_after_us_median": float(np.median(resume_after) * 1e3) if valid.any() else float("nan"),
            "compute_gap_us_median": float(np.median(idle_before + resume_after) * 1e3) if valid.any() else float("nan"),
            "compute_gap_ms_total": float(np.clip(idle_before, 0, None).sum() + resume_after.sum()),
            "corr_resume_vs_comm_duration": corr,
        })
    return pd.DataFrame(rows)


def kernel_contention(tl: pd.DataFrame, pattern: str = DEFAULT_GEMM_PATTERN) -> pd.DataFrame:
    """Backward-phase compute kernels whose (unmerged) name matches ``pattern``: per variant and
    whether a communication kernel overlapped them, their count and median duration."""
    _check(tl)
    parts = []
    for variant, sub, (lo, hi) in _backward_windows(tl):
        k = sub[(sub["kind"] == "compute") & ~sub["name"].str.match(_MERGED) & sub["name"].str.contains(pattern, case=False)
                & (sub["start_ms"] >= lo) & (sub["start_ms"] < hi)].copy()
        comm = sub[sub["kind"] == "comm"]
        c0, c1 = comm["start_ms"].to_numpy(), (comm["start_ms"] + comm["dur_ms"]).to_numpy()
        k["with_comm"] = [bool(((c0 < b) & (c1 > a)).any()) for a, b in zip(k["start_ms"], k["start_ms"] + k["dur_ms"])]
        parts.append(k)
    if not parts:
        return pd.DataFrame(columns=["variant", "with_comm", "kernels", "median_us"])
    k = pd.concat(parts)
    out = k.groupby(["variant", "with_comm"], sort=False)["dur_ms"].agg(kernels="size", median_us="median").reset_index()
    out["median_us"] *= 1e3
    return out


def gaps_around(tl: pd.DataFrame, pattern: str = r"^Memcpy DtoD") -> pd.DataFrame:
    """Per variant, the backward-phase compute-stream kernels whose name matches ``pattern`` (default:
    device-to-device copies, which is how the gradient staging copies into bucket buffers appear) and
    the idle gaps just before and after them — in a host-bound phase, the host time spent around them."""
    _check(tl)
    rows = []
    for variant, sub, (lo, hi) in _backward_windows(tl):
        c = sub[(sub["kind"] == "compute") & (sub["start_ms"] >= lo) & (sub["start_ms"] < hi)].sort_values("start_ms")
        end = c["start_ms"] + c["dur_ms"]
        before, after = c["start_ms"] - end.shift(), c["start_ms"].shift(-1) - end
        hit = c["name"].str.contains(pattern, regex=True).to_numpy()
        rows.append({"variant": variant, "kernels": int(hit.sum()),
                     "gap_before_us_median": float(before[hit].median() * 1e3) if hit.any() else float("nan"),
                     "gap_after_us_median": float(after[hit].median() * 1e3) if hit.any() else float("nan"),
                     "gaps_ms_total": float(before[hit].clip(lower=0).sum() + after[hit].clip(lower=0).sum())})
    return pd.DataFrame(rows)


def backward_stretch(steps: pd.DataFrame, reference: str = "flat") -> pd.DataFrame:
    """Per overlapping variant of a step table: forward+backward time minus ``reference``'s, and that
    excess per collective launched during backward (``num_buckets``; torch DDP's count is not recorded)."""
    if reference not in set(steps["variant"]):
        raise ValueError(f"reference variant {reference!r} not in the table")
    ref = float(steps.loc[steps["variant"] == reference, "fwd_bwd_ms"].iloc[0])
    out = steps[["variant", "num_buckets", "step_ms", "step_ms_std", "fwd_bwd_ms"]].copy()
    out["fwd_bwd_excess_ms"] = out["fwd_bwd_ms"] - ref
    overlapping = out["variant"].str.startswith(("individual", "bucketed"))
    out["excess_per_collective_us"] = np.where(overlapping, out["fwd_bwd_excess_ms"] / out["num_buckets"] * 1e3, np.nan)
    return out


def paired_ratios(runs: dict[str, pd.DataFrame], reference: str = "torch") -> pd.DataFrame:
    """Our variants against ``reference`` *within* each run (one process, variants timed one after the
    other), since in a host-bound regime the same variant moves by tens of percent between processes.

    One row per run and variant of ours (any of :data:`~cs336_systems.distributed.strategies.STRATEGIES`): the step times
    (mean and median), their ratios to the reference's, and ``ours_first`` (whether ours was timed before
    the reference in that process), so that an effect of the position in the run can be told apart.
    Each variant is paired with the reference of the same gradient wire format (``comm_dtype``: torch's
    bf16 compress hook for ours with a bf16 wire) and the same ``cuda_graph`` setting, and with the
    single-GPU row of that setting.
    """
    from cs336_systems.distributed.strategies import STRATEGIES

    rows = []
    for run, steps in runs.items():
        steps = steps.reset_index(drop=True)
        graphed = steps["cuda_graph"].fillna(False).astype(bool) if "cuda_graph" in steps else pd.Series(False, index=steps.index)
        wire = steps["comm_dtype"].fillna("fp32") if "comm_dtype" in steps else pd.Series("fp32", index=steps.index)
        for pos, r in steps.iterrows():
            if str(r["mode"]) not in STRATEGIES:
                continue
            same = graphed == graphed[pos]
            ref_rows = steps.index[same & (wire == wire[pos]) & (steps["mode"] == reference)]
            if not len(ref_rows):
                continue
            ref_pos = int(ref_rows[0])
            ref = steps.loc[ref_pos]
            single = steps.loc[same & (steps["mode"] == "single"), "step_ms"]
            rows.append({"run": run, "variant": r["variant"], "cuda_graph": bool(graphed[pos]),
                         "num_buckets": r.get("num_buckets"),
                         "single_ms": float(single.iloc[0]) if len(single) else float("nan"),
                         "reference_ms": float(ref["step_ms"]), "ours_ms": float(r["step_ms"]),
                         "ratio_mean": float(r["step_ms"] / ref["step_ms"]),
                         "ratio_median": float(r["step_ms_median"] / ref["step_ms_median"]),
                         "ours_first": bool(pos < ref_pos)})
    return pd.DataFrame(rows, columns=["run", "variant", "cuda_graph", "num_buckets", "single_ms", "reference_ms",
                                       "ours_ms", "ratio_mean", "ratio_median", "ours_first"])


def load_runs(prefix: str, section: str = "ddp_benchmark", preset: str = "xl", autocast: str = "bf16") -> dict[str, pd.DataFrame]:
    """Every step table ``<prefix>*_<preset>_<autocast>`` of ``figures/<section>/`` (tables without the
    step columns, such as timelines and all-reduce or overhead-model fits, left out), by name."""
    from cs336_systems.results import FIGURES_DIR, load_table, section_dir

    suffix = f"_{preset}_{autocast}"
    names = sorted(p.stem for p in section_dir(section, FIGURES_DIR).glob(f"{prefix}*{suffix}.csv"))
    tables = {n[: -len(suffix)]: load_table(section, n, FIGURES_DIR) for n in names}
    # Step tables only: timelines, overlap, all-reduce and overhead-model tables share the prefix.
    return {n: t for n, t in tables.items() if {"variant", "mode", "step_ms"} <= set(t.columns)}


def analyse(section: str = "ddp_benchmark", preset: str = "xl", name: str = "steps") -> dict[str, pd.DataFrame]:
    """All six analyses of the committed ``figures/<section>/`` results, fp32 and bf16 side by side.
    ``name`` is the benchmark's ``--name`` (its tables are ``<name>_<preset>_<autocast>`` and, for other
    names than ``steps``, ``<name>_timeline_<preset>_<autocast>``)."""
    from cs336_systems.results import FIGURES_DIR, has_result, load_table

    frames: dict[str, list[pd.DataFrame]] = {"streams": [], "stalls": [], "copies": [], "contention": [], "by_kind": [],
                                             "stretch": []}
    for autocast in ("fp32", "bf16"):
        tag = f"{preset}_{autocast}"
        timeline = f"timeline_{tag}" if name == "steps" else f"{name}_timeline_{tag}"
        if has_result(section, timeline, FIGURES_DIR):
            tl = load_table(section, timeline, FIGURES_DIR)
            for key, fn in (("streams", stream_summary), ("stalls", launch_stalls), ("copies", gaps_around),
                            ("contention", kernel_contention), ("by_kind", busy_by_kind)):
                frames[key].append(fn(tl).assign(autocast=autocast))
        steps = load_table(section, f"{name}_{tag}", FIGURES_DIR) if has_result(section, f"{name}_{tag}", FIGURES_DIR) else None
        if steps is not None and "flat" in set(steps["variant"]):
            frames["stretch"].append(backward_stretch(steps).assign(autocast=autocast))
    return {k: pd.concat(v, ignore_index=True) for k, v in frames.items() if v}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking timeline --help``."""
    parser.add_argument("--section", default="ddp_benchmark")
    parser.add_argument("--preset", default="xl")
    parser.add_argument("--name", default="steps", help="the benchmark run's --name")
    parser.add_argument("--ratios", metavar="PREFIX",
                        help="instead: ours vs torch DDP within each run whose table name starts with PREFIX")
    parser.add_argument("--autocast", default="bf16", help="with --ratios: which runs (fp32 or bf16)")


def run_command(args: argparse.Namespace) -> int:
    if args.ratios is not None:
        ratios = paired_ratios(load_runs(args.ratios, args.section, args.preset, args.autocast))
        print(ratios.to_markdown(index=False, floatfmt=".3g"))
        summary = ratios.groupby(["variant", "ours_first"])[["ratio_mean", "ratio_median"]].agg(["median", "min", "max", "size"])
        print("\n" + summary.to_markdown(floatfmt=".3g"))
        return
    for name, df in analyse(args.section, args.preset, args.name).items():
        print(f"\n## {name}\n")
        print(df.to_markdown(index=False, floatfmt=".3g"))
    return 0

