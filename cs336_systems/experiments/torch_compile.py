"""§1.3 torch.compile: the §1.2.1 attention grid compiled against eager (same run), and the whole model
compiled against vanilla for a forward pass and a full training step.

Problem ``torch_compile``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from cs336_systems.benchmarking import attention_process_ab
from cs336_systems.benchmarking.attention import HANDOUT_D_MODELS, HANDOUT_SEQ_LENS
from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, ModelBenchmark
from cs336_systems.benchmarking.sweep import OK, deadline_left, free_memory, ordered, run_sweep
from cs336_systems.benchmarking.timing import TimingStats
from cs336_systems.configs import HANDOUT_SIZES, get_config
from cs336_systems.configs import PRESETS as ALL_PRESETS
from cs336_systems.experiments.pytorch_attention import GRID_AXES, attention_grid, grid_axes
from cs336_systems.experiments.section import Section, check_parts, check_positive, check_presets, param
from cs336_systems.plotting import grouped_bars, measured_on, status_heatmap
from cs336_systems.derived import Derived
from cs336_systems.report import fmt
from cs336_systems.report.answers import edition_rows, failed_rows, handout_model, in_handout, join_words, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run


#: What a run measures; the whole model at every size takes longer than one GPU job may, so the model part
#: also runs size by size (``--set sizes=xl``) in jobs of its own. ``processes`` times the launch-bound eager
#: attention cells in fresh processes of this section and of §1.2.1, alternating: how far one cell moves between
#: processes, which one process's step-to-step spread does not show.
PARTS = ("attention", "model", "processes")

#: Settings the model rows of two jobs must share for one table to hold them.
MODEL_PARAMS = ("context_length", "warmup", "steps", "rounds", "compile")


@dataclass(frozen=True)
class Params:
    d_models: list[int] = param(HANDOUT_D_MODELS, "attention grid: head dimensions")
    seq_lens: list[int] = param(HANDOUT_SEQ_LENS, "attention grid: sequence lengths")
    batch_size: int = param(8, "attention grid: batch size (one head)")
    n_forward: int = param(100, "attention grid: timed forward passes per cell")
    n_backward: int = param(100, "attention grid: timed backward passes per cell")
    sizes: list[str] = param(list(HANDOUT_SIZES), "model presets compiled")
    context_length: int = param(512, "model: tokens per sequence")
    warmup: int = param(5, "model: untimed steps (compilation happens here)")
    steps: int = param(10, "model: timed steps per round")
    rounds: int = param(3, "model: eager and compiled alternate this many times, each warm-up + steps")
    compile: bool = param(True, "False: eager against eager (smoke runs: Inductor takes minutes on a small CPU)")
    budget_s: float = param(1200.0, "time budget in seconds; cells past it are recorded as skipped")
    process_seq_lens: list[int] = param([256, 1024], "processes: the sequence lengths (every head dimension) "
                                                     "timed in fresh processes")
    process_rounds: int = param(5, "processes: rounds, each one fresh process per section, in alternating order")
    parts: list[str] = param(list(PARTS), "what to run: attention (the grid), model (the sizes), processes (the "
                                          "short cells in fresh processes); a job of model sizes adds its rows to "
                                          "the model tables of the same commit and settings")

    def check(self) -> None:
        check_presets(*self.sizes)
        check_parts("torch_compile", self.parts, PARTS)
        check_positive(batch_size=self.batch_size, n_forward=self.n_forward, n_backward=self.n_backward,
                       context_length=self.context_length, steps=self.steps, rounds=self.rounds, budget_s=self.budget_s,
                       process_rounds=self.process_rounds, **{f"process_seq_len {s}": s for s in self.process_seq_lens})


PRESETS = {
    "full": Params(),
    "quick": Params(n_forward=50, n_backward=50, sizes=["small", "medium", "large"], warmup=3, steps=5,
                    rounds=2, process_rounds=3, budget_s=330.0),
    "smoke": Params(d_models=[16], seq_lens=[32], batch_size=2, n_forward=2, n_backward=2, sizes=["tiny"],
                    context_length=32, warmup=1, steps=2, rounds=1, compile=False, process_seq_lens=[32],
                    process_rounds=1, budget_s=60.0),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """Attention eager then compiled over the grid; the model eager and compiled, forward and train; the short
    eager cells in fresh processes."""
    compile = p.compile
    if not compile:
        print("torch.compile skipped in the smoke run (inductor compilation takes minutes on a small CPU); "
              "eager is benchmarked against eager to exercise the pipeline.")
    deadline = time.monotonic() + p.budget_s
    results: dict[str, Any] = {}
    if "attention" in p.parts:
        share = 1.0 if "model" not in p.parts else 0.5
        eager = attention_grid(p, compile=False, budget_s=0.4 * share * p.budget_s, desc="attention eager")
        compiled = attention_grid(p, compile=compile, budget_s=0.6 * share * p.budget_s, desc="attention compiled")
        both = pd.concat([eager, compiled], ignore_index=True)
        out.table(both, "attention_timings")
        merged = eager.merge(compiled, on=["d_model", "seq_len"], suffixes=("_eager", "_compiled"))
        ratio = merged[["d_model", "seq_len", "status_eager", "status_compiled"]].copy()
        for ph in ("forward", "backward"):
            e, c = merged.get(f"{ph}_mean_ms_eager"), merged.get(f"{ph}_mean_ms_compiled")
            if e is not None and c is not None:
                ratio[f"{ph}_eager_ms"], ratio[f"{ph}_compiled_ms"], ratio[f"{ph}_speedup"] = e, c, e / c
        out.table(ratio, "attention_speedup")
        results.update(attention_timings=both, attention_speedup=ratio)
    if "model" in p.parts:
        results.update(model_part(p, out, deadline))
    if "processes" in p.parts:
        cells = [(d, s) for d in p.d_models for s in p.process_seq_lens]
        processes = attention_process_ab.measure(cells=cells, rounds=p.process_rounds, n=p.n_forward,
                                                 batch=p.batch_size)
        out.table(processes, "attention_processes")
        results["attention_processes"] = processes
    return results


def eager_and_compiled(spec: BenchmarkSpec, rounds: int, compile: bool = True) -> dict[bool, dict[str, Any]]:
    """The model eager and compiled in one process on one set of weights, alternating; one row per side.

    The compiled module wraps the eager one (same parameters; in training one AdamW state stepped by both) and
    compiles first, in warm-up steps of its own (``wall_incl_compile_s``). Then each of ``rounds`` runs
    ``spec.warmup`` untimed and ``spec.steps`` timed steps eager, then compiled. Timed as separate benchmarks,
    the eager step ran right after Inductor's compile had left the GPU idle for half a minute and took longer than
    the same step in §1.1.3; alternating puts both sides in the same state of the GPU.
    """
    torch._dynamo.reset()
    eager = ModelBenchmark(spec)
    compiled = ModelBenchmark(replace(spec, compile=compile), model=eager.model)
    compiled.optimizer = eager.optimizer  # AdamW allocates its state at the first step: one state, not two
    start = time.perf_counter()
    compiled.run(steps=0)
    compile_s = time.perf_counter() - start
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for side, bench in ((False, eager), (True, compiled)):
            times[side] += bench.run()["total"].times_s
    torch._dynamo.reset()  # compiled graphs hold on to the model's weights
    tokens = spec.config.batch_size * spec.config.context_length
    rows = {}
    for side, seconds in times.items():
        stats = TimingStats.from_seconds(seconds)
        rows[side] = {**stats.summary(prefix="total_"), "tokens_per_s": tokens / stats.mean,
                      "wall_incl_compile_s": compile_s if side else math.nan}
    return rows


def model_part(p: Params, out: ResultWriter, deadline: float) -> dict[str, Any]:
    """The whole model eager and compiled (alternating, :func:`eager_and_compiled`), forward and training step,
    per size; rows of sizes this run does not measure are kept from an earlier job of the same commit, device
    and settings."""

    def pair(size: str, mode: str) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode=mode, context_length=p.context_length, warmup=p.warmup, steps=p.steps)
        rows = eager_and_compiled(spec, p.rounds, p.compile)
        return {f"{side}:{k}": v for side, row in rows.items() for k, v in row.items()}

    configs = [{"size": s, "mode": m} for s in p.sizes for m in ("forward", "train")]
    def write(pairs: pd.DataFrame) -> dict[str, pd.DataFrame]:
        # rows of another job of this code and setting stay; read now, so jobs side by side nearly always keep both
        earlier = rows_of_this_run(out, "model_timings", asdict(p), MODEL_PARAMS)
        model = merge_rows(_one_row_per_side(pairs), earlier, "size", order=list(ALL_PRESETS))
        sizes = list(dict.fromkeys(model["size"]))
        out.table(model, "model_timings", params={"sizes": sizes})
        ok = model[model["status"] == OK]
        speed = pd.DataFrame()
        if not ok.empty and ok["compiled"].nunique() == 2:
            wide = ok.pivot_table(index=["size", "mode"], columns="compiled", values="total_mean_ms")
            speed = wide.rename(columns={False: "eager_ms", True: "compiled_ms"}).dropna().reset_index()
            speed["speedup"] = speed["eager_ms"] / speed["compiled_ms"]
            speed = ordered(speed, "size", sizes).sort_values(["size", "mode"]).reset_index(drop=True)
            speed["size"] = speed["size"].astype(str)
            out.table(speed, "model_speedup", params={"sizes": sizes})
        return {"model_timings": model, "model_speedup": speed}

    # Written after every pair: a large preset compiles for a minute per mode, and a job cut at its time limit
    # keeps the pairs it measured.
    pairs = run_sweep(pair, configs, desc="model compiled vs eager", budget_s=deadline_left(deadline), on_row=write)
    free_memory()
    return write(pairs)


def _one_row_per_side(pairs: pd.DataFrame) -> pd.DataFrame:
    """The sweep's rows (one per size and mode, columns ``False:…`` and ``True:…``) as one row per side, with
    ``compiled`` saying which; a failed pair gives two failed rows."""
    rows = []
    for _, r in pairs.iterrows():
        for side in (False, True):
            values = {k.split(":", 1)[1]: v for k, v in r.items() if str(k).startswith(f"{side}:")}
            rows.append({"size": r["size"], "mode": r["mode"], "compiled": side, "status": r["status"], **values})
    return pd.DataFrame(rows)


def _pair_status(speedup: pd.DataFrame) -> pd.Series:
    """One status per cell of the compiled-vs-eager table: ``ok`` only if both ran."""
    eager, compiled = speedup["status_eager"].astype(str), speedup["status_compiled"].astype(str)
    return eager.where(eager != OK, compiled)


def plot_compile_speedup(attention_speedup: pd.DataFrame, model_speedup: pd.DataFrame | None = None,
                         meta: dict[str, Any] | None = None) -> Any:
    """``torch.compile`` speed-up over eager (eager time / compiled time, same run): attention forward and
    backward over (d, sequence length) as diverging heatmaps centred on 1x, and the whole model's forward
    pass and training step per size as bars."""
    has_model = model_speedup is not None and not model_speedup.empty
    widths = [1, 1, 0.8] if has_model else [1, 1]
    fig, axes = plt.subplots(1, len(widths), figsize=(6 * sum(widths) + 1, 4.4), width_ratios=widths)
    cells = attention_speedup.assign(status=_pair_status(attention_speedup))
    for ax, phase in zip(axes, ("forward", "backward")):
        status_heatmap(ax, cells, f"{phase}_speedup", **GRID_AXES, fmt="{:.2f}x", center=1.0, cmap="RdBu",
                       colorbar_label="speed-up (eager / compiled)")
        grid_axes(ax, f"Attention {phase}: compiled vs eager")
    if has_model:
        ax = axes[2]
        wide = model_speedup.pivot_table(index="size", columns="mode", values="speedup")
        wide = wide.reindex(index=list(dict.fromkeys(model_speedup["size"])))
        grouped_bars(ax, wide.rename(columns={"forward": "forward pass", "train": "training step"}), value_fmt="{:.2f}x")
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set(xlabel="model size", ylabel="speed-up (eager / compiled)", title="Whole model: compiled vs eager")
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"torch.compile speed-up over eager, {measured_on(meta)}; >1 means compiled is faster")
    fig.tight_layout()
    return fig


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """Figures of §1.3 from its ``attention_speedup`` (and, when measured, ``model_speedup``) tables."""
    fig = plot_compile_speedup(tables["attention_speedup"], tables.get("model_speedup"), meta)
    return Derived(figures={"compile_speedup": (fig, "attention_speedup")})



# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import mfu_note, model_tflops, with_mfu  # noqa: E402 (answers only)
from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def _eager_pairs(att: pd.DataFrame, eager: pd.DataFrame | None) -> pd.DataFrame | None:
    """This run's speed-up rows joined with §1.2.1's uncompiled timings at the same shapes (None without them)."""
    need = {"d_model", "seq_len", "forward_mean_ms", "backward_mean_ms"}
    if eager is None or not need <= set(eager.columns):
        return None
    ok = eager[eager["status"] == "ok"] if "status" in eager.columns else eager
    if "compiled" in ok.columns:
        ok = ok[~ok["compiled"].astype(bool)]
    both = att.merge(ok[list(need)], on=["d_model", "seq_len"]).dropna(subset=["forward_eager_ms", "forward_mean_ms"])
    return None if both.empty else both


def _long_cells_gap(att: pd.DataFrame, eager: pd.DataFrame | None) -> float | None:
    """The largest relative gap between this run's eager forward and §1.2.1's at the shapes whose forward takes
    1 ms or more (None where there are none): the cells the host does not set."""
    both = _eager_pairs(att, eager)
    slow = both[both["forward_mean_ms"] >= 1.0] if both is not None else None
    if slow is None or slow.empty:
        return None
    return float((slow["forward_eager_ms"] / slow["forward_mean_ms"] - 1).abs().max())


def _against_eager_table(att: pd.DataFrame, eager: pd.DataFrame | None) -> str:
    """How this run's eager attention compares with §1.2.1's table at the same shapes: the speed-ups pair each
    compiled time with the eager time of the same run (like with like), and the handout's "compare with your
    uncompiled results" is that table."""
    both = _eager_pairs(att, eager)
    if both is None:
        return ""
    ratio = both["forward_eager_ms"] / both["forward_mean_ms"]
    far = both.loc[(ratio - 1).abs().idxmax()]
    gap = _long_cells_gap(att, eager)
    return (f" Against §1.2.1's uncompiled table at the same {len(both)} shapes, this run's eager forward takes "
            f"{fmt.ratio(ratio.median())} of its time in the median, {fmt.ratio(ratio.min())}–{fmt.ratio(ratio.max())} "
            f"in all (farthest at d = {int(far['d_model'])}, {int(far['seq_len']):,} tokens: {fmt.ms(far['forward_eager_ms'])} "
            f"against {fmt.ms(far['forward_mean_ms'])})"
            + (f"; the shapes whose forward takes 1 ms or more agree within {fmt.pct(gap)}" if gap is not None else "")
            + ". The speed-ups pair each compiled time with the eager time of its own run, where the two ran under "
              "the same conditions.")


def _between_processes(processes: pd.DataFrame | None) -> tuple[str, pd.DataFrame | None]:
    """The short eager cells timed in fresh processes of both sections: one sentence on how far a cell moves
    between processes against how far the two sections' medians lie apart, and the per-cell summary."""
    if processes is None or not {"round", "section", "phase", "ms"} <= set(processes.columns) or processes.empty:
        return "", None
    table = attention_process_ab.summarize(processes)
    first, second = list(dict.fromkeys(processes["section"]))[:2]
    ratio = table[f"{first}_over_{second}"]
    stds = table[[f"{first}_std_ms", f"{second}_std_ms"]].max(axis=1)
    gap = (table[f"{first}_median_ms"] - table[f"{second}_median_ms"]).abs()
    rel = stds / table[[f"{first}_median_ms", f"{second}_median_ms"]].min(axis=1)
    inside = int((gap <= table[f"{first}_std_ms"].fillna(0) + table[f"{second}_std_ms"].fillna(0)).sum())
    rounds = processes["round"].nunique()
    cells = join_words([f"{int(c):,}" for c in sorted(set(processes["seq_len"]))])
    apart = f"{fmt.ratio(float(ratio.min()))}–{fmt.ratio(float(ratio.max()))}"
    if rounds < 2 or stds.isna().all():
        return (f" Timed again in one fresh process per section, the cells at {cells} tokens: the two sections' "
                f"times lie {apart} apart (one process each: no spread between processes to set them against)."), table
    verdict = ("the difference between the sections is no larger than between one process and the next, so these "
               "cells' times are set by the process they run in, not by the section's imports"
               if inside == len(table) else
               "a steady gap, beyond the processes' spread: the section's imports, not only the process, set these "
               "cells' times" if inside == 0 else
               f"inside the two standard deviations in {inside} of {len(table)} cells and passes")
    text = (f" Timed again in {rounds} fresh processes per section, the two alternating, the cells at {cells} "
            f"tokens move between one process and the next by a standard deviation of up to "
            f"{fmt.ms(float(stds.max()))} ({fmt.pct(float(rel.max()))} of the cell); the two sections' medians lie "
            f"{apart} apart: {verdict}. The check across sections compares these cells against their spread "
            "between processes.")
    return text, table


def _long_and_short(att: pd.DataFrame) -> str:
    """The speed-ups split where the eager forward takes a millisecond: above it the kernels decide them; below
    it the host's launches do, and the ratios scatter."""
    long = att[att["forward_eager_ms"] >= 1.0]
    short = att[att["forward_eager_ms"] < 1.0]
    if long.empty or short.empty:
        return ""

    def span(df: pd.DataFrame, ph: str) -> str:
        return f"{fmt.ratio(df[f'{ph}_speedup'].min())}–{fmt.ratio(df[f'{ph}_speedup'].max())}"

    return (f" Where the eager forward takes a millisecond or more ({int(long['seq_len'].min()):,} tokens and "
            f"beyond) compiling gains {span(long, 'forward')} forward and {span(long, 'backward')} backward; at the "
            f"shorter sequences (well under a millisecond, launch-bound) the ratios scatter, {span(short, 'forward')} "
            f"and {span(short, 'backward')}, following the host's launch cost rather than the kernels.")


def _handout_sizes(sizes: list[str], edition: str) -> list[str]:
    """``sizes`` (presets) that ``edition``'s handout lists, under its names, once each (2026: 2.7B is its xl,
    and 2025's xl is not its model)."""
    return list(dict.fromkeys(handout_model(s, edition) for s in sizes if in_handout(s, edition)))


def answer(d: SectionData) -> list[Block]:
    att = d.frame("attention_speedup")
    model = d.frame("model_speedup")
    d.frame("attention_timings")  # shown through the speed-up table
    timings = d.frame("model_timings")
    a_text = b_text = None
    if att is not None and {"forward_speedup", "backward_speedup"} <= set(att.columns) and att["forward_speedup"].notna().any():
        a_text = Text(f"Compiling the attention function changes the forward time by a factor of "
                      f"{fmt.ratio(att['forward_speedup'].min())}–{fmt.ratio(att['forward_speedup'].max())} "
                      f"(eager / compiled) and the backward by {fmt.ratio(att['backward_speedup'].min())}–"
                      f"{fmt.ratio(att['backward_speedup'].max())}: Inductor fuses the scaling, masking and "
                      "softmax into one or two Triton kernels, but the $T\\times T$ matrices are still written "
                      "to memory." + _long_and_short(att))
    against = (_against_eager_table(att, d.sibling("pytorch_attention").frame("timings")).strip()
               if a_text is not None else "")
    processes_text, processes = _between_processes(d.frame("attention_processes"))
    against = (against + processes_text).strip()
    if against and a_text is not None:
        gap = _long_cells_gap(att, d.sibling("pytorch_attention").frame("timings"))
        # one short sentence: the comparison across sections and processes is the appendix's
        a_text = Text(a_text.markdown + (f" This run's eager forwards of a millisecond or more agree with §1.2.1's "
                                         f"within {fmt.pct(gap)}; the appendix compares the shorter ones."
                                         if gap is not None else
                                         " The appendix compares this run's eager times with §1.2.1's."))
    shown = edition_rows(_with_mfu(model, d.meta("model_speedup")), d.edition)  # this handout's models, its names
    if shown is not None and "preset" in shown.columns:
        shown = shown.drop(columns="preset")
    if model is not None and {"mode", "speedup"} <= set(model.columns) and len(model):
        measured = set(model["size"])
        mine = edition_rows(model, d.edition)
        parts = [f"{r['size']} {r['mode']} {fmt.ratio(r['speedup'])}" for _, r in mine.iterrows()]
        missing = failed_rows(timings)
        absent = [s for s in _planned_sizes() if s not in measured and s not in set(missing.get("size", []))]
        params = d.meta("model_speedup").get("params") or {}
        batch = get_config(str(model["size"].iloc[0])).batch_size
        setup = (f" (fp32, batch {batch}, context {params['context_length']})" if params.get("context_length") else "")
        train = mine[mine["mode"] == "train"]
        falls = len(train) > 1 and float(train["speedup"].iloc[-1]) < float(train["speedup"].iloc[0])
        b_text = Text(f"Speed-up of the compiled model (eager / compiled time){setup}: " + join_words(parts) + "."
                      + (" The gain falls with model size: Inductor fuses the elementwise work around the matmuls "
                         "(norms, activations, residual adds, the attention's softmax), while the fp32 matmuls, a "
                         "larger share of the step the larger the model, run as they did." if falls else "")
                      + (" Not measured: " + join_words(sorted({f"{handout_model(r['size'], d.edition)} ({r['status']})"
                                                                for _, r in missing.iterrows()})) + "."
                         if not missing.empty else "")
                      + (f" Not measured: {join_words(unrun)}." if (unrun := _handout_sizes(absent, d.edition))
                         else ""))
    return [
        question(d, "a", "Compiled versus eager attention, forward and backward.",
                 [a_text, d.table("attention_speedup", frame=_without_ok_status(att),
                                  caption="Eager vs. compiled attention (ms) and speed-up.")],
                 what="compiled vs eager attention timings"),
        question(d, "b", "The compiled Transformer end to end: forward, and forward + backward + optimizer step.",
                 [b_text, d.table("model_speedup", frame=shown,
                                  caption="Vanilla vs. compiled model (ms per step, the two alternating in one "
                                          "process on the same weights), fp32, and each one's MFU."
                                          + mfu_note(d.meta("model_speedup")))],
                 what="compiled vs eager model timings"),
        Text("", role=BEYOND_HANDOUT),  # the tables above, plotted
        *([question(d, "a", "This run's eager attention against §1.2.1's table.", [
            Text(against),
            d.table("attention_processes", frame=processes,
                    caption="The short eager cells timed in fresh processes, each importing §1.2.1's or this "
                            "section's module: per section, the median, range and standard deviation over the "
                            "processes (ms), and the first section's median over the second's.")
            if processes is not None else None])]
          if against else []),
        question(d, "b", "The speed-ups plotted.", [
            d.figure("compile_speedup", caption="Speed-up from torch.compile.")]),
    ]


def _without_ok_status(att: pd.DataFrame | None) -> pd.DataFrame | None:
    """The attention table without its status columns when every cell ran (they would only say "ok")."""
    if att is None:
        return None
    status = [c for c in att.columns if str(c).startswith("status")]
    if status and (att[status].astype(str) == "ok").all().all():
        return att.drop(columns=status)
    return att


def _with_mfu(model: pd.DataFrame | None, meta: dict) -> pd.DataFrame | None:
    if model is None or not {"size", "mode", "eager_ms", "compiled_ms"} <= set(model.columns):
        return model
    ctx = int((meta.get("params") or {}).get("context_length", 512))
    out = model.copy()
    for kind in ("eager", "compiled"):
        tflops = [model_tflops(str(s), ms, ctx, str(m)) for s, m, ms in zip(model["size"], model["mode"], model[f"{kind}_ms"])]
        out[f"{kind}_MFU_pct"] = with_mfu(pd.DataFrame({"TFLOP_per_s": tflops}), meta, "fp32")["MFU_pct"].to_numpy()
    return out



from cs336_systems.experiments.section import Job  # noqa: E402


def _planned_sizes() -> list[str]:
    """The sizes the full run's model jobs measure between them, in order."""
    sizes = [s for job in SECTION.jobs if "model" in job.sets.get("parts", ()) for s in job.sets.get("sizes", ())]
    return list(dict.fromkeys(sizes or PRESETS["full"].sizes))


SECTION = Section(
    name="torch_compile", number="1.3", title="torch.compile", problems=("torch_compile",), answer=answer,
    presets=PRESETS, run=run, derive=derive, derive_inputs=("attention_speedup", "model_speedup"),
    depends=(*MODEL, *TIMING, "cs336_systems/benchmarking/attention.py", "cs336_systems/experiments/pytorch_attention.py",
             "cs336_systems/benchmarking/attention_process_ab.py"),
    # wall times seen on an H200 at dc1acda (not on an H100, so not as minutes): the attention grid 4.9 min (eager
    # 2.2, compiled 2.2); the small pair 1.1 min and medium 0.6-1.9 (Inductor's cache warm or cold); a large pair
    # compiles 1.3-1.5 min per mode; xl's job took 5.0 min and a 2.7B job was cut at 4.5 min
    jobs=(Job({"parts": ["attention"]}, note="4.9 min on an H200"),
          Job({"parts": ["model"], "sizes": ["small", "medium"]}, note="3 min on an H200"),
          Job({"parts": ["model"], "sizes": ["large"]}, note="3.2 min on an H200"),
          Job({"parts": ["model"], "sizes": ["xl"]}, note="5 min on an H200"),
          Job({"parts": ["model"], "sizes": ["2.7B"]}, note="over 4.5 min on an H200: run it alone"),
          Job({"parts": ["processes"]}, note="3 rounds took 71 s on an H200; 5 about 2 min")),
)
