# === Answers: formatting only; changes below this line do not make results stale ===
"""§1.3.2's answers about the whole model (beyond the handout): the training step with each attention, and our
attention against SDPA inside that step, eager and compiled, in alternating rounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

import cs336_systems.experiments.flash_benchmarking as section  # its SECTION is bound after this module loads
from cs336_systems.benchmarking.flash.model import ONE_ROUND
from cs336_systems.experiments.flash_benchmarking import Params
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question, with_mfu
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.results import recorded


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
    single = measured[measured["verdict"] == ONE_ROUND]
    if len(single):
        parts.append(f"{len(single)} measured in one round only, with no spread to judge a difference "
                     f"against, so no verdict ({'; '.join(where(r) for _, r in single.iterrows())})")
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
    lost = measured[measured["verdict"] == baseline]
    if len(lost):
        text += _model_ab_gaps(d.frame("model_ab"), lost, baseline, ours, where)
    if measured["compile"].any():  # what "compiled" means here, unlike §1.4's graph-replayed steps
        text += (". Compiled is `torch.compile(model)` in its default mode with `cs336_basics`' AdamW stepping "
                 "eagerly: no CUDA graphs, so each attention call still pays its custom operators' host path")
    return [question(d, "model_ab", f"Beyond the handout: {ours} against {baseline} inside the model's training "
                     "step, eager and compiled, alternating in one process.", [
        Text(text + "."),
        d.table("model_ab_summary", frame=_model_ab_table(summary, baseline, ours), caption=f"Median training "
                f"step (forward, backward, AdamW) of our model with each attention over alternating rounds, eager "
                f"and compiled{_model_ab_setting(d.frame('model_ab'))}, and the verdict against the spread of the "
                f"rounds (spreads and the ratio {baseline} / ours: the CSV)."),
    ])]


#: The phases of a training step that the model A/B times on their own; the step's rest (zeroing gradients,
#: synchronizing) is its total less these.
_STEP_PHASES = (("forward", "forward"), ("backward", "backward"), ("optimizer", "the AdamW step"))


def _model_ab_gaps(rows: pd.DataFrame | None, lost: pd.DataFrame, baseline: str, ours: str,
                   where: Any) -> str:
    """Where ours loses a cell, the gap split by phase (medians over the rounds): the attention runs in the
    forward and backward only, so a gap in the AdamW step, which is the same code under both, is the host's."""
    if rows is None or not {f"{p}_mean_ms" for p, _ in _STEP_PHASES} <= set(rows.columns):
        return ""
    parts = []
    for _, cell in lost.iterrows():
        mine = rows[(rows["preset"] == cell["preset"]) & (rows["context_length"] == cell["context_length"])
                    & (rows["compile"] == cell["compile"]) & (rows["status"] == "ok")]
        med = mine.groupby("attention_impl")[[f"{p}_mean_ms" for p, _ in _STEP_PHASES] + ["total_mean_ms"]].median()
        if not {baseline, ours} <= set(med.index):
            continue
        gap = med.loc[ours] - med.loc[baseline]
        phases = [(name, gap[f"{p}_mean_ms"]) for p, name in _STEP_PHASES]
        rest = gap["total_mean_ms"] - sum(v for _, v in phases)
        parts.append(f"{where(cell)}, {fmt.sig(gap['total_mean_ms'])} ms slower: "
                     + ", ".join(f"{name} {v:+.2f}".replace("-", "−") for name, v in [*phases, ("the rest", rest)]) + " ms")
    if not parts:
        return ""
    return ("; where " + baseline + " is faster, the gap by phase (ours less " + baseline + ", medians of the "
            "rounds' phase means): " + "; ".join(parts) + ". The attention runs only in the forward and backward; "
            "the AdamW step and the rest run the same code under both, so what differs there is the host's "
            "drift from round to round, which the cell's rounds did not average out")


def _model_ab_setting(rows: pd.DataFrame | None) -> str:
    """Precision, tokens per step and rounds of the model A/B, as its rows record them: every cell steps the same
    number of tokens (batch = tokens / context), which is why a step's time barely moves with the context."""
    if rows is None or not {"precision", "tokens_per_step", "round", "preset", "context_length", "compile"} <= set(
            rows.columns) or rows.empty:
        return ""
    precision = "/".join(sorted({str(v) for v in rows["precision"].dropna()}))
    tokens = "/".join(f"{int(v):,}" for v in sorted(set(rows["tokens_per_step"].dropna())))
    per_cell = rows.groupby(["preset", "context_length", "compile"])["round"].nunique()
    lo, hi = int(per_cell.min()), int(per_cell.max())
    rounds = (f"{lo} round{'' if lo == 1 else 's'} per cell" if lo == hi
              else f"{lo}-{hi} rounds per cell, each cell's count in the CSV")
    return f" ({precision}, {tokens} tokens per step at every context, the batch being tokens / context; {rounds})"


def _model_ab_grid(params: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """The cells presets × contexts × compile of a parameter record (its ``model_ab`` group, or the flat
    ``ab_*`` names that records from before the groups carry)."""
    def value(name: str) -> list[Any]:
        return recorded(params, f"model_ab.{name}") or params.get(f"ab_{name}") or []

    return [(str(p), int(c), bool(k)) for p in value("presets") for c in value("contexts") for k in value("compile")]


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
    return list(_model_ab_planned_rounds())


def _model_ab_planned_rounds() -> dict[tuple[str, int, bool], int]:
    """Each cell of the full run's model_ab jobs, in job order, with the rounds its job takes."""
    defaults = Params().model_ab
    cells: dict[tuple[str, int, bool], int] = {}
    for job in section.SECTION.jobs:
        if "model_ab" in job.sets.get("parts", ()):
            sets = {k: job.sets.get(f"model_ab.{k}", getattr(defaults, k)) for k in ("presets", "contexts", "compile")}
            for cell in _model_ab_grid({"model_ab": sets}):
                cells.setdefault(cell, int(job.sets.get("model_ab.rounds", defaults.rounds)))
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


def _model_setting(df: pd.DataFrame | None) -> str:
    """The model, batch and precision a model-step table ran with, as its CSV records them."""
    if df is None or not {"model", "batch_size", "precision"} <= set(df.columns) or df.empty:
        return ""
    models, batches, precisions = (sorted({str(v) for v in df[c].dropna()}) for c in ("model", "batch_size", "precision"))
    return (f" ({'/'.join(models)} model, batch {'/'.join(batches)}, {'/'.join(precisions)})"
            if models and batches and precisions else "")


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
                + join_words(parts) + "." + _model_step_order(df))


def _model_step_order(df: pd.DataFrame, ours: str = "flash_triton", other: str = "sdpa") -> str:
    """Ours against SDPA in this table: the ratio's range, and the contexts where the two differ by more than
    their steps' ranges. The table times one implementation after the other, so a gap there may be the
    machine's moment; the alternating A/B (``model_ab``) is the speed comparison."""
    need = {"context_length", "attention_impl", "total_mean_ms", "total_min_ms", "total_max_ms"}
    if not need <= set(df.columns):
        return ""
    wide = df.pivot_table(index="context_length", columns="attention_impl",
                          values=["total_mean_ms", "total_min_ms", "total_max_ms"])
    if ("total_mean_ms", ours) not in wide or ("total_mean_ms", other) not in wide:
        return ""
    wide = wide.dropna(subset=[(v, i) for v in ("total_mean_ms", "total_min_ms", "total_max_ms") for i in (ours, other)])
    if wide.empty:
        return ""
    ratio = wide[("total_mean_ms", other)] / wide[("total_mean_ms", ours)]
    apart = wide[(wide[("total_min_ms", ours)] > wide[("total_max_ms", other)])
                 | (wide[("total_min_ms", other)] > wide[("total_max_ms", ours)])]
    where = (f"; their steps' ranges do not overlap at {join_words([f'{int(c):,}' for c in apart.index])}"
             if len(apart) else "; their steps' ranges overlap at every context")
    return (f" {other}'s step time over ours runs from {fmt.ratio(ratio.min())} to {fmt.ratio(ratio.max())}{where}. "
            "This table times the implementations one after the other, a few steps each; the A/B below "
            "alternates them in rounds and is the speed comparison.")
