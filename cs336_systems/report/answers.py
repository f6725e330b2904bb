"""What every section's answer code shares: deliverable blocks and small lookups into result tables."""

from __future__ import annotations

import math

import fnmatch
from typing import Any

import pandas as pd

from cs336_systems import calibration
from cs336_systems.report import agreement, fmt
from cs336_systems.report.fmt import join_words  # noqa: F401 (answers.join_words: the sections import it from here)
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Figure, Missing, Question, Table, Text


def col(df: pd.DataFrame | None, *patterns: str) -> str | None:
    """The first column matching one of ``patterns`` (case-insensitive; ``*``/``?`` globs allowed)."""
    if df is None:
        return None
    lower = {str(c).lower(): c for c in df.columns}
    for pat in patterns:
        pat = pat.lower()
        if pat in lower:
            return lower[pat]
        hits = [orig for low, orig in lower.items() if fnmatch.fnmatchcase(low, pat)]
        if hits:
            return hits[0]
    return None


def pending(d: SectionData, what: str) -> Missing:
    return Missing(what, d.command, d.note, d.alternative)


def question(d: SectionData, label: str, prompt: str, blocks: list[Block | None], what: str | None = None) -> Question:
    """A deliverable with its answer; ``None`` entries (data not found) are dropped, and an answer
    left with no data block says plainly what is missing (unless the whole folder is empty, which
    the section already says once)."""
    kept = [b for b in blocks if b is not None]
    if what and not d.empty and not any(isinstance(b, (Table, Figure)) for b in kept):
        kept.append(pending(d, what))
    return Question(label, prompt, kept, caveat=marked_results(kept))


def marked_results(blocks: list[Block]) -> str:
    """One sentence for the top of an answer whose tables or figures carry a mark (stale, suspect, disagreeing):
    the numbers the prose quotes come from them, so a reader meets the caveat before the numbers, not only on
    the source lines below ("" when none is marked)."""
    why = {}
    for b in blocks:
        meta = (b.meta or {}) if isinstance(b, (Table, Figure)) else {}
        if meta.get("stale"):
            why["stale"] = "measured on older code (STALE)"
        if (meta.get("machine") or {}).get("state") == "suspect":
            why["suspect"] = (f"measured on a GPU that ran more than {calibration.SUSPECT_BELOW:.0%} below its reference speed "
                              "(SUSPECT)")
        if meta.get("disagrees"):
            why["disagrees"] = (f"more than {agreement.TOLERANCE:.0%} away from another section's measurement of the "
                                "same configuration (DISAGREES)")
    if not why:
        return ""
    return f"Caveat: some numbers in this answer were {join_words(list(why.values()))}; the source lines say which."


def ok_rows(df: pd.DataFrame | None) -> pd.DataFrame:
    """Rows that ran (``status == "ok"``; every row when there is no status column); empty if no frame."""
    if df is None:
        return pd.DataFrame()
    if "status" in df.columns:
        return df[df["status"].astype(str) == "ok"]
    return df


def failed_rows(df: pd.DataFrame | None) -> pd.DataFrame:
    if df is None or "status" not in df.columns:
        return pd.DataFrame()
    return df[df["status"].astype(str) != "ok"]


def known(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None (a missing cell, NaN, inf, text)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def spread(*values: Any) -> float:
    """The summed step-to-step spread of several rows; a row that recorded none adds nothing."""
    return sum(x for v in values if (x := known(v)) is not None)


def step_verdict(ours: float, theirs: float, noise_ms: float) -> str:
    """How a step time compares with another timed beside it: ``faster``, ``slower``, or, where the two lie
    within their summed step-to-step spread ``noise_ms``, no difference (a ratio inside the noise is not a result)."""
    if abs(ours - theirs) > noise_ms:  # a gap beyond the spread is a result, however noisy the steps
        return "faster" if ours < theirs else "slower"
    if noise_ms > NOISY_SPREAD * min(ours, theirs):  # a broken measurement, not a tie
        return (f"the steps varied by ±{fmt.ms(noise_ms)}, {noise_ms / min(ours, theirs):.0%} of the step: too noisy "
                "to compare")
    return f"within the steps' spread of ±{fmt.ms(noise_ms)}: no difference"


#: Summed step-to-step spread, as a share of the step, above which two step times are not compared at all.
NOISY_SPREAD = 0.10


def batch_and_context(meta: dict[str, Any] | None) -> str:
    """The batch and context a model run timed (every preset's batch is the handout's, 4)."""
    from cs336_systems.configs import HANDOUT_SIZES, get_config

    context = ((meta or {}).get("params") or {}).get("context_length")
    return f"batch {get_config(HANDOUT_SIZES[0]).batch_size}, context {context}" if context else "the handout's batch"


def edition_preset(preset: str, edition: str) -> str | None:
    """``edition``'s preset of the model ``preset`` names (2026: ``xl@2026`` for ``2.7B``, the same
    architecture), or None where that handout does not list the model or ``preset`` is no preset."""
    from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION, model_shape

    try:
        shape = model_shape(preset)
    except ValueError:  # not a preset
        return None
    return next((n for n in HANDOUT_SIZES_BY_EDITION.get(edition, ()) if model_shape(n) == shape), None)


def in_handout(preset: str, edition: str) -> bool:
    """Whether ``edition``'s handout lists the model of ``preset`` (under any name: 2026 lists 2.7B, as its xl)."""
    return edition_preset(preset, edition) is not None


def edition_rows(df: pd.DataFrame | None, edition: str, column: str = "size") -> pd.DataFrame | None:
    """The rows of ``df`` whose model is in ``edition``'s handout table, named as that handout names it (2026:
    ``xl`` for the ``2.7B`` row, the same architecture; ``10B`` for ``10B@2026``), in place of another edition's
    models; a model measured under both names keeps its row under this handout's preset; rows of models no
    handout lists (``tiny``) stay. The preset's own name moves to ``preset``."""
    from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION

    if df is None or column not in df.columns or edition not in HANDOUT_SIZES_BY_EDITION:
        return df
    handout = {n for t in HANDOUT_SIZES_BY_EDITION.values() for n in t}
    names = set(df[column].astype(str))
    keep, labels = [], []
    for name in df[column].astype(str):
        preset = edition_preset(name, edition)
        if preset is None:
            keep.append(name not in handout)
            labels.append(name)
        else:  # another handout's name for this handout's model counts only where its own preset was not measured
            keep.append(name == preset or preset not in names)
            labels.append(preset.partition("@")[0])
    out = df.assign(**{"preset" if "preset" not in df.columns else "preset_name": df[column]})
    out[column] = labels
    return out[keep].reset_index(drop=True)


def handout_model(preset: str, edition: str) -> str:
    """What ``edition``'s handout calls the model of ``preset``: its own size name for the same architecture
    (2026: ``xl`` for ``2.7B`` and for ``xl@2026``), else the preset under the handout that lists it (``CS336
    2025's xl`` in the 2026 writeup); a name no handout lists, or that is no preset, stays as it is."""
    from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION
    from cs336_systems.report.editions import HANDOUT_NAMES

    own = edition_preset(preset, edition)
    if own is not None:
        return own.partition("@")[0]
    for other, table in HANDOUT_SIZES_BY_EDITION.items():
        if preset in table and other != edition:
            return f"{HANDOUT_NAMES.get(other, other)}'s {preset.partition('@')[0]}"
    return preset


def edition_models(df: pd.DataFrame | None, edition: str, column: str = "model") -> pd.DataFrame | None:
    """``df`` with its ``column`` of presets named as ``edition``'s handout names them (:func:`handout_model`)."""
    if df is None or column not in df.columns:
        return df
    return df.assign(**{column: [handout_model(str(x), edition) for x in df[column]]})


def subset(df: pd.DataFrame | None, *columns: str) -> pd.DataFrame | None:
    """The named columns that exist, in that order (None when the frame is missing or none exist)."""
    if df is None:
        return None
    keep = [c for c in columns if c in df.columns]
    return df[keep] if keep else None


def with_mfu(df: pd.DataFrame | None, meta: dict, precision: str | None = None) -> pd.DataFrame | None:
    """``df`` with ``MFU_pct``: its ``TFLOP_per_s`` over the measuring device's dense peak in the precision the
    matmuls ran in (``precision``, else the frame's ``precision`` column; fp32 at the run's
    ``float32_matmul_precision``). NaN where the device has no known peak (see :mod:`cs336_systems.hardware`)."""
    from cs336_systems.hardware import matmul_precision, mfu

    if df is None or "TFLOP_per_s" not in df.columns:
        return df
    fmp = meta.get("float32_matmul_precision")
    precisions = df["precision"] if precision is None and "precision" in df.columns else [precision or "fp32"] * len(df)
    out = df.copy()
    out["MFU_pct"] = [100 * mfu(t, meta.get("device"), matmul_precision(str(p), fmp))
                      for t, p in zip(df["TFLOP_per_s"], precisions)]
    return out


def step_mfu(df: pd.DataFrame | None, meta: dict, *, model: Any = None, batch: int | None = None,
             context: int | None = None, precision: str | None = None) -> pd.DataFrame | None:
    """``df`` with the model's ``TFLOP_per_s`` per GPU and ``MFU_pct`` (:func:`with_mfu`): the FLOPs of one
    training step of one GPU's share of the batch over ``step_ms``. The model (a preset or ``ModelConfig``),
    the sequences per GPU, the context and the matmuls' precision are the arguments given, else each row's
    ``preset``, ``batch_per_rank``, ``context_length`` and ``autocast`` (fp32 without that column).
    Recomputation (activation checkpointing) is not counted: MFU counts the model's FLOPs, not the hardware's."""
    from cs336_systems.configs import step_flops

    given = {"preset": model, "batch_per_rank": batch, "context_length": context}
    if df is None or "step_ms" not in df.columns or any(v is None and k not in df.columns for k, v in given.items()):
        return df
    shape = pd.DataFrame({k: df[k] if v is None else pd.Series([v] * len(df), index=df.index, dtype=object)
                          for k, v in given.items()})
    flops = [step_flops(m, int(b), int(c), "train") if pd.notna(ms)
             else float("nan") for m, b, c, ms in zip(shape["preset"], shape["batch_per_rank"],
                                                      shape["context_length"], df["step_ms"])]
    out = df.assign(TFLOP_per_s=pd.Series(flops, index=df.index) / (df["step_ms"] * 1e-3) / 1e12)
    precisions = (pd.Series(precision, index=df.index) if precision is not None else
                  df["autocast"] if "autocast" in df.columns else pd.Series("fp32", index=df.index))
    return out.assign(MFU_pct=with_mfu(out.assign(precision=precisions), meta)["MFU_pct"])


def mfu_note(meta: dict, precisions: tuple[str, ...] = ("fp32",)) -> str:
    """One sentence stating the peaks a table's MFU divides by, for a caption (the FLOP count is defined once, in
    the writeup's preamble)."""
    from cs336_systems.hardware import matmul_precision, peak_tflops

    fmp = meta.get("float32_matmul_precision")
    peaks = [(matmul_precision(p, fmp), peak_tflops(meta.get("device"), matmul_precision(p, fmp))) for p in precisions]
    known = [f"{p} {v:g}" for p, v in dict(peaks).items() if v]
    if not known:
        return ""
    units = "; fp32 at PyTorch's \"highest\" precision runs on the FP32 units" if any(
        p == "fp32" for p, _ in peaks) else ""
    return f" MFU against the dense peak of {', '.join(known)} TFLOP/s{units}."


def model_tflops(size: str, ms: float, context_length: int, mode: str = "train", batch_size: int | None = None) -> float:
    """The model's TFLOP/s for one ``mode`` step (``forward`` or ``train``) of preset ``size`` taking ``ms``
    (batch: the preset's), counted as :func:`cs336_systems.configs.step_flops` counts."""
    from cs336_systems.configs import get_config, step_flops

    batch = batch_size or get_config(size).batch_size
    return step_flops(size, batch, context_length, mode) / (ms * 1e-3) / 1e12


#: Course suites that run another suite's files: CSE599-O's handout runs three files of the CS336 2025 suite.
_SUITE_FILES_OF = {"cse599o": "2025"}


def _where_run(name: str, suite: str | None) -> str:
    """A run of the course's suites in words: "on the GPU", "on CPU" (runs named ``-cpu``), and which handout's
    suite where it is not the writeup's own."""
    place = "on CPU" if name.endswith("-cpu") else "on the GPU"
    return f" {place}" if suite is None else f" in the {suite} suite {place}"


def implemented(d: SectionData, what: str, where: str, ours: str, course_file: str | dict[str, str],
                against: str = "single-process training") -> Text:
    """A code problem's answer: where the implementation lives, the project's own tests of it, and the course's
    test file's outcome in every recorded run of the course's suites (§4). ``course_file`` may differ by suite
    (``{"2025": ..., "2026": ...}``, keyed by the run's name up to its first ``-``): the 2026 suite tests
    per-parameter overlap in the file that 2025's uses for bucketed DDP."""
    files = course_file if isinstance(course_file, dict) else None
    tests = d.sibling("course_tests")  # an edition grid's answers cite the runs its own §4 shows
    outcomes, used = [], []
    # The runs of this writeup's handout's suite (2025: `2025` and `2025-cpu`), all runs where it has none.
    own = any(name.split("-")[0] == d.edition for name in tests.records)
    for name in tests.records:
        record = tests.json(name)
        if not isinstance(record, dict) or not isinstance(record.get("tests"), dict):
            continue
        suite = name.split("-")[0]
        if own and suite != d.edition:
            continue
        file = files.get(_SUITE_FILES_OF.get(suite, suite)) if files is not None else course_file
        mine = [v for k, v in record["tests"].items() if file and k.split("::")[0].endswith(file)]
        if mine:
            used.append(_SUITE_FILES_OF.get(suite, suite))
            passed, skipped = sum(v == "passed" for v in mine), sum(v == "skipped" for v in mine)
            outcomes.append(f"{passed} of {len(mine)} passed" + (f" ({skipped} skipped, which need CUDA)" if skipped
                                                                 else "") + _where_run(name, None if own else suite))
    if files is not None and len({files.get(k) for k in used}) == 1:  # one suite's file reported: name it alone
        files = None
        course_file = course_file[used[0]]  # type: ignore[index]
    shown = f"`{course_file}`" if files is None else join_words([f"`{v}` ({k})" for k, v in files.items()])
    course = (f" The course's {shown}: " + join_words(outcomes) + " (§4)." if outcomes else
              f" The course's {shown} runs through `tests/adapters.py` (§4 has the command).")
    return Text(f"**Implementation:** {what} in `{where}`; `uv run pytest {ours}` checks it against {against}."
                + course)


def stream_lanes(timeline: pd.DataFrame | None) -> str:
    """A traced step's rows in words, each CUDA stream under both names a figure may give it (the profiler's
    ``cuda:17``, or ``stream 17``): "cuda:17 (stream 17) is NCCL's stream, cuda:7 (stream 7) is the compute
    stream", each lane by the kind of most of its kernel time (``dur_ms``; by count without it: a timeline may
    merge a run of compute kernels into one row). A variant that ran a quarter or more of its kernel time of the
    other kind on a lane (naive DDP's blocking all-reduces on the compute stream) is named; "" without a timeline."""
    if timeline is None or not {"lane", "kind"} <= set(timeline.columns):
        return ""
    kernels = timeline[timeline["kind"] != "phase"].copy()
    kernels["weight"] = kernels["dur_ms"].astype(float) if "dur_ms" in kernels.columns else 1.0
    what = {"compute": "the compute stream", "comm": "NCCL's stream"}
    also = {"compute": "NCCL's kernels", "comm": "compute kernels"}
    def other_share(rows: pd.DataFrame, variant: Any, kind: str) -> float:
        """The share of ``variant``'s kernel time not of ``kind`` that ran on this lane."""
        mine = kernels[(kernels["variant"] == variant) & (kernels["kind"] != kind)]["weight"].sum()
        here = rows[(rows["variant"] == variant) & (rows["kind"] != kind)]["weight"].sum()
        return float(here / mine) if mine > 0 else 0.0

    parts = []
    for lane, rows in kernels.groupby("lane", sort=False):
        kind = rows.groupby("kind")["weight"].sum().idxmax()
        device, _, ident = str(lane).partition(":")
        text = f"{lane} (stream {ident}) is " if device == "cuda" and ident else f"{lane} is "
        text += what.get(kind, kind)
        if "variant" in rows.columns and kind in also:
            shared = [str(v) for v in rows["variant"].unique() if other_share(rows, v, kind) >= 0.25]
            if shared:
                text += f" ({also[kind]} run on it too in {join_words(shared)})"
        parts.append(text)
    return ", ".join(parts)


def preset_labels(df: pd.DataFrame | None, edition: str) -> str:
    """The figure's model labels (the presets' names) in this handout's names, where they differ."""
    if df is None or "model" not in df.columns:
        return ""
    names = {m.partition("@")[0]: handout_model(m, edition) for m in map(str, df["model"])}
    own = {label: name for label, name in names.items() if "'s " not in name}  # this handout's own size names
    if all(label == name for label, name in own.items()):
        return ""  # every label reads as this handout names it
    said = [f"{label} is " + (f"this handout's {name}" if label in own else name) for label, name in names.items()
            if label != name]
    return f" Its labels are the presets' names: {join_words(said)}."
