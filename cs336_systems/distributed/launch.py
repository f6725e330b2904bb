"""Starting ``torch.distributed`` workers: under ``torchrun``/``srun`` (env:// rendezvous) or, from
notebooks and tests, as N local processes spawned on a free port.

Both paths join the process group the same way (spawned ranks meet through a store that rank 0 serves on
127.0.0.1 only), so strategy code never knows how it was launched. A crashed rank ends the whole run with
its traceback (the launcher stops the others), every collective has a timeout, so a lost peer is an error
rather than a hang, and :func:`spawn` can bound the whole run's wall-clock time.
"""

from __future__ import annotations

import datetime
import glob
import math
import multiprocessing.connection as mp_connection
import numbers
import os
import re
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cs336_systems.distributed.consistency import announce_finished

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.25  # how often the launcher looks for a rank's recorded exception while waiting
_LOCALHOST = "127.0.0.1"  # MASTER_ADDR of spawned ranks


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
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
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
    return _join(backend or default_backend(device_type), timeout_s)


def _join(backend: str, timeout_s: float, store: dist.Store | None = None) -> DistContext:
    """Set this rank up (threads, device) from the env:// variables and join the process group: through
    ``store`` when given, else through a store that env:// makes from MASTER_ADDR/MASTER_PORT."""
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
        kwargs: dict[str, Any] = {}
        if store is None:
            os.environ.setdefault("MASTER_ADDR", _LOCALHOST)
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("WORLD_SIZE", str(world_size))
        else:
            kwargs["store"] = store
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return DistContext(rank, world_size, local_rank, backend, device)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous_store(rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The store through which spawned ranks meet: rank 0 serves it on 127.0.0.1 only (torch's own server
    listens on every interface, reachable from other machines), the others connect to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(_LOCALHOST, port, world_size, is_master=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_LOCALHOST, port))
        sock.listen()
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"rank 0 cannot serve the rendezvous on {_LOCALHOST}:{port} (MASTER_PORT): {e.strerror or e}"
        ) from e
    # detach(): the store closes the descriptor itself, so Python must not close it as well.
    return dist.TCPStore(
        _LOCALHOST, port, world_size, is_master=True, timeout=timeout, master_listen_fd=sock.detach()
    )


def _done_path(result_path: str, rank: int) -> str:
    return f"{result_path}.done-{rank}"


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
        MASTER_ADDR=_LOCALHOST,
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        _join(backend, timeout_s, _rendezvous_store(local_rank, world_size, port, timeout_s))
        result = fn(*args, **kwargs)
        announce_finished()  # a peer still training then fails naming the uneven steps, instead of hanging
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        if local_rank == 0:
            torch.save(gathered, result_path)
        # Only this marker says the rank finished: an exit code of 0 does not (os._exit(0) in fn gives one).
        # An empty file appears whole, so the parent never sees half a marker.
        open(_done_path(result_path, local_rank), "w").close()
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
    """A rank failed, or the run passed its time limit. The message names the rank that failed first and how
    (its exception with the traceback, its exit code, or the signal that killed it) or says that the run
    exceeded ``timeout_s`` with which ranks still running, then what became of the other ranks.
    ``rank`` is that rank (for a run past its limit with no rank failing: the lowest rank still running),
    ``cause`` a one-line description, ``outcomes`` one line per rank."""

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


def describe_exit(exitcode: int | None, finished: bool = False) -> str:
    """How a worker process ended, in words, for one that left no Python traceback. ``finished``: its
    function returned and its result was handed over; without that, even exit code 0 is a failure."""
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
    if exitcode == 0:
        if finished:
            return "finished"
        return "exited with code 0 before its function returned (os._exit or sys.exit in the function)"
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


def _ranks(ranks: Collection[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def diagnose(
    world_size: int,
    recorded: dict[int, tuple[float, str]],
    exits: dict[int, tuple[float, int | None]],
    stopped: set[int],
    timeout_s: float,
    *,
    finished: Collection[int] | None = None,
    over_limit: Collection[int] | None = None,
    limit_s: float | None = None,
) -> WorkerError:
    """Turn what the workers left behind into one :class:`WorkerError` naming the root cause.

    ``recorded``: rank -> (time, traceback) of ranks that raised; ``exits``: rank -> (time observed, exit
    code) of ranks that ended (``None``: still running when the launcher stopped); ``stopped``: ranks the
    launcher terminated itself; ``timeout_s``: the collective timeout. ``finished``: ranks whose function
    returned and whose result was handed over (``None``: every rank that exited with code 0); a rank that
    exited before that failed, whatever its exit code. ``over_limit``: ranks still running when the run
    passed its limit of ``limit_s`` (default ``timeout_s``) and were stopped (``None``: it did not).

    A rank that raised because its peer vanished (connection reset, broken pipe) is a consequence and loses
    to any other failure; otherwise the earliest failure wins, an exit with code 0 included. A run past its
    limit with no failure is reported as such, naming the ranks that were still running.
    """
    if finished is None:
        finished = {rank for rank, (_, code) in exits.items() if code == 0}
    failures: list[_Failure] = []
    for rank, (when, tb) in recorded.items():
        last = _last_line(tb)
        if last.startswith("SystemExit"):  # recorded, yet the exit code may be 0
            last = f"called sys.exit before its function returned ({last})"
        elif _TIMEOUT.search(last) and not _PEER_LOSS.search(last):
            last = f"a collective timed out after {timeout_s:g} s waiting for its peers ({last})"
        failures.append(_Failure(rank, when, last, tb, bool(_PEER_LOSS.search(tb))))
    for rank, (when, code) in exits.items():
        if rank in recorded or rank in stopped or (code == 0 and rank in finished):
            continue
        failures.append(_Failure(rank, when, describe_exit(code), describe_exit(code), False))
    outcomes = {}
    for rank in range(world_size):
        if rank in recorded:
            outcomes[rank] = "raised " + _last_line(recorded[rank][1])
        elif rank in stopped:
            outcomes[rank] = "was still running (hung or waiting) and was stopped by the launcher"
        elif rank in exits:
            outcomes[rank] = describe_exit(exits[rank][1], rank in finished)
        else:
            outcomes[rank] = "unknown"
    over = None
    if over_limit is not None:
        limit = timeout_s if limit_s is None else limit_s
        over = f"the run exceeded timeout_s={limit:g} s with rank(s) {_ranks(over_limit)} still running"
    every_rank = False  # list every rank's fate, not only the others'
    if failures:
        first = min(failures, key=lambda f: (f.consequence, f.time, f.rank))
        headline = f"rank {first.rank} of {world_size} failed first: {first.cause}"
    elif over is not None and over_limit:
        # Nothing failed by itself: the limit is the cause, and no rank failed first.
        first = _Failure(min(over_limit), 0.0, over, "", False)
        headline, over, every_rank = over, None, True
    else:
        first = _Failure(-1, 0.0, "the workers ended without a result", "", False)
        headline = f"rank {first.rank} of {world_size} failed first: {first.cause}"
    others = "\n".join(f"  rank {r}: {o}" for r, o in outcomes.items() if every_rank or r != first.rank)
    hung = [r for r in sorted(stopped) if r != first.rank]
    if hung and "timed out" in first.cause:
        others += f"\n  (rank(s) {_ranks(hung)} never reached the collective: look there for the hang)"
    message = headline
    if first.detail and first.detail != first.cause:
        message += f"\n{first.detail.rstrip()}"
    if others:
        message += f"\n{'ranks' if every_rank else 'other ranks'}:\n{others}"
    if over is not None:
        message += f"\n{over}"
    return WorkerError(message, first.rank, first.cause, outcomes)


def _check_seconds(name: str, value: Any, positive: bool, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        also = " or None" if none_ok else ""
        raise ValueError(f"{name} must be a finite number of seconds {bound}{also}, got {value!r}")


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    start_method: str | None = None,
    grace_s: float = 2.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local processes and return each rank's result
    (rank order); the return value must be picklable.

    Inside ``fn`` the process group is initialised; :func:`current_context` describes this rank. The ranks
    meet through a store that rank 0 serves on 127.0.0.1 only, on a free port.

    ``timeout_s`` limits the whole run, wall clock from this call with start-up included: when it passes,
    the ranks still running are stopped and the error says the run exceeded ``timeout_s`` and which ranks
    were still running. ``None`` (the default) sets no limit, for long benchmarks.
    ``collective_timeout_s`` bounds every collective (and the rendezvous), so a rank that hangs turns into a
    timeout on its peers, which names the rank that never arrived; it may not exceed ``timeout_s`` and
    defaults to ``timeout_s``, or to :data:`DEFAULT_TIMEOUT_S` without a limit. Set it below ``timeout_s``
    to have hangs diagnosed before the limit stops everything.

    A rank has finished only when ``fn`` returned and its result was handed over: one that exits before
    that has failed, whatever its exit code (``os._exit(0)`` in ``fn`` too). When a rank fails, the others
    get ``grace_s`` seconds (never past ``timeout_s``) to finish or fail on their own (so their errors are
    recorded), then are terminated; :func:`diagnose` raises a :class:`WorkerError` naming the rank that
    failed first and how, whether it raised, exited or was killed by a signal.

    The arguments are checked before any process starts (``ValueError``): ``fn`` callable, ``world_size``
    an int >= 1, ``timeout_s`` and ``collective_timeout_s`` finite numbers > 0 or ``None``, ``grace_s`` a
    finite number >= 0.

    CPU (gloo) workers are forked, which skips re-importing torch in every child (seconds per launch);
    GPU workers are started with ``spawn`` because CUDA cannot be used in a forked child. With
    ``spawn``, ``fn`` must be importable, i.e. defined at module level in a library module.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")  # noqa: TRY004 - one ValueError per bad argument
    _check_seconds("timeout_s", timeout_s, positive=True, none_ok=True)
    _check_seconds("collective_timeout_s", collective_timeout_s, positive=True, none_ok=True)
    _check_seconds("grace_s", grace_s, positive=False)
    if timeout_s is not None and collective_timeout_s is not None and collective_timeout_s > timeout_s:
        raise ValueError(f"collective_timeout_s must be <= timeout_s={timeout_s}, got {collective_timeout_s}")
    backend = backend or default_backend()
    check_world_size(world_size, backend)
    if collective_timeout_s is None:
        collective_timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    collective_s = float(collective_timeout_s)
    if start_method is None:
        start_method = "fork" if backend == "gloo" and not torch.cuda.is_initialized() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.pt")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, find_free_port(), backend, collective_s, result_path, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )

        def finished(rank: int) -> bool:
            return os.path.exists(_done_path(result_path, rank))

        def raised(rank: int) -> bool:
            return os.path.exists(f"{result_path}.error-{rank}")

        try:
            exits, stopped, over_limit = _supervise(context.processes, grace_s, deadline, finished, raised)
        except BaseException:  # Ctrl-C in the parent (a notebook's interrupt): no rank may outlive it
            _stop(context.processes)
            raise
        done = {rank for rank in range(world_size) if finished(rank)}
        if stopped or len(done) < world_size or any(code != 0 for _, code in exits.values()):
            raise diagnose(world_size, _recorded_failures(result_path), exits, stopped, collective_s,
                           finished=done, over_limit=over_limit, limit_s=timeout_s)
        return torch.load(result_path, weights_only=False)


def _supervise(
    processes: list[Any],
    grace_s: float,
    deadline: float | None = None,
    finished: Callable[[int], bool] = lambda rank: True,
    raised: Callable[[int], bool] = lambda rank: False,
) -> tuple[dict[int, tuple[float, int | None]], set[int], set[int] | None]:
    """Wait for every worker; once one fails, give the rest ``grace_s`` to end, then stop them. Whatever
    still runs at ``deadline`` (the run's limit, a :func:`time.monotonic` time; ``None``: no limit) is
    stopped then. A rank fails when it ends with a non-zero exit code or before ``finished(rank)`` holds,
    or, still running, once ``raised(rank)`` holds: a rank whose exception is recorded can hang on its way
    out (NCCL's teardown waits for collectives its peers never join), so its exit is not waited for.
    Returns each rank's (time its end was observed, exit code), the ranks the launcher had to stop, and,
    if the deadline stopped them, those ranks again (else ``None``)."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    exits: dict[int, tuple[float, int | None]] = {}
    stop_at = deadline  # when the ranks still running are stopped
    failed = False
    now = time.monotonic()  # kept after the loop: did the deadline end it?
    while len(exits) < len(processes):
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            break
        wait_s = None if stop_at is None else stop_at - now
        if not failed:  # look for recorded exceptions now and then
            wait_s = _POLL_S if wait_s is None else min(wait_s, _POLL_S)
        ready = mp_connection.wait([s for s, r in sentinels.items() if r not in exits], timeout=wait_s)
        observed = time.time()
        if not failed and any(raised(rank) for rank in range(len(processes)) if rank not in exits):
            failed = True
            grace_end = time.monotonic() + grace_s
            stop_at = grace_end if stop_at is None else min(stop_at, grace_end)
        for sentinel in ready:
            rank = sentinels[sentinel]
            processes[rank].join()
            code = processes[rank].exitcode
            exits[rank] = (observed, code)
            if (code != 0 or not finished(rank)) and not failed:
                failed = True
                grace_end = time.monotonic() + grace_s
                stop_at = grace_end if stop_at is None else min(stop_at, grace_end)
    stopped = {rank for rank in range(len(processes)) if rank not in exits}
    over_limit = stopped if stopped and deadline is not None and now >= deadline else None
    _stop([processes[rank] for rank in stopped])
    return exits, stopped, over_limit


def _stop(processes: list[Any]) -> None:
    """Terminate the processes still alive, then kill those that ignore it within 5 s."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def current_context() -> DistContext:
    """The :class:`DistContext` of an already initialised process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group() or use spawn()")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
