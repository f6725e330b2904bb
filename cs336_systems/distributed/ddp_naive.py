"""Naive data parallelism: after backward, one blocking all-reduce per parameter.

The baseline every other strategy improves on. It pays one collective's fixed latency per parameter
(hundreds of calls for a Transformer) and communicates only after the whole backward pass, so none of
the communication hides behind computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.grad_sync import DataParallel, per_parameter_buckets, trainable_parameters


class DataParallelNaive(DataParallel):
    """Broadcast rank 0's parameters at wrap time; :meth:`finish_gradient_synchronization` all-reduces
    every gradient separately (blocking, in ``parameters()`` order) and averages it."""

    def __init__(
        self,
        module: nn.Module,
        *,
        comm_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = False,
    ):
        params = trainable_parameters(module)
        super().__init__(
            module,
            per_parameter_buckets(params, reverse=False),
            overlap=False,
            blocking=True,
            comm_dtype=comm_dtype,
            process_group=process_group,
            broadcast_buffers=broadcast_buffers,
        )
