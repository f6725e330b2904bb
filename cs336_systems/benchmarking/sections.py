"""One function per writeup section (§1.1.3–§1.3.1): run the measurements, write tables and figures.

Each ``run_<section>`` takes its parameters as keyword arguments (``None`` = the section's default for
this kind of run), writes every artefact through :class:`~cs336_systems.results.ResultWriter` under the
section's name, and returns the tables it wrote, so the notebook of the same name and the CLI
(``python -m cs336_systems.benchmarking <section>``) produce identical results.

:func:`section_defaults` gives three parameter sets per section: ``full`` (the handout's grid),
``quick`` (the same questions on a grid that fits a few minutes of one GPU) and ``smoke`` (tiny preset,
a few steps: CPU tests and notebook smoke runs). Every sweep takes a time budget and records
configurations it had no time for as "skipped (time budget)" rather than running over.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from ..configs import HANDOUT_SIZES, get_config, memory_breakdown, residual_stream_bytes
from ..plotting import grouped_bars, measured_on, status_heatmap
from ..replot import Derived, write_derived
from ..results import SCRATCH_DIR, ResultWriter, is_smoke_run, provenance
from .attention import HANDOUT_D_MODELS, HANDOUT_SEQ_LENS, benchmark_attention, naive_attention_memory
from .end_to_end import BenchmarkSpec, ModelBenchmark, benchmark_model, default_device
from .mixed_precision import accumulation_experiments, autocast_dtypes
from .sweep import OK, OOM, free_memory, run_sweep, status_grid

SECTIONS = (
    "benchmarking",
    "nsys_profile",
    "mixed_precision",
    "memory_profiling",
    "pytorch_attention",
    "torch_compile",
)

_CPU_NOTE = "GPU-only part skipped: no CUDA device (CPU smoke run)."

# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------

_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "benchmarking": {
        "full": dict(sizes=HANDOUT_SIZES, context_length=512, warmup=5, steps=10,
                     warmup_study=[0, 1, 2, 5], warmup_study_sizes=HANDOUT_SIZES, fresh_process=True,
                     budget_s=600),
        "quick": dict(sizes=HANDOUT_SIZES, context_length=512, warmup=5, steps=10,
                      warmup_study=[0, 1, 2, 5], warmup_study_sizes=["small", "large"], fresh_process=True,
                      budget_s=150),
        "smoke": dict(sizes=["tiny"], context_length=32, warmup=1, steps=2, warmup_study=[0, 1],
                      warmup_study_sizes=["tiny"], fresh_process=False, budget_s=60),
    },
    "nsys_profile": {
        "full": dict(sizes=HANDOUT_SIZES, context_lengths=[128, 256, 512, 1024], warmup=2, steps=5,
                     profile_steps=2, trace_config=("small", 256), budget_s=900),
        "quick": dict(sizes=HANDOUT_SIZES, context_lengths=[128, 256, 512, 1024], warmup=2, steps=3,
                      profile_steps=1, trace_config=("small", 256), budget_s=170),
        "smoke": dict(sizes=["tiny"], context_lengths=[16], warmup=1, steps=1, profile_steps=1,
                      trace_config=("tiny", 16), budget_s=60),
    },
    "mixed_precision": {
        "full": dict(sizes=HANDOUT_SIZES, context_length=512, warmup=5, steps=10, budget_s=600),
        "quick": dict(sizes=HANDOUT_SIZES, context_length=512, warmup=3, steps=5, budget_s=120),
        "smoke": dict(sizes=["tiny"], context_length=32, warmup=1, steps=2, budget_s=60),
    },
    "memory_profiling": {
        "full": dict(size="2.7B", context_lengths=[128, 256, 512], precisions=["fp32", "bf16"],
                     modes=["forward", "train"], budget_s=600),
        "quick": dict(size="2.7B", context_lengths=[128, 256, 512], precisions=["fp32", "bf16"],
                      modes=["forward", "train"], budget_s=200),
        "smoke": dict(size="tiny", context_lengths=[16, 32], precisions=["fp32"], modes=["forward", "train"],
                      budget_s=60),
    },
    "pytorch_attention": {
        "full": dict(d_models=HANDOUT_D_MODELS, seq_lens=HANDOUT_SEQ_LENS, batch_size=8, n_forward=100,
                     n_backward=100, budget_s=900),
        "quick": dict(d_models=HANDOUT_D_MODELS, seq_lens=HANDOUT_SEQ_LENS, batch_size=8, n_forward=100,
                      n_backward=100, budget_s=150),
        "smoke": dict(d_models=[16, 32], seq_lens=[32, 64], batch_size=2, n_forward=3, n_backward=3,
                      budget_s=60),
    },
    "torch_compile": {
        "full": dict(d_models=HANDOUT_D_MODELS, seq_lens=HANDOUT_SEQ_LENS, batch_size=8, n_forward=100,
                     n_backward=100, sizes=HANDOUT_SIZES, context_length=512, warmup=5, steps=10,
                     budget_s=1200),
        "quick": dict(d_models=HANDOUT_D_MODELS, seq_lens=HANDOUT_SEQ_LENS, batch_size=8, n_forward=50,
                      n_backward=50, sizes=["small", "medium", "large"], context_length=512, warmup=3,
                      steps=5, budget_s=330),
        "smoke": dict(d_models=[16], seq_lens=[32], batch_size=2, n_forward=2, n_backward=2, sizes=["tiny"],
                      context_length=32, warmup=1, steps=2, budget_s=60, compile=False),
    },
}


def section_defaults(section: str, kind: str | None = None) -> dict[str, Any]:
    """Default parameters of ``section`` for ``kind`` = ``full`` / ``quick`` / ``smoke``; ``None`` picks
    ``smoke`` on a smoke run (no CUDA or ``CS336_SMOKE=1``) and ``full`` otherwise."""
    if section not in _DEFAULTS:
        raise ValueError(f"unknown section {section!r}; sections: {', '.join(SECTIONS)}")
    kind = kind or ("smoke" if is_smoke_run() else "full")
    if kind not in ("full", "quick", "smoke"):
        raise ValueError(f"kind must be 'full', 'quick' or 'smoke', got {kind!r}")
    return dict(_DEFAULTS[section][kind])


def _params(section: str, kind: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    params = section_defaults(section, kind)
    unknown = set(overrides) - set(params) - {"compile"}
    if unknown:
        raise ValueError(f"unknown parameter(s) for {section}: {sorted(unknown)}; known: {sorted(params)}")
    params.update({k: v for k, v in overrides.items() if v is not None})
    return params


def _deadline_left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _ordered(df: pd.DataFrame, column: str, order: list[Any]) -> pd.DataFrame:
    return df.assign(**{column: pd.Categorical(df[column], categories=list(dict.fromkeys(order)), ordered=True)})


# --------------------------------------------------------------------------------------------------
# §1.1.3 end-to-end benchmarking
# --------------------------------------------------------------------------------------------------


def run_model_in_subprocess(spec: BenchmarkSpec, timeout_s: float = 300) -> dict[str, Any]:
    """Benchmark ``spec`` in a fresh Python process (``python -m cs336_systems.benchmarking model --json``),
    so its first steps pay every one-time cost (CUDA context, cuBLAS handles and heuristics, allocator
    growth) — the only honest way to measure what warm-up steps are for."""
    cmd = [
        sys.executable, "-m", "cs336_systems.benchmarking", "model", "--size", get_config(spec.model).name,
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


def run_benchmarking(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, pd.DataFrame]:
    """§1.1.3: forward and backward time (mean ± std) per size; the warm-up study for 0, 1, 2, 5 warm-up
    steps, each setting in a fresh process (``fresh_process``; smoke runs stay in-process to be quick, so
    their warm-up study only exercises the pipeline)."""
    p = _params("benchmarking", kind, overrides)
    out = out or ResultWriter("benchmarking", params=p)
    deadline = time.monotonic() + p["budget_s"]

    def one(size: str) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode="forward_backward", context_length=p["context_length"],
                             warmup=p["warmup"], steps=p["steps"])
        return benchmark_model(spec)

    timings = run_sweep(one, [{"size": s} for s in p["sizes"]], desc="fwd+bwd timings",
                        budget_s=0.7 * p["budget_s"])
    keep = ["size", "status"] + [c for c in timings.columns if c.startswith(("forward_", "backward_", "total_"))
                                 or c in ("tokens_per_s", "TFLOP_per_s", "peak_memory_GiB")]
    timings = timings[[c for c in keep if c in timings.columns]]
    out.table(timings, "timings", extra={"mode": "forward_backward", "context_length": p["context_length"]})

    def warm(size: str, warmup: int) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode="forward_backward", context_length=p["context_length"], warmup=warmup,
                             steps=p["steps"])
        row = run_model_in_subprocess(spec) if p["fresh_process"] else benchmark_model(spec)
        return {k: v for k, v in row.items() if k.startswith(("forward_", "backward_"))}

    configs = [{"size": s, "warmup": w} for s in p["warmup_study_sizes"] for w in p["warmup_study"]]
    study = run_sweep(warm, configs, desc="warm-up study", budget_s=_deadline_left(deadline))
    out.table(study, "warmup_study")

    ok = timings[timings["status"] == OK]
    if not ok.empty:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        long = pd.concat(
            [ok.assign(phase=ph, mean_ms=ok[f"{ph}_mean_ms"], std_ms=ok[f"{ph}_std_ms"]) for ph in ("forward", "backward")]
        )
        sns.barplot(long, x="size", y="mean_ms", hue="phase", ax=ax)
        for bar, (_, r) in zip(ax.patches, long.iterrows(), strict=False):
            ax.errorbar(bar.get_x() + bar.get_width() / 2, r["mean_ms"], yerr=r["std_ms"], color="black", capsize=3)
        ax.set(ylabel="ms per step (mean ± std)", title=f"Forward and backward time, context {p['context_length']}")
        out.figure(fig, "timings")
        plt.close(fig)
    study_ok = study[study["status"] == OK] if "status" in study else study
    if not study_ok.empty:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        sns.pointplot(study_ok, x="warmup", y="forward_std_ms", hue="size", ax=ax)
        ax.set(yscale="log", ylabel="std of forward time (ms)", title="Variability vs warm-up steps (fresh process)")
        out.figure(fig, "warmup_study")
        plt.close(fig)
    return {"timings": timings, "warmup_study": study}


# --------------------------------------------------------------------------------------------------
# §1.1.4 profiling with torch.profiler (the nsys questions)
# --------------------------------------------------------------------------------------------------


def attention_flops(cfg: Any, batch_size: int, context_length: int) -> dict[str, float]:
    """Forward FLOPs of one layer's attention core: the two ``seq × seq`` matmuls (2·b·s²·d each) and the
    softmax (≈5 per score: max, subtract, exp, sum, divide)."""
    b, s, d, h = batch_size, context_length, cfg.d_model, cfg.num_heads
    return {"matmul_flops": 2 * 2 * b * s * s * d, "softmax_flops": 5 * b * h * s * s}


def run_nsys_profile(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, pd.DataFrame]:
    """§1.1.4 with torch.profiler: per size × context, the profiled forward time vs the Python timing, the
    top forward kernel and its calls per forward, matmul share in the forward pass vs a full AdamW step,
    and softmax vs matmul time inside attention against their FLOPs."""
    from ..profiling import category_shares, export_chrome_trace, kernel_table, profile_steps

    p = _params("nsys_profile", kind, overrides)
    out = out or ResultWriter("nsys_profile", params=p)
    top_rows: list[pd.DataFrame] = []
    models: dict[str, Any] = {}
    max_ctx = max(p["context_lengths"])

    def one(size: str, context_length: int) -> dict[str, Any]:
        if size not in models:  # one model per size, built for the longest context, reused
            models.clear()
            free_memory()
            models[size] = ModelBenchmark(BenchmarkSpec(size, mode="inference", context_length=max_ctx)).model
        model = models[size]
        spec = BenchmarkSpec(size, mode="forward", context_length=context_length, warmup=p["warmup"], steps=p["steps"])
        fwd_bench = ModelBenchmark(spec, model)
        python_fwd = fwd_bench.run()["forward"]
        train = ModelBenchmark(spec.replace(mode="train"), model)
        n = p["profile_steps"]
        prof = profile_steps(train.step, warmup=1, steps=n)
        del train
        if (size, context_length) == tuple(p["trace_config"]):
            export_chrome_trace(prof, SCRATCH_DIR / "traces" / f"{size}_ctx{context_length}_train.json")
        fwd = kernel_table(prof, "forward", per=n)
        step = kernel_table(prof, "step", per=n)
        scores = kernel_table(prof, "computing attention scores", per=n)["total_ms"].sum()
        final = kernel_table(prof, "final matmul", per=n)["total_ms"].sum()
        softmax = kernel_table(prof, "computing softmax", per=n)["total_ms"].sum()
        for name, table in (("forward", fwd), ("step", step)):
            top_rows.append(table.head(10).assign(size=size, context_length=context_length, range=name,
                                                  rank=range(1, min(10, len(table)) + 1)))
        cfg = get_config(size)
        flops = attention_flops(cfg, cfg.batch_size, context_length)
        top = fwd.iloc[0] if not fwd.empty else None
        non_matmul = fwd[fwd["category"] != "matmul"]
        return {
            "python_forward_ms": python_fwd.mean * 1e3,
            "python_forward_std_ms": python_fwd.std * 1e3,
            "profiled_forward_kernels_ms": fwd["total_ms"].sum(),
            "profiled_step_kernels_ms": step["total_ms"].sum(),
            "top_forward_kernel": top["name"] if top is not None else "",
            "top_kernel_calls_per_forward": top["calls"] if top is not None else math.nan,
            "top_kernel_percent": top["percent"] if top is not None else math.nan,
            "top_non_matmul_kernel": non_matmul.iloc[0]["name"] if not non_matmul.empty else "",
            "top_non_matmul_percent": non_matmul.iloc[0]["percent"] if not non_matmul.empty else math.nan,
            "matmul_percent_forward": category_shares(fwd).get("matmul", 0.0),
            "matmul_percent_train_step": category_shares(step).get("matmul", 0.0),
            "attention_matmul_ms": scores + final,
            "attention_softmax_ms": softmax,
            "softmax_to_matmul_time": softmax / (scores + final) if scores + final else math.nan,
            "softmax_to_matmul_flops": flops["softmax_flops"] / flops["matmul_flops"],
        }

    configs = [{"size": s, "context_length": c} for s in p["sizes"] for c in p["context_lengths"]]
    summary = run_sweep(one, configs, desc="profiling", budget_s=p["budget_s"])
    models.clear()
    free_memory()
    out.table(summary, "summary", extra={"profiler": "torch.profiler", "ranges": "forward / step (fwd+bwd+AdamW)"})
    top = pd.concat(top_rows, ignore_index=True) if top_rows else pd.DataFrame()
    if not top.empty:
        top = top[["size", "context_length", "range", "rank", "name", "calls", "total_ms", "avg_us", "percent", "category"]]
    out.table(top, "top_kernels")
    ok = summary[summary["status"] == OK]
    if not ok.empty:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        long = pd.concat([
            ok.assign(where="forward", matmul_percent=ok["matmul_percent_forward"]),
            ok.assign(where="train step", matmul_percent=ok["matmul_percent_train_step"]),
        ])
        long["config"] = long["size"] + "/" + long["context_length"].astype(str)
        sns.barplot(long, x="config", y="matmul_percent", hue="where", ax=ax)
        ax.tick_params(axis="x", rotation=60)
        ax.set(ylabel="% of GPU kernel time in matmuls", xlabel="size / context")
        out.figure(fig, "matmul_share")
        plt.close(fig)
    return {"summary": summary, "top_kernels": top}


# --------------------------------------------------------------------------------------------------
# §1.1.5 mixed precision
# --------------------------------------------------------------------------------------------------


def run_mixed_precision(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, pd.DataFrame]:
    """§1.1.5: the accumulation loops, ToyModel dtypes under fp16 autocast, fp32 vs bf16 timings."""
    p = _params("mixed_precision", kind, overrides)
    out = out or ResultWriter("mixed_precision", params=p)
    acc = accumulation_experiments()
    out.table(acc, "accumulation", floatfmt=".6f")
    dtypes, info = autocast_dtypes(torch.float16)
    out.table(dtypes, "toy_model_dtypes", extra=info)

    def one(size: str, precision: str) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode="forward_backward", context_length=p["context_length"], warmup=p["warmup"],
                             steps=p["steps"], precision=precision)
        row = benchmark_model(spec)
        return {k: v for k, v in row.items() if k.startswith(("forward_", "backward_")) or k == "peak_memory_GiB"}

    configs = [{"size": s, "precision": pr} for s in p["sizes"] for pr in ("fp32", "bf16")]
    timings = run_sweep(one, configs, desc="fp32 vs bf16", budget_s=p["budget_s"])
    out.table(timings, "precision_timings")
    speedup = pd.DataFrame()
    ok = timings[timings["status"] == OK]
    if not ok.empty and set(ok["precision"]) >= {"fp32", "bf16"}:
        wide = ok.pivot(index="size", columns="precision", values=["forward_mean_ms", "backward_mean_ms"])
        speedup = pd.DataFrame({
            "forward_fp32_ms": wide[("forward_mean_ms", "fp32")],
            "forward_bf16_ms": wide[("forward_mean_ms", "bf16")],
            "backward_fp32_ms": wide[("backward_mean_ms", "fp32")],
            "backward_bf16_ms": wide[("backward_mean_ms", "bf16")],
        }).dropna()
        speedup["forward_speedup"] = speedup["forward_fp32_ms"] / speedup["forward_bf16_ms"]
        speedup["backward_speedup"] = speedup["backward_fp32_ms"] / speedup["backward_bf16_ms"]
        speedup = speedup.reindex([s for s in p["sizes"] if s in speedup.index]).reset_index()
        out.table(speedup, "bf16_speedup")
        fig, ax = plt.subplots(figsize=(7, 3.5))
        long = speedup.melt(id_vars="size", value_vars=["forward_speedup", "backward_speedup"], var_name="phase",
                            value_name="speedup")
        sns.barplot(long, x="size", y="speedup", hue="phase", ax=ax)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set(ylabel="fp32 time / bf16 time", title="bf16 autocast speed-up")
        out.figure(fig, "bf16_speedup")
        plt.close(fig)
    return {"accumulation": acc, "toy_model_dtypes": dtypes, "toy_model_dtypes_info": info,
            "precision_timings": timings, "bf16_speedup": speedup}


# --------------------------------------------------------------------------------------------------
# §1.1.6 memory profiling
# --------------------------------------------------------------------------------------------------


def residual_stream_check(size: str, batch_size: int, context_length: int, precision: str = "fp32",
                          device: torch.device | None = None, model: Any = None) -> dict[str, Any]:
    """The residual-stream activation ``(batch, seq, d_model)`` size from the formula
    (:func:`~cs336_systems.configs.residual_stream_bytes`) next to a tensor measured in a real forward
    pass: the output of the first block, captured by a forward hook."""
    spec = BenchmarkSpec(size, mode="inference", context_length=context_length, batch_size=batch_size,
                         precision=precision, device=str(device) if device else None)
    bench = ModelBenchmark(spec, model)
    captured: dict[str, torch.Tensor] = {}
    hook = bench.model.layers[0].register_forward_hook(lambda m, i, o: captured.setdefault("out", o))
    try:
        bench.step()
    finally:
        hook.remove()
    t = captured["out"]
    dtype = str(t.dtype).removeprefix("torch.")
    predicted = residual_stream_bytes(size, batch_size, context_length, dtype)
    return {
        "shape": list(t.shape), "dtype": dtype, "measured_bytes": t.numel() * t.element_size(),
        "predicted_bytes": predicted, "predicted_MiB": predicted / 2**20,
        "formula": f"batch × seq × d_model × bytes = {batch_size} × {context_length} × {get_config(size).d_model} "
                   f"× {t.element_size()}",
    }


def run_memory_profiling(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, Any]:
    """§1.1.6: memory snapshots of one forward pass (autograd on) and one full AdamW step for the 2.7B
    model at several contexts, fp32 and bf16: timelines, peaks, largest allocations, and the residual-stream
    size derivation checked against a measured tensor."""
    from ..profiling import largest_allocations, plot_active_memory_timeline, record_memory_snapshot

    p = _params("memory_profiling", kind, overrides)
    out = out or ResultWriter("memory_profiling", params=p)
    size, device = p["size"], default_device()
    cfg = get_config(size)
    result: dict[str, Any] = {}
    model = ModelBenchmark(BenchmarkSpec(size, mode="inference", context_length=max(p["context_lengths"]))).model
    check = residual_stream_check(size, cfg.batch_size, max(p["context_lengths"]), device=device, model=model)
    out.json(check, "residual_stream")
    result["residual_stream"] = check
    if device.type != "cuda":
        print(f"{_CPU_NOTE} Memory snapshots need the CUDA caching allocator; only the residual-stream "
              "derivation was checked.")
        return result

    snapshots: dict[tuple[str, int, str], dict[str, Any]] = {}

    def one(precision: str, mode: str, context_length: int) -> dict[str, Any]:
        bench = ModelBenchmark(BenchmarkSpec(size, mode=mode, context_length=context_length, precision=precision), model)
        keep_pickle = (precision, mode, context_length) == ("fp32", "train", max(p["context_lengths"]))
        path = SCRATCH_DIR / "memory" / f"{size}_{mode}_{precision}_ctx{context_length}.pickle" if keep_pickle else None
        snap = record_memory_snapshot(bench.step, path, warmup=1, steps=1)
        del bench
        snapshots[(precision, context_length, mode)] = snap
        predicted = memory_breakdown(cfg, cfg.batch_size, context_length)
        sizes_ = {k: predicted[k] for k in ("parameters", "gradients", "optimizer_state", "activations")}
        pred = sizes_["parameters"] + sizes_["activations"] + (
            sizes_["gradients"] + sizes_["optimizer_state"] if mode == "train" else 0)
        return {
            "peak_GiB": snap["summary"]["peak_allocated_bytes"] / 2**30,
            "allocated_before_GiB": snap["summary"]["allocated_before_bytes"] / 2**30,
            "fp32_estimate_GiB": pred / 2**30,
        }

    configs = [{"precision": pr, "mode": m, "context_length": c}
               for pr in p["precisions"] for m in p["modes"] for c in p["context_lengths"]]
    peaks = run_sweep(one, configs, desc="memory snapshots", budget_s=p["budget_s"])
    out.table(peaks, "peak_memory", extra={"forward": "one forward pass with autograd on (activations kept)",
                                           "fp32_estimate": "configs.memory_breakdown (fp32 everything)"})
    result["peak_memory"] = peaks
    for precision in p["precisions"]:
        cells = [(m, c) for m in p["modes"] for c in p["context_lengths"] if (precision, c, m) in snapshots]
        if not cells:
            continue
        fig, axes = plt.subplots(len(p["modes"]), len(p["context_lengths"]), figsize=(6 * len(p["context_lengths"]), 3.6 * len(p["modes"])), squeeze=False)
        for i, m in enumerate(p["modes"]):
            for j, c in enumerate(p["context_lengths"]):
                ax = axes[i][j]
                if (precision, c, m) in snapshots:
                    plot_active_memory_timeline(snapshots[(precision, c, m)], ax=ax, top=6, title=f"{size} {m}, ctx {c}, {precision}")
                else:
                    ax.set_axis_off()
        fig.tight_layout()
        out.figure(fig, f"timeline_{precision}")
        plt.close(fig)
    biggest = pd.DataFrame()
    key = ("fp32", max(p["context_lengths"]), "train")
    if key in snapshots:
        biggest = largest_allocations(snapshots[key], n=20)
        out.table(biggest, "largest_allocations", extra={"config": list(key)})
        from ..profiling.memory import allocations_of_size

        check["allocations_of_residual_size_in_train_step"] = len(
            allocations_of_size(snapshots[key], check["measured_bytes"]))
        out.json(check, "residual_stream")
    result["largest_allocations"] = biggest
    del model
    snapshots.clear()
    free_memory()
    return result


# --------------------------------------------------------------------------------------------------
# §1.2.1 attention at scale, §1.3.1 compiled
# --------------------------------------------------------------------------------------------------


def _attention_grid(p: dict[str, Any], compile: bool, budget_s: float, desc: str) -> pd.DataFrame:
    def one(d_model: int, seq_len: int) -> dict[str, Any]:
        return benchmark_attention(d_model, seq_len, batch_size=p["batch_size"], compile=compile,
                                   n_forward=p["n_forward"], n_backward=p["n_backward"])

    configs = [{"d_model": d, "seq_len": s} for d in p["d_models"] for s in p["seq_lens"]]
    df = run_sweep(one, configs, desc=desc, budget_s=budget_s)
    return df.assign(compiled=compile)


def attention_memory_accounting(grid: pd.DataFrame, batch_size: int) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Predicted (:func:`naive_attention_memory`) vs measured memory before backward for every cell, and the
    accounting of the smallest OOM configuration (or, if nothing ran out of memory, the first sequence
    length predicted not to fit this device)."""
    rows = []
    for _, r in grid.iterrows():
        pred = naive_attention_memory(batch_size, int(r["seq_len"]), int(r["d_model"]), grad_output=True)
        rows.append({"d_model": r["d_model"], "seq_len": r["seq_len"], "status": r["status"],
                     "predicted_MiB": pred["total"] / 2**20,
                     "measured_MiB": r.get("memory_before_backward_MiB", math.nan)})
    table = pd.DataFrame(rows)
    table["measured_over_predicted"] = table["measured_MiB"] / table["predicted_MiB"]
    ooms = grid[grid["status"] == OOM].sort_values(["seq_len", "d_model"])
    if not ooms.empty:
        first = ooms.iloc[0]
        d, s = int(first["d_model"]), int(first["seq_len"])
        source = "smallest configuration that ran out of memory"
    else:
        d = int(grid["d_model"].min())
        capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        s = int(grid["seq_len"].max()) * 2
        if capacity:
            while naive_attention_memory(batch_size, s, d, grad_output=True)["total"] < capacity:
                s *= 2
        source = "no cell ran out of memory; first power-of-two sequence length predicted not to fit" + (
            "" if capacity else " (no GPU: capacity unknown)")
    terms = {k: v / 2**20 for k, v in naive_attention_memory(batch_size, s, d, grad_output=True).items()}
    below = grid[(grid["d_model"] == d) & (grid["seq_len"] < s) & (grid["status"] == OK)].sort_values("seq_len")
    accounting = {"source": source, "d_model": d, "seq_len": s, "batch_size": batch_size, "terms_MiB": terms}
    if not below.empty:
        b = below.iloc[-1]
        measured = float(b.get("memory_before_backward_MiB", math.nan))
        accounting["below"] = {
            "seq_len": int(b["seq_len"]),
            "measured_MiB": None if math.isnan(measured) else measured,
            "predicted_MiB": naive_attention_memory(batch_size, int(b["seq_len"]), d, grad_output=True)["total"] / 2**20,
        }
    return table, accounting


def run_pytorch_attention(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, Any]:
    """§1.2.1: eager attention over d × seq, batch 8, one head: forward/backward time, memory before
    backward, OOM cells, and the memory accounting."""
    p = _params("pytorch_attention", kind, overrides)
    out = out or ResultWriter("pytorch_attention", params=p)
    df = _attention_grid(p, compile=False, budget_s=p["budget_s"], desc="attention grid")
    out.table(df, "timings")
    grids = {
        "forward_ms": status_grid(df, "forward_mean_ms", "d_model", "seq_len"),
        "backward_ms": status_grid(df, "backward_mean_ms", "d_model", "seq_len"),
        "memory_before_backward_MiB": status_grid(df, "memory_before_backward_MiB", "d_model", "seq_len", "{:.0f}"),
    }
    for name, g in grids.items():
        out.table(g, f"grid_{name}", index=True)
    table, accounting = attention_memory_accounting(df, p["batch_size"])
    out.table(table, "memory_accounting")
    out.json(accounting, "oom_accounting")
    write_derived(out, derive_pytorch_attention({"timings": df}, provenance(p, smoke=out.smoke)))
    return {"timings": df, **{f"grid_{k}": g.reset_index() for k, g in grids.items()},
            "memory_accounting": table, "oom_accounting": accounting}


def run_torch_compile(kind: str | None = None, *, out: ResultWriter | None = None, **overrides: Any) -> dict[str, Any]:
    """§1.3.1: the attention grid compiled vs eager (same run), and the whole model compiled vs vanilla for
    a forward pass and a full training step."""
    p = _params("torch_compile", kind, overrides)
    out = out or ResultWriter("torch_compile", params=p)
    compile = p.get("compile", True)
    if not compile:
        print("torch.compile skipped in the smoke run (inductor compilation takes minutes on a small CPU); "
              "eager is benchmarked against eager to exercise the pipeline.")
    deadline = time.monotonic() + p["budget_s"]
    eager = _attention_grid(p, compile=False, budget_s=0.2 * p["budget_s"], desc="attention eager")
    compiled = _attention_grid(p, compile=compile, budget_s=0.3 * p["budget_s"], desc="attention compiled")
    both = pd.concat([eager, compiled], ignore_index=True)
    out.table(both, "attention_timings")
    merged = eager.merge(compiled, on=["d_model", "seq_len"], suffixes=("_eager", "_compiled"))
    ratio = merged[["d_model", "seq_len", "status_eager", "status_compiled"]].copy()
    for ph in ("forward", "backward"):
        e, c = merged.get(f"{ph}_mean_ms_eager"), merged.get(f"{ph}_mean_ms_compiled")
        if e is not None and c is not None:
            ratio[f"{ph}_eager_ms"], ratio[f"{ph}_compiled_ms"], ratio[f"{ph}_speedup"] = e, c, e / c
    out.table(ratio, "attention_speedup")

    def one(size: str, mode: str, compiled: bool) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode=mode, context_length=p["context_length"], warmup=p["warmup"],
                             steps=p["steps"], compile=compiled and compile)
        torch._dynamo.reset()
        compile_start = time.perf_counter()
        row = benchmark_model(spec)
        row["wall_incl_compile_s"] = time.perf_counter() - compile_start
        return {k: v for k, v in row.items() if k.startswith("total_") or k in ("tokens_per_s", "wall_incl_compile_s")}

    configs = [{"size": s, "mode": m, "compiled": c} for s in p["sizes"] for m in ("forward", "train")
               for c in (False, True)]
    model = run_sweep(one, configs, desc="model compiled vs eager", budget_s=_deadline_left(deadline))
    torch._dynamo.reset()  # compiled graphs hold on to the last model's weights
    free_memory()
    out.table(model, "model_timings")
    ok = model[model["status"] == OK]
    speed = pd.DataFrame()
    if not ok.empty and ok["compiled"].nunique() == 2:
        wide = ok.pivot_table(index=["size", "mode"], columns="compiled", values="total_mean_ms")
        speed = wide.rename(columns={False: "eager_ms", True: "compiled_ms"}).dropna().reset_index()
        speed["speedup"] = speed["eager_ms"] / speed["compiled_ms"]
        speed = _ordered(speed, "size", p["sizes"]).sort_values(["size", "mode"]).reset_index(drop=True)
        speed["size"] = speed["size"].astype(str)
        out.table(speed, "model_speedup")
    measured = {"attention_speedup": ratio, "model_speedup": speed}
    write_derived(out, derive_torch_compile(measured, provenance(p, smoke=out.smoke)))
    return {"attention_timings": both, "attention_speedup": ratio, "model_timings": model, "model_speedup": speed}


# --------------------------------------------------------------------------------------------------
# §1.2.1 / §1.3.1 figures (pure functions of the measured tables; redrawn by ``python -m cs336_systems.replot``)
# --------------------------------------------------------------------------------------------------

_GRID_AXES = dict(index="d_model", columns="seq_len")


def _grid_axes(ax: Any, title: str) -> None:
    ax.set(xlabel="sequence length (tokens)", ylabel="d (head dimension)", title=title)


def plot_attention_grid(timings: pd.DataFrame, meta: dict[str, Any] | None = None) -> Any:
    """Heatmaps over (d, sequence length) of eager attention's forward and backward time and the memory in
    use before the backward pass; cells that ran out of memory (or were skipped) are grey and say so."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    panels = (("forward_mean_ms", "forward pass (ms)", "{:.3g}"),
              ("backward_mean_ms", "backward pass (ms)", "{:.3g}"),
              ("memory_before_backward_MiB", "memory before backward (MiB)", "{:,.0f}"))
    for ax, (column, label, fmt) in zip(axes, panels):
        status_heatmap(ax, timings, column, **_GRID_AXES, fmt=fmt, log=True, cmap="viridis", colorbar_label=label)
        _grid_axes(ax, label[0].upper() + label[1:])
    batch = ((meta or {}).get("params") or {}).get("batch_size")
    fig.suptitle(f"Naive attention (eager PyTorch{f', batch {batch}' if batch else ''}, one head, causal), "
                 f"{measured_on(meta)}; colour scales are logarithmic")
    fig.tight_layout()
    return fig


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
        status_heatmap(ax, cells, f"{phase}_speedup", **_GRID_AXES, fmt="{:.2f}x", center=1.0, cmap="RdBu",
                       colorbar_label="speed-up (eager / compiled)")
        _grid_axes(ax, f"Attention {phase}: compiled vs eager")
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


def derive_pytorch_attention(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """Figures of §1.2.1 from its ``timings`` table."""
    return Derived(figures={"attention_grid": (plot_attention_grid(tables["timings"], meta), "timings")})


def derive_torch_compile(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """Figures of §1.3.1 from its ``attention_speedup`` (and, when measured, ``model_speedup``) tables."""
    fig = plot_compile_speedup(tables["attention_speedup"], tables.get("model_speedup"), meta)
    return Derived(figures={"compile_speedup": (fig, "attention_speedup")})


RUNNERS: dict[str, Callable[..., Any]] = {
    "benchmarking": run_benchmarking,
    "nsys_profile": run_nsys_profile,
    "mixed_precision": run_mixed_precision,
    "memory_profiling": run_memory_profiling,
    "pytorch_attention": run_pytorch_attention,
    "torch_compile": run_torch_compile,
}
