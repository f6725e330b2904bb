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

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention import (
    flash_triton,
    options,
)
from cs336_systems.benchmarking.flash.host import HOST_KEYS, run_host_overhead, summarize_host_overhead
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
    MODEL_AB_ROUND,
    MODEL_AB_SAME,
    plot_model_comparison,
    run_model_ab,
    run_model_comparison,
    summarize_model_ab,
)
from cs336_systems.benchmarking.flash.shapes import (
    SHAPE_KEYS,
    SHAPES_BHN,
    SHAPES_IMPLS,
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
from cs336_systems.experiments.section import Section, check_parts, check_positive, check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.measured_code import MODEL
from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run

SECTION = "flash_benchmarking"
PARTS = ("leaderboard", "sweep", "model", "breakdown", "shapes", "model_ab", "host", "losers")


@dataclass(frozen=True)
class Params:
    parts: list[str] = param(["leaderboard", "sweep", "model", "host"], f"what to run, of {', '.join(PARTS)}")
    seq_lens: list[int] = param(SWEEP_SEQ_LENS, "sweep: sequence lengths")
    head_dims: list[int] = param(SWEEP_HEAD_DIMS, "sweep: head dimensions")
    dtypes: list[str] = param(SWEEP_DTYPES, "sweep: torch dtype names")
    warmup_ms: float = param(5.0, "do_bench warm-up per timing")
    rep_ms: float = param(25.0, "do_bench measuring time per timing")
    sweep_budget_s: float = param(600.0, "sweep: time budget in seconds")
    lb_batch: int = param(16, "leaderboard: batch (heads folded in)")
    lb_seq_len: int = param(16384, "leaderboard: sequence length")
    lb_head_dims: list[int] = param([64, 128], "leaderboard and breakdown: head dimensions")
    contexts: list[int] = param([1024, 2048, 4096, 8192, 16384], "model: context lengths")
    model: str = param("small", "model: preset")
    model_steps: int = param(3, "model: timed steps per cell")
    model_budget_s: float = param(120.0, "model: time budget in seconds")
    shapes: list[list[int]] = param(SHAPES_BHN, "shapes: [batch, heads, seq_len] triples")
    shapes_head_dims: list[int] = param([64, 128], "shapes: head dimensions")
    shapes_dtypes: list[str] = param(["bfloat16", "float16"], "shapes: torch dtype names")
    shapes_causal: list[bool] = param([True, False], "shapes: causal settings")
    shapes_budget_s: float = param(540.0, "shapes: time budget in seconds")
    shapes_rounds: int = param(3, "shapes: alternating rounds per shape (the implementations in turn, the order "
                                  "rotating)")
    ab_presets: list[str] = param(["small", "medium", "xl"], "model_ab: presets")
    ab_contexts: list[int] = param([1024, 2048, 4096], "model_ab: context lengths")
    ab_compile: list[bool] = param([False, True], "model_ab: eager and/or torch.compile'd steps")
    ab_impls: list[str] = param(list(MODEL_AB_IMPLS), "model_ab: baseline attention, then ours")
    ab_tokens_per_step: int = param(8192, "model_ab: tokens per step (batch = tokens / context)")
    ab_rounds: int = param(2, "model_ab: alternating rounds per cell")
    ab_only_rounds: list[int] = param([], "model_ab: measure only these of the cell's rounds (0-based; a later job "
                                          "measures the rest; empty: all)")
    ab_steps: int = param(5, "model_ab: timed steps per implementation and round")
    ab_budget_s: float = param(540.0, "model_ab: time budget in seconds")
    host_shapes: list[list[int]] = param([[1, 16, 1024, 64], [8, 12, 1024, 64], [8, 25, 1024, 64], [4, 32, 1024, 80]],
                                         "host: [batch, heads, seq_len, head_dim] (the issue's, then small, xl "
                                         "and 2.7B at 8,192 or 4,096 tokens)")
    host_layouts: list[str] = param(["bhsd", "bshd"], "host: contiguous (batch, heads, seq, d) and/or the "
                                                      "model's head views of (batch, seq, heads, d)")
    host_rounds: int = param(5, "host: alternating rounds per shape")
    host_calls: int = param(20, "host: calls per measurement")
    losers: int = param(6, "losers: how many of the shapes grid's worst shapes (against cuDNN) to profile")
    losers_rounds: int = param(3, "losers: alternating rounds per shape")
    candidates: str = param("default", "kernel tiles tried by the autotuner: default | wide")
    autotune: bool = param(True, "False: each phase's first tile, untuned")
    poly_exp2: str | None = param(None, "phases on the FMA-pipe exponential: forward,dkdv,dq | all | none "
                                        "(None: each tile's pin)")
    gluon: bool = param(True, "the warp-specialized Gluon forward on Hopper (False: the Triton forward)")

    def check(self) -> None:
        check_parts("flash_benchmarking", self.parts, PARTS)
        if self.candidates not in CANDIDATE_SETS:
            raise ValueError(f"flash_benchmarking: candidates must be one of {', '.join(CANDIDATE_SETS)}")
        if "host" in self.parts:
            from cs336_systems.benchmarking.flash_host_overhead import LAYOUTS

            check_positive(host_rounds=self.host_rounds, host_calls=self.host_calls)
            bad = [s for s in self.host_shapes if len(s) != 4 or min(s) < 1]
            if bad:
                raise ValueError(f"flash_benchmarking: host_shapes takes [batch, heads, seq_len, head_dim] of positive "
                                 f"sizes, got {bad[0]}")
            if not self.host_layouts or set(self.host_layouts) - set(LAYOUTS):
                raise ValueError(f"flash_benchmarking: host_layouts takes some of {', '.join(LAYOUTS)}, "
                                 f"got {self.host_layouts}")
        if "shapes" in self.parts:
            check_positive(shapes_rounds=self.shapes_rounds)
        if "losers" in self.parts:
            check_positive(losers=self.losers, losers_rounds=self.losers_rounds)
        if "model_ab" in self.parts:
            if len(self.ab_impls) != 2:
                raise ValueError(f"flash_benchmarking: ab_impls takes two attention implementations (the baseline, "
                                 f"then ours), got {self.ab_impls}")
            check_presets(*self.ab_presets)
            check_positive(ab_rounds=self.ab_rounds, ab_steps=self.ab_steps,
                           ab_tokens_per_step=self.ab_tokens_per_step, ab_budget_s=self.ab_budget_s)
            outside = [r for r in self.ab_only_rounds if not 0 <= r < self.ab_rounds]
            if outside:
                raise ValueError(f"flash_benchmarking: ab_only_rounds={self.ab_only_rounds} names round {outside[0]}, "
                                 f"not one of ab_rounds={self.ab_rounds} (0..{self.ab_rounds - 1})")
            bad = [c for c in self.ab_contexts if c < 1 or self.ab_tokens_per_step % c]
            if bad:
                raise ValueError(f"flash_benchmarking: ab_tokens_per_step={self.ab_tokens_per_step} is not a multiple "
                                 f"of context {bad[0]}")


PRESETS = {
    "full": Params(),
    "quick": Params(seq_lens=[2**i for i in range(7, 17, 2)], sweep_budget_s=240.0, contexts=[1024, 4096, 16384],
                    model_budget_s=60.0),
    "smoke": Params(seq_lens=[32], head_dims=[16], dtypes=["float32"], warmup_ms=1.0, rep_ms=2.0,
                    shapes=[[2, 2, 24], [1, 2, 40]], shapes_head_dims=[16], shapes_dtypes=["float32"],
                    shapes_causal=[True, False], shapes_budget_s=30.0,
                    sweep_budget_s=30.0, lb_batch=2, lb_seq_len=64, lb_head_dims=[16], contexts=[16],
                    model="tiny", model_steps=1, model_budget_s=30.0,
                    ab_presets=["tiny"], ab_contexts=[16, 32], ab_impls=["sdpa", "flash_pytorch"],
                    ab_tokens_per_step=64, ab_steps=1, ab_budget_s=60.0),
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
        for head_dim in p.lb_head_dims:
            started = time.monotonic()
            table = run_leaderboard(p.lb_batch, p.lb_seq_len, head_dim)
            suffix = "" if head_dim == 64 else f"_d{head_dim}"
            out.table(table, f"leaderboard{suffix}", params={"head_dim": head_dim})
            summary = leaderboard_summary(table, ours=table["impl"].iloc[0])
            out.json(summary, f"leaderboard{suffix}_summary", params={"head_dim": head_dim})
            print(table.to_markdown(index=False, floatfmt=".4g"))
            print(f"leaderboard d={head_dim} took {time.monotonic() - started:.0f} s")
            results[f"leaderboard{suffix}"] = table
    if "sweep" in commands:
        # One table per dtype, each within its own budget: the handout's full grid is longer than one GPU job
        # may run, so `--set dtypes=bfloat16` and `--set dtypes=float32` can refresh it in two runs.
        for dtype in p.dtypes:
            started = time.monotonic()
            long = run_flash_sweep(p.seq_lens, p.head_dims, [dtype], warmup_ms=p.warmup_ms, rep_ms=p.rep_ms,
                                   budget_s=p.sweep_budget_s)
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
            parts = [run_kernel_breakdown(p.lb_batch, p.lb_seq_len, d) for d in p.lb_head_dims]
            summary = pd.DataFrame([p[0] for p in parts])
            kernels = pd.concat([p[1] for p in parts], ignore_index=True)
            tuning = pd.concat([p[2] for p in parts], ignore_index=True)
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
        long = run_shapes(p.shapes, p.shapes_head_dims, p.shapes_dtypes, p.shapes_causal, impls,
                          rounds=p.shapes_rounds, warmup_ms=p.warmup_ms, rep_ms=p.rep_ms, budget_s=p.shapes_budget_s)
        out.table(long, "shapes")
        ratio = shapes_ratio(long, ours=impls[0])
        out.table(ratio, "shapes_ratio")
        baseline = "sdpa_cudnn" if "sdpa_cudnn" in impls else impls[-1]
        summary = shapes_summary(ratio, baseline)
        out.json(summary, "shapes_summary")
        if ratio[f"vs_{baseline}"].notna().any():
            out.figure(plot_shapes(ratio, f"vs_{baseline}"), "shapes_ratio")
        print(ratio.to_markdown(index=False, floatfmt=".3g"))
        print(summary)
        print(f"shapes took {time.monotonic() - started:.0f} s")
        results.update(shapes=long, shapes_ratio=ratio, shapes_summary=summary)
    if "model" in commands:
        started = time.monotonic()
        impls = ("naive", "sdpa", "flash_triton") if not smoke else ("naive", "sdpa", "flash_pytorch")
        table = run_model_comparison(
            p.contexts, impls, model=p.model, budget_s=p.model_budget_s,
            precision="fp32" if smoke else "bf16",
            warmup=min(2, p.model_steps),
            steps=p.model_steps,
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
            rows = run_host_overhead(p.host_shapes, p.host_layouts, rounds=p.host_rounds, calls=p.host_calls)
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
            ratio = rows_of_this_run(out, "shapes_ratio", out.params, ("shapes", "shapes_head_dims", "shapes_dtypes",
                                                                       "shapes_causal", "kernel_options"))
        if not torch.cuda.is_available():
            print("losers skipped: it profiles GPU kernels, which needs a GPU")
        elif ratio is None or "vs_sdpa_cudnn" not in ratio:
            print("losers skipped: it needs this commit's shapes grid against sdpa_cudnn; run --set parts=shapes "
                  "first (or with it)")
        else:
            started = time.monotonic()
            shapes = worst_shapes(ratio, count=p.losers)
            kernels = run_losers(shapes, rounds=p.losers_rounds)
            summary = summarize_losers(kernels)
            out.table(kernels, "losers_kernels", extra={"gpu_us": "median GPU µs per forward+backward call"})
            out.table(summary, "losers", extra={"loses_most_in": "the phase with the largest gap, ours - cuDNN"})
            print(summary.to_markdown(index=False, floatfmt=".1f"))
            print(f"losers took {time.monotonic() - started:.0f} s")
            results.update(losers=summary, losers_kernels=kernels)
    if "model_ab" in commands:
        started = time.monotonic()
        table = run_model_ab(p.ab_presets, p.ab_contexts, p.ab_compile, impls=p.ab_impls, rounds=p.ab_rounds,
                             only_rounds=p.ab_only_rounds,
                             tokens_per_step=p.ab_tokens_per_step, precision="fp32" if smoke else "bf16",
                             steps=p.ab_steps, budget_s=p.ab_budget_s)
        # Split over jobs by preset, compile or round (the grid is longer than one GPU job): rounds of an earlier
        # job of this commit, device and step settings stay, rounds measured again are replaced.
        earlier = rows_of_this_run(out, "model_ab", out.params, MODEL_AB_SAME)  # as recorded: kernel options too
        table = merge_rows(table, earlier, MODEL_AB_ROUND)
        summary = summarize_model_ab(table, *p.ab_impls[:2])
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


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import mfu_note, with_mfu  # noqa: E402  (answers only)


def answer(d: SectionData) -> list[Block]:
    return [
        question(d, "flash_forward", "FlashAttention-2 forward in PyTorch and in Triton, with a causal flag.", [
            Text("The forward pass tiles $Q$ into row blocks of $B_q$ rows and streams $K, V$ in column blocks of "
                 "$B_k$ rows, keeping a running row maximum $m$, normalizer $\\ell$ and unnormalized output "
                 "$\\tilde O$ in on-chip memory; per key block $j$:"),
            Equation([
                (r"S^{(j)} = Q_i K_j^\top/\sqrt{d},\quad m^{(j)} = \max\left(m^{(j-1)}, \mathrm{rowmax}\,S^{(j)}\right),"
                r"\quad \tilde P^{(j)} = \exp\left(S^{(j)} - m^{(j)}\right)"),
                (r"\ell^{(j)} = e^{m^{(j-1)} - m^{(j)}}\,\ell^{(j-1)} + \mathrm{rowsum}\,\tilde P^{(j)},\quad "
                r"\tilde O^{(j)} = \mathrm{diag}\left(e^{m^{(j-1)} - m^{(j)}}\right)\tilde O^{(j-1)} + \tilde P^{(j)} V_j"),
                r"O_i = \mathrm{diag}\left(\ell\right)^{-1}\tilde O,\qquad L_i = m + \log \ell",
            ]),
            Text("With the causal flag, key blocks entirely above the diagonal are skipped and the diagonal block "
                 "is masked with $-10^6$ before the maximum."),
        ]),
        question(d, "flash_backward", "The backward pass by recomputation.", [
            Text("Only $O$ and $L$ are saved. With $D = \\mathrm{rowsum}(O \\circ dO)$ the backward recomputes "
                 "$P = \\exp(S - L)$ tile by tile:"),
            Equation([
                r"dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),",
                r"dQ = dS\,K/\sqrt{d},\quad dK = dS^\top Q/\sqrt{d}",
            ]),
            Text("It exists twice: `FlashAttentionPytorch` does it in tiled PyTorch under `torch.compile` (the "
                 "handout's version), and `FlashAttentionTriton`, the implementation benchmarked below, in two "
                 "Triton kernels: the first owns a query block, computes its $D$ from the $O$ and $dO$ tiles it "
                 "loads and accumulates $dQ$ over the key blocks, writing $L$ and $D$ for the second, which owns "
                 "a key block and accumulates $dK, dV$ over the query blocks; no two programs write the same "
                 "output and no atomics are needed. Its forward is a Triton kernel, or on Hopper "
                 "a warp-specialized Gluon kernel with TMA loads."),
        ]),
        question(d, "flash_benchmarking", "Triton FlashAttention-2 versus PyTorch attention (batch 1, causal) over "
                 "sequence lengths $2^7$–$2^{16}$, head sizes $2^4$–$2^7$, bf16 and fp32: forward, backward and "
                 "forward + backward latency.", _flash_sweep(d), what="the FlashAttention benchmark sweep"),
        question(d, "leaderboard", "Leaderboard timing: forward + backward, batch 1, $T = 16384$, "
                 "$d_{\\mathrm{model}} = 1024$ in 16 heads, bf16, causal.", _leaderboard(d),
                 what="the leaderboard timing"),
        question(d, "model", "The Transformer's training step with each attention implementation.", [
            _model_step_sentence(d.frame("model_step")),
            d.table("model_step", frame=_model_step_table(d.frame("model_step"), d.meta("model_step")),
                    caption="Training step (forward, backward, AdamW) by context length, one column group per "
                            "attention: mean ms, MFU and peak memory (OOM: out of memory; spreads and the "
                            "forward/backward/optimizer split: the CSV)." + mfu_note(d.meta("model_step"), ("bf16",))),
            d.figure("model_step", caption="Step time and peak memory by context length."),
        ]),
        *_shapes(d),
        *_losers(d),
        *_host(d),
        *_model_ab(d),
    ]


def _losers(d: SectionData) -> list[Block]:
    """Beyond the handout: where the worst shapes of the grid lose, kernel by kernel (empty without results)."""
    summary = d.frame("losers")
    if summary is None or summary.empty or "loses_most_in" not in summary:
        return []
    counts = summary["loses_most_in"].value_counts()
    slowest = summary["ours_slowest_kernel"].value_counts()
    text = (f"Profiled at the {len(summary)} shapes where ours loses most to cuDNN (forward+backward, GPU time per "
            "kernel, alternating): the larger part of the gap lies in the "
            + join_words([f"{phase} at {n}" for phase, n in counts.items()])
            + "; our slowest kernel there: " + join_words([f"`{k}` at {n}" for k, n in slowest.items()]) + ". "
            + _losers_per_shape(summary) + " (GPU µs per call by phase and kernel: `losers.csv`, "
            "`losers_kernels.csv` in the results index)")
    levers = [_forward_lever(summary[summary["loses_most_in"] == "forward"]) if phase == "forward" else
              LOSER_LEVERS[phase] for phase in counts.index if phase in LOSER_LEVERS]
    if levers:
        text += ". What would close the gap (predictions from the kernels' profiles, not yet measured): " + \
            "; ".join(levers)
    d.frame("losers_kernels")  # cited above, listed in the index
    return [question(d, "losers", "Beyond the handout: where the shapes that lose most lose, from a profile.",
                     [Text(text + ".")])]


#: Per losing phase, the lever the kernel notes point to (``docs/flash_attention/NOTES.md``, "Next levers").
LOSER_LEVERS = {
    "backward": "in the backward, our dK/dV and dQ kernels each recompute $QK^T$ and $P$, seven products where "
                "cuDNN's fused backward does five; accumulating dQ inside the dK/dV kernel (FlashAttention-3's "
                "schedule) removes two, at the price of a reduction that 128-key tiles keep small",
    "forward": "the tile is already chosen per sequence length; what is left is more work per program at short "
               "sequences (two programs resident per SM, or a persistent schedule), and `flash_host_overhead "
               "--variant` A/Bs tiles at any shape without code changes",
}


def _forward_lever(shapes: pd.DataFrame) -> str:
    """Why the forward loses at ``shapes``, from the Hopper forward's tile arithmetic (``tile_for``, the tile it
    runs at each length): how many of the rows its query tiles compute are padding, and how few key blocks a
    program streams through its ring."""
    from cs336_systems.attention.flash_fwd_sm90 import TILES, tile_for

    facts = []
    for seq, d in sorted({(int(r["seq_len"]), int(r["head_dim"])) for _, r in shapes.iterrows()}):
        if d not in TILES:
            continue
        block_m, block_n, stages = tile_for(d, seq)
        rows = math.ceil(seq / block_m) * block_m
        facts.append(f"at {seq:,} tokens and d = {d}, {block_m}-row query tiles compute {rows:,} rows "
                     f"({1 - seq / rows:.0%} padding) and a program streams at most {math.ceil(seq / block_n)} "
                     f"{block_n}-key blocks through a {stages}-deep ring")
    why = ("in the forward, " + "; ".join(facts)
           + ", so a program spends much of its time filling and draining its pipeline (from the tile arithmetic, "
             "not profiled per instruction); ") if facts else "in the forward, "
    return why + LOSER_LEVERS["forward"]


def _losers_per_shape(summary: pd.DataFrame) -> str:
    """Each profiled shape with ours' and cuDNN's forward and backward µs, in one sentence."""
    def shape(r: pd.Series) -> str:
        return (f"{r['dtype']} ({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, {int(r['head_dim'])})"
                f"{' causal' if str(r['causal']) == 'True' else ''}")

    return "Forward and backward, ours against cuDNN's, in µs: " + "; ".join(
        f"{shape(r)} {fmt.sig(r['ours_forward_us'])}/{fmt.sig(r['cudnn_forward_us'])} and "
        f"{fmt.sig(r['ours_backward_us'])}/{fmt.sig(r['cudnn_backward_us'])}" for _, r in summary.iterrows())


#: The issue's goal for our host cost per forward+backward, in µs.
HOST_GOAL_US = 30.0


def _host(d: SectionData) -> list[Block]:
    """Beyond the handout: CPU µs per call against the GPU's, ours and SDPA's (empty without results)."""
    summary = d.frame("host_overhead_summary")
    if summary is None or summary.empty or "impl" not in summary:
        return []
    keyed = summary.set_index([*HOST_KEYS, "impl"])["host_us"].unstack("impl")
    ours = summary[summary["impl"] == "ours"]

    def span(values: pd.Series, unit: str = " µs", show: Callable[[Any], str] = fmt.sig) -> str:
        lo, hi = show(values.min()), show(values.max())
        return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"

    text = (f"Issuing one causal forward+backward costs our attention {span(ours['host_us'])} of CPU time over "
            f"{len(ours)} shape{'' if len(ours) == 1 else 's'} and layouts (the goal: {HOST_GOAL_US:g} µs)")
    if "sdpa_cudnn" in keyed and "ours" in keyed:
        over = (keyed["ours"] / keyed["sdpa_cudnn"]).dropna()
        text += (f"; SDPA pinned to cuDNN costs {span(keyed['sdpa_cudnn'].dropna())} on the same host, so ours "
                 f"takes {span(over, '', fmt.ratio)} cuDNN's host time. The forward and backward through "
                 "`torch.autograd.grad` are in both numbers")
    host_bound = ours[ours["bound"] == "host"]
    text += (f". Ours is host-bound (issuing a call takes longer than the GPU runs it) at {len(host_bound)} of "
             f"{len(ours)}" + (": " + join_words([f"({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, "
                                                  f"{int(r['head_dim'])}) {r['layout']}"
                                                  for _, r in host_bound.iterrows()]) if len(host_bound) else "")
             + "; there a call's wall time is the host's, unless a CUDA graph replays it (§1.4's compiled steps)."
             " Measured with `python -m cs336_systems.benchmarking.flash_host_overhead` (GPU asleep while the host"
             " issues the calls; `docs/flash_attention/host_overhead.md` has the method and the profile).")
    return [question(d, "host", "Beyond the handout: what one call costs the CPU, beside what it costs the GPU.", [
        Text(text),
        d.table("host_overhead_summary", frame=_host_table(summary), caption="Median over alternating rounds of "
                "the CPU µs to issue one forward+backward and of the kernels' GPU µs, per implementation, bf16, "
                "causal (spreads and wall times: the CSV)."),
    ])]


def _host_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per shape and layout: each implementation's host µs, then its GPU µs."""
    wide = summary.pivot_table(index=list(HOST_KEYS), columns="impl", values=["host_us", "gpu_us"], sort=False)
    impls = list(dict.fromkeys(summary["impl"]))
    wide = wide.reindex(columns=[(v, i) for v in ("host_us", "gpu_us") for i in impls if (v, i) in wide.columns])
    wide.columns = [f"{impl} {value.removesuffix('_us')} µs" for value, impl in wide.columns]
    return wide.reset_index()


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
    if measured["compile"].any():  # what "compiled" means here, unlike §1.4's graph-replayed steps
        text += (". Compiled is `torch.compile(model)` in its default mode with `cs336_basics`' AdamW stepping "
                 "eagerly: no CUDA graphs, so each attention call still pays its custom operators' host path")
    return [question(d, "model_ab", f"Beyond the handout: {ours} against {baseline} inside the model's training "
                     "step, eager and compiled, alternating in one process.", [
        Text(text + "."),
        d.table("model_ab_summary", frame=_model_ab_table(summary, baseline, ours), caption=f"Median training "
                f"step (forward, backward, AdamW) of our model with each attention over alternating rounds, eager "
                f"and compiled, and the verdict against the spread of the rounds (spreads and the ratio "
                f"{baseline} / ours: the CSV)."),
    ])]


def _model_ab_grid(params: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """The cells ``ab_presets`` × ``ab_contexts`` × ``ab_compile`` of a parameter record."""
    return [(str(p), int(c), bool(k)) for p in params.get("ab_presets") or [] for c in params.get("ab_contexts") or []
            for k in params.get("ab_compile") or []]


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
    defaults = Params()
    cells: list[tuple[str, int, bool]] = []
    for job in SECTION.jobs:
        if "model_ab" in job.sets.get("parts", ()):
            sets = {k: job.sets.get(k, getattr(defaults, k)) for k in ("ab_presets", "ab_contexts", "ab_compile")}
            cells += [cell for cell in _model_ab_grid(sets) if cell not in cells]
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


def _shapes(d: SectionData) -> list[Block]:
    """Beyond the handout: the shapes grid against SDPA's flash and cuDNN backends (empty without results)."""
    summary = d.json("shapes_summary")
    if not isinstance(summary, dict) or "baseline" not in summary:
        return []
    baseline = summary["baseline"]
    parts = []
    for phase in ("forward+backward", "forward"):
        g = summary.get(phase)
        if isinstance(g, dict):
            spread = (f" (round-to-round spread of a time: median {fmt.pct(g['spread_median'])}, 90th percentile "
                      f"{fmt.pct(g['spread_p90'])})" if "spread_median" in g else "")
            parts.append(f"{phase}: geometric mean {fmt.ratio(g['geomean'])} of {baseline}'s speed over "
                         f"{g['cells']} shapes, lowest {fmt.ratio(g['min'])} ({g['worst']}), "
                         f"{g['below_0.9']} below 0.9× and {g['below_1.0']} below 1.0×{spread}")
    d.frame("shapes")  # the heatmap's data
    return [question(d, "shapes", "Beyond the handout: every shape, against SDPA's flash and cuDNN backends "
                     "(batch 1-8, heads 8-32, sequences 256-65536 including lengths that are no multiple of a "
                     "tile, head dims 64 and 128, bf16 and fp16, causal and not).", [
        Text("Ours against " + baseline + ", as its time over ours (above 1: ours faster): " + "; ".join(parts)
             + "."),
        d.figure("shapes_ratio", caption=f"{baseline} time over ours per shape, dtype and masking."),
        d.table("shapes_ratio", frame=_worst_shapes(d.frame("shapes_ratio"), f"vs_{baseline}"),
                caption=f"The {WORST_SHAPES} shapes where ours loses most to {baseline} (each backend's time "
                        f"over ours, {_rounds_words(summary)}); every shape is in the CSV and the heatmap."),
    ])]


def _rounds_words(summary: Mapping[str, Any]) -> str:
    rounds = summary.get("rounds", 1)
    if rounds == 1:
        return "medians of `do_bench`"
    return f"medians over {rounds} alternating rounds of `do_bench` medians"


#: Rows of the shapes table in the writeup: the losing end of the grid, which is what needs explaining.
WORST_SHAPES = 12


def _worst_shapes(ratio: pd.DataFrame | None, column: str) -> pd.DataFrame | None:
    if ratio is None or column not in ratio:
        return ratio
    shown = [c for c in (*SHAPE_KEYS, "vs_sdpa_flash", "vs_sdpa_cudnn", "vs_sdpa_math", "vs_best") if c in ratio]
    return ratio.sort_values(column).head(WORST_SHAPES)[shown].reset_index(drop=True)


def _flash_sweep(d: SectionData) -> list[Block | None]:
    frames = [f for f in (d.frame(name) for name in SWEEP_TABLES) if f is not None]
    sweep = pd.concat(frames, ignore_index=True) if frames else None  # shown through the speed-up table
    sp = d.frame("sweep_speedup")
    blocks: list[Block | None] = []
    if sp is not None and {"dtype", "pass", "speedup_vs_builtin"} <= set(sp.columns) and len(sp):
        parts = []
        for (dtype, ph), g in sp.groupby(["dtype", "pass"], sort=False):
            v = g["speedup_vs_builtin"].dropna()
            if len(v):
                parts.append(f"{dtype} {ph}: median {fmt.ratio(v.median())} (range {fmt.sig(v.min())}–"
                             f"{fmt.sig(v.max())})")
        naive_text = _naive_sentence(sp, sweep)
        if naive_text is not None:
            blocks.append(naive_text)
        blocks.append(Text("Speed-up of our Triton kernels over the fastest built-in PyTorch attention in each cell "
                           "(built-in time / ours; above 1 means ours is faster): " + "; ".join(parts) + "."))
        for dtype, g in sp.groupby("dtype", sort=False):
            values = [v for v in ("ours_ms", "naive_ms", "best_builtin_ms") if v in g.columns]
            wide = g.pivot_table(index=["seq_len", "head_dim"], columns="pass", values=values, sort=False)
            label = {"ours_ms": "ours", "naive_ms": "PyTorch", "best_builtin_ms": "best SDPA"}
            wide.columns = [f"{ph} {label[k]} ms" for k, ph in wide.columns]
            order = [c for ph in ("forward", "backward", "forward+backward") for c in
                     (f"{ph} ours ms", f"{ph} PyTorch ms", f"{ph} best SDPA ms") if c in wide.columns]
            blocks.append(d.table("sweep_speedup", frame=wide[order].reset_index(), caption=f"Latency (ms) of our "
                                  f"Triton FlashAttention-2, regular PyTorch attention (eager, unfused) and the "
                                  f"fastest SDPA backend, {dtype}, batch 1, causal; blank: out of memory."))
    blocks.append(d.figure("sweep_speedup", caption="Speed-up over the fastest built-in per cell."))
    blocks.append(d.figure("sweep_latency_d64", caption="Latency against sequence length, head size 64."))
    if len([b for b in blocks if b is not None]) == 0:
        blocks += [d.table(name, caption=f"Latency by implementation, head size, sequence length and pass "
                           f"({name.removeprefix('sweep_')}).") for name in SWEEP_TABLES]
    return blocks


def _naive_sentence(sp: pd.DataFrame, sweep: pd.DataFrame | None) -> Text | None:
    """Ours against regular PyTorch attention (what the handout compares with), forward + backward."""
    if "speedup_vs_naive" not in sp.columns:
        return None
    oom = pd.DataFrame()
    if sweep is not None and {"impl", "status", "pass"} <= set(sweep.columns):
        oom = sweep[(sweep["impl"] == "naive") & (sweep["status"] == "OOM") & (sweep["pass"] == "forward+backward")]
    parts = []
    for dtype, g in sp[sp["pass"] == "forward+backward"].groupby("dtype", sort=False):
        v = g.dropna(subset=["speedup_vs_naive"])
        if v.empty:
            continue
        slower = v[v["speedup_vs_naive"] < 1]
        longest = v[v["seq_len"] == v["seq_len"].max()]
        text = (f"{dtype}: in the median cell ours takes {fmt.ratio(1 / v['speedup_vs_naive'].median())} PyTorch's "
                f"time, at {int(longest['seq_len'].iloc[0]):,} tokens "
                f"{fmt.ratio(1 / longest['speedup_vs_naive'].max())}–{fmt.ratio(1 / longest['speedup_vs_naive'].min())}")
        if not slower.empty:
            text += (f"; ours is slower in {len(slower)} of {len(v)} cells, all at or below "
                     f"{int(slower['seq_len'].max()):,} tokens, where fixed per-call costs outweigh the quadratic work")
        mine = oom[oom["dtype"] == dtype] if "dtype" in oom.columns else oom
        if not mine.empty:
            text += f"; PyTorch runs out of memory from {int(mine['seq_len'].min()):,} tokens, ours does not"
        parts.append(text)
    if not parts:
        return None
    return Text("Against regular PyTorch attention (eager, materializing the $T\\times T$ scores), forward + "
                "backward: " + "; ".join(parts) + ".")


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
                + join_words(parts) + ".")


def _leaderboard_sentence(summary: dict, head_dim: str = "") -> Text | None:
    ours = summary.get("ours", "triton")
    ms_ = summary.get(f"{ours}_fwd_bwd_ms")
    if ms_ is None:
        return None
    vs = [f"{k.removeprefix('speedup_vs_')} {fmt.ratio(v)}" for k, v in summary.items()
          if k.startswith("speedup_vs_") and isinstance(v, (int, float))]
    lead = f"{head_dim}our kernels" if head_dim else "Our kernels"
    return Text(f"{lead} ({ours}) take {fmt.ms(ms_)} for forward + backward"
                + (f" ({fmt.sig(summary['ours_fwd_bwd_TFLOP_per_s'])} TFLOP/s)"
                   if "ours_fwd_bwd_TFLOP_per_s" in summary else "")
                + ("; speed-up over " + join_words(vs) + " measured in the same run." if vs else "."))


def _leaderboard(d: SectionData) -> list[Block | None]:
    summary = d.json("leaderboard_summary", "leaderboard*_summary")
    text = _leaderboard_sentence(summary) if isinstance(summary, dict) else None
    d128 = d.json("leaderboard_d128_summary") if "leaderboard_d128_summary" in d.records and \
        d.frame_name("leaderboard") else None
    if isinstance(d128, dict) and text is not None:
        extra = _leaderboard_sentence(d128, "With head size 128, ")
        text = Text(text.markdown + (" " + extra.markdown if extra else ""))
    main = d.frame_name("leaderboard", "leaderboard_d*")
    frame = subset(d.frame(main) if main else None, "impl", "fwd_bwd_sum_ms", "fwd_bwd_sum_median_ms", "forward_ms",
                   "fwd_bwd_TFLOP_per_s", "forward_TFLOP_per_s")
    return [text, d.table(main or "", frame=frame, caption="Leaderboard configuration, forward + backward "
                          "with `o.sum().backward()` and forward alone (heads folded into the batch)."),
            d.table("leaderboard_d128", frame=subset(d.frame("leaderboard_d128"), "impl", "fwd_bwd_sum_ms",
                                                     "forward_ms", "fwd_bwd_TFLOP_per_s"),
                    caption="The same with head size 128.")]



from cs336_systems.experiments.section import Job  # noqa: E402


SECTION = Section(
    name="flash_benchmarking", number="1.3.2", title="FlashAttention-2 in Triton",
    problems=("flash_forward", "flash_backward", "flash_benchmarking"), answer=answer, presets=PRESETS, run=run,
    derive=derive, derive_inputs=SWEEP_TABLES,
    depends=(*MODEL, "cs336_systems/attention/", "cs336_systems/benchmarking/timing.py",
             "cs336_systems/benchmarking/end_to_end.py", "cs336_systems/benchmarking/sweep.py",
             "cs336_systems/benchmarking/flash_host_overhead.py", "cs336_systems/benchmarking/flash/"),
    # minutes as measured at 087cb28, 311857a and b0eb683 on a fresh H100 machine (docs/flash_attention/
    # refresh_b0eb683.md): a compiled cell compiles the whole model once per implementation and round, about 2 min
    # at xl and 2.5 min at xl 2048 on that host, so xl's compiled cells run one round per job; run again on the
    # same machine, a compiled job takes about half (jobs 5 and 7: 134 and 156 s), its graphs cached
    jobs=(
        Job({"dtypes": ["bfloat16"]}, 4.7, "leaderboard at d 64 and 128, the bf16 sweep, the model step, host cost"),
        Job({"parts": ["sweep"], "dtypes": ["float32"]}, 5.4),
        Job({"parts": ["shapes"]}, 7.5),
        Job({"parts": ["losers"]}, 0.6, "reads the shapes grid of the job before"),
        Job({"parts": ["model_ab"], "ab_presets": ["small"]}, 5.5, "eager and compiled"),
        Job({"parts": ["model_ab"], "ab_presets": ["medium", "xl"], "ab_compile": [False]}, 1.3),
        Job({"parts": ["model_ab"], "ab_presets": ["medium"], "ab_compile": [True], "ab_contexts": [1024, 2048]}, 6.5),
        Job({"parts": ["model_ab"], "ab_presets": ["medium"], "ab_compile": [True], "ab_contexts": [4096]}, 2.8),
        # xl compiled, measured at 63e88b2 on one warm H100 (jobs 9-14 one after another): round 1 compiles the
        # model and took 3.5-3.8 min; round 2, run next on the same machine, found the graphs cached (0.6-0.7 min)
        *(Job({"parts": ["model_ab"], "ab_presets": ["xl"], "ab_compile": [True], "ab_contexts": [context],
               "ab_only_rounds": [r]}, minutes[r], f"round {r + 1} of 2"
              + ("" if r == 0 else "; about 4 min on a machine that has not run round 1"))
          for context, minutes in ((1024, (3.8, 0.6)), (2048, (3.5, 0.7)), (4096, (3.6, 0.7))) for r in (0, 1)),
    ),
)
