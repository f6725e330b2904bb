"""Activation checkpointing for any ``cs336_basics`` model: flat or nested segments of its blocks.

With ``N`` identical blocks and checkpoint segments of ``k`` blocks, a training step keeps one input per
segment (``N/k`` residual-stream tensors) plus, while a segment is recomputed in the backward, the full
activations of its ``k`` blocks: peak ``≈ N/k + k`` block-activations, smallest at ``k = √N``, for one
extra forward. Nesting applies the same split inside each segment: with levels ``[k₁, k₂, …]`` a
segment of ``k₁`` blocks is recomputed as segments of ``k₂``, and so on, which trades further forwards for
memory (``L`` levels: about ``L·N^(1/(L+1))`` block-activations for ``L`` extra forwards; with ``log N``
levels, ``O(log N)`` memory for ``O(N log N)`` compute).

:func:`checkpoint_layers` installs it on a model in place: ``model.layers`` becomes a
:class:`SegmentedLayers` holding the same blocks under the same names (state dicts, ``model.layers[i]``
and parameter order are unchanged), whose iteration yields checkpointed segments, so the model's own
``for layer in self.layers: x = layer(x)`` runs them. ``torch.utils.checkpoint`` (non-reentrant) replays
each segment's forward in the backward, RNG state included.

    checkpoint_layers(model, [4])       # flat: 48 blocks as 12 segments of 4
    checkpoint_layers(model, [8, 2])    # nested: segments of 8, each recomputed as segments of 2
    checkpoint_layers(model, [])        # off again
    checkpoint_layers(model, [], sublayers=True)  # each block's attention and feed-forward branch on its own
    checkpoint_layers(model, [1], first=18)  # only the first 18 blocks, one by one; the rest keep everything

Selective: with ``first`` only the first ``first`` blocks are checkpointed (in segments of the levels), the rest
keep their activations as usual. Any ``k`` checkpointed blocks save the same memory; where memory allows,
recomputing fewer of them is the cheapest way to fit (:func:`cs336_systems.benchmarking.leaderboard_8b.memory_plan`
picks the fewest).

Below one block: with ``sublayers`` each pre-norm block runs its two residual branches, ``x + Attn(RMSNorm(x))``
and ``x + FFN(RMSNorm(x))``, as separate checkpoints, so a backward recomputes half a block at a time and
keeps two residual-stream tensors per block. Where one block's own residuals dwarf its input (naive
attention's ``seq × seq`` scores at long contexts), that is where the peak is lowest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

#: The parts of a pre-norm block that ``sublayers`` checkpoints one by one: (norm, branch) pairs.
SUBLAYERS = (("ln1", "attn"), ("ln2", "ffn"))
#: The profiler range around a segment's replay in the backward: a step's time split
#: (:mod:`cs336_systems.profiling.step_split`) counts the kernels launched inside it as recomputation.
RECOMPUTE_RANGE = "recompute"


def _recompute_range() -> AbstractContextManager[object]:
    """A ``record_function`` range while autograd runs a backward, where a checkpointed forward is its
    recomputation (not inside a compiled region, which traces no profiler ranges)."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
        return nullcontext()
    return record_function(RECOMPUTE_RANGE)


def _branch(norm: nn.Module, branch: nn.Module, x: Tensor) -> Tensor:
    with _recompute_range():
        return branch(norm(x))


def _by_sublayer(block: nn.Module, x: Tensor) -> Tensor:
    """``block(x)`` for a pre-norm block, each residual branch checkpointed on its own."""
    for norm, branch in SUBLAYERS:
        x = x + checkpoint(_branch, getattr(block, norm), getattr(block, branch), x, use_reentrant=False)
    return x


def _run(blocks: Sequence[nn.Module], levels: Sequence[int], x: Tensor, sublayers: bool = False) -> Tensor:
    """Run ``blocks`` on ``x``, checkpointing segments of ``levels[0]`` blocks, each recursively with the
    remaining levels; at the innermost level each block by sublayer if ``sublayers``."""
    with _recompute_range():
        if not levels:
            for block in blocks:
                x = _by_sublayer(block, x) if sublayers else block(x)
            return x
        size, inner = levels[0], levels[1:]
        for start in range(0, len(blocks), size):
            segment = blocks[start:start + size]
            x = checkpoint(_run, segment, inner, x, sublayers, use_reentrant=False)
        return x


class SegmentedLayers(nn.ModuleList):
    """A ``ModuleList`` of blocks whose iteration yields checkpointed segments (callables ``x -> x``) of
    ``levels[0]`` blocks (or, with ``sublayers`` and no levels, single blocks run branch by branch); indexing,
    ``len`` and the module tree are those of the plain list."""

    def __init__(self, blocks: Sequence[nn.Module], levels: Sequence[int], sublayers: bool = False,
                 first: int | None = None):
        super().__init__(blocks)
        self.levels = list(levels)
        self.sublayers = sublayers
        self.first = len(blocks) if first is None else first

    def __iter__(self) -> Iterator[Callable[[Tensor], Tensor]]:
        blocks = list(self._modules.values())
        if not (self.levels or self.sublayers) or not torch.is_grad_enabled():  # no backward: nothing to save
            yield from blocks
            return
        checkpointed, plain = blocks[:self.first], blocks[self.first:]
        if not self.levels:
            for block in checkpointed:
                yield lambda x, block=block: _by_sublayer(block, x)
        else:
            size, inner = self.levels[0], self.levels[1:]
            for start in range(0, len(checkpointed), size):
                segment = checkpointed[start:start + size]
                yield lambda x, segment=segment: checkpoint(_run, segment, inner, x, self.sublayers,
                                                            use_reentrant=False)
        yield from plain

    def extra_repr(self) -> str:
        first = f", first {self.first} of {len(self)} blocks" if self.first < len(self) else ""
        return f"checkpoint levels={self.levels}" + (", by sublayer" if self.sublayers else "") + first

    # ModuleList's repr iterates the list, which here yields segments; print the blocks and the schedule.
    __repr__ = nn.Module.__repr__


def checkpoint_layers(model: nn.Module, levels: Sequence[int], sublayers: bool = False,
                      first: int | None = None) -> nn.Module:
    """Checkpoint ``model.layers`` in segments (see the module docstring), innermost by sublayer if
    ``sublayers`` (blocks need ``ln1``/``attn``/``ln2``/``ffn``), only the first ``first`` blocks if given;
    ``levels`` empty and no ``sublayers`` turns it off. Returns the model (changed in place)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"checkpoint_layers needs a model with a ModuleList `layers`, got {type(model).__name__}")
    levels = [int(k) for k in levels]
    if any(k < 1 for k in levels):
        raise ValueError(f"segment sizes must be positive, got {levels}")
    if any(inner > outer for outer, inner in zip(levels, levels[1:])):
        raise ValueError(f"nested segment sizes must not grow inward, got {levels}")
    if levels and levels[0] > len(layers):
        raise ValueError(f"segments of {levels[0]} blocks exceed the model's {len(layers)} blocks")
    if first is not None and not 0 <= first <= len(layers):
        raise ValueError(f"first must be between 0 and the model's {len(layers)} blocks, got {first}")
    blocks = list(layers._modules.values())
    parts = [name for pair in SUBLAYERS for name in pair]
    lacking = [n for n in parts if sublayers and blocks and not isinstance(getattr(blocks[0], n, None), nn.Module)]
    if lacking:
        raise ValueError(f"checkpointing by sublayer needs pre-norm blocks with {', '.join(parts)}; "
                         f"{type(blocks[0]).__name__} lacks {', '.join(lacking)}")
    model.layers = SegmentedLayers(blocks, levels, sublayers, first)
    return model


def stored_block_activations(num_blocks: int, levels: Sequence[int]) -> int:
    """Peak number of block-activation sets held by :func:`checkpoint_layers`' schedule (the count the
    module docstring estimates): the stored segment inputs at each level plus the innermost segment's
    blocks, recomputed in full. ``levels=[]``: all ``num_blocks``."""
    held, span = 0, num_blocks
    for size in levels:
        held += -(-span // size)  # segment inputs kept at this level
        span = size
    return held + span


__all__ = ["RECOMPUTE_RANGE", "SegmentedLayers", "checkpoint_layers", "stored_block_activations"]
