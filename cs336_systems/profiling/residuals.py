"""What a forward pass saves for its backward ("residuals"), tensor by tensor, with the op that made it.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an autograd node saves, at the moment it
is saved; a dispatch mode running alongside records which operator produced each tensor. Together they
answer "which ops' outputs does this block keep alive until the backward, and how many bytes": the
table behind a block's activation-memory share (and, since each saved tensor of a Linear is its input
or weight, a way to infer its gradients' sizes). A tensor saved by several nodes (a block input used by
three projections) is counted once, by storage.

    table = saved_residuals(lambda: block(x))
    by_op = residuals_by_op(table)           # bytes and share per producing op, largest first
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: What a saved tensor was produced by when no operator inside the measured call made it.
FROM_OUTSIDE = "(input or parameter)"
#: The producer of a saved tensor when producers are not recorded (a compiled graph's tensors).
UNNAMED = "(compiled graph)"


class _ProducerLog(TorchDispatchMode):
    """Maps each output's storage to the name of the operator that produced it."""

    def __init__(self) -> None:
        super().__init__()
        self.producer: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # Views and in-place results share an input's storage: its producer stays the one that allocated it.
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                # A new allocation; the address may be a freed tensor's, so the latest producer wins.
                self.producer[t.untyped_storage().data_ptr()] = name
        return out


def saved_residuals(fn: Callable[[], Any], *, producers: bool = True,
                    outside: Iterable[torch.Tensor] = ()) -> pd.DataFrame:
    """Run ``fn`` (a forward with autograd recording) and list each distinct storage saved for backward:
    ``op`` (producer, or :data:`FROM_OUTSIDE`), ``shape``, ``dtype``, ``bytes`` (the storage's, counted
    once), ``saves`` (how many times nodes saved it). The result of ``fn`` is discarded.

    ``producers=False`` records no producer (``op`` is :data:`UNNAMED`): for a ``torch.compile``d ``fn``, whose
    graph a dispatch mode would intercept while it runs. Tensors sharing a storage with ``outside`` (the
    inputs, the parameters) are then marked :data:`FROM_OUTSIDE`."""
    log = _ProducerLog() if producers else contextlib.nullcontext()
    known = {t.untyped_storage().data_ptr() for t in outside}
    seen: dict[int, dict[str, Any]] = {}

    def producer(key: int) -> str:
        if key in known:
            return FROM_OUTSIDE
        return log.producer.get(key, FROM_OUTSIDE) if producers else UNNAMED

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            seen[key]["saves"] += 1
        else:
            seen[key] = {"op": producer(key), "shape": tuple(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                         "bytes": t.untyped_storage().nbytes(), "saves": 1}
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), log:
        out = fn()
    del out
    return pd.DataFrame(list(seen.values()), columns=["op", "shape", "dtype", "bytes", "saves"])


def residuals_by_op(table: pd.DataFrame, top: int | None = None, include_outside: bool = False) -> pd.DataFrame:
    """Bytes per producing op with its share of the total, largest first (inputs and parameters left out
    unless ``include_outside``: they live anyway)."""
    t = table if include_outside else table[table["op"] != FROM_OUTSIDE]
    by = t.groupby("op")["bytes"].agg(["sum", "count"]).rename(columns={"sum": "bytes", "count": "tensors"})
    by["share"] = by["bytes"] / by["bytes"].sum() if len(by) else by["bytes"]
    by = by.sort_values("bytes", ascending=False).reset_index()
    return by.head(top) if top else by


__all__ = ["FROM_OUTSIDE", "UNNAMED", "residuals_by_op", "saved_residuals"]
