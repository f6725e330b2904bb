"""The same eager attention cells timed in fresh processes that import one section or another, alternating.

§1.2.1 (``pytorch_attention``) and §1.3 (``torch_compile``) time eager attention through the same
``benchmark_attention``, yet on two machines (an H100, then an H200 in consecutive jobs) §1.3's process ran the
sub-millisecond cells (256 and 1,024 tokens) faster, while the cells of a millisecond or more agreed.
The code timed is the same; what differs is the process around it (the modules each section imports)
and the job around that (what ran before it on the machine). This entry point separates the two: every round
starts one fresh process per section, each importing its section's module and then timing the same cells, in
alternating order, so both see the same machine in the same minutes. Equal medians put the difference on the
jobs; a steady gap puts it on the imports. §1.3's ``processes`` part records the same measurement as a result,
and the cross-section check (:mod:`cs336_systems.report.agreement`) takes each cell's standard deviation between
processes as the spread two sections' values of it may differ by.

    python -m cs336_systems.benchmarking.attention_process_ab --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

import pandas as pd

#: The cells whose eager timings disagreed between the two sections: (head dimension, sequence length).
CELLS: tuple[tuple[int, int], ...] = ((16, 256), (128, 256), (64, 1024))
SECTIONS: tuple[str, ...] = ("pytorch_attention", "torch_compile")

_CHILD = """
import importlib, json, sys
importlib.import_module("cs336_systems.experiments." + {section!r})
from cs336_systems.benchmarking.attention import benchmark_attention
rows = []
for d, s in {cells!r}:
    r = benchmark_attention(d, s, batch_size={batch}, n_forward={n}, n_backward={n}, device={device!r})
    rows.append({{"d_model": d, "seq_len": s, "forward_ms": r["forward_mean_ms"], "backward_ms": r["backward_mean_ms"]}})
print(json.dumps(rows))
"""


def one_process(section: str, cells: Sequence[tuple[int, int]], n: int, batch: int, device: str | None,
                timeout_s: float = 600) -> list[dict]:
    """Time ``cells`` in a fresh Python process that first imports ``section``'s module."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {', '.join(SECTIONS)}, got {section!r}")
    code = _CHILD.format(section=section, cells=[tuple(c) for c in cells], batch=batch, n=n, device=device)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the {section} process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(sections: Sequence[str] = SECTIONS, cells: Sequence[tuple[int, int]] = CELLS, rounds: int = 3,
            n: int = 100, batch: int = 8, device: str | None = None) -> pd.DataFrame:
    """One row per round, section, cell and pass; the sections' order flips every round."""
    if rounds < 1 or n < 1 or batch < 1:
        raise ValueError(f"rounds, n and batch must be positive, got {rounds}, {n}, {batch}")
    rows = []
    for r in range(rounds):
        for section in (sections if r % 2 == 0 else list(reversed(sections))):
            for row in one_process(section, cells, n, batch, device):
                for phase in ("forward", "backward"):
                    rows.append({"round": r, "section": section, "d_model": row["d_model"], "seq_len": row["seq_len"],
                                 "phase": phase, "ms": row[f"{phase}_ms"]})
    return pd.DataFrame(rows)


def between_process_std(df: pd.DataFrame) -> pd.Series:
    """Per cell and pass (index ``d_model, seq_len, phase``): the larger of the sections' standard deviations over
    their processes (NaN with one round), how far one cell moves from one fresh process to the next."""
    return df.groupby(["d_model", "seq_len", "phase", "section"])["ms"].std().groupby(level=[0, 1, 2]).max()


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per cell and pass: each section's median over the rounds, spread (max - min) and standard deviation (NaN
    with one round), and the first section's median over the second's."""
    by = df.groupby(["d_model", "seq_len", "phase", "section"])["ms"]
    wide = pd.concat({"median_ms": by.median(), "spread_ms": by.max() - by.min(), "std_ms": by.std()},
                     axis=1).unstack("section")
    wide.columns = [f"{section}_{stat}" for stat, section in wide.columns]
    first, second = list(dict.fromkeys(df["section"]))[:2]
    wide[f"{first}_over_{second}"] = wide[f"{first}_median_ms"] / wide[f"{second}_median_ms"]
    return wide.reset_index()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking attention_process_ab --help``."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=100, help="timed forward and backward passes per cell")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cell", action="append", default=None, metavar="D,SEQ",
                        help="a cell to time (repeatable; default: the cells that disagreed)")
    parser.add_argument("--device", default=None, help="default: cuda when present")


def run_command(args: argparse.Namespace) -> int:
    from cs336_systems.cli import parse_positive_ints

    cells = [parse_positive_ints(text, 2, "--cell is D,SEQ") for text in args.cell] if args.cell else list(CELLS)
    table = summarize(measure(SECTIONS, cells, args.rounds, args.n, args.batch, args.device))
    print(table.to_markdown(index=False, floatfmt=".4g"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking attention_process_ab`` (this module's own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["attention_process_ab", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.attention_process_ab"))
