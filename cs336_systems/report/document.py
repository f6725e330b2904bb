"""The writeup's document model: sections made of a few kinds of blocks.

The section units' ``answer`` functions (``cs336_systems.experiments``) produce these plain objects from the results
folders; the HTML renderer turns them into pages. Keeping the model separate from rendering means
the tests can check *what* the writeup says (sections present, numbers, missing-data notes) without
a browser, and the renderer can change without touching any section.

Text blocks are Markdown with ``$inline$`` and ``$$display$$`` math (matplotlib mathtext syntax, a
LaTeX subset), so derivations are typeset rather than written as code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Text:
    """A paragraph (or several) of Markdown with ``$...$`` / ``$$...$$`` math."""

    markdown: str
    role: str = ""
    """Styling hint for the renderer ("further": the heading of a section's generic results)."""

    def plain(self) -> str:
        return self.markdown


@dataclass
class Equation:
    """Display math, one rendered line per entry (mathtext has no multi-line environments)."""

    lines: list[str]

    def plain(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Table:
    """A results table with its provenance.

    ``frame`` is the (possibly reshaped) pandas DataFrame to show; ``source`` the repository-relative
    path of the CSV it came from and ``meta`` that artefact's ``.meta.json`` record.
    """

    frame: Any
    caption: str
    source: str
    meta: dict[str, Any]
    digits: int = 4
    """Significant digits of floating-point cells."""

    def plain(self) -> str:
        return f"{self.caption}\n{self.frame.to_string(index=False)}"


@dataclass
class Figure:
    """A PNG figure with its provenance (``source``: repository-relative path)."""

    path: Path
    caption: str
    source: str
    meta: dict[str, Any]
    large: bool = False
    """Many small panels: shown at up to the page's width where the PNG is about as tall as it is wide."""

    def plain(self) -> str:
        return f"[figure {self.source}] {self.caption}"


@dataclass
class Missing:
    """A plain statement that some data does not exist yet, and the command that produces it."""

    what: str
    command: str
    note: str = ""
    """Where to run the command, e.g. "on a GPU machine; writes figures/x/"."""
    alternative: str = ""
    """An equivalent command without the notebook runner (e.g. a ``python -m`` entry point)."""

    def plain(self) -> str:
        return f"Not measured yet: {self.what}. Produce it with: {self.command} {self.note}".rstrip()


@dataclass
class Console:
    """A program's printed output as a terminal shows it (what a handout's "screenshot" asks for), with the
    provenance of the run that printed it."""

    command: str
    lines: list[str]
    source: str
    meta: dict[str, Any]
    note: str = ""
    """Where and how it ran, beside the command (markdown)."""

    def plain(self) -> str:
        return "\n".join([f"$ {self.command}", *self.lines])


@dataclass
class Question:
    """One deliverable of a problem, e.g. ``(b)``, with its answer blocks."""

    label: str
    prompt: str
    blocks: list[Block] = field(default_factory=list)
    caveat: str = ""
    """One sentence shown above the answer where its results carry a mark (stale, suspect, disagreeing)."""

    def plain(self) -> str:
        return "\n".join([f"({self.label}) {self.prompt}", *([self.caveat] if self.caveat else []),
                          *(b.plain() for b in self.blocks)])


Block = Text | Equation | Table | Figure | Missing | Console | Question

#: The role of an empty :class:`Text` in a section's answers: the blocks after it go beyond the handout, and
#: the writeup moves them to a continuation of the section in its appendix.
BEYOND_HANDOUT = "beyond-handout"


@dataclass
class Section:
    """One problem group of the writeup, backed by one results folder."""

    number: str
    title: str
    folder: str
    problems: tuple[str, ...]
    blocks: list[Block] = field(default_factory=list)
    further: list[Block] = field(default_factory=list)
    """Artefacts of the section's folders that no answer cites (exploratory runs): listed in the results
    index (``figures/index.html``), not printed in the writeup."""
    problem_names: tuple[str, ...] = ()
    """The problems as the section's header shows them where the handout numbers them ("Problem-6 (name)");
    empty: :attr:`problems` as they are."""

    @property
    def anchor(self) -> str:
        return "sec-" + self.number.replace(".", "-")

    def plain(self) -> str:
        return "\n".join([f"{self.number} {self.title}", *(b.plain() for b in self.blocks)])

    def walk(self) -> list[Block]:
        """All blocks, with those nested in questions flattened in order."""
        out: list[Block] = []
        for b in self.blocks:
            out.append(b)
            if isinstance(b, Question):
                out.extend(b.blocks)
        return out


@dataclass
class Document:
    title: str
    preamble: list[Block]
    sections: list[Section]
    inputs: list[Path]
    """Every results file the document was made from (what the manifest hashes)."""
    unclaimed: list[Section] = field(default_factory=list)
    """Result folders no section claims, shown generically in the results index only."""
    appendix_from: int | None = None
    """Index into ``sections`` where the appendix begins: what goes beyond the handout, after its answers."""

    def plain(self) -> str:
        return "\n\n".join([*(b.plain() for b in self.preamble), *(s.plain() for s in self.sections)])

    def section(self, number: str) -> Section:
        for s in self.sections:
            if s.number == number:
                return s
        raise KeyError(f"no section {number!r}; have {[s.number for s in self.sections]}")
