"""Small helpers shared by the command-line entry points."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Callable
from typing import Any

_BARE_WORD = re.compile(r"\w[\w.@+-]*")


def parse_value(text: str) -> Any:
    """A command-line value: a Python literal (``120``, ``'quick'``, ``[128, 256]``, ``None``), a bare word
    taken as a string (``quick``, ``2.7B``, ``xl@2026``), or a comma-separated list of either
    (``1,10,100`` -> ``[1, 10, 100]``; ``small,xl`` -> ``['small', 'xl']``). Tuples become lists.

    Raises ``ValueError`` naming the text when it is none of these."""
    text = text.strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if "," in text:
            return [parse_value(item) for item in text.split(",") if item.strip()]
        if _BARE_WORD.fullmatch(text):
            return text
        raise ValueError(f"{text!r} is neither a Python literal, a word nor a comma-separated list") from None
    return list(value) if isinstance(value, tuple) else value


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE as :func:`parse_value` reads it (``budget_s=120``, ``kind=quick``,
    ``seq_lens=128,256``, ``seq_lens=[128, 256]``).

    Meant as an argparse ``type=``: a malformed item becomes a one-line usage error naming it.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a Python identifier as KEY, got {text!r}")
    try:
        return key, parse_value(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{key}: {exc}") from None


#: Exit statuses of every entry point: 2 for bad input (usage), 1 for a run that failed.
EXIT_USAGE, EXIT_FAILURE = 2, 1


def run_main(main: Callable[[], int | None], prog: str | None = None) -> int:
    """Run an entry point's ``main`` and turn what escapes it into one line on stderr and an exit status:
    ``ValueError`` (bad input: an unknown preset, an impossible shape, a wrong device) -> 2; any other
    exception -> 1, naming its type. ``CS336_TRACEBACK=1`` re-raises instead, for debugging."""
    import os
    import sys

    prog = prog or os.path.basename(sys.argv[0]) or "cs336"
    try:
        status = main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the whole point: no bare traceback for a user's mistake
        if os.environ.get("CS336_TRACEBACK") == "1":
            raise
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        if isinstance(exc, ValueError):
            print(f"{prog}: error: {first or type(exc).__name__}", file=sys.stderr)
            return EXIT_USAGE
        print(f"{prog}: failed: {type(exc).__name__}: {first or '(no message)'} "
              "(CS336_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILURE
    return int(status or 0)
