"""Figures and derived tables redrawn from committed measurements, on any machine.

A section's measured tables (``figures/<section>/*.csv``) come from a GPU run; its figures and derived
tables are pure functions of those tables. Each section therefore has one ``derive(tables, meta) ->
Derived`` function, next to the code that measured the data, and three callers share it:

- the measuring entry point, right after writing its tables (so a GPU run leaves PNGs behind);
- the section's notebook, which displays what ``derive`` returns;
- ``python -m cs336_systems.writeup replot SECTION...``, which reloads the committed tables on a CPU machine and
  draws the derived artefacts (of the section's own results and of each edition grid measured) into
  ``.scratch/figures/<section>/``; with ``--publish`` into
  ``figures/<section>/`` beside the measurements (``CS336_FIGURES_DIR`` overrides both), where an artefact
  whose bytes did not change is left as it is.

The mechanism is the library's (:mod:`cs336_systems.derived`); this module finds the sections and is the
command line. Replotted artefacts keep the measuring run's provenance (device, versions, commit, date, via
``ResultWriter(..., source=meta)``) plus a ``rendered`` record of where and when they were drawn. The
measured tables are only read, never rewritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cs336_systems.derived import Derived, load_inputs, primary_meta, write_derived  # noqa: F401  (re-exported)
from cs336_systems.experiments import SECTIONS, get
from cs336_systems.results import ResultWriter


def _section(section: Any) -> Any:
    section = get(section) if isinstance(section, str) else section
    if section.derive is None:
        raise ValueError(f"no replot for section {section.name!r}; available: {', '.join(replottable())}")
    return section


def replottable() -> list[str]:
    """Sections whose figures and derived tables are computed from their measured results."""
    return [name for name, s in SECTIONS.items() if s.derive is not None]


def replot(section: str, publish: bool = False, edition: str | None = None) -> list[Path]:
    """Redraw ``section``'s figures and derived tables from its measured results (of its ``edition`` grid,
    ``figures/<section>/<edition>/``, if given), into ``.scratch/figures/<section>/`` or, with ``publish``,
    next to those results (``figures/<section>/``; ``CS336_FIGURES_DIR`` overrides both)."""
    spec = _section(section)
    folder = spec.results_folder(edition)
    tables, metas = load_inputs(spec, folder=folder)
    primary = primary_meta(spec, metas)
    if primary.get("smoke", False):
        print(f"warning: {section} results come from a smoke run; the figures show no GPU numbers", file=sys.stderr)
    params = {**(primary.get("params") or {}), "replot_of": sorted(metas)}
    out = ResultWriter(folder, params=params, smoke=False, publish=publish)
    derived = spec.derive(tables, primary)
    return write_derived(out, derived, metas)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m cs336_systems.writeup replot``."""
    parser.add_argument("sections", nargs="*", help=f"sections to replot (default: all of {', '.join(replottable())})")
    parser.add_argument("--publish", action="store_true",
                        help="write into figures/ beside the measurements (default: .scratch/figures/)")


def run_command(args: argparse.Namespace) -> int:
    unknown = [s for s in args.sections if s not in replottable()]
    if unknown:
        raise ValueError(f"no replot for section(s) {', '.join(unknown)}; available: {', '.join(replottable())}")
    import matplotlib

    matplotlib.use("Agg")
    for section in args.sections or replottable():
        # The section's own results, then each edition grid measured so far (an unmeasured grid is no error).
        grids = [None, *(e for e in get(section).grids if _has_results(section, e))]
        for edition in grids:
            try:
                paths = replot(section, publish=args.publish, edition=edition)
            except FileNotFoundError as exc:
                print(f"replot: {exc}", file=sys.stderr)
                return 1
            for path in paths:
                print(path)
    return 0


def _has_results(section: str, edition: str) -> bool:
    """Whether ``edition``'s grid of ``section`` has measured any of the inputs its figures are drawn from."""
    from cs336_systems.results import has_result, results_root

    spec, root = get(section), results_root(smoke=False)
    return any(has_result(spec.results_folder(edition), name, root=root) for name in spec.derive_inputs)
