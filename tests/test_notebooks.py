"""Every notebook executes end to end on CPU with its smoke parameters (papermill, real kernel).

New notebooks are picked up automatically. Results of these runs go to a temporary folder, so the
committed GPU results in ``figures/`` are never touched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from cs336_systems import notebooks

from cs336_systems.experiments import SECTIONS  # noqa: E402

NAMES = notebooks.list_notebooks()
#: Sections computed in closed form: their full results are exact on any machine, never "smoke".
ANALYTIC = {name for name, s in SECTIONS.items() if s.gpus == 0}


def test_one_notebook_per_writeup_section() -> None:
    """Every section has the notebook of its name (course_tests aside: it runs the course's suite against
    a checkout the user names, not a measurement), and every notebook is a section's."""
    sections = set(SECTIONS) - {"course_tests"}
    assert set(NAMES) == sections, f"sections without a notebook: {sorted(sections - set(NAMES))}; " \
                                   f"notebooks without a section: {sorted(set(NAMES) - sections)}"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_the_thin_section_template(name: str) -> None:
    """A notebook holds no measurement, default or answer of its own: parameters, then its section's run,
    derive and answers (so the notebook, the command line and the writeup cannot disagree)."""
    nb = nbformat.read(notebooks.notebook_path(name), as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    # A section with another edition's grid takes that edition as a parameter too (and only such a section).
    args = "preset, overrides, publish" + (", edition" if SECTIONS[name].grids else "")
    assert code[1:] == [f"from cs336_systems.experiments.notebook import SectionNotebook\n\n"
                        f"nb = SectionNotebook({name!r}, {args})",
                        "nb.run()  # measure and write the results",
                        "nb.derive()  # figures and tables computed from the results", "nb.answers()"]
    namespace: dict = {}
    exec(code[0], namespace)  # the parameters cell: plain assignments papermill can override
    expected = {"preset": None, "overrides": {}, "publish": None}
    if SECTIONS[name].grids:
        expected["edition"] = None
    assert {k: namespace[k] for k in expected} == expected


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_clean(name: str) -> None:
    nb = nbformat.read(notebooks.notebook_path(name), as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell must be tagged 'parameters' for papermill"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"


def _check_provenance(name: str, figures: Path) -> None:
    produced = list(figures.rglob("*.meta.json"))
    assert produced, "a notebook must export at least one result with provenance"
    for meta_path in produced:
        meta = json.loads(meta_path.read_text())
        assert meta["smoke"] is (name not in ANALYTIC), "smoke flag: tiny parameters, or an exact analytic result"
        for key in ("device", "torch", "git_commit", "date", "params"):
            assert key in meta


def _sentences(blocks: list) -> str:
    """The answers' prose (tables may hold NaN where a CPU has nothing to measure; a sentence may not)."""
    from cs336_systems.report.document import Question, Text

    return "\n".join(_sentences(b.blocks) if isinstance(b, Question) else b.plain() for b in blocks
                     if isinstance(b, (Question, Text)))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_section_smoke_run_answers_from_its_own_results(name: str, tmp_path, monkeypatch) -> None:
    """What every notebook runs (its cells are the template checked above), in this process on the smoke
    preset: measure, derive, then format the section's answers from this run's own results alone. A section
    whose answers cannot be formatted from its smoke results fails here (its notebook fails the same way)."""
    from cs336_systems.experiments.notebook import SectionNotebook
    from cs336_systems.report.document import Missing, Question

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "figures"))
    nb = SectionNotebook(name)
    nb.run()
    nb.derive()
    blocks = nb.own_answers()
    answered = [b for q in blocks for b in (q.blocks if isinstance(q, Question) else [q]) if b is not None]
    assert any(not isinstance(b, Missing) for b in answered), "no answer was formatted from the smoke results"
    text = _sentences(blocks)
    assert not re.search(r"\bnan\b", text, re.IGNORECASE), "an answer reads an empty column: " + text[:300]
    _check_provenance(name, tmp_path / "figures")


@pytest.mark.slow
def test_notebook_smoke_run_through_papermill(tmp_path, monkeypatch, capfd) -> None:
    """One notebook end to end through the runner's papermill path and a real kernel (the others run the same
    cells in-process above): no error cell, no warning from the kernel or the progress bars, no error-looking
    line from a run that succeeds."""
    name = "mixed_precision"  # measured (so a smoke run), and quick on a CPU
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "figures"))
    executed = notebooks.execute(name, smoke=True, output_dir=tmp_path, timeout_s=300)
    nb = json.loads(executed.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # Neither the kernel (IPC, not TCP) nor progress bars (text, not widgets) warn; its shutdown is quiet.
    err = capfd.readouterr().err
    assert "without encryption" not in err and "ERROR" not in err, err[-500:]
    stderr = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", [])
                     if o.get("name") == "stderr")
    assert "IProgress not found" not in stderr and "TqdmWarning" not in stderr
    assert "own answers were derived" in json.dumps(nb)
    _check_provenance(name, tmp_path / "figures")


def test_run_parameters_are_literals_words_or_lists() -> None:
    """``-p KEY=VALUE`` on ``notebooks run``: a Python literal, a bare word (a string) or a comma list."""
    import argparse

    from cs336_systems.cli import parse_assignment as _parameter

    assert _parameter("budget_s=120") == ("budget_s", 120)
    assert _parameter("preset='quick'") == ("preset", "quick")
    assert _parameter("preset=quick") == ("preset", "quick")
    assert _parameter("size=2.7B") == ("size", "2.7B")
    assert _parameter("bucket_sizes_mb=1,10") == ("bucket_sizes_mb", [1, 10])
    assert _parameter("sizes=small,xl") == ("sizes", ["small", "xl"])
    assert _parameter("seq_lens=[128, 256]") == ("seq_lens", [128, 256])
    assert _parameter("overrides={'sizes': ['small']}") == ("overrides", {"sizes": ["small"]})
    for bad in ("budget_s", "2x=1", "x=[1, 2", "x=a b"):
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            _parameter(bad)
        assert "\n" not in str(exc.value) and "<ast." not in str(exc.value)


@pytest.mark.slow
def test_direct_papermill_run_of_the_analytic_section_writes_no_tracked_file(tmp_path) -> None:
    """``papermill notebooks/communication_accounting.ipynb out.ipynb``, as a user types it (no runner,
    no environment variables): results go to ``.scratch/``; ``figures/`` only with ``-p publish True``."""
    import papermill as pm

    from tests.conftest import tracked_changes

    before = tracked_changes()
    pm.execute_notebook(str(notebooks.notebook_path("communication_accounting")), str(tmp_path / "out.ipynb"),
                        kernel_name="python3", cwd=str(notebooks.NOTEBOOK_DIR), progress_bar=False)
    assert tracked_changes() == before
    scratch = notebooks.REPO_ROOT / ".scratch" / "figures" / "communication_accounting" / "xxl_memory.csv"
    assert scratch.exists()


def test_the_kernel_is_not_interrupted_on_its_way_out() -> None:
    """A shutdown sends no SIGINT (an idle kernel would log "KeyboardInterrupt caught in kernel" as an error);
    an interrupt asked for while the kernel runs still goes through."""
    import asyncio

    from jupyter_client.manager import AsyncKernelManager

    sent = []

    async def record(self) -> None:
        sent.append(self.shutting_down)

    manager = notebooks._local_kernel_manager()()
    original = AsyncKernelManager._async_interrupt_kernel
    AsyncKernelManager._async_interrupt_kernel = record
    try:
        asyncio.run(manager._async_interrupt_kernel())
        manager.shutting_down = True
        asyncio.run(manager._async_interrupt_kernel())
    finally:
        AsyncKernelManager._async_interrupt_kernel = original
    assert sent == [False]


def test_failed_notebooks_are_reported_by_their_own_exception() -> None:
    from papermill.exceptions import PapermillExecutionError

    inner = PapermillExecutionError(cell_index=3, exec_count=3, source="x", ename="torch.OutOfMemoryError",
                                    evalue="CUDA out of memory. Tried to allocate 2.00 GiB\nmore", traceback=[])
    assert notebooks.failure_summary(inner) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert notebooks.failure_summary(RuntimeError("")) == "RuntimeError (no message)"
    assert notebooks.failure_summary(ValueError("bad\nrest")) == "ValueError: bad"


def test_runner_refuses_gpu_parameters_and_unknown_notebooks_in_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setattr(notebooks, "_cuda_available", lambda: False)
    for argv, expected in ((["run", "--real", "ddp_bucketed"], "--real runs the GPU parameters"),
                           (["run", "-p", "preset=quick", "benchmarking"],
                            "-p preset=quick runs the GPU parameters of benchmarking and needs a CUDA GPU"),
                           (["run", "--smoke", "-p", "preset=quick", "model_sizes"],
                            "-p preset=quick names the preset itself: drop --smoke"),
                           (["run", "no_such_notebook"], "no notebook 'no_such_notebook'")):
        with pytest.raises(SystemExit) as exc:
            notebooks.main(argv)
        assert exc.value.code == 2
        assert expected in capsys.readouterr().err


def test_notebook_parameters_read_papermill_text_as_values() -> None:
    """papermill's ``-p NAME VALUE`` injects any value but a number, True, False or None as a string: the text
    ``'false'`` once counted as true and a smoke run rewrote ``figures/``. Texts are read as the values they name."""
    from cs336_systems.experiments.notebook import notebook_parameters

    for text, value in (("false", False), ("False", False), ("NO", False), ("0", False), (0, False),
                        ("true", True), ("Yes", True), ("1", True), (1, True), (True, True), (False, False),
                        ("none", None), ("None", None), ("", None), (None, None)):
        assert notebook_parameters(publish=text).publish is value, text
    assert notebook_parameters().preset is None and notebook_parameters("none").preset is None
    assert notebook_parameters("", None, None).preset is None
    assert notebook_parameters("quick").preset == "quick"
    assert notebook_parameters().overrides == {} and notebook_parameters(overrides="none").overrides == {}
    assert notebook_parameters(overrides={"sizes": ["small"]}).overrides == {"sizes": ["small"]}
    assert notebook_parameters(overrides="{'sizes': ['small'], 'budget_s': 120}").overrides == \
        {"sizes": ["small"], "budget_s": 120}
    assert notebook_parameters(edition=2026).edition == "2026" and notebook_parameters(edition="none").edition is None


def test_notebook_parameters_refuse_other_values_in_one_line() -> None:
    from cs336_systems.experiments.notebook import notebook_parameters

    cases = (({"publish": "maybe"}, "publish must be None, True or False"), ({"publish": 2}, "got 2"),
             ({"publish": 1.0}, "publish must be"), ({"preset": "fast"}, "preset must be None or one of smoke, quick"),
             ({"preset": 1}, "got 1"),
             ({"overrides": "notadict"}, ("overrides must be a mapping of section parameters, e.g. "
                                          "\"{'sizes': ['small']}\", got 'notadict'")),
             ({"overrides": "[1, 2]"}, "got '[1, 2]'"), ({"overrides": ["sizes"]}, "overrides must be a mapping"),
             ({"edition": True}, "edition must be None or"))
    for kwargs, expected in cases:
        with pytest.raises(ValueError) as exc:
            notebook_parameters(**kwargs)
        assert expected in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_text_false_does_not_publish_an_analytic_section(monkeypatch) -> None:
    """``papermill notebooks/parallelism_strategies.ipynb out.ipynb -p publish false``: the notebook's
    ``SectionNotebook`` gets the text ``'false'`` and writes to ``.scratch/``, not the committed ``figures/``."""
    from cs336_systems.experiments.notebook import SectionNotebook
    from cs336_systems.results import FIGURES_DIR, SCRATCH_DIR

    monkeypatch.delenv("CS336_FIGURES_DIR", raising=False)  # the folder the parameters choose, not the test's
    nb = SectionNotebook("parallelism_strategies", None, None, "false")
    assert nb.out.root == SCRATCH_DIR / "figures" and nb.out.root != FIGURES_DIR
    with pytest.raises(ValueError, match="overrides must be a mapping"):
        SectionNotebook("parallelism_strategies", None, "notadict", None)


@pytest.mark.parametrize("name", NAMES)
def test_runner_reads_each_notebooks_parameter_names(name: str) -> None:
    expected = ["preset", "overrides", "publish"] + (["edition"] if SECTIONS[name].grids else [])
    assert notebooks.parameter_names(name) == expected


def _runner(monkeypatch, argv: list[str]) -> list[dict]:
    """The runner's ``main`` with papermill replaced by a record of the parameters each notebook would get."""
    runs: list[dict] = []
    monkeypatch.setattr(notebooks, "_cuda_available", lambda: False)
    monkeypatch.setattr(notebooks, "execute", lambda name, params, **kw: runs.append(dict(params)) or
                        notebooks.EXECUTED_DIR / f"{name}.ipynb")
    assert notebooks.main(argv) == 0
    return runs


def test_runner_refuses_unknown_parameter_names_and_values_in_one_line(capsys, monkeypatch) -> None:
    """Plain papermill only warns about a name the ``parameters`` cell does not define and runs the defaults;
    the runner refuses it (and a value the notebook would refuse) before any notebook runs."""
    for argv, expected in ((["run", "-p", "presett=quick", "parallelism_strategies"],
                            ("-p: notebook parallelism_strategies has no parameter 'presett'; "
                             "its parameters: preset, overrides, publish")),
                           (["run", "-p", "edition=2026"], "has no parameter 'edition'"),
                           (["run", "-p", "publish=maybe", "parallelism_strategies"], "publish must be None"),
                           (["run", "-p", "overrides=notadict", "parallelism_strategies"],
                            "overrides must be a mapping of section parameters")):
        with pytest.raises(SystemExit) as exc:
            _runner(monkeypatch, argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 2, err  # usage line, then the error


def test_runner_passes_parameters_as_values(monkeypatch) -> None:
    """``-p publish=false`` reaches the kernel as False (not the text 'false'); ``-p preset=none`` is the default."""
    assert _runner(monkeypatch, ["run", "-p", "publish=false", "parallelism_strategies"]) == [{"publish": False}]
    assert _runner(monkeypatch, ["run", "-p", "publish=True", "-p", "overrides={'ffn_devices': [2]}",
                                 "parallelism_strategies"]) == [{"publish": True, "overrides": {"ffn_devices": [2]}}]
    assert _runner(monkeypatch, ["run", "-p", "preset=none", "mixed_precision"]) == [{"preset": None}]
    assert _runner(monkeypatch, ["run", "-p", "edition=2026", "nsys_profile"]) == [{"edition": "2026"}]
