"""Run a function on every rank, however the ranks were started.

Command-line entry points call :func:`run_on_ranks`: under ``torchrun`` or ``srun`` (one process per
rank already exists) it joins the env:// process group and runs the function here; from a plain
``python -m ...`` it spawns ``nproc`` local workers with :func:`cs336_systems.distributed.launch.spawn`.
Either way every rank's return value comes back, in rank order.

Failure is loud in both modes and names the rank that failed first: ``spawn`` raises a
:class:`~cs336_systems.distributed.launch.WorkerError` with its traceback, exit code or signal;
under ``torchrun`` the function runs under ``torch.distributed.elastic``'s ``record``, so torchrun's
root-cause report carries the traceback too. The process group's timeout turns a lost peer into an
error instead of a hang; spawned ranks can also be given a limit on the whole run.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed import launch
from cs336_systems.distributed.consistency import announce_finished


def launched_externally() -> bool:
    """True under ``torchrun`` (RANK/WORLD_SIZE set) or a multi-task ``srun`` step."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def launched_world_size() -> int | None:
    """The world size torchrun or srun started, or None where this process spawns its own ranks."""
    if not launched_externally():
        return None
    return int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])


def check_local_gpus(nproc: Sequence[int], fix: str, backend: str | None = None) -> None:
    """Before any rank starts (and before a GPU job calibrates): one line, ending in ``fix``, when spawning the
    largest of ``nproc`` NCCL ranks needs more GPUs than this machine has. Nothing to check under torchrun or
    srun (the launcher placed the ranks), on gloo, or without CUDA."""
    if launched_externally() or backend not in (None, "nccl") or not torch.cuda.is_available():
        return
    if max(nproc) > torch.cuda.device_count():
        raise ValueError(f"nproc={list(nproc)} needs {max(nproc)} GPUs and this machine has "
                         f"{torch.cuda.device_count()}: {fix}")


def is_main_process() -> bool:
    """Rank 0 under torchrun/srun; always true for the parent of spawned workers."""
    if not launched_externally():
        return True
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


#: What a collective raises on a rank whose peer process went away (gloo's TCP transport).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
#: How long such a rank waits before it fails. torchrun names as root cause the failure with the smallest
#: timestamp, in whole seconds, and the lowest rank among equals: without the wait, a rank whose barrier broke
#: because rank 1 raised could fail in the same second and be reported instead of rank 1. Meanwhile torchrun
#: usually stops it.
PEER_GONE_GRACE_S = 2.0


def _failing_after_peers(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, except that an error caused by a peer's exit is raised :data:`PEER_GONE_GRACE_S` later."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            if any(words in str(error) for words in PEER_GONE):
                time.sleep(PEER_GONE_GRACE_S)
            raise

    return wrapped


def run_on_ranks(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank; returns the list of per-rank results (on every rank).

    Spawned, both timeouts are :func:`~cs336_systems.distributed.launch.spawn`'s: ``timeout_s`` limits the
    whole run (``None``: no limit) and ``collective_timeout_s`` bounds every collective (default
    ``timeout_s``, else ``launch.DEFAULT_TIMEOUT_S``). Under torchrun/srun this process cannot stop its
    peers, so only collectives are bounded (a hung peer becomes a timeout error), by
    ``collective_timeout_s``, else ``timeout_s``, else ``launch.DEFAULT_TIMEOUT_S``; the job's own time
    limit bounds the run."""
    if not launched_externally():
        return launch.spawn(fn, nproc, *args, backend=backend, timeout_s=timeout_s,
                            collective_timeout_s=collective_timeout_s, **kwargs)
    from torch.distributed.elastic.multiprocessing.errors import record

    given = [t for t in (collective_timeout_s, timeout_s) if t is not None]
    launch.init_process_group(backend, given[0] if given else launch.DEFAULT_TIMEOUT_S)
    # record(): the traceback goes to torchrun's error file, so torchrun's "Root Cause (first observed
    # failure)" report shows it beside the rank and exit code (or the signal, for a killed rank).
    result = record(_failing_after_peers(fn))(*args, **kwargs)
    announce_finished()  # a peer still training fails naming the uneven steps instead of hanging
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    launch.destroy_process_group()
    return gathered
