"""Strategy names → wrappers, so benchmarks, CLIs and notebooks select a strategy by string."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.consistency import CheckEvery, DetectNonfinite
from cs336_systems.distributed.ddp_bucketed import DEFAULT_BUCKET_SIZE_MB, DDPBucketed
from cs336_systems.distributed.ddp_flat import DataParallelFlat
from cs336_systems.distributed.ddp_naive import DataParallelNaive
from cs336_systems.distributed.ddp_overlap import DDPIndividualParameters
from cs336_systems.distributed.grad_sync import DataParallel

STRATEGIES: dict[str, type[DataParallel]] = {
    "naive": DataParallelNaive,
    "flat": DataParallelFlat,
    "individual": DDPIndividualParameters,
    "bucketed": DDPBucketed,
}


def wrap(
    module: nn.Module,
    strategy: str,
    *,
    bucket_size_mb: float | None = DEFAULT_BUCKET_SIZE_MB,
    comm_dtype: torch.dtype | None = None,
    process_group: dist.ProcessGroup | None = None,
    gradient_as_bucket_view: bool = False,
    broadcast_buffers: bool = True,
    check_every: CheckEvery = "auto",
    detect_nonfinite: DetectNonfinite = "auto",
) -> DataParallel:
    """Wrap ``module`` with the named strategy (``bucket_size_mb`` only applies to ``bucketed``;
    ``gradient_as_bucket_view`` to the strategies with multi-parameter buckets, ``flat`` and ``bucketed``;
    the other options: :class:`~cs336_systems.distributed.grad_sync.DataParallel`)."""
    try:
        cls = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown DDP strategy {strategy!r}; valid: {', '.join(STRATEGIES)}") from None
    options = dict(comm_dtype=comm_dtype, process_group=process_group, broadcast_buffers=broadcast_buffers,
                   gradient_as_bucket_view=gradient_as_bucket_view, check_every=check_every,
                   detect_nonfinite=detect_nonfinite)
    if cls is DDPBucketed:
        return DDPBucketed(module, bucket_size_mb, **options)
    return cls(module, **options)
