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


_COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def parse_positive_ints(text: str, count: int, usage: str) -> tuple[int, ...]:
    """``count`` positive integers separated by commas (``"8,16,1024,64"``), for an option whose form ``usage``
    names (``"--shape is batch,heads,seq,head_dim"``); anything else is a one-line ``ValueError``."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or min(values) < 1:
        raise ValueError(f"{usage} ({_COUNT_WORDS.get(count, count)} positive integers), got {text!r}")
    return values


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


class RunFailed(RuntimeError):
    """A run whose input was checked and which then failed: what it raised (its ``__cause__``), a
    ``ValueError`` from pandas or torch included, is a failure (exit 1), not bad input (exit 2)."""


def quiet_missing_gpu_logs() -> None:
    """On a machine without a CUDA GPU, keep Kineto (torch.profiler's backend) from logging
    ``ERROR ... gpuGetDeviceCount failed`` each time a profiler starts: it probes for a GPU, finds none and
    says so as an error although nothing failed. Kineto reads its level when a profiler first starts; a level
    the user set wins, and where a GPU exists its errors stay visible."""
    import os

    import torch

    if "KINETO_LOG_LEVEL" not in os.environ and not torch.cuda.is_available():
        os.environ["KINETO_LOG_LEVEL"] = "5"  # above ERROR (4)


def run_main(main: Callable[[], int | None], prog: str | None = None) -> int:
    """Run an entry point's ``main`` and turn what escapes it into one line on stderr and an exit status:
    ``ValueError`` (bad input: an unknown preset, an impossible shape, a wrong device) -> 2; any other
    exception -> 1, naming its type. ``CS336_TRACEBACK=1`` re-raises instead, for debugging."""
    import os
    import sys

    prog = prog or os.path.basename(sys.argv[0]) or "cs336"
    from cs336_systems.calibration import JOB

    try:
        quiet_missing_gpu_logs()
        try:
            status = main()
        finally:
            JOB.finish()  # a GPU job's results get the machine's calibration at its end too
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the whole point: no bare traceback for a user's mistake
        if os.environ.get("CS336_TRACEBACK") == "1":
            raise
        if isinstance(exc, ValueError):
            print(f"{prog}: error: {_first_line(exc) or type(exc).__name__}", file=sys.stderr)
            return EXIT_USAGE
        where, cause = "", exc
        if isinstance(exc, RunFailed) and exc.__cause__ is not None:
            where, cause = f"{_first_line(exc)}: ", exc.__cause__
        print(f"{prog}: failed: {where}{type(cause).__name__}: {_first_line(cause) or '(no message)'} "
              "(CS336_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILURE
    return int(status or 0)


def _first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
