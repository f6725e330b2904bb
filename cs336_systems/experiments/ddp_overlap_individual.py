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
from cs336_systems.report.answers import join_words, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.results import ResultWriter

PRESETS = ddp_common.ddp_presets()


def run(p: DDPParams, out: ResultWriter) -> dict[str, Any]:
    return ddp_common.run_ddp("ddp_overlap_individual", p, out, ["single", "torch", "naive", "flat", "individual"])


# === Answers: formatting only; changes below this line do not make results stale ===


def answer(d: SectionData) -> list[Block]:
    name, df = steps_table(d)
    rows = {m: row(df, m) for m in ("naive", "flat", "overlap", "single")}
    text = None
    if rows["overlap"] is not None:
        others = [f"{m} {fmt.ms(rows[m]['step_ms'])}" for m in ("naive", "flat") if rows[m] is not None]
        text = Text(f"Overlapping each parameter's all-reduce with the rest of the backward pass gives "
                    f"{fmt.ms(rows['overlap']['step_ms'])} per step, with {fmt.ms(rows['overlap']['sync_ms'])} of "
                    "communication left after backward" + (f" (vs. {join_words(others)})." if others else "."))
    overlap_name = named(d.tables, "overlap")
    ov = d.frame(overlap_name) if overlap_name else None
    ov_text = None
    if ov is not None and {"variant", "comm_ms", "comm_during_backward_ms"} <= set(ov.columns) and len(ov):
        ov_text = Text("Share of communication kernel time that ran during the backward pass: " + join_words(
            [f"{r['variant']} {fmt.pct(r['comm_during_backward_ms'] / r['comm_ms'])}" for _, r in ov.iterrows()
             if r["comm_ms"] > 0]) + ".")
    timeline = named(d.figures, "timeline")
    timelines = [d.figure(timeline or "", caption="Kernels of one training step on rank 0, compute and "
                          "communication streams, per strategy.")]
    d.frame(named(d.tables, "timeline") or "")  # the figure's data
    return [
        question(d, "a", "Overlapping per-parameter all-reduces with the backward pass, compared with the two "
                 "previous variants.", [setup(df), text, steps_blocks(d, name, STEPS_CAPTION)],
                 what="time per iteration of the overlapping DDP"),
        question(d, "b", "Traces: communication overlapped with the backward pass.",
                 [ov_text, *timelines, d.table(overlap_name or "", caption="Communication kernel time and the part "
                                               "of it inside the backward pass.")],
                 what="the overlap timelines"),
        *ddp_common.scaling_blocks(d),
    ]



SECTION = Section(
    name="ddp_overlap_individual", number="2.3.2", title="DDP overlapping per-parameter all-reduces",
    problems=("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"), answer=answer,
    presets=PRESETS, run=run, gpus=2, sized_by=("preset",),
    depends=(*ddp_common.DEPENDS, "cs336_systems/distributed/ddp_overlap.py", "cs336_systems/distributed/ddp_flat.py",
             "cs336_systems/distributed/ddp_naive.py"),
)
