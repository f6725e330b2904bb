"""§1.3.5 FlashAttention accuracy against float64 (beyond the handout): at every shape of §1.3.2's shapes grid,
the error of our O, dQ, dK and dV against an exact float64 reference, beside SDPA's flash and cuDNN backends.

A faster kernel is only a replacement if it is as accurate as the one it replaces. The bar: our error at most
2× the better SDPA backend's error at the same shape, dtype and masking
(:data:`cs336_systems.benchmarking.flash_accuracy.ALLOWED_RATIO`). The measurement is
:mod:`cs336_systems.benchmarking.flash_accuracy` (same inputs for every implementation, reference in blocks
of query rows over every head, or the first and the last); this section runs it over the grid, one table per dtype
(``errors_<dtype>``, one row per implementation and output, so the two dtypes can run as separate GPU jobs),
and derives the verdicts, their summary and a heatmap from whichever dtypes were measured.

Without a GPU (``smoke``), ours is the PyTorch-tiled FlashAttention-2 unless Triton's interpreter is on
(``TRITON_INTERPRET=1``), SDPA's flash backend runs its CPU kernel and the cuDNN backend declines (a row that
says ``unsupported``).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from cs336_systems.benchmarking import flash_accuracy as fa
from cs336_systems.benchmarking.sweep import OK, SKIPPED
from cs336_systems.benchmarking.flash.shapes import SHAPES_BHN
from cs336_systems.experiments.section import Job, Section, check_positive, param
from cs336_systems.plotting import MISSING_COLOUR, measured_on
from cs336_systems.derived import Derived
from cs336_systems.results import ResultWriter

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Params:
    shapes: list[list[int]] = param(SHAPES_BHN, "[batch, heads, seq_len] triples (default: §1.3.2's shapes grid)")
    head_dims: list[int] = param([64, 128], "head dimensions")
    dtypes: list[str] = param(["bfloat16", "float16"], "torch dtype names, one result table each")
    causal: list[bool] = param([True, False], "causal settings")
    all_heads: bool = param(True, "compare every head with the reference (False: only the first and the last; "
                                  "a largest error over two heads is a small sample)")
    seed: int = param(0, "seed of the random inputs (the same for every implementation)")
    budget_s: float = param(540.0, "time budget per dtype in seconds; cells past it are recorded as skipped")

    def check(self) -> None:
        unknown = [x for x in self.dtypes if x not in DTYPES]
        if unknown:
            raise ValueError(f"flash_accuracy: unknown dtype {unknown[0]!r}; dtypes: {', '.join(DTYPES)}")
        check_positive(budget_s=self.budget_s, **{f"head_dim {d}": d for d in self.head_dims})
        for shape in self.shapes:
            if len(shape) != 3 or min(shape) < 1:
                raise ValueError(f"flash_accuracy: a shape is [batch, heads, seq_len] of positive sizes, got {shape}")
        if max(self.head_dims, default=0) > 128:
            raise ValueError(f"flash_accuracy: head dims up to 128, got {max(self.head_dims)}")


PRESETS = {
    "full": Params(),
    "quick": Params(shapes=[[8, 32, 256], [4, 32, 3000], [1, 16, 16384]], all_heads=False, budget_s=120.0),
    "smoke": Params(shapes=[[1, 2, 40]], head_dims=[16], dtypes=["bfloat16"], budget_s=60.0),
}


def ours_impl() -> str:
    """Ours as this machine can run it: the Triton kernels on a GPU or under the interpreter, else the
    PyTorch-tiled FlashAttention-2 (a CPU smoke run)."""
    from cs336_systems.attention.flash_triton import interpreter_enabled

    return "ours" if torch.cuda.is_available() or interpreter_enabled() else fa.OURS_PYTORCH


def cells(p: Params) -> list[tuple[list[int], int, bool]]:
    """The (``[batch, heads, seq_len]``, head dim, causal) cells of one dtype, in measuring order."""
    return [(list(s), int(d), bool(c)) for s, d, c in itertools.product(p.shapes, p.head_dims, p.causal)]


def measure_dtype(p: Params, dtype: str, impls: tuple[str, ...], device: str,
                  on_cell: Any = None) -> pd.DataFrame:
    """``errors_<dtype>``: :func:`flash_accuracy.measure_shape`'s rows for every cell, one row per
    implementation and output; cells past ``p.budget_s`` get one row with status ``skipped (time budget)``.
    ``on_cell(rows_so_far)`` runs after each cell, so a job stopped mid-grid leaves what it measured."""
    start, rows = time.monotonic(), []
    for (batch, heads, seq), d, causal in cells(p):
        base = {"dtype": dtype, "batch": batch, "heads": heads, "seq_len": seq, "head_dim": d, "causal": causal}
        if rows and time.monotonic() - start > p.budget_s:
            rows.append({**base, "status": SKIPPED})
            continue
        rows += fa.measure_shape((batch, heads, seq, d), getattr(torch, dtype), causal, impls, device=device,
                                 seed=p.seed, every_head=p.all_heads)
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_cell is not None:
            on_cell(pd.DataFrame(rows))
    return pd.DataFrame(rows)


def run(p: Params, out: ResultWriter) -> dict[str, pd.DataFrame]:
    """One ``errors_<dtype>`` table per dtype, written as it grows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    impls = (ours_impl(), *fa.BASELINES)
    results = {}
    for dtype in p.dtypes:
        name = f"errors_{dtype}"
        results[name] = measure_dtype(p, dtype, impls, device, on_cell=lambda df, n=name: out.table(df, n))
        out.table(results[name], name)
        done = results[name]
        print(f"{dtype}: {done[done['status'] == OK][fa.SHAPE_KEYS[:-1]].drop_duplicates().shape[0]} cells "
              f"measured, {int((done['status'] == SKIPPED).sum())} skipped", flush=True)
    return results


# --------------------------------------------------------------------------------------------------
# Derived: verdicts per cell and output, their summary, the heatmap
# --------------------------------------------------------------------------------------------------

ERROR_TABLES = tuple(f"errors_{dtype}" for dtype in DTYPES)
CELL_KEYS = fa.SHAPE_KEYS[:-1]  # a cell: dtype, batch, heads, seq_len, head_dim, causal


def verdicts(errors: list[pd.DataFrame]) -> pd.DataFrame:
    """:func:`flash_accuracy.accuracy_table` over the measured rows of every dtype, ours being whichever
    implementation of ours the run measured, plus one row per skipped cell (status ``skipped (time
    budget)``)."""
    long = pd.concat([e for e in errors if e is not None and len(e)], ignore_index=True)
    measured = long[long["status"] != SKIPPED]
    ours = next((i for i in ("ours", fa.OURS_PYTORCH) if i in set(measured["impl"])), "ours")
    table = fa.accuracy_table(measured, ours=ours).rename(columns={f"error_{ours}": "error_ours",
                                                                  f"relative_{ours}": "relative_ours"})
    table.insert(len(fa.SHAPE_KEYS), "status", OK)
    table.insert(len(fa.SHAPE_KEYS) + 1, "ours", ours)
    skipped = long[long["status"] == SKIPPED][CELL_KEYS].drop_duplicates()
    if len(skipped):
        rows = skipped.merge(pd.DataFrame({"output": list(fa.OUTPUTS)}), how="cross").assign(status=SKIPPED, ours=ours)
        table = pd.concat([table, rows], ignore_index=True)
    return table


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per dtype and one for all: cells measured and skipped, (cell, output) pairs within the bar,
    the median, geometric mean and largest ratio to the better SDPA backend, and where the largest is."""
    rows = []
    for dtype, part in [*table.groupby("dtype", sort=False), ("all", table)]:
        judged = part.dropna(subset=["ratio_best"])
        skipped = part[part["status"] == SKIPPED]
        row: dict[str, Any] = {
            "dtype": dtype,
            "cells": int(part[part["status"] == OK][CELL_KEYS].drop_duplicates().shape[0]),
            "cells_skipped": int(skipped[CELL_KEYS].drop_duplicates().shape[0]),
            "pairs": int(len(judged)), "within": int(judged["within"].astype(bool).sum()) if len(judged) else 0,
        }
        if len(judged):
            ratios = judged["ratio_best"].clip(lower=1e-12)
            worst = judged.loc[ratios.idxmax()]
            row.update(median_ratio=float(ratios.median()), geomean_ratio=float(np.exp(np.log(ratios).mean())),
                       max_ratio=float(ratios.max()), worst=describe(worst))
        rows.append(row)
    return pd.DataFrame(rows)


def describe(r: pd.Series) -> str:
    """``dq, float16 (1, 16, 16384, 128) non-causal``."""
    return (f"{r['output']}, {r['dtype']} ({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, "
            f"{int(r['head_dim'])}) {'causal' if r['causal'] else 'non-causal'}")


def plot_ratios(table: pd.DataFrame, meta: dict[str, Any] | None = None) -> plt.Figure:
    """Our error over the better SDPA backend's, per shape (rows) and masking × output (columns), one panel per
    dtype; the colour scale is logarithmic around 1 and saturates at the 2× bar (red: ours less accurate);
    grey cells were not measured."""
    import seaborn as sns

    data = table.copy()
    data["shape"] = [f"{int(b)}x{int(h)}x{int(n)} d{int(d)}" for b, h, n, d in
                     zip(data["batch"], data["heads"], data["seq_len"], data["head_dim"])]
    data["setting"] = np.where(data["causal"].astype(bool), "causal ", "full ") + data["output"].astype(str)
    dtypes = list(dict.fromkeys(data["dtype"]))
    shapes = list(dict.fromkeys(data["shape"]))
    settings = [f"{m} {o}" for m in ("causal", "full") for o in fa.OUTPUTS]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 0.33 * len(shapes) + 2.2), squeeze=False)
    limit = math.log2(fa.ALLOWED_RATIO)
    for ax, dtype in zip(axes[0], dtypes):
        part = data[data["dtype"] == dtype]
        ratio = part.pivot_table(index="shape", columns="setting", values="ratio_best", sort=False)
        ratio = ratio.reindex(index=[s for s in shapes if s in set(part["shape"])], columns=settings)
        ax.set_facecolor(MISSING_COLOUR)
        sns.heatmap(np.log2(ratio), ax=ax, annot=ratio, fmt=".2f", cmap="RdBu_r", vmin=-limit, vmax=limit,
                    center=0.0, cbar=ax is axes[0][-1], annot_kws={"fontsize": 6.5},
                    cbar_kws={"label": "log2(ours / better SDPA)"})
        ax.set_title(f"{dtype}: our error / better SDPA backend's")
        ax.set_xlabel("")
        ax.set_ylabel("batch x heads x seq, head dim")
    fig.suptitle(f"Error against float64, {measured_on(meta)}; grey: not measured", y=1.0)
    fig.tight_layout()
    return fig


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """``accuracy`` (verdicts), ``accuracy_summary`` and the ``accuracy_ratio`` heatmap from the measured
    ``errors_<dtype>`` tables present."""
    present = [name for name in ERROR_TABLES if tables.get(name) is not None]
    table = verdicts([tables[name] for name in present])
    figures = {}
    if table["ratio_best"].notna().any():
        figures["accuracy_ratio"] = (plot_ratios(table[table["status"] == OK], meta), present[0])
    return Derived(tables={"accuracy": (table, present[0]), "accuracy_summary": (summary(table), present[0])},
                   figures=figures)


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report import fmt  # noqa: E402
from cs336_systems.report.answers import join_words, question  # noqa: E402
from cs336_systems.report.data import SectionData  # noqa: E402
from cs336_systems.report.document import Block, Text  # noqa: E402


def answer(d: SectionData) -> list[Block]:
    table, totals = d.frame("accuracy"), d.frame("accuracy_summary")
    return [
        question(d, "flash_accuracy", "Is our FlashAttention-2 as accurate as SDPA's? The error of O, dQ, dK and "
                 "dV against float64 at every shape of §1.3.2's shapes grid, beside SDPA's flash and cuDNN "
                 f"backends; the bar: at most {fa.ALLOWED_RATIO:g}× the better backend's error.", [
                     _method_text(d),
                     _verdict_text(table, totals),
                     d.figure("accuracy_ratio", caption="Our error over the better SDPA backend's per shape, "
                              "masking and output (1: as accurate; red past 1, saturated at the 2× bar)."),
                     d.table("accuracy_summary", caption="Per dtype: cells measured and skipped, (cell, output) "
                             "pairs within the bar, and the ratio of our error to the better backend's."),
                     d.table("accuracy", frame=_largest(table), caption="The six largest ratios, with each "
                             "implementation's error (every cell and output: `accuracy.csv`; the measured rows: "
                             "`errors_<dtype>.csv`)."),
                 ], what="the accuracy grid"),
    ]


def _method_text(d: SectionData) -> Text:
    measured = [e.dropna(subset=["heads_checked"]) for e in map(d.frame, ERROR_TABLES)
                if e is not None and "heads_checked" in e]
    every = any(len(e) for e in measured) and all((e["heads_checked"] == e["batch"] * e["heads"]).all()
                                                  for e in measured)
    return Text("Every implementation gets the same random inputs, already in the dtype, so the reference (exact "
                "attention and its gradients in float64, in blocks of query rows, over "
                + ("every head" if every else "the first and the last head") + ") measures what each kernel adds, "
                "not the rounding of its inputs. The error of an output is its largest absolute difference from the "
                "reference.")


def _verdict_text(table: pd.DataFrame | None, totals: pd.DataFrame | None) -> Text | None:
    if table is None or totals is None or totals.empty:
        return None
    parts = []
    for _, r in totals[totals["dtype"] != "all"].iterrows():
        if not r["pairs"]:
            continue
        parts.append(f"{r['dtype']}: {int(r['cells'])} cells, {int(r['within'])} of {int(r['pairs'])} (cell, output) "
                     f"pairs within the bar, median ratio {fmt.sig(r['median_ratio'], 3)}, largest "
                     f"{fmt.sig(r['max_ratio'], 3)} ({r['worst']})")
    if not parts:
        return None
    misses = table[(table["status"] == OK) & (table["within"].astype(str) == "False")]
    skipped = int(totals[totals["dtype"] == "all"]["cells_skipped"].sum())
    ours = set(table["ours"].dropna()) if "ours" in table else {"ours"}
    text = ("Ours here is the PyTorch-tiled FlashAttention-2 (no GPU, no Triton interpreter). " if fa.OURS_PYTORCH in ours
            else "") + "; ".join(parts) + "."
    judged = table.dropna(subset=["ratio_best"])
    errors = [c for c in (f"error_{b}" for b in fa.BASELINES) if c in judged]
    if errors and len(judged):
        worse = judged[errors].max(axis=1)
        text += (f" In {int((judged['error_ours'] <= worse).sum())} of {len(judged)} pairs our error is at most the "
                 "worse of the two backends' errors.")
    text += (" Every pair meets the bar." if misses.empty else
             f" Outside it: {join_words([f'{describe(m)} ({fmt.sig(m.ratio_best, 3)}×)' for _, m in misses.iterrows()])}.")
    if skipped:
        text += f" Not measured (time budget): {skipped} cells."
    return Text(text)


def _largest(table: pd.DataFrame | None) -> pd.DataFrame | None:
    if table is None or "ratio_best" not in table:
        return table
    shown = [c for c in (*fa.SHAPE_KEYS, "error_ours", *(f"error_{b}" for b in fa.BASELINES), "ratio_best", "within")
             if c in table]
    return table.dropna(subset=["ratio_best"]).nlargest(6, "ratio_best")[shown]


SECTION = Section(
    name="flash_accuracy", number="1.3.5", title="FlashAttention accuracy against float64 (beyond the handout)",
    problems=("beyond the handout",), answer=answer, presets=PRESETS, run=run, derive=derive,
    derive_inputs=ERROR_TABLES,
    depends=("cs336_systems/attention/", "cs336_systems/benchmarking/flash_accuracy.py",
             "cs336_systems/benchmarking/flash_host_overhead.py", "cs336_systems/benchmarking/flash/shapes.py"),
    # minutes on an H100 at 63e88b2 (every head): 1.0 each on a machine whose kernels were already tuned; the first
    # run on a fresh machine (two heads, 033a324) took 3.1 and 3.0, mostly compiling and autotuning
    jobs=(Job({"dtypes": ["bfloat16"]}, 3.1, "40 cells"), Job({"dtypes": ["float16"]}, 3.0, "40 cells")),
)
