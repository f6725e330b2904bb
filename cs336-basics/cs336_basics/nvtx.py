"""Optional NVTX ranges.

Profilers (Nsight Systems, and torch.profiler which records NVTX ranges as user annotations when
``record_function`` is used alongside) show these ranges on the timeline. They are off by default
because pushing a range costs a few microseconds of host time per call, which is visible in
small-model benchmarks. Turn them on with :func:`set_enabled` or ``CS336_NVTX=1``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_enabled = os.environ.get("CS336_NVTX", "0") not in ("", "0", "false", "False")


def set_enabled(enabled: bool) -> None:
    """Turn NVTX annotation of the model and training loop on or off (process-wide)."""
    global _enabled
    _enabled = bool(enabled)


def is_enabled() -> bool:
    return _enabled


def range(name: str) -> contextlib.AbstractContextManager[None]:  # noqa: A001 - mirrors torch.cuda.nvtx.range
    """An NVTX range plus a ``torch.profiler`` record_function when annotation is on; else a
    ``nullcontext`` (cheap, and transparent to ``torch.compile``).

    Both are emitted so the same names show up in Nsight Systems and in torch.profiler traces.
    """
    return _annotated(name) if _enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _annotated(name: str) -> Iterator[None]:
    use_nvtx = torch.cuda.is_available()
    if use_nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if use_nvtx:
            torch.cuda.nvtx.range_pop()
