"""The course-suite runner on a synthetic course checkout (the project ships none of the course's code)."""

from __future__ import annotations

import json

import pytest

from cs336_systems.experiments import course_tests
from cs336_systems.experiments.__main__ import main as experiments


def _fake_checkout(root, test_body: str):
    (root / "tests").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "9.9.9"\n')
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "adapters.py").write_text("raise ImportError('the course stub must be replaced')\n")
    (root / "tests" / "test_course.py").write_text(test_body)
    return root


BODY = '''
import pytest
from .adapters import get_ddp

def test_uses_our_adapters():
    assert callable(get_ddp)

def test_fails():
    assert 1 == 2, "Step 0: Parameter w mismatch"

@pytest.mark.skip(reason="no GPU")
def test_skipped():
    pass
'''


@pytest.mark.slow
def test_runs_the_course_suite_against_our_adapters(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "out"))
    checkout = _fake_checkout(tmp_path / "course", BODY)
    assert course_tests.course_version(checkout) == "9.9.9"
    # A suite that ran is a result, failures included: they are what the writeup explains.
    assert experiments(["course_tests", "--set", f"checkout={checkout}", "--set", "edition=2099"]) == 0
    result = json.loads((tmp_path / "out" / "course_tests" / "2099.json").read_text())
    assert result["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert result["tests"]["tests/test_course.py::test_uses_our_adapters"] == "passed"
    assert result["failures"] == {
        "tests/test_course.py::test_fails": "AssertionError: Step 0: Parameter w mismatch"}
    meta = json.loads((tmp_path / "out" / "course_tests" / "2099.meta.json").read_text())
    assert meta["params"]["course_version"] == "9.9.9" and "git_commit" in meta
    assert experiments(["course_tests", "--set", f"checkout={checkout}", "--set", "edition=2099-one",
                        "--set", "pytest_args=['-k', 'adapters']"]) == 0
    one = json.loads((tmp_path / "out" / "course_tests" / "2099-one.json").read_text())
    assert one["counts"] == {"passed": 1}


def test_refuses_what_is_not_a_course_checkout(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a checkout of the course's assignment"):
        experiments(["course_tests", "--set", f"checkout={tmp_path}", "--set", "edition=2025"])
    with pytest.raises(ValueError, match="edition must be a plain label"):
        experiments(["course_tests", "--set", f"checkout={tmp_path}", "--set", "edition='a b'"])
    with pytest.raises(ValueError, match="needs --set checkout="):
        experiments(["course_tests"])


def test_the_cse599o_grid_is_shown_by_the_test_files_its_handout_names(tmp_path) -> None:
    import json

    from cs336_systems.experiments.course_tests import answer
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "course_tests" / "cse599o"
    folder.mkdir(parents=True)
    tests = {"tests/test_ddp.py::a[1]": "passed", "tests/test_ddp.py::a[2]": "passed",
             "tests/test_sharded_optimizer.py::b": "failed"}
    (folder / "cse599o-cpu.json").write_text(json.dumps(
        {"counts": {"passed": 2, "failed": 1}, "tests": tests, "failures": {}}))
    (folder / "cse599o-cpu.meta.json").write_text(json.dumps(
        {"params": {"edition": "cse599o-cpu", "course_version": "1.0.5"}, "device": "CPU"}))
    blocks = answer(SectionData(tmp_path, "course_tests/cse599o"))
    assert "Its repository (github.com/uw-syfi/assignment2-systems) was not available" in blocks[0].markdown
    table = blocks[1]
    assert table.caption.startswith("The CS336 2025 suite's files the CSE599-O handout runs (the CS336 2025 suite's "
                                    "version 1.0.5)")
    assert table.frame.to_dict("records") == [{"file": "tests/test_ddp.py", "passed": 2, "failed": 0},
                                              {"file": "tests/test_sharded_optimizer.py", "passed": 0, "failed": 1}]


def test_a_suite_run_on_a_gpu_machine_is_calibrated(tmp_path, monkeypatch) -> None:
    """The suite runs its GPU tests where CUDA is present, so that run is a GPU job: its result carries the
    machine's calibration like any other (here with a faked GPU reading; the runner itself is stubbed)."""
    from cs336_systems import calibration

    reading = [{"index": 0, "device": "NVIDIA H200", "bf16_matmul_tflops": 700.0}]
    monkeypatch.setattr(calibration, "measure_in_subprocess", lambda: reading)
    monkeypatch.setattr(calibration.JobCalibration, "wanted", staticmethod(lambda smoke: not smoke))
    monkeypatch.setattr(calibration, "JOB", calibration.JobCalibration())
    monkeypatch.setattr(course_tests, "run_suite", lambda *a: {"counts": {"passed": 1}, "tests": {}, "failures": {},
                                                              "exit_code": 0, "command": "pytest", "tail": "1 passed"})
    monkeypatch.setattr(course_tests, "course_version", lambda checkout: "9.9.9")
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "out"))
    assert experiments(["course_tests", "--set", f"checkout={tmp_path}", "--set", "edition=2099"]) == 0
    meta = json.loads((tmp_path / "out" / "course_tests" / "2099.meta.json").read_text())
    assert meta["calibration"]["start"] == reading
