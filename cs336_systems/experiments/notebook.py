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

import ast
from pathlib import Path
from typing import Any, NamedTuple

from cs336_systems.experiments import get
from cs336_systems.experiments.__main__ import resolve_preset, writer
from cs336_systems.experiments.section import PRESETS
from cs336_systems.results import FIGURES_DIR

#: Texts read as "not given" (papermill's ``-p NAME VALUE`` passes any value but a number, True, False or None
#: as a string).
_NONE_TEXTS = ("none", "")
_PUBLISH_TEXTS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class NotebookParameters(NamedTuple):
    """A notebook's parameters as values (what :func:`notebook_parameters` returns)."""

    preset: str | None
    overrides: dict[str, Any]
    publish: bool | None
    edition: str | None


def notebook_parameters(preset: Any = None, overrides: Any = None, publish: Any = None,
                        edition: Any = None) -> NotebookParameters:
    """The ``parameters`` cell's values as :class:`SectionNotebook` uses them, from what papermill injected,
    the runner's ``-p KEY=VALUE`` or JupyterLab: papermill's ``-p publish false`` arrives as the string
    ``'false'``, which must not count as true. ``preset``: None or a preset name; ``overrides``: a dict, None or
    the text of a Python mapping; ``publish``: None, a bool, 1 / 0 or the texts true/false, yes/no, 1/0
    (any case); ``edition``: None or an edition name (``-p edition 2026`` arrives as the int). The texts
    'none' and '' (any case) mean None. Anything else is a ``ValueError`` naming the parameter."""
    if isinstance(preset, str) and preset.strip().lower() in _NONE_TEXTS:
        preset = None
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset must be None or one of {', '.join(PRESETS)}, got {preset!r}")

    text = overrides
    if isinstance(overrides, str):
        if overrides.strip().lower() in _NONE_TEXTS:
            overrides = None
        else:
            try:
                overrides = ast.literal_eval(overrides.strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass  # refused below, with the text as given
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ValueError(f"overrides must be a mapping of section parameters, e.g. \"{{'sizes': ['small']}}\", "
                         f"got {text!r}")

    if isinstance(publish, str) and publish.strip().lower() in _NONE_TEXTS:
        publish = None
    elif isinstance(publish, str) and publish.strip().lower() in _PUBLISH_TEXTS:
        publish = _PUBLISH_TEXTS[publish.strip().lower()]
    elif type(publish) is int and publish in (0, 1):  # papermill's -p publish 1 arrives as the int
        publish = bool(publish)
    if publish is not None and not isinstance(publish, bool):
        raise ValueError(f"publish must be None, True or False (or the text true/false, yes/no, 1/0, none), "
                         f"got {publish!r}")

    if isinstance(edition, str) and edition.strip().lower() in _NONE_TEXTS:
        edition = None
    elif type(edition) is int:  # papermill's -p edition 2026 arrives as the int; editions are named by year
        edition = str(edition)
    if edition is not None and not isinstance(edition, str):
        raise ValueError(f"edition must be None or an edition's name such as '2026', got {edition!r}")
    return NotebookParameters(preset, dict(overrides), publish, edition)


class SectionNotebook:
    """One section run from a notebook (papermill or JupyterLab)."""

    def __init__(self, name: str, preset: str | None = None, overrides: dict[str, Any] | str | None = None,
                 publish: bool | str | None = None, edition: str | int | None = None):
        from cs336_systems.cli import quiet_missing_gpu_logs

        # Before anything else: a parameter given as text must not be taken for another value.
        preset, overrides, publish, edition = notebook_parameters(preset, overrides, publish, edition)
        quiet_missing_gpu_logs()
        self.section = get(name)
        self.folder = self.section.results_folder(edition)
        self.preset = resolve_preset(self.section, preset)
        self.params = self.section.params(self.preset, overrides, edition)
        self.out = writer(self.section, self.params, self.preset, publish, edition)
        print(f"§{self.section.number} {self.section.title} [{self.preset}] — {self.out.banner()}")
        self.results: Any = None

    def run(self) -> None:
        """Measure and write this section's results (a GPU run's with the machine's calibration)."""
        from cs336_systems.calibration import JOB

        if self.section.gpus > 0:
            JOB.begin(self.out.smoke)
        try:
            self.results = self.section.run(self.params, self.out)
        finally:
            JOB.finish()

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
