"""Read access to one section's results folder, remembering what the writeup used.

A section builder asks for artefacts by name, with fallbacks (``data.frame("timings", "*timing*")``),
because the notebooks name their own tables; whatever it does not ask for is still shown by the
generic "further results" part, so no committed result is silently dropped. Every artefact carries
its ``.meta.json`` provenance record, which the renderer prints under each table and figure.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems import calibration
from cs336_systems.measured_code import depends_of, freshness
from cs336_systems.report.document import Block, Figure, Table, Text
from cs336_systems.results import REPO_ROOT

SMOKE_MARK = "SMOKE RUN, not a GPU measurement"
#: Opens the provenance line of a result whose code changed since it was measured (see report.staleness).
STALE_MARK = "STALE"  # the writeup's opening says what it marks: a result measured on older code
SUSPECT_MARK = "SUSPECT, the machine measured slow"
DISAGREES_MARK = "DISAGREES with another section"
UNCALIBRATED_NOTE = "machine not calibrated"
MAX_GENERIC_ROWS = 60
"""Longer tables nobody asked for (e.g. raw profiler timelines) are listed, not printed."""


def _stale_note(verdict: Any) -> str:
    """Why a result is stale, in a source line's room (the line already names the commit): the name of the first
    library file changed since and how many more; ``writeup status -v`` lists them all with their paths."""
    if not verdict.changed:
        return verdict.reason
    more = len(verdict.changed) - 1
    return f"{Path(verdict.changed[0]).name}{f' and {more} more' if more else ''} changed since"


def display_path(path: Path) -> str:
    """Repository-relative path where possible (what a reader can open), else the absolute one."""
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def humanize(name: str) -> str:
    """``peak_memory_by_context`` → ``Peak memory by context``."""
    words = re.sub(r"[_\-]+", " ", name).strip()
    return words[:1].upper() + words[1:]


class SectionData:
    """The artefacts of ``<root>/<folder>/``: tables (CSV), figures (PNG), JSON records, and metadata."""

    def __init__(self, root: Path, folder: str, command: str = "", note: str = "", alternative: str = "",
                 depends: tuple[str, ...] | None = None, edition: str = "2025"):
        self.root = Path(root)
        self.folder = folder
        #: The handout whose writeup these answers are for (names its models as that handout does).
        self.edition = edition
        #: Library paths whose change stales these results (None: the section's, or the whole library).
        self.depends = depends
        self.command = command or f"the notebook notebooks/{folder}.ipynb"
        self.note = note
        self.alternative = alternative
        self.dir = self.root / folder
        self._used: set[str] = set()

    def sibling(self, section: str) -> "SectionData":
        """Another section's results from the same grid: for an edition grid (``<name>/<edition>``) that
        section's grid of the same edition where it is measured, else its own results."""
        _, _, edition = self.folder.partition("/")
        if edition and (self.root / section / edition).is_dir():
            return SectionData(self.root, f"{section}/{edition}", edition=self.edition)
        return SectionData(self.root, section, edition=self.edition)

    @functools.cached_property
    def references(self) -> dict[str, dict[str, dict[str, float]]]:
        """The calibration references (method -> device -> metric -> value) results are judged against."""
        return calibration.load_references(self.root / calibration.REFERENCE_PATH.name)

    # -- what exists -------------------------------------------------------------------------------

    def _names(self, suffix: str) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob(f"*{suffix}") if not p.name.endswith(".meta.json"))

    @property
    def tables(self) -> list[str]:
        return self._names(".csv")

    @property
    def figures(self) -> list[str]:
        return self._names(".png")

    @property
    def records(self) -> list[str]:
        return self._names(".json")

    @property
    def empty(self) -> bool:
        return not (self.tables or self.figures or self.records)

    def files(self) -> list[Path]:
        """Every file of the folder (the inputs the manifest hashes)."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.rglob("*") if p.is_file() and not p.name.startswith("."))

    def _resolve(self, candidates: tuple[str, ...], available: list[str]) -> str | None:
        """The first candidate that exists; a candidate with ``*``/``?`` is a glob over the names."""
        for cand in candidates:
            if any(ch in cand for ch in "*?["):
                hits = [n for n in available if fnmatch.fnmatchcase(n, cand)]
                if hits:
                    return hits[0]
            elif cand in available:
                return cand
        return None

    def meta(self, name: str) -> dict[str, Any]:
        """The result's provenance record, with ``stale`` (a reason) when the code it measured changed."""
        path = self.dir / f"{name}.meta.json"
        if not path.exists():
            return {}
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError:
            return {}
        if isinstance(meta.get("params"), dict):
            meta["params"] = run_params(self.folder, meta["params"])
        depends = self.depends or depends_of(self.folder)
        verdict = freshness(meta, depends)
        if verdict.stale:
            meta["stale"] = _stale_note(verdict)
        machine = calibration.verdict(meta, self.references)
        if machine.state in ("suspect", "uncalibrated"):
            meta["machine"] = {"state": machine.state, "reason": machine.reason}
        from cs336_systems.report import agreement

        disagrees = agreement.flag(self.root, self.folder, name)
        if disagrees:
            meta["disagrees"] = disagrees
        return meta

    # -- access (marks the artefact as used) -------------------------------------------------------

    def frame(self, *names: str) -> pd.DataFrame | None:
        """The first of ``names`` that exists as a CSV, as a DataFrame (None when none does)."""
        name = self._resolve(names, self.tables)
        if name is None:
            return None
        self._used.add(name + ".csv")
        return pd.read_csv(self.dir / f"{name}.csv")

    def frame_name(self, *names: str) -> str | None:
        return self._resolve(names, self.tables)

    def table(
        self, *names: str, caption: str | None = None, frame: pd.DataFrame | None = None, digits: int = 4
    ) -> Table | None:
        """A :class:`Table` block for the first existing name; ``frame`` replaces the shown data
        (e.g. a pivot of the CSV) while provenance still points at the CSV."""
        name = self._resolve(names, self.tables)
        if name is None:
            return None
        df = self.frame(name) if frame is None else frame
        self._used.add(name + ".csv")
        return Table(
            frame=df,
            caption=caption or humanize(name),
            source=display_path(self.dir / f"{name}.csv"),
            meta=self.meta(name),
            digits=digits,
        )

    def json(self, *names: str) -> Any | None:
        name = self._resolve(names, self.records)
        if name is None:
            return None
        self._used.add(name + ".json")
        return json.loads((self.dir / f"{name}.json").read_text())

    def json_meta(self, *names: str) -> dict[str, Any]:
        name = self._resolve(names, self.records)
        return self.meta(name) if name else {}

    def figure(self, *names: str, caption: str | None = None, large: bool = False) -> Figure | None:
        name = self._resolve(names, self.figures)
        if name is None:
            return None
        self._used.add(name + ".png")
        path = self.dir / f"{name}.png"
        return Figure(path=path, caption=caption or humanize(name), source=display_path(path), meta=self.meta(name),
                      large=large)

    # -- everything not yet shown ------------------------------------------------------------------

    def forget_usage(self) -> None:
        """Treat every artefact as unshown again (after a section builder failed half-way)."""
        self._used.clear()

    def remaining(self) -> list[Block]:
        """Generic blocks for every table, figure and flat JSON record no section builder asked for."""
        blocks: list[Block] = []
        for name in self.tables:
            if name + ".csv" in self._used:
                continue
            df = self.frame(name)
            if df is not None and len(df) > MAX_GENERIC_ROWS:
                path = display_path(self.dir / f"{name}.csv")
                blocks.append(Text(f"Data table `{path}`: {len(df):,} rows × {len(df.columns)} columns "
                                   f"({', '.join(map(str, df.columns[:8]))}{', …' if len(df.columns) > 8 else ''})"
                                   ", too long to print."))
            else:
                blocks.append(self.table(name, frame=df))  # type: ignore[arg-type]
        for name in self.records:
            if name + ".json" in self._used:
                continue
            obj = self.json(name)
            path = self.dir / f"{name}.json"
            if isinstance(obj, dict) and obj and all(not isinstance(v, (dict, list)) for v in obj.values()):
                df = pd.DataFrame({"quantity": list(obj), "value": list(obj.values())})
                blocks.append(Table(df, humanize(name), display_path(path), self.meta(name)))
            else:
                blocks.append(Text(f"Structured record: `{display_path(path)}`."))
        for name in self.figures:
            if name + ".png" not in self._used:
                blocks.append(self.figure(name))  # type: ignore[arg-type]
        return blocks


def short_device(meta: dict[str, Any]) -> str:
    """The device as a reader names it: ``H100`` for "NVIDIA H100 80GB HBM3", ``2×H200`` for two."""
    device = str(meta.get("device") or "unknown device")
    if meta.get("device_type") != "cuda":
        return "CPU" if device.startswith("CPU") else device
    name = device.removeprefix("NVIDIA ").split()[0] if device.startswith("NVIDIA ") else device
    n = int(meta.get("num_gpus") or 0)
    used = _ranks_used(meta.get("params"))
    if used is not None and 0 < used < n:  # a 2-rank job on a 4-GPU host: the table's numbers are 2 GPUs'
        return f"{used} of {n}×{name}"
    return f"{n}×{name}" if n > 1 else name


def _ranks_used(params: Any) -> int | None:
    """How many GPUs a multi-process run used: its ``world_size``, else the largest of its ``nproc``; None for a
    run that records neither (single-GPU sections)."""
    if not isinstance(params, dict):
        return None
    used = params.get("world_size") or params.get("nproc")
    if isinstance(used, list):
        used = max(used, default=None)
    try:
        return int(used) if used is not None else None
    except (TypeError, ValueError):
        return None


def provenance_line(meta: dict[str, Any], short: bool = False) -> str:
    """Where a result was measured, in one line: device, software, date, commit (and SMOKE if so), with the
    marks a reader must see (stale, suspect, disagreeing, uncalibrated). ``short``: device · date · commit
    only, as under a table in the writeup (the full line is in the results index)."""
    if not meta:
        return "provenance record missing"
    parts: list[str] = []
    if short:
        parts.append(short_device(meta))
    else:
        device = meta.get("device") or "unknown device"
        n = meta.get("num_gpus") or 0
        if meta.get("device_type") == "cuda" and n > 1:
            device += f" ({n} GPUs)"
        parts.append(device)
        if meta.get("cuda"):
            parts.append(f"CUDA {meta['cuda']}")
        for key in ("torch", "triton"):
            if meta.get(key):
                parts.append(f"{key} {meta[key]}")
    if meta.get("date"):
        parts.append(str(meta["date"])[:10])
    if meta.get("git_commit"):
        commit = str(meta["git_commit"])
        parts.append(("" if short else "commit ") + commit[: 7 if short else 9]
                     + ("-dirty" if commit.endswith("-dirty") else ""))
    machine = meta.get("machine") or {}
    if machine.get("state") == "uncalibrated":
        parts.append(UNCALIBRATED_NOTE)
    line = " · ".join(parts)
    if machine.get("state") == "suspect":
        line = f"{SUSPECT_MARK}: {machine['reason']} · " + line
    if meta.get("disagrees"):
        line = f"{DISAGREES_MARK}: {meta['disagrees']} · " + line
    if meta.get("smoke"):
        line = f"{SMOKE_MARK} · " + line
    if meta.get("stale"):
        line = f"{STALE_MARK}: {meta['stale']} · " + line
    return line


def params_line(meta: dict[str, Any], limit: int = 240) -> str:
    """The run's parameters, compactly: against its section's preset, only the values that differ (what a
    reader needs to repeat the run: ``--full --set k=v ...``), and the value a parameter that defaults to None
    ("auto") was resolved to; every value for a record of no known section. None values are left out."""
    from cs336_systems.results import flat_params

    section = str(meta.get("section") or "")
    params = {k: v for k, v in flat_params(run_params(section, meta.get("params") or {})).items() if v is not None}
    if not params:
        return ""
    run = params.pop("run_preset", None)
    defaults = preset_defaults(section, run, params.get("edition"))
    defaults = flat_params(defaults) if defaults is not None else None
    if defaults is None:
        text = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
    else:
        # Recorded keys that are no parameter (e.g. the kernel options a run resolved) follow from those that are;
        # so is "preset" where it only repeats the run's preset. An "auto" parameter (None by default) records
        # what the run resolved it to.
        shown = {k: v for k, v in params.items() if k in defaults and v != defaults[k]}
        changed = [f"{k}={_short(v)}" for k, v in shown.items() if defaults[k] is not None]
        resolved = [f"{k}={_short(v)}" for k, v in shown.items() if defaults[k] is None]
        grid = params.get("edition") if "edition" not in defaults else None  # an edition's grid, not a parameter
        flag = f"--{run}" + (f" --edition {grid}" if grid else "")
        text = f"{flag}, with " + ", ".join(changed) if changed else f"{flag} (the preset's values)"
        if resolved:
            text += " (resolved: " + ", ".join(resolved) + ")"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_params(section: str, params: dict[str, Any]) -> dict[str, Any]:
    """A record's parameters with the run's preset under ``run_preset``. Older records kept it under "preset",
    overwriting a section's own parameter of that name (a model preset, now unknown for them): there it is
    moved, not left to pass for the model."""
    if "run_preset" in params or "preset" not in params:
        return dict(params)
    out = {**params, "run_preset": params["preset"]}
    found = preset_defaults(section, params["preset"], params.get("edition"))
    if found is not None and "preset" in found:  # the section has a "preset" parameter: this was not it
        del out["preset"]
    return out


#: The sections by results folder, registered by :mod:`cs336_systems.experiments` as it loads them (so that
#: this module, which their answers use, looks nothing up above itself).
SECTIONS: dict[str, Any] = {}


def register_section(section: Any) -> None:
    SECTIONS[section.name] = section
    preset_defaults.cache_clear()


@functools.cache
def preset_defaults(section: str, preset: str | None, edition: str | None = None) -> dict[str, Any] | None:
    """The parameter values ``section`` (a results folder; an edition's grid is a subfolder) runs with under
    ``preset`` today, as they are recorded (JSON values); None where the folder or preset is no section's."""
    from cs336_systems.results import _jsonable

    found = SECTIONS.get(section.split("/")[0])
    if found is None or preset is None:
        return None
    try:
        params = found.params(preset, None, edition if found.grids else None)
    except ValueError:
        return None
    return json.loads(json.dumps(_jsonable(params)))


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(map(_short, v[:3])) + f", …, {_short(v[-1])}] ({len(v)} values)"
    if isinstance(v, list):
        return "[" + ", ".join(map(_short, v)) + "]"
    return str(v)
