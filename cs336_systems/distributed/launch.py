"""Starting ``torch.distributed`` workers: under ``torchrun``/``srun`` (env:// rendezvous) or, from
notebooks and tests, as N local processes spawned on a free port.

Both paths end in :func:`init_process_group`, so strategy code never knows how it was launched.
A crashed rank ends the whole run with its traceback (``torch.multiprocessing.spawn`` terminates the
others), and every collective has a timeout, so a lost peer is an error rather than a hang.
"""

from __future__ import annotations

import datetime
import glob
import multiprocessing.connection as mp_connection
import os
import re
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
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


def threads_per_rank(backend: str, env: Mapping[str, str]) -> int | None:
    """CPU threads for one gloo rank when several share a node: the cores divided among the node's ranks,
    so they do not oversubscribe the CPU (which makes CPU timings meaningless). ``None`` leaves torch's
    default: one rank per node, a GPU backend, or an explicit ``OMP_NUM_THREADS``."""
    local = env.get("LOCAL_WORLD_SIZE", "")
    if backend != "gloo" or "OMP_NUM_THREADS" in env or not local.isdigit() or int(local) <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // int(local))


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
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
        if per_node.split("(")[0].isdigit():  # "2" or "2(x3)"
            os.environ.setdefault("LOCAL_WORLD_SIZE", per_node.split("(")[0])
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = backend or default_backend(device_type)
    threads = threads_per_rank(backend, os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
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
    """A rank failed. The message names the rank that failed first and how (its exception with the
    traceback, its exit code, or the signal that killed it), then what became of the other ranks.
    ``rank`` is that rank, ``cause`` a one-line description, ``outcomes`` one line per rank."""

    def __init__(self, message: str, rank: int, cause: str, outcomes: dict[int, str]):
        super().__init__(message)
        self.rank, self.cause, self.outcomes = rank, cause, outcomes


#: Error text that a rank produces when a *peer* went away: a consequence, never the first cause.
_PEER_LOSS = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|ECONNRESET|EPIPE|connection (refused|closed)|"
    r"Socket closed|peer (closed|reset)|Read error|Write error",
    re.IGNORECASE,
)
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _last_line(traceback_text: str) -> str:
    return next((ln.strip() for ln in reversed(traceback_text.strip().splitlines()) if ln.strip()), "")


def describe_exit(exitcode: int | None) -> str:
    """How a worker process ended, in words, for one that left no Python traceback."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = {
            "SIGKILL": " — often the out-of-memory killer (check `dmesg` / the job's memory limit)",
            "SIGSEGV": " — a crash in native code",
            "SIGABRT": " — an abort in native code (e.g. a collective whose sizes differ between ranks)",
            "SIGBUS": " — a bus error (often shared memory /dev/shm too small)",
        }.get(name, "")
        return f"killed by {name}{hint}"
    return f"exited with code {exitcode} without a Python exception (os._exit, sys.exit or native code)"


def _recorded_failures(result_path: str) -> dict[int, tuple[float, str]]:
    """``{rank: (time, traceback)}`` of the workers that raised (each wrote ``<result>.error-<rank>``)."""
    failures = {}
    for path in glob.glob(f"{result_path}.error-*"):
        suffix = path.rsplit("-", 1)[1]
        if not suffix.isdigit():  # a ".partial" file its rank did not finish writing
            continue
        stamp, _, tb = open(path).read().partition("\n")
        failures[int(suffix)] = (float(stamp), tb)
    return failures


@dataclass(frozen=True)
class _Failure:
    rank: int
    time: float
    cause: str  # one line
    detail: str  # the traceback, or the cause again
    consequence: bool  # the text says a peer went away: an effect of another rank's failure


def diagnose(
    world_size: int,
    recorded: dict[int, tuple[float, str]],
    exits: dict[int, tuple[float, int | None]],
    stopped: set[int],
    timeout_s: float,
) -> WorkerError:
    """Turn what the workers left behind into one :class:`WorkerError` naming the root cause.

    ``recorded``: rank -> (time, traceback) of ranks that raised; ``exits``: rank -> (time observed, exit
    code) of ranks that ended (``None``: still running when the launcher stopped); ``stopped``: ranks the
    launcher terminated itself. A rank that raised because its peer vanished (connection reset, broken
    pipe) is a consequence and loses to any other failure; otherwise the earliest failure wins.
    """
    failures: list[_Failure] = []
    for rank, (when, tb) in recorded.items():
        last = _last_line(tb)
        if _TIMEOUT.search(last) and not _PEER_LOSS.search(last):
            last = f"a collective timed out after {timeout_s:g} s waiting for its peers ({last})"
        failures.append(_Failure(rank, when, last, tb, bool(_PEER_LOSS.search(tb))))
    for rank, (when, code) in exits.items():
        if rank in recorded or rank in stopped or code == 0:
            continue
        failures.append(_Failure(rank, when, describe_exit(code), describe_exit(code), False))
    outcomes = {}
    for rank in range(world_size):
        if rank in recorded:
            outcomes[rank] = "raised " + _last_line(recorded[rank][1])
        elif rank in stopped:
            outcomes[rank] = "was still running (hung or waiting) and was stopped by the launcher"
        elif rank in exits:
            code = exits[rank][1]
            outcomes[rank] = "finished" if code == 0 else describe_exit(code)
        else:
            outcomes[rank] = "unknown"
    if not failures:
        first = _Failure(-1, 0.0, "the workers ended without a result", "", False)
    else:
        first = min(failures, key=lambda f: (f.consequence, f.time, f.rank))
    others = "\n".join(f"  rank {r}: {o}" for r, o in outcomes.items() if r != first.rank)
    hung = [r for r in sorted(stopped) if r != first.rank]
    if hung and "timed out" in first.cause:
        others += f"\n  (rank(s) {', '.join(map(str, hung))} never reached the collective: look there for the hang)"
    message = f"rank {first.rank} of {world_size} failed first: {first.cause}"
    if first.detail and first.detail != first.cause:
        message += f"\n{first.detail.rstrip()}"
    if others:
        message += f"\nother ranks:\n{others}"
    return WorkerError(message, first.rank, first.cause, outcomes)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
    grace_s: float = 2.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local processes and return each rank's result
    (rank order); the return value must be picklable.

    Inside ``fn`` the process group is initialised; :func:`current_context` describes this rank.
    ``timeout_s`` bounds every collective, so a rank that hangs turns into a timeout on its peers.

    When a rank fails, the others get ``grace_s`` seconds to finish or fail on their own (so their
    errors are recorded), then are terminated; :func:`diagnose` raises a :class:`WorkerError` naming the
    rank that failed first and how, whether it raised, exited or was killed by a signal.

    CPU (gloo) workers are forked, which skips re-importing torch in every child (seconds per launch);
    GPU workers are started with ``spawn`` because CUDA cannot be used in a forked child. With
    ``spawn``, ``fn`` must be importable, i.e. defined at module level in a library module.
    """
    backend = backend or default_backend()
    check_world_size(world_size, backend)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if start_method is None:
        start_method = "fork" if backend == "gloo" and not torch.cuda.is_initialized() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.pt")
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, find_free_port(), backend, timeout_s, result_path, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        exits, stopped = _supervise(context.processes, grace_s)
        if any(code != 0 for _, code in exits.values()) or stopped:
            raise diagnose(world_size, _recorded_failures(result_path), exits, stopped, timeout_s)
        return torch.load(result_path, weights_only=False)


def _supervise(processes: list[Any], grace_s: float) -> tuple[dict[int, tuple[float, int | None]], set[int]]:
    """Wait for every worker; once one fails, give the rest ``grace_s`` to end, then stop them. Returns
    each rank's (time its end was observed, exit code) and the ranks the launcher had to stop."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    exits: dict[int, tuple[float, int | None]] = {}
    deadline: float | None = None
    while len(exits) < len(processes):
        wait_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready = mp_connection.wait([s for s, r in sentinels.items() if r not in exits], timeout=wait_s)
        now = time.time()
        for sentinel in ready:
            rank = sentinels[sentinel]
            processes[rank].join()
            exits[rank] = (now, processes[rank].exitcode)
            if processes[rank].exitcode != 0 and deadline is None:
                deadline = time.monotonic() + grace_s
        if not ready and deadline is not None and time.monotonic() >= deadline:
            break
    stopped = {rank for rank in range(len(processes)) if rank not in exits}
    for rank in stopped:
        processes[rank].terminate()
    for rank in stopped:
        processes[rank].join(5)
        if processes[rank].is_alive():
            processes[rank].kill()
            processes[rank].join()
    return exits, stopped


def current_context() -> DistContext:
    """The :class:`DistContext` of an already initialised process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group() or use spawn()")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
