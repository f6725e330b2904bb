"""Data parallelism that overlaps communication with backward, one parameter at a time.

Each parameter gets a ``register_post_accumulate_grad_hook``; as soon as its gradient is accumulated
the hook starts an asynchronous all-reduce (``async_op=True``), and backward continues computing earlier
layers' gradients while the collective runs on NCCL's stream. :meth:`finish_gradient_synchronization`
only waits for the handles. The price is one collective call per parameter, as in the naive strategy.
"""

from __future__ import annotations

from torch import nn

from cs336_systems.distributed.grad_sync import DataParallel, per_parameter_buckets


class DDPIndividualParameters(DataParallel):
    """Per-parameter asynchronous all-reduce launched from gradient hooks (reverse ``parameters()``
    order, the order backward produces them). Options: see
    :class:`~cs336_systems.distributed.grad_sync.DataParallel`."""

    overlap = True

    def plan_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return per_parameter_buckets(params, reverse=True)
