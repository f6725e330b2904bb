"""Test evidence: the course's own test suites, run against ``tests/adapters.py``."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.data import SectionData, display_path
from cs336_systems.report.document import Block, Table, Text

OUTCOMES = ("passed", "failed", "skipped", "error")


def course_tests(d: SectionData) -> list[Block]:
    blocks: list[Block] = []
    if d.empty:
        return blocks
    blocks.append(Text(
        "Each table is one run of the course's unmodified test suite (copied from a checkout of the course's "
        "repository, with our `tests/adapters.py` in place of its stub) by `python -m cs336_systems.course_tests`. "
        "Tests that need CUDA skip on a CPU-only machine."))
    for name in d.records:
        result, meta = d.json(name), d.meta(name)
        params = meta.get("params", {})
        counts = result.get("counts", {})
        frame = pd.DataFrame([{o: int(counts.get(o, 0)) for o in OUTCOMES}])
        caption = (f"The course's {params.get('edition', name)} suite (course version "
                   f"{params.get('course_version', 'unknown')}) on {meta.get('device', 'an unknown device')}")
        blocks.append(Table(frame=frame, caption=caption, source=display_path(d.dir / f"{name}.json"), meta=meta))
        for test, why in result.get("failures", {}).items():
            blocks.append(Text(f"Failed: `{test}`: {why}"))
    if any(d.json(n).get("failures") for n in d.records):
        blocks.append(Text(
            "The 2026 `test_fsdp_correctness[fp32]` compares FSDP with full-batch training bit for bit. Each rank's "
            "weight gradient is a product over its half of the batch, and two such products added are not "
            "bit-identical to one product over the whole batch in float32, so any data-parallel run matches that "
            "reference only up to rounding (the differences above are one or two float32 roundings). Our own suite "
            "checks FSDP bit for bit against micro-batched training instead."))
    return blocks
