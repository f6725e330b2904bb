"""Results folders → :class:`Document` → ``writeup.pdf``, ``writeup.html`` and ``figures/index.html``
(+ manifest)."""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from cs336_systems.report import editions
from cs336_systems.report import manifest as _manifest
from cs336_systems.report.commentary import notebook_intro
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import (
    BEYOND_HANDOUT,
    Block,
    Console,
    Document,
    Figure,
    Missing,
    Question,
    Section,
    Table,
    Text,
)
from cs336_systems.results import FIGURES_DIR

TITLE = "CS336 Assignment 2 (Systems): writeup"
NOTEBOOK_DIR = _manifest.NOTEBOOK_DIR
INDEX_NAME = _manifest.INDEX_NAME


#: Said once, in the preamble; each table's caption gives only the peak it divides by (``mfu_note``).
MFU_DEFINITION = ("MFU (model FLOPs utilization) is the model's FLOPs, 6 × matmul parameters × tokens for a training "
                  "step and 2 × for a forward, plus attention's, over the GPU data sheet's dense peak for the "
                  "precision.")


def _preamble(root: Path, html: str = "writeup.html") -> list[Block]:
    return [
        Text(
            "Every number, table and figure is read from a measured result; the line under each names the device, "
            "date and commit. **STALE** marks a result measured on older code, **SUSPECT** one from a machine that "
            "measured more than 10% slow, **DISAGREES** one that another section measured differently. Work beyond "
            f"the handout is in the appendix; each run's full record is in `{root.name}/{INDEX_NAME}` (`{html}` is "
            "this document as a web page). " + MFU_DEFINITION
        )
    ]


def sections_() -> list[Any]:
    """The writeup's sections, in order: every section unit of :mod:`cs336_systems.experiments`."""
    from cs336_systems.experiments import SECTIONS

    return list(SECTIONS.values())


def build_section(
    spec: Any, root: Path, strict: bool = False, notebooks: Path = NOTEBOOK_DIR, edition: str | None = None,
    answers_for: str = "2025",
) -> tuple[Section, SectionData]:
    """One section: the spec's answers (from its ``edition`` grid's results, if given) in the writeup of the
    ``answers_for`` handout, and (as ``further``, for the results index) every artefact of its folders that the
    answers did not use.

    A builder that fails on unexpected data (a renamed column, say) must not cost the whole writeup:
    unless ``strict``, the section says in red that its answers could not be formatted, the error is
    printed, and its results still appear generically.
    """
    folder, command = spec.results_folder(edition), spec.command_for(edition)
    data = SectionData(root, folder, command=command, note=spec.where, depends=spec.depends or None,
                       edition=answers_for)
    blocks: list[Block] = []
    if data.empty:
        blocks.append(Missing(f"no results in `{root.name}/{folder}/`", command, spec.where))
    intro = notebook_intro(notebooks / f"{spec.name}.ipynb")
    method = [Text(f"*How it was measured (from `notebooks/{spec.name}.ipynb`):* {intro}", role="method")] if intro else []
    failed = False
    try:
        answers = spec.answer(data)
        # The handout's answers in the main body; how they were measured opens the section's part of the appendix
        # (a grader reads the answers, a reader who reruns them the method), before anything beyond the handout.
        cut = next((i for i, b in enumerate(answers) if isinstance(b, Text) and b.role == BEYOND_HANDOUT), len(answers))
        marker = answers[cut:cut + 1] or ([Text("", role=BEYOND_HANDOUT)] if method else [])
        blocks.extend([*answers[:cut], *marker, *method, *answers[cut + 1:]])
        method = []
    except Exception as exc:
        failed = True
        if strict:
            raise
        data.forget_usage()
        message = f"{type(exc).__name__}: {exc}"
        print(f"warning: §{spec.number} answers failed on the data in {data.dir}: {message}", file=sys.stderr)
        blocks.append(Text(f"**The answers of this section could not be formatted from its results** "
                           f"(`{message}`); the results follow unformatted.", role="error"))
        blocks.extend(method)
    further: list[Block] = []
    # The results index lists the edition grids' results under the workbook's own section (the other
    # edition's writeup shows them as answers).
    grids = [spec.results_folder(e) for e in spec.grids] if edition is None else []
    for folder, rest in [(folder, data.remaining())] + [
        (extra, SectionData(root, extra).remaining()) for extra in (*spec.also, *grids)
    ]:
        if rest:
            further.append(Text(f"Further results in `{root.name}/{folder}/`:", role="further"))
            further.extend(rest)
    if failed:  # without answers, the results themselves are the section
        blocks.extend(further)
        further = []
    return Section(spec.number, spec.title, spec.name, spec.problems, blocks, further), data


def _artefact(block: Block) -> str | None:
    return block.source if isinstance(block, (Table, Figure)) else None


def _drop_cited(further: list[Block], cited: set[str]) -> list[Block]:
    """``further`` without the artefacts some section cites (a folder read by two sections), and without
    folder headings left with nothing under them."""
    kept = [b for b in further if _artefact(b) not in cited]
    return [b for i, b in enumerate(kept)
            if not (isinstance(b, Text) and b.role == "further"
                    and (i + 1 == len(kept) or (isinstance(kept[i + 1], Text) and kept[i + 1].role == "further")))]


_CITATION = re.compile(r"(`[^`]*`)|§(\d+(?:\.\d+)*)")  # a code span (left as it is) or a citation


def _renumbered(block: Block, numbers: dict[str, str]) -> Block:
    """``block`` with its citations of workbook sections (``§2.1``) in another edition's numbers; a section
    that edition lacks becomes ``writeup.pdf §N``. Prose and captions only: tables and figures keep their data."""
    def one(m: re.Match) -> str:
        if m.group(1):
            return m.group(1)
        return f"§{numbers[m.group(2)]}" if m.group(2) in numbers else f"`writeup.pdf` §{m.group(2)}"

    def cite(text: str) -> str:
        return _CITATION.sub(one, text)

    if isinstance(block, Missing):
        return dataclasses.replace(block, note=cite(block.note), alternative=cite(block.alternative))
    if isinstance(block, Console):
        return dataclasses.replace(block, note=cite(block.note))
    if isinstance(block, Text):
        return dataclasses.replace(block, markdown=cite(block.markdown))
    if isinstance(block, (Table, Figure)):
        return dataclasses.replace(block, caption=cite(block.caption))
    if isinstance(block, Question):
        return dataclasses.replace(block, prompt=cite(block.prompt),
                                   blocks=[_renumbered(b, numbers) for b in block.blocks])
    return block


def _console(root: Path, name: str, command: str) -> Block:
    """The printed output a handout asks to show, from its record in ``figures/<CONSOLE_FOLDER>/``, or what
    produces it."""
    data = SectionData(root, editions.CONSOLE_FOLDER)
    record = data.json(name)
    if not isinstance(record, dict) or not isinstance(record.get("lines"), list):
        return Missing(f"the printed output of `{command}`",
                       f"cd cs336_systems/cse599o && srun --gpus-per-node=2 uv run {command} --record {name}",
                       f"(on a node with 2 GPUs; keeps it in `{root.name}/{editions.CONSOLE_FOLDER}/`)")
    ran, meta = str(record.get("command") or command), data.meta(name)
    gpus = f"{meta['num_gpus']} GPUs" if meta.get("num_gpus") else "its GPUs"
    return Console(ran, [str(x) for x in record["lines"]], f"{root.name}/{editions.CONSOLE_FOLDER}/{name}.json",
                   meta, note=f"Run in `cs336_systems/cse599o/` on one node with {gpus}, the script "
                   f"`srun --gpus-per-node=2 uv run {ran}` starts. Its few iterations are a launch of their own, so "
                   "they differ from the tables' longer runs by launch-to-launch noise.")


def _edition_document(edition: str, root: Path, strict: bool, notebooks: Path) -> Document:
    """The writeup of another edition of the handout (:mod:`cs336_systems.report.editions`): the same
    sections' answers under that handout's numbers and problem names, each with its note, and an entry for
    every problem no section measures yet."""
    from cs336_systems.experiments import SECTIONS

    sections: list[Section] = []
    rows = ["| this handout | problems | workbook section (`writeup.pdf`) |", "|---|---|---|"]
    numbers = {SECTIONS[e.section].number: e.number for e in editions.entries(edition) or () if e.section}
    lent = {(name, label) for e in editions.entries(edition) or () for name, label, _ in e.borrow}
    for entry in editions.entries(edition) or ():
        def note(gap: str, entry: editions.Entry = entry) -> list[Block]:
            said = " ".join(x for x in (gap, entry.remark) if x)
            return [Text(f"**Note.** {said}")] if said else []

        if entry.section is None:
            blocks: list[Block] = [*note(entry.note), Missing(f"{', '.join(entry.problems)} ({editions.HANDOUT_NAMES[edition]} handout)",
                                                  "see the note above")]
            sections.append(Section(entry.number, entry.title or entry.problems[0], f"{edition}-{entry.number}",
                                    entry.problems, blocks))
            rows.append(f"| §{entry.number} | {', '.join(entry.problems)} | (none yet) |")
            continue
        spec = SECTIONS[entry.section]
        own = _own_grid(spec, root, edition) is not None
        section, _ = build_section(spec, root, strict, notebooks, _own_grid(spec, root, edition), answers_for=edition)
        section.number, section.problems = entry.number, entry.problems
        section.problem_names = tuple(editions.numbered(edition, p) for p in entry.problems)
        section.title = entry.title or spec.title.removesuffix(f" ({edition} handout)")
        section.blocks = [b for b in section.blocks
                          if not (isinstance(b, Question) and (entry.section, b.label) in lent)]
        renamed = dict(entry.labels)
        section.blocks = [dataclasses.replace(b, label=renamed[b.label])
                          if isinstance(b, Question) and b.label in renamed else b for b in section.blocks]
        for name, label, here in entry.borrow:
            section.blocks = _with_borrowed(section.blocks, _borrowed(SECTIONS[name], root, strict, notebooks,
                                                                      edition, label, here))
        section.blocks = _foreign_to_appendix(section.blocks, entry.problems, _problem_ids(edition))
        section.blocks = [_renumbered(b, numbers) for b in section.blocks]  # the answers cite this edition's numbers
        section.blocks[:0] = [_renumbered(_console(root, name, command), numbers) for name, command in entry.console]
        # Measured on this edition's grid: the note on the other grid's results no longer applies, and nothing
        # needs saying (the source line under each table names the folder).
        section.blocks[:0] = note("" if own else entry.note)
        section.further = []  # the results index belongs to the workbook's own writeup
        sections.append(section)
        rows.append(f"| §{entry.number} | {', '.join(section.problem_names) or '(context)'} | §{spec.number} "
                    f"{spec.title} |")
    preamble = _preamble(root, f"writeup-{edition}.html") + [
        Text(f"This document answers {editions.handout_name(edition)}, in its order and under its numbers. Its "
             "sections and the workbook's full writeup (`writeup.pdf`), whose section numbers it cites where it has "
             "no section of its own:"),
        Text("\n".join(rows)),
    ]
    inputs = _manifest.result_files(root)
    main, appendix = _split(sections, lambda s: editions.in_appendix(edition, s.folder, s.problems))
    title = f"{editions.ASSIGNMENT_TITLES[edition]}: writeup" if edition in editions.ASSIGNMENT_TITLES else TITLE
    return Document(f"{title} ({editions.HANDOUT_NAMES[edition]} edition)", preamble, main + appendix, inputs, appendix_from=len(main))


def build_document(root: Path = FIGURES_DIR, strict: bool = False, notebooks: Path = NOTEBOOK_DIR,
                   edition: str = "2025") -> Document:
    """The whole writeup from the results under ``root`` and the commentary of the notebooks in
    ``notebooks`` (no rendering, no browser); ``edition``: which handout's writeup (2025: the workbook's
    own, every section)."""
    root = Path(root)
    if editions.entries(edition) is not None:
        return _edition_document(edition, root, strict, notebooks)
    sections: list[Section] = []
    known = set()
    for spec in sections_():
        section, _ = build_section(spec, root, strict, notebooks)
        sections.append(section)
        known.update((spec.name, *spec.also))
    known.add(editions.CONSOLE_FOLDER)  # the course scripts' printed output: the CSE599-O writeup shows it
    cited = {src for s in sections for b in s.walk() if (src := _artefact(b))}
    for section in sections:
        section.further = _drop_cited(section.further, cited)
        shown = sum(_artefact(b) is not None for b in section.further)
        if shown:
            section.blocks.append(Text(
                f"{shown} further tables and figures of this section's folders (exploratory runs no answer "
                f"cites) are in the results index `{root.name}/{INDEX_NAME}`.", role="further"))
    # Result folders no section claims (e.g. a new notebook) still appear, generically, in the index.
    extra = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in known and not p.name.startswith(".")) \
        if root.is_dir() else []
    unclaimed: list[Section] = []
    for i, folder in enumerate(extra, start=1):
        data = SectionData(root, folder, command=f"uv run python -m cs336_systems.notebooks run {folder}")
        blocks = data.remaining()
        if blocks:
            unclaimed.append(Section(f"A.{i}", f"Other results: {folder}", folder, (folder,), [], blocks))
    main, appendix = _split(sections, lambda s: editions.in_appendix("2025", s.folder))
    return Document(TITLE, _preamble(root), main + appendix, _manifest.result_files(root), unclaimed,
                    appendix_from=len(main))


def _borrowed(spec: Any, root: Path, strict: bool, notebooks: Path, edition: str, label: str,
              here: str) -> list[Block]:
    """The questions labelled ``label`` of another section's answers (from its grid of ``edition`` where
    measured), relabelled ``here``: a part of a problem that the workbook measures in another section."""
    grid = _own_grid(spec, root, edition)
    lender, _ = build_section(spec, root, strict, notebooks, grid, answers_for=edition)
    found = [dataclasses.replace(b, label=here) for b in lender.blocks if isinstance(b, Question) and b.label == label]
    if not found:
        return [Missing(f"part ({here}), answered by {spec.title}", spec.command_for(grid))]
    return found


def _own_grid(spec: Any, root: Path, edition: str) -> str | None:
    """``edition`` where ``spec`` has measured that edition's own grid, else None (the workbook's results)."""
    return edition if edition in spec.grids and not SectionData(root, spec.results_folder(edition)).empty else None


def _with_borrowed(blocks: list[Block], borrowed: list[Block]) -> list[Block]:
    """``borrowed`` after the section's own answers: before how it was measured and anything beyond the handout."""
    at = next((i for i, b in enumerate(blocks) if isinstance(b, Text) and b.role in ("method", BEYOND_HANDOUT)),
              len(blocks))
    return [*blocks[:at], *borrowed, *blocks[at:]]


def _problem_ids(edition: str) -> set[str]:
    """The problem ids ``edition``'s handout answers in its own entries."""
    return {p for entry in (editions.entries(edition) or ()) for p in entry.problems}


def _foreign_to_appendix(blocks: list[Block], own: tuple[str, ...], problem_ids: set[str]) -> list[Block]:
    """An edition's section answers its handout's problems first: a question labelled with a problem that
    the same handout answers in another section (2025's FlashAttention leaderboard inside 2026's
    FlashAttention section, where 2026's leaderboard is the 8B step) moves past the beyond-the-handout marker,
    to the appendix."""
    foreign = [b for b in blocks if isinstance(b, Question) and b.label in problem_ids and b.label not in own]
    if not foreign:
        return blocks
    rest = [b for b in blocks if not any(b is f for f in foreign)]
    marks = [i for i, b in enumerate(rest) if isinstance(b, Text) and b.role == BEYOND_HANDOUT]
    if not marks:
        return [*rest, Text("", role=BEYOND_HANDOUT), *foreign]
    return [*rest[:marks[0] + 1], *foreign, *rest[marks[0] + 1:]]


def _split(sections: list[Section], beyond: Any) -> tuple[list[Section], list[Section]]:
    """The handout's answers in order, and what goes beyond it (for the appendix), in order: whole sections,
    then the continuations of sections whose answers go on past a :data:`BEYOND_HANDOUT` marker."""
    main, rest, continued = [], [], []
    for s in sections:
        if beyond(s):  # whole in the appendix: its marker has nothing to split
            s.blocks = [b for b in s.blocks if not (isinstance(b, Text) and b.role == BEYOND_HANDOUT)]
            rest.append(s)
            continue
        marks = [i for i, b in enumerate(s.blocks) if isinstance(b, Text) and b.role == BEYOND_HANDOUT]
        if marks:
            after = s.blocks[marks[0] + 1 :]
            s.blocks = [b for b in s.blocks[: marks[0]]]
            if after:
                continued.append(Section(f"{s.number}+", f"{s.title}: beyond the handout", s.folder,
                                         ("beyond the handout",), [b for b in after if not (
                                             isinstance(b, Text) and b.role == BEYOND_HANDOUT)]))
        main.append(s)
    return main, continued + rest


def write_html(doc: Document, path: Path, embed: bool = False) -> Path:
    """The writeup as HTML at ``path``: figures linked relative to it (the HTML writeup beside the PDF),
    or embedded (``embed``: one self-contained file, what the PDF printer reads)."""
    from cs336_systems.report.html import document_html

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document_html(doc, link_from=None if embed else path.parent), encoding="utf-8")
    return path


def write_index(doc: Document, root: Path, writeup_html: Path | None) -> Path:
    """The results index ``<root>/index.html`` (see :mod:`cs336_systems.report.index`)."""
    import os

    from cs336_systems.report.index import index_html

    root = Path(root)
    link = Path(os.path.relpath(Path(writeup_html).resolve(), root.resolve())).as_posix() if writeup_html else None
    path = root / INDEX_NAME
    path.write_text(index_html(doc, root, link), encoding="utf-8")
    return path


def build(
    output: Path = _manifest.DEFAULT_PDF,
    root: Path = FIGURES_DIR,
    manifest: Path | None = _manifest.DEFAULT_MANIFEST,
    strict: bool = False,
) -> list[Path]:
    """Render the writeup: ``output`` (PDF), the HTML writeup beside it (same name, ``.html``), and the
    results index ``<root>/index.html``; unless ``manifest`` is None, record their inputs. Returns the
    paths written."""
    from cs336_systems.report.pdf import html_to_pdf

    output, root = Path(output), Path(root)
    doc = build_document(root, strict)
    html_path = write_html(doc, output.with_suffix(".html"))
    index = write_index(doc, root, html_path)
    date = _manifest.inputs_date(root)
    main_pages: dict[str, int] = {}

    def main_body_pages(document: Document, name: str, tmp: str) -> int:
        """The pages of the answers alone: the document cut before its appendix, printed the same way."""
        cut = dataclasses.replace(document, sections=document.sections[: document.appendix_from], appendix_from=None)
        pdf = html_to_pdf(write_html(cut, Path(tmp) / f"main-{name}.html", embed=True), Path(tmp) / f"main-{name}.pdf",
                          date=date)
        return _manifest.pdf_pages(pdf)

    with tempfile.TemporaryDirectory(prefix="cs336-writeup-") as tmp:
        printable = write_html(doc, Path(tmp) / "writeup.html", embed=True)
        html_to_pdf(printable, output, date=date)
        main_pages[output.name] = main_body_pages(doc, output.stem, tmp)
        others: list[Path] = []
        for edition in editions.EDITIONS[1:]:  # the other handouts' writeups beside it: writeup-2026.pdf, -cse599o
            pdf = output.with_name(f"{output.stem}-{edition}.pdf")
            edition_doc = build_document(root, strict, edition=edition)
            others += [pdf, write_html(edition_doc, pdf.with_suffix(".html"))]
            html_to_pdf(write_html(edition_doc, Path(tmp) / f"writeup-{edition}.html", embed=True), pdf, date=date)
            main_pages[pdf.name] = main_body_pages(edition_doc, pdf.stem, tmp)
    written = [output, html_path, index, *others]
    over = {name: n for name, n in main_pages.items() if n > _manifest.MAIN_PAGES_BUDGET}
    if over:
        print(f"warning: the answers before the appendix exceed {_manifest.MAIN_PAGES_BUDGET} pages: "
              + ", ".join(f"{name} {n}" for name, n in over.items()), file=sys.stderr)
    if manifest is not None:
        _manifest.write_manifest(output, root, Path(manifest), outputs=[html_path, index, *others],
                                 main_pages=main_pages)
        written.append(Path(manifest))
    return written


__all__ = ["build", "build_document", "write_html", "write_index"]
