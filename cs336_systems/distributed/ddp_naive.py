"""Naive data parallelism: after backward, one blocking all-reduce per parameter.

The baseline every other strategy improves on. It pays one collective's fixed latency per parameter
(hundreds of calls for a Transformer) and communicates only after the whole backward pass, so none of
the communication hides behind computation.
"""

from __future__ import annotations

from torch import nn

from cs336_systems.distributed.grad_sync import DataParallel, per_parameter_buckets


class DataParallelNaive(DataParallel):
    """Broadcast rank 0's parameters at wrap time; :meth:`finish_gradient_synchronization` all-reduces
    every gradient separately (blocking, in ``parameters()`` order) and averages it. Options: see
    :class:`~cs336_systems.distributed.grad_sync.DataParallel`."""

    blocking = True

    def plan_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return per_parameter_buckets(params, reverse=False)
