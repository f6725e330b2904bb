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
