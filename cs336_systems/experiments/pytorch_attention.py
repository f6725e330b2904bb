"""§1.2.1 Benchmarking PyTorch attention: eager attention over head size × sequence length (batch 8, one
head): forward and backward time, memory before backward, which cells run out of memory, and the
memory accounting of the smallest one that does.

Problem ``pytorch_attention``. The grid and its heatmap are shared with §1.3 (``torch_compile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from cs336_systems.benchmarking.attention import (
    HANDOUT_D_MODELS,
    HANDOUT_SEQ_LENS,
    attention_step_memory,
    benchmark_attention,
    naive_attention_memory,
)
from cs336_systems.benchmarking.sweep import OK, OOM, run_sweep, status_grid
from cs336_systems.experiments.section import Section, check_positive, param
from cs336_systems.plotting import measured_on, status_heatmap
from cs336_systems.derived import Derived
from cs336_systems.report import fmt
from cs336_systems.report.answers import failed_rows, join_words, ok_rows, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params:
    d_models: list[int] = param(HANDOUT_D_MODELS, "head dimensions")
    seq_lens: list[int] = param(HANDOUT_SEQ_LENS, "sequence lengths")
    batch_size: int = param(8, "batch size (one head)")
    n_forward: int = param(100, "timed forward passes per cell")
    n_backward: int = param(100, "timed backward passes per cell")
    budget_s: float = param(900.0, "time budget in seconds; cells past it are recorded as skipped")
    probe_doublings: int = param(3, "where no cell of the grid runs out of memory (on a GPU): one forward and "
                                    "backward at the smallest d and the longest sequence, then at up to this many "
                                    "doublings of it, until one does")

    def check(self) -> None:
        check_positive(batch_size=self.batch_size, n_forward=self.n_forward, n_backward=self.n_backward,
                       budget_s=self.budget_s, probe_doublings=self.probe_doublings,
                       **{f"d_model {d}": d for d in self.d_models},
                       **{f"seq_len {s}": s for s in self.seq_lens})


PRESETS = {
    "full": Params(),
    "quick": Params(budget_s=150.0),
    "smoke": Params(d_models=[16, 32], seq_lens=[32, 64], batch_size=2, n_forward=3, n_backward=3, budget_s=60.0),
}

def attention_grid(p: dict[str, Any], compile: bool, budget_s: float, desc: str) -> pd.DataFrame:
    def one(d_model: int, seq_len: int) -> dict[str, Any]:
        return benchmark_attention(d_model, seq_len, batch_size=p.batch_size, compile=compile,
                                   n_forward=p.n_forward, n_backward=p.n_backward)

    configs = [{"d_model": d, "seq_len": s} for d in p.d_models for s in p.seq_lens]
    df = run_sweep(one, configs, desc=desc, budget_s=budget_s)
    return df.assign(compiled=compile)


def oom_probe(p: Params, grid: pd.DataFrame, device: str | torch.device | None = None) -> pd.DataFrame | None:
    """Where no cell of the grid ran out of memory on a GPU: one forward and backward at the smallest d and the
    longest sequence, then at each doubling of it (up to ``p.probe_doublings``) until one runs out of memory
    (:func:`attention_step_memory`); None where a cell did, or without a GPU."""
    if (grid["status"] == OOM).any() or not torch.cuda.is_available():
        return None
    d, seq = min(p.d_models), max(p.seq_lens)
    rows = []
    for _ in range(p.probe_doublings + 1):
        rows.append(attention_step_memory(d, seq, batch_size=p.batch_size, device=device))
        if rows[-1]["status"] != OK:
            break
        seq *= 2
    return pd.DataFrame(rows)


def attention_memory_accounting(grid: pd.DataFrame, batch_size: int,
                                probe: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Predicted (:func:`naive_attention_memory`) vs measured memory before backward for every cell, and the
    accounting of the smallest OOM configuration: of the grid, else of the ``probe`` beyond it (else the first
    sequence length predicted not to fit this device)."""
    rows = []
    for _, r in grid.iterrows():
        pred = naive_attention_memory(batch_size, int(r["seq_len"]), int(r["d_model"]), grad_output=True)
        rows.append({"d_model": r["d_model"], "seq_len": r["seq_len"], "status": r["status"],
                     "predicted_MiB": pred["total"] / 2**20,
                     "measured_MiB": r.get("memory_before_backward_MiB", math.nan)})
    table = pd.DataFrame(rows)
    table["measured_over_predicted"] = table["measured_MiB"] / table["predicted_MiB"]
    capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    ooms = grid[grid["status"] == OOM].sort_values(["seq_len", "d_model"])
    probed = probe[probe["status"] == OOM] if probe is not None and len(probe) else pd.DataFrame()
    if not ooms.empty:
        first = ooms.iloc[0]
        d, s = int(first["d_model"]), int(first["seq_len"])
        source = "smallest configuration that ran out of memory"
    elif not probed.empty:
        first = probed.iloc[0]
        d, s = int(first["d_model"]), int(first["seq_len"])
        source = (f"every cell of the grid fits; doubling the sequence at the smallest d, the first that ran out of "
                  f"memory, in its {first['oom_in']}")
    else:
        d = int(grid["d_model"].min())
        s = int(grid["seq_len"].max()) * 2
        if capacity:
            while naive_attention_memory(batch_size, s, d, grad_output=True)["total"] < capacity:
                s *= 2
        source = "no cell ran out of memory; first power-of-two sequence length predicted not to fit" + (
            "" if capacity else " (no GPU: capacity unknown)")
    terms = {k: v / 2**20 for k, v in naive_attention_memory(batch_size, s, d, grad_output=True).items()}
    below = grid[(grid["d_model"] == d) & (grid["seq_len"] < s) & (grid["status"] == OK)].sort_values("seq_len")
    accounting = {"source": source, "d_model": d, "seq_len": s, "batch_size": batch_size, "terms_MiB": terms}
    if capacity:
        accounting["capacity_MiB"] = capacity / 2**20
    if probe is not None and len(probe):
        accounting["probe"] = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                               for r in probe.to_dict("records")]
    if not below.empty:
        b = below.iloc[-1]
        measured = float(b.get("memory_before_backward_MiB", math.nan))
        accounting["below"] = {
            "seq_len": int(b["seq_len"]),
            "measured_MiB": None if math.isnan(measured) else measured,
            "predicted_MiB": naive_attention_memory(batch_size, int(b["seq_len"]), d, grad_output=True)["total"] / 2**20,
        }
    return table, accounting



def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The eager grid, its status grids, the probe beyond the grid where it all fits, and the memory accounting."""
    df = attention_grid(p, compile=False, budget_s=p.budget_s, desc="attention grid")
    out.table(df, "timings")
    grids = {
        "forward_ms": status_grid(df, "forward_mean_ms", "d_model", "seq_len"),
        "backward_ms": status_grid(df, "backward_mean_ms", "d_model", "seq_len"),
        "memory_before_backward_MiB": status_grid(df, "memory_before_backward_MiB", "d_model", "seq_len", "{:.0f}"),
    }
    for name, g in grids.items():
        out.table(g, f"grid_{name}", index=True)
    probe = oom_probe(p, df)
    if probe is not None:
        out.table(probe, "oom_probe")
    table, accounting = attention_memory_accounting(df, p.batch_size, probe)
    out.table(table, "memory_accounting")
    out.json(accounting, "oom_accounting")
    return {"timings": df, **{f"grid_{k}": g.reset_index() for k, g in grids.items()},
            "memory_accounting": table, "oom_accounting": accounting}



GRID_AXES = dict(index="d_model", columns="seq_len")


def grid_axes(ax: Any, title: str) -> None:
    ax.set(xlabel="sequence length (tokens)", ylabel="d (head dimension)", title=title)


def plot_attention_grid(timings: pd.DataFrame, meta: dict[str, Any] | None = None) -> Any:
    """Heatmaps over (d, sequence length) of eager attention's forward and backward time and the memory in
    use before the backward pass; cells that ran out of memory (or were skipped) are grey and say so."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    panels = (("forward_mean_ms", "forward pass (ms)", "{:.3g}"),
              ("backward_mean_ms", "backward pass (ms)", "{:.3g}"),
              ("memory_before_backward_MiB", "memory before backward (MiB)", "{:,.0f}"))
    for ax, (column, label, cell_fmt) in zip(axes, panels):
        status_heatmap(ax, timings, column, **GRID_AXES, fmt=cell_fmt, log=True, cmap="viridis", colorbar_label=label)
        grid_axes(ax, label[0].upper() + label[1:])
    batch = ((meta or {}).get("params") or {}).get("batch_size")
    fig.suptitle(f"Naive attention (eager PyTorch{f', batch {batch}' if batch else ''}, one head, causal), "
                 f"{measured_on(meta)}; colour scales are logarithmic")
    fig.tight_layout()
    return fig


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """Figures of §1.2.1 from its ``timings`` table."""
    return Derived(figures={"attention_grid": (plot_attention_grid(tables["timings"], meta), "timings")})



# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def _grid(d: SectionData, value: str) -> pd.DataFrame | None:
    """The grid of ``value`` from the full-precision timings, to four significant digits (the committed grid's
    strings are rounded to 0.01 ms, which a table would print as 0.2500 for a 0.2506 ms cell); None: the grid as
    committed."""
    timings = d.frame("timings")
    if timings is None or not {value, "d_model", "seq_len"} <= set(timings.columns):
        return None
    return status_grid(timings, value, "d_model", "seq_len", "{:.4g}").reset_index()


def _probe_rows(acc: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The probe's last configuration that ran a whole step (with its peak) and its first that did not."""
    probe = acc.get("probe") or []
    fitted = [r for r in probe if r.get("status") == "ok" and r.get("peak_MiB") and r.get("memory_before_backward_MiB")]
    failed = [r for r in probe if r.get("status") != "ok"]
    return (fitted[-1] if fitted else None), (failed[0] if failed else None)


def _which_size(acc: dict[str, Any], device: str | None) -> Text:
    """The direct answer: the smallest configuration that ran out of memory, where, and on what."""
    dd, T = int(acc["d_model"]), int(acc["seq_len"])
    _, oom = _probe_rows(acc)
    where = f" on the {device}" if device else ""
    if oom is not None:
        return Text(f"Every configuration of the grid fits{where}; doubling the sequence at the smallest $d$, the "
                    f"first that runs out of memory is $d = {dd}$, $T = {fmt.tex_int(T)}$ (batch {acc['batch_size']}), "
                    f"in its {oom.get('oom_in') or 'step'}.")
    return Text(f"The smallest configuration that runs out of memory{where}: $d = {dd}$, $T = {fmt.tex_int(T)}$ "
                f"(batch {acc['batch_size']}; {acc.get('source', '')}).")


def _launch_bound(ok: pd.DataFrame) -> str:
    """Where the shortest sequence's passes do not order by head size: a pass there is a few small kernels whose
    launch and host costs, not their FLOPs or bytes, set the time, so a larger $d$ can time faster."""
    short = ok[ok["seq_len"] == ok["seq_len"].min()].sort_values("d_model")
    if len(short) < 2:
        return ""
    f = short["forward_mean_ms"].to_numpy()
    if all(a <= b for a, b in zip(f, f[1:])):
        return ""
    return (f" At {int(short['seq_len'].iloc[0]):,} tokens the forward times do not grow with $d$ "
            f"({fmt.ms(f.min())}–{fmt.ms(f.max())}): each pass is a few kernels too small to fill the GPU, so launch "
            "and host costs, not the arithmetic, set the time.")


def _backward_peak(acc: dict[str, Any]) -> Text | None:
    """Where the grid fit and the probe beyond it ran out of memory: the saved memory measured at that
    configuration, what the backward adds (measured one size below, in score-sized tensors) and what that
    predicts at the configuration that did not fit."""
    last, oom = _probe_rows(acc)
    capacity = acc.get("capacity_MiB")
    if last is None or oom is None or not capacity:
        return None
    growth = last["peak_MiB"] / last["memory_before_backward_MiB"]

    def score_MiB(seq: int) -> float:  # one fp32 B x T x T tensor
        return 4 * acc["batch_size"] * seq**2 / 2**20

    added = (last["peak_MiB"] - last["memory_before_backward_MiB"]) / score_MiB(last["seq_len"])
    # the same number of score-sized tensors at the configuration that did not fit, on top of its saved memory
    need = acc["terms_MiB"]["total"] + round(added) * score_MiB(oom["seq_len"])
    measured = oom.get("memory_before_backward_MiB")
    return Text((f"Measured before its backward: {fmt.sig(measured, 4)} MiB, which fits the GPU's "
                 f"{fmt.sig(capacity, 4)} MiB. " if measured is not None and pd.notna(measured) else "")
                + f"The backward then adds about {added:.0f} more $B \\times T \\times T$ fp32 tensors (at "
                f"$T = {fmt.tex_int(last['seq_len'])}$ the step peaked at {fmt.sig(last['peak_MiB'], 4)} MiB against "
                f"{fmt.sig(last['memory_before_backward_MiB'], 4)} MiB before the backward, {fmt.ratio(growth)}): the "
                f"softmax's gradients and temporaries, allocated while the saved tensors still live. At "
                f"$T = {fmt.tex_int(oom['seq_len'])}$ that is about {fmt.sig(need, 4)} MiB, so the step ran out of "
                f"memory in its {oom.get('oom_in') or 'step'}.")


def answer(d: SectionData) -> list[Block]:
    timings = d.frame("timings")
    acc = d.json("oom_accounting")
    ok = ok_rows(timings)
    t_text = None
    if not ok.empty and {"seq_len", "forward_mean_ms", "backward_mean_ms"} <= set(ok.columns):
        big = ok[ok["seq_len"] == ok["seq_len"].max()]
        failed = failed_rows(timings)
        params = d.meta("timings").get("params", {})
        setup = ", ".join(x for x in (
            f"batch {params['batch_size']}" if params.get("batch_size") else "",
            f"{params['n_forward']} forward and {params.get('n_backward', params['n_forward'])} backward passes each"
            if params.get("n_forward") else "") if x)
        t_text = Text(
            f"{len(ok)} of {len(timings)} configurations ran" + (f" ({setup})" if setup else "") + ". "
            f"At the grid's longest sequence that ran, {int(big['seq_len'].iloc[0]):,}, a forward pass takes "
            f"{fmt.ms(big['forward_mean_ms'].min())}–{fmt.ms(big['forward_mean_ms'].max())} and a backward pass "
            f"{fmt.ms(big['backward_mean_ms'].min())}–{fmt.ms(big['backward_mean_ms'].max())} across head sizes."
            + (" Out of memory or not run: " + join_words([f"$d={int(r['d_model'])}, T={fmt.tex_int(r['seq_len'])}$ "
               f"({r['status']})" for _, r in failed.iterrows()]) + "." if not failed.empty else "") + _launch_bound(ok))
    acc_blocks: list[Block | None] = []
    peak = None  # what the backward adds at that configuration
    if isinstance(acc, dict) and "terms_MiB" in acc:
        B, T, dd = int(acc["batch_size"]), int(acc["seq_len"]), int(acc["d_model"])
        total = acc["terms_MiB"].get("total", float("nan"))
        acc_blocks = [
            Text("At that configuration:"),
            Equation([(rf"M_{{\mathrm{{before\ backward}}}} = 4 \cdot {B}\,(3 \cdot {T}^2 + 2 \cdot {T} + 5 \cdot {T} \cdot {dd})"
                      rf" + {T}^2 = {fmt.tex_sig(total, 4)}\,\mathrm{{MiB}}")]),
        ]
        peak = _backward_peak(acc)
        below = acc.get("below")
        if peak is None and isinstance(below, dict) and below.get("measured_MiB") is not None:
            acc_blocks.append(Text(
                f"Check one size below ($T = {fmt.tex_int(below['seq_len'])}$): measured "
                f"{fmt.sig(below['measured_MiB'], 4)} MiB before backward, predicted "
                f"{fmt.sig(below['predicted_MiB'], 4)} MiB."))
    return [
        question(d, "timings", "Forward and backward time and memory of naive attention (batch 8, one head) over "
                 "$d \\in \\{16, 32, 64, 128\\}$ and sequence lengths 256–16384.", [
                     t_text,
                     d.table("grid_forward_ms", frame=(forward := _grid(d, "forward_mean_ms")),
                             caption="Forward time (ms) by head size (rows) and sequence length (columns)"
                             + ("; OOM: out of memory." if forward is not None and
                                forward.astype(str).isin(["OOM"]).any().any() else ".")),
                     d.table("grid_backward_ms", frame=_grid(d, "backward_mean_ms"), caption="Backward time (ms)."),
                     d.table("grid_memory_before_backward_MiB", caption="Memory in use before the backward pass "
                             "(MiB)."),
                 ], what="the attention sweep"),
        question(d, "memory", "Memory accounting for the smallest configuration that runs out of memory, and how "
                 "to remove that cost.", [
                     _which_size(acc, d.meta("oom_accounting").get("device")) if isinstance(acc, dict)
                     and "terms_MiB" in acc else None,
                     Text("Just before the backward pass, eager attention holds per batch element three $T\\times T$ "
                          "fp32 tensors saved for it (the masked scores $\\mathrm{mask}(QK^\\top/\\sqrt{d})$, their "
                          "exponentials, and the probabilities $P$), the row max and sum, and $Q, K, V$ (saved), the "
                          "output $O$ and the upstream gradient $dO$ (live, not saved; $T\\times d$ each); and one "
                          "boolean $T\\times T$ causal mask for the batch:"),
                     Equation([r"M_{\mathrm{before\ backward}}(B, T, d) = 4B\,(3T^2 + 2T + 5Td) + T^2\ "
                               r"\mathrm{bytes}."]),
                     *acc_blocks,
                     peak,  # why it runs out of memory although the saved tensors fit
                     Text("The $T^2$ terms dominate: doubling $T$ quadruples the memory, whatever $d$. "
                          "FlashAttention removes them by recomputing $S$ and $P$ tile by tile in the backward pass "
                          "and saving, beyond its inputs $Q, K, V$, only $O$ and the row-wise log-sum-exp $L$ "
                          "($T$ values), so the saved memory becomes linear in $T$." + (" The appendix checks the formula against every cell of "
                                                       "the grid." if d.frame("memory_accounting") is not None
                                                       else "")),
                 ], what=None if acc_blocks else "the memory accounting"),
        Text("", role=BEYOND_HANDOUT),  # the plot of the grid and the accounting checked cell by cell
        question(d, "timings", "The grid plotted.", [
            d.figure("attention_grid", caption="Forward and backward time and memory over the grid."),
            Text("Full timings with standard deviations: `timings.csv` in this section's results folder.")
            if timings is not None else None]),
        question(d, "memory", "The memory formula against every cell of the grid.", [
            d.table("memory_accounting", caption="Predicted vs. measured memory before backward.")]),
    ]



SECTION = Section(
    name="pytorch_attention", number="1.2.1", title="Benchmarking PyTorch attention", problems=("pytorch_attention",),
    answer=answer, presets=PRESETS, run=run, derive=derive, derive_inputs=("timings", "oom_accounting"),
    depends=(*MODEL, *TIMING, "cs336_systems/benchmarking/attention.py"),
)
