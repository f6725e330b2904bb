"""§1.1.3 End-to-end benchmarking: forward, backward and optimizer-step time per model size, and what warm-up
steps do.

Problem ``benchmarking_script`` of both handouts: 2025 asks for the forward and backward passes of its model
table, 2026 for the forward, backward and optimizer step of its own. One grid answers both: full AdamW steps
with each phase timed, over both tables with every model once (2026's ``xl`` is 2025's ``2.7B``, so 2026
adds only ``10B@2026``). The model preset table of §1.1.2 (``model_sizes``) is shown with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from cs336_systems.benchmarking.end_to_end import MODES, BenchmarkSpec, benchmark_model
from cs336_systems.benchmarking.sweep import OK, deadline_left, free_memory, is_oom, run_sweep
from cs336_systems.configs import BOTH_EDITIONS_SIZES, HANDOUT_SIZES, get_config
from cs336_systems.experiments.section import Job, Section, check_parts, check_positive, check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import failed_rows, join_words, ok_rows, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run


#: The section's two tables, each a part a job can run alone (the fresh-process study is most of the time).
PARTS = ("timings", "warmup_study")
#: Settings two jobs must share for the study's rows to be one table.
STUDY_PARAMS = ("context_length", "steps", "warmup_study", "fresh_process")


@dataclass(frozen=True)
class Params:
    sizes: list[str] = param(BOTH_EDITIONS_SIZES, "model presets to time (default: both handouts' tables)")
    mode: str = param("train", f"what a timed step runs, of {', '.join(MODES)} (train: forward, backward and "
                               "AdamW, each phase timed)")
    context_length: int = param(512, "tokens per sequence")
    warmup: int = param(5, "untimed steps before the timed ones")
    steps: int = param(10, "timed steps per size")
    warmup_study: list[int] = param([0, 1, 2, 5], "warm-up step counts compared in the warm-up study")
    warmup_study_sizes: list[str] = param(list(HANDOUT_SIZES), "presets of the warm-up study")
    fresh_process: bool = param(True, "each warm-up setting in a new Python process (honest one-time costs)")
    budget_s: float = param(600.0, "time budget in seconds; cells past it are recorded as skipped")
    parts: list[str] = param(list(PARTS), "what to run: timings (the sizes), warmup_study; a job of some warm-up "
                                          "study sizes adds its rows to the study of the same commit and settings")

    def check(self) -> None:
        check_presets(*self.sizes, *self.warmup_study_sizes)
        check_parts("benchmarking", self.parts, PARTS)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_positive(context_length=self.context_length, steps=self.steps, budget_s=self.budget_s)


PRESETS = {
    "full": Params(),
    "quick": Params(warmup_study_sizes=["small", "large"], budget_s=150.0),
    "smoke": Params(sizes=["tiny"], context_length=32, warmup=1, steps=2, warmup_study=[0, 1],
                    warmup_study_sizes=["tiny"], fresh_process=False, budget_s=60.0),
}

def run_model_in_subprocess(spec: BenchmarkSpec, timeout_s: float = 300) -> dict[str, Any]:
    """Benchmark ``spec`` in a fresh Python process (``python -m cs336_systems.benchmarking model --json``),
    so its first steps pay every one-time cost (CUDA context, cuBLAS handles and heuristics, allocator
    growth) — the only honest way to measure what warm-up steps are for."""
    cmd = [
        sys.executable, "-m", "cs336_systems.benchmarking", "model", "--preset", get_config(spec.model).name,
        "--mode", spec.mode, "--context-length", str(spec.config.context_length),
        "--batch-size", str(spec.config.batch_size), "--warmup", str(spec.warmup), "--steps", str(spec.steps),
        "--precision", spec.precision, "--attention", spec.attention_impl, "--json",
    ]
    if spec.compile:
        cmd.append("--compile")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        if "out of memory" in proc.stderr.lower():
            raise torch.cuda.OutOfMemoryError(proc.stderr.strip().splitlines()[-1])
        raise RuntimeError(f"benchmark subprocess failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])



#: What a step runs, heaviest first: a size whose step of one mode runs out of memory is timed in the next,
#: so a model too large to train still has its forward pass measured (last without autograd, ``inference``).
LIGHTER = {"train": "forward_backward", "forward_backward": "forward", "forward": "inference"}


def time_what_fits(size: str, p: Params) -> dict[str, Any]:
    """Time ``size`` in ``p.mode``, or where that runs out of memory in the next lighter mode (:data:`LIGHTER`):
    the row says which mode it timed (``timed_mode``) and, if not the asked one, the mode that did not fit
    (``out_of_memory``). Out of memory in every mode raises, and the sweep records the size as OOM."""
    mode, failed = p.mode, None
    while True:
        spec = BenchmarkSpec(size, mode=mode, context_length=p.context_length, warmup=p.warmup, steps=p.steps)
        try:
            return {"timed_mode": mode, "out_of_memory": failed, **benchmark_model(spec)}
        except Exception as exc:  # noqa: BLE001 - only out-of-memory falls through to a lighter mode
            if not is_oom(exc) or mode not in LIGHTER:
                raise
        free_memory()  # outside the except block, whose traceback still holds the failed step's tensors
        failed = failed or mode
        mode = LIGHTER[mode]


def run(p: Params, out: ResultWriter) -> dict[str, pd.DataFrame]:
    """Time per phase (mean ± std) of a ``mode`` step per size; the warm-up study (forward and backward) for
    each warm-up count, each setting in a fresh process (``fresh_process``; smoke runs stay in-process to be
    quick, so their warm-up study only exercises the pipeline)."""
    deadline = time.monotonic() + p.budget_s
    tables: dict[str, pd.DataFrame] = {}
    if "timings" in p.parts:
        timings = run_sweep(
            lambda size: time_what_fits(size, p), [{"size": s} for s in p.sizes], desc=f"{p.mode} timings",
            budget_s=(0.7 if "warmup_study" in p.parts else 1.0) * p.budget_s)
        phases = ("forward_", "backward_", "optimizer_", "total_")
        keep = ["size", "status", "timed_mode", "out_of_memory"] + [
            c for c in timings.columns
            if c.startswith(phases) or c in ("tokens_per_s", "TFLOP_per_s", "peak_memory_GiB")]
        tables["timings"] = timings = timings[[c for c in keep if c in timings.columns]]
        out.table(timings, "timings", extra={"context_length": p.context_length})  # the mode is in the params
        _plot_timings(timings, p, out)

    if "warmup_study" in p.parts:
        def warm(size: str, warmup: int) -> dict[str, Any]:
            spec = BenchmarkSpec(size, mode="forward_backward", context_length=p.context_length, warmup=warmup,
                                 steps=p.steps)
            row = run_model_in_subprocess(spec) if p.fresh_process else benchmark_model(spec)
            return {k: v for k, v in row.items() if k.startswith(("forward_", "backward_"))}

        earlier = rows_of_this_run(out, "warmup_study", asdict(p), STUDY_PARAMS)
        configs = [{"size": s, "warmup": w} for s in p.warmup_study_sizes for w in p.warmup_study]
        study = run_sweep(warm, configs, desc="warm-up study", budget_s=deadline_left(deadline))
        study = merge_rows(study, earlier, ["size", "warmup"])
        tables["warmup_study"] = study
        measured = {"warmup_study_sizes": list(dict.fromkeys(study["size"]))}  # this job's and earlier jobs'
        out.table(study, "warmup_study", params=measured)
        _plot_study(study, out, measured)
    return tables


def _plot_timings(timings: pd.DataFrame, p: Params, out: ResultWriter) -> None:
    ok = timings[timings["status"] == OK].set_index("size")
    timed = [ph for ph in ("forward", "backward", "optimizer") if f"{ph}_mean_ms" in ok]
    if ok.empty or not timed:
        return
    # pandas draws grouped bars with error bars and leaves a phase a lighter mode did not time empty
    means = ok[[f"{ph}_mean_ms" for ph in timed]].set_axis(timed, axis=1)
    stds = ok[[f"{ph}_std_ms" for ph in timed]].set_axis(timed, axis=1)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    means.plot.bar(yerr=stds, capsize=3, rot=0, ax=ax)
    # log: the sizes span two orders of magnitude (small to 10B)
    ax.set(yscale="log", xlabel="size", ylabel="ms per step (mean ± std)",
           title=f"Time per phase, context {p.context_length}")
    fig.tight_layout()
    out.figure(fig, "timings")
    plt.close(fig)


def _plot_study(study: pd.DataFrame, out: ResultWriter, params: dict[str, Any]) -> None:
    study_ok = study[study["status"] == OK] if "status" in study else study
    if not study_ok.empty:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        sns.pointplot(study_ok, x="warmup", y="forward_std_ms", hue="size", ax=ax)
        ax.set(yscale="log", ylabel="std of forward time (ms)", title="Variability vs warm-up steps (fresh process)")
        out.figure(fig, "warmup_study", params)
        plt.close(fig)



# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.configs import param_counts  # noqa: E402 (answers only)
from cs336_systems.report.agreement import in_run_mode  # noqa: E402 (answers only)
from cs336_systems.report.answers import (  # noqa: E402 (answers only)
    batch_and_context, edition_rows, mfu_note, subset, with_mfu)
from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def _study_caption(params: dict[str, Any]) -> str:
    """The warm-up study's caption from what its run did: the warm-up counts, and whether each ran alone."""
    counts = params.get("warmup_study") or []
    where = ("each setting in a fresh process" if params.get("fresh_process", True)
             else "all settings in one process, one after another (a smoke run: it exercises the pipeline)")
    return (f"Timings after {join_words([str(c) for c in counts])} warm-up steps, {where}." if counts
            else f"Timings by warm-up steps, {where}.")


def answer(d: SectionData) -> list[Block]:
    # The rows of this writeup's handout, under its names (one run measures both handouts' tables).
    timings = edition_rows(d.frame("timings"), d.edition)
    study = edition_rows(d.frame("warmup_study"), d.edition)
    # the cause of a failed study cell may be the other table's, where one run (one process) wrote both
    one_run = all(d.meta("timings").get(k) == d.meta("warmup_study").get(k) for k in ("argv", "git_commit"))
    warmup = _warmup_sentence(study, d.frame("timings") if one_run else None)
    return [
        question(d, "a", "A script for end-to-end benchmarking: forward only, forward and backward, or full "
                 "training steps with the optimizer.", [
            Text("`python -m cs336_systems.benchmarking model --preset SIZE --mode MODE` builds a preset, draws a "
                 "random batch, runs `--warmup` untimed steps and then times `--steps` steps of MODE: `forward`, "
                 "`forward_backward`, or `train` (forward, backward and the AdamW step). Each phase is timed on "
                 "its own with `timeit.default_timer`, with `torch.cuda.synchronize()` after it; "
                 "`python -m cs336_systems.experiments benchmarking` runs this section's whole sweep.")]),
        question(d, "b", "Forward, backward and optimizer-step timings for the model sizes of §1.1.2 (5 warm-up, "
                 "10 measured steps).", [_timing_sentence(timings, d.meta("timings")),
                             d.table("timings", frame=subset(with_mfu(_lighter_shown(timings), d.meta("timings")),
                                                             "size", "status",
                                                             "forward_mean_ms", "forward_std_ms", "backward_mean_ms",
                                                             "backward_std_ms", "optimizer_mean_ms",
                                                             "optimizer_std_ms", "total_mean_ms", "tokens_per_s",
                                                             "TFLOP_per_s", "MFU_pct", "peak_memory_GiB"),
                                     caption=f"Time per step by model size and phase ({_mode(d.meta('timings'))} "
                                             f"steps, {batch_and_context(d.meta('timings'))}); total: the whole "
                                             "step from the first synchronize to the last, the phases plus `zero_grad` and the "
                                             "host's time between them, so a little more than their sum."
                                             + _lighter_caption(timings, d.meta("timings"))
                                             + mfu_note(d.meta("timings")))], what="end-to-end timings by model size"),
        question(d, "c", "The effect of warm-up steps.", [
            None if study is None else Text(
                _cold_against_warm(study) + "The cold steps pay one-time costs: the CUDA context, lazily loaded "
                "kernels, a GEMM algorithm chosen per shape and the allocator's `cudaMalloc` growth. One or two warm-up steps have paid these for every shape, so they can still differ "
                "from five only through what later steps change (allocator growth, clocks) or a single slow step in "
                "a mean of few steps"
                + (_few_against_five(study) or ".")),
        ], what=None if study is not None else "timings with 0, 1 and 2 warm-up steps"),
        Text("", role=BEYOND_HANDOUT),  # the plots and the study's full table
        question(d, "b", "Time per step and phase, plotted.", [
            d.figure("timings", caption="Time per step and phase (error bars: one standard deviation).")]),
        question(d, "c", "The warm-up study in full.", [
            warmup,
            Text(_late_outliers(study).strip()) if _late_outliers(study) else None,
            d.table("warmup_study", frame=_preset_where_renamed(study), caption=_study_caption(d.meta("warmup_study").get("params") or {})),
            d.figure("warmup_study", caption="Spread of the forward time against the number of warm-up steps."),
        ]),
    ]


def _preset_where_renamed(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """An edition's rows with the preset column kept only where this handout renames a model (2026's xl is the
    2.7B preset), so the table and the prose name a model alike."""
    if df is None or "preset" not in df.columns:
        return df
    renamed = df["preset"].astype(str).str.partition("@")[0] != df["size"].astype(str)
    return df if renamed.any() else df.drop(columns="preset")


def _lighter_caption(df: pd.DataFrame | None, meta: dict[str, Any] | None = None) -> str:
    """Where a row was timed in a lighter mode: its total, throughput and MFU are that mode's, not the run's."""
    if df is None or "out_of_memory" not in df.columns or not df["out_of_memory"].notna().any():
        return ""
    return (" A row whose status names a lighter mode timed only that: its total, tokens/s and MFU are of that "
            f"mode, not comparable with the other rows' {_MODE_SHOWN.get(_mode(meta), _mode(meta))}s.")


def _lighter_shown(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """The table as shown: a size timed in a lighter mode than the run's says so in its status."""
    if df is None or "out_of_memory" not in df.columns:
        return df
    lighter = (df["status"] == OK) & df["out_of_memory"].notna()
    shown = df.copy()
    shown.loc[lighter, "status"] = [_MODE_SHOWN[m] + " only" for m in df.loc[lighter, "timed_mode"]]
    return shown


#: A timed mode in words.
_MODE_SHOWN = {"inference": "forward (no autograd)", "forward": "forward", "forward_backward": "forward + backward",
               "train": "training step"}


def _lighter_sentence(ok: pd.DataFrame) -> str:
    """For the sizes a training step did not fit: what ran out of memory, why, and the pass that was timed."""
    parts = []
    for _, r in ok[~in_run_mode(ok)].iterrows():
        timed = [ph for ph in ("forward", "backward") if pd.notna(r.get(f"{ph}_mean_ms"))]
        times = " and ".join(f"its {ph} {fmt.ms(r[f'{ph}_mean_ms'])}" for ph in timed)
        no_grad = " under `torch.no_grad`, since even the activations a backward needs did not fit" \
            if r["timed_mode"] == "inference" else ""
        why = _state_note(r.get("preset", r["size"]), "OOM") if r["out_of_memory"] == "train" else ""
        peak = f" (peak {fmt.gib(r['peak_memory_GiB'] * 2**30)})" if pd.notna(r.get("peak_memory_GiB")) else ""
        parts.append(f"{r['size']}'s {_MODE_SHOWN[r['out_of_memory']]} ran out of memory{why}; timed "
                     f"{_MODE_SHOWN[r['timed_mode']]} only{no_grad}{peak}: {times}")
    return (" " + "; ".join(parts) + ".") if parts else ""


def _timing_sentence(df: pd.DataFrame | None, meta: dict[str, Any] | None = None) -> Text | None:
    all_ok = ok_rows(df)
    ok = all_ok[in_run_mode(all_ok)] if not all_ok.empty else all_ok
    if ok.empty or not {"forward_mean_ms", "backward_mean_ms"} <= set(ok.columns):
        return None
    phases = [ph for ph in ("forward", "backward", "optimizer") if f"{ph}_mean_ms" in ok.columns]
    parts = [f"{r['size']} " + " / ".join(fmt.ms(r[f"{ph}_mean_ms"]) for ph in phases) for _, r in ok.iterrows()]
    text = f"{' / '.join(phases).capitalize()} time per step: {join_words(parts)}."
    if all(f"{ph}_std_ms" in ok.columns for ph in phases):
        cv = pd.concat([ok[f"{ph}_std_ms"] / ok[f"{ph}_mean_ms"] for ph in phases], keys=phases)
        phase, idx = cv.idxmax()
        noisy = cv[cv > 0.1]
        text = (text[:-1] + f"; the standard deviation is {'small' if cv.median() < 0.05 else 'large'}: a median "
                f"of {fmt.pct(cv.median(), 2)} of the mean" + (f", and {_noisy_cells(cv, ok)} (a few slow steps)."
                                                               if len(noisy) else
                                                               f", at most {fmt.pct(cv.max(), 2)} "
                                                               f"({ok.loc[idx, 'size']} {phase})."))
    text += _lighter_sentence(all_ok)
    failed = failed_rows(df)
    if not failed.empty:
        text += " Not measured: " + join_words([f"{r['size']} ({r['status']}"
                                                f"{_state_note(r.get('preset', r['size']), r['status'])})"
                                                for _, r in failed.iterrows()]) + "."
    if "optimizer" not in phases:
        text += (f" This run timed {_mode(meta)} steps, without the optimizer; the 2026 handout's optimizer step is timed "
                 "by the section's default `mode=train`.")
    return Text(text)


def _noisy_cells(cv: pd.Series, ok: pd.DataFrame, above: float = 0.1) -> str:
    """The cells whose standard deviation is above ``above`` of the mean, grouped by phase: "the optimizer
    step's 11%–14% for small, medium and large"."""
    parts = []
    for phase, cells in cv[cv > above].groupby(level=0, sort=False):
        sizes = join_words([str(ok.loc[i, "size"]) for _, i in cells.index])
        lo, hi = fmt.pct(cells.min(), 2), fmt.pct(cells.max(), 2)
        name = "the optimizer step's" if phase == "optimizer" else f"the {phase} pass's"
        parts.append(f"{name} {lo if lo == hi else f'{lo}–{hi}'} for {sizes}")
    return join_words(parts)


def _mode(meta: dict[str, Any] | None) -> str:
    """The timed mode of a run (runs before the ``mode`` parameter timed forward + backward)."""
    return ((meta or {}).get("params") or {}).get("mode", "forward_backward")


def _state_note(size: str, status: str) -> str:
    """For a size that ran out of memory: what its fp32 weights, gradients and AdamW moments need alone."""
    if "oom" not in status.lower():
        return ""
    n = param_counts(size)["total"]
    return (f": {fmt.params(n)} parameters need {fmt.gib(16 * n)} for fp32 weights, gradients and AdamW moments "
            f"alone, where a forward pass holds only the {fmt.gib(4 * n)} of weights")


def _warmup_sentence(df: pd.DataFrame | None, timings: pd.DataFrame | None = None,
                     explain: bool = True) -> Text | None:
    """The warm-up study in a sentence per size; a failed cell is named, and (``explain``) its likely cause given
    (else left to the appendix)."""
    ok = ok_rows(df)
    if ok.empty or not {"warmup", "forward_mean_ms", "forward_std_ms"} <= set(ok.columns):
        return None
    sentences = []
    for size, g in ok.groupby("size", sort=False):
        g = g.sort_values("warmup")
        parts = [f"{fmt.ms(r['forward_mean_ms'])} ± {fmt.sig(r['forward_std_ms'], 2)} after {int(r['warmup'])}"
                 for _, r in g.iterrows()]
        sentences.append(f"{size} {join_words(parts)}")
    failed = df[df["status"] != "ok"] if "status" in df.columns else df.iloc[:0]
    note = ""
    if len(failed):
        cause = _after_oom(df, timings)
        note = (" Not measured: " + join_words([f"{r['size']} after {int(r['warmup'])} ({r['status']})"
                                                 for _, r in failed.iterrows()])
                + "; the fresh process reported the failure, and the run keeps no further message"
                + (", while the same model ran after the other warm-up counts"
                   if failed["size"].isin(ok["size"]).all() else "")
                + ("." if not cause else ". " + cause if explain else
                   ": a failure of the harness, not of the model's memory (the appendix traces it to the cell that "
                   "ran out of memory just before it)."))
    return Text("Forward time (mean ± standard deviation) after the given number of warm-up steps: "
                + "; ".join(sentences) + "." + note)


def _cold_slowdown(cold: pd.DataFrame, warm: pd.DataFrame, phase: str) -> tuple[pd.Series, str]:
    """One pass's cold start over the sizes of both frames: its slowdown (cold mean / warm mean) per size, and the
    range in words ("1.12×–2.92×", one value where all are equal)."""
    slowdown = (cold[f"{phase}_mean_ms"] / warm[f"{phase}_mean_ms"]).dropna()
    if slowdown.empty:
        return slowdown, ""
    lo, hi = fmt.ratio(slowdown.min()), fmt.ratio(slowdown.max())
    return slowdown, (lo if lo == hi else f"{lo}–{hi}")


def _cold_against_warm(study: pd.DataFrame) -> str:
    """The cold start in words: each pass's mean without warm-up against the most warm-up, over the sizes
    measured both ways, with the size where warm-up matters most ("" when no size has both cells)."""
    ok = ok_rows(study)
    if ok.empty or not {"size", "warmup", "forward_mean_ms", "forward_std_ms"} <= set(ok.columns):
        return ""
    most = int(ok["warmup"].max())
    cold = ok[ok["warmup"] == 0].set_index("size")
    warm = ok[ok["warmup"] == most].set_index("size")
    both = [s for s in cold.index if s in warm.index]
    if not both or most == 0:
        return ""
    cold, warm = cold.loc[both], warm.loc[both]
    forward, f_range = _cold_slowdown(cold, warm, "forward")
    unrun = [str(s) for s in study.loc[(study["warmup"] == 0) & (study["status"] != "ok"), "size"]] \
        if "status" in study.columns else []
    # (c) asks for 2-3 sentences: the ranges here, each cell (and the worst) in the appendix's table
    text = (f"In a separate warm-up study (each setting in a fresh process), without warm-up the forward's mean is "
            f"{f_range} its mean after {most} warm-up steps and its standard deviation "
            f"{fmt.ms(cold['forward_std_ms'].min())}–{fmt.ms(cold['forward_std_ms'].max())}, against at most "
            f"{fmt.ms(warm['forward_std_ms'].max())} after {most}"
            + (f" (the appendix says why {join_words(unrun)} without warm-up did not run)" if unrun else ""))
    if {"backward_mean_ms", "backward_std_ms"} <= set(cold.columns):
        backward, b_range = _cold_slowdown(cold, warm, "backward")
        if b_range:
            text += f", while the backward's cold mean is {b_range} its warm one"
            # why, where the data agree: the first backward finds the CUDA context and handles the forward set up
            text += (" (the first forward has already set up the CUDA context)"
                     if backward.max() < forward.max() else "")
    return text + ". "


def _few_against_five(study: pd.DataFrame | None, spreads: float = 3.0) -> str:
    """Whether 1 and 2 warm-up steps time the forward like the most warm-up the study ran, size by size: equal
    within ``spreads`` standard deviations of the two cells, or which cells differ and by how much."""
    ok = ok_rows(study)
    if ok.empty or not {"size", "warmup", "forward_mean_ms", "forward_std_ms"} <= set(ok.columns):
        return ""
    most = int(ok["warmup"].max())
    ref = ok[ok["warmup"] == most].set_index("size")
    few = ok[(ok["warmup"] >= 1) & (ok["warmup"] < most) & ok["size"].isin(ref.index)]
    if few.empty:
        return ""
    differ, largest = [], None
    for _, r in few.iterrows():
        base = ref.loc[r["size"]]
        gap = float(r["forward_mean_ms"] - base["forward_mean_ms"])
        if largest is None or abs(gap) / float(base["forward_mean_ms"]) > largest[0]:
            largest = (abs(gap) / float(base["forward_mean_ms"]), r, base)
        if abs(gap) > spreads * (float(r["forward_std_ms"]) + float(base["forward_std_ms"])):
            differ.append(f"{r['size']} after {int(r['warmup'])}: {fmt.ms(r['forward_mean_ms'])} against "
                          f"{fmt.ms(base['forward_mean_ms'])}")
    if not differ:
        share, r, base = largest
        return (f"; here they do not: after 1 or 2 warm-up steps every size's forward takes what it takes after "
                f"{most}, within {spreads:g} standard deviations of the study's own steps (the largest difference, "
                f"{r['size']} after {int(r['warmup'])}: "
                f"{fmt.ms(r['forward_mean_ms'])} against {fmt.ms(base['forward_mean_ms'])}, {fmt.pct(share)}).")
    return f"; here {len(differ)} of {len(few)} such cells differ from {most} warm-up steps beyond the spread: " + \
        join_words(differ) + "."


def _late_outliers(study: pd.DataFrame | None, factor: float = 1.3) -> str:
    """What the study shows after warm-up: each cell with at least one warm-up step whose slowest forward is more
    than ``factor`` times its fastest (one slow step, not a warm-up cost: more warm-up did not remove it)."""
    ok = ok_rows(study)
    if ok.empty or not {"warmup", "forward_min_ms", "forward_max_ms"} <= set(ok.columns):
        return ""
    warm = ok[ok["warmup"] >= 1]
    slow = warm[warm["forward_max_ms"] > factor * warm["forward_min_ms"]]
    if warm.empty:
        return ""
    if slow.empty:
        return f" Here no cell with warm-up has a forward step {factor:g}× slower than its fastest."
    cells = [f"{r['size']} after {int(r['warmup'])} ({fmt.ms(r['forward_max_ms'])} against {fmt.ms(r['forward_min_ms'])})"
             for _, r in slow.iterrows()]
    first = warm[warm["warmup"] == warm["warmup"].min()].drop_duplicates("size", keep="last").set_index("size")
    def steady(size: str, warmup: int) -> bool:  # the size's cell with the least warm-up had no slow step
        if size not in first.index or int(first.loc[size, "warmup"]) >= warmup:
            return False
        return bool(first.loc[size, "forward_max_ms"] <= factor * first.loc[size, "forward_min_ms"])

    steady_before = all(steady(size, int(w)) for size, w in zip(slow["size"], slow["warmup"]))
    return (f" With warm-up, {len(slow)} of {len(warm)} cells have a forward step more "
            f"than {factor:g}× slower than their fastest, " + join_words(cells)
            + (f", while the same sizes were steady after {int(warm['warmup'].min())} warm-up step"
               f"{'s' if int(warm['warmup'].min()) != 1 else ''}: slow steps of the run, which more warm-up does not "
               "remove, not a warm-up cost" if steady_before else "") + ".")


def _after_oom(study: pd.DataFrame, timings: pd.DataFrame | None) -> str:
    """The likely cause when the warm-up study's first cell failed right after a timing ran out of memory in the
    same measuring process (the caller passes ``timings`` only where one run wrote both tables)."""
    oom = timings[timings["status"] == "OOM"] if timings is not None and "status" in timings.columns else None
    if oom is None or oom.empty or study.empty or study.iloc[0]["status"] == "ok" or timings.iloc[-1]["status"] != "OOM":
        return ""
    return (f"The failed cell is the first to run after {timings.iloc[-1]['size']} ran out of memory in the "
            "measuring process, and the only one: most likely that process still held the failed attempt's memory "
            "when the fresh process started. The sweep empties the allocator's cache inside its exception handler, "
            "where the handled exception still references the attempt's tensors (Python keeps it until the handler "
            "exits, `del` or not), so the cache is only emptied after the next cell; emptying it after the handler "
            "instead would let the cell run.")


SECTION = Section(
    name="benchmarking", number="1.1.3", title="End-to-end benchmarking", problems=("benchmarking_script",),
    answer=answer, presets=PRESETS, run=run, depends=(*MODEL, *TIMING), also=("model_sizes",),
    # the fresh-process warm-up study is 20 processes of 20-30 s each on an H200, so the full run (about 10.5 min
    # there) is longer than one GPU job; the study's jobs add their rows to one table
    jobs=(Job({"parts": ["timings"]}, note="2.2 min on an H200; 10B trains out of memory first, then fits forward + backward"),
          Job({"parts": ["warmup_study"], "warmup_study_sizes": ["small", "medium", "large"]},
              note="5.4 min on an H200"),
          Job({"parts": ["warmup_study"], "warmup_study_sizes": ["xl", "2.7B"]},
              note="4.4 min on an H200; run every job at one commit, or the machine cannot combine them"))
)
