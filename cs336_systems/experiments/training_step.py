"""§1.4 The training step at the limit (beyond the handout): our stack against a torch-native reference of
the same shapes, with MFU, and the longest context each preset trains at.

Per (preset, context) our training step (``cs336_basics`` model with the chosen attention, FlatAdamW,
optional activation checkpointing, ``torch.compile``) and the reference (``nn.Linear``/``nn.RMSNorm``/SDPA
pinned to cuDNN, ``AdamW(fused=True)``, the same compile) are timed alternately in one process
(:mod:`cs336_systems.benchmarking.train_step`); each step holds ``tokens_per_step`` tokens. Both compile in
``reduce-overhead`` mode by default: their graphs replay as CUDA graphs, so the comparison is of GPU work,
not of how fast this host issues kernels (in the default mode our step, with more and smaller launches,
waits on the host at small and medium). Then
:mod:`cs336_systems.benchmarking.max_context` bisects for the longest context of a batch-1 step.

    python -m cs336_systems.experiments training_step --full
    python -m cs336_systems.experiments training_step --set presets=xl --set contexts=4096 --set checkpoint=4
    python -m cs336_systems.experiments training_step --set presets=2.7B --set 'longest_presets=[]'

Each preset writes its own tables as its cells finish, so the grid can be measured over several jobs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from cs336_systems.benchmarking import train_step
from cs336_systems.benchmarking.end_to_end import default_device
from cs336_systems.benchmarking.sweep import OK, deadline_left, run_sweep
from cs336_systems.configs import PRESETS as ALL_PRESETS
from cs336_systems.experiments.section import Section, check_positive, check_presets, group, param
from cs336_systems.measured_code import MODEL
from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run


@dataclass(frozen=True)
class LongestSearch:
    presets: list[str] = param(["small", "medium", "large", "xl", "2.7B"], "presets searched ([]: none)")
    checkpoint: list[int] = param([4], "checkpoint levels of the search's steps")
    high: int = param(131072, "longest context tried")


@dataclass(frozen=True)
class Params:
    presets: list[str] = param(["small", "medium", "large", "xl", "2.7B"], "model presets")
    contexts: list[int] = param([1024, 4096], "context lengths")
    tokens_per_step: int = param(8192, "tokens per step (batch = tokens_per_step / context)")
    precision: str = param("bf16", "autocast dtype of both stacks (fp32: none)")
    compile: bool = param(True, "torch.compile both models with their losses")
    compile_mode: str = param("reduce-overhead", "torch.compile mode of both (reduce-overhead: CUDA graphs, "
                              "so neither step waits on its host)")
    attention: str = param("flash_triton", "our model's registered attention")
    optimizer: str = param("flat", "our AdamW: flat (FlatAdamW) or basics (cs336_basics, per parameter)")
    checkpoint: list[int] = param([], "our model's activation-checkpoint levels ([]: off)")
    fused_head: bool = param(False, "our LM head + cross-entropy without logits (lm_head_loss)")
    fused_projections: bool = param(True, "our Q/K/V and SwiGLU W1/W3 as one GEMM each, as the reference "
                                    "has them, with the packed-QKV attention (docs/training_step/NOTES.md)")
    rounds: int = param(3, "alternating rounds per cell")
    steps: int = param(5, "timed steps per stack and round")
    warmup: int = param(3, "untimed steps per stack (compilation happens here)")
    budget_s: float = param(420.0, "time budget of the comparison; cells past it are recorded as skipped")
    resident: str = param("auto", "both stacks on the device at once, one at a time (rebuilt per round), or auto")
    split_steps: int = param(3, "profiled steps per stack for the time split of each cell (0: none)")
    baseline: bool = param(True, "also time and profile our model as it started (eager, SDPA, per-parameter "
                           "AdamW: train_step.BASELINE_CHANGES) after each cell's pair, on its own")
    longest: LongestSearch = group(LongestSearch(), "the longest context each preset trains at")
    ceiling_sizes: list[int] = param([4096, 8192, 16384], "square matmul sizes of the measured ceiling ([]: none)")

    def check(self) -> None:
        check_presets(*self.presets, *self.longest.presets)
        if self.resident not in train_step.RESIDENCY:
            raise ValueError(f"resident must be one of {', '.join(train_step.RESIDENCY)}, got {self.resident!r}")
        if self.split_steps < 0:
            raise ValueError(f"split_steps must be >= 0, got {self.split_steps}")
        check_positive(tokens_per_step=self.tokens_per_step, rounds=self.rounds, steps=self.steps,
                       budget_s=self.budget_s, **{"longest.high": self.longest.high},
                       **{f"contexts[{i}]": c for i, c in enumerate(self.contexts)})
        bad = [c for c in self.contexts if self.tokens_per_step % c]
        if bad:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} is not a multiple of context {bad[0]}")
        train_step.StepSpec(attention=self.attention, precision=self.precision, optimizer=self.optimizer,
                            checkpoint=tuple(self.checkpoint), compile_mode=self.compile_mode).check()


PRESETS = {
    "full": Params(),
    "quick": Params(presets=["small", "xl"], contexts=[1024], rounds=2, budget_s=240.0,
                    longest=LongestSearch(presets=["xl"])),
    "smoke": Params(presets=["tiny"], contexts=[16, 32], tokens_per_step=64, precision="fp32", compile=False,
                    attention="sdpa", rounds=1, steps=1, warmup=0, budget_s=60.0, split_steps=1,
                    longest=LongestSearch(presets=["tiny"], checkpoint=[1], high=32), ceiling_sizes=[64]),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """Both stacks per (preset, context), then the longest-context search.

    Each preset's cells go to their own tables (``steps_<preset>``, ``time_split_<preset>``), rewritten after
    every cell: the full grid is longer than one GPU job may run, so presets can be measured in separate
    jobs (``--set presets=small,medium``, then ``--set presets=xl``), and a job killed mid-grid keeps what
    it finished. :func:`derive` combines whichever preset tables exist."""
    device = default_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    deadline = time.monotonic() + p.budget_s
    result: dict[str, Any] = {}
    ceiling = None
    if p.presets and p.ceiling_sizes:  # the throughput real GEMMs reach here: the second MFU denominator
        from cs336_systems.benchmarking import matmul_ceiling

        dtype = "fp32" if p.precision == "fp32" else p.precision
        table = matmul_ceiling.measure(dtype, tuple(p.ceiling_sizes), device)
        out.table(table, "matmul_ceiling")
        ceiling = matmul_ceiling.ceiling_tflops(table)
        result["matmul_ceiling"] = table

    for preset in p.presets:
        splits: list[pd.DataFrame] = []

        def cell(context_length: int, preset: str = preset, splits: list = splits) -> dict[str, Any]:
            spec = train_step.StepSpec(preset, context_length, p.tokens_per_step // context_length, p.precision,
                                       compile=p.compile, compile_mode=p.compile_mode, attention=p.attention,
                                       optimizer=p.optimizer,
                                       checkpoint=tuple(p.checkpoint), fused_head=p.fused_head,
                                       fused_projections=p.fused_projections)
            rows = train_step.compare(spec, p.rounds, p.steps, p.warmup, device=device, split_steps=p.split_steps,
                                      resident=p.resident)
            torch._dynamo.reset()  # compiled graphs hold the models
            resident, found = rows.attrs["resident"], [rows.attrs.get("split")]
            status = {}
            if p.baseline:  # the "before": our model as it started, at the same batch and precision
                before = train_step.measure_alone(train_step.baseline_spec(spec), p.rounds, p.steps, p.warmup,
                                                  device, p.split_steps)
                status = {"baseline_status": before.attrs["status"]}
                found.append(before.attrs.get("split"))
                # without the frames' attrs (which pandas would compare while concatenating), and without an
                # empty OOM frame (whose untyped columns would turn every column into objects)
                rows = pd.concat([pd.DataFrame(f.to_dict("list")) for f in (rows, before) if len(f)],
                                 ignore_index=True)
            table = train_step.summarize(rows, spec, name, ceiling_tflops=ceiling).set_index("stack")
            splits.extend(f.assign(preset=preset, context_length=context_length) for f in found if f is not None)
            return {"resident": resident, "matmul_ceiling_TFLOP_per_s": ceiling, **status,
                    **{f"{stack}_{col}": table.loc[stack, col] for stack in table.index for col in table.columns}}

        def write(rows: pd.DataFrame, preset: str = preset, splits: list = splits) -> None:
            # one preset's contexts may take longer than a GPU job (xl: about 5 minutes a context with one stack
            # resident): rows of another job of this commit, device and step parameters stay. Read when
            # writing, not when the job starts, so jobs of one preset run side by side on two GPUs of a host
            # keep each other's rows (all but a write in the same instant: the read and write are not atomic).
            earlier = {name: rows_of_this_run(out, f"{name}_{preset}", asdict(p), STEP_PARAMS)
                       for name in ("steps", "time_split")}
            rows = rows.assign(preset=preset)[["preset", *rows.columns]]
            rows["batch_size"] = p.tokens_per_step // rows["context_length"]
            rows = merge_rows(rows, earlier["steps"], "context_length")
            out.table(rows, f"steps_{preset}", params={"contexts": sorted(rows["context_length"].unique().tolist())},
                      extra={"vs_reference": "reference step time / ours (above 1: ours faster)"})
            result[f"steps_{preset}"] = rows
            if splits or earlier["time_split"] is not None:
                split = merge_rows(pd.concat(splits, ignore_index=True) if splits else None, earlier["time_split"],
                                   "context_length")
                out.table(split, f"time_split_{preset}",
                          extra={"host / idle": "measured step time minus the kernels' time"})
                result[f"time_split_{preset}"] = split

        configs = [{"context_length": c} for c in p.contexts]
        run_sweep(cell, configs, desc=f"training step {preset}", budget_s=deadline_left(deadline), on_row=write)
    if p.longest.presets:
        from cs336_systems.benchmarking.max_context import longest_contexts

        base = train_step.StepSpec(batch_size=1, precision=p.precision, attention=p.attention,
                                   optimizer=p.optimizer, checkpoint=tuple(p.longest.checkpoint),
                                   fused_projections=p.fused_projections)
        # One preset at a time, each written when its search ends: all five take longer than one GPU job, so
        # jobs split by preset (--set 'presets=[]' --set longest.presets=xl) combine at one commit and setting,
        # reading the table when writing it, so jobs running side by side keep each other's presets.
        for preset in p.longest.presets:
            high = p.longest.high
            found = longest_contexts([preset], base, low=min(256, high), high=high, granularity=min(256, high),
                                     device=device)
            longest = merge_rows(found, rows_of_this_run(out, "longest_context", asdict(p), LONGEST_PARAMS),
                                 "preset", order=list(ALL_PRESETS))
            out.table(longest, "longest_context")
        result["longest_context"] = longest
    return result


#: Parameters that change what a cell measures: rows of runs that agree on them (and on the commit) combine.
STEP_PARAMS = ("tokens_per_step", "precision", "compile", "compile_mode", "attention", "optimizer", "checkpoint",
               "fused_head", "fused_projections", "rounds", "steps", "warmup", "split_steps", "resident", "baseline")


#: Parameters that change what the longest-context search finds: searches that agree on them combine.
LONGEST_PARAMS = ("precision", "attention", "optimizer", "fused_projections", "longest.checkpoint", "longest.high")


#: Every preset's measured tables (the order of the combined tables).
STEP_TABLES = tuple(f"steps_{name}" for name in ALL_PRESETS)
SPLIT_TABLES = tuple(f"time_split_{name}" for name in ALL_PRESETS)


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Any:
    """The combined ``steps`` and ``time_split`` tables and their figures, from whichever presets were measured."""
    from cs336_systems.derived import Derived

    steps = [(n, tables[n]) for n in STEP_TABLES if tables.get(n) is not None]
    splits = [(n, tables[n]) for n in SPLIT_TABLES if tables.get(n) is not None]
    derived = Derived()
    if steps:
        wide = pd.concat([t for _, t in steps], ignore_index=True)
        derived.tables["steps"] = (wide, steps[0][0])
        if (wide["status"] == OK).any():
            derived.figures["mfu"] = (plot_mfu(wide), steps[0][0])
    if splits:
        split = pd.concat([t for _, t in splits], ignore_index=True)
        derived.tables["time_split"] = (split, splits[0][0])
        derived.figures["time_split"] = (plot_time_split(split), splits[0][0])
    return derived


def split_by_bucket(split: pd.DataFrame) -> pd.DataFrame:
    """The long time split as one row per (preset, context, stack) and one column per bucket (ms per step)."""
    from cs336_systems.profiling.step_split import BUCKETS

    wide = split.pivot_table(index=["preset", "context_length", "stack"], columns="bucket", values="ms_per_step",
                             sort=False)
    return wide.reindex(columns=[b for b in BUCKETS if b in wide.columns])


def plot_time_split(split: pd.DataFrame) -> plt.Figure:
    """One stacked bar per (preset, context, stack): milliseconds per step in each bucket."""
    wide = split_by_bucket(split).fillna(0.0)
    wide.index = [f"{pr} {c} {s}" for pr, c, s in wide.index]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(wide) + 1.5))
    wide.plot.barh(stacked=True, ax=ax, width=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    return fig


def plot_mfu(wide: pd.DataFrame) -> plt.Figure:
    """MFU of both stacks (and of the baseline, where timed) per preset, a panel per context length."""
    ok = wide[wide["status"] == OK]
    long = pd.concat([ok.assign(stack=s, MFU=ok[f"{s}_MFU_pct"]) for s in ("baseline", "ours", "reference")
                      if f"{s}_MFU_pct" in ok], ignore_index=True)
    g = sns.catplot(data=long, x="preset", y="MFU", hue="stack", col="context_length", kind="bar", height=3.4,
                    aspect=1.2)
    g.set_axis_labels("preset", "MFU (% of the data-sheet peak)")
    return g.figure


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report import fmt  # noqa: E402
from cs336_systems.report.answers import join_words, ok_rows, question, subset  # noqa: E402
from cs336_systems.report.data import SectionData  # noqa: E402
from cs336_systems.report.document import Block, Text  # noqa: E402
from cs336_systems.results import recorded  # noqa: E402


def answer(d: SectionData) -> list[Block]:
    combined = d.frame("steps")
    steps = ok_rows(combined)
    older = _older_presets(d, combined)
    missing = _missing_text(steps, pd.concat([ok_rows(d.frame(name)) for name in older]) if older else None)
    text = Text(missing.strip()) if older else None
    if not steps.empty and {"ours_step_ms", "reference_step_ms"} <= set(steps.columns):
        ratio = steps["reference_step_ms"] / steps["ours_step_ms"]
        lo, hi = steps.loc[ratio.idxmin()], steps.loc[ratio.idxmax()]
        cell = lambda r: f"{r['preset']} at {int(r['context_length'])}"  # noqa: E731
        text = Text(f"Ours runs at {fmt.ratio(ratio.min())}–{fmt.ratio(ratio.max())} the reference's speed "
                    f"(reference time / ours; {cell(lo)} the slowest, {cell(hi)} the "
                    f"{'fastest' if ratio.max() > 1 else 'closest'})"
                    + (", behind it in every cell" if (ratio < 1).all() else "")
                    + (f". Our best MFU is {steps['ours_MFU_pct'].max():.1f}% of the data sheet "
                       f"({cell(steps.loc[steps['ours_MFU_pct'].idxmax()])}) against the reference's "
                       f"{steps['reference_MFU_pct'].max():.1f}%" if _has_values(steps, "ours_MFU_pct") else "")
                    + ". MFU counts 6 × parameters × tokens plus attention's matmuls, as the calculator does."
                    + _ties_text(steps) + _tokens_text(steps) + _mode_text(d.meta("steps")) + missing)
    long_text = _longest_text(d.frame("longest_context"), d.meta("longest_context").get("params") or {})
    return [
        question(d, "steps", "Our training step against a torch-native reference of the same shapes, with MFU.", [
            text,
            d.table("steps", frame=subset(combined, *STEP_COLUMNS),
                    caption="Median step time over alternating rounds, spread (max - min), ours over the reference "
                            "and MFU against the data-sheet peak and against the matmul ceiling measured in the same "
                            "job (matmul_ceiling). Combined from one table per preset (`steps_<preset>`), "
                            "each measured by its own job; the run parameters shown are the first preset's, and each "
                            "preset's own are in its table's record. baseline_step_ms: our model as it started "
                            "(eager, SDPA, per-parameter AdamW), timed alone after the pair."),
            *(d.table(name, frame=subset(d.frame(name), *STEP_COLUMNS),
                      caption=f"{name}: measured on other code than the current (its source line says which), so "
                              "not combined with the current presets; the same columns.") for name in older),
            d.figure("time_split", caption="Where a step's time goes, from a profile of each stack: GPU time by "
                     "kernel kind, and the rest of the measured step (the GPU waiting on the host)."),
            _split_text(d.frame("time_split"), d.meta("steps").get("params")),
            _before_text(steps, d.frame("time_split")),
            _ceiling_text(steps),
        ], what="the training-step comparison"),
        question(d, "longest", "The longest context each preset trains at on this GPU.", [
            long_text,
            d.table("longest_context", frame=_boundary(d.frame("longest_context")),
                    caption="Where each preset's bisection ended: the longest context that trained (two full "
                    "steps) with its peak memory, and the shortest that ran out of memory (every trial: the CSV). "
                    "Combined from searches of one or more presets each, run as separate jobs of the same code and "
                    "setting; the run parameters shown are the last job's."),
        ], what="the longest-context search"),
    ]


def _has_values(frame: pd.DataFrame, column: str) -> bool:
    """``column`` exists and holds a number somewhere (MFU is empty on a CPU, which has no data-sheet peak)."""
    return column in frame.columns and bool(frame[column].notna().any())


def _bucket_gap(split: pd.DataFrame, slower: str, faster: str) -> pd.DataFrame:
    """Per (preset, context) cell and bucket: ``slower``'s ms per step minus ``faster``'s (cells both have)."""
    keyed = split_by_bucket(split[split["stack"].isin([slower, faster])])
    return (keyed.xs(slower, level="stack") - keyed.xs(faster, level="stack")).dropna()


def _before_text(steps: pd.DataFrame, split: pd.DataFrame | None) -> Text | None:
    """Before and after: our step against our model as it started (the baseline, timed alone), and the buckets
    of the time split the saving came from."""
    if "baseline_step_ms" not in steps.columns:
        return None
    status = steps["baseline_status"] if "baseline_status" in steps.columns else pd.Series("ok", index=steps.index)
    timed = steps[steps["baseline_step_ms"].notna()]
    oom = [f"{r['preset']} at {int(r['context_length'])}" for _, r in steps[status == "OOM"].iterrows()]
    if timed.empty and not oom:
        return None
    cell = lambda r: f"{r['preset']} at {int(r['context_length'])}"  # noqa: E731
    text = ("Before and after: against our model as it started (eager, SDPA attention, `cs336_basics`' "
            "per-parameter AdamW, no checkpointing or fused paths; the same batch and precision, timed alone "
            "after each pair)")
    if not timed.empty:
        gain = timed["baseline_step_ms"] / timed["ours_step_ms"]
        lo, hi = timed.loc[gain.idxmin()], timed.loc[gain.idxmax()]
        text += (f", our step is {fmt.ratio(gain.min())}–{fmt.ratio(gain.max())} as fast ({cell(lo)} the least, "
                 f"{cell(hi)} the most)")
        if _has_values(timed, "baseline_MFU_pct"):
            text += (f"; the baseline reaches {timed['baseline_MFU_pct'].min():.1f}–"
                     f"{timed['baseline_MFU_pct'].max():.1f}% MFU")
    if split is not None and {"baseline", "ours"} <= set(split.get("stack", pd.Series(dtype=str))):
        saved = _bucket_gap(split, "baseline", "ours").sum()
        if saved[saved > 0].sum() > 0:
            share = saved / saved[saved > 0].sum()
            text += ("; of the time saved, summed over the profiled cells, " + join_words(
                [f"{fmt.pct(share[b])} came from {b}" for b in saved.sort_values(ascending=False).index
                 if saved[b] > 0][:3]))
    if oom:
        text += f". The baseline does not fit at {join_words(oom)} (out of memory)"
    return Text(text + ".")


def _boundary(longest: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per preset, the trials on either side of the answer: the longest context that fit and the shortest that
    did not (none where the search stopped at its top or its bottom)."""
    if longest is None or not {"preset", "context_length", "fits"} <= set(longest.columns):
        return longest
    fits = longest["fits"].astype(str).str.lower() == "true"
    keep = []  # in the presets' order, each preset's two trials by context
    for _, rows in longest.assign(_fits=fits).groupby("preset", sort=False):
        ok, failed = rows[rows["_fits"]], rows[~rows["_fits"]]
        keep += [ok["context_length"].idxmax()] if len(ok) else []
        keep += [failed["context_length"].idxmin()] if len(failed) else []
    return longest.loc[keep].drop(columns=["longest"], errors="ignore").reset_index(drop=True)


def _longest_text(longest: pd.DataFrame | None, params: dict[str, Any]) -> Text | None:
    """Each preset's longest context with the peak memory there; a preset that fits at the highest context
    tried is reported as "at least" that, since the search never looked further."""
    if longest is None or not {"preset", "longest"} <= set(longest.columns):
        return None
    # the search's group, or the flat names of records from before the parameter groups
    high = recorded(params, "longest.high", params.get("longest_high"))
    found, at_top = [], []
    for preset, rows in longest.groupby("preset", sort=False):
        best = rows["longest"].iloc[0]
        if pd.isna(best):
            found.append(f"{preset} none (its shortest context tried runs out of memory)")
            continue
        top = high is not None and int(best) >= int(high)
        at_top += [preset] if top else []
        peak = rows.loc[rows["context_length"] == best, "peak_GiB"] if "peak_GiB" in rows.columns else None
        memory = f" ({peak.iloc[0]:.1f} GiB peak)" if peak is not None and len(peak) and pd.notna(peak.iloc[0]) else ""
        found.append(f"{preset} {'at least ' if top else ''}{int(best):,}{memory}")
    how = [f"{params['attention']} attention"] if params.get("attention") else []
    levels = recorded(params, "longest.checkpoint", params.get("longest_checkpoint")) or []
    if levels:
        how.append("activation checkpointing in segments of " + " within ".join(map(str, levels)) + " blocks")
    text = ("Longest context of a batch-1 training step (forward, loss, backward and optimizer step, run twice "
            "without running out of memory" + (", with " + join_words(how) if how else "") + "): "
            + join_words(found) + ".")
    if at_top:
        text += (f" The search stops at {int(high):,} tokens (`longest.high`), so {join_words(at_top)} may train "
                 "at longer contexts still.")
    searched = set(longest["preset"])
    unsearched = [pr for pr in PRESETS["full"].longest.presets if pr not in searched]
    if unsearched:
        text += f" Not searched in these runs: {join_words(unsearched)}."
    return Text(text)


def _ceiling_text(steps: pd.DataFrame) -> Text | None:
    """The measured matmul ceilings in a sentence (each job's table is in the results index)."""
    col = "matmul_ceiling_TFLOP_per_s"
    if col not in steps.columns or steps[col].isna().all():
        return None
    lo, hi = steps[col].min(), steps[col].max()
    return Text("The second MFU denominator is the bf16 matmul ceiling each job measures before its cells (the best "
                "of square matmuls, `do_bench` medians): " + (f"{lo:.0f}–{hi:.0f}" if round(lo) != round(hi)
                                                               else f"{hi:.0f}") + " TFLOP/s over the jobs.")


def _tokens_text(steps: pd.DataFrame) -> str:
    """Tokens per step, naming the presets measured with another number than most."""
    if "batch_size" not in steps.columns:
        return ""
    tokens = (steps["batch_size"] * steps["context_length"]).astype(int)
    usual = tokens.mode().iloc[0]
    other = {pr: t for pr, t in zip(steps["preset"], tokens) if t != usual}
    return f" Each step holds {usual:,} tokens" + (
        " (" + ", ".join(f"{pr}: {t:,}" for pr, t in other.items()) + ")" if other else "") + "."


def _ties_text(steps: pd.DataFrame) -> str:
    """The cells where the two stacks differ by less than the larger spread of their rounds: no difference."""
    need = {"ours_step_ms", "reference_step_ms", "ours_spread_ms", "reference_spread_ms"}
    if not need <= set(steps.columns):
        return ""
    diff = (steps["ours_step_ms"] - steps["reference_step_ms"]).abs()
    tie = diff <= steps[["ours_spread_ms", "reference_spread_ms"]].max(axis=1)
    if not tie.any():
        return ""
    cells = [f"{r['preset']} at {int(r['context_length'])}" for _, r in steps[tie].iterrows()]
    return (f" In {len(cells)} of the {len(steps)} cells ({join_words(cells)}) the two differ by less than the "
            "spread of their rounds: no difference.")


def _mode_text(meta: dict[str, Any]) -> str:
    """How both stacks were compiled, from the run's recorded parameters."""
    params = meta.get("params", {})
    if not params.get("compile"):
        return " Neither stack is compiled."
    mode = params.get("compile_mode", "default")
    if mode in train_step.CUDA_GRAPH_MODES:
        return (f" Both stacks are compiled in `{mode}` mode, so their steps replay as CUDA graphs and the "
                "host's speed at issuing kernels drops out of the comparison.")
    return f" Both stacks are compiled in `{mode}` mode."


#: The columns the answer shows of a ``steps`` table (the CSV has every stack's full set).
STEP_COLUMNS = ("preset", "context_length", "batch_size", "status", "resident", "ours_step_ms", "ours_spread_ms",
                "reference_step_ms", "reference_spread_ms", "ours_vs_reference", "ours_MFU_pct", "reference_MFU_pct",
                "ours_MFU_of_ceiling_pct", "reference_MFU_of_ceiling_pct", "baseline_step_ms")


def _older_presets(d: SectionData, steps: pd.DataFrame | None) -> list[str]:
    """The per-preset tables left out of the combined ``steps`` (it takes only inputs measured on the current code,
    ``derived.load_inputs``): shown on their own, marked stale, rather than dropped."""
    combined = set() if steps is None or "preset" not in steps.columns else set(steps["preset"].astype(str))
    return [name for name in STEP_TABLES if name in d.tables and name.removeprefix("steps_") not in combined]


def _missing_text(steps: pd.DataFrame, older: pd.DataFrame | None = None) -> str:
    """The cells of the full grid that the combined table lacks: those measured only on other code (the ok rows
    ``older`` of the tables shown on their own) and those no job measured."""
    full = PRESETS["full"]

    def cells(frame: pd.DataFrame | None) -> set[tuple[str, int]]:
        if frame is None or frame.empty or not {"preset", "context_length"} <= set(frame.columns):
            return set()
        return set(zip(frame["preset"].astype(str), frame["context_length"].astype(int)))

    have, other = cells(steps), cells(older) - cells(steps)
    grid = [(pr, c) for pr in full.presets for c in full.contexts]
    other_words = [f"{pr} at {c}" for pr, c in grid if (pr, c) in other]
    missing = [f"{pr} at {c}" for pr, c in grid if (pr, c) not in have | other]
    text = (f" Measured only on other code than the current (shown below, marked stale): {join_words(other_words)}."
            if other_words else "")
    return text + (f" Not measured in these runs: {join_words(missing)}." if missing else "")


def _split_text(split: pd.DataFrame | None, params: dict[str, Any] | None = None) -> Text | None:
    """Which buckets hold the gap between our step and the reference's, summed over every cell; ``params``
    (the run's) say whether our projections were fused."""
    if split is None or not {"bucket", "ms_per_step", "stack", "preset", "context_length"} <= set(split.columns) \
            or not {"ours", "reference"} <= set(split["stack"]):
        return None
    gap = _bucket_gap(split, "ours", "reference")
    if gap.empty:
        return None
    total = gap.sum()
    worst = total.sort_values(ascending=False)
    share = worst / worst[worst > 0].sum()
    lead = [f"{fmt.pct(share[b])} in {b}" for b in worst.index if worst[b] > 0][:3]
    lead[0] = lead[0].replace(" in ", " lies in ", 1)
    ahead = [b for b in worst.index if worst[b] < 0]
    per_cell = gap[worst.index[0]]
    spread = (f"{fmt.ms(per_cell.min())}–{fmt.ms(per_cell.max())} per step more" if per_cell.min() >= 0 else
              f"from {fmt.ms(-per_cell.min())} per step less to {fmt.ms(per_cell.max())} more, by cell")
    fused = bool((params or {}).get("fused_projections"))
    opening = (f"Of the time by which our step trails the reference, summed over the {len(gap)} cells, "
               if total.sum() > 0 else
               f"Our step is the faster one overall; of the kernel time it still spends beyond the reference's, "
               f"summed over the {len(gap)} cells, ")
    return Text(opening + join_words(lead) + f"; {worst.index[0]} alone costs us {spread}"
                + (", while ours is faster in " + join_words(
                    [f"{b} (by {fmt.ms(-total[b] / len(gap))} a step on average)" for b in ahead]) if ahead else "")
                + "."
                + (f" Matmuls differ by {fmt.ms(gap['matmul'].abs().max())} at most: the GEMMs are not where "
                   "we lose." if "matmul" in gap.columns and share.get("matmul", 0) < 0.1 else "")
                + ((" Both models run Q, K, V as one GEMM and W1, W3 as another (`fused_projections`); ours "
                    "rotates Q and K and packs their gradient inside the attention kernels "
                    "(`flash_attention_qkvpacked`)." if fused else
                    " The reference fuses the Q, K, V projections into one weight and W1, W3 into another; our "
                    "model, run with `fused_projections` off, keeps five separate weights, so each layer runs more "
                    "and smaller GEMMs. Fusing them (`cs336_systems.fused_projections`) saved matmul time but, "
                    "with split attention heads, cost more in the backward, where Inductor concatenated dQ, dK and "
                    "dV for the fused weight's gradient: slower overall on the H100. The packed-QKV attention "
                    "(`flash_attention_qkvpacked`) writes that gradient in place instead and makes fusing pay "
                    "(`docs/training_step/NOTES.md`); these runs have it off.")
                   if share.get("matmul", 0) >= 0.1 else "")
                + (" Our attention is not ahead of cuDNN across §1.3.2's grid (its goals table says where and by how "
                   "much); at head dimension 80 "
                   "(2.7B) it runs as two slabs of 64 and 16 columns, with no padded work, and still trails cuDNN "
                   "there (`docs/flash_attention/head_dim_slabs.md`)." if share.get("attention", 0) >= 0.1 else ""))


from cs336_systems.experiments.section import Job  # noqa: E402

#: What every grid job of the full run sets: no search (its own jobs), two rounds, a budget inside ten minutes.
_GRID_JOB = {"longest.presets": [], "rounds": 2, "budget_s": 540.0}


SECTION = Section(
    name="training_step", number="1.4", title="The training step at the limit (beyond the handout)",
    problems=("beyond the handout",), answer=answer, presets=PRESETS, run=run, derive=derive,
    derive_inputs=(*STEP_TABLES, *SPLIT_TABLES),
    depends=(*MODEL, "cs336_systems/benchmarking/train_step.py", "cs336_systems/benchmarking/torch_native_lm.py",
             "cs336_systems/fused_projections.py", "cs336_systems/benchmarking/max_context.py",
             "cs336_systems/benchmarking/end_to_end.py",
             "cs336_systems/benchmarking/sweep.py", "cs336_systems/flat_adamw.py", "cs336_systems/checkpointing.py",
             "cs336_systems/hardware.py", "cs336_systems/attention/",
             "cs336_systems/profiling/step_split.py", "cs336_systems/profiling/torch_profiler.py"),
    # the slowest of the runs at ec3eb1a, bde2b6b and 9e8909b (docs/training_step/NOTES.md; 2.7B at 1024 ran past
    # 4.1 min at 9e8909b); a fresh machine adds 1-1.5 min to its first job
    jobs=(
        *(Job({**_GRID_JOB, **sets}, minutes) for sets, minutes in (
            ({"presets": ["small", "medium"]}, 5.8),
            ({"presets": ["large"]}, 6.3),
            ({"presets": ["xl"], "contexts": [1024]}, 5.9),
            ({"presets": ["xl"], "contexts": [4096]}, 5.3),
            ({"presets": ["2.7B"], "tokens_per_step": 4096, "contexts": [1024]}, 5.0),  # 8192 tokens: out of memory
            ({"presets": ["2.7B"], "tokens_per_step": 4096, "contexts": [4096]}, 4.2),
        )),
        Job({"presets": [], "longest.presets": ["small", "medium", "large"]}, 1.7, "the longest-context search"),
        Job({"presets": [], "longest.presets": ["xl"]}, 6.9, "the longest-context search"),
        Job({"presets": [], "longest.presets": ["2.7B"]}, 2.6, "the longest-context search"),
    ),
)
