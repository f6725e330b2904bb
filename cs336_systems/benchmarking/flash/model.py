"""Attention inside the model: a training step with each implementation over context lengths (time and
peak memory), and the A/B of ours against SDPA in eager and compiled steps, in alternating rounds that
separate jobs can combine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, benchmark_model
from cs336_systems.benchmarking.sweep import OK, grid, run_sweep


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
#: One round of a cell: the unit a job that measures only some rounds (``only_rounds``) replaces.
MODEL_AB_ROUND = (*MODEL_AB_CELL, "round")
#: The round count is not among them: a job that measures a cell replaces all its rounds (:func:`model_ab_merge_keys`).
MODEL_AB_SAME = ("model_ab.impls", "model_ab.tokens_per_step", "model_ab.steps", "kernel_options")


def model_ab_merge_keys(only_rounds: Sequence[int]) -> tuple[str, ...]:
    """What a job's rows replace of an earlier job's: whole cells, so that a cell's rounds come from one job and
    one round count; or, for a job that measures only some rounds of its cells, just those rounds."""
    return MODEL_AB_ROUND if only_rounds else MODEL_AB_CELL


def model_ab_configs(presets: Sequence[str], contexts: Sequence[int], compiles: Sequence[bool], rounds: int,
                     impls: Sequence[str] = MODEL_AB_IMPLS, only_rounds: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Cells in measuring order: per (preset, context, compile), ``rounds`` rounds of every implementation,
    the order rotating from round to round (A B, then B A), so that neither always runs first; with
    ``only_rounds``, just those rounds (another job measures the rest).

    Small and medium steps are bound by the host, eager and compiled alike (no CUDA graphs), and the host's speed
    drifts from round to round by more than the attention's share of the step: a verdict needs several rounds.
    They are cheap after a cell's first: a compiled round finds the graphs of the round before it cached."""
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
                 impls: Sequence[str] = MODEL_AB_IMPLS, rounds: int = 6, only_rounds: Sequence[int] = (),
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


#: The verdict of a cell where a side has a single measured round, whose spread is zero by construction.
ONE_ROUND = "one round"


def summarize_model_ab(table: pd.DataFrame, baseline: str = MODEL_AB_IMPLS[0],
                       ours: str = MODEL_AB_IMPLS[1]) -> pd.DataFrame:
    """Per (preset, context, compile): each implementation's median step over its measured rounds and the
    spread (max - min), the baseline's time over ours (above 1: ours faster), and ``verdict``: ``tie`` when
    the two medians differ by less than the larger spread, else which is faster. A side measured in one round
    has no spread to judge a difference against: such a cell says :data:`ONE_ROUND` (a job that measured only
    a cell's first round, or a side whose other rounds failed). Cells where either side has no measured round
    say why (``OOM``, skipped)."""
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
            row["verdict"] = (ONE_ROUND if min(row["baseline_rounds"], row["ours_rounds"]) < 2 else "tie"
                              if tied else ours if row["ours_ms"] < row["baseline_ms"] else baseline)
        else:
            row["baseline_over_ours"] = float("nan")
            row["verdict"] = "/".join(sorted(set(g.loc[g["status"] != OK, "status"].astype(str)))) or "not measured"
        rows.append(row)
    summary = pd.DataFrame(rows)
    return summary.assign(baseline=baseline, ours=ours)


# --------------------------------------------------------------------------------------------------
# Host cost per call: what issuing one forward+backward costs the CPU, beside its GPU time
# --------------------------------------------------------------------------------------------------
