"""Command line: ``python -m cs336_systems.benchmarking <command>`` (also installed as ``cs336-bench``).

Commands
  model      one end-to-end benchmark (preset or explicit hyperparameters), optionally profiled
  sweep      a grid of model benchmarks (presets × modes × contexts × precisions), OOM-tolerant
  attention  the §1.2.1 attention grid, eager or compiled
  nsys       ``model`` under Nsight Systems (when ``nsys`` is installed)
  and one command per measuring tool (:data:`TOOLS`, e.g. ``train_step``, ``leaderboard_8b``, ``ddp_steps``),
  each the module of that name's ``add_arguments`` and ``run_command``; ``python -m cs336_systems.benchmarking.TOOL``
  is the same command.

The writeup's sections run through ``python -m cs336_systems.experiments``. Results go through ResultWriter (``figures/<section>/`` on a GPU, ``.scratch/figures/`` on CPU smoke runs,
``CS336_FIGURES_DIR`` overrides). Run ``... <command> --help`` for the options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from .end_to_end import MODES, PRECISIONS


#: Measuring tools by command: the module that declares the tool's options (``add_arguments(parser)``) and
#: runs it (``run_command(args) -> int``). Each validates its values once, as they enter; a bad one is a ValueError.
TOOLS = {
    "train_step": "cs336_systems.benchmarking.train_step",
    "step_kernels": "cs336_systems.benchmarking.step_kernels",
    "max_context": "cs336_systems.benchmarking.max_context",
    "matmul_ceiling": "cs336_systems.benchmarking.matmul_ceiling",
    "optimizer_step": "cs336_systems.benchmarking.optimizer_step",
    "leaderboard_8b": "cs336_systems.benchmarking.leaderboard_8b",
    "leaderboard_split": "cs336_systems.benchmarking.leaderboard_split",
    "flash_accuracy": "cs336_systems.benchmarking.flash_accuracy",
    "flash_host_overhead": "cs336_systems.benchmarking.flash_host_overhead",
    "flash_options_ab": "cs336_systems.benchmarking.flash_options_ab",
    "op_registration": "cs336_systems.benchmarking.op_registration",
    "attention_process_ab": "cs336_systems.benchmarking.attention_process_ab",
    "ddp_steps": "cs336_systems.benchmarking.ddp_steps",
    "ddp_host_overhead": "cs336_systems.benchmarking.ddp_host_overhead",
    "timeline": "cs336_systems.profiling.timeline",
    "split_batch_rounding": "cs336_systems.distributed.split_batch_rounding",
    "calibrate": "cs336_systems.calibration",
}


def _csv(cast: type = str):
    def parse(text: str) -> list[Any]:
        return [cast(x) for x in text.split(",") if x]
    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", "--size", dest="size", default="small",
                   help="model preset (tiny, small, medium, large, xl, 2.7B; --size is the same option)")
    for name in ("d-model", "d-ff", "num-layers", "num-heads", "vocab-size"):
        p.add_argument(f"--{name}", type=int, help="explicit hyperparameter (overrides the preset's)")
    p.add_argument("--mode", choices=MODES, default="forward_backward")
    p.add_argument("--context-length", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--warmup", "-w", type=int, default=5)
    p.add_argument("--steps", "-n", type=int, default=10)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="autocast dtype (fp32 = no autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attention", default="naive", help="attention implementation (registry name)")
    p.add_argument("--nvtx", action="store_true", help="emit NVTX / record_function ranges")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.benchmarking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="one end-to-end benchmark")
    _add_model_args(m)
    m.add_argument("--json", action="store_true", help="print the result row as JSON (last line)")
    m.add_argument("--profile", action="store_true",
                   help="also profile one step: kernels launched and GPU time per phase, and kernel tables")
    m.add_argument("--memory-snapshot", metavar="PICKLE", help="record a CUDA memory snapshot of one step")

    s = sub.add_parser("sweep", help="grid of model benchmarks")
    _add_model_args(s)
    s.add_argument("--presets", "--sizes", dest="sizes", type=_csv(), default=None, help="comma-separated presets")
    s.add_argument("--modes", type=_csv(), default=None)
    s.add_argument("--context-lengths", type=_csv(int), default=None)
    s.add_argument("--precisions", type=_csv(), default=None)
    s.add_argument("--profile", action="store_true",
                   help="also profile one step per cell: kernels launched and GPU time per phase")
    s.add_argument("--section", default="cli_sweep", help="ResultWriter section for the table")
    s.add_argument("--name", default="sweep", help="table name")

    a = sub.add_parser("attention", help="attention grid (§1.2.1)")
    a.add_argument("--d-models", type=_csv(int), default=[16, 32, 64, 128])
    a.add_argument("--seq-lens", type=_csv(int), default=[256, 1024, 4096, 8192, 16384])
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--n-forward", type=int, default=100)
    a.add_argument("--n-backward", type=int, default=100)
    a.add_argument("--impl", default="naive")
    a.add_argument("--compile", action="store_true")
    a.add_argument("--section", default="cli_attention")

    n = sub.add_parser("nsys", help="run `model` under nsys profile")
    n.add_argument("--output", default=".scratch/nsys/benchmark")
    n.add_argument("model_args", nargs=argparse.REMAINDER, help="arguments for the `model` command")

    running = sys.modules.get("__main__")
    for command, module in TOOLS.items():
        # python -m cs336_systems.benchmarking.TOOL runs TOOL as __main__: use that module, not a second copy
        # (a module that registers operators with torch.library may run its top level only once)
        spec = getattr(running, "__spec__", None)
        tool = running if spec is not None and spec.name == module else importlib.import_module(module)
        doc = (tool.__doc__ or "").strip()
        t = sub.add_parser(command, help=doc.split("\n\n")[0].replace("\n", " "), description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        tool.add_arguments(t)
        t.set_defaults(tool=tool)
    return parser


def spec_from_args(args: argparse.Namespace) -> Any:
    from ..configs import get_config
    from .end_to_end import BenchmarkSpec

    cfg = get_config(args.size)
    explicit = {k: getattr(args, k) for k in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size")
                if getattr(args, k) is not None}
    if explicit:
        cfg = cfg.replace(name="custom", **explicit)
    return BenchmarkSpec(cfg, mode=args.mode, context_length=args.context_length, batch_size=args.batch_size,
                         warmup=args.warmup, steps=args.steps, precision=args.precision, compile=args.compile,
                         attention_impl=args.attention)


def _cmd_model(args: argparse.Namespace) -> None:
    from cs336_basics import nvtx

    from .end_to_end import ModelBenchmark, benchmark_model, model_source_id, phase_kernels, spec_row

    nvtx.set_enabled(args.nvtx)
    spec = spec_from_args(args)
    row = {**spec_row(spec), **benchmark_model(spec)}
    if args.profile:
        counts, tables = phase_kernels(ModelBenchmark(spec))
        row.update(counts, model_source=model_source_id())
        for name, table in tables.items():
            if not table.empty:
                print(f"\n== kernels in '{name}' ==\n{table.head(15).to_string(index=False)}", file=sys.stderr)
    if args.memory_snapshot:
        from ..profiling import largest_allocations, record_memory_snapshot

        snap = record_memory_snapshot(ModelBenchmark(spec).step, args.memory_snapshot)
        row["snapshot_peak_GiB"] = snap["summary"]["peak_allocated_bytes"] / 2**30
        print(largest_allocations(snap, n=10).to_string(index=False), file=sys.stderr)
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")


def _cmd_sweep(args: argparse.Namespace) -> None:
    from ..results import ResultWriter
    from .end_to_end import ModelBenchmark, benchmark_model, model_source_id, phase_kernels
    from .sweep import grid, run_sweep

    base = spec_from_args(args)
    axes = dict(size=args.sizes or [args.size], mode=args.modes or [args.mode],
                context_length=args.context_lengths or [args.context_length],
                precision=args.precisions or [args.precision])

    def one(size: str, mode: str, context_length: int | None, precision: str) -> dict[str, Any]:
        model = base.model if size == args.size else size
        spec = base.replace(model=model, mode=mode, context_length=context_length, precision=precision)
        row = benchmark_model(spec)
        if args.profile:
            row.update(phase_kernels(ModelBenchmark(spec))[0], model_source=model_source_id())
        return row

    df = run_sweep(one, grid(**axes), desc="sweep")
    out = ResultWriter(args.section, params=vars(args))
    out.table(df, args.name)
    print(df.to_string(index=False))
    print(f"wrote {out.path(args.name + '.csv')}")


def _cmd_attention(args: argparse.Namespace) -> None:
    from ..results import ResultWriter
    from .attention import benchmark_attention
    from .sweep import grid, run_sweep

    def one(d_model: int, seq_len: int) -> dict[str, Any]:
        return benchmark_attention(d_model, seq_len, batch_size=args.batch_size, impl=args.impl, compile=args.compile,
                                   n_forward=args.n_forward, n_backward=args.n_backward)

    df = run_sweep(one, grid(d_model=args.d_models, seq_len=args.seq_lens), desc="attention")
    out = ResultWriter(args.section, params=vars(args))
    out.table(df, "compiled" if args.compile else "eager")
    print(df.to_string(index=False))


def _cmd_nsys(args: argparse.Namespace) -> None:
    from ..profiling.nsys import NSYS_MISSING, nsys_available, run_nsys

    if not nsys_available():
        print(NSYS_MISSING, file=sys.stderr)
        raise SystemExit(2)
    model_args = [a for a in args.model_args if a != "--"]
    report = run_nsys(["model", *model_args], args.output)
    print(f"wrote {report}; summarise with: nsys stats --report cuda_gpu_kern_sum {report}")


#: Commands that read results or run on the CPU: no GPU calibration before them.
UNCALIBRATED = ("calibrate", "timeline", "ddp_host_overhead", "split_batch_rounding")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in UNCALIBRATED:  # a GPU measurement: calibrate the machine first (run_main: after)
        from cs336_systems.calibration import JOB
        from cs336_systems.results import is_smoke_run

        JOB.begin(is_smoke_run())
    if getattr(args, "tool", None) is not None:
        return int(args.tool.run_command(args) or 0)
    if args.command == "model":
        _cmd_model(args)
    elif args.command == "sweep":
        _cmd_sweep(args)
    elif args.command == "attention":
        _cmd_attention(args)
    elif args.command == "nsys":
        _cmd_nsys(args)
    return 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking"))
