"""Sweeps over configurations that survive out-of-memory errors and respect a time budget.

A sweep of model sizes × context lengths is expected to run out of memory at the large end; that is a
result ("OOM"), not a crash. :func:`run_sweep` calls a benchmark once per configuration under a tqdm
progress bar, turns a CUDA OOM into a row with ``status="OOM"``, frees the cached memory so the next
configuration starts clean, and stops starting new configurations once a deadline has passed (those
rows say ``status="skipped (time budget)"``), so a sweep always returns a complete table.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm  # plain text bars: notebooks run headless, where widget bars only warn

OK, OOM, SKIPPED = "ok", "OOM", "skipped (time budget)"


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA out-of-memory error, also when wrapped (torch.compile re-raises backend errors
    with the original as ``__cause__``) or raised as a plain RuntimeError by older code paths."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def free_memory() -> None:
    """Drop garbage (including tensors a failed step left in a traceback) and the allocator cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """Cartesian product of named axes, first axis slowest: ``grid(size=[...], context_length=[...])``."""
    rows: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        values = list(values)
        if not values:
            raise ValueError(f"axis {name!r} has no values")
        rows = [{**row, name: v} for row in rows for v in values]
    return rows


def run_sweep(
    fn: Callable[..., Mapping[str, Any]],
    configs: Sequence[Mapping[str, Any]],
    *,
    desc: str = "sweep",
    budget_s: float | None = None,
    progress: bool = True,
    on_row: Callable[[pd.DataFrame], None] | None = None,
) -> pd.DataFrame:
    """Call ``fn(**config)`` for each config and collect one row per config.

    A row is the config, then ``status`` (``ok`` / ``OOM`` / ``skipped (time budget)``), then the mapping
    ``fn`` returned. Exceptions other than OOM propagate: a bug must not be reported as a result.
    ``on_row(rows_so_far)`` runs after every measured configuration, so a caller can write its table as it
    grows and a job killed mid-sweep (by a scheduler's time limit) leaves what it measured.
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    rows = []
    bar = tqdm(configs, desc=desc, disable=not progress, leave=False)
    for config in bar:
        bar.set_postfix_str(", ".join(f"{k}={v}" for k, v in config.items()), refresh=False)
        if deadline is not None and time.monotonic() > deadline:
            rows.append({**config, "status": SKIPPED})
            continue
        try:
            result = fn(**config)
        except Exception as exc:  # noqa: BLE001 - filtered right below
            if not is_oom(exc):
                raise
            rows.append({**config, "status": OOM})
        else:
            rows.append({**config, "status": OK, **result})
        # Outside the except block: while it runs, the exception's traceback keeps the failed step's frames (its
        # model, optimizer state and activations) reachable, so collecting there freed nothing and the next
        # configuration ran with them still allocated.
        free_memory()
        if on_row is not None:
            on_row(pd.DataFrame(rows))
    return pd.DataFrame(rows)


def status_grid(df: pd.DataFrame, value: str, index: str, columns: str, fmt: str = "{:.2f}") -> pd.DataFrame:
    """Pivot ``value`` into an ``index × columns`` table of strings where failed cells read "OOM" (or
    "skipped"), the form the writeup prints."""
    def cell(row: pd.Series) -> str:
        if row.get("status", OK) != OK:
            return "OOM" if row["status"] == OOM else "skipped"
        return fmt.format(row[value])

    labelled = df.assign(_cell=df.apply(cell, axis=1))
    table = labelled.pivot(index=index, columns=columns, values="_cell")
    # keep the sweep's order (pivot sorts, which puts "2.7B" before "small")
    return table.reindex(index=pd.unique(df[index]), columns=pd.unique(df[columns]))


#: What a smoke run prints where a GPU-only part of a section is skipped.
CPU_NOTE = "GPU-only part skipped: no CUDA device (CPU smoke run)."


def deadline_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative: the budget left to a sweep."""
    return max(deadline - time.monotonic(), 0.0)


def ordered(df: pd.DataFrame, column: str, order: Sequence[Any]) -> pd.DataFrame:
    """``df`` with ``column`` as an ordered categorical in ``order`` (so sorting follows the preset order)."""
    return df.assign(**{column: pd.Categorical(df[column], categories=list(dict.fromkeys(order)), ordered=True)})
