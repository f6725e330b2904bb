"""FSDP's shards and their collectives: a parameter cut into equal 1-D slices, one per rank
(:class:`FlatShard`), the all-gather that rebuilds it (:class:`PendingGather`) and the reduce-scatter that
averages its gradient into this rank's slice (:func:`reduce_scatter_mean` → :class:`PendingShardGrad`).
:mod:`~cs336_systems.distributed.fsdp` decides when each runs.
"""

from __future__ import annotations

import collections
import math
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
