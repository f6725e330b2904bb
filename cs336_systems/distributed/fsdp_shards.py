"""FSDP's shards and their collectives: a parameter cut into equal 1-D slices, one per rank
(:class:`FlatShard`), the all-gather that rebuilds it (:class:`PendingGather`), one all-gather for several
shards at once (:class:`GatherGroup` → :class:`PendingGroupGather`), the layers one such gather serves
(:class:`GatherUnit`, :func:`group_units`) and the reduce-scatter that averages a gradient into this rank's
slice (:func:`reduce_scatter_mean` → :class:`PendingShardGrad`). :mod:`~cs336_systems.distributed.fsdp` decides
when each runs.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_reduce_scatter_supported: dict[str, bool] = {}


# --------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------


@dataclass
class PendingGather:
    """An in-flight all-gather of one parameter; :meth:`wait` returns the full tensor (orig. shape)."""

    work: Any
    out: torch.Tensor
    numel: int
    shape: torch.Size
    source: torch.Tensor | None  # kept alive until the collective has read it

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.source = None
        return self.out[: self.numel].view(self.shape)


@dataclass
class PendingShardGrad:
    """An in-flight reduce-scatter; :meth:`wait` returns this rank's averaged gradient slice and lets
    go of the full-size input (so at most a few full gradients are alive at any time)."""

    work: Any
    out: torch.Tensor
    divide_by: int
    full: torch.Tensor | None = None  # all-reduce fallback: the whole reduced tensor
    rank: int = 0
    keepalive: torch.Tensor | None = None
    done: bool = False

    @torch.no_grad()
    def wait(self) -> torch.Tensor:
        if not self.done:
            self.work.wait()  # on CUDA the compute stream waits; the host does not block
            if self.full is not None:
                n = self.out.numel()
                self.out.copy_(self.full[self.rank * n : (self.rank + 1) * n])
            if self.divide_by > 1:
                self.out.div_(self.divide_by)
            self.work = self.full = self.keepalive = None
            self.done = True
        return self.out


def reduce_scatter_mean(flat: torch.Tensor, group: dist.ProcessGroup | None) -> PendingShardGrad:
    """Start averaging ``flat`` (length divisible by the world size) across ranks, each rank keeping
    its slice. NCCL averages inside the collective; gloo sums and we divide afterwards. Where the
    backend lacks ``reduce_scatter_tensor`` (gloo in some torch versions), an all-reduce plus slice
    gives the same result at twice the traffic."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(flat.numel() // world_size, dtype=flat.dtype, device=flat.device)
    backend = dist.get_backend(group)
    avg = backend == "nccl"
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    divide_by = 1 if avg else world_size
    if _reduce_scatter_supported.get(backend, True):
        try:
            work = dist.reduce_scatter_tensor(out, flat, op=op, group=group, async_op=True)
            return PendingShardGrad(work, out, divide_by, keepalive=flat)
        except (RuntimeError, NotImplementedError):  # a backend without reduce_scatter (gloo on CPU tensors):
            _reduce_scatter_supported[backend] = False  # all-reduce instead, and keep this rank's shard of it
    flat = flat.clone()  # the all-reduce works in place; the caller's tensor may belong to autograd
    work = dist.all_reduce(flat, op=op, group=group, async_op=True)
    return PendingShardGrad(work, out, divide_by, full=flat, rank=rank)


@dataclass
class PendingCoalescedGather:
    """One all-gather of several shards packed side by side: ``out`` holds, per rank, that rank's slices in a row.
    :meth:`wait` copies each weight out of it in one kernel (``split_with_sizes_copy``), so each full weight is a
    tensor of its own that can be freed on its own."""

    work: Any
    out: torch.Tensor | None  # (world_size, sum of the shards' slice lengths)
    shards: list[FlatShard]
    source: torch.Tensor | None  # the packed input, kept alive until the collective has read it
    full: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self.full is None:
            self.complete()
            assert self.out is not None
            outs = [self.out.new_empty(self.out.shape[0], s.shard_numel) for s in self.shards]
            torch.split_with_sizes_copy(self.out, [s.shard_numel for s in self.shards], dim=1, out=outs)
            self.full = [o.view(-1)[: s.numel].view(s.shape) for o, s in zip(outs, self.shards)]
            self.out = None
        return self.full

    def complete(self) -> None:
        """Wait for the collective only (a prefetch dropped unused needs no copy-out)."""
        if self.work is not None:
            self.work.wait()
            self.work = self.source = None


def start_coalesced_gather(shards: list[FlatShard], dtype: torch.dtype, group: dist.ProcessGroup | None
                           ) -> PendingCoalescedGather:
    """Pack this rank's slices (cast to ``dtype`` on the way, one ``_foreach_copy_``) and all-gather them in one
    collective: per weight this saves the collective's launch, an allocation and a cast on the host."""
    sizes = [s.shard_numel for s in shards]
    device = shards[0].param.device
    source = torch.empty(sum(sizes), dtype=dtype, device=device)
    torch._foreach_copy_(list(source.split(sizes)), [s.param.detach() for s in shards])
    out = torch.empty(shards[0].world_size, sum(sizes), dtype=dtype, device=device)
    work = dist.all_gather_into_tensor(out.view(-1), source, group=group, async_op=True)
    return PendingCoalescedGather(work, out, shards, source)


class PendingGroupGather:
    """The in-flight gathers of a :class:`GatherGroup`; :meth:`wait` returns ``{owner: {name: full tensor}}``."""

    def __init__(self, keys: dict[Hashable, dict[str, int]], parts: list[tuple[list[int], Any]]):
        self.keys, self.parts = keys, parts  # parts: (positions of the group's shards, pending gather)

    def wait(self) -> dict[Hashable, dict[str, torch.Tensor]]:
        full: dict[int, torch.Tensor] = {}
        for positions, pending in self.parts:
            got = pending.wait()
            full.update(zip(positions, got if isinstance(got, list) else [got]))
        return {owner: {name: full[i] for name, i in names.items()} for owner, names in self.keys.items()}

    def complete(self) -> None:
        for _, pending in self.parts:
            pending.complete() if isinstance(pending, PendingCoalescedGather) else pending.wait()


class GatherGroup:
    """Shards gathered by one collective per dtype (``coalesce``; else one each, with no packing or copy-out), each
    under its owner (a layer) and name; a weight two owners share is gathered once."""

    def __init__(self, members: dict[Hashable, dict[str, FlatShard]], group: dist.ProcessGroup | None,
                 coalesce: bool = True):
        self.group, self.coalesce = group, coalesce
        self.shards: list[FlatShard] = []
        self.keys: dict[Hashable, dict[str, int]] = {}
        for owner, named in members.items():
            for name, shard in named.items():
                if not any(shard is s for s in self.shards):
                    self.shards.append(shard)
                self.keys.setdefault(owner, {})[name] = next(i for i, s in enumerate(self.shards) if s is shard)

    def start(self, dtype: torch.dtype | None) -> PendingGroupGather:
        batches: dict[Any, list[int]] = {}  # one collective per batch: per dtype, or per shard
        for i, s in enumerate(self.shards):
            batches.setdefault((dtype or s.param.dtype) if self.coalesce else i, []).append(i)
        parts: list[tuple[list[int], Any]] = []
        for positions in batches.values():
            shards = [self.shards[i] for i in positions]
            parts.append((positions, shards[0].start_gather(dtype) if len(shards) == 1
                          else start_coalesced_gather(shards, dtype or shards[0].param.dtype, self.group)))
        return PendingGroupGather(self.keys, parts)


# --------------------------------------------------------------------------------------------------
# Shards and layers
# --------------------------------------------------------------------------------------------------


class FlatShard:
    """One parameter's slice on this rank plus its in-flight gradient reductions."""

    def __init__(
        self,
        param: nn.Parameter,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        in_flight: collections.deque,
        max_in_flight: int,
    ):
        self.param = param
        self.in_flight, self.max_in_flight = in_flight, max_in_flight
        self.shape = param.shape
        self.numel = param.numel()
        self.world_size, self.group = world_size, group
        self.shard_numel = math.ceil(self.numel / world_size)
        self.padded_numel = self.shard_numel * world_size
        flat = param.detach().reshape(-1)
        shard = torch.zeros(self.shard_numel, dtype=param.dtype, device=param.device)
        start = rank * self.shard_numel
        valid = max(0, min(self.numel - start, self.shard_numel))
        shard[:valid].copy_(flat[start : start + valid])
        param.data = shard  # same Parameter object: optimizers and names are unaffected
        self.pending_grads: list[PendingShardGrad] = []
        self.uses_awaiting_grad = 0  # forward uses whose gradient has not arrived yet
        self.grad_sum: torch.Tensor | None = None
        self.check_finite = False
        self.finite: torch.Tensor | None = None  # was every local gradient of this step finite (if checked)

    def note_use(self) -> None:
        self.uses_awaiting_grad += 1

    @torch.no_grad()
    def add_grad_contribution(self, grad_full: torch.Tensor) -> None:
        """Sum the gradients of all uses of the weight in this backward (a layer called twice, a weight
        shared by two layers) in master precision, and reduce-scatter once, after the last one — the
        same sum, in the same order, that autograd forms for an unsharded parameter."""
        g = grad_full.to(self.param.dtype)
        self.grad_sum = g if self.grad_sum is None else self.grad_sum + g
        self.uses_awaiting_grad -= 1
        if self.uses_awaiting_grad <= 0:
            self.flush_grad()

    def flush_grad(self) -> None:
        if self.grad_sum is not None:
            self.start_grad_reduction(self.grad_sum)
        self.grad_sum = None
        self.uses_awaiting_grad = 0

    def start_gather(self, dtype: torch.dtype | None) -> PendingGather:
        source = self.param.detach()
        if dtype is not None and dtype != source.dtype:
            source = source.to(dtype)  # cast before communicating: low-precision traffic
        out = torch.empty(self.padded_numel, dtype=source.dtype, device=source.device)
        work = dist.all_gather_into_tensor(out, source, group=self.group, async_op=True)
        return PendingGather(work, out, self.numel, self.shape, source)

    @torch.no_grad()
    def start_grad_reduction(self, grad_full: torch.Tensor) -> None:
        master_dtype = self.param.dtype
        flat = grad_full.reshape(-1)
        if flat.dtype != master_dtype or self.padded_numel != self.numel or not flat.is_contiguous():
            padded = torch.zeros(self.padded_numel, dtype=master_dtype, device=flat.device)
            padded[: self.numel].copy_(flat)  # fp32 gradients: the reduction happens in master precision
            flat = padded
        if self.check_finite:  # this rank's own gradient, before the reduction mixes every rank's in
            finite = torch.isfinite(flat).all()
            self.finite = finite if self.finite is None else self.finite & finite
        pending = reduce_scatter_mean(flat, self.group)
        self.pending_grads.append(pending)
        self.in_flight.append(pending)
        while len(self.in_flight) > self.max_in_flight:  # bound the full-size gradients kept alive
            self.in_flight.popleft().wait()

    @torch.no_grad()
    def finish_grad(self) -> None:
        self.flush_grad()  # uses whose gradient never arrived (output not in the loss) end here
        for pending in self.pending_grads:  # one per use of the weight in this backward
            g = pending.wait()
            if self.param.grad is None:
                self.param.grad = g
            else:
                self.param.grad.add_(g)
        self.pending_grads.clear()

    @torch.no_grad()
    def full_tensor(self) -> torch.Tensor:
        """The whole fp32 parameter (a collective)."""
        return self.start_gather(None).wait().clone()


@dataclass
class GatherUnit:
    """Sharded layers whose weights one all-gather brings: a single layer by default (the handout's schedule), or
    every sharded layer inside one module of a ``gather_units`` type, such as a Transformer block (as FSDP2 shards
    it). Gathers, prefetches and regathers for backward all work per unit."""

    index: int
    layers: list[Any]  # fsdp.ShardedLayer
    fsdp: Any  # weakref.proxy to the owning FSDP

    def __post_init__(self) -> None:
        self.gathers = GatherGroup({layer.index: layer.shards for layer in self.layers}, self.fsdp.process_group,
                                   coalesce=len(self.layers) > 1)  # a lone layer: the per-weight gathers as before

    def start_gather(self) -> PendingGroupGather:
        """``wait()`` on the result gives ``{layer index: {name: full weight}}``."""
        self.fsdp._count_gather(self)
        return self.gathers.start(self.fsdp.compute_dtype)


def group_units(module: nn.Module, layers: list[Any], unit_types: tuple[type[nn.Module], ...], fsdp: Any
                ) -> list[GatherUnit]:
    """One unit per sharded layer, or per innermost module of a ``unit_types`` type around it; sets each layer's
    ``unit``, and has each such module tell ``fsdp`` when its forward returns (``_unit_done``)."""
    if not isinstance(unit_types, tuple) or not all(isinstance(t, type) and issubclass(t, nn.Module)
                                                     for t in unit_types):
        raise ValueError(f"gather_units must be a tuple of nn.Module subclasses, got {unit_types!r}")
    modules = dict(module.named_modules())
    owners = [n for n, m in modules.items() if unit_types and isinstance(m, unit_types)]
    missing = [t.__name__ for t in unit_types if not any(isinstance(m, t) for m in modules.values())]
    if missing:
        raise ValueError(f"gather_units: no module of type {', '.join(missing)} in the model")
    grouped: dict[tuple[str, str], list[Any]] = {}
    for layer in layers:
        around = [o for o in owners if o in ("", layer.name) or layer.name.startswith(o + ".")]
        key = ("unit", max(around, key=len)) if around else ("layer", layer.name)
        grouped.setdefault(key, []).append(layer)
    units = [GatherUnit(i, members, fsdp) for i, members in enumerate(grouped.values())]
    for (kind, name), unit in zip(grouped, units):
        for layer in unit.layers:
            layer.unit = unit
        if kind == "unit":
            modules[name].register_forward_hook(lambda mod, args, out, unit=unit: fsdp._unit_done(unit))
    return units
