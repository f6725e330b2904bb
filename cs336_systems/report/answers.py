"""What every section's answer code shares: deliverable blocks and small lookups into result tables."""

from __future__ import annotations

import fnmatch

import pandas as pd

from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Figure, Missing, Question, Table


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
