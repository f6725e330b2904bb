"""Sections that measure the same configuration must agree.

Several sections time the same thing as part of their own question: the fp32 forward of a model preset at
context 512 is a row of §1.1.3 (end-to-end), §1.1.4 (profiling, Python-timed), §1.1.5 (mixed precision)
and §1.3 (eager beside compiled), its eager training step one of §1.1.3 and §1.3; the eager attention
of one shape is in §1.2.1 and again in §1.3; the data-parallel sections share their steps.
Measured by different jobs, on different days or machines, they can disagree, and a reader sees two
answers to one question. :data:`SHARED` lists where each section keeps such cells and the key that says
what a cell measured (quantity, model or shape, precision, context, batch, pass);
:func:`disagreements` groups every committed cell by key and reports each group whose extreme values lie
more than :data:`TOLERANCE` apart *and* farther apart than their runs' own spread (:data:`SPREADS` standard
deviations of each): a difference smaller than the spread of repeated runs is no difference. A table's spread
is step to step within one process; a launch-bound timing (a sub-millisecond attention cell, an eager step
that waits on the host) also moves between processes, by more than that. Where a section has timed such cells
in repeated fresh processes (:data:`BETWEEN_PROCESSES`), a table's value of the cell is one draw from that
spread, and two of them disagree only beyond :data:`BETWEEN_SE` standard errors of their difference.
``writeup status`` prints the disagreements (and fails while any remain), and the writeup marks the tables
they come from, until one side is re-measured.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems.report.fmt import join_words

#: Two sections' values of one cell may differ by this fraction of the smaller before they disagree.
TOLERANCE = 0.10
#: ... and by more than this many standard deviations of each of the two runs, summed: one, so a difference is
#: no difference only when it is smaller than the runs' spread (each a step-to-step standard deviation; for two
#: means of ten steps, their sum is about three standard errors of the difference).
SPREADS = 1.0

#: ... and, for a cell timed in fresh processes, by more than this many standard errors of the difference of two
#: draws, √(σ₁² + σ₂²) with σ the cell's standard deviation between processes: the bar the rule above sets for
#: two means of ten steps.
BETWEEN_SE = 3.0

Key = tuple[Any, ...]


@dataclass(frozen=True)
class Cell:
    key: Key
    value: float
    folder: str
    table: str
    row: str  # the row, in words
    std: float = 0.0  # the run's standard deviation of the value, where the table gives it
    between: float = 0.0  # the cell's standard deviation between fresh processes, where one was measured


@dataclass(frozen=True)
class Shared:
    """Where one section keeps cells other sections measure too: ``table`` of ``folder``, and a function of
    the table and its run's parameters that yields ``(key, value, row, std)``. ``folder`` and ``table`` may be
    glob patterns (``naive_ddp/*``: every edition grid; ``steps_*``: a table per preset and precision)."""

    folder: str
    table: str
    cells: Callable[[pd.DataFrame, dict[str, Any]], Iterator[tuple[Key, float, str]]]

    def tables(self, root: Path) -> list[tuple[str, str, Path]]:
        """``(folder, table, csv)`` of every committed table this spec names under ``root``."""
        found = sorted(Path(root).glob(f"{self.folder}/{self.table}.csv"))
        return [(csv.parent.relative_to(root).as_posix(), csv.stem, csv) for csv in found]


def _model_batch(size: str) -> int:
    from cs336_systems.configs import get_config

    return get_config(size).batch_size


def _ok(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == "ok"] if "status" in frame else frame


def _std(row: pd.Series, column: str) -> float:
    """The standard deviation a table gives beside ``column`` (``x_mean_ms`` -> ``x_std_ms``, ``x_ms`` ->
    ``x_std_ms`` or ``x_ms_std``), else 0."""
    names = ([column.replace("_mean_", "_std_")] if "_mean_" in column else
             [column.replace("_ms", "_std_ms"), f"{column}_std"])
    for name in names:
        value = row.get(name)
        if value is not None and pd.notna(value):
            return float(value)
    return 0.0


def _model_forward(column: str, *, precision: str | None = None, context: str | None = None,
                   where: Callable[[pd.DataFrame], pd.Series] | None = None,
                   quantity: str = "model forward ms") -> Callable:
    """Cells of a model's Python-timed forward (or, with ``quantity``, another pass): key (quantity, size,
    precision, context, batch)."""

    def cells(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float, str]]:
        frame = _ok(frame)
        if where is not None:
            frame = frame[where(frame)]
        for _, row in frame.iterrows():
            prec = row["precision"] if precision is None else precision
            ctx = int(row[context]) if context else int(params["context_length"])
            key = (quantity, row["size"], prec, ctx, _model_batch(row["size"]))
            yield key, float(row[column]), f"{row['size']} {prec} context {ctx}", _std(row, column)

    return cells


# §1.1.3 times a size too large for its run's mode in a lighter one (``timed_mode``, and ``out_of_memory`` the mode
# that did not fit); tables from before those columns timed every row in the run's mode.

def in_run_mode(f: pd.DataFrame) -> pd.Series:
    """The rows of a §1.1.3 table timed in its run's mode."""
    return f["out_of_memory"].isna() if "out_of_memory" in f else pd.Series(True, index=f.index)


def _with_autograd(f: pd.DataFrame) -> pd.Series:
    return f["timed_mode"] != "inference" if "timed_mode" in f else pd.Series(True, index=f.index)


def _benchmark_forward(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float, str]]:
    """§1.1.3's forward passes with autograd on (a forward timed under ``inference`` is another quantity)."""
    return _model_forward("forward_mean_ms", precision="fp32", where=_with_autograd)(frame, params)


def _model_train_step(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float, str]]:
    """§1.1.3's whole-step time, where its run timed training steps (its ``mode``; runs from before the
    parameter timed forward + backward only), of the sizes that fit a training step."""
    if params.get("mode", "forward_backward") != "train" or "total_mean_ms" not in frame:
        return iter(())
    return _model_forward("total_mean_ms", precision="fp32", quantity="model train step ms",
                          where=in_run_mode)(frame, params)


def _eager_attention(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float, str]]:
    frame = _ok(frame)
    if "compiled" in frame:
        frame = frame[~frame["compiled"].astype(bool)]
    for _, row in frame.iterrows():
        for phase in ("forward", "backward"):
            key = (f"eager attention {phase} ms", int(row["d_model"]), int(row["seq_len"]), int(params["batch_size"]))
            column = f"{phase}_mean_ms"
            yield key, float(row[column]), f"d={row['d_model']} seq {row['seq_len']} {phase}", _std(row, column)


def _ddp_steps(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float, str]]:
    """Cells of a data-parallel step table: one per variant and setting (the single-GPU step, torch DDP, naive,
    flat, per-parameter, bucketed), keyed by model, precision, context, batch per rank and ranks."""
    settings = ("variant", "bucket_size_mb", "comm_dtype", "grad_views", "cuda_graph")
    for _, row in frame.iterrows():
        setting = tuple(None if pd.isna(row.get(c)) else row.get(c) for c in settings)
        key = ("DDP step ms", *setting, row["preset"], row["autocast"], int(row["context_length"]),
               int(row["batch_per_rank"]), int(row["world_size"]))
        yield (key, float(row["step_ms"]), f"{row['variant']} {row['preset']} {row['autocast']} on "
               f"{int(row['world_size'])} GPU(s)", _std(row, "step_ms"))


#: The data-parallel sections' step tables (each edition grid too): their single-GPU, torch DDP and naive rows
#: are measured by every one of them.
_DDP_FOLDERS = ("naive_ddp", "ddp_flat", "ddp_overlap_individual", "ddp_bucketed")

SHARED: tuple[Shared, ...] = (
    Shared("benchmarking", "timings", _benchmark_forward),
    Shared("mixed_precision", "precision_timings", _model_forward("forward_mean_ms")),
    *(Shared(folder, "summary", _model_forward("python_forward_ms", precision="fp32", context="context_length"))
      for folder in ("nsys_profile", "nsys_profile/2026")),
    Shared("torch_compile", "model_timings", _model_forward(
        "total_mean_ms", precision="fp32", where=lambda f: (f["mode"] == "forward") & ~f["compiled"].astype(bool))),
    # the whole eager training step (forward, backward, AdamW), first synchronize to last
    Shared("benchmarking", "timings", _model_train_step),
    Shared("torch_compile", "model_timings", _model_forward(
        "total_mean_ms", precision="fp32", quantity="model train step ms",
        where=lambda f: (f["mode"] == "train") & ~f["compiled"].astype(bool))),
    Shared("pytorch_attention", "timings", _eager_attention),
    Shared("torch_compile", "attention_timings", _eager_attention),
    *(Shared(folder, "steps_*", _ddp_steps) for section in _DDP_FOLDERS for folder in (section, f"{section}/*")),
)


@dataclass(frozen=True)
class Disagreement:
    key: Key
    cells: tuple[Cell, ...]

    @property
    def spread(self) -> float:
        values = [c.value for c in self.cells]
        return max(values) / min(values) - 1

    @property
    def beyond_noise(self) -> bool:
        """The extreme values lie farther apart than :data:`SPREADS` standard deviations of each and, where the
        cell was timed in fresh processes, than :data:`BETWEEN_SE` standard errors of two draws' difference."""
        low, high = min(self.cells, key=lambda c: c.value), max(self.cells, key=lambda c: c.value)
        gap = high.value - low.value
        if gap <= SPREADS * (high.std + low.std):
            return False
        return not (high.between or low.between) or gap > BETWEEN_SE * math.hypot(high.between, low.between)

    def line(self) -> str:
        what, *config = self.key[:-2]  # the device and matmul precision: the same for every cell of a key
        cells = ", ".join(f"{c.folder}/{c.table}: {c.value:.4g}" for c in sorted(self.cells, key=lambda c: c.value))
        return f"{what} ({' · '.join(map(str, config))}): {cells} ({self.spread:.0%} apart)"


def _eager_attention_between_processes(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float]]:
    """§1.3's ``attention_processes`` (one row per round, section, cell and pass): per cell and pass, the larger of
    the two sections' standard deviations over their fresh processes."""
    from cs336_systems.benchmarking.attention_process_ab import between_process_std

    for (d, seq, phase), std in between_process_std(frame).items():
        if pd.notna(std):
            yield (f"eager attention {phase} ms", int(d), int(seq), int(params["batch_size"])), float(std)


def _ddp_steps_between_launches(frame: pd.DataFrame, params: dict[str, Any]) -> Iterator[tuple[Key, float]]:
    """§2.2's ``step_processes`` (one row per launch, model, precision and variant): per step cell, the standard
    deviation of its step time over the launches."""
    values: dict[Key, list[float]] = {}
    for key, value, *_ in _ddp_steps(frame, params):
        values.setdefault(key, []).append(value)
    for key, launches in values.items():
        if len(launches) > 1:
            yield key, statistics.stdev(launches)


#: Tables of cells timed in repeated fresh processes, and a function yielding ``(key, std)``: the cell's standard
#: deviation between processes.
BETWEEN_PROCESSES: tuple[Shared, ...] = (
    Shared("torch_compile", "attention_processes", _eager_attention_between_processes),
    Shared("naive_ddp", "step_processes", _ddp_steps_between_launches),
)


def _committed(shared: tuple[Shared, ...], root: Path) -> Iterator[tuple[Shared, str, str, list, tuple]]:
    """``(spec, folder, table, items, machine)`` of every committed (not smoke) table the specs name, ``items``
    what the spec's function yields for it; ``machine`` (the device and matmul precision) ends every key, since
    only the same machine and precision measure the same thing."""
    for spec, folder, table, csv in ((s, *t) for s in shared for t in s.tables(root)):
        meta_path = csv.with_suffix(".meta.json")
        if not meta_path.is_file():
            continue
        meta = json.loads(meta_path.read_text())
        if meta.get("smoke"):
            continue
        try:
            items = list(spec.cells(pd.read_csv(csv), meta.get("params") or {}))
        except (KeyError, ValueError, TypeError):  # a table of another layout (an older run, a test's): no cells
            continue
        yield spec, folder, table, items, (meta.get("device"), meta.get("float32_matmul_precision"))


def shared_cells(root: Path, shared: tuple[Shared, ...] = SHARED) -> list[Cell]:
    """Every shared cell of the committed (not smoke) results under ``root``, with its standard deviation between
    processes where :data:`BETWEEN_PROCESSES` measured one."""
    between = {(*key, *machine): std for *_, items, machine in _committed(BETWEEN_PROCESSES, root)
               for key, std in items}
    out = []
    for _, folder, table, items, machine in _committed(shared, root):
        for key, value, row, std in items:
            full = (*key, *machine)
            out.append(Cell(full, value, folder, table, row, std, between.get(full, 0.0)))
    return out


def shared_keys(root: Path, shared: tuple[Shared, ...] = SHARED) -> set[Key]:
    """The configurations measured by more than one table under ``root`` (what :func:`disagreements` checks)."""
    tables: dict[Key, set[tuple[str, str]]] = {}
    for cell in shared_cells(root, shared):
        tables.setdefault(cell.key, set()).add((cell.folder, cell.table))
    return {key for key, where in tables.items() if len(where) > 1}


def disagreements(root: Path, shared: tuple[Shared, ...] = SHARED, tolerance: float = TOLERANCE) -> list[Disagreement]:
    """Keys measured by more than one section whose values lie more than ``tolerance`` apart and beyond the
    runs' spread."""
    groups: dict[Key, list[Cell]] = {}
    for cell in shared_cells(root, shared):
        groups.setdefault(cell.key, []).append(cell)
    out = []
    for key, cells in groups.items():
        if len({(c.folder, c.table) for c in cells}) < 2 or min(c.value for c in cells) <= 0:
            continue
        found = Disagreement(key, tuple(cells))
        if found.spread > tolerance and found.beyond_noise:
            out.append(found)
    return sorted(out, key=lambda d: -d.spread)


def reconcile(root: Path, folder: str, table: str, what: str,
              name: Callable[[str], str] = lambda folder: folder) -> str | None:
    """One sentence for an answer: how this table's shared cells compare with the other sections' measurements
    of the same configurations (``what`` names them, e.g. "The Python-timed forward passes"; ``name`` names a
    section by its results folder, e.g. as "§1.1.3"); ``None`` when no other section measures them."""
    groups: dict[Key, list[Cell]] = {}
    for cell in shared_cells(root):
        groups.setdefault(cell.key, []).append(cell)
    ratios, pairs, others = [], [], set()
    for cells in groups.values():
        mine = [c for c in cells if (c.folder, c.table) == (folder, table)]
        theirs = [c for c in cells if (c.folder, c.table) != (folder, table)]
        if mine and theirs:
            reference = statistics.median(c.value for c in theirs)
            ratios += [(c.value / reference, c.row) for c in mine if reference > 0]
            pairs += [(c.value / t.value, c.row, name(t.folder)) for c in mine for t in theirs if t.value > 0]
            others |= {name(c.folder) for c in theirs}
    if not ratios:
        return None
    worst, row = max(ratios, key=lambda r: abs(r[0] - 1))
    sources = join_words(sorted(others))
    if abs(worst - 1) <= TOLERANCE:
        widest, pair_row, where = max(pairs, key=lambda r: abs(r[0] - 1))
        single = ("" if round(abs(widest - 1), 2) <= round(abs(worst - 1), 2) else
                  f"; against each other measurement alone, the widest gap is {pair_row}, {abs(widest - 1):.0%} "
                  f"from {where}'s")
        # "within" rounds up: 4.5% apart is not within 4%
        return (f"{what} agree with the median of the same configurations measured elsewhere ({sources}) within "
                f"{math.ceil(round(abs(worst - 1) * 100, 6))}%{single}.")
    return (f"{what} differ from the same configurations measured elsewhere ({sources}) by up to {abs(worst - 1):.0%} "
            f"({row}: {worst:.2f}× theirs); the runs came from different jobs, and `writeup status` lists the "
            "pair until one is measured again on a calibrated machine.")


@functools.lru_cache(maxsize=8)
def _flags(root: str, stamp: tuple) -> dict[tuple[str, str], str]:
    flags: dict[tuple[str, str], list[Disagreement]] = {}
    for found in disagreements(Path(root)):
        for cell in found.cells:
            flags.setdefault((cell.folder, cell.table), []).append(found)
    out = {}
    for (folder, table), found in flags.items():
        worst = max(found, key=lambda d: d.spread)
        others = sorted({f"{c.folder}/{c.table}" for d in found for c in d.cells} - {f"{folder}/{table}"})
        out[(folder, table)] = (f"{len(found)} cell(s) disagree with {', '.join(others)} by more than "
                                f"{TOLERANCE:.0%}, up to {worst.spread:.0%} ({worst.cells[0].row})")
    return out


#: Tables the writeup shows in place of a shared table, with its values (a grid of it, or a speed-up table that
#: repeats its times): they carry the shared table's mark, since the numbers a reader sees are the same.
SHOWN_AS: dict[tuple[str, str], tuple[str, str]] = {
    ("torch_compile", "attention_speedup"): ("torch_compile", "attention_timings"),
    ("torch_compile", "model_speedup"): ("torch_compile", "model_timings"),
    ("pytorch_attention", "grid_forward_ms"): ("pytorch_attention", "timings"),
    ("pytorch_attention", "grid_backward_ms"): ("pytorch_attention", "timings"),
    ("mixed_precision", "bf16_speedup"): ("mixed_precision", "precision_timings"),
}


def flag(root: Path, folder: str, table: str) -> str | None:
    """Why the table ``folder/table`` (or the shared table it shows, :data:`SHOWN_AS`) disagrees with another
    section's, in one line (``None`` if it does not)."""
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                  for s in (*SHARED, *BETWEEN_PROCESSES) for *_, csv in s.tables(root)
                  for p in (csv, csv.with_suffix(".meta.json"))
                  if p.is_file())  # any file changed, added or removed: computed again
    flags = _flags(str(root), stamp)
    return flags.get((folder, table)) or flags.get(SHOWN_AS.get((folder, table), (folder, table)))
