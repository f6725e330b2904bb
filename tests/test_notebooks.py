"""Every notebook executes end to end on CPU with its smoke parameters (papermill, real kernel).

New notebooks are picked up automatically. Results of these runs go to a temporary folder, so the
committed GPU results in ``figures/`` are never touched.
"""

from __future__ import annotations

import json

import nbformat
import pytest

from cs336_systems import notebooks

NAMES = notebooks.list_notebooks()


def test_there_are_notebooks() -> None:
    assert "model_sizes" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_clean(name: str) -> None:
    nb = nbformat.read(notebooks.notebook_path(name), as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell must be tagged 'parameters' for papermill"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_smoke_run(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "figures"))
    executed = notebooks.execute(name, smoke=True, output_dir=tmp_path, timeout_s=300)
    nb = json.loads(executed.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    produced = list((tmp_path / "figures").rglob("*.meta.json"))
    assert produced, "a notebook must export at least one result with provenance"
    for meta_path in produced:
        meta = json.loads(meta_path.read_text())
        assert meta["smoke"] is True
        for key in ("device", "torch", "git_commit", "date", "params"):
            assert key in meta


def test_run_parameters_are_python_literals() -> None:
    """``-p KEY=VALUE`` on ``notebooks run`` parses VALUE as a literal and rejects what is not one."""
    import argparse

    from cs336_systems.cli import parse_assignment as _parameter

    assert _parameter("budget_s=120") == ("budget_s", 120)
    assert _parameter("kind='quick'") == ("kind", "quick")
    assert _parameter("overrides={'sizes': ['small']}") == ("overrides", {"sizes": ["small"]})
    for bad in ("budget_s", "kind=quick", "2x=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _parameter(bad)
