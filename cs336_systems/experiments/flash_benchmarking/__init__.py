"""§1.3.2 FlashAttention-2 in Triton: parameters, the wiring of its parts, derived figures and the answers.

Problems ``flash_forward``, ``flash_backward`` and ``flash_benchmarking``. ``python -m
cs336_systems.experiments flash_benchmarking --set parts=sweep,leaderboard`` runs the parts named; each
part's harness lives in :mod:`cs336_systems.benchmarking.flash`:

- ``leaderboard`` (:mod:`~cs336_systems.benchmarking.flash.leaderboard`): the handout's configuration,
  compiled forward then backward, against SDPA's flash and cuDNN backends in the same run.
- ``sweep`` (:mod:`~cs336_systems.benchmarking.flash.sweep`): batch 1, one head, causal; every sequence length
  x head dimension x dtype; forward, backward and forward+backward latency of ours, naive PyTorch and SDPA
  pinned to each backend. Failures are results: ``OOM``, ``unsupported``, ``skipped (time budget)``.
- ``model`` and ``model_ab`` (:mod:`~cs336_systems.benchmarking.flash.model`): a training step with each
  attention over context lengths (time, peak memory), and ours against SDPA in eager and compiled steps.
- ``breakdown`` and ``losers`` (:mod:`~cs336_systems.benchmarking.flash.kernels`): our kernels one by one and
  the autotuner's choices; the shapes where we trail cuDNN, kernel by kernel.
- ``shapes`` (:mod:`~cs336_systems.benchmarking.flash.shapes`): the shapes grid against the fast backends.
- ``host`` (:mod:`~cs336_systems.benchmarking.flash.host`): the host's cost per call.

The default parts are leaderboard, sweep and model, in that order. Without a GPU the section runs a tiny smoke
version (PyTorch-tiled flash, naive and SDPA's math path on CPU), so that the code path is exercised.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention import (
    flash_triton,
    options,
)
from cs336_systems.benchmarking.flash.host import run_host_overhead, summarize_host_overhead
from cs336_systems.benchmarking.flash.kernels import (
    CANDIDATE_SETS,
    run_kernel_breakdown,
    run_losers,
    summarize_losers,
    worst_shapes,
)
from cs336_systems.benchmarking.flash.leaderboard import leaderboard_summary, run_leaderboard
from cs336_systems.benchmarking.flash.model import (
    MODEL_AB_IMPLS,
    MODEL_AB_SAME,
    model_ab_merge_keys,
    plot_model_comparison,
    run_model_ab,
    run_model_comparison,
    summarize_model_ab,
)
from cs336_systems.benchmarking.flash.shapes import (
    SHAPES_BHN,
    SHAPES_IMPLS,
    SHAPES_SAME,
    merge_shape_rows,
    SHAPES_SMOKE_IMPLS,
    plot_shapes,
    run_shapes,
    shapes_ratio,
    shapes_summary,
)
from cs336_systems.benchmarking.flash.sweep import (
    SWEEP_DTYPES,
    SWEEP_HEAD_DIMS,
    SWEEP_SEQ_LENS,
    _poly_exp2_label,
    plot_latency,
    plot_speedup,
    run_flash_sweep,
    speedup_table,
)
from cs336_systems.benchmarking.sweep import OK
from cs336_systems.experiments.section import Section, check_parts, check_positive, check_presets, group, param
from cs336_systems.measured_code import MODEL
from cs336_systems.results import ResultWriter, load_meta, merge_rows, rows_of_this_run, settings_differ

SECTION = "flash_benchmarking"
PARTS = ("leaderboard", "sweep", "model", "breakdown", "shapes", "model_ab", "host", "losers")


@dataclass(frozen=True)
class Leaderboard:
    batch: int = param(16, "batch (heads folded in)")
    seq_len: int = param(16384, "sequence length")
    head_dims: list[int] = param([64, 128], "head dimensions (also the breakdown's)")


@dataclass(frozen=True)
class Sweep:
    seq_lens: list[int] = param(SWEEP_SEQ_LENS, "sequence lengths")
    head_dims: list[int] = param(SWEEP_HEAD_DIMS, "head dimensions")
    dtypes: list[str] = param(SWEEP_DTYPES, "torch dtype names")
    budget_s: float = param(600.0, "time budget in seconds")


@dataclass(frozen=True)
class ModelStep:
    contexts: list[int] = param([1024, 2048, 4096, 8192, 16384], "context lengths")
    preset: str = param("small", "model preset")
    steps: int = param(3, "timed steps per cell")
    budget_s: float = param(120.0, "time budget in seconds")


@dataclass(frozen=True)
class Shapes:
    shapes: list[list[int]] = param(SHAPES_BHN, "[batch, heads, seq_len] triples")
    head_dims: list[int] = param([64, 128], "head dimensions")
    dtypes: list[str] = param(["bfloat16", "float16"], "torch dtype names")
    causal: list[bool] = param([True, False], "causal settings")
    budget_s: float = param(540.0, "time budget in seconds")
    rounds: int = param(3, "alternating rounds per shape (the implementations in turn, the order rotating)")


@dataclass(frozen=True)
class ModelAB:
    presets: list[str] = param(["small", "medium", "xl"], "model presets")
    contexts: list[int] = param([1024, 2048, 4096], "context lengths")
    compile: list[bool] = param([False, True], "eager and/or torch.compile'd steps")
    impls: list[str] = param(list(MODEL_AB_IMPLS), "baseline attention, then ours")
    tokens_per_step: int = param(8192, "tokens per step (batch = tokens / context)")
    rounds: int = param(6, "alternating rounds per cell (a host-bound step drifts from round to round; rounds "
                           "after a cell's first take seconds)")
    only_rounds: list[int] = param([], "measure only these of the cell's rounds (0-based; a later job measures the "
                                       "rest; empty: all)")
    steps: int = param(5, "timed steps per implementation and round")
    budget_s: float = param(540.0, "time budget in seconds")


@dataclass(frozen=True)
class Host:
    shapes: list[list[int]] = param([[1, 16, 1024, 64], [8, 12, 1024, 64], [8, 25, 1024, 64], [4, 32, 1024, 80]],
                                    "[batch, heads, seq_len, head_dim] (the issue's, then small, xl and 2.7B at "
                                    "8,192 or 4,096 tokens)")
    layouts: list[str] = param(["bhsd", "bshd"], "contiguous (batch, heads, seq, d) and/or the model's head views "
                                                 "of (batch, seq, heads, d)")
    rounds: int = param(5, "alternating rounds per shape")
    calls: int = param(20, "calls per measurement")


@dataclass(frozen=True)
class Losers:
    count: int = param(6, "how many of the shapes grid's worst shapes (against cuDNN) to profile")
    rounds: int = param(3, "alternating rounds per shape")


@dataclass(frozen=True)
class Params:
    parts: list[str] = param(["leaderboard", "sweep", "model", "host"], f"what to run, of {', '.join(PARTS)}")
    warmup_ms: float = param(5.0, "do_bench warm-up per timing")
    rep_ms: float = param(25.0, "do_bench measuring time per timing")
    candidates: str = param("default", "kernel tiles tried by the autotuner: default | wide")
    autotune: bool = param(True, "False: each phase's first tile, untuned")
    poly_exp2: str | None = param(None, "phases on the FMA-pipe exponential: forward,dkdv,dq | all | none "
                                        "(None: each tile's pin)")
    gluon: bool = param(True, "the warp-specialized Gluon forward on Hopper (False: the Triton forward)")
    leaderboard: Leaderboard = group(Leaderboard(), "the handout's leaderboard configuration, and the breakdown's")
    sweep: Sweep = group(Sweep(), "batch 1, one head, causal: every length x head dimension x dtype")
    model: ModelStep = group(ModelStep(), "a training step with each attention over context lengths")
    shapes: Shapes = group(Shapes(), "the shapes grid against the fast backends")
    model_ab: ModelAB = group(ModelAB(), "ours against SDPA in eager and compiled training steps")
    host: Host = group(Host(), "the host's cost per call")
    losers: Losers = group(Losers(), "the shapes grid's worst shapes, kernel by kernel")

    def check(self) -> None:
        check_parts("flash_benchmarking", self.parts, PARTS)
        if self.candidates not in CANDIDATE_SETS:
            raise ValueError(f"flash_benchmarking: candidates must be one of {', '.join(CANDIDATE_SETS)}")
        if "host" in self.parts:
            from cs336_systems.benchmarking.flash_host_overhead import LAYOUTS

            host = self.host
            check_positive(**{"host.rounds": host.rounds, "host.calls": host.calls})
            bad = [s for s in host.shapes if len(s) != 4 or min(s) < 1]
            if bad:
                raise ValueError(f"flash_benchmarking: host.shapes takes [batch, heads, seq_len, head_dim] of positive "
                                 f"sizes, got {bad[0]}")
            if not host.layouts or set(host.layouts) - set(LAYOUTS):
                raise ValueError(f"flash_benchmarking: host.layouts takes some of {', '.join(LAYOUTS)}, "
                                 f"got {host.layouts}")
        if "shapes" in self.parts:
            check_positive(**{"shapes.rounds": self.shapes.rounds})
        if "losers" in self.parts:
            check_positive(**{"losers.count": self.losers.count, "losers.rounds": self.losers.rounds})
        if "model_ab" in self.parts:
            ab = self.model_ab
            if len(ab.impls) != 2:
                raise ValueError(f"flash_benchmarking: model_ab.impls takes two attention implementations (the "
                                 f"baseline, then ours), got {ab.impls}")
            check_presets(*ab.presets)
            check_positive(**{"model_ab.rounds": ab.rounds, "model_ab.steps": ab.steps,
                              "model_ab.tokens_per_step": ab.tokens_per_step, "model_ab.budget_s": ab.budget_s})
            outside = [r for r in ab.only_rounds if not 0 <= r < ab.rounds]
            if outside:
                raise ValueError(f"flash_benchmarking: model_ab.only_rounds={ab.only_rounds} names round {outside[0]}, "
                                 f"not one of model_ab.rounds={ab.rounds} (0..{ab.rounds - 1})")
            bad = [c for c in ab.contexts if c < 1 or ab.tokens_per_step % c]
            if bad:
                raise ValueError(f"flash_benchmarking: model_ab.tokens_per_step={ab.tokens_per_step} is not a "
                                 f"multiple of context {bad[0]}")


PRESETS = {
    "full": Params(),
    "quick": Params(sweep=Sweep(seq_lens=[2**i for i in range(7, 17, 2)], budget_s=240.0),
                    model=ModelStep(contexts=[1024, 4096, 16384], budget_s=60.0)),
    "smoke": Params(warmup_ms=1.0, rep_ms=2.0,
                    sweep=Sweep(seq_lens=[32], head_dims=[16], dtypes=["float32"], budget_s=30.0),
                    shapes=Shapes(shapes=[[2, 2, 24], [1, 2, 40]], head_dims=[16], dtypes=["float32"],
                                  causal=[True, False], budget_s=30.0),
                    leaderboard=Leaderboard(batch=2, seq_len=64, head_dims=[16]),
                    model=ModelStep(contexts=[16], preset="tiny", steps=1, budget_s=30.0),
                    model_ab=ModelAB(presets=["tiny"], contexts=[16, 32], impls=["sdpa", "flash_pytorch"],
                                     tokens_per_step=64, steps=1, rounds=2, budget_s=60.0)),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """Run the parts ``p.parts`` names under ``p``'s kernel options and write their tables and figures."""
    changes: dict[str, Any] = {"candidates": CANDIDATE_SETS[p.candidates], "autotune": p.autotune, "gluon": p.gluon}
    if p.poly_exp2 is not None:
        changes["poly_exp2"] = p.poly_exp2
    with options.use(**changes):
        # Provenance: the kernel options every artefact was measured under.
        out.params.update(poly_exp2=_poly_exp2_label(), kernel_options=options.current().describe())
        return _run_parts(p, out)


def _run_parts(p: Params, out: ResultWriter) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands, smoke = p.parts, out.smoke
    if "leaderboard" in commands:
        for head_dim in p.leaderboard.head_dims:
            started = time.monotonic()
            table = run_leaderboard(p.leaderboard.batch, p.leaderboard.seq_len, head_dim)
            suffix = "" if head_dim == 64 else f"_d{head_dim}"
            out.table(table, f"leaderboard{suffix}", params={"head_dim": head_dim})
            summary = leaderboard_summary(table, ours=table["impl"].iloc[0])
            out.json(summary, f"leaderboard{suffix}_summary", params={"head_dim": head_dim})
            print(table.to_markdown(index=False, floatfmt=".4g"))
            print(f"leaderboard d={head_dim} took {time.monotonic() - started:.0f} s")
            results[f"leaderboard{suffix}"] = table
    if "sweep" in commands:
        # One table per dtype, each within its own budget: the handout's full grid is longer than one GPU job
        # may run, so `--set sweep.dtypes=bfloat16` and `--set sweep.dtypes=float32` can refresh it in two runs.
        for dtype in p.sweep.dtypes:
            started = time.monotonic()
            long = run_flash_sweep(p.sweep.seq_lens, p.sweep.head_dims, [dtype], warmup_ms=p.warmup_ms, rep_ms=p.rep_ms,
                                   budget_s=p.sweep.budget_s)
            out.table(long, f"sweep_{dtype}")
            results[f"sweep_{dtype}"] = long
            print(f"sweep {dtype} took {time.monotonic() - started:.0f} s")
        # The speed-up table and figures are derived (Section.execute, replot) from every per-dtype table in
        # the results folder, so a run of one dtype combines with an earlier run of the other.
    if "breakdown" in commands:
        if smoke and not flash_triton.interpreter_enabled():
            print("breakdown skipped: it times the Triton kernels, which need a GPU (or TRITON_INTERPRET=1)")
        else:
            started = time.monotonic()
            lb = p.leaderboard
            parts = [run_kernel_breakdown(lb.batch, lb.seq_len, d) for d in lb.head_dims]
            summary = pd.DataFrame([part[0] for part in parts])
            kernels = pd.concat([part[1] for part in parts], ignore_index=True)
            tuning = pd.concat([part[2] for part in parts], ignore_index=True)
            extra = {"options": options.current().describe(), "poly_exp2": _poly_exp2_label()}
            out.table(summary, "kernel_breakdown", params=extra)
            out.table(kernels, "kernel_breakdown_kernels", params=extra)
            out.table(tuning, "kernel_breakdown_tuning", params=extra)
            print(summary.to_markdown(index=False, floatfmt=".4g"))
            ours = kernels[kernels["matmuls"].notna()]
            print(ours[["head_dim", "name", "calls", "total_ms", "percent", "TFLOP_per_s"]].to_markdown(
                index=False, floatfmt=".4g"))
            print(tuning.to_markdown(index=False, floatfmt=".4g"))
            print(f"breakdown took {time.monotonic() - started:.0f} s")
            results.update(kernel_breakdown=summary, kernel_breakdown_kernels=kernels, kernel_breakdown_tuning=tuning)
    if "shapes" in commands:
        started = time.monotonic()
        impls = SHAPES_IMPLS if torch.cuda.is_available() else SHAPES_SMOKE_IMPLS
        g = p.shapes
        long = run_shapes(g.shapes, g.head_dims, g.dtypes, g.causal, impls,
                          rounds=g.rounds, warmup_ms=p.warmup_ms, rep_ms=p.rep_ms, budget_s=g.budget_s)
        # Split over jobs by dtype (the grid is longer than one GPU job): an earlier job's cells of this code,
        # device and settings stay, cells measured again are replaced; ratios are per cell, so they combine.
        long = merge_shape_rows(long, rows_of_this_run(out, "shapes", out.params, SHAPES_SAME))
        ratio, summary = _write_shapes(out, long, impls)
        print(ratio.to_markdown(index=False, floatfmt=".3g"))
        print(summary)
        print(f"shapes took {time.monotonic() - started:.0f} s")
        results.update(shapes=long, shapes_ratio=ratio, shapes_summary=summary)
    if "model" in commands:
        started = time.monotonic()
        impls = ("naive", "sdpa", "flash_triton") if not smoke else ("naive", "sdpa", "flash_pytorch")
        table = run_model_comparison(
            p.model.contexts, impls, model=p.model.preset, budget_s=p.model.budget_s,
            precision="fp32" if smoke else "bf16",
            warmup=min(2, p.model.steps),
            steps=p.model.steps,
        )  # fmt: skip
        out.table(table, "model_step")
        out.figure(plot_model_comparison(table), "model_step")
        cols = [
            c
            for c in ("context_length", "attention_impl", "status", "total_mean_ms", "peak_memory_GiB")
            if c in table
        ]
        print(table[cols].to_markdown(index=False, floatfmt=".4g"))
        print(f"model comparison took {time.monotonic() - started:.0f} s")
        results["model_step"] = table
    if "host" in commands:
        if not torch.cuda.is_available():
            print("host skipped: it measures what CUDA launches cost the CPU, which needs a GPU")
        else:
            started = time.monotonic()
            rows = run_host_overhead(p.host.shapes, p.host.layouts, rounds=p.host.rounds, calls=p.host.calls)
            summary = summarize_host_overhead(rows)
            out.table(rows, "host_overhead")
            out.table(summary, "host_overhead_summary",
                      extra={"host_us": "CPU µs to issue one forward+backward (the GPU kept busy)",
                             "gpu_us": "the kernels' GPU µs per call", "wall_us": "µs per call back to back"})
            print(summary.to_markdown(index=False, floatfmt=".1f"))
            print(f"host overhead took {time.monotonic() - started:.0f} s")
            results.update(host_overhead=rows, host_overhead_summary=summary)
    if "losers" in commands:
        # The worst shapes come from this job's shapes grid, or from an earlier job's at this commit and device.
        ratio = results.get("shapes_ratio")
        if ratio is None and torch.cuda.is_available():
            ratio = rows_of_this_run(out, "shapes_ratio", out.params, SHAPES_SAME)
        if not torch.cuda.is_available():
            print("losers skipped: it profiles GPU kernels, which needs a GPU")
        elif ratio is None or "vs_sdpa_cudnn" not in ratio:
            print("losers skipped: it needs this commit's shapes grid against sdpa_cudnn; run --set parts=shapes "
                  "first (or with it)")
        else:
            started = time.monotonic()
            shapes = worst_shapes(ratio, count=p.losers.count)
            kernels = run_losers(shapes, rounds=p.losers.rounds)
            summary = summarize_losers(kernels)
            out.table(kernels, "losers_kernels", extra={"gpu_us": "median GPU µs per forward+backward call"})
            out.table(summary, "losers", extra={"loses_most_in": "the phase with the largest gap, ours - cuDNN"})
            print(summary.to_markdown(index=False, floatfmt=".1f"))
            print(f"losers took {time.monotonic() - started:.0f} s")
            results.update(losers=summary, losers_kernels=kernels)
    if "model_ab" in commands:
        started = time.monotonic()
        ab = p.model_ab
        table = run_model_ab(ab.presets, ab.contexts, ab.compile, impls=ab.impls, rounds=ab.rounds,
                             only_rounds=ab.only_rounds, tokens_per_step=ab.tokens_per_step,
                             precision="fp32" if smoke else "bf16", steps=ab.steps, budget_s=ab.budget_s)
        # Split over jobs by preset, compile or round (the grid is longer than one GPU job): cells of an earlier
        # job of this code, device and step settings stay; cells measured again are replaced whole, or only the
        # rounds measured again where the job measures some rounds (model_ab_merge_keys).
        earlier = rows_of_this_run(out, "model_ab", out.params, MODEL_AB_SAME)  # as recorded: kernel options too
        table = merge_rows(table, earlier, model_ab_merge_keys(ab.only_rounds))
        summary = summarize_model_ab(table, *ab.impls[:2])
        out.table(table, "model_ab")
        out.table(summary, "model_ab_summary")
        print(summary.to_markdown(index=False, floatfmt=".4g"))
        print(f"model A/B took {time.monotonic() - started:.0f} s")
        results.update(model_ab=table, model_ab_summary=summary)
    return results




#: The sweep's measured tables, one per dtype (the first is the handout's primary).
SWEEP_TABLES = tuple(f"sweep_{dtype}" for dtype in SWEEP_DTYPES)


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Any:
    """The speed-up table and the two sweep figures from whichever per-dtype sweep tables exist."""
    from cs336_systems.derived import Derived

    present = [name for name in SWEEP_TABLES if tables.get(name) is not None]
    if not present:
        raise ValueError(f"no sweep table among {', '.join(SWEEP_TABLES)}")
    long = pd.concat([tables[name] for name in present], ignore_index=True)
    # Ours is the Triton kernel; a CPU smoke run has only the PyTorch-tiled one.
    ours = "triton" if (long["impl"] == "triton").any() else "flash_pytorch"
    table = speedup_table(long, ours=ours)
    figures = {}
    if table["speedup_vs_builtin"].notna().any():
        figures["sweep_speedup"] = (plot_speedup(table), present[0])
    if ((long["head_dim"] == 64) & (long["status"] == OK)).any():
        figures["sweep_latency_d64"] = (plot_latency(long, head_dim=64), present[0])
    return Derived(tables={"sweep_speedup": (table, present[0])}, figures=figures)


def _write_shapes(out: ResultWriter, long: Any, impls: Sequence[str], source: dict[str, Any] | None = None
                  ) -> tuple[Any, dict[str, Any]]:
    """The shapes grid's tables, summary and figure from its long rows (``impls[0]`` is ours); ``source``: the
    measuring job's record, where the rows were measured elsewhere (:func:`combine`)."""
    out.table(long, "shapes", source=source)
    ratio = shapes_ratio(long, ours=impls[0])
    out.table(ratio, "shapes_ratio", source=source)
    baseline = "sdpa_cudnn" if "sdpa_cudnn" in impls else impls[-1]
    summary = shapes_summary(ratio, baseline)
    out.json(summary, "shapes_summary", source=source)
    if ratio[f"vs_{baseline}"].notna().any():
        out.figure(plot_shapes(ratio, f"vs_{baseline}"), "shapes_ratio", source=source)
    return ratio, summary


def combine(other: Path, publish: bool = True) -> list[str]:
    """Add the shapes grid that another job wrote to its own copy of ``figures/flash_benchmarking/`` (the folder
    ``other``) to this folder's, as the later of the two jobs would have, had its machine been given the earlier
    one's folder (:func:`~cs336_systems.results.rows_of_this_run`): for jobs on machines that could not pass the
    folder on. Both grids must be fresh (measured by the current code), from one device model, not smoke runs,
    and measured with the same settings (``SHAPES_SAME``). The later job's record describes the result, the
    earlier job's calibration is kept beside its own (``merged``), and where the rows were combined is
    ``rendered``. Returns the names written."""
    from cs336_systems import calibration
    from cs336_systems.measured_code import freshness

    out = ResultWriter("flash_benchmarking", smoke=False, publish=publish)
    if Path(other).resolve() == out.dir.resolve():
        raise ValueError(f"combine: {other} is the committed folder itself; name the other job's copy")
    grids = []
    for folder in (out.dir, Path(other)):
        if not (folder / "shapes.meta.json").is_file() or not (folder / "shapes.csv").is_file():
            raise ValueError(f"combine: {folder} has no shapes grid (shapes.csv and shapes.meta.json)")
        meta = load_meta(folder.name, "shapes", root=folder.parent)
        verdict = freshness(meta, SECTION.depends)
        if meta.get("smoke") or verdict.stale:
            raise ValueError(f"combine: the shapes grid in {folder} is "
                             f"{'a smoke run' if meta.get('smoke') else verdict.reason}; combine fresh grids only")
        if not meta.get("date"):
            raise ValueError(f"combine: the shapes grid in {folder} records no date, so which job came later is unknown")
        grids.append((meta, pd.read_csv(folder / "shapes.csv")))
    (later, later_rows), (earlier, earlier_rows) = sorted(grids, key=lambda g: str(g[0].get("date")), reverse=True)
    if later.get("device") != earlier.get("device"):
        raise ValueError(f"combine: the grids ran on {later.get('device')} and {earlier.get('device')}")
    differ = settings_differ(later.get("params") or {}, earlier.get("params") or {}, SHAPES_SAME)
    if differ:
        raise ValueError(f"combine: the grids' settings differ in {', '.join(differ)}")
    own = later.get("calibration")
    if own is not None:  # the earlier job's records, each once (as rows_of_this_run adds them)
        merged = list(own.get("merged") or [])
        calibration.add_merged(merged, earlier.get("calibration"), calibration.without_merged(own))
        own = {**own, "merged": merged}
    long = merge_shape_rows(later_rows, earlier_rows)
    out.params = dict(later.get("params") or {})
    impls = [i for i in (*SHAPES_IMPLS, *SHAPES_SMOKE_IMPLS) if i in set(long["impl"])]  # ours first
    _write_shapes(out, long, impls, source={**later, "calibration": own})
    return ["shapes", "shapes_ratio", "shapes_summary"]


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.experiments.flash_benchmarking.answers import answer  # noqa: E402
from cs336_systems.experiments.section import Job  # noqa: E402

SECTION = Section(
    name="flash_benchmarking", number="1.3.2", title="FlashAttention-2 in Triton",
    problems=("flash_forward", "flash_backward", "flash_benchmarking"), answer=answer, presets=PRESETS, run=run,
    derive=derive, derive_inputs=SWEEP_TABLES, combine=combine,
    depends=(*MODEL, "cs336_systems/attention/", "cs336_systems/benchmarking/timing.py",
             "cs336_systems/benchmarking/end_to_end.py", "cs336_systems/benchmarking/sweep.py",
             "cs336_systems/benchmarking/flash_host_overhead.py", "cs336_systems/benchmarking/flash/",
             # where the harnesses and the wiring lived until they moved: results measured then are judged by it
             "cs336_systems/experiments/flash_benchmarking.py"),
    # minutes as measured at 087cb28, 311857a and b0eb683 on a fresh H100 machine (docs/flash_attention/
    # refresh_b0eb683.md): a compiled cell compiles the whole model once per implementation and round, about 2 min
    # at xl and 2.5 min at xl 2048 on that host, so xl's compiled cells run one round per job; run again on the
    # same machine, a compiled job takes about half (jobs 5 and 7: 134 and 156 s), its graphs cached
    jobs=(
        Job({"sweep.dtypes": ["bfloat16"]}, 4.7, "leaderboard at d 64 and 128, the bf16 sweep, the model step, host cost"),
        Job({"parts": ["sweep"], "sweep.dtypes": ["float32"]}, 5.4),
        # the shapes grid by dtype: at b833df4 on a fresh H200 the whole grid ran past 9 min (its first cell
        # compiles the C++ host entry, about 1 min; bf16 took 5.5 min of it)
        *(Job({"parts": ["shapes"], "shapes.dtypes": [dtype]}, 5.5) for dtype in ("bfloat16", "float16")),
        Job({"parts": ["losers"]}, 0.6, "reads the shapes grid of the jobs before"),
        # the model A/B at six rounds a cell, from jobs 6-11 at 99c8750 on a fresh H200 (two rounds then): after a
        # job's first cell (about 1 min: autotuning, the C++ host entry's build) an eager measurement took 1-3 s
        # (small to xl), a compiled cell's first round 40-45 s per implementation at small and medium and its
        # later rounds about as long as eager ones, their graphs cached
        Job({"parts": ["model_ab"], "model_ab.compile": [False]}, 5.0, "every eager cell"),
        Job({"parts": ["model_ab"], "model_ab.presets": ["small"], "model_ab.compile": [True]}, 6.2),
        Job({"parts": ["model_ab"], "model_ab.presets": ["medium"], "model_ab.compile": [True], "model_ab.contexts": [1024, 2048]}, 6.9),
        Job({"parts": ["model_ab"], "model_ab.presets": ["medium"], "model_ab.compile": [True], "model_ab.contexts": [4096]}, 3.2),
        # xl compiled: a step is the GPU's (its rounds agreed within 1% at 99c8750), so two rounds, one per job:
        # round 1 compiles the model, 5.0 min at 1,024 on a fresh H200 at 99c8750 (3.5-3.8 min on a warm H100 at
        # 63e88b2); round 2, run next on the same machine, found the graphs cached (1.2 min; 0.6-0.7 on the H100)
        *(Job({"parts": ["model_ab"], "model_ab.presets": ["xl"], "model_ab.compile": [True], "model_ab.contexts": [context],
               "model_ab.rounds": 2, "model_ab.only_rounds": [r]}, minutes[r], f"round {r + 1} of 2"
              + ("" if r == 0 else "; about 5 min on a machine that has not run round 1"))
          for context, minutes in ((1024, (5.0, 1.2)), (2048, (5.0, 1.2)), (4096, (5.0, 1.2))) for r in (0, 1)),
    ),
)
