"""Where the 8B leaderboard step's time goes on each GPU: ours beside the torch-native reference.

Each rank builds the step of :mod:`~cs336_systems.benchmarking.leaderboard_8b` (ours, or
:meth:`~cs336_systems.benchmarking.leaderboard_8b.StepOptions.reference`), runs ``warmup`` steps, profiles
``steps`` more with ``torch.profiler`` (CUDA activity), and reduces its own trace with
:func:`~cs336_systems.profiling.step_split.overlapped_time_split`: matmul, attention, norms and elementwise,
optimizer, communication where it ran alone, and idle, in ms per step. The profiled steps run slower than the
timed ones (the profiler's own cost), so the split says where the time goes, the leaderboard's step time how much
there is. Without marked ``recompute`` ranges the recomputed blocks' kernels count under their own kinds.

    python -m cs336_systems.benchmarking.leaderboard_split --nproc 2 --checkpoint 1 --checkpoint-blocks 20 \\
        --out split/        # the full shape on two GPUs: split/time_split.csv and split/time_split.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from cs336_systems.benchmarking.leaderboard_8b import LeaderboardShape, StepOptions, build_step, checkpoint_blocks

STACKS = ("ours", "reference")


def profile_split(shape: LeaderboardShape, options: StepOptions, device: torch.device, steps: int = 2,
                  warmup: int = 2) -> pd.DataFrame:
    """This rank's split of the step (ms per step by bucket): ``warmup`` steps, then ``steps`` profiled."""
    from torch.profiler import ProfilerActivity, profile

    from cs336_systems.profiling.step_split import overlapped_time_split

    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    if device.type != "cuda":
        raise ValueError("the time split reads GPU kernels: run it on a GPU")
    step = build_step(shape, options, device)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    return overlapped_time_split(trace, steps)


def _rank_worker(shape: LeaderboardShape, options: StepOptions, steps: int, warmup: int) -> list[dict]:
    from cs336_systems.distributed import launch

    return profile_split(shape, options, launch.current_context().device, steps, warmup).to_dict("records")


def split_on_ranks(shape: LeaderboardShape, options: StepOptions, nproc: int, steps: int = 2,
                   warmup: int = 2) -> pd.DataFrame:
    """:func:`profile_split` on ``nproc`` spawned ranks (or those of ``torchrun``): one row per rank and bucket."""
    from cs336_systems.distributed import runner

    per_rank = runner.run_on_ranks(_rank_worker, 0 if runner.launched_externally() else nproc, shape, options,
                                   steps, warmup)
    return pd.concat([pd.DataFrame(rows).assign(rank=r) for r, rows in enumerate(per_rank)], ignore_index=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    full = LeaderboardShape()
    parser.add_argument("--layers", type=int, default=full.num_layers)
    parser.add_argument("--context", type=int, default=full.context_length)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (FSDP over that many GPUs)")
    parser.add_argument("--checkpoint", default="1", help="checkpoint levels, e.g. 1 (blocks one by one)")
    parser.add_argument("--checkpoint-blocks", default="all", help="how many blocks, from the first: all or a number")
    parser.add_argument("--compile-pointwise", action="store_true", help="ours with RMSNorm, RoPE and SwiGLU's gate "
                        "compiled (as §1.5 runs it)")
    parser.add_argument("--stacks", default=",".join(STACKS), help="ours, reference or both (comma-separated)")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before profiling")
    parser.add_argument("--out", default="", help="folder for time_split.csv and time_split.png")


def run_command(args: argparse.Namespace) -> int:
    from cs336_systems.benchmarking.train_step import parse_levels
    from cs336_systems.profiling.step_split import plot_time_split

    stacks = [s for s in args.stacks.split(",") if s]
    if not stacks or set(stacks) - set(STACKS):
        raise ValueError(f"--stacks takes {', '.join(STACKS)}, got {args.stacks!r}")
    if args.checkpoint_blocks == "plan":
        raise ValueError("--checkpoint-blocks takes all or a number here (the plan's count: leaderboard_8b --plan-only)")
    if args.nproc < 2:
        raise ValueError(f"the split is of the step on several GPUs: --nproc must be >= 2, got {args.nproc}")
    shape = replace(LeaderboardShape(), num_layers=args.layers, context_length=args.context)
    shape.config()
    ours = StepOptions(checkpoint=parse_levels(args.checkpoint),
                       checkpoint_blocks=checkpoint_blocks(args.checkpoint_blocks, None),
                       compile_pointwise=args.compile_pointwise)
    ours.check()
    splits = {}
    for stack in stacks:
        options = ours if stack == "ours" else ours.reference()
        splits[stack] = split_on_ranks(shape, options, args.nproc, args.steps, args.warmup).assign(stack=stack)
    table = pd.concat(splits.values(), ignore_index=True)
    print(table.pivot_table(index="bucket", columns=["stack", "rank"], values="ms_per_step", sort=False)
          .to_string(float_format=lambda v: f"{v:.1f}"))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "time_split.csv", index=False)
        fig = plot_time_split({s: t[t["rank"] == 0] for s, t in splits.items()})
        fig.savefig(out / "time_split.png", dpi=150, bbox_inches="tight")
        print(f"wrote {out / 'time_split.csv'} and {out / 'time_split.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking leaderboard_split``."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["leaderboard_split", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.leaderboard_split"))
