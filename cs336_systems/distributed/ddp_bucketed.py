"""Bucketed data parallelism: overlap *and* few collective calls.

Parameters are grouped, in reverse ``parameters()`` order, into buckets of at most ``bucket_size_mb``
MiB; a bucket's asynchronous all-reduce starts when its last gradient is ready. Small buckets start
communicating early but pay the per-call overhead often; large buckets pay it rarely but leave more
communication after backward (the last bucket cannot overlap). ``overhead_model`` derives the optimum;
``benchmark`` measures the sweep. This is the design of ``torch.nn.parallel.DistributedDataParallel``
(whose default cap is 25 MiB).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cs336_systems.distributed.grad_sync import DataParallel, bucket_size_mb_value, size_capped_buckets

DEFAULT_BUCKET_SIZE_MB = 25.0


class DDPBucketed(DataParallel):
    """Buckets of ≤ ``bucket_size_mb`` MiB (``None``: a single bucket), each with a flat gradient buffer
    reused across steps, all-reduced asynchronously as soon as complete. With
    ``gradient_as_bucket_view=True`` parameters' ``.grad`` are views of those buffers, so gradients are
    neither copied in nor copied back (``torch`` DDP's option of the same name; off by default, as there).
    Measurements of both paths against ``torch`` DDP, and why the views matter most when the step is
    host-bound, are in ``docs/ddp/NOTES.md``."""

    overlap = True
    supports_grad_views = True

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = DEFAULT_BUCKET_SIZE_MB, **options: Any):
        """``options``: see :class:`~cs336_systems.distributed.grad_sync.DataParallel`."""
        self._bucket_size_mb = bucket_size_mb_value(bucket_size_mb)  # read by plan_buckets in the shared constructor
        super().__init__(module, **options)

    @property
    def bucket_size_mb(self) -> float | None:
        return self._bucket_size_mb

    def plan_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return size_capped_buckets(params, self._bucket_size_mb)
