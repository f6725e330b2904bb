"""Naive DDP: check it against single-process training, or time it on the Transformer.

    python -m cs336_systems.distributed.naive_ddp_benchmark --model toy            # prints "Naive DDP matches baseline!"
    python -m cs336_systems.distributed.naive_ddp_benchmark --model transformer    # XL: time/step and communication
    torchrun --nproc-per-node 2 -m cs336_systems.distributed.naive_ddp_benchmark --model toy

``--model toy`` trains the course's ToyModel with :class:`DataParallelNaive` on ``--nproc`` ranks and a
single process on the full batch, and exits non-zero if any rank's parameters differ. ``--model
transformer`` times naive DDP next to single-GPU training and torch DDP (the same machinery as
``ddp_benchmark``), writing ``figures/ddp_benchmark/naive_<preset>_<autocast>.*``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed import runner
from cs336_systems.distributed.benchmark import add_arguments, run_from_args
from cs336_systems.distributed.ddp_naive import DataParallelNaive
from cs336_systems.distributed.equivalence import train_and_compare

TOLERANCE = 1e-5


def toy_check_worker(steps: int, global_batch: int, kind: str = "toy") -> dict[str, Any]:
    """Train naive DDP and the single-process reference; time the synchronisation calls."""
    sync_times: list[float] = []

    def timed_finish(model: DataParallelNaive, optimizer: Any) -> None:
        t0 = time.perf_counter()
        model.finish_gradient_synchronization()
        sync_times.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    res = train_and_compare(DataParallelNaive, kind, steps=steps, global_batch=global_batch, after_backward=timed_finish)
    elapsed = time.perf_counter() - t0
    # Every rank must agree with the reference *and* with each other.
    finals: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(finals, res.pop("final"))
    res["ranks_agree"] = all(torch.equal(finals[0], f) for f in finals)
    res["iteration_ms"] = elapsed / steps * 1e3
    res["sync_ms"] = sum(sync_times) / len(sync_times) * 1e3
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["toy", "transformer"], default="toy")
    parser.add_argument("--toy-steps", type=int, default=5)
    parser.add_argument("--toy-batch", type=int, default=16, help="global batch for the toy check")
    add_arguments(parser, modes_default=["single", "torch", "naive"])
    args = parser.parse_args(argv)

    if args.model == "transformer":
        args.name = "naive" if args.name == "steps" else args.name
        run_from_args(args)
        return 0

    results = runner.run_on_ranks(toy_check_worker, args.nproc, args.toy_steps, args.toy_batch, backend=args.backend or "gloo")
    if not runner.is_main_process():
        return 0
    worst = max(r["final_diff"] for r in results)
    print(f"ranks: {len(results)}, steps: {args.toy_steps}, global batch: {args.toy_batch}")
    print(f"time per iteration: {max(r['iteration_ms'] for r in results):.2f} ms, "
          f"communication (gradient all-reduce): {max(r['sync_ms'] for r in results):.2f} ms")
    print(f"max |DDP - single process| over parameters: {worst:.3g}")
    ok = all(r["init_diff"] == 0.0 and r["ranks_agree"] for r in results) and worst < TOLERANCE
    if not ok:
        print("Naive DDP does NOT match the single-process baseline", file=sys.stderr)
        return 1
    print("Naive DDP matches baseline!")
    return 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.distributed.naive_ddp_benchmark"))
