"""Our attention under kernel-option variants, alternating in one process over shapes: the measurement a routing
rule (which kernel runs where: ``gluon_persistent``, ``gluon_backward_min_keys``, ``gluon_min_key_work``, ...) is
decided by.

Why its own entry point: a rule fitted to two grids measured in different jobs compares two machines as much as
two kernels (H200s of one fleet calibrate several percent apart, and short cells move by tens of percent from
round to round), so a rule is decided here instead. Each variant is a set of
:class:`~cs336_systems.attention.options.FlashOptions` fields. At each shape the variants, and any built-in
baseline, run in turn on the same inputs, the order rotating from round to round, each timed by the shapes grid's
protocol (:func:`.flash.shapes.run_shapes`: ``do_bench`` medians, forward and forward+backward). Every time is then
reported over the first variant's with both spreads: a ratio that moves less than the larger spread is no
difference, and the summary counts only the cells that move more. The options switch once per variant and round,
not per call, so launch plans are recorded once per switch and then replay as in a steady run.

    python -m cs336_systems.benchmarking.flash_options_ab \\
        --variant 'persistent={"gluon_persistent": true}' --variant 'one_item={"gluon_persistent": false}' \\
        --shape 8,16,2048 --shape 1,16,12345 --head-dims 128 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from torch import Tensor

from cs336_systems.attention import FlashAttentionTriton, options
from cs336_systems.benchmarking.flash import shapes as flash_shapes
from cs336_systems.benchmarking.flash.sweep import IMPLEMENTATIONS
from cs336_systems.benchmarking.flash_host_overhead import parse_variant


class VariantAttention:
    """``FlashAttentionTriton.apply`` under fixed options. A call made while other options are current (another
    variant ran since) sets them first: one options generation per switch, not per call."""

    def __init__(self, changes: Mapping[str, Any]) -> None:
        self.options = options.FlashOptions(**changes)  # checked here, in one line, before anything runs
        self._generation: int | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        if options.generation() != self._generation:
            options.set_options(self.options)
            self._generation = options.generation()
        return FlashAttentionTriton.apply(q, k, v, is_causal)


@contextlib.contextmanager
def registered(variants: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """The variants as implementations of the shapes grid for the block; the caller's options restored after."""
    taken = sorted(set(variants) & set(IMPLEMENTATIONS))
    if taken:
        raise ValueError(f"variant names {taken} are implementations already; choose others")
    fns = {name: VariantAttention(changes) for name, changes in variants.items()}
    previous = options.current()
    IMPLEMENTATIONS.update(fns)
    try:
        yield
    finally:
        for name in fns:
            IMPLEMENTATIONS.pop(name, None)
        options.set_options(previous)


def run_ab(variants: Mapping[str, Mapping[str, Any]], bhn: Sequence[Sequence[int]], head_dims: Sequence[int],
           dtypes: Sequence[str] = ("bfloat16",), causal: Sequence[bool] = (True, False),
           baselines: Sequence[str] = (), rounds: int = 3, warmup_ms: float = 5, rep_ms: float = 25,
           device: str | None = None) -> pd.DataFrame:
    """One row per cell and pass: each implementation's median ms, its time over the first variant's
    (``vs_<impl>``) and every implementation's spread over the rounds (``spread_<impl>``)."""
    if not variants:
        raise ValueError("at least one variant (NAME=JSON of FlashOptions fields) is needed")
    unknown = [b for b in baselines if b not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"unknown baseline {unknown[0]!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    impls = [*variants, *baselines]
    if len(impls) < 2:
        raise ValueError("an A/B needs two implementations: two variants, or a variant and a baseline")
    with registered(variants):
        long = flash_shapes.run_shapes(bhn, head_dims, dtypes, causal, impls, rounds=rounds, warmup_ms=warmup_ms,
                                       rep_ms=rep_ms, device=device)
    return flash_shapes.shapes_ratio(long, ours=impls[0])


def summarize(ratio: pd.DataFrame, first: str) -> pd.DataFrame:
    """Per implementation and pass, against ``first``: the cells, the geometric mean of its time over the first's,
    and how many cells it was slower or faster in by more than the larger of the two spreads (the rest: level)."""
    rows = []
    for column in (c for c in ratio.columns if c.startswith("vs_") and c != "vs_best"):
        impl = column.removeprefix("vs_")
        for phase, cells in ratio.groupby("pass", sort=False):
            r = cells[column].to_numpy(dtype=float)
            spread = np.fmax(cells[f"spread_{impl}"].to_numpy(dtype=float),
                             cells[f"spread_{first}"].to_numpy(dtype=float))
            ok = np.isfinite(r) & (r > 0)
            moved = np.abs(np.log(r[ok])) > np.log1p(np.nan_to_num(spread[ok]))
            rows.append({"impl": impl, "pass": phase, "cells": int(ok.sum()),
                         f"geomean_over_{first}": float(np.exp(np.log(r[ok]).mean())) if ok.any() else math.nan,
                         "slower": int((moved & (r[ok] > 1)).sum()), "faster": int((moved & (r[ok] < 1)).sum()),
                         "level": int((~moved).sum())})
    return pd.DataFrame(rows)


def _shape(text: str) -> list[int]:
    try:
        shape = [int(x) for x in text.split(",")]
    except ValueError:
        shape = []
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape takes three positive integers batch,heads,seq, got {text!r}")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking flash_options_ab --help``."""
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON", required=True,
                        help="a variant of ours: NAME and the FlashOptions fields it sets (repeatable; the first is "
                             """the reference), e.g. 'one_item={"gluon_persistent": false}'""")
    parser.add_argument("--baseline", default="", help=f"built-ins timed beside them, comma-separated, of "
                                                      f"{', '.join(n for n in IMPLEMENTATIONS if n != 'triton')}")
    parser.add_argument("--shape", action="append", default=None, metavar="B,H,N",
                        help="batch,heads,seq (repeatable; default: the §1.3.2 shapes grid)")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16, float32")
    parser.add_argument("--causal", default="both", choices=["both", "true", "false"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-ms", type=float, default=5)
    parser.add_argument("--rep-ms", type=float, default=25)
    parser.add_argument("--csv", help="write the per-cell table here")


def run_command(args: argparse.Namespace) -> int:
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) != len(args.variant):
        raise ValueError("--variant names must differ")
    try:
        head_dims = [int(d) for d in args.head_dims.split(",") if d]
    except ValueError:
        raise ValueError(f"--head-dims takes comma-separated integers, got {args.head_dims!r}") from None
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("bfloat16", "float16", "float32")]
    if bad or not dtypes or not head_dims:
        raise ValueError(f"--dtypes takes bfloat16, float16 or float32 and --head-dims at least one size, got "
                         f"{args.dtypes!r} and {args.head_dims!r}")
    causal = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    bhn = [_shape(s) for s in args.shape] if args.shape else flash_shapes.SHAPES_BHN
    baselines = [b for b in args.baseline.split(",") if b]
    ratio = run_ab(variants, bhn, head_dims, dtypes, causal, baselines, args.rounds, args.warmup_ms, args.rep_ms)
    first = next(iter(variants))
    shown = [*flash_shapes.SHAPE_KEYS,
             *(c for c in ratio.columns if c.endswith("_ms") or (c.startswith("vs_") and c != "vs_best"))]
    print(f"{args.rounds} alternating rounds; vs_<impl>: its median time over {first}'s (above 1: {first} faster)")
    print(ratio[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(summarize(ratio, first).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.csv:
        ratio.to_csv(args.csv, index=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking flash_options_ab``."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["flash_options_ab", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
