"""Host time that gradient synchronisation adds to a training step, measured without GPUs.

Under bf16 autocast the XL step at 2 × 512 tokens per GPU is launch-bound (``docs/ddp/NOTES.md``). Every
microsecond the host spends in gradient hooks and collective launches then lengthens the step, and
that host cost is what separates our Python hooks from torch DDP's C++ reducer. It depends on the
number of parameters, hooks and collectives, not on their size. This tool therefore keeps XL's structure
and shrinks its widths:

- 48 blocks with the same shape ratios: ``d_ff = 4·d_model``, and a vocabulary whose embedding and LM
  head are as large as an FFN matrix, so each gets a bucket of its own, as in XL;
- the bucket cap scaled by the same factor as the matrices, which gives the 243 buckets XL has at 25 MB;
- one gloo process. Its collectives move a few kilobytes, so a step's time is compute plus host
  bookkeeping, and the difference to the unwrapped model is the synchronisation's host cost.

    python -m cs336_systems.benchmarking.ddp_host_overhead --repeats 4   # writes figures/ddp_benchmark/host_overhead_cpu*

Each variant runs ``steps`` timed steps (median reported) after ``warmup``. Repeats alternate the order
of the variants, because timings on a busy host drift.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from cs336_systems.configs import get_config
from cs336_systems.distributed import launch
from cs336_systems.distributed.ddp_bucketed import DEFAULT_BUCKET_SIZE_MB
from cs336_systems.distributed.grad_sync import DataParallel, size_capped_buckets
from cs336_systems.distributed.strategies import wrap
from cs336_systems.results import ResultWriter

VARIANTS = ("single", "torch", "bucketed", "bucketed (grad views)")
D_MODEL = 64  # d_ff = 4·d_model, one head of 64: XL's matrices at 1/625 of the elements


def scaled_model(preset: str = "xl") -> tuple[torch.nn.Module, float]:
    """A model with ``preset``'s depth and shape ratios at ``D_MODEL`` width, and the bucket cap (MiB)
    that gives it the preset's bucket layout at the default cap."""
    from cs336_basics.model import BasicsTransformerLM

    c = get_config(preset)
    scale = (D_MODEL * 4 * D_MODEL) / (c.d_model * c.d_ff)  # FFN matrix elements, tiny over full
    vocab = max(2, round(c.vocab_size * c.d_model * scale / D_MODEL))
    model = BasicsTransformerLM(vocab, 16, D_MODEL, c.num_layers, 1, 4 * D_MODEL)
    return model, DEFAULT_BUCKET_SIZE_MB * scale


def _time_variant(variant: str, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    module, cap = scaled_model()
    if variant == "single":
        model = module
    elif variant == "torch":
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap)
    else:
        model = wrap(module, "bucketed", bucket_size_mb=cap, gradient_as_bucket_view=variant.endswith("views)"))
    sync = getattr(model, "finish_gradient_synchronization", lambda: None)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    vocab = module.vocab_size
    x = torch.randint(0, vocab, (2, 16))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
        sync()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    ours = isinstance(model, DataParallel)
    buckets = len(model.buckets) if ours else None
    if ours:
        model.reducer.remove_hooks()
    return {"variant": variant, "step_ms_median": statistics.median(times) * 1e3, "num_buckets": buckets,
            "num_params": sum(1 for p in module.parameters() if p.requires_grad)}


def _worker(order: list[str], steps: int, warmup: int) -> list[dict[str, Any]]:
    return [_time_variant(v, steps, warmup, seed=0) for v in order]


def measure(repeats: int = 3, steps: int = 20, warmup: int = 3) -> pd.DataFrame:
    """Median step time of every variant, ``repeats`` times in alternating order (one gloo process per
    repeat); ``overhead_ms`` is the step minus the unwrapped model's step of the same repeat."""
    if repeats < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, steps >= 1, warmup >= 0; got {repeats}, {steps}, {warmup}")
    rows = []
    for r in range(repeats):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        result = launch.spawn(_worker, 1, order, steps, warmup, backend="gloo")[0]
        single = next(row["step_ms_median"] for row in result if row["variant"] == "single")
        rows += [{**row, "repeat": r, "overhead_ms": row["step_ms_median"] - single} for row in result]
    return pd.DataFrame(rows)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per variant: the median over repeats of the step time and of the overhead."""
    out = frame.groupby("variant", sort=False).agg(
        step_ms=("step_ms_median", "median"), overhead_ms=("overhead_ms", "median"),
        num_buckets=("num_buckets", "first"), num_params=("num_params", "first")).reset_index()
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking ddp_host_overhead --help``."""
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="host_overhead_cpu", help="table name under figures/ddp_benchmark/")


def run_command(args: argparse.Namespace) -> int:
    module, cap = scaled_model()
    print(f"XL-structured model at width {D_MODEL}: {len(list(module.parameters()))} parameters, cap {cap:.4f} MiB "
          f"-> {len(size_capped_buckets(list(module.parameters()), cap))} buckets")
    frame = measure(args.repeats, args.steps, args.warmup)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print()
    summary = summarize(frame)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    out = ResultWriter("ddp_benchmark", params={**vars(args), "d_model": D_MODEL, "bucket_cap_mb": cap})
    out.table(frame, args.name)
    out.table(summary, f"{args.name}_summary")
    print(out.banner())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking ddp_host_overhead`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["ddp_host_overhead", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.ddp_host_overhead"))
