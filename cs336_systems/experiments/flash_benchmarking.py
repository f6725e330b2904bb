"""§1.3.2 FlashAttention-2 in Triton: the kernel sweep, the leaderboard configuration, and the model step.

Problems ``flash_forward``, ``flash_backward`` and ``flash_benchmarking``. ``python -m
cs336_systems.experiments flash_benchmarking --set parts=sweep,leaderboard`` runs the parts named:

- ``sweep``: batch 1, one head, causal; every sequence length × head dimension × dtype; forward,
  backward and forward+backward latency of our Triton kernels next to naive PyTorch attention and
  ``F.scaled_dot_product_attention`` pinned to each backend (flash, cuDNN, memory-efficient), all timed
  in one process with ``triton.testing.do_bench``. Failures are results: ``OOM``, ``unsupported`` (a
  backend that does not take the dtype or head dim), ``skipped (time budget)``.
- ``leaderboard``: ``Q, K, V`` of shape ``(16, 16384, 64)`` bf16, causal, ``torch.compile(Fn.apply)``,
  forward then ``o.sum().backward()``, against both SDPA backends in the same run; mean and median,
  ratios and achieved TFLOP/s.
- ``model``: a training step of ``BasicsTransformerLM`` (bf16 autocast) with ``flash_triton`` vs ``naive``
  vs ``sdpa`` attention over context lengths, with peak memory: naive's grows with seq², flash's does not.
- ``breakdown``: our kernels alone at the leaderboard shape (head dims 64 and 128): forward+backward
  time, the GPU time and achieved TFLOP/s of each kernel per step (torch.profiler), the tiles the
  autotuner chose and its timing of every candidate. The lab bench behind ``docs/flash_attention/NOTES.md``;
  ``--candidates wide`` widens the candidate tiles.
The default parts are leaderboard, sweep and model, in that order.

Everything goes through :class:`~cs336_systems.results.ResultWriter` (section ``flash_benchmarking``).
Without a GPU the commands run a tiny smoke version (PyTorch-tiled flash, naive and SDPA's math path on
CPU) so that the code path is exercised; the GPU-only baselines are reported as skipped.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import (
    FlashAttentionPytorch,
    FlashAttentionTriton,
    flash_triton,
    naive_attention,
    options,
)
from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, benchmark_model
from cs336_systems.benchmarking.sweep import OK, OOM, free_memory, grid, is_oom, run_sweep
from cs336_systems.benchmarking.timing import TimingStats, do_bench
from cs336_systems.configs import attention_flops
from cs336_systems.experiments.section import Section, check_parts, check_positive, check_presets, param
from cs336_systems.profiling.torch_profiler import kernel_table, profile_steps
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.staleness import MODEL
from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run

SECTION = "flash_benchmarking"
PASSES = ("forward", "backward", "forward+backward")
UNSUPPORTED = "unsupported"

#: The handout's sweep.
SWEEP_SEQ_LENS = [2**i for i in range(7, 17)]  # 128 … 65536
SWEEP_HEAD_DIMS = [16, 32, 64, 128]
SWEEP_DTYPES = ["bfloat16", "float32"]

# --------------------------------------------------------------------------------------------------
# Implementations under test: fn(q, k, v, is_causal) on (batch, heads, seq, d)
# --------------------------------------------------------------------------------------------------


def _sdpa(backend: SDPBackend) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    def attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    attention.__name__ = f"sdpa_{backend.name.lower()}"
    return attention


IMPLEMENTATIONS: dict[str, Callable[[Tensor, Tensor, Tensor, bool], Tensor]] = {
    "triton": FlashAttentionTriton.apply,
    "flash_pytorch": FlashAttentionPytorch.apply,
    "naive": naive_attention,
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
    "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    "sdpa_math": _sdpa(SDPBackend.MATH),
}
GPU_IMPLS = ["triton", "naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
SMOKE_IMPLS = ["flash_pytorch", "naive", "sdpa_math"]
#: The built-in baselines a speed-up is computed against (the fastest that ran, per cell).
BUILTIN_IMPLS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def _poly_exp2_label() -> str:
    """Which kernels exponentiate with the FMA-pipe polynomial under the current options, for provenance:
    the phases forced by ``poly_exp2``, or ``dkdv+tuned`` when each candidate tile's pin decides (the
    chosen configs then say which)."""
    forced = options.current().poly_exp2
    return ",".join(sorted(forced)) if forced is not None else "dkdv+tuned"


def _median_ms(stats: TimingStats) -> float:
    return statistics.median(stats.times_s) * 1e3


def _is_unsupported(exc: BaseException) -> bool:
    """SDPA raises a RuntimeError naming no usable kernel when a pinned backend cannot take the inputs."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("no available kernel" in text or "not supported" in text)


def _record_timing(row: dict[str, Any], name: str, measure: Callable[[], TimingStats]) -> None:
    """Run ``measure`` and store ``{name}_ms`` (mean), ``{name}_median_ms`` and ``{name}_status`` in ``row``.
    An OOM or an unsupported input is recorded as that cell's status; any other error propagates."""
    try:
        stats = measure()
    except Exception as exc:
        status = OOM if is_oom(exc) else UNSUPPORTED if _is_unsupported(exc) else None
        if status is None:
            raise
        del exc
        free_memory()
        row.update({f"{name}_ms": math.nan, f"{name}_median_ms": math.nan, f"{name}_status": status})
        return
    row.update({f"{name}_ms": stats.mean * 1e3, f"{name}_median_ms": _median_ms(stats), f"{name}_status": OK})


def time_attention_passes(
    fn: Callable[[Tensor, Tensor, Tensor, bool], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    *,
    is_causal: bool = True,
    passes: Sequence[str] = PASSES,
    warmup_ms: float = 10,
    rep_ms: float = 40,
) -> dict[str, Any]:
    """Time each pass of ``fn``; returns ``{pass}_ms`` (mean), ``{pass}_median_ms`` and ``{pass}_status``.

    ``backward`` replays a retained graph (the forward is outside the timed region); ``forward`` runs
    with autograd recording, as in training. An OOM or an unsupported input ends that pass only.
    """
    inputs = (q, k, v)
    unknown = [phase for phase in passes if phase not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid: {PASSES}")

    def forward() -> TimingStats:
        return do_bench(lambda: fn(q, k, v, is_causal), warmup_ms=warmup_ms, rep_ms=rep_ms)

    def backward() -> TimingStats:
        o = fn(q, k, v, is_causal)
        return do_bench(lambda: torch.autograd.grad(o, inputs, do, retain_graph=True), warmup_ms=warmup_ms, rep_ms=rep_ms)

    def forward_backward() -> TimingStats:
        return do_bench(lambda: torch.autograd.grad(fn(q, k, v, is_causal), inputs, do), warmup_ms=warmup_ms, rep_ms=rep_ms)

    measures = {"forward": forward, "backward": backward, "forward+backward": forward_backward}
    row: dict[str, Any] = {}
    for phase in passes:
        _record_timing(row, phase, measures[phase])
    return row


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


def _random_qkvdo(
    batch: int, heads: int, seq_len: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[Tensor, ...]:
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype)


def run_flash_sweep(
    seq_lens: Sequence[int] = SWEEP_SEQ_LENS,
    head_dims: Sequence[int] = SWEEP_HEAD_DIMS,
    dtypes: Sequence[str] = SWEEP_DTYPES,
    impls: Sequence[str] | None = None,
    *,
    batch: int = 1,
    is_causal: bool = True,
    warmup_ms: float = 10,
    rep_ms: float = 40,
    budget_s: float | None = None,
    device: str | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Long table: one row per (impl, dtype, head_dim, seq_len, pass) with mean/median ms, TFLOP/s, status."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    impls = list(impls or (GPU_IMPLS if device == "cuda" else SMOKE_IMPLS))

    def cell(dtype: str, head_dim: int, seq_len: int, impl: str) -> dict[str, Any]:
        q, k, v, do = _random_qkvdo(batch, 1, seq_len, head_dim, getattr(torch, dtype), device)
        return time_attention_passes(
            IMPLEMENTATIONS[impl], q, k, v, do, is_causal=is_causal, warmup_ms=warmup_ms, rep_ms=rep_ms
        )

    configs = grid(dtype=dtypes, head_dim=head_dims, seq_len=seq_lens, impl=impls)
    wide = run_sweep(cell, configs, desc="flash sweep", budget_s=budget_s, progress=progress)
    return _long_format(wide, batch_heads=batch, is_causal=is_causal)


def _long_format(wide: pd.DataFrame, batch_heads: int, is_causal: bool) -> pd.DataFrame:
    rows = []
    for rec in wide.to_dict("records"):
        for phase in PASSES:
            status = rec.get(f"{phase}_status", rec["status"])
            status = rec["status"] if (not isinstance(status, str) or rec["status"] != OK) else status
            ms = rec.get(f"{phase}_ms", math.nan)
            flops = attention_flops(batch_heads, rec["seq_len"], rec["seq_len"], rec["head_dim"], is_causal=is_causal,
                                    phase=phase)
            rows.append({
                **{key: rec[key] for key in ("impl", "dtype", "head_dim", "seq_len")},
                "pass": phase, "status": status, "mean_ms": ms,
                "median_ms": rec.get(f"{phase}_median_ms", math.nan),
                "TFLOP_per_s": math.nan if math.isnan(ms) else flops / (ms * 1e-3) / 1e12,
            })  # fmt: skip
    return pd.DataFrame(rows)


def speedup_table(long: pd.DataFrame, ours: str = "triton") -> pd.DataFrame:
    """Per cell: our time, the fastest built-in (which one, and its time) and ``speedup = builtin / ours``;
    also the naive time and ours' speed-up over it."""
    keys = ["dtype", "head_dim", "seq_len", "pass"]
    ok = long[long["status"] == OK]
    mine = ok[ok["impl"] == ours].set_index(keys)["mean_ms"].rename("ours_ms")
    builtin = ok[ok["impl"].isin(BUILTIN_IMPLS)]
    best = builtin.loc[builtin.groupby(keys)["mean_ms"].idxmin()].set_index(keys)
    naive = ok[ok["impl"] == "naive"].set_index(keys)["mean_ms"].rename("naive_ms")
    table = pd.concat(
        [mine, best["impl"].rename("best_builtin"), best["mean_ms"].rename("best_builtin_ms"), naive], axis=1
    ).reset_index()
    table["speedup_vs_builtin"] = table["best_builtin_ms"] / table["ours_ms"]
    table["speedup_vs_naive"] = table["naive_ms"] / table["ours_ms"]
    return table.sort_values(keys, kind="stable").reset_index(drop=True)


def plot_speedup(table: pd.DataFrame) -> plt.Figure:
    """Speed-up of ours over the fastest built-in per cell vs sequence length; a panel per dtype × pass."""
    data = table.dropna(subset=["speedup_vs_builtin"])
    g = sns.relplot(
        data=data, x="seq_len", y="speedup_vs_builtin", hue="head_dim", style="head_dim", col="pass",
        row="dtype", kind="line", markers=True, palette="viridis", height=2.8, aspect=1.2,
        facet_kws={"sharey": False},
    )  # fmt: skip
    for ax in g.axes.flat:
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    g.set_axis_labels("sequence length", "speed-up vs fastest SDPA backend")
    g.figure.suptitle("Triton FlashAttention-2 vs F.scaled_dot_product_attention (causal, batch 1)", y=1.02)
    return g.figure


def plot_latency(long: pd.DataFrame, head_dim: int) -> plt.Figure:
    """Latency of every implementation at one head dimension, vs sequence length (log-log)."""
    data = long[(long["head_dim"] == head_dim) & (long["status"] == OK)]
    g = sns.relplot(
        data=data, x="seq_len", y="mean_ms", hue="impl", style="impl", col="pass", row="dtype",
        kind="line", markers=True, height=2.8, aspect=1.2,
    )  # fmt: skip
    for ax in g.axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    g.set_axis_labels("sequence length", "latency (ms)")
    g.figure.suptitle(f"Attention latency, head dim {head_dim} (causal, batch 1)", y=1.02)
    return g.figure


# --------------------------------------------------------------------------------------------------
# Every shape: ours against SDPA's flash and cuDNN backends over (batch, heads, seq, d) × dtype × causal
# --------------------------------------------------------------------------------------------------

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


SHAPE_KEYS = ["dtype", "batch", "heads", "seq_len", "head_dim", "causal", "pass"]
#: One shape of the grid, whatever the pass.
SHAPE_CELL = [k for k in SHAPE_KEYS if k != "pass"]


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


def _leaderboard_inputs(batch: int, seq_len: int, head_dim: int, dtype: str, device: str) -> tuple[Tensor, ...]:
    """``q, k, v = randn(3, batch, seq_len, head_dim)`` as the leaderboard builds them, requiring grad."""
    q, k, v = torch.randn(3, batch, seq_len, head_dim, device=device, dtype=getattr(torch, dtype)).unbind(0)
    return tuple(t.requires_grad_() for t in (q, k, v))


def run_leaderboard(
    batch: int = 16,
    seq_len: int = 16384,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    impls: Sequence[str] | None = None,
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    device: str | None = None,
    compile_ours: bool | None = None,
) -> pd.DataFrame:
    """One row per implementation: fwd+bwd with ``o.sum().backward()`` (the leaderboard's protocol) and with
    a random ``dO``, and the forward alone; mean and median ms, TFLOP/s and time ratios.

    Inputs are ``(batch, seq_len, head_dim)`` (heads folded into batch) for ours, as the leaderboard
    calls it, and the same memory viewed as ``(batch, 1, seq_len, head_dim)`` for SDPA. Ours runs under
    ``torch.compile(Fn.apply)`` (``compile_ours``, default on CUDA only: Inductor's CPU compile would
    dominate a smoke run); the baselines run eagerly (compiling does not change their kernels).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    impls = list(
        impls or (["triton", "sdpa_flash", "sdpa_cudnn", "naive"] if device == "cuda" else SMOKE_IMPLS[:2])
    )
    q, k, v = _leaderboard_inputs(batch, seq_len, head_dim, dtype, device)
    do = torch.randn_like(q)
    compile_ours = device == "cuda" if compile_ours is None else compile_ours
    rows = []
    for impl in impls:
        if impl in ("triton", "flash_pytorch"):
            fn = torch.compile(IMPLEMENTATIONS[impl]) if compile_ours else IMPLEMENTATIONS[impl]
            args = (q, k, v)
        else:
            fn = IMPLEMENTATIONS[impl]
            args = tuple(t.unsqueeze(1) for t in (q, k, v))  # views: gradients still reach q, k, v
        row: dict[str, Any] = {"impl": impl}
        if impl == "triton":
            row["poly_exp2"] = _poly_exp2_label()
            row["forward_kernel"] = flash_triton.forward_kernel_name(q, k, v, True)  # gluon on Hopper, else triton
        protocols: dict[str, Callable[[], Any]] = {
            "fwd_bwd_sum": lambda: fn(*args, True).sum().backward(),
            "fwd_bwd_random_do": lambda: fn(*args, True).backward(do.view_as(args[0])),
            "forward": lambda: fn(*args, True),
        }
        for name, step in protocols.items():
            _record_timing(
                row, name, lambda step=step: do_bench(step, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=[q, k, v])
            )
        rows.append(row)
        free_memory()
    table = pd.DataFrame(rows)
    fwd_bwd = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True, phase="forward+backward")
    fwd = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True)
    table["fwd_bwd_TFLOP_per_s"] = fwd_bwd / (table["fwd_bwd_sum_ms"] * 1e-3) / 1e12
    table["forward_TFLOP_per_s"] = fwd / (table["forward_ms"] * 1e-3) / 1e12
    ours = table.loc[table["impl"] == impls[0]].iloc[0]
    for col in ("fwd_bwd_sum_ms", "forward_ms"):
        table[f"{col.removesuffix('_ms')}_time_vs_{impls[0]}"] = table[col] / ours[col]
    return table


def leaderboard_summary(table: pd.DataFrame, ours: str = "triton") -> dict[str, Any]:
    """The headline numbers: ours, each SDPA backend, ratios (``baseline / ours`` > 1: ours is faster)."""
    by = table.set_index("impl")
    summary: dict[str, Any] = {"ours": ours}
    for impl in by.index:
        summary[f"{impl}_fwd_bwd_ms"] = by.at[impl, "fwd_bwd_sum_ms"]
        summary[f"{impl}_fwd_bwd_median_ms"] = by.at[impl, "fwd_bwd_sum_median_ms"]
        summary[f"{impl}_forward_ms"] = by.at[impl, "forward_ms"]
        if impl != ours:
            summary[f"speedup_vs_{impl}"] = by.at[impl, "fwd_bwd_sum_ms"] / by.at[ours, "fwd_bwd_sum_ms"]
            summary[f"forward_speedup_vs_{impl}"] = by.at[impl, "forward_ms"] / by.at[ours, "forward_ms"]
    summary["ours_fwd_bwd_TFLOP_per_s"] = by.at[ours, "fwd_bwd_TFLOP_per_s"]
    summary["ours_forward_TFLOP_per_s"] = by.at[ours, "forward_TFLOP_per_s"]
    return summary


# --------------------------------------------------------------------------------------------------
# Kernel breakdown: where our forward+backward spends its time, and what the autotuner chose
# --------------------------------------------------------------------------------------------------

#: The autotuned kernels whose choices the breakdown records, with their tuning phase.
TUNED_KERNELS = {"flash_forward_kernel": "forward", "flash_backward_dkdv_kernel": "dkdv",
                 "flash_backward_dq_kernel": "dq"}

#: Every tile shape, warp count, stage count and register cap worth trying on Hopper (a minute or more of
#: tuning per shape class): how the library's ``options.DEFAULT_CANDIDATES`` were chosen. Run the kernel
#: breakdown with ``--candidates wide`` and read the winners off its ``best_config`` column.
_T = options.Tile
WIDE_CANDIDATES: dict[str, list[options.Tile]] = {
    "forward": [_T(64, 64, 4, 3), _T(64, 64, 4, 4), _T(64, 128, 4, 3), _T(128, 64, 4, 3), _T(128, 64, 8, 3),
                _T(128, 64, 8, 4), _T(128, 128, 8, 2), _T(128, 128, 8, 3), _T(128, 32, 4, 3), _T(64, 32, 4, 4)],
    "dkdv": [_T(32, 64, 4, 3), _T(32, 64, 4, 5), _T(32, 128, 4, 3), _T(32, 128, 4, 5),
             _T(32, 128, 8, 4), _T(64, 64, 4, 2), _T(64, 64, 4, 3), _T(64, 64, 4, 4), _T(64, 64, 8, 4),
             _T(64, 128, 8, 2), _T(64, 128, 8, 3), _T(128, 128, 8, 2),
             _T(32, 64, 4, 3, maxnreg=168),
             _T(32, 64, 4, 4, maxnreg=168), _T(64, 64, 4, 3, maxnreg=168),
             _T(32, 128, 8, 3, maxnreg=128), _T(64, 64, 4, 3, maxnreg=168, poly=False),
             _T(64, 64, 4, 3, poly=False), _T(32, 64, 4, 3, maxnreg=168, poly=False),
             _T(32, 128, 8, 3, maxnreg=128, poly=False), _T(64, 128, 8, 3, poly=False),
             _T(64, 64, 4, 2, maxnreg=168, poly=False), _T(64, 64, 4, 4, maxnreg=168, poly=False)],
    "dq": [_T(64, 32, 4, 4), _T(64, 64, 4, 3), _T(64, 64, 4, 5), _T(64, 128, 4, 3), _T(128, 32, 4, 3),
           _T(128, 32, 4, 5), _T(128, 64, 4, 3), _T(128, 64, 8, 3), _T(128, 128, 8, 2),
           _T(64, 64, 4, 3, maxnreg=128), _T(128, 64, 8, 3, maxnreg=128), _T(128, 64, 4, 4),
           _T(128, 64, 4, 3, maxnreg=168), _T(128, 128, 8, 3)],
}  # fmt: skip
CANDIDATE_SETS = {"default": None, "wide": WIDE_CANDIDATES}
#: Matmuls per step each kernel issues: forward 2 (S, PV), dK/dV 4 (S, dV, dP, dK), dQ 3 (S, dP, dQ). The
#: Gluon forward (Hopper) replaces the Triton one where it applies.
MATMULS_PER_STEP = {"flash_forward_kernel": 2, "flash_forward_gluon_kernel": 2, "flash_backward_dkdv_kernel": 4,
                    "flash_backward_dq_kernel": 3}


def _config_label(config: Any) -> str:
    """``BLOCK_M x BLOCK_N, w warps, s stages[, maxnreg r][, polynomial exp2]`` for a ``triton.Config``."""
    kw = config.kwargs
    label = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}, {config.num_warps} warps, {config.num_stages} stages"
    maxnreg = getattr(config, "maxnreg", None)
    label = f"{label}, maxnreg {maxnreg}" if maxnreg else label
    return f"{label}, polynomial exp2" if kw.get("POLY_EXP2") else label


def _tuning_state() -> dict[str, Any]:
    """Per tuned kernel, the object holding its latest tuning timings (changes whenever it tunes)."""
    kernels, opts = flash_triton._kernels(), options.current()
    return {name: getattr(kernels.tuned(phase, opts), "configs_timings", None) for name, phase in TUNED_KERNELS.items()}


def run_kernel_breakdown(
    batch: int = 16,
    seq_len: int = 16384,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    profiled_steps: int = 5,
    device: str | None = None,
    compile_ours: bool | None = None,
) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """Our kernels on the leaderboard protocol (``torch.compile(Fn.apply)``, causal, ``o.sum().backward()``).

    Returns ``(summary, kernels, tuning)``: ``summary`` holds forward+backward and forward-only times (mean,
    median), TFLOP/s and the tiles each kernel ran with; ``kernels`` has one row per GPU kernel with calls,
    time and share per step (torch.profiler over ``profiled_steps`` steps) and the achieved TFLOP/s of our
    three attention kernels; ``tuning`` has the autotuner's timing of every candidate tile configuration, when
    this call is the one that tuned (first use of the shape class in the process; empty otherwise).
    On CPU this needs ``TRITON_INTERPRET=1`` (tiny shapes only).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compile_ours = device == "cuda" if compile_ours is None else compile_ours
    q, k, v = _leaderboard_inputs(batch, seq_len, head_dim, dtype, device)
    fn = torch.compile(FlashAttentionTriton.apply) if compile_ours else FlashAttentionTriton.apply

    def step() -> None:
        fn(q, k, v, True).sum().backward()

    before = _tuning_state()
    step()  # first use tunes every kernel for this shape class
    after = _tuning_state()
    q.grad = k.grad = v.grad = None

    poly = _poly_exp2_label()
    summary: dict[str, Any] = {"poly_exp2": poly, "batch": batch, "seq_len": seq_len, "head_dim": head_dim,
                               "dtype": dtype, "forward_kernel": flash_triton.forward_kernel_name(q, k, v, True)}  # fmt: skip
    _record_timing(summary, "fwd_bwd_sum", lambda: do_bench(step, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                                            grad_to_none=[q, k, v]))  # fmt: skip
    _record_timing(summary, "forward", lambda: do_bench(lambda: fn(q, k, v, True), warmup_ms=warmup_ms,
                                                        rep_ms=rep_ms))  # fmt: skip
    total_flops = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True, phase="forward+backward")
    summary["fwd_bwd_TFLOP_per_s"] = total_flops / (summary["fwd_bwd_sum_ms"] * 1e-3) / 1e12

    kernels = kernel_table(profile_steps(step, warmup=1, steps=profiled_steps), per=profiled_steps)
    summary["profiled_gpu_ms_per_step"] = kernels["total_ms"].sum()
    matmul = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True) / 2  # one causal product
    kernels["matmuls"] = kernels["name"].map(MATMULS_PER_STEP)
    kernels["TFLOP_per_s"] = kernels["matmuls"] * matmul / (kernels["total_ms"] * 1e-3) / 1e12
    kernels = kernels.assign(head_dim=head_dim, poly_exp2=poly)

    chosen, opts = flash_triton._kernels(), options.current()
    tuning_rows = []
    for name, phase in TUNED_KERNELS.items():
        best = getattr(chosen.tuned(phase, opts), "best_config", None)
        summary[f"config_{name}"] = _config_label(best) if best is not None else ""
        timings = after[name]
        if timings is None or timings is before[name]:
            continue
        for config, times in timings.items():
            median = times[0] if isinstance(times, (list, tuple)) else times
            tuning_rows.append({"head_dim": head_dim, "kernel": name, "config": _config_label(config),
                                "median_ms": median, "chosen": best is config})  # fmt: skip
    tuning = pd.DataFrame(tuning_rows, columns=["head_dim", "kernel", "config", "median_ms", "chosen"])
    return summary, kernels, tuning


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def run_model_comparison(
    contexts: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
    impls: Sequence[str] = ("naive", "sdpa", "flash_triton"),
    *,
    model: str = "small",
    batch_size: int = 1,
    precision: str = "bf16",
    warmup: int = 2,
    steps: int = 3,
    budget_s: float | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """A training step (forward, backward, AdamW) per context × attention implementation, with peak
    memory."""

    def cell(context_length: int, attention_impl: str) -> dict[str, Any]:
        spec = BenchmarkSpec(
            model=model, mode="train", context_length=context_length, batch_size=batch_size,
            precision=precision, attention_impl=attention_impl, warmup=warmup, steps=steps,
        )  # fmt: skip
        return benchmark_model(spec)

    configs = grid(context_length=contexts, attention_impl=impls)
    table = run_sweep(cell, configs, desc="model step", budget_s=budget_s, progress=progress)
    return table.assign(model=model, batch_size=batch_size, precision=precision)


def plot_model_comparison(table: pd.DataFrame) -> plt.Figure:
    """Step time and peak memory vs context length, one line per attention implementation."""
    data = table[table["status"] == OK]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    sns.lineplot(
        data=data, x="context_length", y="total_mean_ms", hue="attention_impl", marker="o", ax=axes[0]
    )
    axes[0].set(xscale="log", yscale="log", xlabel="context length", ylabel="training step (ms)")
    if "peak_memory_GiB" in data:
        sns.lineplot(
            data=data, x="context_length", y="peak_memory_GiB", hue="attention_impl", marker="o", ax=axes[1]
        )
    axes[1].set(xscale="log", yscale="log", xlabel="context length", ylabel="peak memory (GiB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
    fig.suptitle("BasicsTransformerLM training step by attention implementation")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# Inside the model: our attention against SDPA in the same training step, alternating
# --------------------------------------------------------------------------------------------------

#: What the model A/B compares: the built-in baseline first, then ours.
MODEL_AB_IMPLS = ("sdpa", "flash_triton")
#: One cell of the model A/B, and the parameters under which cells of separate jobs combine into one table.
MODEL_AB_CELL = ("preset", "context_length", "compile")
#: One round of a cell: the unit separate jobs combine (an xl compiled cell's two rounds outlast one GPU job).
MODEL_AB_ROUND = (*MODEL_AB_CELL, "round")
MODEL_AB_SAME = ("ab_impls", "ab_tokens_per_step", "ab_rounds", "ab_steps", "kernel_options")


def model_ab_configs(presets: Sequence[str], contexts: Sequence[int], compiles: Sequence[bool], rounds: int,
                     impls: Sequence[str] = MODEL_AB_IMPLS, only_rounds: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Cells in measuring order: per (preset, context, compile), ``rounds`` rounds of every implementation,
    the order rotating from round to round (A B, then B A), so that neither always runs first; with
    ``only_rounds``, just those rounds (another job measures the rest)."""
    if rounds < 1 or len(impls) < 2:
        raise ValueError(f"model A/B needs rounds >= 1 and two implementations, got {rounds} and {list(impls)}")
    outside = [r for r in only_rounds if not 0 <= r < rounds]
    if outside:
        raise ValueError(f"model A/B round {outside[0]} is not one of the {rounds} rounds (0..{rounds - 1})")
    configs = []
    for cell in grid(preset=presets, context_length=contexts, compile=compiles):
        for r in (sorted(set(only_rounds)) or range(rounds)):
            k = r % len(impls)
            configs += [{**cell, "round": r, "attention_impl": impl} for impl in (*impls[k:], *impls[:k])]
    return configs


def run_model_ab(presets: Sequence[str], contexts: Sequence[int], compiles: Sequence[bool] = (False, True), *,
                 impls: Sequence[str] = MODEL_AB_IMPLS, rounds: int = 2, only_rounds: Sequence[int] = (),
                 tokens_per_step: int = 8192,
                 precision: str = "bf16", warmup: int = 2, steps: int = 5, budget_s: float | None = None,
                 progress: bool = True) -> pd.DataFrame:
    """One training step (forward, backward, AdamW) of our model per cell of :func:`model_ab_configs`, the
    attention the only difference; the batch holds ``tokens_per_step`` tokens (batch = tokens / context)."""
    bad = [c for c in contexts if c < 1 or tokens_per_step % c]
    if bad:
        raise ValueError(f"tokens_per_step={tokens_per_step} is not a multiple of context {bad[0]}")

    def cell(preset: str, context_length: int, compile: bool, attention_impl: str, **_: Any) -> dict[str, Any]:
        spec = BenchmarkSpec(
            model=preset, mode="train", context_length=context_length,
            batch_size=tokens_per_step // context_length, precision=precision, compile=compile,
            attention_impl=attention_impl, warmup=warmup, steps=steps,
        )  # fmt: skip
        return {"batch_size": spec.batch_size, **benchmark_model(spec)}

    configs = model_ab_configs(presets, contexts, compiles, rounds, impls, only_rounds)
    table = run_sweep(cell, configs, desc="model A/B", budget_s=budget_s, progress=progress)
    return table.assign(precision=precision, tokens_per_step=tokens_per_step)


def summarize_model_ab(table: pd.DataFrame, baseline: str = MODEL_AB_IMPLS[0],
                       ours: str = MODEL_AB_IMPLS[1]) -> pd.DataFrame:
    """Per (preset, context, compile): each implementation's median step over its measured rounds and the
    spread (max - min), the baseline's time over ours (above 1: ours faster), and ``verdict``: ``tie`` when
    the two medians differ by less than the larger spread, else which is faster. Cells where either side
    has no measured round say why (``OOM``, skipped)."""
    keys = ["preset", "context_length", "compile"]
    rows = []
    for cell, g in table.groupby(keys, sort=False):
        row: dict[str, Any] = dict(zip(keys, cell))
        for impl, label in ((baseline, "baseline"), (ours, "ours")):
            t = g[(g["attention_impl"] == impl) & (g["status"] == OK)]["total_mean_ms"]
            row[f"{label}_ms"] = t.median() if len(t) else float("nan")
            row[f"{label}_spread_ms"] = (t.max() - t.min()) if len(t) else float("nan")
            row[f"{label}_rounds"] = len(t)
        if row["baseline_rounds"] and row["ours_rounds"]:
            row["baseline_over_ours"] = row["baseline_ms"] / row["ours_ms"]
            tied = abs(row["baseline_ms"] - row["ours_ms"]) < max(row["baseline_spread_ms"], row["ours_spread_ms"])
            row["verdict"] = "tie" if tied else (ours if row["ours_ms"] < row["baseline_ms"] else baseline)
        else:
            row["baseline_over_ours"] = float("nan")
            row["verdict"] = "/".join(sorted(set(g.loc[g["status"] != OK, "status"].astype(str)))) or "not measured"
        rows.append(row)
    summary = pd.DataFrame(rows)
    return summary.assign(baseline=baseline, ours=ours)


# --------------------------------------------------------------------------------------------------
# Host cost per call: what issuing one forward+backward costs the CPU, beside its GPU time
# --------------------------------------------------------------------------------------------------

#: What the host-cost table compares: ours, then SDPA pinned to each fast backend.
HOST_IMPLS = ("ours", "sdpa_flash", "sdpa_cudnn")
#: One row of the host-cost summary.
HOST_KEYS = ("batch", "heads", "seq_len", "head_dim", "layout")


def run_host_overhead(shapes: Sequence[Sequence[int]], layouts: Sequence[str], dtype: str = "bfloat16",
                      rounds: int = 5, calls: int = 20, impls: Sequence[str] = HOST_IMPLS) -> pd.DataFrame:
    """Host µs, GPU µs and wall µs per causal forward+backward, every round of every implementation
    (:func:`cs336_systems.benchmarking.flash_host_overhead.measure`: alternating, in rotating order), per
    (batch, heads, seq, head_dim) shape and memory layout."""
    from cs336_systems.benchmarking import flash_host_overhead

    frames = [flash_host_overhead.measure(tuple(shape), getattr(torch, dtype), True, tuple(impls),  # type: ignore[arg-type]
                                          rounds, calls, layout=layout)
              for shape in shapes for layout in layouts]
    return pd.concat(frames, ignore_index=True)


def summarize_host_overhead(rows: pd.DataFrame) -> pd.DataFrame:
    """Per shape, layout and implementation: median host, GPU and wall µs over the rounds, the host time's
    spread (max - min), and ``bound``: ``host`` when issuing a call takes longer than the GPU runs it."""
    from cs336_systems.benchmarking.flash_host_overhead import summarize

    out = summarize(rows, by=HOST_KEYS)
    out["bound"] = ["host" if h > gpu else "GPU" for h, gpu in zip(out["host_us"], out["gpu_us"])]
    return out


# --------------------------------------------------------------------------------------------------
# Where the losing shapes lose: ours' kernels against cuDNN's at the worst shapes of the grid (a profile)
# --------------------------------------------------------------------------------------------------

#: Kernel-name fragments by the phase the kernel serves: ours (``flash_forward*``, ``flash_backward_*``) and
#: cuDNN's (``..._fprop_...``, ``..._bprop_...`` and its backward's pre- and post-passes).
KERNEL_PHASES = (("forward", ("flash_forward", "fprop")),
                 ("backward", ("flash_backward", "bprop", "dot_do_o", "convert_dq")))
#: What the losers part profiles: ours against the backend the shapes grid is judged by.
LOSERS_IMPLS = ("ours", "sdpa_cudnn")


def kernel_phase(name: str) -> str:
    """``forward``, ``backward`` or ``other`` (memsets, copies) for a GPU kernel's name."""
    for phase, fragments in KERNEL_PHASES:
        if any(f in name for f in fragments):
            return phase
    return "other"


def worst_shapes(ratio: pd.DataFrame, column: str = "vs_sdpa_cudnn", count: int = 6,
                 pass_: str = "forward+backward") -> pd.DataFrame:
    """The ``count`` shapes of ``pass_`` where ours loses most (``column``, a backend's time over ours, lowest)."""
    if column not in ratio:
        raise ValueError(f"the shapes table has no {column!r} column (columns: {', '.join(map(str, ratio.columns))})")
    rows = ratio[(ratio["pass"] == pass_) & ratio[column].notna()].sort_values(column).head(count)
    return rows[[*SHAPE_CELL, column]].reset_index(drop=True)


def run_losers(shapes: pd.DataFrame, rounds: int = 3, calls: int = 20) -> pd.DataFrame:
    """GPU µs per forward+backward call of every kernel, ours and cuDNN's, at each shape of ``shapes`` (rows of
    :func:`worst_shapes`; contiguous inputs, as the grid ran), medians over alternating rounds."""
    from cs336_systems.benchmarking import flash_host_overhead

    rows = []
    for _, s in shapes.iterrows():
        shape = (int(s["batch"]), int(s["heads"]), int(s["seq_len"]), int(s["head_dim"]))
        measured = flash_host_overhead.measure(shape, getattr(torch, str(s["dtype"])), bool(s["causal"]),
                                               LOSERS_IMPLS, rounds, calls, kernels=True)
        per_kernel = flash_host_overhead.kernel_table(measured)
        keys = {k: s[k] for k in SHAPE_CELL}
        for impl in per_kernel.columns:
            for name, us in per_kernel[impl].dropna().items():
                rows.append({**keys, "impl": impl, "kernel": name, "phase": kernel_phase(str(name)), "gpu_us": us})
    return pd.DataFrame(rows)


def summarize_losers(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per shape: ours' and cuDNN's GPU µs per phase, the gap (ours - cuDNN) per phase, the phase where ours
    loses most (``loses_most_in``) and ours' slowest kernel."""
    rows = []
    for cell, g in kernels.groupby(SHAPE_CELL, sort=False):
        row: dict[str, Any] = dict(zip(SHAPE_CELL, cell))
        for impl, label in zip(LOSERS_IMPLS, ("ours", "cudnn")):
            mine = g[g["impl"] == impl]
            for phase in ("forward", "backward", "other"):
                row[f"{label}_{phase}_us"] = float(mine.loc[mine["phase"] == phase, "gpu_us"].sum())
            row[f"{label}_total_us"] = float(mine["gpu_us"].sum())
        gaps = {phase: row[f"ours_{phase}_us"] - row[f"cudnn_{phase}_us"] for phase in ("forward", "backward")}
        row.update({f"{phase}_gap_us": gap for phase, gap in gaps.items()})
        row["loses_most_in"] = max(gaps, key=lambda phase: gaps[phase])
        ours = g[g["impl"] == LOSERS_IMPLS[0]]
        row["ours_slowest_kernel"] = str(ours.loc[ours["gpu_us"].idxmax(), "kernel"]) if len(ours) else ""
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------

PARTS = ("leaderboard", "sweep", "model", "breakdown", "shapes", "model_ab", "host", "losers")


@dataclass(frozen=True)
class Params:
    parts: list[str] = param(["leaderboard", "sweep", "model", "host"], f"what to run, of {', '.join(PARTS)}")
    seq_lens: list[int] = param(SWEEP_SEQ_LENS, "sweep: sequence lengths")
    head_dims: list[int] = param(SWEEP_HEAD_DIMS, "sweep: head dimensions")
    dtypes: list[str] = param(SWEEP_DTYPES, "sweep: torch dtype names")
    warmup_ms: float = param(5.0, "do_bench warm-up per timing")
    rep_ms: float = param(25.0, "do_bench measuring time per timing")
    sweep_budget_s: float = param(600.0, "sweep: time budget in seconds")
    lb_batch: int = param(16, "leaderboard: batch (heads folded in)")
    lb_seq_len: int = param(16384, "leaderboard: sequence length")
    lb_head_dims: list[int] = param([64, 128], "leaderboard and breakdown: head dimensions")
    contexts: list[int] = param([1024, 2048, 4096, 8192, 16384], "model: context lengths")
    model: str = param("small", "model: preset")
    model_steps: int = param(3, "model: timed steps per cell")
    model_budget_s: float = param(120.0, "model: time budget in seconds")
    shapes: list[list[int]] = param(SHAPES_BHN, "shapes: [batch, heads, seq_len] triples")
    shapes_head_dims: list[int] = param([64, 128], "shapes: head dimensions")
    shapes_dtypes: list[str] = param(["bfloat16", "float16"], "shapes: torch dtype names")
    shapes_causal: list[bool] = param([True, False], "shapes: causal settings")
    shapes_budget_s: float = param(540.0, "shapes: time budget in seconds")
    shapes_rounds: int = param(3, "shapes: alternating rounds per shape (the implementations in turn, the order "
                                  "rotating)")
    ab_presets: list[str] = param(["small", "medium", "xl"], "model_ab: presets")
    ab_contexts: list[int] = param([1024, 2048, 4096], "model_ab: context lengths")
    ab_compile: list[bool] = param([False, True], "model_ab: eager and/or torch.compile'd steps")
    ab_impls: list[str] = param(list(MODEL_AB_IMPLS), "model_ab: baseline attention, then ours")
    ab_tokens_per_step: int = param(8192, "model_ab: tokens per step (batch = tokens / context)")
    ab_rounds: int = param(2, "model_ab: alternating rounds per cell")
    ab_only_rounds: list[int] = param([], "model_ab: measure only these of the cell's rounds (0-based; a later job "
                                          "measures the rest; empty: all)")
    ab_steps: int = param(5, "model_ab: timed steps per implementation and round")
    ab_budget_s: float = param(540.0, "model_ab: time budget in seconds")
    host_shapes: list[list[int]] = param([[1, 16, 1024, 64], [8, 12, 1024, 64], [8, 25, 1024, 64], [4, 32, 1024, 80]],
                                         "host: [batch, heads, seq_len, head_dim] (the issue's, then small, xl "
                                         "and 2.7B at 8,192 or 4,096 tokens)")
    host_layouts: list[str] = param(["bhsd", "bshd"], "host: contiguous (batch, heads, seq, d) and/or the "
                                                      "model's head views of (batch, seq, heads, d)")
    host_rounds: int = param(5, "host: alternating rounds per shape")
    host_calls: int = param(20, "host: calls per measurement")
    losers: int = param(6, "losers: how many of the shapes grid's worst shapes (against cuDNN) to profile")
    losers_rounds: int = param(3, "losers: alternating rounds per shape")
    candidates: str = param("default", "kernel tiles tried by the autotuner: default | wide")
    autotune: bool = param(True, "False: each phase's first tile, untuned")
    poly_exp2: str | None = param(None, "phases on the FMA-pipe exponential: forward,dkdv,dq | all | none "
                                        "(None: each tile's pin)")
    gluon: bool = param(True, "the warp-specialized Gluon forward on Hopper (False: the Triton forward)")

    def check(self) -> None:
        check_parts("flash_benchmarking", self.parts, PARTS)
        if self.candidates not in CANDIDATE_SETS:
            raise ValueError(f"flash_benchmarking: candidates must be one of {', '.join(CANDIDATE_SETS)}")
        if "host" in self.parts:
            from cs336_systems.benchmarking.flash_host_overhead import LAYOUTS

            check_positive(host_rounds=self.host_rounds, host_calls=self.host_calls)
            bad = [s for s in self.host_shapes if len(s) != 4 or min(s) < 1]
            if bad:
                raise ValueError(f"flash_benchmarking: host_shapes takes [batch, heads, seq_len, head_dim] of positive "
                                 f"sizes, got {bad[0]}")
            if not self.host_layouts or set(self.host_layouts) - set(LAYOUTS):
                raise ValueError(f"flash_benchmarking: host_layouts takes some of {', '.join(LAYOUTS)}, "
                                 f"got {self.host_layouts}")
        if "shapes" in self.parts:
            check_positive(shapes_rounds=self.shapes_rounds)
        if "losers" in self.parts:
            check_positive(losers=self.losers, losers_rounds=self.losers_rounds)
        if "model_ab" in self.parts:
            if len(self.ab_impls) != 2:
                raise ValueError(f"flash_benchmarking: ab_impls takes two attention implementations (the baseline, "
                                 f"then ours), got {self.ab_impls}")
            check_presets(*self.ab_presets)
            check_positive(ab_rounds=self.ab_rounds, ab_steps=self.ab_steps,
                           ab_tokens_per_step=self.ab_tokens_per_step, ab_budget_s=self.ab_budget_s)
            outside = [r for r in self.ab_only_rounds if not 0 <= r < self.ab_rounds]
            if outside:
                raise ValueError(f"flash_benchmarking: ab_only_rounds={self.ab_only_rounds} names round {outside[0]}, "
                                 f"not one of ab_rounds={self.ab_rounds} (0..{self.ab_rounds - 1})")
            bad = [c for c in self.ab_contexts if c < 1 or self.ab_tokens_per_step % c]
            if bad:
                raise ValueError(f"flash_benchmarking: ab_tokens_per_step={self.ab_tokens_per_step} is not a multiple "
                                 f"of context {bad[0]}")


PRESETS = {
    "full": Params(),
    "quick": Params(seq_lens=[2**i for i in range(7, 17, 2)], sweep_budget_s=240.0, contexts=[1024, 4096, 16384],
                    model_budget_s=60.0),
    "smoke": Params(seq_lens=[32], head_dims=[16], dtypes=["float32"], warmup_ms=1.0, rep_ms=2.0,
                    shapes=[[2, 2, 24], [1, 2, 40]], shapes_head_dims=[16], shapes_dtypes=["float32"],
                    shapes_causal=[True, False], shapes_budget_s=30.0,
                    sweep_budget_s=30.0, lb_batch=2, lb_seq_len=64, lb_head_dims=[16], contexts=[16],
                    model="tiny", model_steps=1, model_budget_s=30.0,
                    ab_presets=["tiny"], ab_contexts=[16, 32], ab_impls=["sdpa", "flash_pytorch"],
                    ab_tokens_per_step=64, ab_steps=1, ab_budget_s=60.0),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """Run the parts ``p.parts`` names under ``p``'s kernel options and write their tables and figures."""
    changes: dict[str, Any] = {"candidates": CANDIDATE_SETS[p.candidates], "autotune": p.autotune, "gluon": p.gluon}
    if p.poly_exp2 is not None:
        changes["poly_exp2"] = p.poly_exp2
    with options.use(**changes):
        # Provenance: the kernel options every artefact was measured under.
        out.params.update(poly_exp2=_poly_exp2_label(), kernel_options=options.current().describe())
        return _run_parts(p, out)


def _run_parts(p: Params, out: ResultWriter) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands, smoke = p.parts, out.smoke
    if "leaderboard" in commands:
        for head_dim in p.lb_head_dims:
            started = time.monotonic()
            table = run_leaderboard(p.lb_batch, p.lb_seq_len, head_dim)
            suffix = "" if head_dim == 64 else f"_d{head_dim}"
            out.table(table, f"leaderboard{suffix}", params={"head_dim": head_dim})
            summary = leaderboard_summary(table, ours=table["impl"].iloc[0])
            out.json(summary, f"leaderboard{suffix}_summary", params={"head_dim": head_dim})
            print(table.to_markdown(index=False, floatfmt=".4g"))
            print(f"leaderboard d={head_dim} took {time.monotonic() - started:.0f} s")
            results[f"leaderboard{suffix}"] = table
    if "sweep" in commands:
        # One table per dtype, each within its own budget: the handout's full grid is longer than one GPU job
        # may run, so `--set dtypes=bfloat16` and `--set dtypes=float32` can refresh it in two runs.
        for dtype in p.dtypes:
            started = time.monotonic()
            long = run_flash_sweep(p.seq_lens, p.head_dims, [dtype], warmup_ms=p.warmup_ms, rep_ms=p.rep_ms,
                                   budget_s=p.sweep_budget_s)
            out.table(long, f"sweep_{dtype}")
            results[f"sweep_{dtype}"] = long
            print(f"sweep {dtype} took {time.monotonic() - started:.0f} s")
        # The speed-up table and figures are derived (Section.execute, replot) from every per-dtype table in
        # the results folder, so a run of one dtype combines with an earlier run of the other.
    if "breakdown" in commands:
        if smoke and not flash_triton.interpreter_enabled():
            print("breakdown skipped: it times the Triton kernels, which need a GPU (or TRITON_INTERPRET=1)")
        else:
            started = time.monotonic()
            parts = [run_kernel_breakdown(p.lb_batch, p.lb_seq_len, d) for d in p.lb_head_dims]
            summary = pd.DataFrame([p[0] for p in parts])
            kernels = pd.concat([p[1] for p in parts], ignore_index=True)
            tuning = pd.concat([p[2] for p in parts], ignore_index=True)
            extra = {"options": options.current().describe(), "poly_exp2": _poly_exp2_label()}
            out.table(summary, "kernel_breakdown", params=extra)
            out.table(kernels, "kernel_breakdown_kernels", params=extra)
            out.table(tuning, "kernel_breakdown_tuning", params=extra)
            print(summary.to_markdown(index=False, floatfmt=".4g"))
            ours = kernels[kernels["matmuls"].notna()]
            print(ours[["head_dim", "name", "calls", "total_ms", "percent", "TFLOP_per_s"]].to_markdown(
                index=False, floatfmt=".4g"))
            print(tuning.to_markdown(index=False, floatfmt=".4g"))
            print(f"breakdown took {time.monotonic() - started:.0f} s")
            results.update(kernel_breakdown=summary, kernel_breakdown_kernels=kernels, kernel_breakdown_tuning=tuning)
    if "shapes" in commands:
        started = time.monotonic()
        impls = SHAPES_IMPLS if torch.cuda.is_available() else SHAPES_SMOKE_IMPLS
        long = run_shapes(p.shapes, p.shapes_head_dims, p.shapes_dtypes, p.shapes_causal, impls,
                          rounds=p.shapes_rounds, warmup_ms=p.warmup_ms, rep_ms=p.rep_ms, budget_s=p.shapes_budget_s)
        out.table(long, "shapes")
        ratio = shapes_ratio(long, ours=impls[0])
        out.table(ratio, "shapes_ratio")
        baseline = "sdpa_cudnn" if "sdpa_cudnn" in impls else impls[-1]
        summary = shapes_summary(ratio, baseline)
        out.json(summary, "shapes_summary")
        if ratio[f"vs_{baseline}"].notna().any():
            out.figure(plot_shapes(ratio, f"vs_{baseline}"), "shapes_ratio")
        print(ratio.to_markdown(index=False, floatfmt=".3g"))
        print(summary)
        print(f"shapes took {time.monotonic() - started:.0f} s")
        results.update(shapes=long, shapes_ratio=ratio, shapes_summary=summary)
    if "model" in commands:
        started = time.monotonic()
        impls = ("naive", "sdpa", "flash_triton") if not smoke else ("naive", "sdpa", "flash_pytorch")
        table = run_model_comparison(
            p.contexts, impls, model=p.model, budget_s=p.model_budget_s,
            precision="fp32" if smoke else "bf16",
            warmup=min(2, p.model_steps),
            steps=p.model_steps,
        )  # fmt: skip
        out.table(table, "model_step")
        out.figure(plot_model_comparison(table), "model_step")
        cols = [
            c
            for c in ("context_length", "attention_impl", "status", "total_mean_ms", "peak_memory_GiB")
            if c in table
        ]
        print(table[cols].to_markdown(index=False, floatfmt=".4g"))
        print(f"model comparison took {time.monotonic() - started:.0f} s")
        results["model_step"] = table
    if "host" in commands:
        if not torch.cuda.is_available():
            print("host skipped: it measures what CUDA launches cost the CPU, which needs a GPU")
        else:
            started = time.monotonic()
            rows = run_host_overhead(p.host_shapes, p.host_layouts, rounds=p.host_rounds, calls=p.host_calls)
            summary = summarize_host_overhead(rows)
            out.table(rows, "host_overhead")
            out.table(summary, "host_overhead_summary",
                      extra={"host_us": "CPU µs to issue one forward+backward (the GPU kept busy)",
                             "gpu_us": "the kernels' GPU µs per call", "wall_us": "µs per call back to back"})
            print(summary.to_markdown(index=False, floatfmt=".1f"))
            print(f"host overhead took {time.monotonic() - started:.0f} s")
            results.update(host_overhead=rows, host_overhead_summary=summary)
    if "losers" in commands:
        # The worst shapes come from this job's shapes grid, or from an earlier job's at this commit and device.
        ratio = results.get("shapes_ratio")
        if ratio is None and torch.cuda.is_available():
            ratio = rows_of_this_run(out, "shapes_ratio", out.params, ("shapes", "shapes_head_dims", "shapes_dtypes",
                                                                       "shapes_causal", "kernel_options"))
        if not torch.cuda.is_available():
            print("losers skipped: it profiles GPU kernels, which needs a GPU")
        elif ratio is None or "vs_sdpa_cudnn" not in ratio:
            print("losers skipped: it needs this commit's shapes grid against sdpa_cudnn; run --set parts=shapes "
                  "first (or with it)")
        else:
            started = time.monotonic()
            shapes = worst_shapes(ratio, count=p.losers)
            kernels = run_losers(shapes, rounds=p.losers_rounds)
            summary = summarize_losers(kernels)
            out.table(kernels, "losers_kernels", extra={"gpu_us": "median GPU µs per forward+backward call"})
            out.table(summary, "losers", extra={"loses_most_in": "the phase with the largest gap, ours - cuDNN"})
            print(summary.to_markdown(index=False, floatfmt=".1f"))
            print(f"losers took {time.monotonic() - started:.0f} s")
            results.update(losers=summary, losers_kernels=kernels)
    if "model_ab" in commands:
        started = time.monotonic()
        table = run_model_ab(p.ab_presets, p.ab_contexts, p.ab_compile, impls=p.ab_impls, rounds=p.ab_rounds,
                             only_rounds=p.ab_only_rounds,
                             tokens_per_step=p.ab_tokens_per_step, precision="fp32" if smoke else "bf16",
                             steps=p.ab_steps, budget_s=p.ab_budget_s)
        # Split over jobs by preset, compile or round (the grid is longer than one GPU job): rounds of an earlier
        # job of this commit, device and step settings stay, rounds measured again are replaced.
        earlier = rows_of_this_run(out, "model_ab", out.params, MODEL_AB_SAME)  # as recorded: kernel options too
        table = merge_rows(table, earlier, MODEL_AB_ROUND)
        summary = summarize_model_ab(table, *p.ab_impls[:2])
        out.table(table, "model_ab")
        out.table(summary, "model_ab_summary")
        print(summary.to_markdown(index=False, floatfmt=".4g"))
        print(f"model A/B took {time.monotonic() - started:.0f} s")
        results.update(model_ab=table, model_ab_summary=summary)
    return results




#: The sweep's measured tables, one per dtype (the first is the handout's primary).
SWEEP_TABLES = tuple(f"sweep_{dtype}" for dtype in SWEEP_DTYPES)


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Any:
    """The speed-up table and the two sweep figures from whichever per-dtype sweep tables exist."""
    from cs336_systems.replot import Derived

    present = [name for name in SWEEP_TABLES if tables.get(name) is not None]
    if not present:
        raise ValueError(f"no sweep table among {', '.join(SWEEP_TABLES)}")
    long = pd.concat([tables[name] for name in present], ignore_index=True)
    # Ours is the Triton kernel; a CPU smoke run has only the PyTorch-tiled one.
    ours = "triton" if (long["impl"] == "triton").any() else "flash_pytorch"
    table = speedup_table(long, ours=ours)
    figures = {}
    if table["speedup_vs_builtin"].notna().any():
        figures["sweep_speedup"] = (plot_speedup(table), present[0])
    if ((long["head_dim"] == 64) & (long["status"] == OK)).any():
        figures["sweep_latency_d64"] = (plot_latency(long, head_dim=64), present[0])
    return Derived(tables={"sweep_speedup": (table, present[0])}, figures=figures)


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import mfu_note, with_mfu  # noqa: E402  (answers only)


def answer(d: SectionData) -> list[Block]:
    return [
        question(d, "flash_forward", "FlashAttention-2 forward in PyTorch and in Triton, with a causal flag.", [
            Text("The forward pass tiles $Q$ into row blocks of $B_q$ rows and streams $K, V$ in column blocks of "
                 "$B_k$ rows, keeping a running row maximum $m$, normalizer $\\ell$ and unnormalized output "
                 "$\\tilde O$ in on-chip memory; per key block $j$:"),
            Equation([
                (r"S^{(j)} = Q_i K_j^\top/\sqrt{d},\quad m^{(j)} = \max\left(m^{(j-1)}, \mathrm{rowmax}\,S^{(j)}\right),"
                r"\quad \tilde P^{(j)} = \exp\left(S^{(j)} - m^{(j)}\right)"),
                (r"\ell^{(j)} = e^{m^{(j-1)} - m^{(j)}}\,\ell^{(j-1)} + \mathrm{rowsum}\,\tilde P^{(j)},\quad "
                r"\tilde O^{(j)} = \mathrm{diag}\left(e^{m^{(j-1)} - m^{(j)}}\right)\tilde O^{(j-1)} + \tilde P^{(j)} V_j"),
                r"O_i = \mathrm{diag}\left(\ell\right)^{-1}\tilde O,\qquad L_i = m + \log \ell",
            ]),
            Text("With the causal flag, key blocks entirely above the diagonal are skipped and the diagonal block "
                 "is masked with $-10^6$ before the maximum."),
        ]),
        question(d, "flash_backward", "The backward pass by recomputation.", [
            Text("Only $O$ and $L$ are saved. With $D = \\mathrm{rowsum}(O \\circ dO)$ the backward recomputes "
                 "$P = \\exp(S - L)$ tile by tile:"),
            Equation([
                r"dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),",
                r"dQ = dS\,K/\sqrt{d},\quad dK = dS^\top Q/\sqrt{d}",
            ]),
            Text("It exists twice: `FlashAttentionPytorch` does it in tiled PyTorch under `torch.compile` (the "
                 "handout's version), and `FlashAttentionTriton`, the implementation benchmarked below, in two "
                 "Triton kernels: the first owns a query block, computes its $D$ from the $O$ and $dO$ tiles it "
                 "loads and accumulates $dQ$ over the key blocks, writing $L$ and $D$ for the second, which owns "
                 "a key block and accumulates $dK, dV$ over the query blocks; no two programs write the same "
                 "output and no atomics are needed. Its forward is a Triton kernel, or on Hopper "
                 "a warp-specialized Gluon kernel with TMA loads."),
        ]),
        question(d, "flash_benchmarking", "Triton FlashAttention-2 versus PyTorch attention (batch 1, causal) over "
                 "sequence lengths $2^7$–$2^{16}$, head sizes $2^4$–$2^7$, bf16 and fp32: forward, backward and "
                 "forward + backward latency.", _flash_sweep(d), what="the FlashAttention benchmark sweep"),
        question(d, "leaderboard", "Leaderboard timing: forward + backward, batch 1, $T = 16384$, "
                 "$d_{\\mathrm{model}} = 1024$ in 16 heads, bf16, causal.", _leaderboard(d),
                 what="the leaderboard timing"),
        question(d, "model", "The Transformer's training step with each attention implementation.", [
            _model_step_sentence(d.frame("model_step")),
            d.table("model_step", frame=_model_step_table(d.frame("model_step"), d.meta("model_step")),
                    caption="Training step (forward, backward, AdamW) by context length, one column group per "
                            "attention: mean ms, MFU and peak memory (OOM: out of memory; spreads and the "
                            "forward/backward/optimizer split: the CSV)." + mfu_note(d.meta("model_step"), ("bf16",))),
            d.figure("model_step", caption="Step time and peak memory by context length."),
        ]),
        *_shapes(d),
        *_losers(d),
        *_host(d),
        *_model_ab(d),
    ]


def _losers(d: SectionData) -> list[Block]:
    """Beyond the handout: where the worst shapes of the grid lose, kernel by kernel (empty without results)."""
    summary = d.frame("losers")
    if summary is None or summary.empty or "loses_most_in" not in summary:
        return []
    counts = summary["loses_most_in"].value_counts()
    slowest = summary["ours_slowest_kernel"].value_counts()
    text = (f"Profiled at the {len(summary)} shapes where ours loses most to cuDNN (forward+backward, GPU time per "
            "kernel, alternating): the larger part of the gap lies in the "
            + join_words([f"{phase} at {n}" for phase, n in counts.items()])
            + "; our slowest kernel there: " + join_words([f"`{k}` at {n}" for k, n in slowest.items()]) + ". "
            + _losers_per_shape(summary) + " (GPU µs per call by phase and kernel: `losers.csv`, "
            "`losers_kernels.csv` in the results index)")
    levers = [_forward_lever(summary[summary["loses_most_in"] == "forward"]) if phase == "forward" else
              LOSER_LEVERS[phase] for phase in counts.index if phase in LOSER_LEVERS]
    if levers:
        text += ". What would close the gap (predictions from the kernels' profiles, not yet measured): " + \
            "; ".join(levers)
    d.frame("losers_kernels")  # cited above, listed in the index
    return [question(d, "losers", "Beyond the handout: where the shapes that lose most lose, from a profile.",
                     [Text(text + ".")])]


#: Per losing phase, the lever the kernel notes point to (``docs/flash_attention/NOTES.md``, "Next levers").
LOSER_LEVERS = {
    "backward": "in the backward, our dK/dV and dQ kernels each recompute $QK^T$ and $P$, seven products where "
                "cuDNN's fused backward does five; accumulating dQ inside the dK/dV kernel (FlashAttention-3's "
                "schedule) removes two, at the price of a reduction that 128-key tiles keep small",
    "forward": "the tile is already chosen per sequence length; what is left is more work per program at short "
               "sequences (two programs resident per SM, or a persistent schedule), and `flash_host_overhead "
               "--variant` A/Bs tiles at any shape without code changes",
}


def _forward_lever(shapes: pd.DataFrame) -> str:
    """Why the forward loses at ``shapes``, from the Hopper forward's tile arithmetic (``tile_for``, the tile it
    runs at each length): how many of the rows its query tiles compute are padding, and how few key blocks a
    program streams through its ring."""
    from cs336_systems.attention.flash_fwd_sm90 import TILES, tile_for

    facts = []
    for seq, d in sorted({(int(r["seq_len"]), int(r["head_dim"])) for _, r in shapes.iterrows()}):
        if d not in TILES:
            continue
        block_m, block_n, stages = tile_for(d, seq)
        rows = math.ceil(seq / block_m) * block_m
        facts.append(f"at {seq:,} tokens and d = {d}, {block_m}-row query tiles compute {rows:,} rows "
                     f"({1 - seq / rows:.0%} padding) and a program streams at most {math.ceil(seq / block_n)} "
                     f"{block_n}-key blocks through a {stages}-deep ring")
    why = ("in the forward, " + "; ".join(facts)
           + ", so a program spends much of its time filling and draining its pipeline (from the tile arithmetic, "
             "not profiled per instruction); ") if facts else "in the forward, "
    return why + LOSER_LEVERS["forward"]


def _losers_per_shape(summary: pd.DataFrame) -> str:
    """Each profiled shape with ours' and cuDNN's forward and backward µs, in one sentence."""
    def shape(r: pd.Series) -> str:
        return (f"{r['dtype']} ({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, {int(r['head_dim'])})"
                f"{' causal' if str(r['causal']) == 'True' else ''}")

    return "Forward and backward, ours against cuDNN's, in µs: " + "; ".join(
        f"{shape(r)} {fmt.sig(r['ours_forward_us'])}/{fmt.sig(r['cudnn_forward_us'])} and "
        f"{fmt.sig(r['ours_backward_us'])}/{fmt.sig(r['cudnn_backward_us'])}" for _, r in summary.iterrows())


#: The issue's goal for our host cost per forward+backward, in µs.
HOST_GOAL_US = 30.0


def _host(d: SectionData) -> list[Block]:
    """Beyond the handout: CPU µs per call against the GPU's, ours and SDPA's (empty without results)."""
    summary = d.frame("host_overhead_summary")
    if summary is None or summary.empty or "impl" not in summary:
        return []
    keyed = summary.set_index([*HOST_KEYS, "impl"])["host_us"].unstack("impl")
    ours = summary[summary["impl"] == "ours"]

    def span(values: pd.Series, unit: str = " µs", show: Callable[[Any], str] = fmt.sig) -> str:
        lo, hi = show(values.min()), show(values.max())
        return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"

    text = (f"Issuing one causal forward+backward costs our attention {span(ours['host_us'])} of CPU time over "
            f"{len(ours)} shape{'' if len(ours) == 1 else 's'} and layouts (the goal: {HOST_GOAL_US:g} µs)")
    if "sdpa_cudnn" in keyed and "ours" in keyed:
        over = (keyed["ours"] / keyed["sdpa_cudnn"]).dropna()
        text += (f"; SDPA pinned to cuDNN costs {span(keyed['sdpa_cudnn'].dropna())} on the same host, so ours "
                 f"takes {span(over, '', fmt.ratio)} cuDNN's host time. The forward and backward through "
                 "`torch.autograd.grad` are in both numbers")
    host_bound = ours[ours["bound"] == "host"]
    text += (f". Ours is host-bound (issuing a call takes longer than the GPU runs it) at {len(host_bound)} of "
             f"{len(ours)}" + (": " + join_words([f"({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, "
                                                  f"{int(r['head_dim'])}) {r['layout']}"
                                                  for _, r in host_bound.iterrows()]) if len(host_bound) else "")
             + "; there a call's wall time is the host's, unless a CUDA graph replays it (§1.4's compiled steps)."
             " Measured with `python -m cs336_systems.benchmarking.flash_host_overhead` (GPU asleep while the host"
             " issues the calls; `docs/flash_attention/host_overhead.md` has the method and the profile).")
    return [question(d, "host", "Beyond the handout: what one call costs the CPU, beside what it costs the GPU.", [
        Text(text),
        d.table("host_overhead_summary", frame=_host_table(summary), caption="Median over alternating rounds of "
                "the CPU µs to issue one forward+backward and of the kernels' GPU µs, per implementation, bf16, "
                "causal (spreads and wall times: the CSV)."),
    ])]


def _host_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per shape and layout: each implementation's host µs, then its GPU µs."""
    wide = summary.pivot_table(index=list(HOST_KEYS), columns="impl", values=["host_us", "gpu_us"], sort=False)
    impls = list(dict.fromkeys(summary["impl"]))
    wide = wide.reindex(columns=[(v, i) for v in ("host_us", "gpu_us") for i in impls if (v, i) in wide.columns])
    wide.columns = [f"{impl} {value.removesuffix('_us')} µs" for value, impl in wide.columns]
    return wide.reset_index()


def _model_ab(d: SectionData) -> list[Block]:
    """Beyond the handout: our attention against SDPA inside the model's training step (empty without results)."""
    summary = d.frame("model_ab_summary")
    if summary is None or summary.empty or "verdict" not in summary:
        return []
    baseline, ours = str(summary["baseline"].iloc[0]), str(summary["ours"].iloc[0])
    measured = summary[summary["baseline_over_ours"].notna()]
    counts = measured["verdict"].value_counts()
    ties = int(counts.get("tie", 0))

    def where(r: pd.Series) -> str:
        return f"{r['preset']} at {int(r['context_length']):,}, {'compiled' if r['compile'] else 'eager'}"

    def wins(impl: str) -> str:
        won = measured[measured["verdict"] == impl]
        return f"{impl} faster in {len(won)}" + (f" ({'; '.join(where(r) for _, r in won.iterrows())})"
                                                  if len(won) else "")

    parts = [f"{ties} tie{'' if ties == 1 else 's'} (the medians differ by less than the larger spread of the "
             "rounds)", wins(ours), wins(baseline)]
    text = (f"Over {len(measured)} cell{'' if len(measured) == 1 else 's'} (preset × context × eager or compiled) "
            "measured in alternating rounds: " + ", ".join(parts))
    if len(measured):
        ratio = measured["baseline_over_ours"]
        lo, hi = measured.loc[ratio.idxmin()], measured.loc[ratio.idxmax()]

        text += (f"; {baseline}'s time over ours is {fmt.ratio(lo['baseline_over_ours'])} ({where(lo)})"
                 if len(measured) == 1 else
                 f"; {baseline}'s time over ours runs from {fmt.ratio(lo['baseline_over_ours'])} ({where(lo)}) "
                 f"to {fmt.ratio(hi['baseline_over_ours'])} ({where(hi)})")
    missing = summary[summary["baseline_over_ours"].isna()]
    if len(missing):
        text += "; not measured: " + join_words([f"{r['preset']} at {int(r['context_length']):,} "
                                                 f"({'compiled' if r['compile'] else 'eager'}, {r['verdict']})"
                                                 for _, r in missing.iterrows()])
    absent = _model_ab_absent(summary, d.meta("model_ab_summary").get("params") or {}, _model_ab_planned())
    if absent:
        text += ("; the grid's " + join_words([f"{p} at {c:,} ({'compiled' if k else 'eager'})" for p, c, k in absent])
                 + " not measured yet (the full run's model_ab jobs, listed by `python -m "
                 "cs336_systems.experiments flash_benchmarking --help`)")
    if measured["compile"].any():  # what "compiled" means here, unlike §1.4's graph-replayed steps
        text += (". Compiled is `torch.compile(model)` in its default mode with `cs336_basics`' AdamW stepping "
                 "eagerly: no CUDA graphs, so each attention call still pays its custom operators' host path")
    return [question(d, "model_ab", f"Beyond the handout: {ours} against {baseline} inside the model's training "
                     "step, eager and compiled, alternating in one process.", [
        Text(text + "."),
        d.table("model_ab_summary", frame=_model_ab_table(summary, baseline, ours), caption=f"Median training "
                f"step (forward, backward, AdamW) of our model with each attention over alternating rounds, eager "
                f"and compiled, and the verdict against the spread of the rounds (spreads and the ratio "
                f"{baseline} / ours: the CSV)."),
    ])]


def _model_ab_grid(params: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """The cells ``ab_presets`` × ``ab_contexts`` × ``ab_compile`` of a parameter record."""
    return [(str(p), int(c), bool(k)) for p in params.get("ab_presets") or [] for c in params.get("ab_contexts") or []
            for k in params.get("ab_compile") or []]


def _model_ab_absent(summary: pd.DataFrame, params: dict[str, Any],
                     planned: Sequence[tuple[str, int, bool]] = ()) -> list[tuple[str, int, bool]]:
    """Cells of the recorded grid, then of ``planned``, without a row."""
    have = {(str(p), int(c), bool(k)) for p, c, k in zip(summary["preset"], summary["context_length"],
                                                          summary["compile"])}
    grid = _model_ab_grid(params)
    grid += [cell for cell in planned if cell not in grid]
    return [cell for cell in grid if cell not in have]


def _model_ab_planned() -> list[tuple[str, int, bool]]:
    """The cells the full run's model_ab jobs measure between them (each job covers part of the grid, and the
    last job's parameters name only its own part)."""
    defaults = Params()
    cells: list[tuple[str, int, bool]] = []
    for job in SECTION.jobs:
        if "model_ab" in job.sets.get("parts", ()):
            sets = {k: job.sets.get(k, getattr(defaults, k)) for k in ("ab_presets", "ab_contexts", "ab_compile")}
            cells += [cell for cell in _model_ab_grid(sets) if cell not in cells]
    return cells


def _model_ab_table(summary: pd.DataFrame, baseline: str, ours: str) -> pd.DataFrame:
    """One row per (preset, context): each implementation's ms and the verdict, eager, then compiled."""
    rows = []
    for (preset, context), g in summary.groupby(["preset", "context_length"], sort=False):
        row: dict[str, Any] = {"preset": preset, "context_length": context}
        for _, r in g.sort_values("compile").iterrows():
            mode = "compiled" if r["compile"] else "eager"
            row.update({f"{mode} {baseline} ms": r["baseline_ms"], f"{mode} {ours} ms": r["ours_ms"],
                        f"{mode} verdict": r["verdict"]})
        rows.append(row)
    return pd.DataFrame(rows)


def _shapes(d: SectionData) -> list[Block]:
    """Beyond the handout: the shapes grid against SDPA's flash and cuDNN backends (empty without results)."""
    summary = d.json("shapes_summary")
    if not isinstance(summary, dict) or "baseline" not in summary:
        return []
    baseline = summary["baseline"]
    parts = []
    for phase in ("forward+backward", "forward"):
        g = summary.get(phase)
        if isinstance(g, dict):
            spread = (f" (round-to-round spread of a time: median {fmt.pct(g['spread_median'])}, 90th percentile "
                      f"{fmt.pct(g['spread_p90'])})" if "spread_median" in g else "")
            parts.append(f"{phase}: geometric mean {fmt.ratio(g['geomean'])} of {baseline}'s speed over "
                         f"{g['cells']} shapes, lowest {fmt.ratio(g['min'])} ({g['worst']}), "
                         f"{g['below_0.9']} below 0.9× and {g['below_1.0']} below 1.0×{spread}")
    d.frame("shapes")  # the heatmap's data
    return [question(d, "shapes", "Beyond the handout: every shape, against SDPA's flash and cuDNN backends "
                     "(batch 1-8, heads 8-32, sequences 256-65536 including lengths that are no multiple of a "
                     "tile, head dims 64 and 128, bf16 and fp16, causal and not).", [
        Text("Ours against " + baseline + ", as its time over ours (above 1: ours faster): " + "; ".join(parts)
             + "."),
        d.figure("shapes_ratio", caption=f"{baseline} time over ours per shape, dtype and masking."),
        d.table("shapes_ratio", frame=_worst_shapes(d.frame("shapes_ratio"), f"vs_{baseline}"),
                caption=f"The {WORST_SHAPES} shapes where ours loses most to {baseline} (each backend's time "
                        f"over ours, {_rounds_words(summary)}); every shape is in the CSV and the heatmap."),
    ])]


def _rounds_words(summary: Mapping[str, Any]) -> str:
    rounds = summary.get("rounds", 1)
    if rounds == 1:
        return "medians of `do_bench`"
    return f"medians over {rounds} alternating rounds of `do_bench` medians"


#: Rows of the shapes table in the writeup: the losing end of the grid, which is what needs explaining.
WORST_SHAPES = 12


def _worst_shapes(ratio: pd.DataFrame | None, column: str) -> pd.DataFrame | None:
    if ratio is None or column not in ratio:
        return ratio
    shown = [c for c in (*SHAPE_KEYS, "vs_sdpa_flash", "vs_sdpa_cudnn", "vs_sdpa_math", "vs_best") if c in ratio]
    return ratio.sort_values(column).head(WORST_SHAPES)[shown].reset_index(drop=True)


def _flash_sweep(d: SectionData) -> list[Block | None]:
    frames = [f for f in (d.frame(name) for name in SWEEP_TABLES) if f is not None]
    sweep = pd.concat(frames, ignore_index=True) if frames else None  # shown through the speed-up table
    sp = d.frame("sweep_speedup")
    blocks: list[Block | None] = []
    if sp is not None and {"dtype", "pass", "speedup_vs_builtin"} <= set(sp.columns) and len(sp):
        parts = []
        for (dtype, ph), g in sp.groupby(["dtype", "pass"], sort=False):
            v = g["speedup_vs_builtin"].dropna()
            if len(v):
                parts.append(f"{dtype} {ph}: median {fmt.ratio(v.median())} (range {fmt.sig(v.min())}–"
                             f"{fmt.sig(v.max())})")
        naive_text = _naive_sentence(sp, sweep)
        if naive_text is not None:
            blocks.append(naive_text)
        blocks.append(Text("Speed-up of our Triton kernels over the fastest built-in PyTorch attention in each cell "
                           "(built-in time / ours; above 1 means ours is faster): " + "; ".join(parts) + "."))
        for dtype, g in sp.groupby("dtype", sort=False):
            values = [v for v in ("ours_ms", "naive_ms", "best_builtin_ms") if v in g.columns]
            wide = g.pivot_table(index=["seq_len", "head_dim"], columns="pass", values=values, sort=False)
            label = {"ours_ms": "ours", "naive_ms": "PyTorch", "best_builtin_ms": "best SDPA"}
            wide.columns = [f"{ph} {label[k]} ms" for k, ph in wide.columns]
            order = [c for ph in ("forward", "backward", "forward+backward") for c in
                     (f"{ph} ours ms", f"{ph} PyTorch ms", f"{ph} best SDPA ms") if c in wide.columns]
            blocks.append(d.table("sweep_speedup", frame=wide[order].reset_index(), caption=f"Latency (ms) of our "
                                  f"Triton FlashAttention-2, regular PyTorch attention (eager, unfused) and the "
                                  f"fastest SDPA backend, {dtype}, batch 1, causal; blank: out of memory."))
    blocks.append(d.figure("sweep_speedup", caption="Speed-up over the fastest built-in per cell."))
    blocks.append(d.figure("sweep_latency_d64", caption="Latency against sequence length, head size 64."))
    if len([b for b in blocks if b is not None]) == 0:
        blocks += [d.table(name, caption=f"Latency by implementation, head size, sequence length and pass "
                           f"({name.removeprefix('sweep_')}).") for name in SWEEP_TABLES]
    return blocks


def _naive_sentence(sp: pd.DataFrame, sweep: pd.DataFrame | None) -> Text | None:
    """Ours against regular PyTorch attention (what the handout compares with), forward + backward."""
    if "speedup_vs_naive" not in sp.columns:
        return None
    oom = pd.DataFrame()
    if sweep is not None and {"impl", "status", "pass"} <= set(sweep.columns):
        oom = sweep[(sweep["impl"] == "naive") & (sweep["status"] == "OOM") & (sweep["pass"] == "forward+backward")]
    parts = []
    for dtype, g in sp[sp["pass"] == "forward+backward"].groupby("dtype", sort=False):
        v = g.dropna(subset=["speedup_vs_naive"])
        if v.empty:
            continue
        slower = v[v["speedup_vs_naive"] < 1]
        longest = v[v["seq_len"] == v["seq_len"].max()]
        text = (f"{dtype}: in the median cell ours takes {fmt.ratio(1 / v['speedup_vs_naive'].median())} PyTorch's "
                f"time, at {int(longest['seq_len'].iloc[0]):,} tokens "
                f"{fmt.ratio(1 / longest['speedup_vs_naive'].max())}–{fmt.ratio(1 / longest['speedup_vs_naive'].min())}")
        if not slower.empty:
            text += (f"; ours is slower in {len(slower)} of {len(v)} cells, all at or below "
                     f"{int(slower['seq_len'].max()):,} tokens, where fixed per-call costs outweigh the quadratic work")
        mine = oom[oom["dtype"] == dtype] if "dtype" in oom.columns else oom
        if not mine.empty:
            text += f"; PyTorch runs out of memory from {int(mine['seq_len'].min()):,} tokens, ours does not"
        parts.append(text)
    if not parts:
        return None
    return Text("Against regular PyTorch attention (eager, materializing the $T\\times T$ scores), forward + "
                "backward: " + "; ".join(parts) + ".")


def _model_step_table(df: pd.DataFrame | None, meta: dict) -> pd.DataFrame | None:
    """One row per context: each attention's step ms, MFU and peak GiB side by side (its status where not ok)."""
    if df is None or not {"context_length", "attention_impl", "total_mean_ms"} <= set(df.columns):
        return df
    df = with_mfu(df, meta)
    table = pd.DataFrame({"context_length": df["context_length"].unique()})
    for impl, g in df.groupby("attention_impl", sort=False):
        rows = {int(r["context_length"]): r for _, r in g.iterrows()}
        cells: dict[str, list[str]] = {f"{impl} ms": [], f"{impl} MFU %": [], f"{impl} GiB": []}
        for context in table["context_length"]:
            r = rows.get(int(context))
            good = r is not None and str(r.get("status", "ok")) == "ok"
            cells[f"{impl} ms"].append(fmt.sig(r["total_mean_ms"]) if good else "" if r is None else str(r["status"]))
            for key, column in ((f"{impl} MFU %", "MFU_pct"), (f"{impl} GiB", "peak_memory_GiB")):
                v = r.get(column) if good else None
                cells[key].append(f"{v:.1f}" if v is not None and pd.notna(v) else "")
        for key, values in cells.items():
            if any(values):
                table[key] = values
    return table


def _model_step_sentence(df: pd.DataFrame | None) -> Text | None:
    if df is None or not {"context_length", "attention_impl", "total_mean_ms"} <= set(df.columns) or df.empty:
        return None
    longest = df[df["context_length"] == df["context_length"].max()]
    parts = []
    for _, r in longest.iterrows():
        if str(r.get("status", "ok")) == "ok":
            mem = f", {fmt.gib(r['peak_memory_GiB'] * 2**30)}" if pd.notna(r.get("peak_memory_GiB")) else ""
            parts.append(f"{r['attention_impl']} {fmt.ms(r['total_mean_ms'])}{mem}")
        else:
            parts.append(f"{r['attention_impl']} {r['status']}")
    return Text(f"At context {int(longest['context_length'].iloc[0]):,} a training step takes: "
                + join_words(parts) + ".")


def _leaderboard_sentence(summary: dict, head_dim: str = "") -> Text | None:
    ours = summary.get("ours", "triton")
    ms_ = summary.get(f"{ours}_fwd_bwd_ms")
    if ms_ is None:
        return None
    vs = [f"{k.removeprefix('speedup_vs_')} {fmt.ratio(v)}" for k, v in summary.items()
          if k.startswith("speedup_vs_") and isinstance(v, (int, float))]
    lead = f"{head_dim}our kernels" if head_dim else "Our kernels"
    return Text(f"{lead} ({ours}) take {fmt.ms(ms_)} for forward + backward"
                + (f" ({fmt.sig(summary['ours_fwd_bwd_TFLOP_per_s'])} TFLOP/s)"
                   if "ours_fwd_bwd_TFLOP_per_s" in summary else "")
                + ("; speed-up over " + join_words(vs) + " measured in the same run." if vs else "."))


def _leaderboard(d: SectionData) -> list[Block | None]:
    summary = d.json("leaderboard_summary", "leaderboard*_summary")
    text = _leaderboard_sentence(summary) if isinstance(summary, dict) else None
    d128 = d.json("leaderboard_d128_summary") if "leaderboard_d128_summary" in d.records and \
        d.frame_name("leaderboard") else None
    if isinstance(d128, dict) and text is not None:
        extra = _leaderboard_sentence(d128, "With head size 128, ")
        text = Text(text.markdown + (" " + extra.markdown if extra else ""))
    main = d.frame_name("leaderboard", "leaderboard_d*")
    frame = subset(d.frame(main) if main else None, "impl", "fwd_bwd_sum_ms", "fwd_bwd_sum_median_ms", "forward_ms",
                   "fwd_bwd_TFLOP_per_s", "forward_TFLOP_per_s")
    return [text, d.table(main or "", frame=frame, caption="Leaderboard configuration, forward + backward "
                          "with `o.sum().backward()` and forward alone (heads folded into the batch)."),
            d.table("leaderboard_d128", frame=subset(d.frame("leaderboard_d128"), "impl", "fwd_bwd_sum_ms",
                                                     "forward_ms", "fwd_bwd_TFLOP_per_s"),
                    caption="The same with head size 128.")]



from cs336_systems.experiments.section import Job  # noqa: E402


SECTION = Section(
    name="flash_benchmarking", number="1.3.2", title="FlashAttention-2 in Triton",
    problems=("flash_forward", "flash_backward", "flash_benchmarking"), answer=answer, presets=PRESETS, run=run,
    derive=derive, derive_inputs=SWEEP_TABLES,
    depends=(*MODEL, "cs336_systems/attention/", "cs336_systems/benchmarking/timing.py",
             "cs336_systems/benchmarking/end_to_end.py", "cs336_systems/benchmarking/sweep.py",
             "cs336_systems/benchmarking/flash_host_overhead.py"),
    # minutes as measured at 087cb28, 311857a and b0eb683 on a fresh H100 machine (docs/flash_attention/
    # refresh_b0eb683.md): a compiled cell compiles the whole model once per implementation and round, about 2 min
    # at xl and 2.5 min at xl 2048 on that host, so xl's compiled cells run one round per job; run again on the
    # same machine, a compiled job takes about half (jobs 5 and 7: 134 and 156 s), its graphs cached
    jobs=(
        Job({"dtypes": ["bfloat16"]}, 4.7, "leaderboard at d 64 and 128, the bf16 sweep, the model step, host cost"),
        Job({"parts": ["sweep"], "dtypes": ["float32"]}, 5.4),
        Job({"parts": ["shapes"]}, 7.5),
        Job({"parts": ["losers"]}, 0.6, "reads the shapes grid of the job before"),
        Job({"parts": ["model_ab"], "ab_presets": ["small"]}, 5.5, "eager and compiled"),
        Job({"parts": ["model_ab"], "ab_presets": ["medium", "xl"], "ab_compile": [False]}, 1.3),
        Job({"parts": ["model_ab"], "ab_presets": ["medium"], "ab_compile": [True], "ab_contexts": [1024, 2048]}, 6.5),
        Job({"parts": ["model_ab"], "ab_presets": ["medium"], "ab_compile": [True], "ab_contexts": [4096]}, 2.8),
        # xl compiled, measured at 63e88b2 on one warm H100 (jobs 9-14 one after another): round 1 compiles the
        # model and took 3.5-3.8 min; round 2, run next on the same machine, found the graphs cached (0.6-0.7 min)
        *(Job({"parts": ["model_ab"], "ab_presets": ["xl"], "ab_compile": [True], "ab_contexts": [context],
               "ab_only_rounds": [r]}, minutes[r], f"round {r + 1} of 2"
              + ("" if r == 0 else "; about 4 min on a machine that has not run round 1"))
          for context, minutes in ((1024, (3.8, 0.6)), (2048, (3.5, 0.7)), (4096, (3.6, 0.7))) for r in (0, 1)),
    ),
)
