"""Figures and derived tables computed from measured results: the mechanism a section's ``derive`` runs
through, inside its measuring run and later from committed results (``python -m cs336_systems.writeup replot``).

A section's ``derive(tables, meta) -> Derived`` is a pure function of its measured tables. Its artefacts keep
the measuring run's provenance (device, versions, commit, date, via ``ResultWriter(..., source=meta)``), and
a derived artefact never mixes inputs measured by older code with current ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .measured_code import freshness
from .results import ResultWriter, git_commit, has_result, load_json, load_meta, load_table, results_root, section_dir


@dataclass
class Derived:
    """What ``derive`` computed: figures and tables by artefact name, each paired with the name of the
    measured table (or JSON record) it was computed from, whose provenance it inherits."""

    figures: dict[str, tuple[Any, str]] = field(default_factory=dict)
    tables: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def figure(self, name: str) -> Any:
        return self.figures[name][0]

    def table(self, name: str) -> Any:
        return self.tables[name][0]


def write_derived(
    out: ResultWriter, derived: Derived, sources: dict[str, dict[str, Any]] | None = None, *, close: bool = True
) -> list[Path]:
    """Write every derived figure and table through ``out``. ``sources`` maps a measured artefact's name
    to its ``.meta.json`` (given when drawing from earlier measurements; ``None`` inside the measuring
    run). Refuses names that would overwrite a measured artefact's sidecar."""
    import matplotlib.pyplot as plt

    inputs = {src for _, src in [*derived.figures.values(), *derived.tables.values()]}
    clash = (set(derived.figures) | set(derived.tables)) & inputs
    if clash:
        raise ValueError(f"derived artefact name(s) {sorted(clash)} equal measured inputs; pick other names")

    def origin(src: str) -> dict[str, Any]:
        """Inside the measuring run: the parameters of the job that measured ``src`` (an earlier job's, for a
        table that combines several jobs), not the last job's; later, its whole provenance. Inside a run too,
        an input measured at another commit (a part this job did not re-measure) keeps its own provenance:
        stamping its plot with this run's commit would present older measurements as this code's."""
        if sources is not None:
            return {"source": sources.get(src)}
        if not (out.dir / f"{src}.meta.json").exists():
            return {}
        meta = load_meta(out.section, src, root=out.root)
        if str(meta.get("git_commit", "")) != git_commit():
            return {"source": meta}
        return {"params": meta.get("params")}

    written = []
    for name, (df, src) in derived.tables.items():
        written.append(out.table(df, name, **origin(src)))
    for name, (fig, src) in derived.figures.items():
        written.append(out.figure(fig, name, **origin(src)))
        if close:
            plt.close(fig)
    return written


def load_inputs(section: Any, root: Path | None = None,
                folder: str | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The measured inputs of ``section`` (a Section, or anything with its ``name``, ``derive_inputs`` and
    ``depends``; tables as DataFrames, JSON records as dicts)
    and their metas, from ``root`` (default: where real runs write, ``figures/`` or ``CS336_FIGURES_DIR``),
    in its results ``folder`` (default: the section's own; an edition grid's is ``name/edition``).
    When some inputs describe the current code and others older code, only the current ones."""
    root = root or results_root(smoke=False)
    folder = folder or section.name
    tables: dict[str, Any] = {}
    metas: dict[str, dict[str, Any]] = {}
    for name in section.derive_inputs:
        if not has_result(folder, name, root=root):
            continue
        meta = load_meta(folder, name, root=root)
        is_csv = (section_dir(folder, root) / f"{name}.csv").exists()
        tables[name] = load_table(folder, name, root=root) if is_csv else load_json(folder, name, root=root)
        metas[name] = meta
    if not metas:
        raise FileNotFoundError(f"no measured {' or '.join(map(repr, section.derive_inputs))} in "
                                f"{section_dir(folder, root)}: nothing to replot")
    current = _measured_on_current_code(section, metas)
    if current and len(current) < len(metas):
        # A derived artefact carries one input's provenance, so it must not mix in measurements of older
        # code: those stay in their own (stale-marked) files, and the combination leaves them out.
        tables = {name: tables[name] for name in current}
        metas = {name: metas[name] for name in current}
    return tables, metas


def _measured_on_current_code(section: Any, metas: dict[str, dict[str, Any]]) -> list[str]:
    """The inputs whose measured code is the current code (the writeup's test, :func:`.measured_code.freshness`)."""
    return [name for name, meta in metas.items() if not freshness(meta, section.depends).stale]


def primary_meta(section: Any, metas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The provenance derived artefacts inherit: the first of the section's inputs that was measured."""
    return next(metas[name] for name in section.derive_inputs if name in metas)
