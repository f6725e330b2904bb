"""The results index, ``figures/index.html``: every committed result, by folder, on one browsable page.

The writeup prints only what its answers cite. Everything else under ``figures/`` (exploratory sweeps,
lab runs, raw tables) is shown here in full, with its provenance, and each folder lists which of its
files the writeup cites and where. Figures are linked, not embedded, so the page stays small.
"""

from __future__ import annotations

import html
from pathlib import Path

from cs336_systems.report.data import params_line, provenance_line
from cs336_systems.report.document import Document, Figure, Section, Table
from cs336_systems.report.html import CSS, SCREEN_CSS, _Counter, block_html

INDEX_CSS = """
.cited { font-size: 9pt; color: #333; }
.cited code { font-size: 8pt; }
h2 a.back { font-size: 9pt; font-weight: normal; margin-left: 3mm; }
"""


def _cited(section: Section) -> list[str]:
    return sorted({b.source for b in section.walk() if isinstance(b, (Table, Figure))})


def _cited_provenance(section: Section) -> str:
    """The full record of every result the writeup cites (it prints only device · date · commit)."""
    rows = {}
    for b in section.walk():
        if isinstance(b, (Table, Figure)) and b.source not in rows:
            params = params_line(b.meta)
            rows[b.source] = (f"<li><code>{html.escape(Path(b.source).name)}</code>: "
                              f"{html.escape(provenance_line(b.meta))}"
                              + (f"; run parameters: {html.escape(params)}" if params else "") + "</li>")
    return f'<ul class="cited">{"".join(rows[k] for k in sorted(rows))}</ul>' if rows else ""


def _folder_html(section: Section, counter: _Counter, writeup: str | None) -> str:
    anchor = html.escape(section.folder)
    title = html.escape(section.title)
    back = (f' <a class="back" href="{html.escape(writeup)}#{section.anchor}">the writeup\'s §{section.number}</a>'
            if writeup and not section.number.startswith("A.") else "")
    parts = [f'<h2 id="{anchor}"><code>{anchor}/</code> · {title}{back}</h2>']
    cited = _cited(section)
    if cited:
        listed = ", ".join(f"<code>{html.escape(Path(c).name)}</code>" for c in cited)
        parts.append(f'<p class="cited">Cited by the writeup ({len(cited)}): {listed}. Their full records:</p>')
        parts.append(_cited_provenance(section))
    if section.further:
        parts.append("".join(block_html(b, counter) for b in section.further))
    elif not section.number.startswith("A."):
        parts.append('<p class="cited">Nothing else: the writeup shows every result of this folder.</p>')
    return "<section>" + "".join(parts) + "</section>"


def index_html(doc: Document, root: Path, writeup: str | None = "../writeup.html") -> str:
    """The index page for the results under ``root`` (figures linked relative to ``root``); ``writeup``
    is the HTML writeup's path relative to ``root``, for links to the sections that cite a folder."""
    counter = _Counter(link_from=Path(root))
    counter.full_provenance = True
    sections = [*doc.sections, *doc.unclaimed]
    shown = sum(isinstance(b, (Table, Figure)) for s in sections for b in s.further)
    toc = "".join(
        f'<div><a href="#{html.escape(s.folder)}">{html.escape(s.folder)}/</a> '
        f"({sum(isinstance(b, (Table, Figure)) for b in s.further)} further)</div>"
        for s in sections
    )
    intro = (
        f"<p>Every result under <code>{html.escape(Path(root).name)}/</code>, by folder: {len(doc.inputs)} files. "
        "Each folder names the files the writeup cites (and links its section); the other results, "
        f"{shown} tables and figures from exploratory runs, follow in full with their provenance. "
        "Built with the writeup by <code>uv run python -m cs336_systems.writeup build</code>.</p>"
    )
    body = "".join(_folder_html(s, counter, writeup) for s in sections)
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>Results index: {html.escape(Path(root).name)}/</title>"
        f"<style>{CSS}{SCREEN_CSS}{INDEX_CSS}</style></head><body>"
        f"<h1>Results index: <code>{html.escape(Path(root).name)}/</code></h1>{intro}"
        f"<nav class='toc'>{toc}</nav>{body}</body></html>"
    )


__all__ = ["index_html"]
