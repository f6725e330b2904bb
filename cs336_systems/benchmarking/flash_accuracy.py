"""Error against float64, ours beside SDPA's flash and cuDNN backends, shape by shape.

A faster kernel is no use if it is less accurate than the one it replaces. The goal: at every shape of
the §1.3.2 shapes grid, the error of our O, dQ, dK and dV against a float64 reference stays within 2× of
SDPA's own error at the same dtype (the smaller of its flash and cuDNN backends' errors, so the bar is the
better of the two). All implementations get the same inputs, already rounded to the dtype, so the
reference measures what each kernel adds, not the rounding of its inputs.

The reference is exact attention in float64 over a few heads of each shape (the first and the last),
computed in blocks of query rows (:func:`reference_head`): at 65,536 tokens one head's float64 score
matrix alone would take 32 GiB. The error of an output is its largest absolute difference from the
reference over the heads checked; ``relative`` divides it by the reference's largest magnitude.

    python -m cs336_systems.benchmarking.flash_accuracy                 # the shapes grid, bf16 and fp16
    python -m cs336_systems.benchmarking.flash_accuracy --shape 8,32,256,64 --dtype float16 --no-causal
    python -m cs336_systems.benchmarking.flash_accuracy --csv errors.csv --json summary.json --budget-s 200
    python -m cs336_systems.benchmarking.flash_accuracy --shape 1,16,16384,128 --dtype float16 --no-causal \
        --all-heads --variant 'polyexp={"poly_exp2": "all"}'     # ours with other options, side by side
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cs336_systems.attention.reference import causal_mask
from cs336_systems.benchmarking.flash_host_overhead import _backend, attention_fn, make_inputs, parse_variant
from cs336_systems.benchmarking.sweep import OK, OOM  # the sweeps' status words

IMPLS = ("ours", "sdpa_flash", "sdpa_cudnn")
#: Our PyTorch-tiled FlashAttention-2 (``attention/flash_pytorch.py``): ours where the Triton kernels cannot run
#: (a CPU machine without Triton's interpreter).
OURS_PYTORCH = "flash_pytorch"
BASELINES = ("sdpa_flash", "sdpa_cudnn")
OUTPUTS = ("o", "dq", "dk", "dv")
#: The goal: our error at most this many times the better SDPA backend's.
ALLOWED_RATIO = 2.0
UNSUPPORTED = "unsupported"
#: float64 elements per query block of the reference's score-sized matrices (four of them live at once).
_REFERENCE_BLOCK_ELEMENTS = 1 << 24


def reference_head(q: Tensor, k: Tensor, v: Tensor, do: Tensor, is_causal: bool,
                   block_rows: int | None = None) -> dict[str, Tensor]:
    """float64 ``O, dQ, dK, dV`` of one head: ``q (n_queries, d)``, ``k, v (n_keys, d)``, ``do`` like ``q``.

    Exact attention (scores scaled by ``1/sqrt(d)``, causal top-left aligned as in SDPA) computed
    ``block_rows`` query rows at a time: each block's scores, probabilities and their gradients are
    formed, used and dropped, while dK and dV accumulate over the blocks. Memory is
    O(``block_rows`` × n_keys) instead of O(n_queries × n_keys)."""
    if q.dim() != 2 or k.dim() != 2 or v.shape != k.shape or do.shape != q.shape or q.shape[1] != k.shape[1]:
        raise ValueError(f"reference_head takes one head: q, do (n_queries, d) and k, v (n_keys, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(do.shape)}")
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be at least 1, got {block_rows}")
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    n_queries, d = q.shape
    n_keys = k.shape[0]
    rows = block_rows or max(1, _REFERENCE_BLOCK_ELEMENTS // n_keys)
    scale = 1.0 / math.sqrt(d)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start in range(0, n_queries, rows):
        block = slice(start, min(start + rows, n_queries))
        s = (q[block] @ k.T) * scale
        if is_causal:
            visible = causal_mask(s.shape[0], n_keys, s.device, query_offset=start)
            s = s.masked_fill(~visible, float("-inf"))
        p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
        o[block] = p @ v
        ds = p * (do[block] @ v.T - (do[block] * o[block]).sum(dim=-1, keepdim=True))
        dq[block] = (ds @ k) * scale
        dk += (ds.T @ q[block]) * scale
        dv += p.T @ do[block]
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


def checked_heads(batch: int, heads: int, every: bool = False) -> list[tuple[int, int]]:
    """The (batch, head) pairs compared with the reference: the first and the last, or ``every`` one."""
    if every:
        return [(b, h) for b in range(batch) for h in range(heads)]
    return list(dict.fromkeys([(0, 0), (batch - 1, heads - 1)]))


def measure_shape(shape: Sequence[int], dtype: torch.dtype, is_causal: bool, impls: Sequence[str] = IMPLS,
                  *, device: str = "cuda", seed: int = 0, variants: Mapping[str, dict[str, Any]] | None = None,
                  every_head: bool = False) -> list[dict[str, Any]]:
    """One row per (implementation, output) at ``shape`` = (batch, heads, seq, head_dim): the largest
    absolute error against float64 over :func:`checked_heads`, and the reference's largest magnitude.
    An implementation that cannot run the shape (SDPA's backends decline some) gets status ``unsupported``
    (``OOM`` when it ran out of memory).
    ``variants``: named option sets of ours (``flash_host_overhead.parse_variant``), measured as impls."""
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"a shape is batch,heads,seq,head_dim of positive sizes, got {list(shape)}")
    batch, heads, seq, head_dim = (int(x) for x in shape)
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = make_inputs((batch, heads, seq, head_dim), dtype, generator=generator, device=device)
    picks = checked_heads(batch, heads, every_head)
    refs = [reference_head(q[b, h], k[b, h], v[b, h], do[b, h], is_causal) for b, h in picks]
    scale = {name: max(r[name].abs().max().item() for r in refs) for name in OUTPUTS}
    rows = []
    base = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "heads": heads, "seq_len": seq,
            "head_dim": head_dim, "causal": is_causal, "heads_checked": len(picks)}
    for impl in impls:
        fn = _attention_fn(impl, variants)
        try:
            with _policy(impl, variants):
                o = fn(q, k, v, is_causal)
            got = dict(zip(OUTPUTS, (o, *torch.autograd.grad(o, (q, k, v), do))))
        except RuntimeError as exc:  # SDPA: "No available kernel" for a backend that declines the shape
            reason = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            status = OOM if isinstance(exc, torch.OutOfMemoryError) else UNSUPPORTED
            rows += [{**base, "impl": impl, "output": name, "status": status, "error": math.nan,
                      "reference_max": scale[name], "note": reason[:200]} for name in OUTPUTS]
            continue
        for name in OUTPUTS:
            error = max((got[name][b, h].double() - ref[name]).abs().max().item()
                        for (b, h), ref in zip(picks, refs))
            rows.append({**base, "impl": impl, "output": name, "status": OK, "error": error,
                         "reference_max": scale[name], "note": ""})
        del got, o
    return rows


def _attention_fn(impl: str, variants: Mapping[str, dict[str, Any]] | None) -> Any:
    if impl == OURS_PYTORCH:
        from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch

        return FlashAttentionPytorch.apply
    return attention_fn(impl, variants)


def _policy(impl: str, variants: Mapping[str, dict[str, Any]] | None) -> Any:
    return contextlib.nullcontext() if impl == OURS_PYTORCH else _backend(impl, variants)


SHAPE_KEYS = ["dtype", "batch", "heads", "seq_len", "head_dim", "causal", "output"]


def accuracy_table(rows: pd.DataFrame | Sequence[dict[str, Any]], ours: str = "ours") -> pd.DataFrame:
    """Per shape and output: each implementation's error (``error_<impl>``), ours relative to the
    reference's magnitude, ``ratio_<baseline>`` = our error over that baseline's, ``ratio_best`` over the
    smaller baseline error, and ``within`` (ours at most :data:`ALLOWED_RATIO` times that; None where no
    baseline ran). Variants of ours (``--variant``) get ``error_<name>`` and ``ratio_best_<name>``."""
    long = pd.DataFrame(rows)
    ok = long[long["status"] == OK]
    wide = ok.pivot_table(index=SHAPE_KEYS, columns="impl", values="error").reset_index()
    magnitude = long.groupby(SHAPE_KEYS)["reference_max"].max().reset_index()
    table = wide[SHAPE_KEYS].merge(magnitude, on=SHAPE_KEYS, how="left")
    mine = wide[ours] if ours in wide else pd.Series(math.nan, index=wide.index)
    table[f"error_{ours}"] = mine
    table[f"relative_{ours}"] = mine / table["reference_max"]
    baselines = [b for b in BASELINES if b in wide]
    for b in baselines:
        table[f"error_{b}"] = wide[b]
        table[f"ratio_{b}"] = mine / wide[b]
    best = wide[baselines].min(axis=1) if baselines else pd.Series(math.nan, index=wide.index)
    table["ratio_best"] = mine / best
    table["within"] = [None if math.isnan(r) else bool(r <= ALLOWED_RATIO) for r in table["ratio_best"]]
    for variant in [c for c in wide.columns if c not in (*SHAPE_KEYS, ours, *BASELINES)]:  # ours' A/B variants
        table[f"error_{variant}"] = wide[variant]
        table[f"ratio_best_{variant}"] = wide[variant] / best
    return table


def accuracy_summary(table: pd.DataFrame) -> dict[str, Any]:
    """How many (shape, output) cells meet the goal, the worst ratio and where, and the largest ratio per
    output."""
    judged = table.dropna(subset=["ratio_best"])
    out: dict[str, Any] = {"cells": int(len(table)), "judged": int(len(judged)), "allowed_ratio": ALLOWED_RATIO}
    if not len(judged):
        return out
    worst = judged.loc[judged["ratio_best"].idxmax()]
    out.update({
        "within": int(judged["within"].astype(bool).sum()),
        "worst_ratio": float(worst["ratio_best"]),
        "worst": f"{worst['output']} at {worst['dtype']} ({int(worst['batch'])}, {int(worst['heads'])}, "
                 f"{int(worst['seq_len'])}, {int(worst['head_dim'])}){' causal' if worst['causal'] else ''}",
        "geomean_ratio": float(np.exp(np.log(judged["ratio_best"].clip(lower=1e-12)).mean())),
        "max_ratio_by_output": {k: float(v) for k, v in judged.groupby("output")["ratio_best"].max().items()},
    })
    return out


def grid_shapes() -> list[tuple[int, int, int, int]]:
    """The §1.3.2 shapes grid: its (batch, heads, seq) triples at head dims 64 and 128."""
    from cs336_systems.benchmarking.flash.shapes import SHAPES_BHN

    return [(b, h, n, d) for (b, h, n), d in itertools.product(SHAPES_BHN, (64, 128))]


def run(shapes: Iterable[Sequence[int]], dtypes: Sequence[torch.dtype], causal: Sequence[bool],
        impls: Sequence[str] = IMPLS, *, device: str = "cuda", budget_s: float | None = None,
        variants: Mapping[str, dict[str, Any]] | None = None, every_head: bool = False,
        echo: bool = False) -> pd.DataFrame:
    """:func:`measure_shape` over ``shapes`` × ``dtypes`` × ``causal``, stopping before a new shape once
    ``budget_s`` seconds have passed (the first always runs; the rows say which shapes ran)."""
    for impl in impls:
        _attention_fn(impl, variants)  # an unknown name fails here, in one line
    start, rows = time.monotonic(), []
    for dtype, shape, is_causal in itertools.product(dtypes, shapes, causal):
        if rows and budget_s is not None and time.monotonic() - start > budget_s:
            if echo:
                print(f"budget of {budget_s:.0f} s spent; stopping before {tuple(shape)} {dtype}", flush=True)
            break
        rows += measure_shape(shape, dtype, is_causal, impls, device=device, variants=variants,
                              every_head=every_head)
        if device == "cuda":
            torch.cuda.empty_cache()
        if echo:
            print(f"{str(dtype).removeprefix('torch.')} {tuple(shape)} causal={is_causal}: done", flush=True)
    return pd.DataFrame(rows)


def _dtype(name: str) -> torch.dtype:
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {name!r}")
    return getattr(torch, name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking flash_accuracy --help``."""
    parser.add_argument("--shape", action="append", default=None,
                        help="batch,heads,seq,head_dim (repeatable; default: the §1.3.2 shapes grid)")
    parser.add_argument("--dtype", action="append", default=None,
                        help="bfloat16, float16 or float32 (repeatable; default bfloat16 and float16)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="only causal (--causal) or only not (--no-causal); default both")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated, of {', '.join((*IMPLS, OURS_PYTORCH))} and the --variant names")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="a variant of ours with these FlashOptions fields, measured beside the --impls "
                             """(repeatable): 'hwexp={"poly_exp2": []}'""")
    parser.add_argument("--all-heads", action="store_true",
                        help="compare every head with the reference, not only the first and the last")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=None, help="stop before a new shape after this long")
    parser.add_argument("--csv", help="write every (shape, implementation, output) row here")
    parser.add_argument("--json", help="write the summary with provenance here")


def run_command(args: argparse.Namespace) -> int:
    try:
        shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else grid_shapes())
    except ValueError:
        raise ValueError(f"--shape takes four integers batch,heads,seq,head_dim, got {args.shape}")
    dtypes = [_dtype(name) for name in (args.dtype or ["bfloat16", "float16"])]
    causal = [True, False] if args.causal is None else [args.causal]
    variants = dict(parse_variant(v) for v in args.variant)
    impls = [x for x in args.impls.split(",") if x]
    impls += [name for name in variants if name not in impls]
    if not set(impls) <= {*IMPLS, OURS_PYTORCH, *variants}:
        raise ValueError(f"--impls: unknown {sorted(set(impls) - {*IMPLS, OURS_PYTORCH, *variants})}; choose from "
                         f"{', '.join((*IMPLS, OURS_PYTORCH, *variants))}")
    rows = run(shapes, dtypes, causal, impls, device=args.device, budget_s=args.budget_s, variants=variants,
               every_head=args.all_heads, echo=True)
    table = accuracy_table(rows)
    summary = accuracy_summary(table)
    shown = [c for c in table.columns if c.startswith(("error_", "ratio_")) or c in ("within",)]
    print(table[[*SHAPE_KEYS, *shown]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(json.dumps(summary, indent=1))
    if args.csv:
        rows.to_csv(args.csv, index=False)
    if args.json:
        from cs336_systems.results import provenance

        params = {"shapes": [list(s) for s in shapes], "dtypes": [str(d) for d in dtypes], "causal": causal,
                  "impls": impls, "variants": variants, "all_heads": args.all_heads, "budget_s": args.budget_s,
                  "allowed_ratio": ALLOWED_RATIO}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "provenance": provenance(params)}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking flash_accuracy`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["flash_accuracy", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.flash_accuracy"))
