"""Our kernels one by one at the leaderboard shape: GPU time and TFLOP/s of each kernel per step, the tiles
the autotuner chose and its timing of every candidate (``--candidates wide`` widens them); and the shapes
where we trail cuDNN, profiled kernel by kernel against it."""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from cs336_systems.attention import (
    FlashAttentionTriton,
    flash_triton,
    options,
)
from cs336_systems.benchmarking.timing import do_bench
from cs336_systems.configs import attention_flops
from cs336_systems.profiling.torch_profiler import kernel_table, profile_steps

from .leaderboard import _leaderboard_inputs
from .shapes import SHAPE_CELL
from .sweep import _poly_exp2_label, _record_timing

#: The autotuned kernels whose choices the breakdown records, with their tuning phase.
TUNED_KERNELS = {"flash_forward_kernel": "forward", "flash_backward_dkdv_kernel": "dkdv",
                 "flash_backward_dq_kernel": "dq"}

#: Every tile shape, warp count, stage count and register cap worth trying on Hopper (a minute or more of
#: tuning per shape class): how the library's ``options.DEFAULT_CANDIDATES`` were chosen. Run the kernel
#: breakdown with ``--candidates wide`` and read the winners off its ``best_config`` column.
_T = options.Tile
WIDE_CANDIDATES: dict[str, list[options.Tile]] = {
    "forward": [_T(64, 64, 4, 3), _T(64, 64, 4, 4), _T(64, 128, 4, 3), _T(128, 64, 4, 3), _T(128, 64, 8, 3),
                _T(128, 64, 8, 4), _T(128, 128, 8, 2), _T(128, 128, 8, 3), _T(128, 32, 4, 3), _T(64, 32, 4, 4)],
    "dkdv": [_T(32, 64, 4, 3), _T(32, 64, 4, 5), _T(32, 128, 4, 3), _T(32, 128, 4, 5),
             _T(32, 128, 8, 4), _T(64, 64, 4, 2), _T(64, 64, 4, 3), _T(64, 64, 4, 4), _T(64, 64, 8, 4),
             _T(64, 128, 8, 2), _T(64, 128, 8, 3), _T(128, 128, 8, 2),
             _T(32, 64, 4, 3, maxnreg=168),
             _T(32, 64, 4, 4, maxnreg=168), _T(64, 64, 4, 3, maxnreg=168),
             _T(32, 128, 8, 3, maxnreg=128), _T(64, 64, 4, 3, maxnreg=168, poly=False),
             _T(64, 64, 4, 3, poly=False), _T(32, 64, 4, 3, maxnreg=168, poly=False),
             _T(32, 128, 8, 3, maxnreg=128, poly=False), _T(64, 128, 8, 3, poly=False),
             _T(64, 64, 4, 2, maxnreg=168, poly=False), _T(64, 64, 4, 4, maxnreg=168, poly=False)],
    "dq": [_T(64, 32, 4, 4), _T(64, 64, 4, 3), _T(64, 64, 4, 5), _T(64, 128, 4, 3), _T(128, 32, 4, 3),
           _T(128, 32, 4, 5), _T(128, 64, 4, 3), _T(128, 64, 8, 3), _T(128, 128, 8, 2),
           _T(64, 64, 4, 3, maxnreg=128), _T(128, 64, 8, 3, maxnreg=128), _T(128, 64, 4, 4),
           _T(128, 64, 4, 3, maxnreg=168), _T(128, 128, 8, 3)],
}  # fmt: skip
CANDIDATE_SETS = {"default": None, "wide": WIDE_CANDIDATES}
#: Matmuls per step each kernel issues: forward 2 (S, PV), dK/dV 4 (S, dV, dP, dK), dQ 3 (S, dP, dQ). The
#: Gluon forward (Hopper, one program per item or persistent) replaces the Triton one where it applies.
MATMULS_PER_STEP = {"flash_forward_kernel": 2, "flash_forward_gluon_kernel": 2,
                    "flash_forward_gluon_persistent_kernel": 2, "flash_backward_dkdv_kernel": 4,
                    "flash_backward_dkdv_gluon_kernel": 4, "flash_backward_dkdv_gluon_persistent_kernel": 4,
                    "flash_backward_dq_kernel": 3}
#: The same where the dK/dV kernel also forms dQ (``options.dq_atomic``): the dQ kernel then writes only ``[L; D]``.
MATMULS_PER_STEP_FUSED_DQ = {**MATMULS_PER_STEP, "flash_backward_dkdv_kernel": 5,
                             "flash_backward_dkdv_gluon_kernel": 5, "flash_backward_dkdv_gluon_persistent_kernel": 5,
                             "flash_backward_dq_kernel": float("nan")}


def _config_label(config: Any) -> str:
    """``BLOCK_M x BLOCK_N, w warps, s stages[, maxnreg r][, polynomial exp2]`` for a ``triton.Config``."""
    kw = config.kwargs
    label = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}, {config.num_warps} warps, {config.num_stages} stages"
    maxnreg = getattr(config, "maxnreg", None)
    label = f"{label}, maxnreg {maxnreg}" if maxnreg else label
    return f"{label}, polynomial exp2" if kw.get("POLY_EXP2") else label


def _tuning_state() -> dict[str, Any]:
    """Per tuned kernel, the object holding its latest tuning timings (changes whenever it tunes)."""
    kernels, opts = flash_triton.kernel_module(), options.current()
    return {name: getattr(kernels.tuned(phase, opts), "configs_timings", None) for name, phase in TUNED_KERNELS.items()}


def run_kernel_breakdown(
    batch: int = 16,
    seq_len: int = 16384,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    profiled_steps: int = 5,
    device: str | None = None,
    compile_ours: bool | None = None,
) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """Our kernels on the leaderboard protocol (``torch.compile(Fn.apply)``, causal, ``o.sum().backward()``).

    Returns ``(summary, kernels, tuning)``: ``summary`` holds forward+backward and forward-only times (mean,
    median), TFLOP/s and the tiles each kernel ran with; ``kernels`` has one row per GPU kernel with calls,
    time and share per step (torch.profiler over ``profiled_steps`` steps) and the achieved TFLOP/s of our
    three attention kernels; ``tuning`` has the autotuner's timing of every candidate tile configuration, when
    this call is the one that tuned (first use of the shape class in the process; empty otherwise).
    On CPU this needs ``TRITON_INTERPRET=1`` (tiny shapes only).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compile_ours = device == "cuda" if compile_ours is None else compile_ours
    q, k, v = _leaderboard_inputs(batch, seq_len, head_dim, dtype, device)
    fn = torch.compile(FlashAttentionTriton.apply) if compile_ours else FlashAttentionTriton.apply

    def step() -> None:
        fn(q, k, v, True).sum().backward()

    before = _tuning_state()
    step()  # first use tunes every kernel for this shape class
    after = _tuning_state()
    q.grad = k.grad = v.grad = None

    poly = _poly_exp2_label()
    summary: dict[str, Any] = {"poly_exp2": poly, "batch": batch, "seq_len": seq_len, "head_dim": head_dim,
                               "dtype": dtype, "forward_kernel": flash_triton.forward_kernel_name(q, k, v, True),
                               "backward_kernel": flash_triton.backward_kernel_name(q, k, v)}  # fmt: skip
    _record_timing(summary, "fwd_bwd_sum", lambda: do_bench(step, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                                            grad_to_none=[q, k, v]))  # fmt: skip
    _record_timing(summary, "forward", lambda: do_bench(lambda: fn(q, k, v, True), warmup_ms=warmup_ms,
                                                        rep_ms=rep_ms))  # fmt: skip
    total_flops = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True, phase="forward+backward")
    summary["fwd_bwd_TFLOP_per_s"] = total_flops / (summary["fwd_bwd_sum_ms"] * 1e-3) / 1e12

    kernels = kernel_table(profile_steps(step, warmup=1, steps=profiled_steps), per=profiled_steps)
    summary["profiled_gpu_ms_per_step"] = kernels["total_ms"].sum()
    matmul = attention_flops(batch, seq_len, seq_len, head_dim, is_causal=True) / 2  # one causal product
    fused = options.current().fuses_dq(summary["backward_kernel"].startswith("gluon"))
    kernels["matmuls"] = kernels["name"].map(MATMULS_PER_STEP_FUSED_DQ if fused else MATMULS_PER_STEP)
    kernels["TFLOP_per_s"] = kernels["matmuls"] * matmul / (kernels["total_ms"] * 1e-3) / 1e12
    kernels = kernels.assign(head_dim=head_dim, poly_exp2=poly)

    chosen, opts = flash_triton.kernel_module(), options.current()
    tuning_rows = []
    for name, phase in TUNED_KERNELS.items():
        best = getattr(chosen.tuned(phase, opts), "best_config", None)
        summary[f"config_{name}"] = _config_label(best) if best is not None else ""
        timings = after[name]
        if timings is None or timings is before[name]:
            continue
        for config, times in timings.items():
            median = times[0] if isinstance(times, (list, tuple)) else times
            tuning_rows.append({"head_dim": head_dim, "kernel": name, "config": _config_label(config),
                                "median_ms": median, "chosen": best is config})  # fmt: skip
    tuning = pd.DataFrame(tuning_rows, columns=["head_dim", "kernel", "config", "median_ms", "chosen"])
    return summary, kernels, tuning


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


#: Kernel-name fragments by the phase the kernel serves: ours (``flash_forward*``, ``flash_backward_*``) and
#: cuDNN's (``..._fprop_...``, ``..._bprop_...`` and its backward's pre- and post-passes).
KERNEL_PHASES = (("forward", ("flash_forward", "fprop")),
                 ("backward", ("flash_backward", "bprop", "dot_do_o", "convert_dq")))
#: What the losers part profiles: ours against the backend the shapes grid is judged by.
LOSERS_IMPLS = ("ours", "sdpa_cudnn")


def kernel_phase(name: str) -> str:
    """``forward``, ``backward`` or ``other`` (memsets, copies) for a GPU kernel's name."""
    for phase, fragments in KERNEL_PHASES:
        if any(f in name for f in fragments):
            return phase
    return "other"


def worst_shapes(ratio: pd.DataFrame, column: str = "vs_sdpa_cudnn", count: int = 6,
                 pass_: str = "forward+backward") -> pd.DataFrame:
    """The ``count`` shapes of ``pass_`` where ours loses most (``column``, a backend's time over ours, lowest)."""
    if column not in ratio:
        raise ValueError(f"the shapes table has no {column!r} column (columns: {', '.join(map(str, ratio.columns))})")
    rows = ratio[(ratio["pass"] == pass_) & ratio[column].notna()].sort_values(column).head(count)
    return rows[[*SHAPE_CELL, column]].reset_index(drop=True)


def run_losers(shapes: pd.DataFrame, rounds: int = 3, calls: int = 20) -> pd.DataFrame:
    """GPU µs per forward+backward call of every kernel, ours and cuDNN's, at each shape of ``shapes`` (rows of
    :func:`worst_shapes`; contiguous inputs, as the grid ran), medians over alternating rounds."""
    from cs336_systems.benchmarking import flash_host_overhead

    rows = []
    for _, s in shapes.iterrows():
        shape = (int(s["batch"]), int(s["heads"]), int(s["seq_len"]), int(s["head_dim"]))
        measured = flash_host_overhead.measure(shape, getattr(torch, str(s["dtype"])), bool(s["causal"]),
                                               LOSERS_IMPLS, rounds, calls, kernels=True)
        per_kernel = flash_host_overhead.kernel_table(measured)
        keys = {k: s[k] for k in SHAPE_CELL}
        for impl in per_kernel.columns:
            for name, us in per_kernel[impl].dropna().items():
                rows.append({**keys, "impl": impl, "kernel": name, "phase": kernel_phase(str(name)), "gpu_us": us})
    return pd.DataFrame(rows)


def summarize_losers(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per shape: ours' and cuDNN's GPU µs per phase, the gap (ours - cuDNN) per phase, the phase where ours
    loses most (``loses_most_in``) and ours' slowest kernel."""
    rows = []
    for cell, g in kernels.groupby(SHAPE_CELL, sort=False):
        row: dict[str, Any] = dict(zip(SHAPE_CELL, cell))
        for impl, label in zip(LOSERS_IMPLS, ("ours", "cudnn")):
            mine = g[g["impl"] == impl]
            for phase in ("forward", "backward", "other"):
                row[f"{label}_{phase}_us"] = float(mine.loc[mine["phase"] == phase, "gpu_us"].sum())
            row[f"{label}_total_us"] = float(mine["gpu_us"].sum())
        gaps = {phase: row[f"ours_{phase}_us"] - row[f"cudnn_{phase}_us"] for phase in ("forward", "backward")}
        row.update({f"{phase}_gap_us": gap for phase, gap in gaps.items()})
        row["loses_most_in"] = max(gaps, key=lambda phase: gaps[phase])
        ours = g[g["impl"] == LOSERS_IMPLS[0]]
        row["ours_slowest_kernel"] = str(ours.loc[ours["gpu_us"].idxmax(), "kernel"]) if len(ours) else ""
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------
