"""Did each FSDP all-gather arrive before the compute stream needed it? Read from a kernel timeline.

Our FSDP launches layer ``k+1``'s all-gather on NCCL's stream when layer ``k`` starts; the compute stream
waits for it only when layer ``k+1`` begins. On the GPU a gather that arrives late shows as the compute
stream running dry and resuming the moment the gather's kernel ends; a gather in time ends while compute
is still busy with earlier layers. The rows are those of :func:`cs336_systems.profiling.timeline.profile_timeline`
(``variant, lane, kind, name, start_ms, dur_ms``; compute kernels closer than 5 µs merged), so the same
reading works on any profiled step.

- :func:`gather_waits` — one row per all-gather kernel that starts in a phase (``forward`` by default):
  when it ended, whether compute was busy then, and how long compute waited for it.
- :func:`gather_summary` — per variant and phase: the phase's GPU span, the gathers' kernel time and how
  much of it ran beside compute, the gathers compute waited for, and the total and longest wait.
- :func:`align_ranks` and :func:`peer_waits` — with one variant per rank: every rank on rank 0's clock, and
  which part of each gather's kernel time was spent waiting inside NCCL for the other ranks to arrive.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pandas as pd

from cs336_systems.profiling.timeline import _check, _intersection, _length, _phases, _union

GATHER_KERNEL = re.compile(r"all_?gather", re.IGNORECASE)

#: A compute stream that resumes within this long after a gather ends is taken to have waited for it.
RESUME_US = 30.0


def _compute(sub: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    rows = sub[(sub["kind"] == "compute") & ~sub["name"].str.contains(GATHER_KERNEL)]
    start = rows["start_ms"].to_numpy(float)
    return _union(start, start + rows["dur_ms"].to_numpy(float))


def _windows(tl: pd.DataFrame, phase: str) -> Iterator[tuple[str, pd.DataFrame, float, float, np.ndarray, np.ndarray]]:
    """``(variant, its rows, phase start, phase end, compute starts, compute ends)`` per variant with ``phase``."""
    _check(tl)
    for variant, sub in tl.groupby("variant", sort=False):
        window = _phases(sub).get(phase)
        if window is not None:
            yield (variant, sub, *window, *_compute(sub))


def gather_waits(tl: pd.DataFrame, phase: str = "forward", resume_us: float = RESUME_US) -> pd.DataFrame:
    """Per all-gather kernel starting inside ``phase`` (per variant): ``start_ms``, ``end_ms``,
    ``dur_ms``, ``compute_busy_at_end`` (a compute kernel was running when it ended: in time),
    ``waited_ms`` (compute idle from its last kernel until the gather ended, counted only when compute
    resumed within ``resume_us`` of that end; otherwise the idle time had another cause, such as the host,
    and the gather counts as in time) and ``late`` (``waited_ms > 0``)."""
    if resume_us < 0:
        raise ValueError(f"resume_us must be >= 0, got {resume_us}")
    rows = []
    for variant, sub, lo, hi, cs, ce in _windows(tl, phase):
        gathers = sub[sub["name"].str.contains(GATHER_KERNEL) & (sub["kind"] != "phase")]
        gathers = gathers[(gathers["start_ms"] >= lo) & (gathers["start_ms"] < hi)].sort_values("start_ms")
        for i, g in enumerate(gathers.itertuples()):
            end = g.start_ms + g.dur_ms
            busy = bool(((cs < end) & (end < ce)).any())  # a kernel starting exactly then was waiting
            waited = 0.0
            if not busy:
                after = cs[cs >= end]
                before = ce[ce <= end]
                if len(after) and (after.min() - end) * 1e3 <= resume_us:
                    waited = end - (before.max() if len(before) else lo)
            rows.append({"variant": variant, "phase": phase, "gather": i, "start_ms": g.start_ms, "end_ms": end,
                         "dur_ms": g.dur_ms, "compute_busy_at_end": busy, "waited_ms": max(waited, 0.0),
                         "late": waited > 0})
    return pd.DataFrame(rows, columns=["variant", "phase", "gather", "start_ms", "end_ms", "dur_ms",
                                       "compute_busy_at_end", "waited_ms", "late"])


def gather_summary(tl: pd.DataFrame, phase: str = "forward", resume_us: float = RESUME_US) -> pd.DataFrame:
    """Per variant: ``span_ms`` (the phase on the GPU), ``compute_ms`` (compute kernels' busy time in it),
    ``gathers``, ``gather_ms`` (their kernel time), ``gather_beside_compute_ms`` (of it, while compute ran),
    ``late_gathers``, ``wait_ms`` (total compute wait for gathers) and ``max_wait_ms``."""
    waits = gather_waits(tl, phase, resume_us)
    rows = []
    for variant, _, lo, hi, cs, ce in _windows(tl, phase):
        cs, ce = np.clip(cs, lo, hi), np.clip(ce, lo, hi)
        w = waits[waits["variant"] == variant]
        gs = w["start_ms"].to_numpy(float)
        gathers = _union(gs, w["end_ms"].to_numpy(float))
        rows.append({"variant": variant, "phase": phase, "span_ms": hi - lo, "compute_ms": _length(cs, ce),
                     "gathers": len(w), "gather_ms": float(w["dur_ms"].sum()),
                     "gather_beside_compute_ms": _intersection((cs, ce), gathers),
                     "late_gathers": int(w["late"].sum()), "wait_ms": float(w["waited_ms"].sum()),
                     "max_wait_ms": float(w["waited_ms"].max()) if len(w) else 0.0})
    return pd.DataFrame(rows)


def _gathers(sub: pd.DataFrame) -> pd.DataFrame:
    return sub[sub["name"].str.contains(GATHER_KERNEL) & (sub["kind"] != "phase")].sort_values("start_ms")


def align_ranks(tl: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every variant's rows (one variant per rank, the first being rank 0) moved onto the first one's clock.

    Each rank's profile counts from its own first event, and the ranks' clocks are not compared. A collective
    ends on every rank at nearly the same moment (the last bytes arrive), however early a rank entered it, so
    the median difference of the all-gathers' ends is the offset between two ranks' clocks. Returns the moved
    rows and, per variant, ``offset_ms`` and ``residual_us`` (the largest end mismatch left after the move:
    how far the reading can be trusted). The ranks must have run the same number of all-gathers."""
    _check(tl)
    variants = list(dict.fromkeys(tl["variant"]))
    ends = {v: (lambda g: (g["start_ms"] + g["dur_ms"]).to_numpy(float))(_gathers(tl[tl["variant"] == v]))
            for v in variants}
    if not variants or not len(ends[variants[0]]):
        raise ValueError("align_ranks needs all-gather kernels in the first variant's timeline")
    counts = {v: len(e) for v, e in ends.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"the ranks ran different numbers of all-gathers: {counts}")
    moved, rows = tl.copy(), []
    for v in variants:
        offset = float(np.median(ends[variants[0]] - ends[v]))
        moved.loc[moved["variant"] == v, "start_ms"] += offset
        rows.append({"variant": v, "offset_ms": offset,
                     "residual_us": float(np.abs(ends[variants[0]] - ends[v] - offset).max()) * 1e3})
    return moved, pd.DataFrame(rows)


def peer_waits(tl: pd.DataFrame, phase: str = "forward") -> pd.DataFrame:
    """Per all-gather of ``phase`` and rank, on a timeline already on one clock (:func:`align_ranks`):
    ``start_ms``, ``dur_ms``, ``peer_wait_ms`` (from its start until the last rank's kernel started: an NCCL
    kernel that starts first spins until its peers arrive), ``last`` (this rank arrived last) and
    ``transfer_ms`` (the last arrival's kernel time, the gather with no waiting in it). Gathers are numbered over
    the whole step on every rank (the ranks issue the same collectives in the same order) and the phase's are
    those that start inside the first variant's (rank 0's) phase: pairing them within each rank's own window
    would pair different gathers wherever a window's edge falls between two of them."""
    columns = ["variant", "gather", "start_ms", "dur_ms", "peer_wait_ms", "last", "transfer_ms"]
    windows = {variant: (lo, hi) for variant, _, lo, hi, _, _ in _windows(tl, phase)}
    variants = list(dict.fromkeys(tl["variant"]))
    if not variants or variants[0] not in windows:
        return pd.DataFrame(columns=columns)
    per = {v: _gathers(tl[tl["variant"] == v]) for v in variants}
    counts = {v: len(g) for v, g in per.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"the ranks ran different numbers of all-gathers: {counts}")
    lo, hi = windows[variants[0]]
    first = per[variants[0]]["start_ms"].to_numpy(float)
    picked = np.flatnonzero((first >= lo) & (first < hi))
    if not len(picked):
        return pd.DataFrame(columns=columns)
    starts = np.stack([g["start_ms"].to_numpy(float)[picked] for g in per.values()])  # (ranks, gathers)
    durs = np.stack([g["dur_ms"].to_numpy(float)[picked] for g in per.values()])
    last = starts.argmax(axis=0)
    transfer = durs[last, np.arange(len(picked))]
    rows = [{"variant": v, "gather": i, "start_ms": starts[r, i], "dur_ms": durs[r, i],
             "peer_wait_ms": float(np.clip(starts[last[i], i] - starts[r, i], 0.0, durs[r, i])),
             "last": bool(last[i] == r), "transfer_ms": float(transfer[i])}
            for r, v in enumerate(per) for i in range(len(picked))]
    return pd.DataFrame(rows, columns=columns)


def peer_summary(tl: pd.DataFrame, phase: str = "forward") -> pd.DataFrame:
    """Per rank (variant): ``peer_wait_ms`` (its gathers' time waiting for the other ranks), ``arrived_last``
    (gathers it was the last to reach) and ``transfer_ms`` (the gathers' time with no waiting, the same on every
    rank), from :func:`peer_waits`."""
    w = peer_waits(tl, phase)
    if w.empty:
        return pd.DataFrame(columns=["variant", "peer_wait_ms", "arrived_last", "transfer_ms"])
    transfer = float(w.drop_duplicates("gather")["transfer_ms"].sum())
    return (w.groupby("variant", sort=False).agg(peer_wait_ms=("peer_wait_ms", "sum"), arrived_last=("last", "sum"))
            .reset_index().assign(transfer_ms=transfer))


def zoom_window(tl: pd.DataFrame, gathers: int = 14, phase: str = "forward") -> tuple[float, float] | None:
    """A window of the first variant's ``phase`` around ``gathers`` consecutive all-gathers from its middle (14: two
    Transformer blocks' seven weights each), from the first's start to the last's end, widened by a tenth on each
    side; None without that many gathers. A whole step's plot cannot show 80-µs gathers beside the kernels they
    should hide behind; this window can, as Nsight's zoom would."""
    if isinstance(gathers, bool) or not isinstance(gathers, int) or gathers < 1:
        raise ValueError(f"zoom_window: gathers must be an integer >= 1, got {gathers!r}")
    for _, sub, start, end, _, _ in _windows(tl, phase):
        inside = _gathers(sub)
        inside = inside[(inside["start_ms"] >= start) & (inside["start_ms"] < end)]
        if len(inside) < gathers:
            return None
        first = (len(inside) - gathers) // 2
        chosen = inside.iloc[first:first + gathers]
        lo, hi = float(chosen["start_ms"].iloc[0]), float((chosen["start_ms"] + chosen["dur_ms"]).max())
        margin = 0.1 * (hi - lo)
        return lo - margin, hi + margin
    return None
