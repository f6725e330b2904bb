"""The tensors behind the ops a block's saved-for-backward listing names (§1.1.7's residuals, memory profiling
(f) of the 2026 handout): autograd records the op that produced each saved tensor, and the answer says which
tensor of the model that is, only where certain. Answer text only: nothing here measures."""

from __future__ import annotations

import math

import pandas as pd

from cs336_systems.report.fmt import join_words


#: The tensors an op's saved outputs are in this model's block (autograd names the op that produced them).
SAVED_AS = {"exp": " (the exponentials)", "masked_fill": " (the masked scores)", "div": " (the probabilities)"}
#: Ops whose outputs are named only where every saved output has the shape that name implies (given the block's
#: d_model, d_ff and tokens): a matmul or a copy elsewhere in another model would be something else.
SAVED_AS_BY_SHAPE = {
    "mm": (" (the feed-forward's $W_1x$ and $W_3x$)", lambda tensor_shape, d, ff, tokens: tensor_shape[-1] == ff),
    "clone": (" (contiguous copies of $Q$, $K^\\top$ and $V$ split by head, and of the merged attention output)",
              lambda tensor_shape, d, ff, tokens: math.prod(tensor_shape) == tokens * d),
}


def tied_with_last(table: pd.DataFrame | None, top: pd.DataFrame) -> str:
    """The ops left out of the top list that save exactly as much as its last one: a tie the cut hides."""
    from cs336_systems.profiling.residuals import residuals_by_op

    if table is None or top is None or not len(top):
        return ""
    by = residuals_by_op(table)
    last = float(top["bytes"].iloc[-1])
    shown = set(top["op"].astype(str))
    tied = [str(op) for op, b in zip(by["op"], by["bytes"]) if str(op) not in shown and float(b) == last]
    if not tied:
        return ""
    return f"; {join_words(tied)} {'saves' if len(tied) == 1 else 'save'} as much as {top['op'].iloc[-1]}"


def saved_as(op: str, table: pd.DataFrame | None, meta: dict | None) -> str:
    """What ``op``'s saved outputs are, in words: by name (:data:`SAVED_AS`) or, for an op that produces other
    tensors in other blocks, where all of its rows in the residual ``table`` have the implied shape."""
    if op in SAVED_AS:
        return SAVED_AS[op]
    extra = (meta or {}).get("extra") or {}
    dims, batch, context = extra.get("shape") or [], extra.get("batch_size"), extra.get("context_length")  # d, d_ff, ...
    if op not in SAVED_AS_BY_SHAPE or table is None or len(dims) < 2 or not batch or not context:
        return ""
    words, fits = SAVED_AS_BY_SHAPE[op]
    rows = table[table["op"].astype(str) == op]
    shapes = [tuple(int(x) for x in str(v).strip("()").split(",") if x.strip()) for v in rows["shape"]]
    ok = bool(shapes) and all(fits(sh, int(dims[0]), int(dims[1]), int(batch) * int(context)) for sh in shapes)
    return words if ok else ""
