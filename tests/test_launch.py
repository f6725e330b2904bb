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


def test_first_failure_ignores_an_error_file_its_rank_did_not_finish(tmp_path) -> None:
    """A rank terminated while recording its error leaves only a ``.partial`` file, which must neither
    break the report nor win it."""
    result = str(tmp_path / "results.pt")
    (tmp_path / "results.pt.error-0.partial").write_text("")
    (tmp_path / "results.pt.error-1").write_text("12.5\nTraceback: boom on rank 1\n")
    (tmp_path / "results.pt.error-2").write_text("13.0\nTraceback: connection reset\n")
    assert launch._first_failure(result) == (1, "Traceback: boom on rank 1\n")
    assert launch._first_failure(str(tmp_path / "other.pt")) is None


def test_impossible_world_sizes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch.check_world_size(0, "gloo")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="CUDA device"):
            launch.spawn(_rank_sum, 64, 1, backend="nccl")


def test_free_ports_are_usable() -> None:
    port = launch.find_free_port()
    assert 1024 < port < 65536
