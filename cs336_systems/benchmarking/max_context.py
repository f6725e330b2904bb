"""The longest context each preset trains at on this GPU, with the peak memory of a full training step.

A context "trains" when our training step (:class:`cs336_systems.benchmarking.train_step.TrainStep`:
forward, loss, backward, optimizer step) runs twice without running out of memory. Contexts are searched
by bisection over multiples of ``granularity`` between ``low`` and ``high``; every trial is recorded
(context, fits, peak GiB), so the table shows the boundary, not just the answer.

    python -m cs336_systems.benchmarking.max_context --presets small,medium,large,xl,2.7B --precision bf16 \\
        --attention flash_triton --checkpoint 4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import pandas as pd
import torch

from cs336_systems.benchmarking.end_to_end import PRECISIONS, default_device
from cs336_systems.benchmarking.sweep import free_memory, is_oom
from cs336_systems.benchmarking.train_step import StepSpec, TrainStep, parse_levels
from cs336_systems.configs import get_config


def bisect_longest(fits: Callable[[int], bool], low: int, high: int, granularity: int) -> tuple[int | None, list[int]]:
    """The largest multiple of ``granularity`` in ``[low, high]`` for which ``fits`` holds, assuming it holds
    below some boundary and fails above it; None if even ``low`` fails. Returns it with the contexts tried."""
    if granularity < 1 or low < granularity or high < low:
        raise ValueError(f"need 1 <= granularity <= low <= high, got {granularity}, {low}, {high}")
    lo, hi = low // granularity, high // granularity  # in units of granularity
    tried: list[int] = []

    def ok(units: int) -> bool:
        tried.append(units * granularity)
        return fits(units * granularity)

    if not ok(lo):
        return None, tried
    if ok(hi):
        return hi * granularity, tried
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * granularity, tried


def trial(spec: StepSpec, device: torch.device) -> dict[str, float | bool]:
    """Two training steps at ``spec``: ``fits`` and the peak allocated GiB (NaN on CPU)."""
    free_memory()
    step = None
    try:
        step = TrainStep("ours", spec, device)
        for _ in range(2):
            step.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        return {"fits": True, "peak_GiB": peak}
    except Exception as exc:
        if not is_oom(exc):
            raise
        return {"fits": False, "peak_GiB": float("nan")}
    finally:
        del step
        free_memory()


def longest_contexts(presets: list[str], base: StepSpec, low: int = 256, high: int = 131072,
                     granularity: int = 256, device: torch.device | None = None) -> pd.DataFrame:
    """One row per trial: ``preset``, ``context_length``, ``fits``, ``peak_GiB``, ``longest`` (the answer, on
    every row of its preset)."""
    device = device or default_device()
    rows = []
    for preset in presets:
        get_config(preset)
        results: dict[int, dict] = {}

        def fits(ctx: int, preset: str = preset) -> bool:
            spec = StepSpec(**{**base.__dict__, "preset": preset, "context_length": ctx})
            spec.check()
            results[ctx] = trial(spec, device)
            return bool(results[ctx]["fits"])

        best, tried = bisect_longest(fits, low, high, granularity)
        rows += [{"preset": preset, "context_length": c, **results[c], "longest": best} for c in tried]
    return pd.DataFrame(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking max_context --help``."""
    parser.add_argument("--presets", default="small,medium,large,xl,2.7B")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--checkpoint", default="", help="checkpoint levels, e.g. 4 or 8,2 (empty: off)")
    parser.add_argument("--fused-projections", action="store_true", help="Q/K/V and W1/W3 as one GEMM each")
    parser.add_argument("--low", type=int, default=256)
    parser.add_argument("--high", type=int, default=131072)
    parser.add_argument("--granularity", type=int, default=256)
    parser.add_argument("--csv", help="write every trial here")


def run_command(args: argparse.Namespace) -> int:
    try:
        levels = parse_levels(args.checkpoint)
    except ValueError as exc:
        raise ValueError(f"--checkpoint: {exc}")
    base = StepSpec(batch_size=args.batch_size, precision=args.precision, attention=args.attention, checkpoint=levels,
                    fused_projections=args.fused_projections)
    table = longest_contexts([p for p in args.presets.split(",") if p], base, args.low, args.high, args.granularity)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking max_context`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["max_context", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.max_context"))
