"""DDP training-step benchmark (§2.2–§2.3): every strategy next to single-GPU training and
``torch.nn.parallel.DistributedDataParallel`` in the same run, plus torch.profiler timelines.

Each variant trains the same model from the same weights on the same data (``batch_per_rank`` sequences per
rank) for ``warmup`` + ``steps`` steps. CUDA events on the compute stream split every step without stalling the
host: ``step_ms`` (forward, backward, gradient synchronisation, optimizer step); ``sync_ms`` (end of backward's
compute to averaged gradients in place: the communication backward did *not* hide; not separable for torch DDP,
which synchronises inside ``backward()``); ``overhead_ms`` (``step_ms`` minus the single-GPU step of the same
run: what data parallelism costs, comparable across every strategy). Rows report the slowest rank's means and
its median step (``step_ms_median``), which occasional slow steps of a host-bound run do not move.

``cuda_graph`` variants time replays of the whole captured step (GPU time only: ``step_ms`` alone). ``single``
runs the unwrapped model on every rank (the ideal); ``torch`` is DDP with its defaults or its
``bf16_compress_hook``. Strategies in ``profile`` get one traced step each (:mod:`cs336_systems.profiling.timeline`).

Command line: ``python -m cs336_systems.benchmarking ddp_steps`` (spawned ranks, or torchrun's and srun's: the
forms are in ``docs/guide/distributed.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from cs336_systems.benchmarking.allreduce import parse_size, time_all_reduce
from cs336_systems.configs import build_model, get_config
from cs336_systems.distributed import launch
from cs336_systems.distributed.ddp_bucketed import DEFAULT_BUCKET_SIZE_MB
from cs336_systems.distributed.grad_sync import DataParallel, bucket_size_mb_value, shard_batch
from cs336_systems.distributed.strategies import STRATEGIES, wrap
from cs336_systems.profiling.timeline import overlap_summary, plot_timeline, profile_timeline

SECTION = "ddp_benchmark"  # results folder (figures/ddp_benchmark/) the command-line runs write to
BASELINES = ("single", "torch")
ALL_MODES = (*BASELINES, *STRATEGIES)
_COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
EQUIVALENCE_TOL = 1e-5
LOW_PRECISION_EQUIVALENCE_TOL = 2e-2


@dataclass
class DDPBenchConfig:
    """What to run: ``modes`` of :data:`ALL_MODES`, ``bucket_sizes_mb`` for ``bucketed``, ``comm_dtypes`` for every
    communicating mode, ``autocast`` the compute precision (parameters, gradients, optimizer stay fp32)."""

    preset: str = "xl"
    context_length: int = 512
    batch_per_rank: int = 2
    autocast: str = "fp32"
    modes: list[str] = field(default_factory=lambda: list(ALL_MODES))
    bucket_sizes_mb: list[float] = field(default_factory=lambda: [DEFAULT_BUCKET_SIZE_MB])
    comm_dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    warmup: int = 3
    steps: int = 10
    profile: list[str] = field(default_factory=list)  # variant labels or modes to trace
    seed: int = 0
    attention_impl: str = "naive"
    allreduce_sizes: list[int] = field(default_factory=list)  # bytes; timed on the same group for the overhead model
    check_toy: bool = False  # first check each of our strategies against single-process training (toy model)
    grad_views: list[bool] = field(default_factory=lambda: [False])  # flat/bucketed: .grad as bucket views
    cuda_graph: list[bool] = field(default_factory=lambda: [False])  # capture each step in a CUDA graph

    def validate(self, world_size: int | None = None) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ValueError(f"unknown modes {bad}; valid: {', '.join(ALL_MODES)}")
        if self.autocast not in ("fp32", "bf16"):
            raise ValueError(f"autocast must be fp32 or bf16, got {self.autocast!r}")
        bad = [c for c in self.comm_dtypes if c not in _COMM_DTYPES]
        if bad:
            raise ValueError(f"unknown comm dtypes {bad}; valid: {', '.join(_COMM_DTYPES)}")
        for size in self.bucket_sizes_mb:
            bucket_size_mb_value(size, "bucket_sizes_mb", allow_none=False)
        if self.batch_per_rank < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("need batch_per_rank >= 1, steps >= 1, warmup >= 0")
        # One spelling per model: "XL" and "xl" name the same files.
        object.__setattr__(self, "preset", get_config(self.preset).name)
        from cs336_basics.model import get_attention

        get_attention(self.attention_impl)  # ValueError naming the registered implementations
        if any(self.cuda_graph) and not torch.cuda.is_available():
            raise ValueError("cuda_graph needs CUDA devices: a CUDA graph captures GPU work (NCCL collectives included)")


@dataclass(frozen=True)
class Variant:
    mode: str
    bucket_size_mb: float | None = None
    comm_dtype: str = "fp32"
    grad_views: bool = False
    cuda_graph: bool = False

    @property
    def label(self) -> str:
        parts = [self.mode]
        if self.mode == "bucketed":
            parts.append(f"{self.bucket_size_mb:g}MB")
        if self.comm_dtype != "fp32":
            parts.append(f"{self.comm_dtype} comm")
        if self.grad_views:
            parts.append("grad views")
        if self.cuda_graph:
            parts.append("CUDA graph")
        return parts[0] if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})"


def expand_variants(cfg: DDPBenchConfig) -> list[Variant]:
    """Every (mode, bucket size, comm dtype, graph) combination the config asks for, ``single`` once
    per graph setting."""
    out: list[Variant] = []
    for mode in cfg.modes:
        if mode == "single":
            out.append(Variant("single"))
            continue
        for comm in cfg.comm_dtypes:
            if mode == "bucketed":
                out += [Variant(mode, b, comm, views) for b in cfg.bucket_sizes_mb for views in cfg.grad_views]
            elif mode == "flat":
                out += [Variant(mode, None, comm, views) for views in cfg.grad_views]
            elif mode == "torch":
                out.append(Variant(mode, DEFAULT_BUCKET_SIZE_MB, comm))
            else:
                out.append(Variant(mode, None, comm))
    out = [replace(v, cuda_graph=g) for g in cfg.cuda_graph for v in out]
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------------
# One training step, timed with events
# --------------------------------------------------------------------------------------------------


class _Clock:
    """CUDA events on the current stream (no host stall), or host timestamps on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        import time

        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _wrap_model(model: nn.Module, variant: Variant, device: torch.device) -> nn.Module:
    comm = _COMM_DTYPES[variant.comm_dtype]
    if variant.mode == "single":
        return model
    if variant.mode == "torch":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=variant.bucket_size_mb or DEFAULT_BUCKET_SIZE_MB,
        )
        if comm is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.bf16_compress_hook if comm == torch.bfloat16 else default_hooks.fp16_compress_hook
            ddp.register_comm_hook(state=None, hook=hook)
        return ddp
    return wrap(model, variant.mode, bucket_size_mb=variant.bucket_size_mb, comm_dtype=comm,
                gradient_as_bucket_view=variant.grad_views)


def _make_graphed_step(captured: Callable[[], Any], clock: _Clock) -> Callable[[], tuple[Any, Any, Any, Any]]:
    """Replays of a captured step, timed as a whole (the phases inside a graph have no host marks)."""

    def step() -> tuple[Any, Any, Any, Any]:
        with record_function("graph_replay"):
            t0 = clock.mark()
            captured()
            t3 = clock.mark()
        return t0, None, None, t3

    return step


def _make_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               autocast: str, clock: _Clock | None) -> Callable[[], tuple[Any, Any, Any, Any]]:
    """One whole training step on the static batch ``x, y``, returning its four time marks; with
    ``clock=None`` the marks are ``None`` (the untimed body a CUDA graph captures)."""
    device_type = x.device.type
    sync = model.finish_gradient_synchronization if isinstance(model, DataParallel) else (lambda: None)
    mark = clock.mark if clock is not None else (lambda: None)

    def step() -> tuple[Any, Any, Any, Any]:
        t0 = mark()
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"), torch.autocast(device_type, torch.bfloat16, enabled=autocast == "bf16"):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        with record_function("backward"):
            loss.backward()
        t1 = mark()
        with record_function("grad_sync"):
            sync()
        t2 = mark()
        with record_function("optimizer"):
            optimizer.step()
        t3 = mark()
        return t0, t1, t2, t3

    return step


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _batch(cfg: DDPBenchConfig, vocab: int, rank: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, vocab, (cfg.batch_per_rank * world_size, cfg.context_length + 1), generator=g)
    local = shard_batch(tokens, rank, world_size).to(device)
    return local[:, :-1].contiguous(), local[:, 1:].contiguous()


def run_variant(cfg: DDPBenchConfig, variant: Variant) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Time one variant on the current process group; returns its row (identical on every rank after
    the MAX reduction) and, if profiled and rank 0, its timeline intervals."""
    ctx = launch.current_context()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.preset, context_length=cfg.context_length, attention_impl=cfg.attention_impl,
                        device=ctx.device)
    vocab = get_config(cfg.preset).vocab_size
    x, y = _batch(cfg, vocab, ctx.rank, ctx.world_size, ctx.device)
    clock = _Clock(ctx.device)
    if variant.cuda_graph:
        if ctx.device.type != "cuda":
            raise ValueError("CUDA-graph variants need CUDA devices (the NCCL backend)")
        from cs336_systems.cuda_graphs import DEFAULT_WARMUP, CapturedStep, side_stream

        with side_stream(ctx.device):  # torch DDP must be built off the default stream to be captured
            wrapped = _wrap_model(model, variant, ctx.device)
        # Optimizer state (step counts included) on the GPU, so that replays advance it.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
        captured = CapturedStep(_make_step(wrapped, optimizer, x, y, cfg.autocast, None), ctx.device,
                                warmup=max(cfg.warmup, DEFAULT_WARMUP))
        step = _make_graphed_step(captured, clock)
    else:
        wrapped = _wrap_model(model, variant, ctx.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if ctx.device.type == "cuda" else {}))
        step = _make_step(wrapped, optimizer, x, y, cfg.autocast, clock)

    for _ in range(cfg.warmup):
        step()
    _synchronize(ctx.device)
    dist.barrier()
    marks = [step() for _ in range(cfg.steps)]
    _synchronize(ctx.device)
    nan = float("nan")
    per_step = torch.tensor(
        [[clock.ms(a, d), clock.ms(b, c), clock.ms(a, b), clock.ms(c, d)] if b is not None else [clock.ms(a, d), nan, nan, nan]
         for a, b, c, d in marks], dtype=torch.float64
    )
    # Report the slowest rank's breakdown (a step ends when the slowest rank ends); taking each
    # component's max separately would give a breakdown that adds up to more than any rank's step.
    # The median is reported beside the mean: a host-bound step (bf16 autocast) has occasional slow
    # steps from the OS and the other processes on the node, which move the mean much more than the median.
    summary = torch.cat([per_step.mean(0), per_step[:, 0].median().reshape(1)]).to(ctx.device)
    gathered = [torch.empty_like(summary) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, summary)
    step_ms, sync_ms, fwd_bwd_ms, opt_ms, step_median_ms = max((g.tolist() for g in gathered), key=lambda g: g[0])
    has_sync = isinstance(wrapped, DataParallel)
    row = {
        "variant": variant.label,
        "mode": variant.mode,
        "bucket_size_mb": variant.bucket_size_mb,
        "comm_dtype": variant.comm_dtype if variant.mode != "single" else None,
        "grad_views": variant.grad_views,
        "cuda_graph": variant.cuda_graph,
        "num_buckets": len(wrapped.buckets) if has_sync else None,
        "step_ms": step_ms,
        "step_ms_std": float(per_step[:, 0].std()) if cfg.steps > 1 else 0.0,
        "step_ms_median": step_median_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "sync_ms": sync_ms if has_sync else nan,
        "optimizer_ms": opt_ms,
        "world_size": ctx.world_size if variant.mode != "single" else 1,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "peak_mem_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else float("nan"),
    }

    timeline: list[dict[str, Any]] = []
    if variant.label in cfg.profile or variant.mode in cfg.profile:
        timeline = profile_timeline(step, ctx.device, variant.label) if ctx.rank == 0 else []
        if ctx.rank != 0:
            profile_timeline(step, ctx.device, variant.label, export=False)
    dist.barrier()
    if has_sync:
        wrapped.reducer.remove_hooks()
    if variant.cuda_graph:
        captured.reset()
        del captured
    del wrapped, model, optimizer, step, x, y
    _free(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    return row, timeline


def with_overheads(steps: Any) -> Any:
    """A copy of the step table ``steps`` with ``overhead_ms`` and ``vs_single`` of every row against
    the single-GPU step *of the same kind* (eager or captured in a CUDA graph): a captured step compared
    with an eager single-GPU step would credit the graph to data parallelism."""
    frame = steps.copy()
    graphed = _captured(frame)
    frame["overhead_ms"] = float("nan")
    frame["vs_single"] = float("nan")
    for setting in graphed.unique():
        same = graphed == setting
        single = frame.loc[same & (frame["mode"] == "single"), "step_ms"]
        if len(single):
            frame.loc[same, "overhead_ms"] = frame.loc[same, "step_ms"] - single.iloc[0]
            frame.loc[same, "vs_single"] = frame.loc[same, "step_ms"] / single.iloc[0]
    return frame


def check_toy_equivalence(variants: list[Variant]) -> list[dict[str, Any]]:
    """Train each of our strategies (as configured: bucket size, wire dtype) on the toy model and compare
    with single-process training on the full batch; rows report the worst rank."""
    from cs336_systems.checks.equivalence import train_and_compare, train_captured_and_compare

    ctx = launch.current_context()
    rows = []
    for v in variants:
        if v.mode in BASELINES:
            continue
        comm = _COMM_DTYPES[v.comm_dtype]
        train = train_captured_and_compare if v.cuda_graph else train_and_compare
        res = train(lambda m, v=v, comm=comm: wrap(m, v.mode, bucket_size_mb=v.bucket_size_mb, comm_dtype=comm,
                                                   gradient_as_bucket_view=v.grad_views),
                    "toy", global_batch=4 * ctx.world_size, device=ctx.device)
        finals: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(finals, res.pop("final"))
        worst = torch.tensor([res["init_diff"], res["final_diff"]], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        agree = all(torch.equal(finals[0], f) for f in finals)
        # A low-precision wire format rounds every averaged gradient, so it gets a looser tolerance.
        tol = EQUIVALENCE_TOL if comm is None else LOW_PRECISION_EQUIVALENCE_TOL
        rows.append({"variant": v.label, "init_diff": worst[0].item(), "final_diff": worst[1].item(), "moved": res["moved"],
                     "ranks_agree": agree, "ok": agree and worst[0].item() == 0.0 and worst[1].item() < tol})
    return rows


def ddp_benchmark_worker(cfg: DDPBenchConfig) -> dict[str, Any]:
    """All variants, in order, on the current process group (run on every rank)."""
    ctx = launch.current_context()
    cfg.validate(ctx.world_size)
    equivalence = check_toy_equivalence(expand_variants(cfg)) if cfg.check_toy else []
    rows, timeline = [], []
    for variant in expand_variants(cfg):
        if ctx.is_main:
            print(f"[{cfg.preset} {cfg.autocast} x{ctx.world_size}] {variant.label} ...", flush=True)
        row, tl = run_variant(cfg, variant)
        row.update(preset=cfg.preset, autocast=cfg.autocast, context_length=cfg.context_length,
                   batch_per_rank=cfg.batch_per_rank, steps=cfg.steps)
        rows.append(row)
        timeline += tl
        if ctx.is_main:
            print(f"    {row['step_ms']:.1f} ms/step, exposed communication {row['sync_ms']:.1f} ms", flush=True)
    import pandas as pd

    rows = with_overheads(pd.DataFrame(rows)).to_dict("records")
    allreduce = [time_all_reduce(size) for size in cfg.allreduce_sizes]
    return {"rows": rows, "timeline": timeline, "allreduce": allreduce, "equivalence": equivalence}


def run_benchmark(cfg: DDPBenchConfig, nproc: int = 2, backend: str | None = None) -> dict[str, Any]:
    """Spawn ``nproc`` local ranks (or join torchrun/srun's) and run :func:`ddp_benchmark_worker`;
    returns rank 0's ``{"rows", "timeline", "allreduce", "equivalence"}``."""
    from cs336_systems.distributed import runner

    cfg.validate()
    return runner.run_on_ranks(ddp_benchmark_worker, nproc, cfg, backend=backend)[0]


# --------------------------------------------------------------------------------------------------
# Figures, result files and the command line
# --------------------------------------------------------------------------------------------------

def _captured(df: Any) -> Any:
    """Boolean Series: which rows were timed as replays of a CUDA graph (tables older than the option
    have no column and were all eager)."""
    import pandas as pd

    if "cuda_graph" not in df:
        return pd.Series(False, index=df.index)
    return df["cuda_graph"].fillna(False).astype(bool)


def plot_steps(df: Any, title: str = "") -> Any:
    """Horizontal stacked bars per variant: forward+backward, exposed communication, optimizer step;
    a step captured in a CUDA graph is one bar (its phases have no host marks). The single-GPU step is
    a dashed line (dotted for the captured one)."""
    import matplotlib.pyplot as plt

    d = df.reset_index(drop=True).copy()
    captured = _captured(d)
    for col in ("fwd_bwd_ms", "sync_ms", "optimizer_ms"):
        d[col] = d[col].where(~captured, 0.0).fillna(0.0)
    d["captured_ms"] = d["step_ms"].where(captured, 0.0)
    d["other_ms"] = (d["step_ms"] - d["fwd_bwd_ms"] - d["sync_ms"] - d["optimizer_ms"] - d["captured_ms"]).clip(lower=0)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(d) + 1.5))
    left = [0.0] * len(d)
    segments = [("fwd_bwd_ms", "#4c72b0", "forward + backward"), ("sync_ms", "#dd8452", "exposed communication"),
                ("optimizer_ms", "#55a868", "optimizer step"), ("other_ms", "#cccccc", "other"),
                ("captured_ms", "#8172b3", "whole step, one CUDA graph")]
    for col, color, label in segments:
        if d[col].any():
            ax.barh(d["variant"], d[col], left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, d[col])]
    for y, v in enumerate(d["step_ms"]):
        ax.text(v, y, f" {v:.0f} ms", va="center", fontsize=8)
    for graphed, style, label in ((False, "--", "single GPU"), (True, ":", "single GPU, CUDA graph")):
        single = d.loc[(d["mode"] == "single") & (captured == graphed), "step_ms"]
        if len(single):
            ax.axvline(single.iloc[0], ls=style, color="k", lw=1, label=label)
    ax.set_xlim(0, float(d["step_ms"].max()) * 1.12)  # room for the labels
    ax.invert_yaxis()
    ax.set_xlabel("time per training step (ms)")
    ax.set_title(title, loc="left")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_bucket_sweep(df: Any, title: str = "") -> Any:
    """Step time vs bucket size (bucketed rows), with single-GPU and torch DDP as reference lines."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(7, 4))
    sweep = df[df["mode"] == "bucketed"].assign(cuda_graph=_captured(df))
    style = "cuda_graph" if sweep["cuda_graph"].nunique() > 1 else None
    sns.lineplot(data=sweep, x="bucket_size_mb", y="step_ms", hue="comm_dtype", style=style, marker="o", ax=ax)
    for mode, style in (("single", "--"), ("torch", ":")):
        for _, r in df[df["mode"] == mode].iterrows():
            ax.axhline(r["step_ms"], ls=style, color="gray", lw=1)
            ax.annotate(r["variant"], (sweep["bucket_size_mb"].min() if len(sweep) else 1, r["step_ms"]), fontsize=8,
                        va="bottom", color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("time per step (ms)")
    ax.set_title(title, loc="left")
    fig.tight_layout()
    return fig


#: The notebook sections the DDP benchmark publishes to: the modes each one presents (the first two
#: must have been run for the section to be written) and the variants whose timelines it shows.
NOTEBOOK_SECTIONS: dict[str, tuple[list[str], list[str]]] = {
    "naive_ddp": (["single", "naive", "torch"], []),
    "ddp_flat": (["single", "flat", "torch", "naive"], ["flat"]),
    "ddp_overlap_individual": (["single", "individual", "torch", "naive", "flat"], ["naive", "flat", "individual"]),
    "ddp_bucketed": (["single", "bucketed", "torch", "naive", "flat", "individual"], []),
}
STEP_COLUMNS = ["variant", "num_buckets", "step_ms", "step_ms_median", "fwd_bwd_ms", "sync_ms", "optimizer_ms", "overhead_ms", "vs_single"]


def sections_for(modes: list[str]) -> list[str]:
    """Notebook sections a run with these modes can fill (their two required modes were run)."""
    return [sec for sec, (shown, _) in NOTEBOOK_SECTIONS.items() if set(shown[:2]) <= set(modes)]


def write_section(out: Any, result: dict[str, Any], cfg: DDPBenchConfig, *, name: str = "steps",
                  modes: list[str] | None = None, timelines: list[str] | None = None) -> dict[str, Any]:
    """Write one section's artefacts from a benchmark result (CLI and notebooks share this).

    ``<name>_<preset>_<autocast>``: the step table (rows of ``modes``; all if ``None``) and its figure; a
    ``bucket_sweep_*`` figure when several bucket sizes ran; ``timeline_*`` (table and figure) and
    ``overlap_*`` for the profiled variants in ``timelines``; ``allreduce_*`` and, with a bucket sweep,
    ``overhead_model_*`` (table, JSON, figure: the fitted model against the measured overheads);
    ``toy_equivalence_*``. Returns the frames and figures (figures are left open for notebooks to show).
    """
    import pandas as pd

    from cs336_systems.benchmarking import ddp_overhead_model as overhead_model  # noqa: F401 (module alias)

    tag = f"{cfg.preset}_{cfg.autocast}"

    def label(kind: str) -> str:  # "timeline_xl_fp32" for the main run, "bf16comm_timeline_xl_fp32" for others
        return f"{kind}_{tag}" if name == "steps" else f"{name}_{kind}_{tag}"

    title = f"{cfg.preset}, {cfg.autocast}, {cfg.batch_per_rank}x{cfg.context_length} tokens per rank"
    df = pd.DataFrame(result["rows"])
    if modes is not None:
        df = df[df["mode"].isin(modes)].reset_index(drop=True)
    written: dict[str, Any] = {"steps": df}
    out.table(df, f"{name}_{tag}")
    written["steps_figure"] = plot_steps(df, title)
    out.figure(written["steps_figure"], f"{name}_{tag}")
    sweep = df[df["mode"] == "bucketed"]
    if len(sweep) > 1:
        written["bucket_sweep_figure"] = plot_bucket_sweep(df, title)
        out.figure(written["bucket_sweep_figure"], label("bucket_sweep"))
    timeline = pd.DataFrame(result.get("timeline") or [])
    if len(timeline) and timelines:
        timeline = timeline[timeline["variant"].isin(timelines) | timeline["variant"].map(lambda v: v.split(" (")[0] in timelines)]
    if len(timeline) and (timelines is None or timelines):
        written["timeline"] = timeline
        written["overlap"] = overlap_summary(timeline)
        out.table(timeline, label("timeline"), floatfmt=".4f")
        out.table(written["overlap"], label("overlap"))
        written["timeline_figure"] = plot_timeline(timeline)
        out.figure(written["timeline_figure"], label("timeline"))
    if result.get("equivalence"):
        written["equivalence"] = eq = pd.DataFrame(result["equivalence"])
        if modes is not None:
            eq = written["equivalence"] = eq[eq["variant"].map(lambda v: v.split(" (")[0] in modes)]
        if len(eq):
            out.table(eq, label("toy_equivalence"))
    if result.get("allreduce"):
        written["allreduce"] = allreduce = pd.DataFrame(result["allreduce"])
        out.table(allreduce, label("allreduce"))
        if len(sweep) > 1 and allreduce["size_bytes"].nunique() > 1:
            try:
                table, fitted = overhead_model.compare_with_sweep(df, allreduce)
            except ValueError as e:  # e.g. noisy CPU timings that do not grow with size
                written["overhead_fit_error"] = str(e)
                print(f"overhead model not fitted: {e}")
                return written
            written["overhead_model"], written["overhead_fit"] = table, fitted
            out.table(table, label("overhead_model"))
            out.json(fitted, label("overhead_model"))
            written["overhead_model_figure"] = plot_overhead_model(table, fitted, title)
            out.figure(written["overhead_model_figure"], label("overhead_model"))
    return written


def plot_overhead_model(table: Any, fitted: dict[str, float], title: str = "") -> Any:
    """Measured overhead (step − single) and the model's ``s/(n_b w) + n_b o`` against bucket size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for comm, grp in table.groupby("comm_dtype"):
        grp = grp.sort_values("bucket_size_mb")
        line, = ax.plot(grp.bucket_size_mb, grp.overhead_ms, "o-", label=f"measured, {comm} gradients")
        ax.plot(grp.bucket_size_mb, grp.predicted_overhead_ms, "s--", color=line.get_color(), alpha=0.7,
                label=f"model, {comm}")
    ax.axvline(fitted["optimal_bucket_size_mb"], color="gray", ls=":", label="model optimum (fp32)")
    ax.set(xscale="log", xlabel="bucket size (MiB)", ylabel="overhead vs single device (ms)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_results(result: dict[str, Any], cfg: DDPBenchConfig, name: str, sections: list[str] | None = None) -> Any:
    """CLI output: everything into :data:`SECTION` (``figures/ddp_benchmark/``), plus each notebook
    section the run covers (``sections``, default :func:`sections_for`), so the notebooks and the
    writeup find GPU results where they look for them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cs336_systems.results import ResultWriter

    # NCCL's environment (channel and CTA limits, protocols, NVLS) changes what a collective costs and
    # how much it slows the compute it overlaps with, so it is part of a result's parameters.
    params = {**asdict(cfg), "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}}
    written = write_section(ResultWriter(SECTION, params=params), result, cfg, name=name)
    plt.close("all")
    for section in sections if sections is not None else sections_for(cfg.modes):
        shown, timelines = NOTEBOOK_SECTIONS.get(section, (None, None))
        write_section(ResultWriter(section, params=params), result, cfg, name=name, modes=shown, timelines=timelines)
        plt.close("all")
        print(f"wrote {section}/{name}_{cfg.preset}_{cfg.autocast}")
    df = written["steps"]
    print(df[STEP_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if "overhead_fit" in written:
        print("overhead model:", {k: round(v, 3) for k, v in written["overhead_fit"].items()})
    print(ResultWriter(SECTION, params=params).banner())
    return df


def add_run_arguments(parser: Any, *, modes_default: list[str]) -> None:
    """The options every DDP step command takes (this tool's and the course-style naive DDP script's)."""
    parser.add_argument("--mode", nargs="+", default=modes_default, choices=list(ALL_MODES),
                        help="strategies to time (single = one GPU, torch = torch DDP)")
    parser.add_argument("--bucket-size-mb", nargs="+", type=float, default=[DEFAULT_BUCKET_SIZE_MB],
                        help="bucket sizes (MiB) for --mode bucketed")
    parser.add_argument("--comm-dtype", nargs="+", default=["fp32"], choices=list(_COMM_DTYPES),
                        help="gradient wire format(s) for the communicating modes")
    parser.add_argument("--preset", default=None, help="model preset (default xl; tiny in smoke runs)")
    parser.add_argument("--autocast", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (1 in smoke runs)")
    parser.add_argument("--steps", type=int, default=None, help="default 10 (2 in smoke runs)")
    parser.add_argument("--profile", nargs="*", default=[], help="modes or variant labels to trace with torch.profiler")
    parser.add_argument("--nproc", type=int, default=2, help="local processes to spawn when not under torchrun/srun")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with GPUs, else gloo")
    parser.add_argument("--sections", nargs="*", default=None,
                        help=f"notebook sections to publish to besides figures/{SECTION}/ (default: every one the modes cover)")
    parser.add_argument("--name", default="steps", help="table/figure name prefix")
    parser.add_argument("--allreduce-sizes", nargs="*", default=[],
                        help="also time all-reduces of these sizes (e.g. 1MB 10MB 100MB) for the overhead model")
    parser.add_argument("--grad-views", choices=["off", "on", "both"], default="off",
                        help="flat/bucketed: keep .grad as views of the bucket buffers (gradient_as_bucket_view); "
                             "'both' runs each setting side by side")
    parser.add_argument("--cuda-graph", choices=["off", "on", "both"], default="off",
                        help="capture each variant's whole step in a CUDA graph and time its replays (GPU only); "
                             "'both' runs eager and captured side by side")
    parser.add_argument("--attention", default="naive",
                        help="attention implementation of the model (naive, sdpa, or a registered flash kernel)")
    parser.add_argument("--check-toy", action="store_true",
                        help="first check every strategy against single-process training on the toy model")


def configs_from_args(args: Any) -> list[DDPBenchConfig]:
    """One config per ``--autocast`` value; smoke runs (no GPU) shrink the model and the step counts."""
    from cs336_systems.results import is_smoke_run

    smoke = is_smoke_run()
    preset = args.preset or ("tiny" if smoke else "xl")
    context = args.context_length or (get_config(preset).context_length if smoke else 512)
    cfgs = []
    for ac in args.autocast:
        cfg = DDPBenchConfig(
            preset=preset, context_length=context, batch_per_rank=args.batch_per_rank, autocast=ac,
            modes=list(args.mode), bucket_sizes_mb=list(args.bucket_size_mb), comm_dtypes=list(args.comm_dtype),
            warmup=args.warmup if args.warmup is not None else (1 if smoke else 3),
            steps=args.steps if args.steps is not None else (2 if smoke else 10),
            profile=list(args.profile),
            allreduce_sizes=[parse_size(x) for x in args.allreduce_sizes],
            check_toy=args.check_toy,
            attention_impl=args.attention,
            grad_views={"off": [False], "on": [True], "both": [False, True]}[args.grad_views],
            cuda_graph={"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph],
        )
        cfg.validate()
        cfgs.append(cfg)
    return cfgs


def run_from_args(args: Any) -> list[Any]:
    """Run every config on the ranks (spawned or torchrun/srun) and write results from rank 0."""
    from cs336_systems.distributed import runner

    frames = []
    for cfg in configs_from_args(args):
        result = run_benchmark(cfg, args.nproc, args.backend)
        if runner.is_main_process():
            frames.append(write_results(result, cfg, args.name, args.sections))
            failed = [r["variant"] for r in result["equivalence"] if not r["ok"]]
            if failed:
                raise RuntimeError(f"strategies that do not match single-process training on the toy model: {failed}")
    return frames


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking ddp_steps --help``."""
    add_run_arguments(parser, modes_default=["naive", "flat", "individual", "bucketed"])
    parser.add_argument("--no-baselines", action="store_true", help="do not add single-GPU and torch DDP runs")


def run_command(args: argparse.Namespace) -> int:
    if not args.no_baselines:  # single and torch DDP, the baselines every strategy is read against
        args.mode = [*BASELINES, *[m for m in args.mode if m not in BASELINES]]
    run_from_args(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking ddp_steps`` (this module's own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking
    return benchmarking(["ddp_steps", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.ddp_steps"))
