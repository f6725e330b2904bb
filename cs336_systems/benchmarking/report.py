"""What a section notebook shows: freshly measured results, or the committed GPU results.

A notebook run on a GPU measures and shows its own results. A notebook run on CPU (CI smoke runs, a
laptop) still runs the whole pipeline on tiny parameters, but the numbers worth discussing are the GPU
measurements committed under ``figures/<section>/``; :func:`section_results` returns those when they
exist, together with a sentence saying where they came from, so the commentary always quotes real data.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from ..results import FIGURES_DIR, load_meta, section_dir


def committed_results(section: str, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Tables (CSV) or JSON records ``names`` from ``figures/<section>/`` and the first one's provenance, or
    ``None`` unless all exist and come from a non-smoke run."""
    folder = section_dir(section, FIGURES_DIR)
    found: dict[str, Any] = {}
    for name in names:
        meta_path = folder / f"{name}.meta.json"
        if not meta_path.exists() or json.loads(meta_path.read_text()).get("smoke", True):
            return None
        if (folder / f"{name}.csv").exists():
            found[name] = pd.read_csv(folder / f"{name}.csv")
        elif (folder / f"{name}.json").exists():
            found[name] = json.loads((folder / f"{name}.json").read_text())
        else:
            return None
    return found, load_meta(section, names[0], FIGURES_DIR)


def section_results(
    section: str, fresh: dict[str, Any] | None, names: list[str], *, smoke: bool
) -> tuple[dict[str, Any], str, str]:
    """``(results, provenance sentence, source)`` with ``source`` one of ``fresh`` (a real run: its own
    results), ``committed`` (a smoke run showing the committed GPU results) or ``smoke`` (a smoke run
    with nothing committed: its own numbers, flagged as not meaningful)."""
    if not smoke and fresh is not None:
        return fresh, "Results measured in this run.", "fresh"
    committed = committed_results(section, names)
    if committed is not None:
        tables, meta = committed
        sentence = (f"Showing the committed results measured on {meta['device']} (torch {meta['torch']}, "
                    f"commit {meta['git_commit'][:12]}, {meta['date']}); this run's smoke results went to .scratch.")
        return tables, sentence, "committed"
    return fresh or {}, ("No committed GPU results found: showing this smoke run's numbers, which exercise the "
                         "pipeline on a tiny model and say nothing about GPU performance."), "smoke"


def figure_path(section: str, name: str, fresh_dir: Any, source: str) -> Any:
    """PNG to display: the committed one when the notebook shows committed results, else this run's."""
    folder = section_dir(section, FIGURES_DIR) if source == "committed" else fresh_dir
    path = folder / f"{name}.png"
    return path if path.exists() else None
