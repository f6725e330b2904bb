"""Suite-wide guard: running the tests never modifies a tracked file (a clean clone stays clean).

The tracked working tree's diff against HEAD is fingerprinted when the session starts and again when it
ends; any difference fails the run and names the files, whichever test caused it. Tests on a GPU machine do
not calibrate it (``CS336_CALIBRATE=0``): a test's results are not a job's.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CS336_CALIBRATE", "0")


def tracked_changes() -> dict[str, str] | None:
    """Tracked files that differ from HEAD, each with a hash of its current bytes; None outside git."""
    try:
        names = subprocess.run(["git", "diff", "HEAD", "--name-only", "-z"], cwd=REPO_ROOT, capture_output=True,
                               check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        return None
    state = {}
    for name in filter(None, names):
        path = REPO_ROOT / name
        state[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "deleted"
    return state


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = tracked_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None or getattr(session.config, "workerinput", None) is not None:
        return
    after = tracked_changes() or {}
    touched = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    if touched:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test run modified tracked files (a clean clone must stay clean): " + ", ".join(touched[:20])
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"FAILED clean-checkout guard: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()
