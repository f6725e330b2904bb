"""Under torchrun (env://) a failing rank is reported the same way: which rank, and its traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cs336_systems.distributed.launch import find_free_port
from cs336_systems.results import REPO_ROOT

SCRIPT = textwrap.dedent('''
    import sys
    import torch.distributed as dist
    from cs336_systems.distributed import runner

    def work():
        if dist.get_rank() == 1:
            raise ValueError("injected on rank 1")
        dist.barrier()

    runner.run_on_ranks(work, 2, backend="gloo", timeout_s=float(sys.argv[1]))
''')


@pytest.mark.slow
def test_torchrun_names_the_failing_rank_with_its_traceback(tmp_path) -> None:
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(find_free_port()), str(script), "20"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Root Cause (first observed failure)" in report
    root = report[report.index("Root Cause (first observed failure)"):]
    assert "rank      : 1" in root and "ValueError: injected on rank 1" in root, root[-2000:]


def test_a_rank_failing_because_a_peer_went_away_fails_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun reports the earliest failure (whole seconds, lowest rank among equals) as the root cause, so a rank
    whose collective broke because a peer exited waits before it fails; any other error is raised at once."""
    from cs336_systems.distributed import runner

    slept: list[float] = []
    monkeypatch.setattr(runner.time, "sleep", slept.append)

    def broken_barrier() -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:33513")

    def own_error() -> None:
        raise ValueError("injected on rank 1")

    with pytest.raises(RuntimeError, match="closed by peer"):
        runner._failing_after_peers(broken_barrier)()
    assert slept == [runner.PEER_GONE_GRACE_S] and runner.PEER_GONE_GRACE_S >= 1.0  # timestamps are whole seconds
    with pytest.raises(ValueError, match="injected"):
        runner._failing_after_peers(own_error)()
    assert slept == [runner.PEER_GONE_GRACE_S] and runner._failing_after_peers(lambda: 3)() == 3
