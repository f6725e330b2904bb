"""The writeup's input manifest: proof that ``writeup.pdf`` is not older than what it is made from.

``build`` records the sha256 of every file under the results root (all of ``figures/``, since the
writeup shows every committed result), of the builder's own source, and of the PDF it wrote.
``check`` recomputes them: any added, removed or changed result, a builder change, or a PDF that is
not the one built, makes the writeup stale, and the fix is always the same single command.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from cs336_systems.report.commentary import notebook_intro
from cs336_systems.report.staleness import stale_results
from cs336_systems.results import FIGURES_DIR, REPO_ROOT

MANIFEST_NAME = "writeup_manifest.json"
#: The results index the build writes into the results root (an output, not a result).
INDEX_NAME = "index.html"
DEFAULT_PDF = REPO_ROOT / "writeup.pdf"
DEFAULT_MANIFEST = FIGURES_DIR / MANIFEST_NAME
REBUILD_COMMAND = "uv run python -m cs336_systems.writeup build"
NOTEBOOK_DIR = REPO_ROOT / "notebooks"

#: Source files whose change alters the document: the blocks and renderers, the sections (their answer text),
#: the builder and the analytic models whose numbers the answers compute (the preset calculator, the data-sheet peaks,
#: the DDP overhead model).
BUILDER_ROOTS = (
    REPO_ROOT / "cs336_systems" / "report",
    REPO_ROOT / "cs336_systems" / "experiments",
    REPO_ROOT / "cs336_systems" / "writeup",
    REPO_ROOT / "cs336_systems" / "configs.py",
    REPO_ROOT / "cs336_systems" / "hardware.py",
    REPO_ROOT / "cs336_systems" / "benchmarking" / "ddp_overhead_model.py",
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(path: Path, base: Path) -> str:
    path = path.resolve()
    return path.relative_to(base).as_posix() if path.is_relative_to(base) else path.as_posix()


def result_files(root: Path) -> list[Path]:
    """Every result file under ``root`` (hidden files and the manifest itself excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.relative_to(root).as_posix() not in (MANIFEST_NAME, INDEX_NAME)
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def builder_files() -> list[Path]:
    files: list[Path] = []
    for r in BUILDER_ROOTS:
        files.extend(sorted(r.rglob("*.py")) if r.is_dir() else [r])
    return [f for f in files if "__pycache__" not in f.parts]


def fingerprint(root: Path, notebooks: Path = NOTEBOOK_DIR) -> dict[str, dict[str, str]]:
    """Hashes of the inputs: ``results`` keyed relative to ``root``; the commentary of the ``notebooks``
    (which opens each section) and the ``builder`` source keyed relative to the repository."""
    root = Path(root).resolve()
    return {
        "results": {_key(p, root): sha256(p) for p in result_files(root)},
        # Only the commentary the writeup quotes: editing a notebook's code does not stale the PDF.
        "notebooks": {
            _key(p, REPO_ROOT): hashlib.sha256((notebook_intro(p) or "").encode()).hexdigest()
            for p in sorted(Path(notebooks).glob("*.ipynb"))
        },
        "builder": {_key(p, REPO_ROOT): sha256(p) for p in builder_files()},
        # Which results the PDF marks STALE: a code change that stales a result stales the PDF too. (Only
        # which ones: the files listed in a mark may grow without a rebuild.)
        "stale": sorted(stale_results(root)),
    }


def inputs_date(root: Path) -> str | None:
    """The newest measurement date among the results under ``root`` (the writeup's "as of" date)."""
    dates = []
    for meta in Path(root).rglob("*.meta.json"):
        try:
            dates.append(_dt.datetime.fromisoformat(json.loads(meta.read_text())["date"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(dates).isoformat(timespec="seconds") if dates else None


def pdf_pages(pdf: Path) -> int:
    """The number of pages of a PDF (its page objects; Chromium writes no object streams)."""
    return len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", Path(pdf).read_bytes()))


#: The page budget of each writeup's answers to the handout (before its appendix).
MAIN_PAGES_BUDGET = 30


def write_manifest(pdf: Path, root: Path, manifest: Path, notebooks: Path = NOTEBOOK_DIR,
                   outputs: list[Path] = (), main_pages: dict[str, int] | None = None) -> dict[str, Any]:
    """``main_pages``: per PDF, the pages of its answers before the appendix (what the page budget counts)."""
    data: dict[str, Any] = {
        "rebuild": REBUILD_COMMAND,
        # No wall-clock build time: a rebuild from unchanged inputs writes the same manifest.
        "inputs_date": inputs_date(root),
        "pdf": {"path": _key(Path(pdf), REPO_ROOT), "sha256": sha256(Path(pdf)), "pages": pdf_pages(Path(pdf))},
        "main_pages": dict(main_pages or {}),
        # The other renderings of the same document (the HTML writeup, the results index).
        "outputs": {_key(Path(p), REPO_ROOT): sha256(Path(p)) for p in outputs},
        **fingerprint(root, notebooks),
    }
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return data


def uncommitted_inputs(root: Path, notebooks: Path = NOTEBOOK_DIR) -> list[str]:
    """Inputs that differ from git's HEAD (modified or untracked). A manifest built over them matches
    only this working tree, not a clean checkout, until they are committed too."""
    paths = [Path(root), *BUILDER_ROOTS]
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", *map(str, paths)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    skip = {MANIFEST_NAME, DEFAULT_PDF.name, INDEX_NAME}
    return [line[3:] for line in out.splitlines() if line[3:] and Path(line[3:]).name not in skip
            and "__pycache__" not in line]


def _diff(kind: str, old: dict[str, str], new: dict[str, str]) -> list[str]:
    problems = []
    for k in sorted(set(new) - set(old)):
        problems.append(f"{kind} file added since the last build: {k}")
    for k in sorted(set(old) - set(new)):
        problems.append(f"{kind} file removed since the last build: {k}")
    for k in sorted(set(old) & set(new)):
        if old[k] != new[k]:
            problems.append(f"{kind} file changed since the last build: {k}")
    return problems


def check_manifest(
    pdf: Path = DEFAULT_PDF, root: Path = FIGURES_DIR, manifest: Path = DEFAULT_MANIFEST, notebooks: Path = NOTEBOOK_DIR
) -> list[str]:
    """Reasons the committed PDF is stale (empty when it is up to date)."""
    pdf, manifest = Path(pdf), Path(manifest)
    if not manifest.exists():
        return [f"no manifest at {_key(manifest, REPO_ROOT)}"]
    recorded = json.loads(manifest.read_text())
    problems: list[str] = []
    if not pdf.exists():
        problems.append(f"{_key(pdf, REPO_ROOT)} does not exist")
    elif sha256(pdf) != recorded.get("pdf", {}).get("sha256"):
        problems.append(f"{_key(pdf, REPO_ROOT)} is not the PDF the manifest was written for")
    for key, digest in recorded.get("outputs", {}).items():
        path = Path(key) if Path(key).is_absolute() else REPO_ROOT / key
        if not path.exists():
            problems.append(f"{key} does not exist")
        elif sha256(path) != digest:
            problems.append(f"{key} is not the one built with the PDF")
    now = fingerprint(root, notebooks)
    problems += _diff("result", recorded.get("results", {}), now["results"])
    problems += _diff("notebook", recorded.get("notebooks", {}), now["notebooks"])
    problems += _diff("builder", recorded.get("builder", {}), now["builder"])
    if sorted(recorded.get("stale", [])) != now["stale"]:
        newly = sorted(set(now["stale"]) - set(recorded.get("stale", [])))
        gone = sorted(set(recorded.get("stale", [])) - set(now["stale"]))
        problems.append("the PDF's STALE marks are out of date (code changed since their results were measured): "
                        + (f"newly stale {newly[:3]}" if newly else "") + (f" fresh again {gone[:3]}" if gone else ""))
    return problems
