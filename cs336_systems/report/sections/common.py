"""What every section builder shares: the section registry entry and small lookup helpers."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Figure, Missing, Question, Table


def notebook_command(folder: str) -> str:
    """How a results folder is produced: its notebook, executed with real parameters (on a GPU machine
    for measured sections; the notebook runner picks real parameters whenever CUDA is present)."""
    return f"uv run python -m cs336_systems.notebooks run {folder}"


@dataclass(frozen=True)
class SectionSpec:
    """One writeup section: its number and title in the course writeup, its results folder (the
    notebook stem), the course problem names it answers, and the builder that writes it."""

    number: str
    title: str
    folder: str
    problems: tuple[str, ...]
    build: Callable[[SectionData], list[Block]]
    gpus: int = 1
    """GPUs the measurement needs (0: analytic, runs anywhere)."""
    also: tuple[str, ...] = ()
    """Further results folders shown (generically) at the end of this section."""
    command: str | None = None
    alternative: str = ""
    """The same measurement without papermill (what a bare GPU machine runs)."""
    depends: tuple[str, ...] = ()
    """Library paths (repository-relative files or folders) whose change makes this section's results stale
    (see :mod:`cs336_systems.report.staleness`)."""

    @property
    def produce(self) -> str:
        return self.command or notebook_command(self.folder)

    @property
    def where(self) -> str:
        machine = {0: "", 1: "on a GPU machine; "}.get(self.gpus, f"on a machine with {self.gpus}+ GPUs; ")
        return f"({machine}writes `figures/{self.folder}/`)"


def col(df: pd.DataFrame | None, *patterns: str) -> str | None:
    """The first column matching one of ``patterns`` (case-insensitive; ``*``/``?`` globs allowed)."""
    if df is None:
        return None
    lower = {str(c).lower(): c for c in df.columns}
    for pat in patterns:
        pat = pat.lower()
        if pat in lower:
            return lower[pat]
        hits = [orig for low, orig in lower.items() if fnmatch.fnmatchcase(low, pat)]
        if hits:
            return hits[0]
    return None


def pending(d: SectionData, what: str) -> Missing:
    return Missing(what, d.command, d.note, d.alternative)


def question(d: SectionData, label: str, prompt: str, blocks: list[Block | None], what: str | None = None) -> Question:
    """A deliverable with its answer; ``None`` entries (data not found) are dropped, and an answer
    left with no data block says plainly what is missing (unless the whole folder is empty, which
    the section already says once)."""
    kept = [b for b in blocks if b is not None]
    if what and not d.empty and not any(isinstance(b, (Table, Figure)) for b in kept):
        kept.append(pending(d, what))
    return Question(label, prompt, kept)


def ok_rows(df: pd.DataFrame | None) -> pd.DataFrame:
    """Rows that ran (``status == "ok"``; every row when there is no status column); empty if no frame."""
    if df is None:
        return pd.DataFrame()
    if "status" in df.columns:
        return df[df["status"].astype(str) == "ok"]
    return df


def failed_rows(df: pd.DataFrame | None) -> pd.DataFrame:
    if df is None or "status" not in df.columns:
        return pd.DataFrame()
    return df[df["status"].astype(str) != "ok"]


def join_words(items: list[str]) -> str:
    """``["a", "b", "c"]`` → ``"a, b and c"``."""
    items = [str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def subset(df: pd.DataFrame | None, *columns: str) -> pd.DataFrame | None:
    """The named columns that exist, in that order (None when the frame is missing or none exist)."""
    if df is None:
        return None
    keep = [c for c in columns if c in df.columns]
    return df[keep] if keep else None
