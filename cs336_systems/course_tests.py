"""Run the course's own test suite against this project's ``tests/adapters.py``.

The project ships none of the course's code: point this command at a checkout of the course's assignment
repository (any edition: 2025's v1.0.x, 2026's 26.x, or a CSE599-O fork). Its ``tests/`` folder is copied
into a temporary directory, its ``adapters.py`` replaced by ours, and pytest runs there with this
environment (which supplies the course tests' own needs, ``einops`` and ``jaxtyping``). The counts are
written with provenance to ``results/course_tests/<edition>.json`` under the results root
(``.scratch/figures`` unless ``--publish``)::

    uv run python -m cs336_systems.course_tests ~/assignment2-systems --edition 2026
    uv run python -m cs336_systems.course_tests ~/assignment2-systems --edition 2026 -- -k fsdp -x

Attention tests of the Triton kernel run on CPU only under ``TRITON_INTERPRET=1`` (set automatically
without a GPU) and need a GPU for bfloat16.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cs336_systems.results import REPO_ROOT, ResultWriter

SECTION = "course_tests"
OUR_ADAPTERS = REPO_ROOT / "tests" / "adapters.py"
_OUTCOME = re.compile(r"^(?P<test>\S+::\S+)\s+(?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.MULTILINE)
_SUMMARY_FAILED = re.compile(r"^FAILED (?P<test>\S+)(?: - (?P<why>.*))?$", re.MULTILINE)


def course_version(checkout: Path) -> str:
    """The ``version`` of the course checkout's ``pyproject.toml`` (``unknown`` if absent)."""
    match = re.search(r'^version\s*=\s*"([^"]+)"', (checkout / "pyproject.toml").read_text(), re.MULTILINE) \
        if (checkout / "pyproject.toml").exists() else None
    return match.group(1) if match else "unknown"


def stage_suite(checkout: Path, into: Path) -> Path:
    """Copy the course's ``tests/`` under ``into`` with our adapters in place of theirs; returns the copy."""
    tests = checkout / "tests"
    if not (tests / "adapters.py").exists():
        raise ValueError(f"{checkout} is not a checkout of the course's assignment (no tests/adapters.py)")
    dst = into / "tests"
    shutil.copytree(tests, dst)
    shutil.copy(OUR_ADAPTERS, dst / "adapters.py")
    return dst


def parse_outcomes(output: str) -> dict[str, Any]:
    """Counts and per-test outcomes from ``pytest -rA -v`` output."""
    outcomes: dict[str, str] = {}
    for m in _OUTCOME.finditer(output):
        outcomes.setdefault(m.group("test"), m.group("outcome").lower())
    failures = {m.group("test"): _failure_reason(output, m.group("test")) or (m.group("why") or "").strip()
                for m in _SUMMARY_FAILED.finditer(output)}
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "tests": outcomes, "failures": failures}


def _failure_reason(output: str, test: str) -> str:
    """The last ``E   SomeError: message`` line of ``test``'s section in pytest's FAILURES report (the
    rank's own assertion, for a failure inside spawned processes)."""
    name = test.split("::")[-1]
    header = re.search(rf"^_+ {re.escape(name)} _+$", output, re.MULTILINE)
    if header is None:
        return ""
    section = output[header.end():]
    following = re.search(r"^_{3,} \S.* _{3,}$|^=+ ", section, re.MULTILINE)
    section = section[: following.start()] if following else section
    errors = re.findall(r"^E\s+(\w*(?:Error|Exception)\b.*)$", section, re.MULTILINE)
    return errors[-1].strip() if errors else ""


def run_suite(checkout: Path, pytest_args: list[str], timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    if not _cuda_available():
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels on CPU tensors
    env["COLUMNS"] = "400"  # pytest cuts the failure summary at the terminal width
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "cs336-basics"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="cs336-course-tests-") as tmp:
        stage_suite(checkout, Path(tmp))
        cmd = [sys.executable, "-m", "pytest", "tests", "-v", "-rA", "-p", "no:cacheprovider", *pytest_args]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    result = parse_outcomes(proc.stdout)
    result.update(exit_code=proc.returncode, command=" ".join(cmd[1:]))
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    result["tail"] = last.strip("= ")
    return result


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.course_tests", description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after `--` go to pytest.")
    parser.add_argument("checkout", type=Path, help="a checkout of the course's assignment repository")
    parser.add_argument("--edition", required=True, help="a label for the result, e.g. 2025, 2026, cse599o")
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit for the whole suite")
    parser.add_argument("--publish", action="store_true", help="write figures/course_tests/ (default: .scratch/)")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.pytest_args = pytest_args
    if not re.fullmatch(r"[\w.-]+", args.edition):
        parser.error(f"--edition must be a plain label (letters, digits, '.', '-', '_'), got {args.edition!r}")
    checkout = args.checkout.expanduser().resolve()
    try:
        result = run_suite(checkout, args.pytest_args, args.timeout_s)
    except (ValueError, FileNotFoundError) as exc:
        print(f"course_tests: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"course_tests: the suite ran past {args.timeout_s:g} s", file=sys.stderr)
        return 1
    out = ResultWriter(SECTION, params={"edition": args.edition, "course_version": course_version(checkout),
                                        "pytest_args": args.pytest_args}, smoke=False, publish=args.publish)
    out.json(result, args.edition)
    print(f"{args.edition} (course {course_version(checkout)}): {result['tail']}")
    for test, why in result["failures"].items():
        print(f"  FAILED {test}: {why}")
    print(out.banner())
    return 0 if result["exit_code"] in (0, 5) else 1


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.course_tests"))
