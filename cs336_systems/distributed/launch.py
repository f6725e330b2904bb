"""Starting ``torch.distributed`` workers: under ``torchrun``/``srun`` (env:// rendezvous) or, from
notebooks and tests, as N local processes spawned on a free port.

Both paths end in :func:`init_process_group`, so strategy code never knows how it was launched.
A crashed rank ends the whole run with its traceback (``torch.multiprocessing.spawn`` terminates the
others), and every collective has a timeout, so a lost peer is an error rather than a hang.
"""

from __future__ import annotations

import datetime
import glob
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_backend(device_type: str | None = None) -> str:
    """NCCL when GPUs are used, gloo otherwise."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device_type == "cuda" else "gloo"


def find_free_port() -> int:
    """A TCP port the OS reports free on localhost (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_world_size(world_size: int, backend: str) -> None:
    """Clear errors for impossible process counts instead of a hang at the first collective."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl":
        available = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local > available:
            raise ValueError(
                f"asked for {local} processes with NCCL on this node but only {available} CUDA device(s) exist"
            )


def init_process_group(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str | None = None
) -> DistContext:
    """Join the process group described by the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) as set by torchrun, srun wrappers or :func:`spawn`."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # Plain `srun python -m ...` without torchrun: translate Slurm's variables.
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = backend or default_backend(device_type)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    check_world_size(world_size, backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return DistContext(rank, world_size, local_rank, backend, device)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    result_path: str,
    args: tuple,
    kwargs: dict,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if backend == "gloo":
        # Share the CPU cores instead of every rank spinning up a full thread pool.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_process_group(backend, timeout_s)
        result = fn(*args, **kwargs)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        if local_rank == 0:
            torch.save(gathered, result_path)
        dist.barrier()
    except BaseException:
        # Record when and how this rank failed: the peers' errors that follow ("connection reset")
        # are consequences, and the parent reports the earliest failure as the cause.
        # Written whole, then renamed: a rank terminated while writing (the launcher stops the others
        # once one fails) must not leave a partial file for the parent to read.
        error_path = f"{result_path}.error-{local_rank}"
        with open(error_path + ".partial", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(error_path + ".partial", error_path)
        raise
    finally:
        destroy_process_group()


class WorkerError(RuntimeError):
    """A rank raised; the message holds the traceback of the rank that failed first."""


def _first_failure(result_path: str) -> tuple[int, str] | None:
    failures = []
    for path in glob.glob(f"{result_path}.error-*"):
        suffix = path.rsplit("-", 1)[1]
        if not suffix.isdigit():  # a ".partial" file its rank did not finish writing
            continue
        stamp, _, tb = open(path).read().partition("\n")
        failures.append((float(stamp), int(suffix), tb))
    if not failures:
        return None
    _, rank, tb = min(failures)
    return rank, tb


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local processes and return each rank's result
    (rank order); the return value must be picklable.

    Inside ``fn`` the process group is initialised; :func:`current_context` describes this rank.

    CPU (gloo) workers are forked, which skips re-importing torch in every child (seconds per launch);
    GPU workers are started with ``spawn`` because CUDA cannot be used in a forked child. With
    ``spawn``, ``fn`` must be importable, i.e. defined at module level in a library module.
    """
    backend = backend or default_backend()
    check_world_size(world_size, backend)
    if start_method is None:
        start_method = "fork" if backend == "gloo" and not torch.cuda.is_initialized() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.pt")
        try:
            mp.start_processes(
                _worker,
                args=(fn, world_size, find_free_port(), backend, timeout_s, result_path, args, kwargs),
                nprocs=world_size,
                join=True,
                start_method=start_method,
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            first = _first_failure(result_path)
            if first is None:
                raise
            rank, tb = first
            raise WorkerError(f"rank {rank} of {world_size} failed first:\n{tb}") from exc
        return torch.load(result_path, weights_only=False)


def current_context() -> DistContext:
    """The :class:`DistContext` of an already initialised process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group() or use spawn()")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
