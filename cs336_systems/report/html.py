"""Document → one self-contained HTML file, styled for print.

Math is rendered offline by matplotlib's mathtext (a LaTeX subset, no TeX install) to SVG and
embedded as data URIs, so the browser that prints the page needs no fonts or scripts beyond the
page itself. Figures are embedded the same way; the HTML file alone reproduces the PDF.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import html
import io
import os
import re
from pathlib import Path
from typing import Any

import markdown as _markdown

from cs336_systems.report import fmt, tables
from cs336_systems.report.data import (
    DISAGREES_MARK,
    SMOKE_MARK,
    STALE_MARK,
    SUSPECT_MARK,
    params_line,
    provenance_line,
)
from cs336_systems.report.document import (
    Block,
    Console,
    Document,
    Equation,
    Figure,
    Missing,
    Question,
    Section,
    Table,
    Text,
)

MATH_FONT_PT = 11.0

CSS = """
@page {
  size: A4;
  margin: 16mm 15mm 18mm 15mm;
  @bottom-center { content: counter(page) " / " counter(pages); font: 8pt "Liberation Sans", sans-serif; color: #666; }
}
html { font-family: "Liberation Serif", "Times New Roman", serif; font-size: 10.5pt; line-height: 1.38; color: #111; }
body { margin: 0; }
h1 { font-size: 20pt; margin: 0 0 2mm 0; }
h1.appendix { break-before: page; }
h2 { font-size: 14pt; margin: 7mm 0 2mm 0; border-bottom: 0.6pt solid #999; padding-bottom: 1mm;
     break-after: avoid; }
h2 .num { color: #555; margin-right: 2.5mm; }
div.problems { font: 7.5pt "Liberation Mono", monospace; color: #777; text-align: right; margin: -1.5mm 0 1.5mm 0;
               break-after: avoid; }
h3 { font-size: 11pt; margin: 4mm 0 1mm 0; break-after: avoid; }
h3 .label { color: #555; margin-right: 1.5mm; }
h3 .prompt { font-weight: normal; font-style: italic; }
p { margin: 1.2mm 0 2mm 0; }
code { font-family: "Liberation Mono", "DejaVu Sans Mono", monospace; font-size: 8.6pt; background: #f3f3f3;
       padding: 0 0.6mm; border-radius: 0.6mm; }
.subtitle { color: #444; font-size: 9.5pt; margin-bottom: 4mm; }
nav.toc { columns: 2; column-gap: 8mm; font-size: 9.5pt; margin: 3mm 0 5mm 0; border-top: 0.6pt solid #999;
          border-bottom: 0.6pt solid #999; padding: 2mm 0; }
nav.toc a { color: #111; text-decoration: none; }
nav.toc div { break-inside: avoid; }
nav.toc .missing-mark { color: #b35c00; font-size: 8pt; }
figure { margin: 3mm 0; break-inside: avoid; text-align: center; }
figure img { max-width: 92%; max-height: 82mm; }
@page landscape { size: A4 landscape; }
figure.landscape { page: landscape; }
figure.landscape img { max-width: 100%; max-height: 160mm; }
figure.large img { max-width: 100%; max-height: 150mm; }
figure.landscape.shared img { max-height: 70mm; }
section.landscape { page: landscape; }  /* a section of landscape figures alone: its heading on their page */
section.landscape figure.landscape img { max-height: 135mm; }
figure.table { overflow: hidden; }
figure.table.long { break-inside: auto; overflow: visible; }  /* long tables run over pages, header repeated */
figure.table.long figcaption { break-after: avoid; }
figcaption { font-size: 8.8pt; text-align: left; margin-top: 1mm; }
figure.table figcaption { margin: 0 0 1mm 0; }
.prov { display: block; font: 7pt "Liberation Sans", sans-serif; color: #666; margin-top: 0.4mm; }
.prov code { font-size: 6.8pt; background: none; padding: 0; }
.prov .smoke { color: #b00; font-weight: bold; }
table { border-collapse: collapse; margin: 0 auto; font: 8pt "Liberation Sans Narrow", "Liberation Sans", sans-serif; }
table.wide { font-size: 7pt; }
table.wider { font-size: 6.2pt; }
table.wider th, table.wider td { padding: 0.4mm 1mm; }
figcaption .note { color: #555; }
p.caveat { font-style: italic; color: #8a1c1c; }
thead { display: table-header-group; }
tr { break-inside: avoid; }
th, td { padding: 0.5mm 1.6mm; border-bottom: 0.3pt solid #ccc; }
th { border-bottom: 0.8pt solid #444; border-top: 0.8pt solid #444; font-weight: bold; vertical-align: bottom; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.txt { text-align: left; overflow-wrap: anywhere; max-width: 70mm; }
td.txt.word { white-space: nowrap; }
.missing { border-left: 2.2pt solid #d98200; background: #fff6e8; padding: 1.5mm 3mm; margin: 2mm 0;
           font-size: 9.5pt; break-inside: avoid; }
.missing code { background: #fdebd0; }
figure.console { text-align: left; }
figure.console pre { font: 7.8pt "Liberation Mono", "DejaVu Sans Mono", monospace; background: #1e1e1e; color: #e8e8e8;
                     padding: 2mm 3mm; margin: 0; white-space: pre-wrap; overflow-wrap: anywhere; border-radius: 1mm; }
.equation { text-align: center; margin: 2mm 0; break-inside: avoid; }
.equation img { display: block; margin: 1.2mm auto; }
img.math { display: inline; }
div.error p { color: #b00; }
div.method { border-left: 1.5pt solid #bbb; padding: 0 0 0 3mm; margin: 2mm 0 3mm 0; color: #333;
             font-size: 8.8pt; line-height: 1.3; }
div.method p { margin: 0.8mm 0; }
div.further { break-after: avoid; }
p.deferred { font-size: 8.8pt; color: #555; }
div.further p { font-size: 9.5pt; color: #333; margin-top: 4mm; break-after: avoid; }
"""

#: On a screen (the HTML writeup, the results index) the page is a readable column rather than A4 sheets.
SCREEN_CSS = """
@media screen {
  body { max-width: 185mm; margin: 0 auto; padding: 8mm 6mm 20mm 6mm; }
  figure img { max-height: none; }
  figure.landscape img { max-width: 100%; }
}
"""


# -- math --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2048)
def render_math(tex: str, size_pt: float = MATH_FONT_PT) -> tuple[str, float, float, float]:
    """``tex`` (mathtext, without dollars) → (SVG data URI, width pt, height pt, depth pt).

    Raises ``ValueError`` naming the formula when mathtext cannot parse it, so a typo in a
    derivation fails the build instead of printing raw TeX.
    """
    from matplotlib import rc_context
    from matplotlib.font_manager import FontProperties
    from matplotlib.mathtext import math_to_image

    buf = io.BytesIO()
    try:
        with rc_context({"mathtext.fontset": "stix", "svg.fonttype": "path", "svg.hashsalt": "cs336"}):
            depth = math_to_image(f"${tex}$", buf, prop=FontProperties(size=size_pt), dpi=72, format="svg")
    except ValueError as e:
        raise ValueError(f"cannot typeset formula {tex!r}: {e}") from None
    svg = buf.getvalue().decode()
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.DOTALL)  # drops the timestamp
    m = re.search(r'width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    width, height = (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)
    uri = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    return uri, width, height, float(depth or 0.0)


def math_img(tex: str, display: bool = False) -> str:
    """An ``<img>`` of the formula; display math uses full-size fractions (``\\dfrac``), as TeX does."""
    if display:
        tex = re.sub(r"\\frac(?=[{\s])", r"\\dfrac", tex)
    uri, w, h, depth = render_math(tex, MATH_FONT_PT * (1.1 if display else 1.0))
    style = f"width:{w:.2f}pt;height:{h:.2f}pt"
    if not display:
        style += f";vertical-align:-{depth:.2f}pt"
    alt = html.escape(tex, quote=True)
    return f'<img class="math" alt="{alt}" style="{style}" src="{uri}">'


_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.DOTALL)
_INLINE = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<![\s\\])\$(?!\$)")


def markdown_to_html(text: str, lenient: bool = False) -> str:
    """Markdown with ``$$display$$`` and ``$inline$`` math → HTML (math swapped in after Markdown,
    so Markdown never sees TeX's underscores and asterisks).

    ``lenient`` (for quoted notebook commentary, written for Jupyter's MathJax): a formula mathtext
    cannot typeset is shown as code instead of failing the build.
    """
    pieces: list[str] = []

    def typeset(tex: str, display: bool) -> str:
        try:
            img = math_img(tex, display)
        except ValueError:
            if not lenient:
                raise
            return f"<code>{html.escape(tex)}</code>"
        return f'<span class="equation">{img}</span>' if display else img

    def stash(html_snippet: str) -> str:
        pieces.append(html_snippet)
        return f"MATHPLACEHOLDER{len(pieces) - 1}X"

    text = _DISPLAY.sub(lambda m: stash(typeset(m.group(1).strip(), True)), text)
    text = _INLINE.sub(lambda m: stash(typeset(m.group(1), False)), text)
    text = text.replace(r"\$", "$")
    out = _markdown.markdown(text, extensions=["tables", "sane_lists"])
    return re.sub(r"MATHPLACEHOLDER(\d+)X", lambda m: pieces[int(m.group(1))], out)


# -- blocks ------------------------------------------------------------------------------------------


class _Counter:
    """Table and figure numbers, and how figures are referenced: embedded as data URIs (``link_from``
    None: the file alone is the document, as the PDF printer needs) or linked by a relative path from the
    folder ``link_from`` where the HTML file is written (small files that a browser opens in place)."""

    def __init__(self, link_from: Path | None = None) -> None:
        self.tables = 0
        self.figures = 0
        self.link_from = link_from
        self.deferred: list[str] | None = None
        """While a section renders: its landscape figures, placed after the rest of it."""
        self.full_provenance = False
        """Under each table and figure the whole record (versions, run parameters), as the results index
        shows it; else the short line a reader of the writeup needs (device · date · commit, and any mark)."""


def _prov_html(meta: dict[str, Any], source: str, full: bool = True) -> str:
    prov = html.escape(provenance_line(meta, short=not full))
    prov = prov.replace(SMOKE_MARK, f'<span class="smoke">{SMOKE_MARK}</span>')
    prov = prov.replace(STALE_MARK, f'<span class="smoke">{STALE_MARK}</span>')
    for mark in (SUSPECT_MARK, DISAGREES_MARK):
        prov = prov.replace(mark, f'<span class="smoke">{mark}</span>')
    line = f"Source <code>{html.escape(source)}</code> · {prov}"
    params = params_line(meta) if full else ""
    if params:
        line += f"<br>Run parameters: {html.escape(params)}"
    return f'<span class="prov">{line}</span>'


_NUMBER_TEXT = re.compile(r"^(—|[-+−]?[\d,.]+(e[-+]?\d+)?(×|%)?( ± \S+)?)$")


#: Text cells this short and without spaces (preset names, statuses, dtypes) never wrap: letting them break
#: anywhere, as long text cells must, splits words like "medium" across two lines in wide tables.
SHORT_WORD = 12


def _text_class(text: str) -> str:
    return "txt word" if len(text) <= SHORT_WORD and not any(c.isspace() for c in text) else "txt"


def _right_aligned(series: Any) -> bool:
    """Numbers, and "mean ± sd" or pre-formatted numeric strings, align right."""
    if getattr(series.dtype, "kind", "O") in "iuf":
        return True
    return all(_NUMBER_TEXT.match(str(v)) for v in series)


def table_html(block: Table, n: int, full: bool = True) -> str:
    df, notes = tables.for_print(block.frame)
    numeric = [_right_aligned(df[c]) for c in df.columns]
    width = tables.text_width(df)
    cls = ""
    if width > tables.PAGE_CHARS * 1.15:
        cls = ' class="wider"'
    elif width > tables.PAGE_CHARS:
        cls = ' class="wide"'
    # Allow long snake_case headers to wrap at underscores.
    head = "".join(f"<th>{html.escape(str(c)).replace('_', ' ')}</th>" for c in df.columns)
    rows = []
    for rec in df.itertuples(index=False):
        cells = "".join(
            f'<td class="{"num" if isnum else _text_class(text)}">{html.escape(text)}</td>'
            for text, isnum in ((fmt.cell(v, block.digits), isnum) for v, isnum in zip(rec, numeric))
        )
        rows.append(f"<tr>{cells}</tr>")
    caption = markdown_inline(block.caption)
    if notes:
        caption += f" <span class='note'>({'; '.join(notes)}.)</span>"
    caption = f"<b>Table {n}.</b> {caption}" + _prov_html(block.meta, block.source, full)
    long = " long" if len(df) > 12 else ""
    return (
        f'<figure class="table{long}"><figcaption>{caption}</figcaption>'
        f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></figure>"
    )


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk ((0, 0) if it is not a PNG)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return 0, 0
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


#: Figures wider than this (width / height) get a landscape page of their own, to stay legible.
LANDSCAPE_ASPECT = 2.0
#: ... if they are also this wide in pixels (a 150-dpi figure of more than about 13 inches).
LANDSCAPE_MIN_PX = 1900


def is_landscape(data: bytes) -> bool:
    """Whether a PNG is wide enough to get a landscape page of its own."""
    w, h = _png_size(data)
    return bool(h) and w / h > LANDSCAPE_ASPECT and w > LANDSCAPE_MIN_PX


#: A figure at most this wide per unit of height is "tall": shown at the text height cap it would be narrow.
TALL_ASPECT = 1.1


def is_tall(data: bytes) -> bool:
    """Whether a PNG is about as tall as it is wide (a grid of panels squeezed by the usual height cap)."""
    w, h = _png_size(data)
    return bool(h) and w / h <= TALL_ASPECT


def figure_html(block: Figure, n: int, link_from: Path | None = None, full: bool = True) -> str:
    data = block.path.read_bytes()
    cls = ' class="landscape"' if is_landscape(data) else ' class="large"' if block.large and is_tall(data) else ""
    if link_from is None:
        uri = "data:image/png;base64," + base64.b64encode(data).decode()
    else:
        uri = html.escape(Path(os.path.relpath(block.path.resolve(), Path(link_from).resolve())).as_posix())
    caption = f"<b>Figure {n}.</b> {markdown_inline(block.caption)}" + _prov_html(block.meta, block.source, full)
    return (f'<figure{cls}><img src="{uri}" alt="{html.escape(block.caption)}">'
            f"<figcaption>{caption}</figcaption></figure>")


def markdown_inline(text: str) -> str:
    out = markdown_to_html(text)
    return re.sub(r"^<p>(.*)</p>$", r"\1", out.strip(), flags=re.DOTALL)


def block_html(block: Block, counter: _Counter) -> str:
    if isinstance(block, Text):
        out = markdown_to_html(block.markdown, lenient=block.role == "method")
        return f'<div class="{block.role}">{out}</div>' if block.role else out
    if isinstance(block, Equation):
        return '<div class="equation">' + "".join(math_img(line, True) for line in block.lines) + "</div>"
    if isinstance(block, Table):
        counter.tables += 1
        return table_html(block, counter.tables, counter.full_provenance)
    if isinstance(block, Figure):
        counter.figures += 1
        out = figure_html(block, counter.figures, counter.link_from, counter.full_provenance)
        if counter.deferred is not None and ' class="landscape"' in out[:40]:
            # A landscape page breaks the portrait flow: placed where it is cited, it leaves the page before it
            # mostly empty. Like a LaTeX float page, it goes to the end of its section, keeping its number.
            counter.deferred.append(out)
            return f'<p class="deferred">(Figure {counter.figures}: on a landscape page at the end of this section.)</p>'
        return out
    if isinstance(block, Missing):
        return (
            f'<div class="missing"><b>Not measured yet:</b> {markdown_inline(block.what)}. '
            f"Produce it with <code>{html.escape(block.command)}</code>"
            + (f" or <code>{html.escape(block.alternative)}</code>" if block.alternative else "")
            + (f" {markdown_inline(block.note)}" if block.note else "")
            + ".</div>"
        )
    if isinstance(block, Console):
        counter.figures += 1
        text = "\n".join([f"$ {block.command}", *block.lines])
        caption = (f"<b>Figure {counter.figures}.</b> What <code>{html.escape(block.command)}</code> printed, "
                   "verbatim." + (f" {markdown_inline(block.note)}" if block.note else "")
                   + _prov_html(block.meta, block.source, counter.full_provenance))
        return f'<figure class="console"><pre>{html.escape(text)}</pre><figcaption>{caption}</figcaption></figure>'
    if isinstance(block, Question):
        inner = "".join(block_html(b, counter) for b in block.blocks)
        prompt = markdown_inline(block.prompt)
        return (
            f'<section class="question"><h3><span class="label">({html.escape(block.label)})</span>'
            f'<span class="prompt">{prompt}</span></h3>'
            + (f'<p class="caveat">{markdown_inline(block.caveat)}</p>' if block.caveat else "")
            + f'{inner}</section>'
        )
    raise TypeError(f"unknown block type {type(block).__name__}")


def section_html(section: Section, counter: _Counter) -> str:
    problems = ", ".join(section.problem_names or section.problems)
    head = (
        f'<h2 id="{section.anchor}"><span class="num">§{section.number}</span>{html.escape(section.title)}</h2>'
        f'<div class="problems">{html.escape(problems)}</div>'
    )
    blocks = list(section.blocks)
    tail = []  # the closing "further results" note goes after the landscape pages, where the next section follows
    while blocks and isinstance(blocks[-1], Text) and blocks[-1].role == "further":
        tail.insert(0, blocks.pop())
    counter.deferred = []
    body = "".join(block_html(b, counter) for b in blocks)
    deferred, counter.deferred = counter.deferred, None
    if len(deferred) > 1:  # two to a landscape page, still wider than a portrait page allows
        deferred = [d.replace(' class="landscape"', ' class="landscape shared"', 1) for d in deferred]
    closing = "".join(block_html(b, counter) for b in tail)
    if len(deferred) == 1 and _only_words(section.walk()):
        # Nothing of the section needs the portrait page but its words: the heading goes on the landscape page
        # with its figure, in place, rather than alone on a page before it.
        body = re.sub(r'<p class="deferred">\(Figure \d+: on a landscape page at the end of this section\.\)</p>',
                      lambda _: deferred[0], body, count=1)
        return f'<section class="landscape">{head}{body}{closing}</section>'
    return f"<section>{head}{body}{''.join(deferred)}{closing}</section>"


def _only_words(blocks: list[Block]) -> bool:
    """Whether the blocks hold no table, equation or missing-data note, and at most one figure (short words
    and headings besides)."""
    figures = sum(isinstance(b, Figure) for b in blocks)
    texts = sum(len(b.markdown) for b in blocks if isinstance(b, Text))
    return figures == 1 and texts < 300 and not any(isinstance(b, (Table, Equation, Missing)) for b in blocks)


def _has_missing(section: Section) -> bool:
    return any(isinstance(b, Missing) for b in section.walk())


def _newest_measurement(doc: Document) -> str:
    """The date of the newest result the document shows: taken from the inputs, not the clock, so an
    unchanged writeup rebuilds byte for byte the same."""
    import json

    dates = []
    for path in doc.inputs:
        if path.name.endswith(".meta.json"):
            try:
                dates.append(_dt.datetime.fromisoformat(json.loads(path.read_text())["date"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return max(dates).astimezone(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC") if dates else "(no results)"


#: Where the answers to the handout end: everything after it goes beyond the handout.
APPENDIX_HEADING = ('<h1 class="appendix" id="appendix">Appendix</h1><p>Beyond the handout: what the workbook '
                    "measures in addition to the problems above (its own studies, the other edition's problems, "
                    "the course's test suites), in the same form. The full provenance of every result (software "
                    "versions, the machine's calibration, run parameters) is in the results index.</p>")


def document_html(doc: Document, link_from: Path | None = None) -> str:
    """The writeup as one HTML page; figures embedded, or linked relative to ``link_from`` (the folder the
    page is written to)."""
    counter = _Counter(link_from)
    split = len(doc.sections) if doc.appendix_from is None else doc.appendix_from
    toc = "".join(
        ("<div><b>Appendix</b></div>" if i == split else "")
        + f'<div><a href="#{s.anchor}">§{s.number} {html.escape(s.title)}</a>'
        + (' <span class="missing-mark">(data pending)</span>' if _has_missing(s) else "")
        + "</div>"
        for i, s in enumerate(doc.sections)
    )
    as_of = _newest_measurement(doc)
    preamble = "".join(block_html(b, counter) for b in doc.preamble)
    body = "".join(section_html(s, counter) for s in doc.sections[:split])
    if split < len(doc.sections):
        body += (APPENDIX_HEADING + "".join(section_html(s, counter) for s in doc.sections[split:]))
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(doc.title)}</title><style>{CSS}{SCREEN_CSS}</style></head><body>"
        f"<h1>{html.escape(doc.title)}</h1>"
        f'<div class="subtitle">Results as of {as_of}.</div>'
        f"{preamble}<nav class='toc'>{toc}</nav>{body}</body></html>"
    )
