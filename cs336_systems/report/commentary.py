"""The notebooks' own words: each section opens with its notebook's introductory Markdown."""

from __future__ import annotations

import json
from pathlib import Path


#: The notebook's pointer to its section's code: for a reader of the notebook, not of the writeup.
CODE_POINTER = "The section's code, parameters and answer text:"


def notebook_intro(path: Path) -> str | None:
    """The notebook's opening commentary (its first Markdown cell, title line and code pointer removed): what
    was measured and how, in its author's words. It carries no numbers; those come from the results."""
    if not path.exists():
        return None
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    source = next(("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown"), "")
    lines = source.strip().splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    lines = [line for line in lines if not line.startswith(CODE_POINTER)]
    text = "\n".join(lines).strip()
    return text or None
