"""What a section notebook runs: parameters → measure → derive → answers, all from the section unit.

Every notebook in ``notebooks/`` is the same four cells around its section's name::

    nb = SectionNotebook("benchmarking", preset, overrides, publish)
    nb.run()        # measure and write the results (the command line's run, to the same folder)
    nb.derive()     # figures and tables computed from the results
    nb.answers()    # the deliverables' answers, formatted from the results

On a machine without the section's GPUs the notebook runs the ``smoke`` preset (the same pipeline on a tiny
model, into ``.scratch/figures``). Its answers are derived from those smoke results first, so a section whose
answers cannot be formatted from its own results fails here; the answers shown are then the committed GPU
results from ``figures/`` where they exist, saying so (``nb.answers(own=True)`` shows the smoke run's own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cs336_systems.experiments import get
from cs336_systems.experiments.__main__ import resolve_preset, writer
from cs336_systems.results import FIGURES_DIR


class SectionNotebook:
    """One section run from a notebook (papermill or JupyterLab)."""

    def __init__(self, name: str, preset: str | None = None, overrides: dict[str, Any] | None = None,
                 publish: bool | None = None, edition: str | None = None):
        from cs336_systems.cli import quiet_missing_gpu_logs

        quiet_missing_gpu_logs()
        self.section = get(name)
        self.folder = self.section.results_folder(edition)
        self.preset = resolve_preset(self.section, preset)
        self.params = self.section.params(self.preset, overrides or {}, edition)
        self.out = writer(self.section, self.params, self.preset, publish, edition)
        print(f"§{self.section.number} {self.section.title} [{self.preset}] — {self.out.banner()}")
        self.results: Any = None

    def run(self) -> None:
        """Measure and write this section's results."""
        self.results = self.section.run(self.params, self.out)

    def derive(self) -> None:
        """Draw the section's figures and derived tables from the results just written."""
        if self.section.derive is not None:
            self.section.rederive(self.out)

    def own_answers(self) -> list[Any]:
        """The answers formatted from this run's own results (an exception if they cannot be)."""
        from cs336_systems.report.data import SectionData

        return self.section.answer(SectionData(self.out.root, self.folder, depends=self.section.depends))

    def answers_root(self, own: bool = False) -> tuple[Path, str]:
        """Where the answers read from, and a sentence saying so."""
        root = self.out.root
        if self.preset != "smoke":
            return root, "Answers from the results measured in this run."
        if own:
            return root, ("This smoke run's own answers: they exercise the pipeline on a tiny model and say nothing "
                          "about GPU performance.")
        from cs336_systems.results import result_metas

        committed = result_metas(FIGURES_DIR / self.folder)
        if committed and not all(m.get("smoke", False) for m in committed.values()):
            return FIGURES_DIR, (f"Smoke run: its results went to {self.out.dir} and its own answers were "
                                 f"derived from them (`nb.answers(own=True)` shows them); the answers below show "
                                 f"the committed results in figures/{self.folder}/ (provenance under each table).")
        return root, ("Smoke run and no committed results: the answers below show this run's numbers, "
                                     "which exercise the pipeline on a tiny model and say nothing about GPU performance.")

    def answers(self, own: bool = False) -> None:
        """Display the deliverables' answers: text as Markdown, tables as DataFrames, figures as images. A smoke
        run formats its own answers first (so a broken answer fails its run) and shows them with ``own``."""
        from IPython.display import Markdown, display

        from cs336_systems.report.data import SectionData

        mine = self.own_answers() if self.preset == "smoke" or own else None
        root, sentence = self.answers_root(own)
        display(Markdown(f"*{sentence}*"))
        blocks = mine if root == self.out.root and mine is not None else \
            self.section.answer(SectionData(root, self.folder, depends=self.section.depends))
        for block in blocks:
            show(block)


def show(block: Any, level: int = 0) -> None:
    """One writeup block in a notebook."""
    from IPython.display import Image, Markdown, display

    from cs336_systems.report.data import provenance_line
    from cs336_systems.report.document import Equation, Figure, Missing, Question, Table, Text

    if isinstance(block, Question):
        display(Markdown(f"**({block.label})** {block.prompt}"))
        for inner in block.blocks:
            show(inner, level + 1)
    elif isinstance(block, Text):
        display(Markdown(block.markdown))
    elif isinstance(block, Equation):
        display(Markdown("\n\n".join(f"$${line}$$" for line in block.lines)))
    elif isinstance(block, Table):
        display(Markdown(f"*{block.caption}* — `{block.source}`; {provenance_line(block.meta)}"))
        display(block.frame)
    elif isinstance(block, Figure):
        display(Markdown(f"*{block.caption}* — `{block.source}`; {provenance_line(block.meta)}"))
        display(Image(filename=str(block.path)))
    elif isinstance(block, Missing):
        display(Markdown(f"*{block.plain()}*"))
