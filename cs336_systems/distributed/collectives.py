"""The collectives every data-parallel strategy is built from: an averaging all-reduce launched with as
little host work as possible (optionally through a bf16/fp16 wire format), and broadcasts of rank 0's state.

:class:`MeanAllReduce` → :class:`PendingReduce` averages one tensor (asynchronously by default), as
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`` does for a low-precision
wire: the local gradient is accumulated in fp32 and the mean is written back into it.
:func:`broadcast_coalesced` sends many small tensors (a model's buffers) in one collective per dtype;
:func:`broadcast_module_state` makes replicas start identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_LOW_PRECISION_COMM = (torch.bfloat16, torch.float16)


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` with the values of the group's first rank: one broadcast per (dtype, device)
    of all of them concatenated, instead of one collective per tensor (a model's buffers are many small
    tensors, and each collective costs a fixed latency)."""
    unique: dict[int, torch.Tensor] = {id(t): t for t in tensors}  # a tied tensor once
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in unique.values():
        if t.numel():
            kinds.setdefault((t.dtype, t.device), []).append(t)
    receiving = dist.get_rank(group) != 0
    for same_kind in kinds.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        dist.broadcast(flat, group=group, group_src=0)
        if receiving:
            for t, value in zip(same_kind, flat.split([t.numel() for t in same_kind])):
                t.detach().copy_(value.view_as(t))


def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter (trainable or frozen) and buffer with the group's first rank's values.

    Replicas must start identical: ranks that build a model from different seeds would otherwise train
    different models while exchanging gradients that no longer belong to a common point.
    """
    broadcast_coalesced([*module.parameters(), *module.buffers()], group)




def check_comm_dtype(comm_dtype: torch.dtype | None) -> None:
    if comm_dtype is not None and comm_dtype not in (torch.float32, *_LOW_PRECISION_COMM):
        raise ValueError(f"comm_dtype must be None, float32, bfloat16 or float16, got {comm_dtype}")


class MeanAllReduce:
    """Averaging all-reduces on one process group, with everything that does not change between calls
    (the group object, its size, whether the backend averages natively, the options) resolved once.

    A bucketed backward launches a few hundred collectives from its gradient hooks, and when backward is
    launch-bound (bf16 autocast of a large model at a small batch) every microsecond of host time per
    launch lengthens the step one for one. So the launch goes straight to the process group's own
    ``allreduce`` rather than through ``dist.all_reduce``, whose argument checks and logging decorators
    cost tens of microseconds per call (docs/ddp/NOTES.md), and the per-call lookups of the backend and the
    world size are done here, once. ``torch`` DDP's reducer calls the process group from C++ for the same
    reason.

    NCCL averages inside the collective (``ReduceOp.AVG``, which pre-multiplies by 1/n and so also keeps
    fp16 from overflowing); gloo only sums, so the sum is divided afterwards.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.process_group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(group)
        native_avg = dist.get_backend(group) == "nccl"
        self.op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        self.post_divide = 1 if native_avg else self.world_size
        self._options = {}
        for async_op in (True, False):
            opts = dist.AllreduceOptions()
            opts.reduceOp = self.op
            if hasattr(opts, "asyncOp"):  # as dist.all_reduce sets it: async work runs on NCCL's own stream
                opts.asyncOp = async_op
            self._options[async_op] = opts

    def _launch(self, tensor: torch.Tensor, async_op: bool) -> Any:
        work = self.process_group.allreduce([tensor], self._options[async_op])
        if async_op:
            return work
        if work is not None:  # NCCL with asyncOp=False has already synchronised in C++ and returns None
            work.wait()
        return None

    def __call__(
        self,
        tensor: torch.Tensor,
        *,
        comm_dtype: torch.dtype | None = None,
        comm_buffer: torch.Tensor | None = None,
        async_op: bool = True,
    ) -> PendingReduce:
        """Start averaging ``tensor``; the mean lands in ``tensor`` on ``wait()``.

        With ``comm_dtype`` bf16/fp16 the gradient travels (and is summed by the collective) in that dtype:
        half the bytes on the wire. The local gradient was accumulated in ``tensor``'s dtype (fp32) and the
        mean is written back into it, so the optimizer still sees fp32 gradients. The tensor is scaled by
        ``1/world_size`` *before* the low-precision sum, which keeps fp16 from overflowing.
        ``comm_buffer`` (same shape, ``comm_dtype``) is reused instead of allocating a copy per call.
        """
        if comm_dtype is None or comm_dtype == tensor.dtype:
            return PendingReduce(self._launch(tensor, async_op), tensor, tensor, self.post_divide)
        if comm_buffer is None:
            check_comm_dtype(comm_dtype)
            comm_buffer = torch.empty_like(tensor, dtype=comm_dtype)
        elif comm_buffer.shape != tensor.shape or comm_buffer.dtype != comm_dtype:
            raise ValueError(
                f"comm_buffer must have shape {tuple(tensor.shape)} and dtype {comm_dtype}, "
                f"got {tuple(comm_buffer.shape)} {comm_buffer.dtype}"
            )
        if self.post_divide == 1:
            comm_buffer.copy_(tensor)
        else:
            torch.div(tensor, self.world_size, out=comm_buffer)  # scale in fp32, round once
        return PendingReduce(self._launch(comm_buffer, async_op), comm_buffer, tensor, 1)


@dataclass
class PendingReduce:
    """An in-flight averaging all-reduce. :meth:`wait` leaves the mean in ``target``."""

    work: Any  # dist.Work, or None when the call was synchronous
    wire: torch.Tensor  # the tensor that went through the collective
    target: torch.Tensor  # where the average must end up (may be ``wire`` itself)
    post_divide: int  # > 1 when the collective summed and we still have to divide

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # on CUDA: makes the current stream wait for the NCCL stream, host not blocked
        if self.wire is not self.target:
            self.target.copy_(self.wire)  # e.g. bf16 wire → fp32 gradient
        if self.post_divide > 1:
            self.target.div_(self.post_divide)
        return self.target
