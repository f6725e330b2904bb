"""Which results still describe the current code.

Every result's ``.meta.json`` records the commit it was measured at; every writeup section names the
library paths its measurements depend on (``Section.depends`` in :mod:`cs336_systems.experiments`). A result is
*fresh* when every definition under those paths at its commit still exists unchanged under them now
(:mod:`cs336_systems.measured_code`: compared by syntax tree, so comments, docstrings, imports and code moved
between dependencies do not count), *stale* otherwise (the files whose definitions changed are listed), and
stale too when its commit is unknown to this repository or it was measured with uncommitted library
changes (``-dirty``): then nobody can say which code it measured.

``python -m cs336_systems.writeup status`` prints this per section with the command that refreshes it and
exits 1 while any shown result is stale; the writeup marks each stale table and figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cs336_systems import calibration
from cs336_systems.measured_code import (  # noqa: F401  (the mechanism lives in the library)
    ANSWERS_MARKER,
    LIBRARY,
    MODEL,
    TIMING,
    Freshness,
    changed_since,
    depends_of,
    freshness,
    measuring_part,
)
from cs336_systems.results import REPO_ROOT, result_metas

STALE_MARK = "STALE"


@dataclass(frozen=True)
class SectionStatus:
    number: str
    title: str
    folder: str
    state: str  # fresh | stale | missing
    stale: dict[str, Freshness]
    fresh: tuple[str, ...]
    command: str
    #: Results whose job's machine measured slow (name -> reason), and how many came from an uncalibrated one.
    suspect: dict[str, str] = field(default_factory=dict)
    uncalibrated: int = 0

    def line(self) -> str:
        head = f"§{self.number} {self.title}" if self.number else self.title
        if self.state == "missing":
            return f"{head}: missing (no results in {self.folder}/) — run: {self.command}"
        machine = ""
        if self.suspect:
            first = sorted(self.suspect.values())[0]
            machine += f"; SUSPECT ({len(self.suspect)} measured on a machine that calibrated slow: {first})"
        if self.uncalibrated:
            machine += f"; {self.uncalibrated} from an uncalibrated machine"
        if self.state == "fresh":
            return f"{head}: fresh ({len(self.fresh)} results){machine}" + \
                (f" — re-measure: {self.command}" if self.suspect else "")
        reasons = sorted({f.reason for f in self.stale.values()})
        return (f"{head}: STALE ({len(self.stale)} of {len(self.stale) + len(self.fresh)} "
                f"results): {reasons[0]}" + (f" (+{len(reasons) - 1} other reasons)" if len(reasons) > 1 else "")
                + machine + f" — refresh: {self.command}")


def section_status(root: Path, spec: Any, repo: Path = REPO_ROOT, edition: str | None = None) -> SectionStatus:
    """The state of a section's results, or of its ``edition`` grid's (``figures/<name>/<edition>/``)."""
    folder, command = spec.results_folder(edition), spec.command_for(edition)
    title = f"{spec.title} [{edition} grid]" if edition else spec.title
    metas = result_metas(Path(root) / folder)
    if not metas:
        return SectionStatus(spec.number, title, folder, "missing", {}, (), command)
    verdicts = {name: freshness(meta, spec.depends, repo) for name, meta in metas.items()}
    stale = {name: f for name, f in verdicts.items() if f.stale}
    fresh = tuple(name for name, f in verdicts.items() if not f.stale)
    references = calibration.load_references(Path(root) / calibration.REFERENCE_PATH.name)
    machines = {name: calibration.verdict(meta, references) for name, meta in metas.items()}
    suspect = {name: v.reason for name, v in machines.items() if v.suspect}
    uncalibrated = sum(v.state == "uncalibrated" for v in machines.values())
    return SectionStatus(spec.number, title, folder, "stale" if stale else "fresh", stale, fresh, command,
                         suspect, uncalibrated)


def stale_results(root: Path, repo: Path = REPO_ROOT) -> dict[str, str]:
    """``{"folder/name": reason}`` for every stale result under ``root`` (what the writeup marks), edition
    grids' subfolders (``folder/edition/name``) included. Each folder's dependencies come from the registry
    the sections fill when they load (:func:`cs336_systems.measured_code.depends_of`)."""
    from cs336_systems import measured_code

    if not measured_code.DEPENDS:  # else every folder would be judged against the whole library
        raise RuntimeError("stale_results needs the sections loaded (import cs336_systems.experiments): each "
                           "registers what its results depend on")
    root = Path(root)
    out = {}
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    folders += [sub for p in folders for sub in p.iterdir() if sub.is_dir() and not sub.name.startswith(".")]
    for folder in sorted(folders):
        rel = folder.relative_to(root).as_posix()
        for name, meta in result_metas(folder).items():
            verdict = freshness(meta, depends_of(rel), repo)
            if verdict.stale:
                out[f"{rel}/{name}"] = verdict.reason
    return out
