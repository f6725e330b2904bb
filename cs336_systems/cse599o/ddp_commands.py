"""Flags and printout of the CSE599-O DDP scripts; the work itself is the library's.

``benchmark_naive_ddp.py --model toy`` is :func:`cs336_systems.experiments.naive_ddp.main`'s toy check;
every timed run (``--model transformer`` and ``benchmark_optimized_ddp.py``) is
:func:`cs336_systems.benchmarking.ddp_steps.run_benchmark` on the Table 1 model (preset ``large``), fp32, a
few iterations, as the handout asks. Ranks are spawned here (``--nproc``, default one per visible GPU, or
two CPU ranks on gloo without CUDA) unless srun (``-n 2``) or torchrun started them. These runs print their
numbers and write no result files: what they print is what the handout's screenshots show.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch

from cs336_systems.benchmarking.ddp_steps import DDPBenchConfig, run_benchmark
from cs336_systems.cli import EXIT_USAGE
from cs336_systems.configs import get_config
from cs336_systems.distributed import runner
from cs336_systems.distributed.ddp_bucketed import DEFAULT_BUCKET_SIZE_MB
from cs336_systems.distributed.grad_sync import bucket_size_mb_value
from cs336_systems.report.editions import CONSOLE_FOLDER

DEFAULT_PRESET = "large"  # the handout's Table 1: d_model 1280, d_ff 5120, 36 layers, 20 heads
DEFAULT_WARMUP, DEFAULT_STEPS = 2, 5  # "a small number of iterations (e.g., fewer than 10)"
OPTIMIZED_MODES = ("flat", "individual", "bucketed")
#: Strategies whose communication overlaps the backward pass: what they leave after it is what is measured.
OVERLAPPING = ("individual", "bucketed")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (``prog: error: ...``) and exit status 2, like
    every other bad input here; ``--help`` still prints the full usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def default_nproc() -> int:
    """Ranks to spawn when none were started: the staff's single task sees both GPUs, so one rank per
    visible GPU; without CUDA, two CPU ranks (gloo)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn when not under srun -n N or torchrun "
                             "(default: one per visible GPU, else 2 CPU ranks)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl with GPUs, else gloo (the toy check always defaults to gloo)")
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"model preset of the timed runs (default {DEFAULT_PRESET}, the handout's Table 1)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed iterations first")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed iterations (toy: training steps)")
    parser.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank and iteration")
    parser.add_argument("--context-length", type=int, default=None, help="default: the preset's (512 for large)")
    parser.add_argument("--autocast", choices=["fp32", "bf16"], default="fp32", help="compute precision")
    parser.add_argument("--record", metavar="NAME", default=None,
                        help=f"also keep what the run prints as figures/{CONSOLE_FOLDER}/NAME.json with its provenance "
                             "(a CPU run: under .scratch/); the CSE599-O writeup shows it where it asks for a screenshot")


def _parse(parser: OneLineParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check every value before a rank starts, so bad input is one line and exit 2."""
    args = parser.parse_args(argv)
    try:
        args.preset = get_config(args.preset).name
    except ValueError as exc:
        parser.error(str(exc))
    if args.nproc is not None and args.nproc < 2:
        parser.error(f"--nproc must be at least 2 (data parallelism needs two ranks), got {args.nproc}")
    if args.steps < 1 or args.warmup < 0 or args.batch_per_rank < 1:
        parser.error("need --steps >= 1, --warmup >= 0 and --batch-per-rank >= 1")
    if args.record is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", args.record):
        parser.error(f"--record takes a plain name (letters, digits, _ and -), got {args.record!r}")
    if args.context_length is not None and args.context_length < 1:
        parser.error(f"--context-length must be at least 1, got {args.context_length}")
    for size in getattr(args, "bucket_size_mb", []):
        try:
            bucket_size_mb_value(size, "--bucket-size-mb", allow_none=False)  # the one check of a bucket size
        except ValueError as exc:
            parser.error(str(exc))
    if args.nproc is None and not runner.launched_externally():
        args.nproc = default_nproc()
        if args.nproc < 2:
            parser.error(f"only {args.nproc} CUDA device visible and DDP needs two ranks: ask Slurm for two GPUs "
                         "(--gpus-per-node=2), or run on CPU with --backend gloo --nproc 2")
    return args


def naive_main(argv: Sequence[str] | None = None) -> int:
    """``benchmark_naive_ddp.py``: the toy check (exit 1 when DDP differs from one process) or naive DDP
    timed on the Transformer."""
    parser = OneLineParser(prog="benchmark_naive_ddp.py",
                           description="Naive DDP: checked against one process on the ToyModel, or timed on "
                                       "the Table 1 Transformer.")
    parser.add_argument("--model", choices=["toy", "transformer"], default="toy",
                        help="toy: check naive DDP against single-process training; transformer: time it")
    _add_common_arguments(parser)
    args = _parse(parser, argv)
    if args.model == "toy":
        from cs336_systems.experiments import naive_ddp

        toy = ["--model", "toy", "--toy-steps", str(args.steps), "--nproc", str(args.nproc or 2)]
        with _recorded(args, parser.prog, argv) as printed:
            code = naive_ddp.main(toy + (["--backend", args.backend] if args.backend else []))
            printed.ok = code == 0
        return code
    with _recorded(args, parser.prog, argv):
        return time_strategies(args, ["naive"], [])


def optimized_main(argv: Sequence[str] | None = None) -> int:
    """``benchmark_optimized_ddp.py``: flat, individual (overlapping) and bucketed DDP timed on the
    Transformer, each bucket size of ``--bucket-size-mb`` a run of its own."""
    parser = OneLineParser(prog="benchmark_optimized_ddp.py",
                           description="Flat, overlapping (individual) and bucketed DDP timed on the Table 1 "
                                       "Transformer.")
    parser.add_argument("--mode", nargs="+", choices=list(OPTIMIZED_MODES), default=list(OPTIMIZED_MODES),
                        help="strategies to time (default: all three)")
    parser.add_argument("--bucket-size-mb", nargs="+", type=float, default=[DEFAULT_BUCKET_SIZE_MB],
                        help=f"bucket caps in MiB for --mode bucketed, e.g. 1 10 100 1000 "
                             f"(default {DEFAULT_BUCKET_SIZE_MB:g}, torch DDP's)")
    _add_common_arguments(parser)
    args = _parse(parser, argv)
    with _recorded(args, parser.prog, argv):
        return time_strategies(args, list(dict.fromkeys(args.mode)), list(dict.fromkeys(args.bucket_size_mb)))


SHARDING_OPTIMIZERS = {"adamw": "AdamW, replicated state", "sharded": "our ShardedOptimizer(AdamW)",
                       "zero": "torch ZeroRedundancyOptimizer(AdamW)"}


def sharding_main(argv: Sequence[str] | None = None) -> int:
    """``sharding_optimizer.py``: peak memory after initialization, before and after the optimizer step, its
    breakdown, and the time per iteration, with and without optimizer-state sharding (Problem 10)."""
    parser = OneLineParser(prog="sharding_optimizer.py",
                           description="Peak memory and time per iteration with and without optimizer-state "
                                       "sharding, on the Table 1 Transformer.")
    parser.add_argument("--optimizer", nargs="+", choices=list(SHARDING_OPTIMIZERS), default=["adamw", "sharded"],
                        help="optimizers to measure, one after the other (default: adamw sharded)")
    _add_common_arguments(parser)
    args = _parse(parser, argv)
    if args.autocast != "fp32":
        parser.error("the sharding benchmark trains in fp32 (the handout's setting); drop --autocast")
    with _recorded(args, parser.prog, argv):
        return profile_sharding(args, list(dict.fromkeys(args.optimizer)))


def profile_sharding(args: argparse.Namespace, optimizers: list[str]) -> int:
    """Run the optimizer-state sharding benchmark of §3 (``optimizer_state_sharding.sharding_worker``) and print,
    on rank 0, one block per optimizer."""
    from cs336_systems.experiments.optimizer_state_sharding import sharding_worker, summarise

    world = runner.launched_world_size() or args.nproc or 2
    model = get_config(args.preset)
    config = dict(model=args.preset, global_batch=args.batch_per_rank * world,
                  context_length=args.context_length or model.context_length, warmup=args.warmup, steps=args.steps)
    per_rank = runner.run_on_ranks(sharding_worker, 0 if runner.launched_externally() else world, config, optimizers,
                                   backend=args.backend)
    if runner.is_main_process():
        memory, breakdown, timing = summarise([r for rows in per_rank for r in rows])
        print("\n".join(sharding_lines(memory, breakdown, timing, config, world)), flush=True)
    return 0


def sharding_lines(memory: Any, breakdown: Any, timing: Any, config: dict[str, Any], world: int) -> list[str]:
    """Rank 0's peaks at the three points, its memory by component, and the time per iteration (slowest rank)."""
    m = get_config(config["model"])
    lines = [f"{m.name} model (d_model {m.d_model}, d_ff {m.d_ff}, {m.num_layers} layers, {m.num_heads} heads), "
             f"fp32, {world} ranks x {config['global_batch'] // world} sequences of {config['context_length']} "
             f"tokens; mean of {config['steps']} iterations after {config['warmup']} warm-up"]
    step = timing.set_index("optimizer")["step_ms"]

    def size(gib: float) -> str:
        return "n/a" if gib != gib else f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"

    for _, r in memory[memory["rank"] == 0].iterrows():
        name = r["optimizer"]
        parts = breakdown[(breakdown["rank"] == 0) & (breakdown["optimizer"] == name)
                          & (breakdown["source"] == "measured")].set_index("component")["GiB"]
        lines += [f"{SHARDING_OPTIMIZERS[name]}:",
                  f"  peak memory: after initialization {size(r['after_init_peak'])}, directly before the "
                  f"optimizer step {size(r['before_step_peak'])}, directly after it {size(r['after_step_peak'])}",
                  "  rank 0 holds: " + ", ".join(f"{c.replace('_', ' ')} {size(v)}" for c, v in parts.items()),
                  f"  time per iteration: {step[name]:.2f} ms"]
    if memory["after_step_peak"].isna().all():
        lines.append("(peaks and activations need CUDA's allocator statistics: n/a on CPU ranks)")
    return lines


class _Printed(io.TextIOBase):
    """Standard output that also keeps a copy of what passes through it."""

    def __init__(self, out: Any) -> None:
        self.out, self.copy, self.ok = out, io.StringIO(), True

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def _recorded(args: argparse.Namespace, prog: str, argv: Sequence[str] | None) -> Iterator[_Printed]:
    """With ``--record NAME``: what rank 0 prints during the block, kept as a result with provenance (and the
    machine calibrated around it on a GPU), unless the run failed. Without it: nothing but the printing."""
    printed = _Printed(sys.stdout)
    if args.record is None or not runner.is_main_process():
        yield printed
        return
    from cs336_systems.calibration import JOB
    from cs336_systems.results import ResultWriter

    smoke = not torch.cuda.is_available()
    JOB.begin(smoke)
    with contextlib.redirect_stdout(printed):
        yield printed
    if printed.ok:
        words = list(sys.argv[1:] if argv is None else argv)
        command = " ".join([prog, *(w for i, w in enumerate(words) if w != "--record"
                                    and (i == 0 or words[i - 1] != "--record"))])
        out = ResultWriter(CONSOLE_FOLDER, params={**vars(args), "argv": words}, smoke=smoke)
        out.json({"command": command, "lines": printed.copy.getvalue().rstrip("\n").splitlines()}, args.record)


def time_strategies(args: argparse.Namespace, modes: list[str], bucket_sizes_mb: list[float]) -> int:
    """Time ``modes`` with the DDP step benchmark and print, on rank 0, one line per strategy."""
    model = get_config(args.preset)
    cfg = DDPBenchConfig(preset=args.preset, context_length=args.context_length or model.context_length,
                         batch_per_rank=args.batch_per_rank, autocast=args.autocast, modes=modes,
                         bucket_sizes_mb=bucket_sizes_mb or [DEFAULT_BUCKET_SIZE_MB],
                         warmup=args.warmup, steps=args.steps)
    result = run_benchmark(cfg, args.nproc or 2, args.backend)
    if runner.is_main_process():
        print("\n".join(summary_lines(result["rows"], cfg)), flush=True)
    return 0


def summary_lines(rows: list[dict[str, Any]], cfg: DDPBenchConfig) -> list[str]:
    """The readable result: a line saying what ran, then per strategy its time per iteration and its
    gradient communication time with that time's share of the iteration (the slowest rank's means)."""
    m = get_config(cfg.preset)
    world = max((int(r["world_size"]) for r in rows), default=0)
    lines = [(f"{m.name} model (d_model {m.d_model}, d_ff {m.d_ff}, {m.num_layers} layers, {m.num_heads} heads), "
             f"{cfg.autocast}, {world} ranks x {cfg.batch_per_rank} sequences of {cfg.context_length} tokens; "
             f"mean of {cfg.steps} iterations after {cfg.warmup} warm-up")]
    for r in rows:
        step, comm = float(r["step_ms"]), float(r["sync_ms"])
        what = "gradient communication not hidden by backward" if r["mode"] in OVERLAPPING else "gradient communication"
        name = f"{r['mode']} DDP" + (f" ({r['bucket_size_mb']:g} MB buckets)" if r["mode"] == "bucketed" else "")
        lines.append(f"{name}: {step:.2f} ms per iteration, {what} {comm:.2f} ms "
                     f"({comm / step:.1%} of the iteration)")
    if any(r["mode"] in OVERLAPPING for r in rows):
        lines.append("(overlapping strategies all-reduce during backward; the communication shown is the wait "
                     "left after backward ends)")
    return lines

