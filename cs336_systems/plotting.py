"""Plot building blocks shared by the sections' figures: grouped bars with error bars and reference
markers, heatmaps of sweep grids whose failed cells (OOM, skipped) stay visible, and titles that name the
device the numbers were measured on (read from the results' provenance, not from this machine)."""

from __future__ import annotations

import math
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, Normalize, TwoSlopeNorm
from matplotlib.ticker import FuncFormatter

#: Colour of grid cells without a value (out of memory, skipped by the time budget).
MISSING_COLOUR = "#d9d9d9"


def measured_on(meta: dict[str, Any] | None) -> str:
    """``"NVIDIA H200, torch 2.11.0+cu130"`` from a result's ``.meta.json``; smoke results say so loudly."""
    if not meta:
        return "unknown device"
    text = f"{meta.get('device', 'unknown device')}, torch {meta.get('torch', '?')}"
    return text + " (SMOKE RUN: not GPU numbers)" if meta.get("smoke") else text


def grouped_bars(
    ax: Axes,
    wide: pd.DataFrame,
    *,
    yerr: pd.DataFrame | None = None,
    markers: pd.DataFrame | None = None,
    marker_label: str = "predicted",
    value_fmt: str | None = "{:.1f}",
    rotation: float = 0,
) -> Axes:
    """Bars of ``wide`` (rows = groups on the x axis, columns = bars within a group, NaN = no bar), with
    optional error bars, a short black line per bar at ``markers`` (same shape; e.g. a prediction), and
    each bar's value printed inside it."""
    wide.plot.bar(ax=ax, yerr=yerr, capsize=3, rot=rotation, width=0.8, edgecolor="white")
    bars = [c for c in ax.containers if hasattr(c, "patches")]
    for col, container in zip(wide.columns, bars, strict=True):
        heights = wide[col].to_numpy(dtype=float)
        if value_fmt:  # inside the bar, so neither error bars nor markers cover it
            labels = [value_fmt.format(h) if np.isfinite(h) else "" for h in heights]
            ax.bar_label(container, labels=labels, label_type="center", rotation=90, fontsize=8, color="white")
        for h, p in zip(heights, container.patches, strict=True):  # a missing bar says so instead of looking like 0
            if not np.isfinite(h):
                ax.text(p.get_x() + p.get_width() / 2, 0, " not run", rotation=90, ha="center", va="bottom",
                        fontsize=8, color="#555555")
    if markers is not None:
        first = True
        for col, container in zip(wide.columns, bars):
            for row, patch in zip(wide.index, container.patches, strict=True):
                y = markers.at[row, col] if col in markers and row in markers.index else math.nan
                if np.isfinite(y):
                    x0, w = patch.get_x(), patch.get_width()
                    ax.hlines(y, x0, x0 + w, colors="black", linewidth=2, label=marker_label if first else None)
                    first = False
    ax.margins(y=0.12)
    return ax


def status_heatmap(
    ax: Axes,
    df: pd.DataFrame,
    value: str,
    *,
    index: str,
    columns: str,
    fmt: str = "{:.3g}",
    log: bool = False,
    center: float | None = None,
    cmap: str = "viridis",
    colorbar_label: str = "",
) -> Axes:
    """Heatmap of ``value`` over ``index × columns`` (in the order they appear in ``df``), each cell
    annotated with its value; cells whose ``status`` is not ``ok`` (or whose value is missing) are grey and
    say why ("OOM", "skipped"). ``log`` uses a logarithmic colour scale (timings spanning decades);
    ``center`` a diverging one around that value (speed-ups around 1, logarithmic when all values are
    positive)."""
    rows, cols = list(pd.unique(df[index])), list(pd.unique(df[columns]))
    grid = df.pivot_table(index=index, columns=columns, values=value, aggfunc="first", dropna=False)
    grid = grid.reindex(index=rows, columns=cols)
    status = df.pivot_table(index=index, columns=columns, values="status", aggfunc="first") if "status" in df else None
    values = grid.to_numpy(dtype=float)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        norm: Normalize = Normalize(0, 1)
    elif center is not None and finite.min() > 0:  # ratios: symmetric in log space (2x and 0.5x equally far)
        spread = max(finite.max() / center, center / finite.min(), 1.01)
        norm = LogNorm(vmin=center / spread, vmax=center * spread)
    elif center is not None:
        span = max(abs(finite.max() - center), abs(center - finite.min()), 1e-9)
        norm = TwoSlopeNorm(vcenter=center, vmin=center - span, vmax=center + span)
    elif log and finite.min() > 0:
        norm = LogNorm(vmin=finite.min(), vmax=max(finite.max(), finite.min() * 1.01))
    else:
        norm = Normalize(vmin=finite.min(), vmax=finite.max())
    cm = plt.get_cmap(cmap).with_extremes(bad=MISSING_COLOUR)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cm, norm=norm, aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.grid(False)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            v = values[i, j]
            if np.isfinite(v):
                rgba = cm(norm(v))
                dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="white" if dark else "black")
            else:
                why = status.at[r, c] if status is not None and r in status.index and c in status.columns else "n/a"
                ax.text(j, i, "skipped" if str(why).startswith("skipped") else str(why), ha="center", va="center",
                        fontsize=8, color="#c00000" if why == "OOM" else "#555555", fontweight="bold")
    bar = ax.figure.colorbar(image, ax=ax, label=colorbar_label, shrink=0.9)
    if isinstance(norm, LogNorm):  # plain numbers instead of 10^k
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        bar.ax.yaxis.set_minor_formatter(FuncFormatter(_minor_log_label))
    return ax


def _minor_log_label(value: float, _pos: Any = None) -> str:
    """Label the 2, 3 and 5 minor ticks of a log axis (0.3, 2, 50, ...), leave the others blank."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa) in (2, 3, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""

