"""§2.3.3 Bucketed DDP: gradients grouped into buckets of a chosen size, each all-reduced once its last
gradient is ready; a bucket-size sweep against torch DDP, fp32 and bf16 gradient communication, the
latency-bandwidth overhead model fitted to all-reduces timed in the same run, and every step also captured
in a CUDA graph (so the comparison measures GPU time, not host launches).

Problem ``ddp_bucketed_benchmarking``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cs336_systems.benchmarking.allreduce import DEFAULT_SIZES, parse_size
from cs336_systems.distributed.grad_sync import bucket_size_mb_value
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
from cs336_systems.experiments.section import Section, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import implemented, join_words, known, question, spread
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Figure, Table, Text
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params(DDPParams):
    bucket_sizes_mb: list[float] = param([1.0, 10.0, 25.0, 100.0, 1000.0], "bucket sizes (MiB)")
    comm_dtypes: list[str] = param(["fp32", "bf16"], "gradient wire formats")
    allreduce_sizes: list[str] = param(DEFAULT_SIZES, "all-reduces timed in the same run, for the overhead model")
    cuda_graph: bool = param(True, "also capture every step in a CUDA graph (GPUs only)")

    def check(self) -> None:
        super().check()
        for size in self.bucket_sizes_mb:
            bucket_size_mb_value(size, "ddp_bucketed.bucket_sizes_mb", allow_none=False)
        for size in self.allreduce_sizes:
            parse_size(size)


PRESETS = ddp_common.ddp_presets(Params, bucket_sizes_mb=[0.01, 1.0], allreduce_sizes=["1KB", "4MB"], cuda_graph=False)
# The performance bar against torch DDP is held at 2 and 4 GPUs, so the full run measures both (and the weak
# scaling between them); the handouts' questions are answered from the 2-GPU run.
PRESETS["full"] = Params(nproc=[2, 4])


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    from cs336_systems.distributed import runner

    world = runner.launched_world_size()
    if world is not None:  # the launcher fixed the world: one run of it, tagged with its size
        p = dataclasses.replace(p, nproc=[world])
    runner.check_local_gpus(p.nproc, "pass --set nproc=2", p.backend)
    return ddp_common.run_ddp(
        "ddp_bucketed", p, out, ["single", "torch", "bucketed"], bucket_sizes_mb=list(p.bucket_sizes_mb),
        comm_dtypes=list(p.comm_dtypes), allreduce_sizes=[parse_size(s) for s in p.allreduce_sizes],
        cuda_graph=[False, True] if p.cuda_graph else [False])


# === Answers: formatting only; changes below this line do not make results stale ===


def _previous(d: SectionData, df: Any) -> tuple[Any, Any]:
    """The unbucketed runs to compare with: flat and per-parameter overlap from this table, else from their own
    sections' eager steps (§2.3.1 and §2.3.2, the same model and settings), tagged ``_from`` (the section) and
    ``_single`` (that run's single-GPU step, by which :func:`_expectations` scales it to this run's machine)."""
    found = []
    for mode, folder in (("flat", "ddp_flat"), ("overlap", "ddp_overlap_individual")):
        hit = row(df, mode)
        if hit is None:
            _, theirs = steps_table(d.sibling(folder))
            hit = row(ddp_common.eager_rows(theirs), mode) if theirs is not None else None
            if hit is not None:  # another job's run: the comparison says so, and scales by that run's own single step
                hit = hit.copy()
                hit["_from"] = {"ddp_flat": "§2.3.1", "ddp_overlap_individual": "§2.3.2"}[folder]
                own = row(ddp_common.eager_rows(theirs), "single")
                hit["_single"] = _typical(own) if own is not None else None
        found.append(hit)
    return found[0], found[1]


def _typical(r: Any) -> float:
    """A row's step time for comparisons: the median step where recorded (one slow step moves a mean of ten)."""
    median = r.get("step_ms_median") if hasattr(r, "get") else None
    return float(median) if median is not None and median == median else float(r["step_ms"])


def _expectations(b: Any, flat: Any, individual: Any, single: Any = None) -> str:
    """(a)'s other questions: what we expected, whether the measurement agrees, and what setup would show it.
    ``b``: the fp32 bucketed rows by bucket size; ``single``: this run's single-GPU row. A variant from another
    run is compared at this run's speed: its step times this run's single-GPU step over its own run's (two jobs'
    machines differ by as much as the variants do)."""
    typical = b.apply(_typical, axis=1)
    best, largest = b.loc[typical.idxmin()], b.loc[b["bucket_size_mb"].idxmax()]
    few = (f"{fmt.sig(largest['bucket_size_mb'])} MiB's {int(largest['num_buckets'])} buckets start late, like "
           "flat DDP" if known(largest.get("num_buckets")) else "the largest buckets start late, like flat DDP")
    expected = (" **Expected:** a U in bucket size (1 MiB pays a collective's fixed cost hundreds of times, "
                f"{few}), its best beating flat DDP and per-parameter overlap.")
    ordered = b.sort_values("bucket_size_mb")
    times = [_typical(r) for _, r in ordered.iterrows()]
    noise = [known(v) or 0.0 for v in ordered.get("step_ms_std", [0.0] * len(ordered))]
    rising = all(x <= y + e for x, y, e in zip(times, times[1:], noise[1:]))  # never lower beyond a row's spread
    lowest = int(times.index(min(times)))
    shape = ("Too few sizes to see a shape" if len(times) < 3 else
             "**No U:** no larger bucket is faster beyond the steps' spread" if rising
             else "A U: the best size lies inside the range" if 0 < lowest < len(times) - 1
             else "No clear U")
    outcome = f" {shape}."
    per_tensor = known(individual.get("num_buckets")) if individual is not None else None
    same_scheme = bool(per_tensor and known(best.get("num_buckets")) and best["num_buckets"] >= per_tensor)
    if same_scheme:
        outcome = outcome.removesuffix(".") + (f" (at {fmt.sig(best['bucket_size_mb'])} MiB every bucket holds "
                                               f"one tensor, {int(best['num_buckets'])} buckets: per-parameter "
                                               "overlap again).")
    if flat is not None and individual is not None:
        mine = _typical(best)
        won, lost, between_runs = [], [], ""
        for label, other in (("flat", flat), ("per-parameter overlap", individual)):
            noise = spread(best.get("step_ms_std"), other.get("step_ms_std"))  # this pair's step-to-step spread
            theirs, where = _typical(other), ""
            if isinstance(other.get("_from"), str):
                where = f" in {other['_from']}'s run"
                if known(other.get("_single")) and single is not None:
                    theirs *= _typical(single) / float(other["_single"])
                    where += (f", {fmt.ms(theirs)} scaled to this run by the ratio of the two runs' single-GPU "
                              "steps")
            if same_scheme and label == "per-parameter overlap":
                # the best size is that scheme: a gap to its own run is between runs, not between schemes
                between_runs = (f" It is the per-parameter scheme itself, so its gap to the per-parameter run "
                                f"({fmt.ms(_typical(other))}{where}) is one between runs, not between schemes.")
                continue
            (won if mine < theirs - noise else lost).append(f"{label} ({fmt.ms(_typical(other))}{where})")
        verdict = (f"beats {join_words(won)}" if not lost else f"beats {join_words(won)} but not "
                   f"{join_words(lost)} beyond the spread" if won else f"does not beat {join_words(lost)} beyond "
                   "the spread")
        which = "median" if "step_ms_median" in b.columns else "mean"
        outcome = outcome.removesuffix(".") + (
                    f", and by {which} step the best size ({fmt.ms(mine)}) {verdict}" + (
            ": over NVLink the all-reduce is a small share of the step, so little is left to hide." if lost else ".")
            + between_runs)
    change = (" **A setup that would show the U:** a slower link (PCIe, or nodes over InfiniBand or Ethernet) or "
              "more gradient bytes per FLOP (a larger model per GPU, fewer tokens per step).")
    return expected + outcome + change


def _communication(d: SectionData, name: str | None, b: Any) -> Table | None:
    """Communication time per bucket size (CSE599-O's Problem 8 asks for it beside the step time): the wait the
    backward left (measured, the step table's ``sync``), and the time all of a size's all-reduces take, the
    linear cost ``n_b o + s/w`` summed over its buckets with ``o`` and ``w`` fitted to all-reduces timed in the
    same run (the ``overhead_model`` record), so the share the backward hid."""
    import pandas as pd

    fit_name = name.replace("steps", "overhead_model", 1) if name else None
    fit = d.json(fit_name) if fit_name in d.records else None
    need = {"bucket_size_mb", "num_buckets", "sync_ms", "grad_bytes"}
    if not isinstance(fit, dict) or not {"o_us", "w_GBps"} <= set(fit) or not need <= set(b.columns) or b.empty:
        return None
    total = b["num_buckets"] * fit["o_us"] / 1e3 + b["grad_bytes"] / (fit["w_GBps"] * 1e9) * 1e3
    frame = pd.DataFrame({"bucket_size_mb": b["bucket_size_mb"], "num_buckets": b["num_buckets"],
                          "step_ms": b.apply(_typical, axis=1), "exposed_comm_ms": b["sync_ms"],
                          "modelled_allreduce_ms": total,
                          # a wait longer than the modelled all-reduces hid nothing (the rest is host time)
                          "hidden_pct": (100 * (1 - b["sync_ms"] / total)).clip(lower=0)})
    return d.table(name, frame=ddp_common.mib_labels(frame.reset_index(drop=True)), caption=(
        "Communication by bucket size (fp32 gradients, eager steps): `step_ms` the median step (the mean where the "
        "run recorded no median); `exposed_comm_ms` "
        "measured, the wait for the all-reduces after the backward pass (the step table's `sync`); "
        "`modelled_allreduce_ms` the time all of its buckets' all-reduces take by the fit, $n_b\\,o + s/w$ with "
        f"$o$ = {fmt.sig(fit['o_us'], 3)} µs and $w$ = {fmt.sig(fit['w_GBps'])} GB/s fitted to all-reduces timed in "
        "the same run (the model of (b)); `hidden_pct` the share of that the backward pass hid."))


def answer(d: SectionData) -> list[Block]:
    name, df = steps_table(d)
    # (b): the derivation and the fitted optimum are the answer; the measured overhead against the model (its
    # table, split and figure) is the appendix's.
    model = ddp_common.bucket_model(d.sibling("distributed_communication_single_node"), d)
    measured = next((i for i, b in enumerate(model) if isinstance(b, (Table, Figure))), len(model))
    text = why = communication = None
    eager = ddp_common.eager_rows(df) if df is not None else None
    if eager is not None and "mode" in eager.columns and (eager["mode"] == "bucketed").any():
        df = eager
        wire = df["comm_dtype"].fillna("fp32") if "comm_dtype" in df.columns else "fp32"
        b = df[(df["mode"] == "bucketed") & (wire == "fp32")].sort_values("bucket_size_mb")
        best = b.loc[b["step_ms"].idxmin()]
        parts = [f"{fmt.sig(r['bucket_size_mb'])} MiB {fmt.ms(r['step_ms'])}" for _, r in b.iterrows()]
        refs = [f"{r['variant']} {fmt.ms(r['step_ms'])}" for m in ("naive", "flat", "overlap", "single", "torch")
                if (r := row(df, m)) is not None]
        width = b["step_ms"].max() / b["step_ms"].min() - 1
        single = row(df, "single")
        if width < 0.05:
            why = (f" All bucket sizes lie within {fmt.pct(width, 2)} of each other"
                   + (f" and within {fmt.pct(b['step_ms'].max() / single['step_ms'] - 1, 2)} of the single-GPU step"
                      if single is not None else "")
                   + ": on this node's interconnect the gradients' all-reduce is a small part of the step, so "
                   "bucketing can only recover a little")
            if "step_ms_std" in b.columns and b["step_ms"].max() - b["step_ms"].min() < b["step_ms_std"].max():
                why += (f", and the differences are within the step-to-step standard deviation (up to "
                        f"{fmt.ms(b['step_ms_std'].max())})")
            why += "."
        else:
            why = (" Tiny buckets pay the per-call cost many times, huge ones cannot start communicating until most "
                   "of backward is done; in between, communication hides behind the remaining backward compute.")
        text = Text("Step time by bucket size: " + join_words(parts) + f"; the best is {fmt.sig(best['bucket_size_mb'])} "
                    "MiB" + (f" (reference: {join_words(refs)})." if refs else ".")
                    + _expectations(b, *_previous(d, df), single))
        why = Text(why.strip())
        communication = _communication(d, name, b)
    sweep = named(d.figures, "bucket_sweep")
    return [
        question(d, "ddp_overlap_bucketed", "DDP that groups gradients into buckets of a maximum size and "
                 "all-reduces each bucket as soon as its last gradient is ready.", [implemented(
                     d, "`DDPBucketed` (parameters assigned to size-capped buckets in reverse order, the order "
                     "backward produces their gradients; each bucket's all-reduce starts when its last gradient "
                     "arrives)", "cs336_systems/distributed/ddp_bucketed.py", "tests/test_ddp_strategies.py",
                     {"2025": "test_ddp.py"})]),  # 2026's test_ddp.py tests per-parameter overlap
        question(d, "a", "Bucketed DDP with the handout's bucket sizes, 1, 10, 100 and 1000 MB (MiB here; 25, "
                 "torch DDP's default, added), compared with the unbucketed variants.", [setup(df, d.edition, first=False), text, steps_blocks(d, name, STEPS_CAPTION + " Eager steps; the captured "
                                                            "ones are in the appendix.", eager_only=True),
                               communication, d.figure(sweep or "", caption="Step time against bucket size.")],
                 what="bucketed DDP timings"),
        question(d, "b", "A model of DDP's communication overhead and the bucket size that minimizes it.",
                 model[:measured]),
        Text("", role=BEYOND_HANDOUT),  # torch DDP, CUDA-graph capture and weak scaling: the writeup's appendix
        *([question(d, "a", "The bucket sizes' spread, and our bucketed step against torch DDP.",
                    [why, ddp_common.torch_parity(d)])] if why is not None or ddp_common.torch_parity(d) else []),
        *([question(d, "b", "The model against the measured overhead.", model[measured:])]
          if model[measured:] else []),
        *ddp_common.captured_steps(d),
        *ddp_common.scaling_blocks(d),
    ]



from cs336_systems.experiments.section import Job  # noqa: E402

SECTION = Section(
    name="ddp_bucketed", number="2.3.3", title="Bucketed DDP", problems=("ddp_overlap_bucketed", "ddp_bucketed_benchmarking"),
    answer=answer, presets=PRESETS, run=run, gpus=2, sized_by=("preset",),
    editions={"cse599o": {"nproc": [2]}},  # its bucketed benchmark: one node, 2 GPUs
    depends=(*ddp_common.DEPENDS, "cs336_systems/distributed/ddp_bucketed.py",
             "cs336_systems/benchmarking/ddp_overhead_model.py"),
    jobs=(Job({"autocast": ["fp32"]}, None, "2 and 4 GPUs"), Job({"autocast": ["bf16"]}, None, "2 and 4 GPUs")),
)
