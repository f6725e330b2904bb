"""Make results tables fit a page without losing what they say.

Notebooks export timing tables with ``X_mean_ms, X_std_ms, X_min_ms, X_max_ms`` columns (full detail
stays in the CSV). For print we fold each family into one ``X ms`` column reading "mean ± sd", drop
an all-"ok" status column, and turn a short table with many columns on its side.
"""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.report import fmt

_MEAN = re.compile(r"^(?P<stem>.*?)_?mean(?P<unit>_[A-Za-z]+)?$")
PAGE_CHARS = 150
"""Characters of 8 pt narrow sans that fit the text width (A4, 15 mm margins), padding included."""


def fold_mean_std(df: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """Replace ``X_mean_U``/``X_std_U`` pairs by ``X U`` = "mean ± sd" (dropping ``X_min_U``/``X_max_U``).

    Returns the new frame and whether anything was folded (the caption then explains "±").
    """
    out = df.copy()
    folded = False
    for c in list(df.columns):
        m = _MEAN.match(str(c))
        if not m:
            continue
        stem, unit = m.group("stem"), m.group("unit") or ""
        sep = "_" if stem else ""
        std = f"{stem}{sep}std{unit}"
        if std not in df.columns:
            continue
        name = (stem + unit).strip("_") or "value"
        values = [
            "—" if pd.isna(mu) else f"{fmt.cell(float(mu))} ± {fmt.sig(sd, 2) if pd.notna(sd) else '?'}"
            for mu, sd in zip(df[c], df[std])
        ]
        pos = out.columns.get_loc(c)
        drop = [x for x in (c, std, f"{stem}{sep}min{unit}", f"{stem}{sep}max{unit}") if x in out.columns]
        out = out.drop(columns=drop)
        out.insert(min(pos, len(out.columns)), name, values)
        folded = True
    return out, folded


def drop_trivial_status(df: pd.DataFrame) -> pd.DataFrame:
    if "status" in df.columns and (df["status"].astype(str) == "ok").all():
        return df.drop(columns="status")
    return df


def text_width(df: pd.DataFrame) -> int:
    """Estimated characters per row: widest cell or header word (headers wrap at underscores) per column."""
    total = 0
    for c in df.columns:
        header = max((len(w) for w in re.split(r"[_\s]", str(c))), default=1)
        cells = min(max((len(fmt.cell(v)) for v in df[c]), default=0), 40)  # long text wraps
        total += max(header, cells) + 3
    return total


def for_print(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The frame as it should be printed, plus caption notes describing what was changed."""
    notes: list[str] = []
    out, folded = fold_mean_std(df)
    if folded:
        notes.append("“a ± b”: mean ± standard deviation (min/max in the CSV)")
    out = drop_trivial_status(out)
    if text_width(out) > PAGE_CHARS * 1.2 and len(out) <= 8 and len(out.columns) > 4:
        key = out.columns[0]
        labels = [fmt.cell(v) for v in out[key]]
        if len(set(labels)) != len(labels):
            labels = [f"{lab} ({i + 1})" for i, lab in enumerate(labels)]
        body = out.drop(columns=key).astype(object).T
        body.columns = labels
        out = body.reset_index().rename(columns={"index": str(key)})
        out = out.map(fmt.cell).astype(str)  # mixed columns: pre-format each cell
        notes.append("transposed to fit the page")
    return out, notes
