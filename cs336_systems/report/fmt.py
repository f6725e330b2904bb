"""Number formatting for the writeup's prose and tables, so every quoted number reads the same way."""

from __future__ import annotations

import math
from typing import Any


def sig(x: Any, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, with thousands separators and no scientific notation
    for everyday magnitudes (1e-3 … 1e9)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "n/a"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if v == 0:
        return "0"
    mag = math.floor(math.log10(abs(v)))
    if mag >= 9 or mag < -3:
        return f"{v:.{digits - 1}e}"
    decimals = max(digits - 1 - mag, 0)
    return f"{v:,.{decimals}f}"


def count(x: Any) -> str:
    """A count: an integer with separators ("n/a" when missing)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "n/a" if math.isnan(v) else f"{round(v):,}"


def params(n: Any) -> str:
    """A parameter count: "12.8 B", "124 M", or the integer below a million."""
    v = float(n)
    return f"{sig(v / 1e9)} B" if v >= 1e9 else f"{sig(v / 1e6)} M" if v >= 1e6 else count(v)


def ms(x: Any, digits: int = 3) -> str:
    return f"{sig(x, digits)} ms"


def pct(fraction: Any, digits: int = 3) -> str:
    return f"{sig(100 * float(fraction), digits)}%"


def ratio(x: Any, digits: int = 3) -> str:
    return f"{sig(x, digits)}×"


def gib(num_bytes: Any, digits: int = 3) -> str:
    return f"{sig(float(num_bytes) / 2**30, digits)} GiB"


def mib(num_bytes: Any, digits: int = 3) -> str:
    return f"{sig(float(num_bytes) / 2**20, digits)} MiB"


def tex_sig(x: Any, digits: int = 3) -> str:
    """:func:`sig` for use inside math: thousands separated by thin spaces, not commas."""
    return sig(x, digits).replace(",", r"\,")


def tex_int(n: Any) -> str:
    """An integer for mathtext, thousands separated by thin spaces (a comma would be spaced as punctuation)."""
    return f"{int(n):,}".replace(",", r"\,")


def cell(v: Any, digits: int = 4) -> str:
    """A table cell: integers with separators, floats to ``digits`` significant digits, NaN as an em dash."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iu"):
        return f"{int(v):,}"
    if isinstance(v, float) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") == "f"):
        f = float(v)
        if math.isnan(f):
            return "—"
        if f.is_integer() and abs(f) < 1e15:
            return f"{int(f):,}"
        return sig(f, digits)
    return str(v)


def join_words(items: list[str]) -> str:
    """``["a", "b", "c"]`` → ``"a, b and c"``."""
    items = [str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]
