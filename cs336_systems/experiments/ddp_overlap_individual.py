"""§2.3.2 DDP that all-reduces each parameter's gradient as soon as backward produces it, overlapping the
communication with the rest of the backward pass; with per-strategy kernel timelines of one step.

Problems ``ddp_overlap_individual_parameters`` and ``ddp_overlap_individual_parameters_benchmarking``.
"""

from __future__ import annotations

from typing import Any

from cs336_systems.experiments import ddp_common
from cs336_systems.experiments.ddp_common import (
    STEPS_CAPTION,
    DDPParams,
    named,
    row,
    setup,
    steps_blocks,
    steps_table,
)
from cs336_systems.experiments.section import Section
from cs336_systems.report import fmt
from cs336_systems.report.answers import implemented, join_words, known, question, spread, step_verdict, stream_lanes
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.results import ResultWriter

PRESETS = ddp_common.ddp_presets()


def run(p: DDPParams, out: ResultWriter) -> dict[str, Any]:
    return ddp_common.run_ddp("ddp_overlap_individual", p, out, ["single", "torch", "naive", "flat", "individual"])


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.document import BEYOND_HANDOUT  # noqa: E402  (answers only)


def _overlapping(variant: Any) -> bool:
    """Whether a traced variant is the per-parameter overlapping one (named ``individual`` or ``overlap``)."""
    return "individual" in str(variant) or "overlap" in str(variant)


#: Idle time (ms) after backward below which a traced step's gap is not worth a sentence.
IDLE_MS = 1.0


def _idle_after_backward(timeline: Any, timed: Any = None) -> str:
    """The traced step's gap in the overlapping variant between the end of backward and the optimizer with no
    kernel on any stream (host time: it waits there on every parameter's all-reduce handle), against its untraced
    steps' exposed wait (``timed``, its row of the steps table: ``sync_ms``), which the profiler's per-call host
    cost does not inflate."""
    if timeline is None or not {"variant", "kind", "name", "start_ms", "dur_ms"} <= set(timeline.columns):
        return ""
    gaps = []
    for variant, sub in timeline.groupby("variant", sort=False):
        if not _overlapping(variant):
            continue  # flat's gap is its flatten, all-reduce and copy back: not a wait on handles
        phases = sub[sub["kind"] == "phase"].set_index("name")
        if not {"backward", "optimizer"} <= set(phases.index):
            continue
        lo = float(phases.loc["backward", "start_ms"] + phases.loc["backward", "dur_ms"])
        hi = float(phases.loc["optimizer", "start_ms"])
        kernels = sub[sub["kind"] != "phase"]
        idle, reached = 0.0, lo  # time in [lo, hi) that no kernel covers, over kernels in start order
        for start, end in sorted(zip(kernels["start_ms"], kernels["start_ms"] + kernels["dur_ms"])):
            if end <= reached or start >= hi:
                continue
            idle += max(0.0, start - reached)
            reached = max(reached, min(end, hi))
        idle += max(0.0, hi - reached)
        if idle > IDLE_MS:
            gaps.append((variant, idle))
    if not gaps:
        return ""
    said = join_words([f"{variant} {fmt.ms(ms)}" for variant, ms in gaps])
    untraced = (f"; its untraced steps in the table of (a) leave {fmt.ms(timed['sync_ms'])} there"
                if timed is not None and known(timed.get("sync_ms")) is not None else "")
    return (f"Between the end of backward and the optimizer the traced step leaves both streams idle for "
            f"{said}: host time, in which the step waits on every parameter's all-reduce handle, host calls whose "
            f"cost the profiler can inflate{untraced}.")


#: Editions whose handout names flat DDP as the "initial implementation" the overlap traces compare against
#: (CSE599-O's Problem 6 (b)); the CS336 handouts mean naive DDP.
INITIAL_IS_FLAT = ("cse599o",)


#: A row's step-to-step spread, as a share of its mean, past which one number does not describe its steps.
VARIED = 0.03


def _spread_note(r: Any) -> str:
    """Where a row's steps vary widely and no few slow ones explain it (``ddp_common.outlier_note`` says that
    case), a clause giving the spread and the median; else empty."""
    mean, std, median = (known(r.get(k)) for k in ("step_ms", "step_ms_std", "step_ms_median"))
    if ddp_common.outlier_note(r) or mean is None or std is None or median is None or std < VARIED * mean:
        return ""
    return f" (its steps vary by ±{fmt.ms(std)} around a median of {fmt.ms(median)})"


#: A traced all-reduce this much longer than the timed wait after backward calls for a word on why.
KERNEL_OVER_WAIT = 1.2


def _kernel_over_wait(ov: Any, rows: dict[str, Any]) -> str:
    """Where a non-overlapping variant's all-reduce kernels ran longer in the traced step than the wait the timed
    steps measured after its backward, why the two differ (the reader would expect the wait to hold the kernels)."""
    said = []
    for variant in ("naive", "flat"):
        mine, timed = ov[ov["variant"] == variant], rows.get(variant)
        if len(mine) and timed is not None and known(timed.get("sync_ms")) and \
                float(mine["comm_ms"].iloc[0]) > KERNEL_OVER_WAIT * float(timed["sync_ms"]):
            said.append(f"{variant}'s {fmt.ms(mine['comm_ms'].iloc[0])} against its {fmt.ms(timed['sync_ms'])} wait")
    if not said:
        return ""
    return (f" The traced kernels ran longer than the wait the timed steps measured ({join_words(said)}). They are "
            "different steps: the trace is one step under the profiler, which slows each rank's host and so can leave "
            "one rank's kernel spinning longer until the other reaches the same collective (an NCCL kernel's time "
            "includes that spinning), while the wait is a mean over unprofiled steps.")


def _printed_alone(d: SectionData, r: Any) -> str:
    """Where this run's steps vary widely and the handout's own script printed this strategy's step (CSE599-O), a
    clause comparing the two: that script times the one strategy in its processes, this run five in turn."""
    printed, median, std = ddp_common.printed_step_ms(d, "individual"), known(r.get("step_ms_median")), known(
        r.get("step_ms_std"))
    if printed is None or median is None or std is None:
        return ""
    return (f" The handout's script, which times this strategy alone in its processes, printed {fmt.ms(printed)} "
            "(its output opens this section), "
            + ("within that spread." if abs(printed - median) <= std else
               f"outside that spread: this run, which times five strategies in turn in one pair of processes, is the "
               f"{'slower' if median > printed else 'faster'} of the two, and what makes it so was not isolated."))


def _verdict(rows: dict[str, Any]) -> str:
    """(a)'s comparison in one sentence: against naive and flat DDP, faster, slower or level within the two rows'
    summed step-to-step spread."""
    own, parts = rows["overlap"], []
    for other in ("naive", "flat"):
        them = rows.get(other)
        if them is None or known(own.get("step_ms")) is None or known(them.get("step_ms")) is None:
            continue
        noise = spread(own.get("step_ms_std"), them.get("step_ms_std"))
        verdict = step_verdict(float(own["step_ms"]), float(them["step_ms"]), noise)
        parts.append(f"{verdict} than {other}" if verdict in ("faster", "slower") else
                     f"level with {other} (±{fmt.ms(noise)})" if verdict.endswith("no difference") else
                     f"not comparable with {other} ({verdict})")
    return f" So in this run it is {join_words(parts)}, judged by the rows' summed step-to-step spread." if parts else ""


def _why(ov: Any, rows: dict[str, Any]) -> str:
    """The reason in one sentence: how much of the communication the overlap hid (from the traces), and what
    it costs the backward it shares the GPU with (forward+backward time against flat's)."""
    by = ov.set_index("variant")
    hit = [v for v in by.index if _overlapping(v)]
    if not hit or not by.loc[hit[0], "comm_ms"]:
        return ""
    r = by.loc[hit[0]]
    share = float(r["comm_during_backward_ms"] / r["comm_ms"])
    flat, own = rows.get("flat"), rows.get("overlap")
    varied = own is not None and bool(_spread_note(own))
    out = (f" Why: {fmt.pct(share)} of its all-reduce kernel time ({fmt.ms(r['comm_ms'])}) ran while backward was "
           "still computing" + (" in the traced step" if varied else "") + ", "
           + ("so almost none of it is exposed" + (" there" if varied else "") if share >= 0.9
              else f"so {fmt.pct(1 - share)} of it still runs after backward"))
    if flat is not None and own is not None and known(flat.get("fwd_bwd_ms")) and known(own.get("fwd_bwd_ms")):
        mine, how = float(own["fwd_bwd_ms"]), ""
        parts = [known(own.get(k)) for k in ("step_ms_median", "sync_ms", "optimizer_ms")]
        if ddp_common.outlier_note(own) and all(x is not None for x in parts):
            # The mean forward+backward carries the slow steps too: take the median step less the rest.
            mine, how = parts[0] - parts[1] - parts[2], " from the median step"
        # (a) asks for 1-2 sentences: the mechanism in a clause, where the backward did slow
        if mine > float(flat["fwd_bwd_ms"]):
            out += (f", {'but' if share >= 0.9 else 'and'} the backward slows ({fmt.ms(mine)} forward and "
                    f"backward{how}, against flat's {fmt.ms(flat['fwd_bwd_ms'])}) as the NCCL kernels share SMs and "
                    "memory bandwidth with it and each parameter costs a launch")
    return out + "." + (" The wait after backward above is a mean over timed steps that vary; the trace is of one "
                        "step." if varied else "")


def _other_precision(d: SectionData, shown: str | None) -> str:
    """The same comparison under the run's other precision (bf16 autocast beside fp32), when its verdict
    differs: the answer's conclusion holds only for the precision it reads."""
    df = ddp_common.other_precision_table(d, shown)
    if df is None:
        return ""
    mine, naive, flat = (row(df, m) for m in ("overlap", "naive", "flat"))
    if mine is None or naive is None or flat is None:
        return ""
    best = min(float(naive["step_ms"]), float(flat["step_ms"]))
    if float(mine["step_ms"]) <= best:
        return ""
    precision = df["precision"].iloc[0]
    return (f" **Under {precision} it is the other way round:** {fmt.ms(mine['step_ms'])} against naive "
            f"{fmt.ms(naive['step_ms'])} and flat {fmt.ms(flat['step_ms'])}, {fmt.ratio(float(mine['step_ms']) / best)} "
            "the faster of them: the backward is much shorter there, so a launch and a hook per parameter and the "
            "all-reduce kernels beside it weigh more, and the eager step is bound by the host (§2.3.3's "
            "CUDA-graph runs take the host out).")


def answer(d: SectionData) -> list[Block]:
    name, df = steps_table(d)
    rows = {m: row(df, m) for m in ("naive", "flat", "overlap", "single")}
    text = None
    if rows["overlap"] is not None:
        median = bool(ddp_common.outlier_note(rows["overlap"]))  # then every row is quoted by its median
        spread = _spread_note(rows["overlap"])
        others = [f"{m} {fmt.ms(rows[m]['step_ms_median' if median else 'step_ms'])}" for m in ("naive", "flat")
                  if rows[m] is not None]
        text = (f"Overlapping each parameter's all-reduce with the rest of the backward pass gives "
                f"{fmt.ms(rows['overlap']['step_ms'])} per step{ddp_common.outlier_note(rows['overlap'])}"
                f"{spread}, with {fmt.ms(rows['overlap']['sync_ms'])} of communication left "
                f"after backward{' on average' if spread else ''}"
                + (f" (vs. {join_words(others)}{', medians' if median else ''})." if others else ".")
                + _verdict(rows) + (_printed_alone(d, rows["overlap"]) if spread else ""))
    overlap_name = named(d.tables, "overlap")
    ov = d.frame(overlap_name) if overlap_name else None
    ov_text = None
    if ov is not None and {"variant", "comm_ms", "comm_during_backward_ms"} <= set(ov.columns) and len(ov):
        ov_text = Text("Share of communication kernel time that ran during the backward pass: " + join_words(
            [f"{r['variant']} {fmt.pct(r['comm_during_backward_ms'] / r['comm_ms'])}" for _, r in ov.iterrows()
             if r["comm_ms"] > 0]) + "."
            + (" The non-overlapped side of the comparison is flat DDP (§2.3.1's strategy, profiled in this "
               "run), which, like the initial implementation, starts communicating only once the backward has finished (one all-reduce where "
               "the initial one issues one per parameter): what the traces contrast is when communication runs, "
               "and that is the same for both." if "flat" in set(ov["variant"]) and "naive" not in set(ov["variant"])
               and d.edition not in INITIAL_IS_FLAT else "")
            + _kernel_over_wait(ov, rows))
        text = (text or "") + _why(ov, rows)
    text = Text(text) if text else None
    other = _other_precision(d, name).strip()
    other_name = ddp_common.other_precision_name(d, name) if other else None
    timeline = named(d.figures, "timeline")
    lanes = stream_lanes(d.frame(named(d.tables, "timeline") or ""))
    timelines = [d.figure(timeline or "", caption="Kernels of one training step on rank 0, compute and "
                          "communication streams, per strategy, drawn from a torch.profiler trace of the step (the "
                          "same kernels Nsight Systems would show; the GPU machines have no nsys)."
                          + (f" Rows: {lanes}." if lanes else ""))]
    gap = _idle_after_backward(d.frame(named(d.tables, "timeline") or ""), rows.get("overlap") if rows else None)
    return [
        question(d, "ddp_overlap_individual_parameters", "DDP that all-reduces each parameter's gradient as soon as "
                 "it is ready, overlapping communication with the rest of the backward pass.", [implemented(
                     d, "`DDPIndividualParameters` (a gradient hook per parameter launches its asynchronous "
                     "all-reduce; `finish_gradient_synchronization` waits on the handles before the optimizer step)",
                     "cs336_systems/distributed/ddp_overlap.py", "tests/test_ddp_strategies.py",
                     {"2025": "test_ddp_individual_parameters.py", "2026": "test_ddp.py"})]),
        question(d, "a", "Overlapping per-parameter all-reduces with the backward pass, compared with the two "
                 "previous variants.", [setup(df, d.edition, first=False), text, steps_blocks(d, name, STEPS_CAPTION)],
                 what="time per iteration of the overlapping DDP"),
        question(d, "b", "Traces: communication overlapped with the backward pass.",
                 [ov_text, *timelines, Text(gap) if gap else None, d.table(overlap_name or "", caption="Communication kernel time and the part "
                                               "of it inside the backward pass. Each step also broadcasts the "
                                               "model's buffers once as its forward starts (as `DistributedDataParallel`'s "
                                               "`broadcast_buffers` does), one kernel more than the all-reduces.")],
                 what="the overlap timelines"),
        *([Text("", role=BEYOND_HANDOUT),
           question(d, "a", "The same comparison under the run's other precision.",
                    [Text(other), steps_blocks(d, other_name, STEPS_CAPTION)])] if other else []),
        *ddp_common.scaling_blocks(d),
    ]



SECTION = Section(
    name="ddp_overlap_individual", number="2.3.2", title="DDP overlapping per-parameter all-reduces",
    problems=("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"), answer=answer,
    presets=PRESETS, run=run, gpus=2, sized_by=("preset",),
    depends=(*ddp_common.DEPENDS, "cs336_systems/distributed/ddp_overlap.py", "cs336_systems/distributed/ddp_flat.py",
             "cs336_systems/distributed/ddp_naive.py"),
)
