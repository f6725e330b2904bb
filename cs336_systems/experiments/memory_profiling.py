"""§1.1.6 Memory profiling: memory snapshots of one forward pass (autograd on) and one full AdamW step of
the 2.7B model at several contexts, fp32 and bf16: timelines, peaks, largest allocations, and the
residual-stream size derivation checked against a measured tensor.

Problem ``memory_profiling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, ModelBenchmark, default_device
from cs336_systems.benchmarking.sweep import CPU_NOTE, free_memory, run_sweep
from cs336_systems.configs import get_config, memory_breakdown, residual_stream_bytes
from cs336_systems.experiments.section import Section, check_positive, check_presets, param
from cs336_systems.report import editions, fmt
from cs336_systems.report.answers import handout_model, join_words, ok_rows, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Equation, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import SCRATCH_DIR, ResultWriter


@dataclass(frozen=True)
class Params:
    size: str = param("2.7B", "model preset")
    context_lengths: list[int] = param([128, 256, 512], "contexts snapshotted")
    precisions: list[str] = param(["fp32", "bf16"], "fp32 (no autocast) and/or bf16 autocast")
    modes: list[str] = param(["inference", "forward", "train"],
                             "inference: a forward pass without autograd (what the handout calls inference only); "
                             "forward: the same with autograd on, activations kept for backward; train: a full "
                             "AdamW step")
    budget_s: float = param(600.0, "time budget in seconds; cells past it are recorded as skipped")

    def check(self) -> None:
        check_presets(self.size)
        check_positive(budget_s=self.budget_s, **{f"context_length {c}": c for c in self.context_lengths})
        if not self.modes or not set(self.precisions) <= {"fp32", "bf16"} or not set(self.modes) <= set(MODES):
            raise ValueError(f"precisions are fp32/bf16 and modes {'/'.join(MODES)}, got {self.precisions} and "
                             f"{self.modes}")


#: What each mode snapshots (``BenchmarkSpec`` modes; ``inference`` runs the forward under ``torch.no_grad``).
MODES = ("inference", "forward", "train")


PRESETS = {
    "full": Params(),
    "quick": Params(budget_s=200.0),
    "smoke": Params(size="tiny", context_lengths=[16, 32], precisions=["fp32"], budget_s=60.0),
}

def residual_stream_check(size: str, batch_size: int, context_length: int, precision: str = "fp32",
                          device: torch.device | None = None, model: Any = None) -> dict[str, Any]:
    """The residual-stream activation ``(batch, seq, d_model)`` size from the formula
    (:func:`~cs336_systems.configs.residual_stream_bytes`) next to a tensor measured in a real forward
    pass: the output of the first block, captured by a forward hook."""
    spec = BenchmarkSpec(size, mode="inference", context_length=context_length, batch_size=batch_size,
                         precision=precision, device=str(device) if device else None)
    bench = ModelBenchmark(spec, model)
    captured: dict[str, torch.Tensor] = {}
    hook = bench.model.layers[0].register_forward_hook(lambda m, i, o: captured.setdefault("out", o))
    try:
        bench.step()
    finally:
        hook.remove()
    t = captured["out"]
    dtype = str(t.dtype).removeprefix("torch.")
    predicted = residual_stream_bytes(size, batch_size, context_length, dtype)
    return {
        "shape": list(t.shape), "dtype": dtype, "measured_bytes": t.numel() * t.element_size(),
        "predicted_bytes": predicted, "predicted_MiB": predicted / 2**20,
        "formula": f"batch × seq × d_model × bytes = {batch_size} × {context_length} × {get_config(size).d_model} "
                   f"× {t.element_size()}",
    }



def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """Snapshot each (precision, mode, context) cell with the CUDA caching allocator's history."""
    from cs336_systems.profiling import (
        largest_allocations,
        plot_memory_timelines,
        record_memory_snapshot,
    )

    size, device = p.size, default_device()
    cfg = get_config(size)
    result: dict[str, Any] = {}
    model = ModelBenchmark(BenchmarkSpec(size, mode="inference", context_length=max(p.context_lengths))).model
    check = residual_stream_check(size, cfg.batch_size, max(p.context_lengths), device=device, model=model)
    out.json(check, "residual_stream")
    result["residual_stream"] = check
    if device.type != "cuda":
        print(f"{CPU_NOTE} Memory snapshots need the CUDA caching allocator; only the residual-stream "
              "derivation was checked.")
        return result

    snapshots: dict[tuple[str, int, str], dict[str, Any]] = {}

    def one(precision: str, mode: str, context_length: int) -> dict[str, Any]:
        bench = ModelBenchmark(BenchmarkSpec(size, mode=mode, context_length=context_length, precision=precision), model)
        keep_pickle = precision == "fp32" and context_length == max(p.context_lengths)  # for pytorch.org/memory_viz
        path = SCRATCH_DIR / "memory" / f"{size}_{mode}_{precision}_ctx{context_length}.pickle" if keep_pickle else None
        snap = record_memory_snapshot(bench.step, path, warmup=1, steps=1)
        del bench
        snapshots[(precision, context_length, mode)] = snap
        predicted = memory_breakdown(cfg, cfg.batch_size, context_length)
        sizes_ = {k: predicted[k] for k in ("parameters", "gradients", "optimizer_state", "activations")}
        pred = sizes_["parameters"] + sizes_["activations"] + (
            sizes_["gradients"] + sizes_["optimizer_state"] if mode == "train" else 0)
        return {
            "peak_GiB": snap["summary"]["peak_allocated_bytes"] / 2**30,
            "allocated_before_GiB": snap["summary"]["allocated_before_bytes"] / 2**30,
            "fp32_estimate_GiB": pred / 2**30,
        }

    configs = [{"precision": pr, "mode": m, "context_length": c}
               for pr in p.precisions for m in p.modes for c in p.context_lengths]
    peaks = run_sweep(one, configs, desc="memory snapshots", budget_s=p.budget_s)
    out.table(peaks, "peak_memory", extra={"inference": "one forward pass under torch.no_grad (nothing kept)",
                                           "forward": "one forward pass with autograd on (activations kept)",
                                           "fp32_estimate": "configs.memory_breakdown (fp32 everything)"})
    result["peak_memory"] = peaks
    for precision in p.precisions:
        cells = [(m, c) for m in p.modes for c in p.context_lengths if (precision, c, m) in snapshots]
        if not cells:
            continue
        panels = {f"{size} {m}, ctx {c}, {precision}": snapshots.get((precision, c, m))
                  for m in p.modes for c in p.context_lengths}
        fig = plot_memory_timelines(panels, ncols=len(p.context_lengths), top=6)
        out.figure(fig, f"timeline_{precision}")
        plt.close(fig)
    # (e) asks about the forward pass: its largest allocations are attention's seq × seq score and
    # probability tensors; the autograd forward's and the training step's are listed too.
    from cs336_systems.profiling.memory import allocations_of_size

    biggest = pd.DataFrame()
    for mode, name in (("inference", "largest_allocations_inference"), ("forward", "largest_allocations"),
                       ("train", "largest_allocations_train")):
        ran = [c for c in p.context_lengths if ("fp32", c, mode) in snapshots]
        if not ran:  # every fp32 cell of this mode ran out of memory (or was skipped)
            continue
        key = ("fp32", max(ran), mode)  # the longest context that ran
        table = largest_allocations(snapshots[key], n=20)
        out.table(table, name, extra={"config": list(key)})
        biggest = table if biggest.empty and mode != "train" else biggest
        check[f"allocations_of_residual_size_in_{mode}"] = len(allocations_of_size(snapshots[key], check["measured_bytes"]))
    out.json(check, "residual_stream")
    result["largest_allocations"] = biggest
    del model
    snapshots.clear()
    free_memory()
    return result



# === Answers: formatting only; changes below this line do not make results stale ===


def _peak_pivot(peaks: pd.DataFrame, precision: str) -> pd.DataFrame | None:
    ok = ok_rows(peaks)
    if ok.empty or not {"precision", "mode", "context_length", "peak_GiB"} <= set(ok.columns):
        return None
    sel = ok[ok["precision"] == precision]
    if sel.empty:
        return None
    wide = sel.pivot_table(index="context_length", columns="mode", values="peak_GiB")
    wide = wide[[m for m in MODES if m in wide.columns] + [m for m in wide.columns if m not in MODES]].reset_index()
    wide.columns = [c if c == "context_length" else f"{c}_peak_GiB" for c in wide.columns]
    return wide


#: The modes in the order the answers name them, in the answers' words.
_MODE_WORDS = {"inference": "inference forward", "forward": "forward with autograd", "train": "training step"}


def _inference_note(fp32: pd.DataFrame) -> str:
    """How much of the autograd forward's peak is the activations it keeps: its peak against inference's."""
    if not {"inference_peak_GiB", "forward_peak_GiB"} <= set(fp32.columns):
        return ""
    rows = fp32.dropna(subset=["inference_peak_GiB", "forward_peak_GiB"])
    if rows.empty:
        return ""
    r = rows.iloc[-1]
    return (f" At context {int(r['context_length'])} turning autograd on raises the forward's peak from "
            f"{fmt.gib(r['inference_peak_GiB'] * 2**30)} to {fmt.gib(r['forward_peak_GiB'] * 2**30)}: the "
            "difference is the activations saved for backward, which inference frees block by block.")


def _failed_cells(peaks: pd.DataFrame | None, precision: str | None = None) -> str:
    """A sentence naming the cells (of ``precision``, when given) that did not run (out of memory, skipped), or ''."""
    if peaks is None or "status" not in peaks.columns:
        return ""
    bad = peaks[peaks["status"] != "ok"]
    if precision is not None and "precision" in bad.columns:
        bad = bad[bad["precision"] == precision]
    if bad.empty:
        return ""
    out = ""
    for oom, cells in bad.groupby(bad["status"] == "OOM", sort=False):
        parts = [f"{join_words(sorted({f'{pr} {_MODE_WORDS.get(m, m)}' for pr, m in zip(g['precision'], g['mode'])}))}"
                 f" at context {int(c)}" + ("" if oom else f" ({status})")
                 for (status, c), g in cells.groupby(["status", "context_length"], sort=True)]
        out += (" Ran out of memory: " if oom else " Not run: ") + "; ".join(parts) + "."
    return out


def _fits_checkpointed(d: SectionData, size: str, peaks: pd.DataFrame | None) -> str:
    """Where the fp32 training step ran out of memory at a context §1.1.7's checkpointing sweep ran for the same
    model and batch: that with checkpointing it fits, and at what peak (the sweep's lowest that ran)."""
    if peaks is None or not {"status", "mode", "precision", "context_length"} <= set(peaks.columns):
        return ""
    oom = peaks[(peaks["status"] == "OOM") & (peaks["mode"] == "train") & (peaks["precision"] == "fp32")]
    sibling = d.sibling("gradient_checkpointing")
    sweep, params = sibling.frame("checkpointing"), (sibling.meta("checkpointing").get("params") or {})
    if oom.empty or sweep is None or params.get("preset") != size or "peak_GiB" not in sweep.columns:
        return ""
    if int(params.get("context_length", -1)) not in set(oom["context_length"].astype(int)):
        return ""
    ran = sweep[(sweep["status"] == "ok") & (sweep["block_size"] > 0)] if "status" in sweep.columns else sweep
    if ran.empty or int(params.get("batch_size", -1)) != get_config(size).batch_size:
        return ""
    return (f" With its blocks checkpointed the training step fits at context {int(params['context_length']):,}: "
            f"a peak of {fmt.gib(float(ran['peak_GiB'].min()) * 2**30)} (§1.1.7 (b)).")


def _not_rescued(peaks: pd.DataFrame | None) -> str:
    """The modes bf16 autocast ran out of memory in as fp32 did, per context: what mixed precision does not save."""
    need = {"status", "precision", "mode", "context_length"}
    if peaks is None or not need <= set(peaks.columns):
        return ""
    oom = peaks[peaks["status"] == "OOM"]
    both = oom[oom["precision"] == "bf16"].merge(oom[oom["precision"] == "fp32"], on=["mode", "context_length"])
    parts = [f"at context {int(c):,} the {join_words([_MODE_WORDS.get(m, m) for m in g['mode']])} still "
             f"{'runs' if len(g) == 1 else 'run'} out of memory under bf16, as in fp32"
             for c, g in both.groupby("context_length", sort=True)]
    return ("It does not rescue a longer context: " + "; ".join(parts) + ". ") if parts else ""


def _saved_per_block(d: SectionData, size: str, batch: int, context: int) -> float | None:
    """Bytes one block saves for backward, as §1.1.7 measured it, where it measured this model at this batch and
    context (saved-tensor hooks on one block; its input and weights excluded); None otherwise."""
    from cs336_systems.profiling.residuals import residuals_by_op

    sibling = d.sibling("gradient_checkpointing")
    extra, table = sibling.meta("residuals").get("extra") or {}, sibling.frame("residuals")
    if table is None or "bytes" not in table.columns or (extra.get("model"), extra.get("batch_size"),
                                                         extra.get("context_length")) != (size, batch, context):
        return None
    return float(residuals_by_op(table)["bytes"].sum())


def _why_out_of_memory(d: SectionData, peaks: pd.DataFrame | None, cfg: Any, device: str) -> str:
    """Why the shortest context that ran out of memory did: what one block saves for backward times the blocks,
    on top of the training state (from §1.1.7's measurement where it measured this shape, else the accounting)."""
    first = _first_oom(peaks, cfg)
    if first is None:
        return ""
    c, scores = first
    from cs336_systems.configs import param_counts

    state = 16 * param_counts(cfg)["total"]  # fp32 weights, gradients and AdamW's two moments
    per_block = _saved_per_block(d, cfg.name, cfg.batch_size, c)
    gib = d.meta("peak_memory").get("gpu_memory_gib")
    capacity = f"{fmt.sig(float(gib))} GiB" if gib else "memory"
    if per_block is not None:
        here = editions.borrowed_as(d.edition, "memory_profiling", "gradient_checkpointing", "residuals")
        where = f"part ({here}) below measures it" if here else "§1.1.7 measured it"
        return (f" At context {c} one block saves {fmt.gib(per_block)} for backward ({where} at this "
                f"batch and context), so the {cfg.num_layers} blocks hold about {fmt.gib(cfg.num_layers * per_block)} "
                f"of activations on top of {fmt.gib(state)} of fp32 weights, gradients and AdamW moments, about "
                f"{fmt.gib(cfg.num_layers * per_block + state)} against the {device}'s {capacity}.")
    need = memory_breakdown(cfg, cfg.batch_size, c)
    return (f" At context {c} our memory accounting predicts {fmt.gib(need['total'])} for an fp32 training step, "
            f"{fmt.gib(need['activations'])} of it activations, against the {device}'s memory: naive attention keeps "
            f"batch × heads × context² scores ({fmt.gib(scores)} per tensor in fp32) several times per block.")


def _first_oom(peaks: pd.DataFrame | None, cfg: Any) -> tuple[int, int] | None:
    """The shortest context that ran out of memory, and the bytes of one of naive attention's fp32 score
    tensors there (batch × heads × context²); None where nothing ran out of memory."""
    if peaks is None or "status" not in peaks.columns or not (peaks["status"] == "OOM").any():
        return None
    c = int(peaks[peaks["status"] == "OOM"]["context_length"].min())
    return c, cfg.batch_size * cfg.num_heads * c * c * 4


def _scores_note(d: SectionData, peaks: pd.DataFrame | None, cfg: Any) -> str:
    """What dominates a block's saved tensors at the shortest context that ran out of memory, where §1.1.7
    measured that block (its three score-sized tensors: the masked scores, their exponentials, the probabilities)."""
    first = _first_oom(peaks, cfg)
    if first is None or _saved_per_block(d, cfg.name, cfg.batch_size, first[0]) is None:
        return ""
    c, scores = first
    return (f" At context {c} three of each block's saved tensors are naive attention's batch × heads × context² "
            f"scores, {fmt.gib(scores)} each in fp32.")


def _peak_moments(peaks: pd.DataFrame | None) -> list[tuple[int, str]]:
    """Per fp32 context with both a forward and a training step: which moment sets the training step's peak,
    "the end of the forward" (the state held between steps plus the activations saved for backward) or "the
    optimizer step" (that state plus the gradients, a copy of the weights)."""
    need = {"precision", "mode", "context_length", "status", "peak_GiB", "allocated_before_GiB"}
    if peaks is None or not need <= set(peaks.columns):
        return []
    p = peaks[(peaks["precision"] == "fp32") & (peaks["status"] == "ok")]
    fwd, train = (p[p["mode"] == m].set_index("context_length") for m in ("forward", "train"))
    contexts = [c for c in train.index if c in fwd.index]
    if not contexts:
        return []
    weights = float(fwd["allocated_before_GiB"].iloc[0])
    return [(int(c), "the end of the forward" if float(fwd.loc[c, "peak_GiB"]) - weights > weights else
             "the optimizer step") for c in contexts]


def _training_shape(peaks: pd.DataFrame | None) -> str:
    """How the training step's timeline moves through the backward, from which moment sets its peak (the
    activations it frees against the gradients it allocates)."""
    moments = _peak_moments(peaks)
    falls = [c for c, which in moments if which == "the end of the forward"]
    rises = [c for c, which in moments if which == "the optimizer step"]
    shapes = {
        "falls": (falls, "it peaks at the end of the forward and falls as the backward frees each block's activations "
                         "faster than gradients appear"),
        "rises": (rises, "it keeps rising through the backward, whose gradients (a copy of the weights) outweigh the "
                         "activations it frees, and peaks at the optimizer step"),
    }
    present = sorted((v for v in shapes.values() if v[0]), key=lambda v: min(v[0]))
    both = len(present) > 1
    parts = [("at context " + join_words([f"{c:,}" for c in where]) + " " if both else "") + words
             for where, words in present] or ["the backward then frees each block's activations while gradients appear"]
    return ("The training step starts higher (AdamW's two moments are resident after the warm-up step) and repeats "
            "that ramp; " + "; ".join(parts) + ".")


def _panel_legend(peaks: pd.DataFrame | None) -> str:
    """How to read the timelines' colours (for the figure's caption): what "other" and "(no user frame)" hold."""
    rises = [c for c, which in _peak_moments(peaks) if which == "the optimizer step"]
    return ((f" Where the peak comes at the optimizer step (context{'s' if len(rises) > 1 else ''} "
             f"{join_words([f'{c:,}' for c in rises])}), the training panel draws the forward's activations as "
             "“other”: each panel colours the sources that hold the most memory at its own peak, and by then the "
             "backward has freed them." if rises else "")
            + " “(no user frame)” marks allocations made with no Python code on the stack: inside autograd's "
            "backward, whose engine runs on its own thread (the gradients among them), or the optimizer's C++ code.")


def _train_peak_breakdown(peaks: pd.DataFrame | None, counted_gib: float | None = None) -> str:
    """What sets the training step's peak at each context: the state held between steps plus the forward's
    activations (the end of the forward), or that state plus the gradients (the optimizer step). ``counted_gib``:
    the fp32 parameters by the calculator's count, beside what the run had allocated before its forward."""
    need = {"precision", "mode", "context_length", "status", "peak_GiB", "allocated_before_GiB"}
    if peaks is None or not need <= set(peaks.columns):
        return ""
    moments = _peak_moments(peaks)
    if not moments:
        return ""
    p = peaks[(peaks["precision"] == "fp32") & (peaks["status"] == "ok")]
    fwd, train = (p[p["mode"] == m].set_index("context_length") for m in ("forward", "train"))
    weights = float(fwd["allocated_before_GiB"].iloc[0])
    state = float(train["allocated_before_GiB"].iloc[0])
    parts, kinds = [], []
    for c, which in moments:
        acts = float(fwd.loc[c, "peak_GiB"]) - weights
        end_of_forward, optimizer = state + acts, state + weights
        kinds.append(which)
        parts.append(f"context {int(c)}: {fmt.gib(acts * 2**30)} of activations, so {which} "
                     f"({fmt.gib(max(end_of_forward, optimizer) * 2**30)} predicted, "
                     f"{fmt.gib(float(train.loc[c, 'peak_GiB']) * 2**30)} measured)")
    held = (f"the fp32 weights ({fmt.gib(counted_gib * 2**30)} of parameters by our count; the run had "
            f"{fmt.gib(weights * 2**30)} allocated before its forward, the inputs and other small allocations "
            "included)" if counted_gib else f"the {fmt.gib(weights * 2**30)} of fp32 weights")
    return (f" Between steps the training run holds {held} and AdamW's two "
            f"moments, {fmt.gib(state * 2**30)} in all ({fmt.sig(state / weights, 2)} copies of the weights; "
            "`zero_grad` frees the gradients). A step then peaks at the larger of two moments: the end of the "
            "forward, that state plus the activations saved for backward (the forward's peak minus the weights), "
            "or the optimizer step, that state plus the gradients, a fourth copy of the weights. "
            + (lambda t: t[0].upper() + t[1:])("; ".join(parts)) + "."
            + (" So at short contexts the optimizer step sets the peak and it barely moves with context; once the "
               "activations outgrow one copy of the weights, they set it." if len(set(kinds)) > 1 else ""))


#: The peak table's columns as printed, each with what it holds: the handout's two passes first, under its names.
PEAK_COLUMNS = {
    "inference_peak_GiB": ("forward_pass_GiB", "the forward pass (inference, no autograd)"),
    "train_peak_GiB": ("training_step_GiB", "the full training step"),
    "forward_peak_GiB": ("forward_with_autograd_GiB", "the forward with autograd on, which holds the activations a "
                                                      "training step saves"),
}


def _peak_caption(frame: pd.DataFrame | None) -> str:
    """The caption's gloss of the columns the table has."""
    meanings = [PEAK_COLUMNS[c][1] for c in PEAK_COLUMNS if frame is not None and c in frame.columns]
    return (": " + "; ".join(meanings) + ".") if meanings else "."


def _peak_columns(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    if frame is None:
        return None
    first = [c for c in frame.columns if c not in PEAK_COLUMNS] + [c for c in PEAK_COLUMNS if c in frame.columns]
    return frame[first].rename(columns={c: name for c, (name, _) in PEAK_COLUMNS.items()})


def answer(d: SectionData) -> list[Block]:
    from cs336_systems.configs import param_counts

    meta = d.meta("peak_memory") or d.meta("residual_stream")
    size = str((meta.get("params") or {}).get("size", "2.7B"))
    shown = handout_model(size, d.edition)  # as this edition's handout names it (2026: xl for xl@2026)
    device = meta.get("device", "the GPU")
    cfg = get_config(size)
    rs = d.json("residual_stream")
    shape = rs.get("shape") if isinstance(rs, dict) else None
    # The derivation at the shape the run measured (the reference batch, the grid's longest context).
    batch, context = (int(shape[0]), int(shape[1])) if shape and len(shape) == 3 else (cfg.batch_size,
                                                                                        cfg.context_length)
    act = residual_stream_bytes(cfg, batch, context, "fp32")
    # (d) at the handout's reference shape, the measured context beside it
    ref = residual_stream_bytes(cfg, cfg.batch_size, cfg.context_length, "fp32")
    peaks = d.frame("peak_memory")
    fp32 = _peak_pivot(peaks, "fp32") if peaks is not None else None
    bf16 = _peak_pivot(peaks, "bf16") if peaks is not None else None
    b_text = c_text = None
    failed = _failed_cells(peaks, "fp32")  # (b) is the fp32 question; (c) names bf16's own
    # What sets the training step's peak, derived: beyond the handout's two numbers per context (the appendix).
    breakdown = _train_peak_breakdown(peaks, param_counts(cfg)["total"] * 4 / 2**30).strip()
    if fp32 is not None and "train_peak_GiB" in fp32.columns and ({"inference_peak_GiB", "forward_peak_GiB"}
                                                                   & set(fp32.columns)):
        def cell(r: pd.Series) -> str:
            done = [f"{what} {fmt.gib(r[f'{m}_peak_GiB'] * 2**30)}" for m, what in _MODE_WORDS.items()
                    if f"{m}_peak_GiB" in r and pd.notna(r[f"{m}_peak_GiB"])]
            return f"at context {int(r['context_length'])}, " + ", ".join(done)

        b_text = Text(f"Peak memory of the {shown} model in fp32: " + "; ".join(
            cell(r) for _, r in fp32.iterrows()) + "."
            + f"{failed}" + _why_out_of_memory(d, peaks, cfg, device) + _fits_checkpointed(d, size, peaks))
        # (b) asks for a table: what autograd adds and what fills a block are the appendix's
        breakdown = (_inference_note(fp32) + _scores_note(d, peaks, cfg) + " " + breakdown).strip()
    elif failed:
        b_text = Text(f"No fp32 cell with both a forward pass and a training step ran for the {shown} model on "
                      f"{device}.{failed}")
    if fp32 is not None and bf16 is not None:
        m = fp32.merge(bf16, on="context_length", suffixes=("_fp32", "_bf16"))
        ratios, moves = [], {}  # bf16 / fp32 peak per mode (each peak is in the table)
        for mode, words in _MODE_WORDS.items():
            a, bcol = f"{mode}_peak_GiB_fp32", f"{mode}_peak_GiB_bf16"
            if a in m and bcol in m:
                r = (m[bcol] / m[a]).dropna()
                if not r.empty:
                    ratios.append(r)
                    moves[words] = max(abs(float(r.max()) - 1), abs(1 - float(r.min())))
        if ratios:
            grows = any(x.max() > 1 for x in ratios)
            # The handout asks whether it matters: yes where any peak moves by more than a tenth, else no.
            moved = max(max(abs(float(x.max()) - 1), abs(1 - float(x.min()))) for x in ratios)
            steady = [w for w, x in moves.items() if x <= 0.10]
            direction = {words: "raises" if float(r.max()) - 1 >= 1 - float(r.min()) else "lowers"
                         for words, r in zip(moves, ratios)}
            cells = {words: len(r) for words, r in zip(moves, ratios)}  # "up to" only over several contexts
            moving = [f"{direction[w]} the {w} peak by {'up to ' if cells[w] > 1 else ''}{fmt.pct(x, 2)}"
                      for w, x in moves.items() if x > 0.10]
            verdict = ("Not significantly: no peak moves by more than 10%. " if moved <= 0.10 else
                       (f"Not significantly for the {join_words(steady)} peaks (within 10%); it " if steady
                        else "Yes: it ") + join_words(moving) + ". ")
            verdict += _not_rescued(peaks)
            # (c) asks for 2-3 sentences: the verdict, the longer context, why (each peak is in the table)
            c_text = Text(verdict + "Autocast keeps the "
                          "fp32 weights, gradients and optimizer state and adds bf16 copies of weights for the "
                          "matmuls, so only the activations shrink (those saved for backward, or without autograd "
                          "the transient ones, such as the attention scores)"
                          + ("; where the peak grows, those weight copies outweigh the smaller activations." if grows
                             else "; the saving grows with context length, where activations dominate."))
    modes = [m for m in _MODE_WORDS if fp32 is not None and f"{m}_peak_GiB" in fp32.columns]
    timeline = d.figure("timeline_fp32", large=True, caption=f"Active memory over allocation events, {shown}, fp32, one row per "
                        f"mode ({', '.join(_MODE_WORDS[m] for m in modes) or 'forward pass and training step'}, top "
                        "to bottom) and one column per context length. Drawn by us from the allocator trace "
                        "(`torch.cuda.memory._snapshot()`) that pytorch.org/memory_viz reads, stacked like its Active "
                        "Memory Timeline; the longest context's fp32 snapshots are kept for that viewer. The dashed "
                        "peak is the largest sum of the allocations the trace records, which can sit a little below the "
                        "allocator's own peak in the table." + _panel_legend(peaks))
    rs_text = None
    if isinstance(rs, dict) and "measured_bytes" in rs:
        rs_text = Text(f"Measured in a forward pass (the first block's output, shape {tuple(rs.get('shape', []))}, "
                       f"`{rs.get('dtype')}`): {int(rs['measured_bytes']):,} bytes, "
                       + ("matching the formula." if rs.get("measured_bytes") == rs.get("predicted_bytes") else
                          f"against {int(rs.get('predicted_bytes', 0)):,} predicted."))
    largest_name = d.frame_name("largest_allocations_inference", "largest_allocations")
    largest = _largest_text(d.frame(largest_name), d.meta(largest_name)) if largest_name else None
    return [
        question(d, "a", f"Memory timelines of the {shown} model: forward pass and full training step.", [
            timeline,
            None if timeline is None else Text(
                ("Inference (no autograd) stays flat above the weights, its spikes one block's transients and the "
                 "logits at the end. " if "inference" in modes else "")
                + "With autograd on, the forward rises as each block saves its activations for the backward, and "
                "peaks at its end with every block's activations and the logits resident. "
                + _training_shape(peaks)),
        ], what="memory timelines"),
        question(d, "b", "Peak memory by context length, forward pass and full training step.",
                 [b_text, d.table("peak_memory", frame=_peak_columns(fp32), caption=f"Peak allocated memory of "
                                  f"the {shown} model, fp32 (GiB)" + _peak_caption(fp32))],
                 what="peak memory by context length"),
        question(d, "c", "Peak memory with bf16 mixed precision.",
                 [c_text, d.table("peak_memory", frame=_peak_columns(bf16), caption=f"Peak allocated memory of the {shown} model "
                                  "under bf16 autocast (GiB)."),
                  d.figure("timeline_bf16", large=True, caption="Active memory timelines under bf16 autocast.")],
                 what="peak memory with mixed precision"),
        question(d, "d", f"Size of one residual-stream activation of the {shown} model in fp32.", [
            Equation([
                (r"B \cdot T \cdot d_{\mathrm{model}} \cdot 4\,\mathrm{bytes} = "
                rf"{cfg.batch_size} \cdot {cfg.context_length} \cdot {cfg.d_model} \cdot 4 = "
                rf"{fmt.tex_int(ref)}\,\mathrm{{B}} = {ref / 2**20:g}\,\mathrm{{MiB}}"),
            ]),
            Text(f"At the reference batch size {cfg.batch_size} and context length {cfg.context_length} one "
                 f"residual-stream tensor is {fmt.mib(ref, 4)}"
                 + (f"; at context {context}, where the run measured it, {fmt.mib(act, 4)}." if context !=
                    cfg.context_length or batch != cfg.batch_size else ".")),
            rs_text,
        ]),
        question(d, "e", "The largest allocations in the forward pass's active-memory timeline and where they "
                 "come from.", [largest],
                 what=None if largest is not None else "the largest allocations"),  # its table is the appendix's
        # (e)'s answer names the tensors; the allocation tables behind it, and (b)'s derivation, are the appendix's.
        Text("", role=BEYOND_HANDOUT),
        *([question(d, "b", "What autograd adds to the forward's peak, and what sets the training step's peak.",
                    [Text(breakdown)])]
          if breakdown else []),
        *[t for t in (
            d.table("largest_allocations_inference", frame=_allocation_table(d, "largest_allocations_inference"),
                    caption="§1.1.6 (e): largest allocations of the fp32 inference forward pass at the longest "
                            f"context that ran{_config_context(d, 'largest_allocations_inference')} (stacks: the CSV)."),
            d.table("largest_allocations", frame=_allocation_table(d, "largest_allocations"),
                    caption="§1.1.6 (e): largest allocations of the fp32 forward pass with autograd on at the longest "
                            f"context that ran{_config_context(d, 'largest_allocations')} (stacks: the CSV)."),
            d.table("largest_allocations_train",
                    frame=_allocation_table(d, "largest_allocations_train"),
                    caption="§1.1.6 (e), for comparison: the largest allocations of the full training step."),
        ) if t is not None],
    ]


def _config_context(d: SectionData, name: str) -> str:
    config = ((d.meta(name) or {}).get("extra") or {}).get("config")
    return f", {int(config[1])}" if isinstance(config, list) and len(config) == 3 else ""


def _source_line(origin: str, commit: str | None) -> tuple[str, str] | None:
    """``(assigned name, code)`` of an allocation site ``"model.py:146 scaled_dot_product_attention"``: the
    line of our model package at the result's commit (the working tree's when that is unknown)."""
    import re

    from cs336_systems.measured_code import REPO_ROOT, git

    match = re.match(r"(\w+\.py):(\d+) ", origin)
    if not match:
        return None
    path = f"cs336-basics/cs336_basics/{match.group(1)}"
    text = git(["show", f"{commit}:{path}"], REPO_ROOT) if commit else None
    if text is None and (REPO_ROOT / path).is_file():
        text = (REPO_ROOT / path).read_text()
    lines = (text or "").splitlines()
    line = int(match.group(2))
    if not 0 < line <= len(lines):
        return None
    code = lines[line - 1].strip()
    target = re.match(r"(\w+)\s*=[^=]", code)
    return (target.group(1) if target else ""), code


def _shape_words(nbytes: float, meta: dict[str, Any]) -> str:
    """The tensor shape a size matches, for the model and context of the result: attention's
    batch × heads × seq × seq, or a batch × seq × width activation."""
    size = (meta.get("params") or {}).get("size")
    config = ((meta.get("extra") or {}).get("config")) or []
    if not size or len(config) != 3:
        return ""
    try:
        cfg = get_config(size)
    except ValueError:
        return ""
    context, element = int(config[1]), 2 if config[0] in ("bf16", "fp16") else 4
    shapes = {
        "batch × heads × seq × seq": (cfg.batch_size, cfg.num_heads, context, context),
        "batch × seq × d_ff": (cfg.batch_size, context, cfg.d_ff),
        "batch × seq × d_model": (cfg.batch_size, context, cfg.d_model),
        "batch × seq × vocab": (cfg.batch_size, context, cfg.vocab_size),
    }
    for words, dims in shapes.items():
        for elem, dtype in ((element, config[0]), (4, "fp32")):
            if abs(nbytes - elem * int(torch.Size(dims).numel())) < 1:
                return f", a {words} tensor ({' × '.join(map(str, dims))}, {dtype})"
    return ""


def _tensor_of(origin: str, nbytes: float, meta: dict[str, Any], code: bool = True, shape: bool = True) -> str:
    """The tensor an allocation is, by the name its line of the model assigns (and, with ``shape``, its shape),
    not by file and line number; ``code=False`` leaves out the markdown (for a table cell)."""
    if origin.startswith("(no user frame"):
        return "no Python frame (inside autograd's backward or the optimizer's C++ code)"
    function = origin.split(" ", 1)[1] if " " in origin else origin
    found = _source_line(origin, meta.get("git_commit"))
    q = "`" if code else ""
    if found is None:
        return f"{q}{origin}{q}"
    name, line = found
    what = f"{q}{name}{q} = {q}{line.split('=', 1)[1].strip()}{q}" if name else f"{q}{line}{q}"
    return f"{what} in {q}{function}{q}{_shape_words(nbytes, meta) if shape else ''}"


def _largest_text(df: pd.DataFrame | None, meta: dict[str, Any] | None = None) -> Text | None:
    """The largest allocations by the tensor each one is (the name its line assigns, and the line), not by
    file and line number."""
    if df is None or df.empty or not {"size_MiB", "origin"} <= set(df.columns):
        return None
    meta = meta or {}
    # three, or every site of the largest size where more share it (a reader counts what the answer omits)
    shown = max(3, int((df["size_MiB"] >= df["size_MiB"].max() - 1e-9).sum()))
    top = df.head(shown)
    config = (meta.get("extra") or {}).get("config") or []
    which = (f" ({_MODE_WORDS.get(config[2], config[2])}, {config[0]}, context {int(config[1]):,})"
             if len(config) == 3 else "")
    if top["size_MiB"].nunique() == 1 and "count" in top.columns:  # one size: say it and its shape once
        nbytes = float(top["size_MiB"].iloc[0]) * 2**20
        size = (meta.get("params") or {}).get("size")
        layers = _layers(str(size)) if size else None
        sites = [f"{_tensor_of(str(r['origin']), nbytes, meta, shape=False)} (×{int(r['count'])}"
                 + (f", {_per_layer(int(r['count']), layers)}" if layers else "") + ")" for _, r in top.iterrows()]
        shape = _shape_words(nbytes, meta).replace(", a ", ", each a ", 1)
        return Text(f"The largest allocations{which} are {fmt.mib(nbytes)}{shape}, made at {len(sites)} lines: "
                    + "; ".join(sites) + ".")
    parts = [f"{fmt.mib(r['size_MiB'] * 2**20)}" + (f" ×{int(r['count'])}" if "count" in df.columns else "")
             + f": {_tensor_of(str(r['origin']), r['size_MiB'] * 2**20, meta)}" for _, r in top.iterrows()]
    # the first frameless allocation says where such allocations come from; the others only that they have none
    seen = False
    for i, part in enumerate(parts):
        if "no Python frame" in part:
            parts[i] = part if not seen else part.split(" (inside")[0]
            seen = True
    return Text(f"The largest allocations{which}: " + "; ".join(parts) + ".")


def _layers(preset: str) -> int | None:
    try:
        return get_config(preset).num_layers
    except (KeyError, ValueError):
        return None


def _per_layer(count: int, layers: int) -> str:
    """How often a line allocates per layer, in words ("once per layer", "twice per layer")."""
    if count % layers:
        return f"{count} over {layers} layers"
    times = count // layers
    return {1: "once", 2: "twice"}.get(times, f"{times} times") + " per layer"


def _allocation_table(d: SectionData, name: str) -> pd.DataFrame | None:
    """An allocation table with each origin named as the tensor it allocates (the CSV keeps the stacks)."""
    df = subset(d.frame(name), "size_MiB", "count", "origin")
    if df is None or df.empty:
        return df
    meta = d.meta(name)
    tensors = [_tensor_of(str(o), s * 2**20, meta, code=False) for o, s in zip(df["origin"], df["size_MiB"])]
    return df.drop(columns="origin").assign(tensor=tensors)


SECTION = Section(
    name="memory_profiling", number="1.1.6", title="Memory profiling", problems=("memory_profiling",),
    answer=answer, presets=PRESETS, run=run,
    editions={"2026": {"size": "xl@2026", "context_lengths": [128, 2048]}},  # the 2026 handout's xl and contexts
    depends=(*MODEL, *TIMING, "cs336_systems/profiling/memory.py"),
)
