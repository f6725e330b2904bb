"""Which kernels make one stack's training step slower than the other's: a per-kernel table of both.

The §1.4 time split says *which kind* of work our step loses time in (norms and elementwise, host);
this says *which kernels*. Each stack (:class:`~cs336_systems.benchmarking.train_step.TrainStep`) is built
alone (so xl fits), warmed up (compilation happens there), then ``steps`` steps run under
``torch.profiler``. Kernels are grouped by a short name (:func:`short_name`: Inductor's generated
``triton_poi_fused_add_mul_3`` and ``triton_poi_fused_add_mul_7`` are one *kind* of fusion) into
milliseconds and launches per step, in the split's buckets, side by side:

    python -m cs336_systems.benchmarking.step_kernels --preset small --context-length 1024 --batch-size 8 \\
        --compile --attention flash_triton --top 20 --csv .scratch/step_kernels_small.csv

Launches per step is the other half of the story: a compiled step that launches twice the kernels of the
other waits twice as often on the host, which the split books as ``host / idle``. So each stack's host time
to issue a step is measured too (the GPU kept asleep meanwhile), against its kernels' time: a step whose
host time exceeds its GPU time is host-bound. ``--host-profile N`` prints where that host time goes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

import pandas as pd
import torch

from cs336_systems.benchmarking.end_to_end import default_device
from cs336_systems.benchmarking.train_step import StepSpec, TrainStep, add_step_arguments, step_from_args

#: Inductor names a generated kernel after what it fuses and numbers it; the number is not the kind.
_INDUCTOR = re.compile(r"^(triton_(?:poi|red|per|tem|for)_fused_\w*?)_\d+$")


def short_name(name: str, limit: int = 90) -> str:
    """A kernel's kind: Inductor's kernels without their serial number, the others as
    §1.1.4's kernel tables name them (:func:`~cs336_systems.profiling.torch_profiler.short_kernel`: an ATen
    kernel by its functors, ``vectorized_elementwise_kernel<FillFunctor>``), cut to ``limit``."""
    from cs336_systems.profiling.torch_profiler import short_kernel

    match = _INDUCTOR.match(str(name))
    text = match.group(1) if match else short_kernel(name, limit=10_000)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def kernel_summary(records: pd.DataFrame, steps: int, optimizer_intervals: list[tuple[float, float]] = ()
                   ) -> pd.DataFrame:
    """Per (bucket, kernel kind): ``ms_per_step``, ``launches_per_step`` and ``us_per_launch``, the largest
    first, from :func:`~cs336_systems.profiling.torch_profiler.kernel_records` of ``steps`` steps."""
    from cs336_systems.profiling.step_split import _OPTIMIZER, bucket

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    columns = ["bucket", "kernel", "ms_per_step", "launches_per_step", "us_per_launch"]
    if records.empty:
        return pd.DataFrame(columns=columns)
    in_optimizer = records["name"].str.contains(_OPTIMIZER)
    for start, end in optimizer_intervals:
        in_optimizer |= records["launch_us"].between(start, end)
    table = records.assign(bucket=records["name"].map(bucket).where(~in_optimizer, "optimizer"),
                           kernel=records["name"].map(short_name))
    out = table.groupby(["bucket", "kernel"], as_index=False).agg(us=("duration_us", "sum"),
                                                                 launches=("duration_us", "size"))
    out["ms_per_step"] = out["us"] / 1e3 / steps
    out["launches_per_step"] = out["launches"] / steps
    out["us_per_launch"] = out["us"] / out["launches"]
    return out.sort_values("ms_per_step", ascending=False, ignore_index=True)[columns]


#: GPU sleep under a host measurement: far longer than the host takes to issue a few steps of any preset.
HOST_SLEEP_S = 2.0


def host_ms_per_step(step: Callable[[], object], steps: int, device: torch.device) -> tuple[float, bool]:
    """CPU milliseconds to issue one step, and whether the host waited on the GPU while issuing them.

    On a GPU, the steps are queued behind a long ``torch.cuda._sleep``, so they cost only their host work,
    unless something in them synchronizes, or they launch more kernels than the launch queue holds (about a
    thousand: one step of a small model, not of xl): then ``waited`` is set and the time includes the wait.
    On a CPU every step runs where it is issued: the time is the step's."""
    from cs336_systems.benchmarking.flash_host_overhead import issue_seconds

    elapsed, awake = issue_seconds(step, steps, HOST_SLEEP_S)
    # awake already: a synchronization; most of the sleep gone: the launch queue (about a thousand
    # kernels deep) filled, and launches blocked until the GPU drained it
    waited = device.type == "cuda" and (awake or elapsed > HOST_SLEEP_S / 2)
    return elapsed * 1e3 / steps, waited


def profile_stack(stack: str, spec: StepSpec, device: torch.device, steps: int = 3,
                  warmup: int = 3, profile_top: int = 0) -> pd.DataFrame:
    """:func:`kernel_summary` of ``steps`` profiled steps of one freshly built stack; its ``attrs`` hold
    :func:`host_ms_per_step` of one unprofiled step (``host_ms``, ``host_waited``) and, with
    ``profile_top``, a cProfile of one more step's host work (``host_profile``: the ``profile_top`` functions
    of most own time, :func:`~cs336_systems.benchmarking.flash_host_overhead.profile_host`)."""
    from torch.profiler import ProfilerActivity, profile

    from cs336_systems.benchmarking.flash_host_overhead import profile_host

    from cs336_systems.profiling.torch_profiler import kernel_records, range_intervals

    run = TrainStep(stack, spec, device)
    try:
        with run.context():
            for _ in range(warmup):
                run.step()
            host_ms, waited = host_ms_per_step(run.step, 1, device)  # one step: the launch queue holds it
            text = profile_host(run.step, 1, profile_top) if profile_top else ""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with run.context(), profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                run.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        table = kernel_summary(kernel_records(prof), steps, range_intervals(prof, "optimizer")).assign(stack=stack)
        table.attrs.update(host_ms=host_ms, host_waited=waited, host_profile=text)
        return table
    finally:
        del run
        torch._dynamo.reset()  # compiled graphs hold the model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def side_by_side(tables: pd.DataFrame) -> pd.DataFrame:
    """Per bucket and stack: milliseconds, launches and distinct kernel kinds per step."""
    return (tables.groupby(["bucket", "stack"])
            .agg(ms_per_step=("ms_per_step", "sum"), launches_per_step=("launches_per_step", "sum"),
                 kinds=("kernel", "nunique"))
            .unstack("stack"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking step_kernels --help``."""
    add_step_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per stack")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--top", type=int, default=15, help="kernel kinds listed per stack and bucket")
    parser.add_argument("--bucket", default="norms & elementwise", help="the bucket whose kernels are listed")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also print a cProfile of each stack's steps, the N functions of most own time")
    parser.add_argument("--csv", help="write every stack's per-kernel table here")


def run_command(args: argparse.Namespace) -> int:
    spec, stacks = step_from_args(args)
    if args.steps < 1 or args.warmup < 0 or args.top < 1 or args.host_profile < 0:
        raise ValueError("--steps and --top must be >= 1, --warmup and --host-profile >= 0")
    device = default_device()
    per_stack = [profile_stack(s, spec, device, args.steps, args.warmup, args.host_profile) for s in stacks]
    tables = pd.concat(per_stack, ignore_index=True)
    print(f"{spec.preset}, context {spec.context_length}, batch {spec.batch_size}, {spec.precision}, "
          f"compile={spec.compile}, ours with {spec.attention}; {args.steps} profiled steps per stack")
    print(side_by_side(tables).to_string(float_format=lambda v: f"{v:.3g}"))
    for stack, table in zip(stacks, per_stack):
        gpu_ms = table["ms_per_step"].sum()
        wait = " (it waited on the GPU: a synchronization, or a full launch queue)" if table.attrs["host_waited"] else ""
        print(f"{stack}: host {table.attrs['host_ms']:.3g} ms to issue a step, GPU kernels {gpu_ms:.3g} ms{wait}")
    for stack, table in zip(stacks, per_stack):
        if table.attrs["host_profile"]:
            print(f"\n{stack}: host profile of one step\n{table.attrs['host_profile']}")
    for stack in stacks:
        mine = tables[(tables["stack"] == stack) & (tables["bucket"] == args.bucket)].head(args.top)
        print(f"\n{stack}: the {len(mine)} largest {args.bucket} kernel kinds")
        print(mine.drop(columns=["stack", "bucket"]).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        tables.to_csv(args.csv, index=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking step_kernels`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["step_kernels", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.step_kernels"))
