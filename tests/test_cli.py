"""Command-line behaviour shared by every entry point: one-line errors and exit statuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cs336_systems.cli import EXIT_FAILURE, EXIT_USAGE, parse_value, run_main


def test_run_main_maps_exceptions_to_one_line_and_a_status(capsys, monkeypatch) -> None:
    monkeypatch.delenv("CS336_TRACEBACK", raising=False)

    def bad_input() -> None:
        raise ValueError("unknown model preset 'Smal'\nmore")

    def broken() -> None:
        raise RuntimeError("")

    assert run_main(bad_input, "prog") == EXIT_USAGE
    assert capsys.readouterr().err == "prog: error: unknown model preset 'Smal'\n"
    assert run_main(broken, "prog") == EXIT_FAILURE
    assert "prog: failed: RuntimeError: (no message)" in capsys.readouterr().err
    assert run_main(lambda: None, "prog") == 0 and run_main(lambda: 3, "prog") == 3
    monkeypatch.setenv("CS336_TRACEBACK", "1")
    with pytest.raises(ValueError):
        run_main(bad_input, "prog")


def test_values_are_literals_words_or_comma_lists() -> None:
    assert parse_value("[1, 2]") == [1, 2] and parse_value("1,2") == [1, 2] and parse_value("(1, 2)") == [1, 2]
    assert parse_value("xl@2026") == "xl@2026" and parse_value("None") is None


@pytest.mark.parametrize(("argv", "message"), [
    (["-m", "cs336_systems.benchmarking", "model", "--size", "Smal"], "unknown model preset 'Smal'"),
    (["-m", "cs336_systems.benchmarking", "model", "--size", "small", "--num-heads", "7"],
     "d_model 768 is not divisible by num_heads 7"),
    (["-m", "cs336_systems.experiments", "benchmarking", "--smoke", "--set", "sizes=Smal"],
     "unknown model preset 'Smal'"),
    (["-m", "cs336_systems.experiments", "memory_profiling", "--smoke", "--set", "context_lengths=abc"],
     "memory_profiling.context_lengths must be int, got 'abc'"),
])
def test_entry_points_end_bad_input_with_one_line(argv, message) -> None:
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr[-2000:]


def test_gpu_grids_are_refused_at_once_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "cs336_systems.experiments", "pytorch_attention", "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and proc.stderr.count("\n") == 1
    assert "pytorch_attention --quick needs a CUDA GPU and this machine has 0: run --smoke" in proc.stderr
