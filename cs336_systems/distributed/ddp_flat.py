"""Flat data parallelism: after backward, every gradient is copied into one flat buffer and averaged
with a single all-reduce.

One collective instead of hundreds removes the per-call latency of the naive strategy (the buffer is
allocated once and reused), but communication still starts only after backward has finished.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.grad_sync import DataParallel, size_capped_buckets, trainable_parameters


class DataParallelFlat(DataParallel):
    """One bucket holding every trainable parameter (one per dtype/device if the model mixes them),
    reduced in :meth:`finish_gradient_synchronization`."""

    def __init__(
        self,
        module: nn.Module,
        *,
        comm_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = False,
        gradient_as_bucket_view: bool = False,
    ):
        params = trainable_parameters(module)
        super().__init__(
            module,
            size_capped_buckets(params, None),
            overlap=False,
            comm_dtype=comm_dtype,
            process_group=process_group,
            broadcast_buffers=broadcast_buffers,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
