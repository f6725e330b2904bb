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
    with pytest.raises(ValueError, match="world_size must be >= 1"):
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
