"""Optimized-DDP benchmark: time per training step and communication time for each strategy, next to
single-GPU training and ``torch.nn.parallel.DistributedDataParallel`` in the same run.

    python -m cs336_systems.distributed.ddp_benchmark --mode flat individual bucketed --bucket-size-mb 25
    torchrun --nproc-per-node 2 -m cs336_systems.distributed.ddp_benchmark --mode bucketed --bucket-size-mb 1 10 100 1000
    srun -n 2 python -m cs336_systems.distributed.ddp_benchmark --mode individual

Without torchrun/srun it spawns ``--nproc`` local workers. ``single`` and ``torch`` are always added
as baselines unless ``--no-baselines``. Results: ``figures/ddp_benchmark/<name>_<preset>_<autocast>.*``.
"""

from __future__ import annotations

import argparse
import sys

from cs336_systems.distributed.benchmark import BASELINES, add_arguments, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, modes_default=["naive", "flat", "individual", "bucketed"])
    parser.add_argument("--no-baselines", action="store_true", help="do not add single-GPU and torch DDP runs")
    args = parser.parse_args(argv)
    if not args.no_baselines:
        args.mode = [*BASELINES, *[m for m in args.mode if m not in BASELINES]]
    run_from_args(args)
    return 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.distributed.ddp_benchmark"))
