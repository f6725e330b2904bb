"""Small helpers shared by the command-line entry points."""

from __future__ import annotations

import argparse
import ast
from typing import Any


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE a Python literal (``budget_s=120``, ``kind='quick'``, ``seq_lens=[128, 256]``).

    Meant as an argparse ``type=``: a malformed item becomes a usage error naming it.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a Python identifier as KEY, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError) as exc:
        raise argparse.ArgumentTypeError(f"{key}: {value!r} is not a Python literal ({exc})") from None
