"""The shapes grid: batch, heads and sequence lengths (tile-misaligned ones included) at head dims 64 and
128, ours against SDPA's flash and cuDNN backends in alternating rounds; ratios, a summary and a heatmap."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch

from cs336_systems.benchmarking.sweep import OK, grid, run_sweep
from cs336_systems.configs import attention_flops

from .sweep import IMPLEMENTATIONS, _random_qkvdo, time_attention_passes

#: (batch, heads, seq_len) triples of the shapes grid: batch 1-8, heads 8-32, sequences 256-65536, including
#: lengths that are not multiples of any tile (1000, 3000, 12345). Each runs at head dims 64 and 128.
SHAPES_BHN: list[list[int]] = [
    [8, 32, 256], [8, 16, 1000], [8, 16, 2048], [4, 32, 3000], [4, 32, 4096], [2, 16, 8192],
    [1, 16, 12345], [1, 16, 16384], [1, 8, 32768], [1, 8, 65536],
]
SHAPES_IMPLS = ("triton", "sdpa_flash", "sdpa_cudnn")
SHAPES_SMOKE_IMPLS = ("flash_pytorch", "sdpa_math")


def run_shapes(
    bhn: Sequence[Sequence[int]], head_dims: Sequence[int], dtypes: Sequence[str], causal: Sequence[bool],
    impls: Sequence[str], *, rounds: int = 1, warmup_ms: float = 5, rep_ms: float = 25, budget_s: float | None = None,
    device: str | None = None,
) -> pd.DataFrame:
    """Long table: one row per (impl, dtype, batch, heads, seq_len, head_dim, causal, pass) for the passes
    ``forward`` and ``forward+backward``, with mean/median ms, TFLOP/s and status.

    At each shape the implementations run in turn on the same inputs, ``rounds`` times, the order rotating
    (A B C, B C A, C A B, ...), so that a slow moment of the machine falls on all of them rather than on one
    cell. ``median_ms`` is the median over the rounds of each round's ``do_bench`` median, ``mean_ms`` the mean
    of the rounds' means, and ``spread`` the rounds' (max − min) / median: a ratio that moves less than its
    two spreads is no difference."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if rounds < 1:
        raise ValueError(f"shapes: rounds must be at least 1, got {rounds}")
    for shape in bhn:
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"a shape is [batch, heads, seq_len] of positive sizes, got {list(shape)}")
    impls = list(impls)

    def cell(dtype: str, shape: tuple[int, int, int], head_dim: int, is_causal: bool) -> dict[str, Any]:
        batch, heads, seq = shape
        q, k, v, do = _random_qkvdo(batch, heads, seq, head_dim, getattr(torch, dtype), device)
        measured: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
        for r in range(rounds):
            for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
                measured[impl].append(time_attention_passes(
                    IMPLEMENTATIONS[impl], q, k, v, do, is_causal=is_causal, passes=SHAPES_PASSES,
                    warmup_ms=warmup_ms, rep_ms=rep_ms))
        return {"by_impl": {impl: _merge_rounds(runs) for impl, runs in measured.items()}}

    configs = grid(dtype=list(dtypes), shape=[tuple(s) for s in bhn], head_dim=list(head_dims),
                   is_causal=list(causal))
    wide = run_sweep(cell, configs, desc="shapes", budget_s=budget_s)
    rows = []
    for rec in wide.to_dict("records"):
        batch, heads, seq = rec["shape"]
        by_impl = rec.get("by_impl") if rec["status"] == OK else None
        for impl in impls:
            timed = by_impl[impl] if isinstance(by_impl, dict) else {}
            for phase in SHAPES_PASSES:
                ms = timed.get(f"{phase}_ms", math.nan)
                flops = attention_flops(batch * heads, seq, seq, rec["head_dim"], is_causal=rec["is_causal"],
                                        phase=phase)
                rows.append({"impl": impl, "dtype": rec["dtype"], "batch": batch, "heads": heads, "seq_len": seq,
                             "head_dim": rec["head_dim"], "causal": rec["is_causal"], "pass": phase,
                             "status": timed.get(f"{phase}_status", rec["status"]), "rounds": rounds,
                             "mean_ms": ms, "median_ms": timed.get(f"{phase}_median_ms", math.nan),
                             "spread": timed.get(f"{phase}_spread", math.nan),
                             "TFLOP_per_s": math.nan if math.isnan(ms) else flops / (ms * 1e-3) / 1e12})
    return pd.DataFrame(rows)


#: The passes of the shapes grid.
SHAPES_PASSES = ("forward", "forward+backward")


def _merge_rounds(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One implementation's rounds at one shape as one record of :func:`time_attention_passes`'s keys plus
    ``{pass}_spread``; a pass that failed in any round (OOM, unsupported) takes that round's status."""
    merged: dict[str, Any] = {}
    for phase in SHAPES_PASSES:
        failed = [r[f"{phase}_status"] for r in runs if r[f"{phase}_status"] != OK]
        if failed:
            merged.update({f"{phase}_status": failed[0], f"{phase}_ms": math.nan, f"{phase}_median_ms": math.nan,
                           f"{phase}_spread": math.nan})
            continue
        medians = [r[f"{phase}_median_ms"] for r in runs]
        median = float(np.median(medians))
        merged.update({f"{phase}_status": OK, f"{phase}_ms": float(np.mean([r[f"{phase}_ms"] for r in runs])),
                       f"{phase}_median_ms": median, f"{phase}_spread": (max(medians) - min(medians)) / median})
    return merged


#: Parameters two jobs must share for their shapes tables to combine into one (the grid is split by dtype).
SHAPES_SAME = ("shapes.shapes", "shapes.head_dims", "shapes.causal", "shapes.rounds", "warmup_ms", "rep_ms",
               "kernel_options")
SHAPE_KEYS = ["dtype", "batch", "heads", "seq_len", "head_dim", "causal", "pass"]
#: One shape of the grid, whatever the pass.
SHAPE_CELL = [k for k in SHAPE_KEYS if k != "pass"]


def merge_shape_rows(rows: pd.DataFrame, earlier: pd.DataFrame | None) -> pd.DataFrame:
    """``rows`` (this job's) over ``earlier`` (an earlier job's of the same code and settings): a cell measured
    again replaces its rows, but a row this job did not measure (time budget, OOM) never replaces one that an
    earlier job measured."""
    from cs336_systems.results import merge_rows

    if earlier is None:
        return rows
    key = [*SHAPE_KEYS, "impl"]
    measured = set(earlier.loc[earlier["status"] == OK, key].itertuples(index=False, name=None))
    lost = pd.Series([status != OK and cell in measured for status, cell in
                      zip(rows["status"], rows[key].itertuples(index=False, name=None))], index=rows.index, dtype=bool)
    return merge_rows(rows[~lost], earlier, key)


def shapes_ratio(long: pd.DataFrame, ours: str = "triton") -> pd.DataFrame:
    """Per shape and pass: each implementation's median ms (column ``<impl>_ms``) and ``vs_<impl>`` = its time
    over ours (above 1: ours is faster); ``vs_best`` against the fastest other implementation that ran. With
    rounds (:func:`run_shapes`), also ``rounds`` and each implementation's ``spread_<impl>``."""
    ok = long[long["status"] == OK]
    wide = ok.pivot_table(index=SHAPE_KEYS, columns="impl", values="median_ms").reset_index()
    others = [c for c in wide.columns if c not in SHAPE_KEYS and c != ours]
    table = wide[SHAPE_KEYS].copy()
    table[f"{ours}_ms"] = wide.get(ours, math.nan)
    for impl in others:
        table[f"{impl}_ms"] = wide[impl]
        table[f"vs_{impl}"] = wide[impl] / table[f"{ours}_ms"]
    table["vs_best"] = wide[others].min(axis=1) / table[f"{ours}_ms"] if others else math.nan
    if "spread" in ok.columns and len(ok):
        spread = ok.pivot_table(index=SHAPE_KEYS, columns="impl", values="spread", dropna=False).reset_index()
        spread = table[SHAPE_KEYS].merge(spread, on=SHAPE_KEYS, how="left")
        table["rounds"] = int(ok["rounds"].max())
        for impl in (ours, *others):
            table[f"spread_{impl}"] = spread[impl].to_numpy() if impl in spread else math.nan
    return table


def shapes_summary(ratio: pd.DataFrame, baseline: str = "sdpa_cudnn") -> dict[str, Any]:
    """Geometric mean and minimum of ``vs_<baseline>`` per pass, and the shapes below 0.9× and 1.0×; with
    rounds, their number and the median and 90th percentile of the rounds' spreads over every time of the pass."""
    col = f"vs_{baseline}"
    out: dict[str, Any] = {"baseline": baseline}
    if col not in ratio.columns:
        return out
    if "rounds" in ratio.columns and len(ratio):
        out["rounds"] = int(ratio["rounds"].max())
    spread_cols = [c for c in ratio.columns if c.startswith("spread_")]
    for phase, g in ratio.dropna(subset=[col]).groupby("pass"):
        r = g[col]
        worst = g.loc[r.idxmin()]
        out[phase] = {"cells": int(len(r)), "geomean": float(np.exp(np.log(r).mean())), "min": float(r.min()),
                      "below_0.9": int((r < 0.9).sum()), "below_1.0": int((r < 1.0).sum()),
                      "worst": f"{worst['dtype']} {int(worst['batch'])}x{int(worst['heads'])}x"
                               f"{int(worst['seq_len'])}x{int(worst['head_dim'])}"
                               f"{' causal' if worst['causal'] else ''}"}
        spreads = g[spread_cols].to_numpy(dtype=float).ravel()
        spreads = spreads[~np.isnan(spreads)]
        if len(spreads):
            out[phase].update(spread_median=float(np.median(spreads)), spread_p90=float(np.percentile(spreads, 90)))
    return out


def plot_shapes(ratio: pd.DataFrame, column: str = "vs_sdpa_cudnn") -> plt.Figure:
    """Heatmaps of ``column`` (baseline time / ours): rows are shapes, columns dtype × causal; one panel per
    pass; centred on 1× (blue: ours faster)."""
    data = ratio.dropna(subset=[column]).copy()
    data["shape"] = [f"{int(b)}x{int(h)}x{int(n)} d{int(d)}" for b, h, n, d in
                     zip(data["batch"], data["heads"], data["seq_len"], data["head_dim"])]
    data["setting"] = data["dtype"].astype(str) + np.where(data["causal"], " causal", " full")
    passes = list(dict.fromkeys(data["pass"]))
    fig, axes = plt.subplots(1, max(len(passes), 1), figsize=(5.5 * max(len(passes), 1), 0.32 * data["shape"].nunique() + 2),
                             squeeze=False)
    for ax, phase in zip(axes[0], passes):
        wide = data[data["pass"] == phase].pivot_table(index="shape", columns="setting", values=column, sort=False)
        sns.heatmap(wide, ax=ax, annot=True, fmt=".2f", cmap="RdBu", center=1.0, cbar=ax is axes[0][-1],
                    annot_kws={"fontsize": 7})
        ax.set_title(f"{phase}: {column.removeprefix('vs_')} time / ours")
        ax.set_xlabel("")
        ax.set_ylabel("batch x heads x seq, head dim")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# The leaderboard configuration
# --------------------------------------------------------------------------------------------------
