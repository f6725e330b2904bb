"""Result records with provenance.

Every table, figure and JSON a notebook or benchmark exports goes through :class:`ResultWriter`, which
writes the artefact plus a ``<name>.meta.json`` sidecar recording the device, software versions, git
commit, date and the parameters of the run. The writeup builder reads the same files back with
:func:`load_table` / :func:`load_json` / :func:`load_meta`, so every quoted number has a source.

Where results go:
- a real (GPU) run writes to ``figures/<section>/`` (committed);
- a smoke run (CPU, tiny parameters) writes to ``.scratch/figures/<section>/`` (git-ignored), so it can
  never overwrite measured results;
- ``publish=False`` sends a full run there too (an analytic section, a replot), until it is asked to
  publish;
- ``CS336_FIGURES_DIR`` overrides the root for either.

Rewriting an artefact whose bytes did not change leaves the file untouched, and its sidecar too when the
run's code (commit) is the same: re-running a deterministic section leaves a clean checkout clean. The same
bytes from a newer commit update only the sidecar's commit, date and command line (in place), so the record
says which code the result describes. A replot never touches the measuring run's record.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cs336_systems import calibration
from cs336_systems.measured_code import REPO_ROOT, git

FIGURES_DIR = REPO_ROOT / "figures"
SCRATCH_DIR = REPO_ROOT / ".scratch"


#: Provenance fields that describe the measuring run (copied onto artefacts derived from it).
MEASUREMENT_KEYS = (
    "device", "device_type", "num_gpus", "gpu_memory_gib", "cuda", "torch", "triton", "python",
    "float32_matmul_precision", "git_commit", "date", "calibration",
)


def is_smoke_run(smoke: bool | None = None) -> bool:
    """Decide smoke vs real: an explicit argument wins, then ``CS336_SMOKE`` (0/1), then "no CUDA GPU"."""
    if smoke is not None:
        return bool(smoke)
    env = os.environ.get("CS336_SMOKE")
    if env not in (None, ""):
        return env not in ("0", "false", "False")
    return not torch.cuda.is_available()


def results_root(smoke: bool, publish: bool | None = None) -> Path:
    """Where results go: ``CS336_FIGURES_DIR`` if set, else ``figures/`` for a published real run and
    ``.scratch/figures/`` for everything else (``publish=None`` means "publish unless smoke")."""
    override = os.environ.get("CS336_FIGURES_DIR")
    if override:
        return Path(override)
    publish = not smoke if publish is None else publish and not smoke
    return FIGURES_DIR if publish else SCRATCH_DIR / "figures"


#: Sidecar fields that change on every run without the result changing.
VOLATILE_META_KEYS = ("git_commit", "date", "argv", "rendered", "calibration")


def _write_bytes_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` unless ``path`` already holds exactly it; True if the file changed."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.write_bytes(data)
    return True


@functools.cache
def _git(*args: str) -> str:
    return (git(args, REPO_ROOT) or "").strip()


def git_commit() -> str:
    """HEAD's commit, with ``-dirty`` when tracked files under the library differ from it; or the commit named by
    ``CS336_GIT_COMMIT`` (a copy of the tree without its ``.git``), which must be a full hash: staleness and the
    merging of a grid's jobs compare commits exactly, so a short or mistyped one would orphan the result."""
    pinned = os.environ.get("CS336_GIT_COMMIT")
    if pinned:
        if not _FULL_COMMIT.fullmatch(pinned):
            raise ValueError(f"CS336_GIT_COMMIT must be a full 40-hex commit hash (optionally -dirty), got {pinned!r}")
        return pinned
    commit = _git("rev-parse", "HEAD") or "unknown"
    if commit != "unknown" and uncommitted_library_files():
        commit += "-dirty"
    return commit


def uncommitted_library_files() -> list[str]:
    """The tracked library files that differ from HEAD (what makes :func:`git_commit` say ``-dirty``)."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "cs336_systems", "cs336-basics")
    return [line[3:] for line in status.splitlines() if line.strip()]


def dirty_warning(commit: str) -> str:
    """A one-line warning for a measured run whose results will record ``commit`` with ``-dirty``: such results
    read as stale at once and never combine with another job's (empty for a clean commit)."""
    if not commit.endswith("-dirty"):
        return ""
    files = [] if os.environ.get("CS336_GIT_COMMIT") else uncommitted_library_files()
    named = f" ({', '.join(files[:3])}{f' and {len(files) - 3} more' if len(files) > 3 else ''})" if files else ""
    sha = commit.removesuffix("-dirty")[:9]
    return (f"WARNING: the library differs from commit {sha}{named}: these results will record {sha}-dirty and "
            "read as stale at once. Commit first; on a copy of the tree, pack its history again (python -m "
            "cs336_systems.writeup history) at the commit it is sent from.")


_FULL_COMMIT = re.compile(r"[0-9a-f]{40}(-dirty)?")


def device_description() -> dict[str, Any]:
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        return {
            "device": torch.cuda.get_device_name(0),
            "device_type": "cuda",
            "num_gpus": n,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
        }
    return {"device": f"CPU ({platform.processor() or platform.machine()})", "device_type": "cpu", "num_gpus": 0}


def software_versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        # "highest" means true fp32 matmuls; "high" allows TF32 on Ampere and newer.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def provenance(params: dict[str, Any] | None = None, *, smoke: bool | None = None) -> dict[str, Any]:
    """Everything needed to say where a number came from."""
    return {
        **device_description(),
        **software_versions(),
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": is_smoke_run(smoke),
        "argv": sys.argv[1:] if sys.argv and not sys.argv[0].endswith("ipykernel_launcher.py") else [],
        "params": _jsonable(params or {}),
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(obj))
    return str(obj)


class ResultWriter:
    """Writes one section's artefacts, each with a provenance sidecar.

    >>> out = ResultWriter("benchmarking", params={"steps": 10})
    >>> out.table(df, "timings")          # timings.csv, timings.md, timings.meta.json
    >>> out.figure(fig, "timings")        # timings.png, timings.meta.json
    """

    def __init__(
        self,
        section: str,
        params: dict[str, Any] | None = None,
        smoke: bool | None = None,
        *,
        publish: bool | None = None,
    ):
        self.section = section
        self.smoke = is_smoke_run(smoke)
        self.params = dict(params or {})
        self.root = results_root(self.smoke, publish)
        """The results root (``figures/`` or ``.scratch/figures/``); ``section`` may be a subfolder path."""
        self.dir = self.root / section
        self.dir.mkdir(parents=True, exist_ok=True)
        #: The calibrations of earlier jobs whose rows this writer merged into a table (:func:`rows_of_this_run`).
        #: Every table it writes afterwards records them: the section's other tables (a summary, a speed-up) are
        #: computed from the merged rows.
        self.merged_calibrations: list[dict[str, Any] | None] = []

    def path(self, filename: str) -> Path:
        return self.dir / filename

    def _meta(
        self,
        name: str,
        files: list[str],
        params: dict[str, Any] | None,
        extra: dict[str, Any] | None,
        source: dict[str, Any] | None = None,
        changed: bool = True,
        inherit_extra: bool = False,
    ) -> Path:
        meta = provenance({**self.params, **(params or {})}, smoke=self.smoke)
        job_calibration = calibration.JOB.record()
        if job_calibration is not None:
            meta["calibration"] = job_calibration
            if self.merged_calibrations:  # the earlier jobs' machines too: their rows are in what this job writes
                meta["calibration"] = {**job_calibration, "merged": list(self.merged_calibrations)}
        if source is not None:
            # Derived from a measurement (a plot or a model fit made later, perhaps on a laptop): the
            # numbers belong to the measuring run, so its device, versions, commit and date are recorded;
            # where and when the derivation ran is kept under "rendered".
            rendered = {k: meta[k] for k in ("device", "git_commit", "date")}
            meta.pop("calibration", None)  # the measuring job's machine, not this one's
            meta.update({k: source[k] for k in MEASUREMENT_KEYS if k in source})
            meta["smoke"] = bool(source.get("smoke", meta["smoke"]))
            meta["rendered"] = rendered
            if isinstance(source.get("params"), dict):  # and its parameters, unless this call names others
                meta["params"] = {**source["params"], **(params or {})}
        meta.update(section=self.section, name=name, files=files)
        if extra:
            meta["extra"] = _jsonable(extra)
        path = self.dir / f"{name}.meta.json"
        if path.exists():  # several artefacts of one name (table + figure) share a sidecar
            old = json.loads(path.read_text())
            meta["files"] = sorted(set(old.get("files", [])) | set(files))
            if inherit_extra and "extra" not in meta and "extra" in old:
                meta["extra"] = old["extra"]  # the table's extra, kept when its figure is written beside it
            if not changed and source is not None:
                return path  # the same bytes derived from the same measurement (a replot): keep its record
            if not changed and _stable(old) == _stable(meta):
                if _commit(old) == _commit(meta) or _same_measuring_code(old, self.section):
                    # The same result from the same code (the same commit, or a later one at which none of
                    # the section's dependencies changed): nothing to record, and the record stays byte-identical.
                    return path
                # The same result from newer code: it now describes that code (which is what staleness
                # checks), so only the commit, date and command line move, in place.
                meta = {**old, **{k: meta[k] for k in VOLATILE_META_KEYS if k in meta}}
        _write_bytes_if_changed(path, (json.dumps(meta, indent=2) + "\n").encode())
        if source is None or (job_calibration is not None
                              and calibration.without_merged(meta.get("calibration")) == job_calibration):
            calibration.JOB.note_written(path)  # measured in this job, or derived from what this job measured
        return path

    def table(
        self,
        df: Any,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        index: bool = False,
        floatfmt: str = ".4g",
        extra: dict[str, Any] | None = None,
        source: dict[str, Any] | None = None,
    ) -> Path:
        """A pandas DataFrame as ``name.csv`` (full precision) and ``name.md`` (formatted)."""
        csv = self.dir / f"{name}.csv"
        changed = _write_bytes_if_changed(csv, df.to_csv(index=index).encode())
        md = (df.to_markdown(index=index, floatfmt=floatfmt) + "\n").encode()
        changed |= _write_bytes_if_changed(self.dir / f"{name}.md", md)
        self._meta(name, [csv.name, f"{name}.md"], params, extra, source, changed)
        return csv

    def figure(
        self,
        fig: Any,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        dpi: int = 150,
        source: dict[str, Any] | None = None,
    ) -> Path:
        """A matplotlib figure as ``name.png``. Pass the ``.meta.json`` of the data it plots as ``source``
        when the plot is drawn from earlier measurements."""
        import io

        png = self.dir / f"{name}.png"
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
        changed = _write_bytes_if_changed(png, buf.getvalue())
        self._meta(name, [png.name], params, None, source, changed, inherit_extra=True)
        return png

    def json(
        self, obj: Any, name: str, params: dict[str, Any] | None = None, *, source: dict[str, Any] | None = None
    ) -> Path:
        path = self.dir / f"{name}.json"
        changed = _write_bytes_if_changed(path, (json.dumps(_jsonable(obj), indent=2) + "\n").encode())
        self._meta(name, [path.name], params, None, source, changed, inherit_extra=True)
        return path

    def banner(self) -> str:
        """A one-line statement of what kind of run this is, for notebook output."""
        where = self.dir.relative_to(REPO_ROOT) if self.dir.is_relative_to(REPO_ROOT) else self.dir
        if self.smoke:
            return (
                f"SMOKE RUN ({device_description()['device']}): small parameters, numbers are not GPU results; "
                f"artefacts go to {where}"
            )
        if self.dir.is_relative_to(SCRATCH_DIR):
            return (f"Run on {device_description()['device']}, not published: artefacts go to {where} "
                    "(ask to publish to write figures/)")
        warning = dirty_warning(git_commit())
        return f"Measured run on {device_description()['device']}; artefacts go to {where}" + (
            f"\n{warning}" if warning else "")


def _commit(meta: dict[str, Any]) -> str:
    return str(meta.get("git_commit", ""))


def _stable(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in VOLATILE_META_KEYS}


def section_dir(section: str, root: Path | None = None) -> Path:
    return (root or FIGURES_DIR) / section


def load_meta(section: str, name: str, root: Path | None = None) -> dict[str, Any]:
    return json.loads((section_dir(section, root) / f"{name}.meta.json").read_text())


def load_table(section: str, name: str, root: Path | None = None) -> Any:
    import pandas as pd

    return pd.read_csv(section_dir(section, root) / f"{name}.csv")


def load_json(section: str, name: str, root: Path | None = None) -> Any:
    return json.loads((section_dir(section, root) / f"{name}.json").read_text())


def has_result(section: str, name: str, root: Path | None = None) -> bool:
    return (section_dir(section, root) / f"{name}.meta.json").exists()


def rows_of_this_run(out: ResultWriter, name: str, params: dict[str, Any], same: tuple[str, ...]) -> Any:
    """The existing table ``name`` of ``out`` if it was measured by this code, on this device, with equal
    values of the parameters named in ``same``; otherwise None, after printing one line that says why (a job
    that silently starts a new table would drop the earlier jobs' rows unnoticed).

    A grid too long for one GPU job is measured in several (other contexts, other model sizes), each adding
    its rows to the table; a table from other code, another device or other settings is replaced instead,
    so every table keeps a single provenance. "This code" is this commit, or an earlier one at which none of
    the section's dependencies differed (:mod:`cs336_systems.measured_code`, the test the writeup applies):
    a commit of notes or answer text between two jobs does not split their table. The combined table records
    the later commit, whose code it describes, and every job's calibration: the earlier jobs' under the
    record's ``merged`` (:func:`cs336_systems.calibration.verdict` judges them all)."""
    if not (out.dir / f"{name}.meta.json").exists():
        return None
    meta = load_meta(out.section, name, root=out.root)
    why = _why_not_this_run(meta, out, params, same)
    if why:
        print(f"{out.section}/{name}: the existing table is replaced, not extended: {why}")
        return None
    calibration.add_merged(out.merged_calibrations, meta.get("calibration"), calibration.JOB.record())
    return load_table(out.section, name, root=out.root)


def _why_not_this_run(meta: dict[str, Any], out: ResultWriter, params: dict[str, Any],
                      same: tuple[str, ...]) -> str | None:
    """Why the table recorded by ``meta`` is not this run's to extend (None where it is)."""
    device = device_description()["device"]
    if meta.get("device") != device:
        return f"it was measured on {meta.get('device') or 'a device it does not record'}, this job runs on {device}"
    if meta.get("smoke") != out.smoke:
        return f"it records smoke={meta.get('smoke')}, this job runs smoke={out.smoke}"
    then, now = str(meta.get("git_commit") or "unknown"), git_commit()
    if now == "unknown" or then == "unknown":  # two runs outside git may be any two versions of the code
        return (f"{'this job runs' if now == 'unknown' else 'it was measured'} outside git (no .git, no "
                "CS336_GIT_COMMIT), so nothing shows the code is the same")
    if then != now and not _same_measuring_code(meta, out.section):
        if then.endswith("-dirty"):
            return f"it was measured with uncommitted changes on top of {then[:12]}"
        if now.endswith("-dirty"):
            return "this job runs uncommitted library changes"
        return (f"it was measured at {then[:12]}, and the section's code changed since, or "
                "git here lacks that commit (a copy without .git cannot compare commits)")
    differ = settings_differ(meta.get("params") or {}, params, same)
    if differ:
        return "its settings differ in " + ", ".join(differ)
    return None


def settings_differ(recorded_params: dict[str, Any], params: dict[str, Any], same: Sequence[str]) -> list[str]:
    """The parameters named in ``same`` (dotted for groups) whose values differ between a table's recorded
    parameters and ``params``, compared as recorded: JSON turns int keys and tuples into strings and lists."""
    return [k for k in same if _jsonable(recorded(recorded_params, k)) != _jsonable(recorded(params, k))]


def _same_measuring_code(meta: dict[str, Any], section: str) -> bool:
    """Whether ``meta``'s commit and the running code agree on every dependency of ``section`` (its results
    folder): both committed (no ``-dirty``), and no definition they depend on changed between them (False
    where git cannot tell)."""
    from cs336_systems.measured_code import depends_of, same_measuring_code

    return same_measuring_code(str(meta.get("git_commit") or ""), git_commit(), depends_of(section),
                               results=str(meta.get("section") or section),
                               table=str(meta["name"]) if meta.get("name") else None)


def merge_rows(rows: Any, earlier: Any, key: str | Sequence[str], order: list[Any] | None = None) -> Any:
    """``rows`` with the rows of ``earlier`` whose ``key`` value ``rows`` does not measure, ordered by ``key``
    (by its position in ``order`` when given; values not in it go last). With several key columns a cell is
    their combination, and the earlier rows kept come first, then ``rows``, each in its own order."""
    import pandas as pd

    if earlier is None:
        return rows
    if rows is None:
        return earlier
    if not isinstance(key, str):
        cells = set(rows[list(key)].itertuples(index=False, name=None))
        measured = pd.Series([c in cells for c in earlier[list(key)].itertuples(index=False, name=None)],
                             index=earlier.index, dtype=bool)
        return pd.concat([earlier[~measured], rows], ignore_index=True)
    kept = earlier[~earlier[key].isin(set(rows[key]))]
    both = pd.concat([kept, rows], ignore_index=True)
    rank = both[key] if order is None else both[key].map({v: i for i, v in enumerate(order)}).fillna(len(order))
    return both.iloc[rank.argsort(kind="stable")].reset_index(drop=True)


def result_metas(folder: Path) -> dict[str, dict[str, Any]]:
    """Every ``<name>.meta.json`` of a results folder (unreadable ones as empty records)."""
    metas = {}
    for path in sorted(Path(folder).glob("*.meta.json")):
        try:
            metas[path.name.removesuffix(".meta.json")] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            metas[path.name.removesuffix(".meta.json")] = {}
    return metas


def recorded(params: dict[str, Any], name: str, default: Any = None) -> Any:
    """The recorded parameter ``name``; ``GROUP.NAME`` reads into a group's nested record."""
    value: Any = params
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def flat_params(params: dict[str, Any]) -> dict[str, Any]:
    """Recorded parameters with each group's spelled as ``GROUP.NAME`` (how ``--set`` names them)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_params(value).items()})
        else:
            out[key] = value
    return out
