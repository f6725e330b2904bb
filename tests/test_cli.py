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


def test_a_run_that_fails_after_its_input_was_checked_exits_1_naming_its_cause(capsys, monkeypatch) -> None:
    """A ValueError from a library (pandas refusing an all-NA column) inside a section's run is a failure,
    not bad input: exit 1, the section, the cause and the variable that shows the traceback. Our own checks'
    ValueErrors stay bad input (exit 2), even where a run makes them."""
    import dataclasses

    import pandas as pd

    from cs336_systems.experiments import SECTIONS
    from cs336_systems.experiments.__main__ import PROG, main

    monkeypatch.delenv("CS336_TRACEBACK", raising=False)
    monkeypatch.setenv("CS336_FIGURES_DIR", "/nonexistent-never-written")

    def broken(params, out) -> None:
        pd.Series([float("nan")]).idxmax()

    def refuses(params, out) -> None:
        from cs336_systems.configs import get_config

        get_config("Smal")

    def empty(params, out) -> None:
        max([])  # Python's own ValueError in our code: a failure, not bad input

    for run, status, expected in ((broken, EXIT_FAILURE, "failed: model_sizes [smoke]: ValueError: "),
                                  (empty, EXIT_FAILURE, "failed: model_sizes [smoke]: ValueError: max()"),
                                  (refuses, EXIT_USAGE, "error: unknown model preset 'Smal'")):
        monkeypatch.setitem(SECTIONS, "model_sizes", dataclasses.replace(SECTIONS["model_sizes"], run=run))
        monkeypatch.setattr("cs336_systems.experiments.__main__.writer", lambda *a, **k: _NoWriter())
        assert run_main(lambda: main(["model_sizes", "--smoke"]), PROG) == status
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
        if status == EXIT_FAILURE:
            assert "CS336_TRACEBACK=1 shows the traceback" in err


class _NoWriter:
    root = dir = None

    def banner(self) -> str:
        return "test"


def test_runs_without_a_gpu_keep_kinetos_probe_quiet(monkeypatch) -> None:
    """Kineto logs "ERROR ... gpuGetDeviceCount failed" on a machine without a GPU although nothing failed:
    the entry points raise its level there, and leave a level the user set alone."""
    import torch

    from cs336_systems.cli import quiet_missing_gpu_logs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    quiet_missing_gpu_logs()
    import os

    assert os.environ["KINETO_LOG_LEVEL"] == "5"
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")
    quiet_missing_gpu_logs()
    assert os.environ["KINETO_LOG_LEVEL"] == "2"


def test_values_are_literals_words_or_comma_lists() -> None:
    assert parse_value("[1, 2]") == [1, 2] and parse_value("1,2") == [1, 2] and parse_value("(1, 2)") == [1, 2]
    assert parse_value("xl@2026") == "xl@2026" and parse_value("None") is None


@pytest.mark.slow
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


@pytest.mark.slow
def test_gpu_grids_are_refused_at_once_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "cs336_systems.experiments", "pytorch_attention", "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and proc.stderr.count("\n") == 1
    assert "pytorch_attention --quick needs a CUDA GPU and this machine has 0: run --smoke" in proc.stderr
