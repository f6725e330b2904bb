"""§2.2 Naive DDP: check it against single-process training, and time it on the Transformer.

Problems ``naive_ddp`` and ``naive_ddp_benchmarking``. The section runs both (``python -m
cs336_systems.experiments naive_ddp``); the course-style script form does one or the other::

    python -m cs336_systems.experiments.naive_ddp --model toy            # prints "Naive DDP matches baseline!"
    python -m cs336_systems.experiments.naive_ddp --model transformer    # XL: time/step and communication
    torchrun --nproc-per-node 2 -m cs336_systems.experiments.naive_ddp --model toy

``--set parts=processes`` times the eager single-GPU and torch DDP steps again in fresh launches (a job of its own,
``naive_ddp --full --set parts=processes``): how far a host-bound step moves from one job to the next.

``--model toy`` trains the course's ToyModel with :class:`DataParallelNaive` on ``--nproc`` ranks and a
single process on the full batch, and exits non-zero if any rank's parameters differ. ``--model
transformer`` times naive DDP next to single-GPU training and torch DDP (the same machinery as
the DDP sections), writing ``figures/naive_ddp/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.benchmarking import ddp_steps
from cs336_systems.benchmarking.ddp_steps import add_run_arguments, run_from_args
from cs336_systems.checks.equivalence import train_and_compare
from cs336_systems.distributed import runner
from cs336_systems.distributed.ddp_naive import DataParallelNaive
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
from cs336_systems.experiments.section import Section, check_parts, check_positive, check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import handout_model, join_words, known, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Text
from cs336_systems.results import ResultWriter

TOLERANCE = 1e-5


def toy_check_worker(steps: int, global_batch: int, kind: str = "toy") -> dict[str, Any]:
    """Train naive DDP and the single-process reference; time the synchronisation calls."""
    sync_times: list[float] = []

    def timed_finish(model: DataParallelNaive, optimizer: Any) -> None:
        t0 = time.perf_counter()
        model.finish_gradient_synchronization()
        sync_times.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    res = train_and_compare(DataParallelNaive, kind, steps=steps, global_batch=global_batch, after_backward=timed_finish)
    elapsed = time.perf_counter() - t0
    # Every rank must agree with the reference *and* with each other.
    finals: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(finals, res.pop("final"))
    res["ranks_agree"] = all(torch.equal(finals[0], f) for f in finals)
    res["iteration_ms"] = elapsed / steps * 1e3
    res["sync_ms"] = sum(sync_times) / len(sync_times) * 1e3
    return res


def toy_check(nproc: int, steps: int, global_batch: int, backend: str | None = None) -> pd.DataFrame:
    """Naive DDP on ``nproc`` ranks against one process on the full batch, on the course's ToyModel: one row
    per rank with the largest parameter difference, whether the ranks agree, and the time per iteration."""
    results = runner.run_on_ranks(toy_check_worker, nproc, steps, global_batch, backend=backend or "gloo")
    table = pd.DataFrame([{"rank": i, **r} for i, r in enumerate(results)])
    table["matches"] = (table["init_diff"] == 0.0) & table["ranks_agree"] & (table["final_diff"] < TOLERANCE)
    return table


PARTS = ("toy", "steps", "processes")


@dataclass(frozen=True)
class Params(DDPParams):
    toy_steps: int = param(5, "training steps of the toy-model check")
    toy_batch: int = param(16, "global batch of the toy-model check")
    parts: list[str] = param(["toy", "steps"], "what to run: toy (the handout's check), steps (the step timings), "
                                               "processes (the single-GPU and torch DDP steps in fresh launches)")
    process_rounds: int = param(5, "processes: launches per model, the models alternating")
    process_presets: list[str] = param(["large", "xl"], "processes: the models (those the step tables time)")
    process_autocast: list[str] = param(["bf16"], "processes: the precisions")
    process_modes: list[str] = param(["single", "torch"], "processes: the steps timed (modes of ddp_steps; the "
                                                          "other DDP sections' own, flat or bucketed, too)")

    def check(self) -> None:
        super().check()
        check_parts("naive_ddp", self.parts, PARTS)
        check_positive(process_rounds=self.process_rounds)
        check_presets(*self.process_presets)
        if bad := [a for a in self.process_autocast if a not in ("fp32", "bf16")]:
            raise ValueError(f"process_autocast must be fp32 or bf16, got {bad}")
        if bad := [m for m in self.process_modes if m not in ddp_steps.ALL_MODES]:
            raise ValueError(f"process_modes: unknown {bad}; modes: {', '.join(ddp_steps.ALL_MODES)}")


PRESETS = ddp_common.ddp_presets(Params, process_presets=["tiny"], process_rounds=2, process_autocast=["fp32"])


def step_processes(p: Params) -> pd.DataFrame:
    """The steps the DDP sections share (``p.process_modes``: single GPU and torch DDP by default), timed again
    in ``p.process_rounds`` fresh launches per model (each
    :func:`~cs336_systems.benchmarking.ddp_steps.run_benchmark` spawns its ranks anew; the models alternate),
    eager and, on GPUs, captured in a CUDA graph. Every DDP section's table times these steps in a job of its
    own, and an eager step this small waits on the host's Python and kernel launches, so its time moves with
    the job; the launches measure by how much, the spread the check across sections
    (:mod:`cs336_systems.report.agreement`) lets two tables' values of one step differ by. One row per round,
    model, precision and variant."""
    graphs = [False, True] if torch.cuda.is_available() else [False]
    frames = []
    for r in range(p.process_rounds):
        for preset in (p.process_presets if r % 2 == 0 else p.process_presets[::-1]):
            for ac in p.process_autocast:
                cfg = ddp_steps.DDPBenchConfig(preset=preset, context_length=p.context_length,
                                               batch_per_rank=p.batch_per_rank, autocast=ac, modes=p.process_modes,
                                               warmup=p.warmup, steps=p.steps, cuda_graph=graphs)
                result = ddp_steps.run_benchmark(cfg, p.nproc[0], p.backend)
                frames.append(pd.DataFrame(result["rows"]).assign(round=r))
    return pd.concat(frames, ignore_index=True)


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The toy-model equality check (its printout is the handout's deliverable), the step timings, and the
    parts asked for beyond them."""
    results: dict[str, Any] = {}
    if "toy" in p.parts:
        table = results["toy_check"] = toy_check(p.nproc[0], p.toy_steps, p.toy_batch)
        out.table(table, "toy_check", extra={"tolerance": TOLERANCE})
        print(table.to_string(index=False))
        if not table["matches"].all():
            raise RuntimeError("Naive DDP does NOT match the single-process baseline on the toy model")
        print("Naive DDP matches baseline!")
    if "steps" in p.parts:
        results.update(ddp_common.run_ddp("naive_ddp", p, out, ["single", "torch", "naive"]))
    if "processes" in p.parts:
        table = results["step_processes"] = step_processes(p)
        out.table(table, "step_processes")
        print(between_launches(table).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return results


def between_launches(table: pd.DataFrame) -> pd.DataFrame:
    """Per model, precision and variant of :func:`step_processes`' table: the median step over the launches,
    their standard deviation (NaN with one launch) and range."""
    by = table.groupby(["preset", "autocast", "variant"], sort=False)["step_ms"]
    return pd.DataFrame({"launches": by.size(), "median_ms": by.median(), "std_ms": by.std(),
                         "min_ms": by.min(), "max_ms": by.max()}).reset_index()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["toy", "transformer"], default="toy")
    parser.add_argument("--toy-steps", type=int, default=5)
    parser.add_argument("--toy-batch", type=int, default=16, help="global batch for the toy check")
    add_run_arguments(parser, modes_default=["single", "torch", "naive"])
    args = parser.parse_args(argv)

    if args.model == "transformer":
        args.name = "naive" if args.name == "steps" else args.name
        run_from_args(args)
        return 0

    results = runner.run_on_ranks(toy_check_worker, args.nproc, args.toy_steps, args.toy_batch, backend=args.backend or "gloo")
    if not runner.is_main_process():
        return 0
    worst = max(r["final_diff"] for r in results)
    print(f"ranks: {len(results)}, steps: {args.toy_steps}, global batch: {args.toy_batch}")
    print(f"time per iteration: {max(r['iteration_ms'] for r in results):.2f} ms, "
          f"communication (gradient all-reduce): {max(r['sync_ms'] for r in results):.2f} ms")
    print(f"max |DDP - single process| over parameters: {worst:.3g}")
    ok = all(r["init_diff"] == 0.0 and r["ranks_agree"] for r in results) and worst < TOLERANCE
    if not ok:
        print("Naive DDP does NOT match the single-process baseline", file=sys.stderr)
        return 1
    print("Naive DDP matches baseline!")
    return 0


# === Answers: formatting only; changes below this line do not make results stale ===


#: Editions whose naive-DDP problem asks to compare its communication time with the all-reduce microbenchmark
#: (CSE599-O's Problem 3).
COMPARES_WITH_MICROBENCHMARK = ("cse599o",)


def answer(d: SectionData) -> list[Block]:
    name, df = steps_table(d)
    naive, single = row(df, "naive"), row(df, "single")
    text = None
    if naive is not None:
        text = Text(f"Naive DDP takes {fmt.ms(naive['step_ms'])} per step, of which {fmt.ms(naive['sync_ms'])} "
                    f"({fmt.pct(naive['sync_ms'] / naive['step_ms'])}) is spent all-reducing gradients one parameter "
                    "at a time after backward"
                    + (f"; the same step on one GPU without communication takes {fmt.ms(single['step_ms'])}."
                       if single is not None else "."))
    # Beyond the handout's two numbers: the other precision and the all-reduce benchmark's prediction (the appendix;
    # the prediction is the answer where the handout asks for the comparison with its microbenchmark).
    other = _other_precision(d, name, naive).strip() if naive is not None else ""
    against = _against_microbenchmark(d, naive)
    asked = [against] if against is not None and d.edition in COMPARES_WITH_MICROBENCHMARK else []
    beyond = [b for b in (Text(other) if other else None, None if asked else against, _launches(d)) if b is not None]
    return [
        question(d, "naive_ddp", "Data parallelism by all-reducing every gradient after the backward pass.", [
            Text("Each rank holds a full replica, runs forward and backward on its $1/p$ slice of the batch (of $p$ ranks), then "
                 "all-reduces (averages) each parameter's gradient before the optimizer step, so every replica "
                 "takes the same step; the tests compare the trained weights with single-process training, and "
                 "the benchmark checks every strategy against it before timing."),
            d.table("toy_check", frame=subset(d.frame("toy_check"), "rank", "init_diff", "final_diff", "ranks_agree",
                                              "matches", "iteration_ms", "sync_ms"),
                    caption="The handout's check: naive DDP on each rank against one process on the full batch "
                            "(ToyModel, gloo); a difference of 0 or below the tolerance prints \"Naive DDP matches "
                            "baseline!\"."),
            _equivalence_sentence(d.frame(named(d.tables, "toy_equivalence") or ""))]),
        question(d, "naive_ddp_benchmarking", "Time per training step and the share spent communicating gradients "
                 f"({handout_model(_model_name(df), d.edition)} model, one node, 2 GPUs).",
                 [setup(df, d.edition), text, *asked, steps_blocks(d, name, STEPS_CAPTION),
                  d.figure(name or "", caption="Step time split into phases.")],
                 what="naive DDP step and communication times"),
        *([Text("", role=BEYOND_HANDOUT),
           question(d, "naive_ddp_benchmarking", "The run's other precision, and the step's communication against "
                    "the all-reduce benchmark.", beyond)] if beyond else []),
        *ddp_common.scaling_blocks(d),
    ]


def _other_precision(d: SectionData, shown: str | None, shown_naive: Any = None) -> str:
    """The same numbers under the run's other precision. Autocast leaves the gradients fp32, so the bytes
    all-reduced are the same: a shorter step makes them a larger share, and a different communication time
    is not a different amount of traffic."""
    other = ddp_common.other_precision_table(d, shown)
    naive = row(other, "naive") if other is not None else None
    if naive is None or known(naive.get("sync_ms")) is None:
        return ""
    std = known(naive.get("step_ms_std"))
    spread = f" (± {fmt.ms(std)} step to step)" if std is not None and std >= 0.05 * naive["step_ms"] else ""
    text = (f" Under {other['precision'].iloc[0]}: {fmt.ms(naive['step_ms'])} per step{spread}, {fmt.ms(naive['sync_ms'])} "
            f"communicating ({fmt.pct(naive['sync_ms'] / naive['step_ms'])}). The gradients stay fp32 under autocast, "
            "so the bytes all-reduced are the same")
    before = known(shown_naive.get("sync_ms")) if shown_naive is not None else None
    if before is None or abs(naive["sync_ms"] / before - 1) <= 0.1:
        return text + "; the share changes with the step's length."
    return (text + f", yet they took {fmt.ms(naive['sync_ms'])} here against {fmt.ms(before)}: not more traffic, "
            "but a collective's time on one rank also counts its wait for the other ranks to reach the call, which "
            "differs from run to run.")


def _launches(d: SectionData) -> Text | None:
    """How far the eager single-GPU and torch DDP steps move between fresh launches, against the same steps
    captured in a CUDA graph (``step_processes``, in the main grid's folder for every edition)."""
    main = SectionData(d.root, "naive_ddp", edition=d.edition)
    table = main.frame("step_processes")
    if table is None or table["round"].nunique() < 2:
        return None
    summary = between_launches(table)
    captured = summary["variant"].str.contains("CUDA graph")
    eager, graph = summary[~captured], summary[captured]

    def name(r: pd.Series) -> str:
        return f"{handout_model(r['preset'], d.edition)} {r['variant'].replace(' (CUDA graph)', '')}"

    ranges = join_words([f"{name(r)} {fmt.ms(r['median_ms'])} ({fmt.sig(r['min_ms'], 3)}–{fmt.sig(r['max_ms'], 3)})"
                         for _, r in eager.iterrows()])
    medians = join_words([f"{name(r)} {fmt.ms(r['median_ms'])}" for _, r in graph.iterrows()])
    precisions = join_words(list(dict.fromkeys(table["autocast"])))
    launched_on, tables_on = _host(main.meta("step_processes")), _host(d.meta(steps_table(d)[0] or ""))
    return Text(f"Timed again in {table['round'].nunique()} fresh launches per model ({precisions}, "
                f"{int(table['world_size'].max())} GPUs), the eager steps move from one launch to the next by a "
                f"standard deviation of {fmt.sig(eager['std_ms'].min(), 3)}–{fmt.ms(eager['std_ms'].max())} "
                f"(median and range: {ranges}); captured in a CUDA graph, the same steps move by at most "
                f"{fmt.ms(graph['std_ms'].max())} ({medians}). Eager, a step of batch "
                f"{int(table['batch_per_rank'].iloc[0])} waits on the host's Python and kernel launches, so its time "
                "follows the host of the job that ran it"
                + (f": these launches ran on {launched_on}, the step tables above on {tables_on}: another host, so "
                   "the launches' medians are not those tables' values; their spread carries over"
                   if launched_on != tables_on else "")
                + ". The check across sections compares the DDP sections' values of these steps by this spread "
                  "(a gap beyond three standard errors of the difference of two launches is a disagreement).")


def _host(meta: dict[str, Any]) -> str:
    """The machine a result was measured on, in words: its GPU count and model."""
    return f"a {meta.get('num_gpus', '?')}-GPU {meta.get('device', 'machine')} host"


def _model_name(df: Any) -> str:
    """The model the step table measured (the handout's benchmark model: xl, 2026's xl, CSE599-O's Table 1)."""
    return str(df["preset"].iloc[0]) if df is not None and "preset" in df.columns and len(df) else "xl"


def _close_to_fit(allreduce: SectionData, meta: dict[str, Any], calls: int, size: float) -> str:
    """Why a naive step can sit near the fit's prediction and still not match it: what the handout's "potential
    causes for any differences" asks, from what differs between the fit's calls and the step's."""
    sizes = allreduce.frame("allreduce")
    smallest = (float(sizes["size_bytes"].min()) if sizes is not None and "size_bytes" in sizes and len(sizes)
                else None)
    causes = ["the calls here follow each gradient as backward frees it, where the microbenchmark's run back to "
              "back, one size at a time"]
    if smallest is not None:
        causes.append(f"the fit covers messages of {fmt.sig(smallest / 1e6)} MB and up, while the step's "
                      f"{calls} tensors average {fmt.sig(size / calls / 1e6)} MB and many (norms, biases) are far "
                      "smaller, so their fixed cost is extrapolated")
    theirs, ours = allreduce.meta("allreduce"), meta
    if theirs.get("num_gpus") != ours.get("num_gpus"):
        causes.append(f"the fit ran on {_host(theirs)}, this step on {_host(ours)}")
    return ("close to the microbenchmark's speed; what can move it either way: " + "; ".join(causes))


def _against_microbenchmark(d: SectionData, naive: Any) -> Text | None:
    """The naive step's communication against what the all-reduce microbenchmark (§2.1) predicts for the same
    calls: ``n`` all-reduces moving ``S`` bytes in all take ``n·o + S/w`` with the latency ``o`` and algorithm
    bandwidth ``w`` fitted there (NCCL, the same world size)."""
    need = ("num_buckets", "grad_bytes", "sync_ms", "world_size")
    if naive is None or not set(need) <= set(naive.index) or any(known(naive[k]) is None for k in need):
        return None
    allreduce = d.sibling("distributed_communication_single_node")
    fit = ddp_common.published_fit(allreduce, world_size=int(naive["world_size"]))
    name, _ = steps_table(d)
    if fit is None or allreduce.meta("allreduce").get("device") != d.meta(name or "").get("device"):
        return None  # a prediction from another machine's links says nothing about this run
    n, size = int(naive["num_buckets"]), float(naive["grad_bytes"])
    predicted = (n * fit["o"] + size / fit["w"]) * 1e3
    ratio = float(naive["sync_ms"]) / predicted
    why = (_close_to_fit(allreduce, d.meta(name or ""), n, size) if abs(ratio - 1) < 0.15 else
           "more than the microbenchmark's back-to-back calls of one size: here each call is also launched from "
           "Python after the tensor's gradient is ready, the sizes are uneven (many small norms and biases beside "
           "the large matrices), and the measured time includes waiting for the slower rank to finish backward"
           if ratio > 1 else
           "less than predicted: the fit's latency is an average over message sizes, and small messages run "
           "faster than it")
    per_step = (f" (the ring's $2(p-1)$ steps of $\\alpha$ = {fmt.sig(fit['alpha_us'], 3)} µs each)"
                if "alpha_us" in fit else "")
    return Text(f"Against the all-reduce microbenchmark (§2.1, NCCL on {int(naive['world_size'])} GPUs), a call "
                f"costs a fixed $o$ = {fmt.sig(fit['o'] * 1e6, 2)} µs{per_step} plus its bytes $S$ at "
                f"$w$ = {fmt.sig(fit['w'] / 1e9)} GB/s: "
                f"$n$ = {n} calls moving {fmt.sig(size / 1e9)} GB in all predict $n\\,o + S/w$ = {fmt.ms(predicted)}; the naive "
                f"step measured {fmt.ms(naive['sync_ms'])}, {fmt.ratio(ratio)} the prediction, {why}.")



def _equivalence_sentence(eq: pd.DataFrame | None) -> Text | None:
    """The benchmark's own pre-timing check (its table is in the section's folder)."""
    if eq is None or not {"variant", "final_diff", "ok"} <= set(eq.columns) or not len(eq):
        return None
    return Text("Before timing, the step benchmark repeats the check for every strategy it times ("
                + "; ".join(f"{r['variant']}: largest final difference {fmt.sig(r['final_diff'], 2)}, "
                            + ("match" if r["ok"] else "MISMATCH") for _, r in eq.iterrows()) + ").")


SECTION = Section(
    name="naive_ddp", number="2.2", title="Naive distributed data parallel training",
    problems=("naive_ddp", "naive_ddp_benchmarking"), answer=answer, presets=PRESETS, run=run, gpus=2, sized_by=("preset",),
    depends=(*ddp_common.DEPENDS, "cs336_systems/distributed/ddp_naive.py"),
)


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.experiments.naive_ddp"))
