"""The local launcher: results come back per rank, failures surface with their traceback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed import launch


def _rank_sum(scale: int) -> dict:
    ctx = launch.current_context()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": t.item() * scale}


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever here without the launcher tearing everything down


def test_spawn_gathers_results_in_rank_order() -> None:
    out = launch.spawn(_rank_sum, 2, 10, backend="gloo")
    assert out == [{"rank": 0, "world": 2, "sum": 30.0}, {"rank": 1, "world": 2, "sum": 30.0}]


def test_a_crashing_rank_ends_the_run_with_its_traceback() -> None:
    with pytest.raises(launch.WorkerError, match=r"rank 1 of 2 failed first:(.|\n)*boom on rank 1"):
        launch.spawn(_fail_on_rank_one, 2, backend="gloo", timeout_s=60)


def test_recorded_failures_ignore_an_error_file_its_rank_did_not_finish(tmp_path) -> None:
    """A rank terminated while recording its error leaves only a ``.partial`` file, which must neither
    break the report nor win it."""
    result = str(tmp_path / "results.pt")
    (tmp_path / "results.pt.error-0.partial").write_text("")
    (tmp_path / "results.pt.error-1").write_text("12.5\nTraceback: boom on rank 1\n")
    (tmp_path / "results.pt.error-2").write_text("13.0\nTraceback: connection reset\n")
    assert launch._recorded_failures(result) == {1: (12.5, "Traceback: boom on rank 1\n"),
                                                 2: (13.0, "Traceback: connection reset\n")}
    assert launch._recorded_failures(str(tmp_path / "other.pt")) == {}


def test_a_killed_rank_beats_the_peer_that_lost_its_connection() -> None:
    """The survivor's "connection reset" may be recorded before the launcher sees the killed rank's exit;
    it is a consequence, so the killed rank is still named as the cause."""
    recorded = {0: (10.0, "Traceback...\nRuntimeError: [gloo] Connection reset by peer")}
    err = launch.diagnose(2, recorded, {0: (10.2, 1), 1: (10.1, -9)}, set(), 60)
    assert err.rank == 1 and err.cause.startswith("killed by SIGKILL")
    assert "raised RuntimeError: [gloo] Connection reset by peer" in err.outcomes[0]
    hung = launch.diagnose(2, {0: (5.0, "RuntimeError: Timed out waiting 3000ms for recv")}, {0: (5.1, 1)}, {1}, 3)
    assert hung.rank == 0 and "timed out after 3 s" in hung.cause and "never reached the collective" in str(hung)


def test_impossible_world_sizes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        launch.check_world_size(0, "gloo")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="CUDA device"):
            launch.spawn(_rank_sum, 64, 1, backend="nccl")


def test_free_ports_are_usable() -> None:
    import socket

    ports = {launch.find_free_port() for _ in range(3)}
    for port in ports:  # a listener can bind each one: the rendezvous will not collide with a busy port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_gloo_ranks_share_the_cores_however_they_were_started(monkeypatch) -> None:
    import os

    cores = os.cpu_count() or 1
    assert launch.threads_per_rank("gloo", {"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert launch.threads_per_rank("gloo", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "4"}) is None
    assert launch.threads_per_rank("nccl", {"LOCAL_WORLD_SIZE": "2"}) is None
    assert launch.threads_per_rank("gloo", {"LOCAL_WORLD_SIZE": "1"}) is None


def _threads() -> int:
    return torch.get_num_threads()


@pytest.mark.slow
def test_slurm_started_ranks_get_their_share_of_threads(monkeypatch) -> None:
    """Started the Slurm way (no torchrun): SLURM_NTASKS_PER_NODE becomes LOCAL_WORLD_SIZE, so each rank
    of a node gets its share of the cores, as spawned ranks do."""
    import os

    from cs336_systems.distributed import runner

    port = launch.find_free_port()
    script = (
        "import os, sys, torch\n"
        "from cs336_systems.distributed import launch\n"
        "launch.init_process_group('gloo', 30)\n"
        "print(torch.get_num_threads())\n"
        "launch.destroy_process_group()\n"
    )
    import subprocess
    import sys

    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS",
                                                               "LOCAL_WORLD_SIZE", "MASTER_PORT")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in done]
    outs = [out.strip() for out, _ in done]
    assert outs == [str(max(1, (os.cpu_count() or 1) // 2))] * 2
    assert runner.launched_externally() is False  # this test process itself stays unlaunched


# --- a rank has finished only when its function returned ---------------------------------------------


def _exit_early_on_rank_one(how: str, peer_sleep_s: float) -> None:
    import os
    import sys
    import time

    if dist.get_rank() == 1:
        if how == "os._exit":
            os._exit(0)
        sys.exit(0)
    time.sleep(peer_sleep_s)
    dist.barrier()  # rank 1 is gone: rank 0's error here is a consequence


@pytest.mark.parametrize("how", ["os._exit", "sys.exit"])
def test_a_rank_that_exits_with_code_0_before_returning_is_the_cause(how: str) -> None:
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(_exit_early_on_rank_one, 2, how, 0.0, backend="gloo", timeout_s=30)
    err = info.value
    assert err.rank == 1 and "before its function returned" in err.cause, str(err)
    assert "finished" not in err.outcomes[1]


def _exit_0() -> None:
    import os

    os._exit(0)


def test_a_single_rank_that_exits_with_code_0_is_no_result() -> None:
    with pytest.raises(launch.WorkerError, match="rank 0 of 1 failed first: exited with code 0 before its"):
        launch.spawn(_exit_0, 1, backend="gloo", timeout_s=30)


def test_an_early_exit_with_code_0_starts_the_grace_period() -> None:
    """Rank 0 is busy for 20 s; rank 1's exit is a failure, so rank 0 is stopped after grace_s."""
    import time

    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(_exit_early_on_rank_one, 2, "os._exit", 20.0, backend="gloo", grace_s=0.2)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and "stopped by the launcher" in info.value.outcomes[0], str(info.value)


def test_the_first_rank_to_exit_is_blamed_whatever_its_exit_code() -> None:
    timed_out = {0: (10.5, "Traceback...\nRuntimeError: Timed out waiting 3000ms for recv")}
    early = launch.diagnose(2, timed_out, {0: (10.6, 1), 1: (10.1, 0)}, set(), 3, finished=set())
    assert early.rank == 1 and early.cause.startswith("exited with code 0 before its function returned")
    # Exit code 0 after the function returned is a finished rank, not a cause.
    done = launch.diagnose(2, timed_out, {0: (10.6, 1), 1: (10.1, 0)}, set(), 3, finished={1})
    assert done.rank == 0 and done.outcomes[1] == "finished"


# --- timeout_s limits the whole run ------------------------------------------------------------------


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_timeout_s_limits_the_whole_run(world_size: int) -> None:
    """Every rank sleeps for 30 s: at timeout_s all are stopped (grace_s does not extend the limit)."""
    import time

    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(_sleep, world_size, 30.0, backend="gloo", timeout_s=1, grace_s=5)
    elapsed = time.monotonic() - start
    assert elapsed < 1 + 1.5, f"took {elapsed:.1f} s"
    running = ", ".join(map(str, range(world_size)))
    assert str(info.value).startswith(f"the run exceeded timeout_s=1 s with rank(s) {running} still running")
    assert info.value.rank == 0
    assert all("stopped by the launcher" in o for o in info.value.outcomes.values()), info.value.outcomes


def _sleep_on_rank_one(seconds: float) -> None:
    if dist.get_rank() == 1:
        _sleep(seconds)
    dist.barrier()


def test_a_collective_timeout_below_the_limit_names_the_hung_rank() -> None:
    import time

    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as info:
        launch.spawn(_sleep_on_rank_one, 2, 30.0, backend="gloo", timeout_s=20, collective_timeout_s=0.5,
                     grace_s=0.2)
    err = info.value
    assert time.monotonic() - start < 5
    assert err.rank == 0 and "timed out after 0.5 s" in err.cause, str(err)
    assert "rank(s) 1 never reached the collective" in str(err) and "exceeded" not in str(err)


def _collective_timeout_s() -> float:
    pg = dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


@pytest.mark.parametrize(
    ("timeouts", "expected"),
    [({}, launch.DEFAULT_TIMEOUT_S), ({"timeout_s": 7}, 7.0), ({"collective_timeout_s": 2}, 2.0),
     ({"timeout_s": 7, "collective_timeout_s": 2}, 2.0)],
)
def test_collectives_time_out_after_the_limit_or_the_default(timeouts: dict, expected: float) -> None:
    assert launch.spawn(_collective_timeout_s, 1, backend="gloo", **timeouts) == [expected]


def test_run_on_ranks_sets_no_limit_unless_asked(monkeypatch) -> None:
    """Spawned, both timeouts reach spawn as given (``None``: no limit); under torchrun only collectives can
    be bounded: by collective_timeout_s, else timeout_s, else DEFAULT_TIMEOUT_S."""
    from cs336_systems.distributed import runner

    seen: list[object] = []

    def fake_spawn(fn, nproc, *args, backend=None, timeout_s=None, collective_timeout_s=None, **kwargs):
        seen.append((timeout_s, collective_timeout_s))
        return [None] * nproc

    def fake_init(backend=None, timeout_s=launch.DEFAULT_TIMEOUT_S, device_type=None):
        seen.append(timeout_s)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch, "spawn", fake_spawn)
    monkeypatch.setattr(launch, "init_process_group", fake_init)
    runner.run_on_ranks(_rank_sum, 2, 1)
    runner.run_on_ranks(_rank_sum, 2, 1, timeout_s=60, collective_timeout_s=5)
    assert seen == [(None, None), (60, 5)]
    seen.clear()
    monkeypatch.setattr(runner, "launched_externally", lambda: True)
    for timeouts in ({}, {"timeout_s": 60}, {"timeout_s": 60, "collective_timeout_s": 5}):
        with pytest.raises(RuntimeError, match="stop here"):
            runner.run_on_ranks(_rank_sum, 2, 1, **timeouts)
    assert seen == [launch.DEFAULT_TIMEOUT_S, 60, 5]


# --- the rendezvous: localhost only, and a busy port is a clear, bounded failure ----------------------


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    import socket
    import struct

    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word in host byte order.
            raw = b"".join(struct.pack("=I", int(address[i:i + 8], 16)) for i in range(0, len(address), 8))
            found.add(socket.inet_ntop(family, raw))
    return found


def _store_addresses() -> set[str]:
    import os

    return _listening_addresses(int(os.environ["MASTER_PORT"]))


def test_the_rendezvous_store_listens_on_localhost_only() -> None:
    import os

    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux's /proc/net/tcp")
    assert launch.spawn(_store_addresses, 2, backend="gloo", timeout_s=30) == [{"127.0.0.1"}] * 2


@pytest.mark.slow
def test_a_port_in_use_fails_every_rank_in_time_naming_rank_0s_bind_error(monkeypatch) -> None:
    """Rank 0 cannot listen; rank 1 would wait for the store until its timeout. Every rank ends within
    timeout_s even though grace_s is longer, and the cause is rank 0's error."""
    import socket
    import time

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setattr(launch, "find_free_port", lambda: busy.getsockname()[1])
        start = time.monotonic()
        with pytest.raises(launch.WorkerError) as info:
            launch.spawn(_rank_sum, 2, 1, backend="gloo", timeout_s=1.5, grace_s=5)
        elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < 1.5 + 1, f"took {elapsed:.1f} s"
    assert err.rank == 0 and "address already in use" in err.cause.lower(), str(err)
    assert "stopped by the launcher" in err.outcomes[1]


# --- arguments are checked before any process starts -----------------------------------------------


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        *[({"timeout_s": v}, "timeout_s") for v in (float("nan"), float("inf"), 0, -1.0, "3", True)],
        *[({"collective_timeout_s": v}, "collective_timeout_s") for v in (float("nan"), 0, "3", True, 6)],
        *[({"world_size": v}, "world_size") for v in (2.5, "2", True, 0)],
        *[({"grace_s": v}, "grace_s") for v in (float("nan"), float("inf"), -0.5, True, "1", None)],
        ({"fn": None}, "fn"),
        ({"fn": 42}, "fn"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(monkeypatch, bad: dict, name: str) -> None:
    def no_processes(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(launch.mp, "start_processes", no_processes)
    call = {"fn": _rank_sum, "world_size": 2, "timeout_s": 5, "grace_s": 1.0} | bad
    with pytest.raises(ValueError, match=f"^{name} must be") as info:
        launch.spawn(call.pop("fn"), call.pop("world_size"), 1, backend="gloo", **call)
    assert "\n" not in str(info.value)


def test_an_interrupted_launcher_leaves_no_rank_running(monkeypatch) -> None:
    """Ctrl-C in the parent (a notebook's interrupt) while the ranks run: every rank is stopped."""
    import multiprocessing

    started: list = []

    def interrupted(processes, *args, **kwargs):
        started.extend(processes)
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_supervise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.spawn(_sleep, 2, 30.0, backend="gloo")
    assert started and not any(p.is_alive() for p in started)
    assert not multiprocessing.active_children()
