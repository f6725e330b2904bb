"""CUDA memory snapshots, and their offline analysis.

Recording: :func:`record_memory_snapshot` runs a step under
``torch.cuda.memory._record_memory_history(max_entries=1_000_000)`` and dumps the allocator's history with
``_dump_snapshot`` (a pickle that https://pytorch.org/memory_viz also reads).

Analysis works on the snapshot dict alone, so it runs anywhere (CPU CI included):

- :func:`allocation_events` turns ``device_traces`` into a table of ``alloc`` / ``free_completed`` events,
  each with the first frames of its Python stack that belong to user code;
- :func:`active_memory_timeline` integrates them into the memory in use after every event, split into
  the largest origins (the memory_viz "Active Memory Timeline", grouped by source line instead of drawn one
  block at a time), and :func:`plot_active_memory_timeline` renders it as a stacked area plot;
- :func:`largest_allocations` lists the biggest blocks with their size, lifetime and origin.

Memory that was already allocated when recording started has no ``alloc`` event; it is inferred from the
segments' active blocks at dump time and drawn as the "allocated before recording" band at the bottom.
"""

from __future__ import annotations

import os
import pickle
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

_ALLOC, _FREE = "alloc", "free_completed"
BEFORE_RECORDING = "allocated before recording"
OTHER = "other"
#: Allocations with no Python frame on their stack: made inside autograd's backward or optimizer C++ code.
NO_USER_FRAME = "(no user frame)"


# --------------------------------------------------------------------------------------------------
# Recording (CUDA only)
# --------------------------------------------------------------------------------------------------


def record_memory_snapshot(
    step: Callable[[], Any],
    path: str | Path | None = None,
    *,
    warmup: int = 1,
    steps: int = 1,
    max_entries: int = 1_000_000,
) -> dict[str, Any]:
    """Run ``step`` ``warmup`` times, then record the allocator's history over ``steps`` calls.

    Returns the snapshot dict with an extra ``"summary"`` entry: peak allocated bytes during the recorded
    steps, bytes allocated before them, and the ``path`` of the pickle (written only when ``path`` is given;
    such files are large, so keep them out of version control).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory snapshots record the CUDA caching allocator and need a CUDA device")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    except TypeError:  # a torch without the ``stacks`` keyword
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    snapshot["summary"] = {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "allocated_before_bytes": before,
        "path": str(path) if path is not None else None,
    }
    return snapshot


def load_snapshot(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


# --------------------------------------------------------------------------------------------------
# Stack frames
# --------------------------------------------------------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.normpath(p)
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
              str(Path(torch.__file__).parent)}
)


def is_user_frame(frame: dict[str, Any]) -> bool:
    """True for a Python frame of the program being profiled, False for torch, the standard library,
    site-packages (except editable installs of our own packages) and C++ frames."""
    filename = str(frame.get("filename", ""))
    if not filename.endswith(".py") or filename.startswith("<"):
        return False
    if "cs336_basics" in filename or "cs336_systems" in filename:
        return True
    normalized = os.path.normpath(filename)
    return not normalized.startswith(_LIBRARY_DIRS) and "site-packages" not in normalized


def format_frame(frame: dict[str, Any]) -> str:
    return f"{Path(str(frame.get('filename', '?'))).name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def origin_label(origin: str, package: str = "cs336_basics", width: int = 44) -> str:
    """A legend entry that shows the allocating code instead of its place: ``scores = Q @ K.transpose(-2, -1)
    / m… (scaled_dot_product_attention)`` for ``model.py:146 scaled_dot_product_attention``, the line read from
    ``package`` as this process runs it (so the one that allocated); ``origin`` unchanged where the frame is not
    the package's."""
    import importlib.util
    import linecache
    import re

    match = re.match(r"(\w+\.py):(\d+) (\S+)$", origin)
    spec = importlib.util.find_spec(package) if match else None
    if not match or spec is None or not spec.submodule_search_locations:
        return origin
    path = Path(next(iter(spec.submodule_search_locations))) / match.group(1)
    code = " ".join(linecache.getline(str(path), int(match.group(2))).split())
    if not code:
        return origin
    return f"{code if len(code) <= width else code[:width - 1] + '…'} ({match.group(3)})"


def user_stack(frames: Sequence[dict[str, Any]], depth: int = 3) -> list[str]:
    """The innermost ``depth`` user-code frames of an allocation's stack (innermost first)."""
    return [format_frame(f) for f in frames if is_user_frame(f)][:depth]


# --------------------------------------------------------------------------------------------------
# Analysis of a snapshot dict
# --------------------------------------------------------------------------------------------------


def _device_trace(snapshot: dict[str, Any], device: int | None) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces")
    if traces is None:
        raise ValueError("snapshot has no 'device_traces': record it with _record_memory_history enabled")
    if device is None:  # the device that did the work
        device = max(range(len(traces)), key=lambda i: len(traces[i])) if traces else 0
    if not 0 <= device < len(traces):
        raise ValueError(f"snapshot has traces for {len(traces)} device(s), asked for device {device}")
    return traces[device]


def _active_bytes_at_dump(snapshot: dict[str, Any]) -> int:
    return sum(
        block["size"]
        for seg in snapshot.get("segments", [])
        for block in seg.get("blocks", [])
        if block.get("state") == "active_allocated"
    )


def allocation_events(snapshot: dict[str, Any], device: int | None = None) -> pd.DataFrame:
    """``alloc`` and ``free_completed`` events in order: ``event`` (index in the trace), ``action``, ``addr``,
    ``size``, ``delta`` (+size / -size), ``time_us`` (when recorded), ``origin`` (innermost user frame),
    ``stack`` (user frames joined by `` <- ``) and ``alloc_event`` (for frees: the matching alloc)."""
    rows = []
    live: dict[int, int] = {}  # addr -> row of its alloc
    for i, entry in enumerate(_device_trace(snapshot, device)):
        action = entry.get("action")
        if action not in (_ALLOC, _FREE):
            continue
        frames = entry.get("frames", [])
        stack = user_stack(frames)
        row = {
            "event": i,
            "action": action,
            "addr": entry["addr"],
            "size": int(entry["size"]),
            "delta": int(entry["size"]) if action == _ALLOC else -int(entry["size"]),
            "time_us": entry.get("time_us"),
            "origin": stack[0] if stack else NO_USER_FRAME,
            "stack": " <- ".join(stack),
            "alloc_event": None,
        }
        if action == _ALLOC:
            live[entry["addr"]] = len(rows)
        elif entry["addr"] in live:
            alloc_row = rows[live.pop(entry["addr"])]
            row["alloc_event"] = alloc_row["event"]
            row["origin"], row["stack"] = alloc_row["origin"], alloc_row["stack"]  # a free belongs to its alloc
        else:
            row["origin"] = BEFORE_RECORDING
        rows.append(row)
    return pd.DataFrame(
        rows, columns=["event", "action", "addr", "size", "delta", "time_us", "origin", "stack", "alloc_event"]
    )


def active_memory_timeline(
    snapshot: dict[str, Any], *, top: int = 8, device: int | None = None, max_points: int = 4000
) -> pd.DataFrame:
    """Bytes in use after each event, one column per origin (the ``top`` origins by peak contribution, then
    ``other``, then memory allocated before recording), indexed by event number.

    Long traces are thinned to ``max_points`` rows, always keeping the row of the overall peak.
    """
    events = allocation_events(snapshot, device)
    if events.empty:
        raise ValueError("the snapshot's trace has no alloc/free events")
    # Memory live before recording: what was active at dump time minus what the trace accounts for.
    # Frees of such blocks appear in the trace (origin BEFORE_RECORDING), so they are added back.
    before = _active_bytes_at_dump(snapshot) - int(events["delta"].sum())
    recorded = events["origin"] != BEFORE_RECORDING
    total = events["delta"].cumsum() + before
    peak_at = int(total.idxmax())
    # Rank origins by what they hold at the peak, before pivoting (a trace can have 10^6 events and
    # hundreds of origins; the pivot only ever has top + 2 columns).
    contrib = events.loc[:peak_at][recorded.loc[:peak_at]].groupby("origin")["delta"].sum().sort_values(ascending=False)
    keep = [c for c in contrib.index[:top] if contrib[c] > 0]
    column = events["origin"].where(events["origin"].isin(keep) | ~recorded, OTHER)
    live = (
        events.assign(column=pd.Categorical(column, categories=[*keep, OTHER, BEFORE_RECORDING]))
        .pivot_table(index="event", columns="column", values="delta", aggfunc="sum", fill_value=0, observed=False)
        .cumsum()
    )
    live[BEFORE_RECORDING] += before
    timeline = live[[*keep, OTHER, BEFORE_RECORDING]]
    timeline.columns = list(timeline.columns)
    peak_at = int(events.loc[peak_at, "event"])
    if len(timeline) > max_points:
        positions = np.unique(np.r_[np.linspace(0, len(timeline) - 1, max_points).astype(int),
                                    timeline.index.get_loc(peak_at)])
        timeline = timeline.iloc[positions]
    return timeline


_GREYS = {BEFORE_RECORDING: "#bbbbbb", OTHER: "#dddddd"}


def _stack_timeline(ax: Any, timeline: pd.DataFrame, colors: dict[str, Any], title: str) -> None:
    order = [BEFORE_RECORDING, OTHER] + [c for c in timeline.columns if c not in (BEFORE_RECORDING, OTHER)][::-1]
    gib = timeline[order] / 2**30
    ax.stackplot(gib.index, *(gib[c].to_numpy() for c in order), labels=order, colors=[colors[c] for c in order],
                 linewidth=0)
    peak = gib.sum(axis=1).max()
    ax.axhline(peak, color="black", linewidth=0.8, linestyle="--")
    ax.text(gib.index[0], peak, f" peak {peak:.2f} GiB", va="bottom", fontsize=9)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title)
    ax.margins(x=0)


def _origin_colors(timelines: Sequence[pd.DataFrame]) -> dict[str, Any]:
    """One colour per origin across all panels (greys for the two catch-all bands)."""
    colors: dict[str, Any] = dict(_GREYS)
    palette = list(plt.get_cmap("tab20").colors)
    for t in timelines:
        for c in t.columns:
            if c not in colors:
                colors[c] = palette[(len(colors) - len(_GREYS)) % len(palette)]
    return colors


def plot_active_memory_timeline(
    snapshot: dict[str, Any], *, title: str = "Active memory timeline", top: int = 8, ax: Any = None
) -> plt.Figure:
    """Stacked area plot of :func:`active_memory_timeline` in GiB, pre-recording memory at the bottom, with
    its legend below the axes."""
    timeline = active_memory_timeline(snapshot, top=top)
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 5))
    else:
        fig = ax.figure
    _stack_timeline(ax, timeline, _origin_colors([timeline]), title)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2,
              frameon=False)
    return fig


def plot_memory_timelines(
    panels: dict[str, dict[str, Any] | None], *, ncols: int, top: int = 6, panel_size: tuple[float, float] = (5.0, 3.4),
    label: Callable[[str], str] = origin_label,
) -> plt.Figure:
    """A grid of :func:`active_memory_timeline` panels (title → snapshot, row by row; None leaves a panel
    empty) sharing one colour per origin and one legend under the grid, in type a page can print legibly; the
    legend names each origin by ``label`` (the allocating line of code)."""
    titles = list(panels)
    timelines = {t: active_memory_timeline(s, top=top) for t, s in panels.items() if s is not None}
    if not timelines:
        raise ValueError("no snapshots to plot")
    nrows = -(-len(titles) // ncols)
    colors = _origin_colors(list(timelines.values()))
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k < len(titles) and titles[k] in timelines:
            _stack_timeline(ax, timelines[titles[k]], colors, titles[k])
        else:
            ax.set_axis_off()
    used = [c for c in colors if any(c in t.columns for t in timelines.values())]
    legend = [c for c in used if c not in _GREYS] + [c for c in (OTHER, BEFORE_RECORDING) if c in used]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in legend]
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (-(-len(legend) // 3)) / nrows, 1, 1))
    fig.legend(handles, [c if c in _GREYS else label(c) for c in legend], loc="lower center", ncol=3, fontsize=10,
               frameon=False)
    return fig


def largest_allocations(snapshot: dict[str, Any], n: int = 15, device: int | None = None) -> pd.DataFrame:
    """The ``n`` largest allocations recorded: ``size_MiB``, ``count`` of allocations of the same size and
    origin, ``alloc_event``, ``lifetime_events`` (events until freed; NaN if still alive), ``origin`` and
    ``stack`` (user frames, innermost first)."""
    events = allocation_events(snapshot, device)
    allocs = events[events["action"] == _ALLOC].set_index("event")
    frees = events[(events["action"] == _FREE) & events["alloc_event"].notna()]
    freed_at = pd.Series(frees["event"].to_numpy(), index=frees["alloc_event"].astype(int).to_numpy())
    allocs = allocs.assign(lifetime_events=freed_at.reindex(allocs.index) - allocs.index)
    grouped = (
        allocs.reset_index()
        .groupby(["size", "origin", "stack"], sort=False)
        .agg(count=("event", "size"), alloc_event=("event", "first"), lifetime_events=("lifetime_events", "first"))
        .reset_index()
        .sort_values(["size", "alloc_event"], ascending=[False, True])
        .head(n)
    )
    grouped.insert(0, "size_MiB", grouped.pop("size") / 2**20)
    return grouped[["size_MiB", "count", "alloc_event", "lifetime_events", "origin", "stack"]].reset_index(drop=True)


def allocations_of_size(snapshot: dict[str, Any], nbytes: int, device: int | None = None) -> pd.DataFrame:
    """Allocations of exactly ``nbytes`` (the caching allocator rounds requests up to 512 B, so compare
    against a size rounded the same way: see :func:`allocator_rounded`)."""
    events = allocation_events(snapshot, device)
    return events[(events["action"] == _ALLOC) & (events["size"] == nbytes)]


def allocator_rounded(nbytes: int) -> int:
    """Size the CUDA caching allocator reserves for a request of ``nbytes`` (multiples of 512 bytes)."""
    return max(512, -(-nbytes // 512) * 512)
