"""Results folders → :class:`Document` → HTML → ``writeup.pdf`` (+ manifest)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from cs336_systems.report import manifest as _manifest
from cs336_systems.report.commentary import notebook_intro
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Document, Missing, Section, Text
from cs336_systems.results import FIGURES_DIR

TITLE = "CS336 Assignment 2 (Systems): writeup"
NOTEBOOK_DIR = _manifest.NOTEBOOK_DIR


def _preamble(root: Path) -> list[Block]:
    return [
        Text(
            "Every number, table and figure below is read from the committed results under "
            f"`{root.name}/`, which the notebooks in `notebooks/` write through `ResultWriter`; each table and "
            "figure names the device, software versions, date and commit it was measured on. A result whose "
            "code changed since that commit opens its provenance line with **STALE** and the files that changed "
            "(`python -m cs336_systems.report status` lists them per section with the command that refreshes "
            "them). A section without results says so and names the command that produces them. Rebuild with "
            f"`{_manifest.REBUILD_COMMAND}`."
        )
    ]


def sections_() -> list[Any]:
    """The writeup's sections, in order: every section unit of :mod:`cs336_systems.experiments`."""
    from cs336_systems.experiments import SECTIONS

    return list(SECTIONS.values())


def build_section(
    spec: Any, root: Path, strict: bool = False, notebooks: Path = NOTEBOOK_DIR
) -> tuple[Section, SectionData]:
    """One section: the spec's answers, then every artefact of its folders that the answers did not use.

    A builder that fails on unexpected data (a renamed column, say) must not cost the whole writeup:
    unless ``strict``, the section says in red that its answers could not be formatted, the error is
    printed, and its results still appear generically.
    """
    data = SectionData(root, spec.name, command=spec.refresh_command, note=spec.where, depends=spec.depends or None)
    blocks: list[Block] = []
    if data.empty:
        blocks.append(Missing(f"no results in `{root.name}/{spec.name}/`", spec.refresh_command, spec.where))
    intro = notebook_intro(notebooks / f"{spec.name}.ipynb")
    if intro:
        blocks.append(Text(f"*From `notebooks/{spec.name}.ipynb`:* {intro}", role="method"))
    try:
        blocks.extend(spec.answer(data))
    except Exception as exc:
        if strict:
            raise
        data.forget_usage()
        message = f"{type(exc).__name__}: {exc}"
        print(f"warning: §{spec.number} answers failed on the data in {data.dir}: {message}", file=sys.stderr)
        blocks.append(Text(f"**The answers of this section could not be formatted from its results** "
                           f"(`{message}`); the results follow unformatted.", role="error"))
    for folder, rest in [(spec.name, data.remaining())] + [
        (extra, SectionData(root, extra).remaining()) for extra in spec.also
    ]:
        if rest:
            blocks.append(Text(f"Further results in `{root.name}/{folder}/`:", role="further"))
            blocks.extend(rest)
    return Section(spec.number, spec.title, spec.name, spec.problems, blocks), data


def build_document(root: Path = FIGURES_DIR, strict: bool = False, notebooks: Path = NOTEBOOK_DIR) -> Document:
    """The whole writeup from the results under ``root`` and the commentary of the notebooks in
    ``notebooks`` (no rendering, no browser)."""
    root = Path(root)
    sections: list[Section] = []
    known = set()
    for spec in sections_():
        section, _ = build_section(spec, root, strict, notebooks)
        sections.append(section)
        known.update((spec.name, *spec.also))
    # Result folders no section claims (e.g. a new notebook) still appear, generically.
    extra = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in known and not p.name.startswith(".")) \
        if root.is_dir() else []
    for i, folder in enumerate(extra, start=1):
        data = SectionData(root, folder, command=f"uv run python -m cs336_systems.notebooks run {folder}")
        blocks = data.remaining()
        if blocks:
            note = Text(f"Results in `{root.name}/{folder}/` that no section of the writeup claims, shown as "
                        "committed.", role="further")
            sections.append(Section(f"A.{i}", f"Other results: {folder}", folder, (folder,), [note, *blocks]))
    return Document(TITLE, _preamble(root), sections, _manifest.result_files(root))


def write_html(doc: Document, path: Path) -> Path:
    from cs336_systems.report.html import document_html

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document_html(doc), encoding="utf-8")
    return path


def build(
    output: Path = _manifest.DEFAULT_PDF,
    root: Path = FIGURES_DIR,
    manifest: Path | None = _manifest.DEFAULT_MANIFEST,
    html_path: Path | None = None,
    strict: bool = False,
) -> Path:
    """Render the writeup to ``output`` and, unless ``manifest`` is None, record its inputs."""
    from cs336_systems.report.pdf import html_to_pdf

    doc = build_document(root, strict)
    with tempfile.TemporaryDirectory(prefix="cs336-writeup-") as tmp:
        html = write_html(doc, Path(html_path) if html_path else Path(tmp) / "writeup.html")
        html_to_pdf(html, Path(output), date=_manifest.inputs_date(root))
    if manifest is not None:
        _manifest.write_manifest(Path(output), root, Path(manifest))
    return Path(output)


__all__ = ["build", "build_document", "write_html"]
