"""§1.1.7 Autograd residuals and gradient checkpointing (the 2026 handout's §3, "Single-GPU memory").

Two measurements on the 2026 handout's xl shape (d_model 2560, d_ff 10240, 32 layers, 32 heads; batch 4,
context 2048, float32):

- ``residuals``: what one TransformerBlock saves for backward, tensor by tensor, through
  ``torch.autograd.graph.saved_tensors_hooks`` (:mod:`cs336_systems.profiling.residuals`), eager and under
  ``torch.compile``, grouped by the op that produced each tensor (``residuals_by_op``).
- ``checkpointing``: the peak memory and time of a full training step (forward, backward, AdamW) with the
  blocks checkpointed in flat segments of ``k`` blocks (:func:`cs336_systems.checkpointing.checkpoint_layers`),
  for every ``k`` in ``block_sizes`` (0: no checkpointing), next to the calculator's count of block-activation
  sets held at the peak (:func:`~cs336_systems.checkpointing.stored_block_activations`).

- ``backward_by_block``: the memory allocated as the backward pass enters and leaves each block of a model of
  that block shape: the drop across a block is what it saved for backward less the gradients its backward writes.

Problems ``gradient_checkpointing`` (and ``memory_profiling`` (f) of 2026, from the residual and backward tables).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from cs336_systems.benchmarking.end_to_end import default_device
from cs336_systems.benchmarking.sweep import CPU_NOTE, OK, free_memory, run_sweep
from cs336_systems.configs import ModelConfig, get_config
from cs336_systems.derived import Derived
from cs336_systems.experiments.section import Section, check_positive, param
from cs336_systems.measured_code import MODEL
from cs336_systems.plotting import measured_on
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params:
    preset: str = param("xl@2026", "model preset (2026's xl: d_model 2560, d_ff 10240, 32 layers, 32 heads)")
    batch_size: int = param(4, "sequences per step")
    context_length: int = param(2048, "tokens per sequence")
    attention: str = param("naive", "registered attention of the model (the handout's model: naive)")
    block_sizes: list[float] = param([0, 0.5, 1, 2, 4, 8, 16, 32],
                                     "checkpoint segment sizes in blocks (0: none; 0.5: each block's attention and "
                                     "feed-forward branches checkpointed separately)")
    backward_layers: int = param(4, "blocks of the model whose backward is traced block by block (the preset's "
                                    "block shape, batch and context; the whole preset does not fit without "
                                    "checkpointing)")
    top: int = param(5, "producing ops listed per residual table")
    budget_s: float = param(480.0, "time budget of the checkpointing sweep")

    def config(self) -> ModelConfig:
        return get_config(self.preset, context_length=self.context_length, batch_size=self.batch_size)

    def check(self) -> None:
        from cs336_basics.model import available_attention_impls

        self.config()  # unknown presets and impossible shapes fail in one line
        check_positive(top=self.top, budget_s=self.budget_s, backward_layers=self.backward_layers)
        if self.attention not in available_attention_impls():
            raise ValueError(f"unknown attention {self.attention!r}; available: {available_attention_impls()}")
        bad = [k for k in self.block_sizes if k != SUBLAYER and (k < 0 or k != int(k))]
        if bad:
            raise ValueError(f"block sizes are whole blocks >= 0 (0: no checkpointing) or {SUBLAYER} (by sublayer), "
                             f"got {bad[0]:g}")


#: The block size that stands for checkpointing each block's two residual branches on their own.
SUBLAYER = 0.5


PRESETS = {
    "full": Params(),
    "quick": Params(block_sizes=[0, 4, 8], budget_s=240.0),
    "smoke": Params(preset="tiny", batch_size=2, context_length=16, block_sizes=[0, 0.5, 1, 2], backward_layers=2,
                    budget_s=60.0),
}


def block_residuals(p: Params, device: torch.device, compiled: bool) -> pd.DataFrame:
    """Every tensor one TransformerBlock of ``p``'s shape saves for backward (eager or compiled)."""
    from cs336_basics.model import RotaryEmbedding, TransformerBlock

    from cs336_systems.profiling.residuals import saved_residuals

    cfg = p.config()
    rope = RotaryEmbedding(cfg.context_length, cfg.d_head, cfg.rope_theta, device=device)
    block = TransformerBlock(cfg.d_model, cfg.num_heads, cfg.d_ff, rope, p.attention, device=device)
    x = torch.randn(cfg.batch_size, cfg.context_length, cfg.d_model, device=device, requires_grad=True)
    if compiled:
        fn = torch.compile(block)
        fn(x)  # compile outside the hooks
        outside = (x, *block.parameters(), *block.buffers(), *rope.buffers())
        table = saved_residuals(lambda: fn(x), producers=False, outside=outside)
    else:
        table = saved_residuals(lambda: block(x))
    torch._dynamo.reset()  # the compiled graph holds the block
    return table


def backward_by_block(p: Params, device: torch.device) -> pd.DataFrame:
    """Memory allocated when the backward pass enters and leaves each block of a ``p.backward_layers``-block
    model of ``p``'s block shape, batch and context (fp32, one forward and backward): the handout's "how much
    memory usage changes for every TransformerBlock in the backward pass", read from the caching allocator in
    module backward hooks where Nsight would read it between NVTX ranges.

    Across one block the allocated memory drops by what the block saved for backward, its input included, less
    the gradients its backward writes: its weights' (kept until ``zero_grad``) and its input's. The input's
    gradient counts because the leaving hook receives the output's gradient as an argument: both are alive when
    it reads the allocator, and the output's is freed only after the hook returns."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy

    cfg = p.config()
    model = BasicsTransformerLM(**{**cfg.model_kwargs(), "num_layers": p.backward_layers},
                                attention_impl=p.attention, device=device)
    cuda = device.type == "cuda"
    marks: dict[tuple[int, str], float] = {}

    def mark(i: int, when: str) -> None:
        marks[(i, when)] = torch.cuda.memory_allocated(device) if cuda else float("nan")

    for i, block in enumerate(model.layers):
        block.register_full_backward_pre_hook(lambda m, g, i=i: mark(i, "start"))
        block.register_full_backward_hook(lambda m, gi, go, i=i: mark(i, "end"))
    shape = (cfg.batch_size, cfg.context_length)
    inputs = torch.randint(0, cfg.vocab_size, shape, device=device)
    targets = torch.randint(0, cfg.vocab_size, shape, device=device)
    cross_entropy(model(inputs), targets).backward()
    rows = [{"block": i, "start_MiB": marks[(i, "start")] / 2**20, "end_MiB": marks[(i, "end")] / 2**20}
            for i in reversed(range(p.backward_layers))]
    table = pd.DataFrame(rows)
    table["drop_MiB"] = table["start_MiB"] - table["end_MiB"]
    del model
    return table


def checkpointed_step(p: Params, block_size: float, device: torch.device) -> dict[str, Any]:
    """Peak memory (of the second step, after AdamW's state exists) and time of one training step: our
    stack of :class:`~cs336_systems.benchmarking.train_step.TrainStep` in float32, its blocks checkpointed in
    segments of ``block_size`` (0: none; :data:`SUBLAYER`: each block branch by branch). The forward and
    backward's own peak is read as the optimizer step begins: checkpointing changes that one, while the whole
    step's peak may come in the optimizer step, from the gradients and AdamW's temporaries."""
    from cs336_systems.benchmarking.train_step import StepSpec, TrainStep
    from cs336_systems.checkpointing import checkpoint_layers, stored_block_activations

    by_sublayer = block_size == SUBLAYER
    levels = (int(block_size),) if block_size and not by_sublayer else ()
    cuda = device.type == "cuda"
    # allocated before this configuration exists: what earlier parts of the job left behind, counted in every
    # "held between steps" below and owned by no configuration
    leftover = torch.cuda.memory_allocated(device) if cuda else float("nan")
    spec = StepSpec(p.preset, p.context_length, p.batch_size, "fp32", attention=p.attention, checkpoint=levels)
    run = TrainStep("ours", spec, device)
    if by_sublayer:  # the same blocks, run branch by branch; parameters and optimizer unchanged
        checkpoint_layers(run.model, [], sublayers=True)
    run.step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    backward_peak: list[float] = []

    def optimizer_begins(*_: Any) -> None:
        backward_peak.append(torch.cuda.max_memory_allocated(device) if cuda else float("nan"))

    hook = run.optimizer.register_step_pre_hook(optimizer_begins)
    t0 = time.perf_counter()
    run.step()
    if cuda:
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    hook.remove()
    peak = torch.cuda.max_memory_allocated(device) if cuda else float("nan")
    return {"levels": "by sublayer" if by_sublayer else str(list(levels)),
            "held_block_activations": float("nan") if by_sublayer else
            stored_block_activations(p.config().num_layers, list(levels)),
            "step_ms": ms, "peak_GiB": peak / 2**30,
            "activation_peak_GiB": (peak - before) / 2**30 if cuda else float("nan"),
            "backward_peak_GiB": backward_peak[0] / 2**30,
            "leftover_GiB": leftover / 2**30}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The checkpointing sweep, then the residuals of one block (eager and compiled) and the backward read block
    by block. The sweep runs first, on an empty GPU: the residual measurement leaves memory allocated, which every
    configuration's peak would otherwise carry."""
    device = default_device()
    cfg = p.config()
    extra = {"model": cfg.name, "shape": [cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads],
             "batch_size": p.batch_size, "context_length": p.context_length}
    result: dict[str, Any] = {}
    wide = run_sweep(lambda block_size: checkpointed_step(p, block_size, device),
                     [{"block_size": k} for k in p.block_sizes], desc="checkpointing", budget_s=p.budget_s)
    out.table(wide, "checkpointing", extra=extra)
    result["checkpointing"] = wide
    free_memory()
    for compiled in (False, True):
        name = "residuals_compiled" if compiled else "residuals"
        table = block_residuals(p, device, compiled)
        out.table(table, name, extra=extra)
        result[name] = table
        free_memory()
    result["backward_by_block"] = backward_by_block(p, device)
    out.table(result["backward_by_block"], "backward_by_block", extra=extra)
    free_memory()
    if device.type != "cuda":
        print(CPU_NOTE)
    elif (wide["status"] == OK).any():
        fig = plot_checkpointing(wide)
        out.figure(fig, "checkpointing")
        plt.close(fig)
    return result


def plot_backward_by_block(table: pd.DataFrame, meta: dict[str, Any] | None = None) -> plt.Figure:
    """Allocated memory as the backward enters and leaves each block, in the order it runs (last block first):
    the drop across a block is what it saved less the gradients its backward leaves."""
    rows = table.reset_index(drop=True)
    x = [i + dx for i in range(len(rows)) for dx in (0.0, 0.8)]
    y = [v / 1024 for _, r in rows.iterrows() for v in (r["start_MiB"], r["end_MiB"])]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(x, y, marker="o")
    for i, r in rows.iterrows():
        ax.annotate(f"−{r['drop_MiB'] / 1024:.2f} GiB", (i + 0.4, (r["start_MiB"] + r["end_MiB"]) / 2048),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + 0.4 for i in range(len(rows))], [f"block {int(b)}" for b in rows["block"]])
    ax.set(xlabel="backward pass, in the order it runs", ylabel="allocated memory (GiB)",
           title=f"Memory across each block's backward, {measured_on(meta)}")
    fig.tight_layout()
    return fig


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """§1.1.7's per-block backward plot from its ``backward_by_block`` table."""
    table = tables.get("backward_by_block")
    if table is None or not {"block", "start_MiB", "end_MiB", "drop_MiB"} <= set(table.columns) \
            or not table["drop_MiB"].notna().any():
        return Derived()
    return Derived(figures={"backward_memory": (plot_backward_by_block(table, meta), "backward_by_block")})


def plot_checkpointing(wide: pd.DataFrame) -> plt.Figure:
    """Peak memory and step time against the checkpoint segment size."""
    ok = wide[wide["status"] == OK]
    labels = ["none" if k == 0 else "½" if k == SUBLAYER else f"{k:g}" for k in ok["block_size"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(labels, ok["peak_GiB"])
    a.set(xlabel="blocks per checkpoint segment (½: by sublayer)", ylabel="peak memory (GiB)")
    b.bar(labels, ok["step_ms"], color="tab:orange")
    b.set(xlabel="blocks per checkpoint segment", ylabel="step time (ms)")
    fig.tight_layout()
    return fig


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.configs import param_counts  # noqa: E402
from cs336_systems.report import fmt  # noqa: E402
from cs336_systems.report.answers import join_words, ok_rows, question, step_mfu, subset  # noqa: E402
from cs336_systems.report.data import SectionData  # noqa: E402
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Text  # noqa: E402
# answers only; the names table stays reachable here, where the residuals answer is read and tested
from cs336_systems.experiments.residual_names import (  # noqa: E402, F401
    SAVED_AS as _SAVED_AS, saved_as as _saved_as, tied_with_last as _tied_with_last)


def _top(d: SectionData, name: str, top: int = 5) -> tuple[pd.DataFrame | None, float | None]:
    from cs336_systems.profiling.residuals import residuals_by_op

    table = d.frame(name)
    if table is None or "bytes" not in table.columns:
        return None, None
    by = residuals_by_op(table)
    return by.head(top), float(by["bytes"].sum())


def answer(d: SectionData) -> list[Block]:
    top, total = _top(d, "residuals")
    _, total_c = _top(d, "residuals_compiled")
    res_text = None
    if top is not None and len(top):
        ops = ", ".join(f"{r['op']}{_saved_as(str(r['op']), d.frame('residuals'), d.meta('residuals'))} "
                        f"{fmt.sig(r['bytes'] / 2**20)} MiB "
                        f"({r['share']:.0%})" for _, r in top.iterrows())
        tied = _tied_with_last(d.frame("residuals"), top)
        res_text = Text(f"One block saves {fmt.sig(total / 2**20)} MiB for backward (its input and weights "
                        f"excluded); the largest producers are {ops}{tied}."
                        + (f" Compiled with `torch.compile`, the same block saves {fmt.sig(total_c / 2**20)} MiB."
                           if total_c else "") + _against_the_snippet(d.meta("residuals")))
    grad_text = _gradients_text(d.meta("residuals"), total)
    measured = _measured_gradients(d.frame("backward_by_block"), d.meta("backward_by_block"), total,
                                   _block_input_bytes(d.frame("residuals")))
    parts = _best_segment_parts(d.frame("checkpointing"), total, _block_input_bytes(d.frame("residuals")),
                                (d.meta("checkpointing").get("params") or {}).get("preset"))
    # (b) in the handout's form, its answer first: the best strategy's measured peak and its neighbours', then
    # the reasoning and hypothesis that predicted it, and the verdict; the accounting of the peak, the growth per
    # block and where the peak sits go to the appendix
    order = ("peak_only", "neighbours", "reasoning", "verdict")
    best_text = None if parts is None else Text(" ".join(parts[x].strip() for x in order if parts[x].strip()))
    best_detail = None if parts is None or not (parts["measured"] or parts["shown"]) else Text(
        (parts["heads"] + parts["measured"] + parts["shown"]).strip())
    sweep = ok_rows(d.frame("checkpointing"))
    return [
        question(d, "residuals", "What one TransformerBlock saves for backward: the five largest producing "
                 "ops and their share, eager and compiled.", [
            res_text,
            # the gradients, expected and measured, are one paragraph (the handout allows two in all)
            Text(grad_text.markdown + " " + measured.markdown) if grad_text is not None and measured is not None
            else grad_text or measured,
            d.figure("backward_memory", caption="Allocated memory as the backward pass enters and leaves each block "
                     "(read in module backward hooks, where Nsight Systems would show it between NVTX ranges).")
            if measured is not None else None,
            d.table("residuals", caption="The largest producing ops of what one block saves for backward (eager); "
                    "residuals.csv lists every tensor.",
                    frame=top if top is not None else None),
        ], what="the residual table"),
        question(d, "gradient_checkpointing (a)", "The checkpointing strategy that minimizes peak activation memory, "
                 "its asymptotic memory and compute.", [
            Text("Ignoring compute, chain the checkpoints so that every block's input is recomputed from the "
                 "model's input: the last block runs on a checkpoint of the first $N-1$, which runs on a checkpoint "
                 "of the first $N-2$, and so on. Every level saves the same tensor, the model's input, so the "
                 "backward holds that input, one block's residuals and the gradient flowing back: $O(1)$ blocks' "
                 "activations, for $O(N^2)$ block forwards (block $i$'s input is recomputed from the start for "
                 "each $i$). Cheaper schedules keep more: binary nesting (checkpoint each half, recursively) holds "
                 "$O(\\log N)$ inputs for $O(N \\log N)$ forwards, one level of segments of $\\sqrt{N}$ blocks "
                 "$O(\\sqrt{N})$ for one extra forward."),
            Text("    def run(blocks, x):  # blocks[-1](...blocks[0](x)), each input recomputed from x\n"
                 "        if len(blocks) == 1:\n"
                 "            return blocks[0](x)\n"
                 "        h = checkpoint(run, blocks[:-1], x, use_reentrant=False)\n"
                 "        return blocks[-1](h)\n\n"
                 "    y = checkpoint(run, blocks, x, use_reentrant=False)"),
        ]),
        question(d, "gradient_checkpointing (b)", "The xl model, batch 4, context 2048, one level of recomputation: the "
                 "best segment size, and the peak memory of it and of its neighbours.", [
            best_text,
            d.table("checkpointing", frame=(shown := _shown_sweep(d)),
                    caption="A full training step (forward, backward, AdamW) per checkpoint segment: none, each "
                            "block's two branches apart (sublayer) or k blocks: the step's peak memory, its part "
                            "above what is held between steps (the gradients included)"
                            + (", the forward and backward's own peak"
                               if "fwd_bwd_peak_GiB" in getattr(shown, "columns", ()) else "")
                            + "; MFU counts the model's FLOPs, not the recomputation, against the FP32 peak."),
            # one fitting size makes a plot of one point: the table says it all
            d.figure("checkpointing", caption="Peak memory and step time against the segment size.")
            if len(sweep) > 1 else None,
        ], what="the checkpointing sweep"),
        *([Text("", role=BEYOND_HANDOUT),
           question(d, "gradient_checkpointing (b)", "The best segment's peak, accounted for, and where it sits.",
                    [best_detail])] if best_detail is not None else []),
    ]


#: Peaks closer than this (a MiB) were set by the same tensors at the same moment of the step.
SAME_PEAK_GIB = 2**-10

#: The heads of the block in the 2026 handout's residual snippet (§3.2), which reports 3,651 MiB compiled.
SNIPPET_HEADS = 16


def _against_the_snippet(meta: dict | None) -> str:
    """Why the compiled block saves more than the handout's snippet says: the snippet builds it with 16 heads,
    the handout's model table (and this run) with more, and every batch × heads × T² tensor scales with them."""
    shape = ((meta or {}).get("extra") or {}).get("shape") or []
    if len(shape) != 4 or int(shape[3]) == SNIPPET_HEADS:
        return ""
    return (f" The handout's snippet (3,651 MiB compiled) builds the block with {SNIPPET_HEADS} heads; the model "
            f"table's xl, measured here, has {int(shape[3])}, and every batch × heads × context² tensor grows with "
            "the heads.")


def _block_params(preset: str) -> int:
    """Parameters of one block of ``preset``: attention projections, SwiGLU and two RMSNorm gains."""
    cfg = get_config(preset)
    return 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model


def _gradients_text(meta: dict | None, residual_bytes: float | None) -> Text | None:
    """(f)'s second half: one block's fp32 gradients beside what it saves for backward, and whether that is
    what the shapes predict."""
    params = (meta or {}).get("params") or {}
    if not residual_bytes or not params.get("preset"):
        return None
    n = _block_params(params["preset"])
    grads = 4 * n
    batch, context = params.get("batch_size"), params.get("context_length")
    if batch is None or context is None:
        return None
    return Text(rf"Its gradients: the block has $4d^2 + 3\,d\,d_{{ff}} + 2d$ = {n:,} parameters, so backward "
                f"writes {fmt.sig(grads / 2**20)} MiB of fp32 gradients for it at any batch and context; what it "
                f"saves is {fmt.sig(residual_bytes / grads, 2)}× that at batch {batch} × {context} tokens. As "
                r"expected: the saved activations grow with $B \cdot T$ (the naive attention's scores and "
                r"probabilities with $B \cdot h \cdot T^2$), the gradients only with the parameters, so at "
                "training batch and context the activations dominate.")


def _measured_gradients(table: pd.DataFrame | None, meta: dict | None, saved_bytes: float | None,
                        input_bytes: float | None) -> Text | None:
    """(f)'s measurement: how much the allocated memory drops as backward crosses a block, and the gradients
    that implies (what the block saved, its input included, less the drop), against its weights' gradients."""
    params = (meta or {}).get("params") or {}
    if table is None or "drop_MiB" not in table.columns or not table["drop_MiB"].notna().any() \
            or not saved_bytes or not input_bytes or not params.get("preset"):
        return None
    weights = 4 * _block_params(params["preset"]) / 2**20
    drop = float(table["drop_MiB"].median())
    freed = (saved_bytes + input_bytes) / 2**20
    written = freed - drop
    expected = weights + input_bytes / 2**20
    off = abs(written / expected - 1)
    verdict = (f"and the measurement is within {'1%' if off < 0.01 else fmt.pct(off)} of it" if off <= 0.1
               else f"and the measurement is {fmt.ratio(written / expected)} of that, more than they account for")
    return Text(f"Measured: as the backward pass of a {len(table)}-block model of this shape crosses a block, the "
                f"allocated memory drops by {fmt.sig(drop)} MiB (median over the blocks, "
                f"{fmt.sig(float(table['drop_MiB'].min()))}–{fmt.sig(float(table['drop_MiB'].max()))}). Nsight "
                "Systems is not installed on these machines, so in place of its screenshots the caching allocator "
                "is read in module backward hooks as the backward enters and leaves each block (the figure). "
                f"The block had saved {fmt.sig(freed)} MiB, its {fmt.sig(input_bytes / 2**20)} MiB input included, "
                f"so its backward left {fmt.sig(written)} MiB of gradients behind. Expected: its weights' "
                f"{fmt.sig(weights)} MiB, plus its input's {fmt.sig(input_bytes / 2**20)} MiB gradient, which the "
                "reading includes because the hook that reads the memory as the backward leaves the block still "
                "holds the gradient of the block's output (freed once the hook returns): "
                f"{fmt.sig(expected)} MiB, {verdict}.")


def _with_mfu(d: SectionData) -> pd.DataFrame | None:
    """The sweep with MFU (fp32, as this section trains) when its record names the model preset."""
    frame, meta = d.frame("checkpointing"), d.meta("checkpointing")
    params = meta.get("params") or {}
    if frame is None or not params.get("preset"):
        return frame
    return step_mfu(frame, meta, model=params["preset"], batch=params.get("batch_size"),
                    context=params.get("context_length"), precision="fp32")


def _block_input_bytes(residuals: pd.DataFrame | None) -> float | None:
    """The block input's size: the saved (batch, sequence, d_model) tensor that no op of the block produced."""
    if residuals is None or not {"op", "shape", "bytes"} <= set(residuals.columns):
        return None
    inputs = residuals[(residuals["op"] == "(input or parameter)") & (residuals["shape"].str.count(",") == 2)]
    return float(inputs["bytes"].max()) if len(inputs) else None


def _segment_name(k: float, short: bool = False) -> str:
    if k == 0:
        return "no checkpointing"
    if k == SUBLAYER:
        return "checkpointing by sublayer" if short else ("each block by sublayer (its attention and feed-forward branches "
                                            "checkpointed separately)")
    return f"segments of {k:g} block{'s' if k != 1 else ''}"


#: Two peaks closer than this share are a tie: the sweep runs each configuration once.
TIE = 0.01
#: A row whose memory resident between steps differs from the other rows' by more than this (GiB) carries
#: leftovers of another configuration (an out-of-memory run before it) and is compared on its step's own memory.
RESIDENT_SLACK_GIB = 1.0


def _best_segment_parts(table: pd.DataFrame | None, block_bytes: float | None = None,
                        input_bytes: float | None = None, preset: str | None = None) -> dict[str, str] | None:
    """The direct answer to (b), in the handout's form: the reasoning, the measured strategy's peak, and its
    neighbours in the sweep.

    Configurations are compared on the memory allocated during the step above what is resident between steps
    (``activation_peak_GiB``): that is what checkpointing changes, and it is immune to a row whose resident memory
    still held another configuration's tensors. Peaks closer than :data:`TIE` are a tie."""
    sweep = ok_rows(table)
    if sweep.empty or not sweep["activation_peak_GiB"].notna().any():
        return None
    resident = sweep["peak_GiB"] - sweep["activation_peak_GiB"]
    usual = float(resident.median())
    clean = (resident - usual).abs() <= RESIDENT_SLACK_GIB
    best = sweep.loc[sweep["activation_peak_GiB"].idxmin()]
    tied = sweep[(sweep["activation_peak_GiB"] <= best["activation_peak_GiB"] * (1 + TIE)) & (sweep.index != best.name)]
    if not tied.empty and not clean[best.name]:
        best, tied = tied.iloc[0], sweep.loc[[best.name]]  # lead the tie with the row whose peak is clean
    k = float(best["block_size"])

    reasoning, optimum = "", float("inf")
    if block_bytes and input_bytes and preset:
        optimum = (get_config(preset).num_layers * input_bytes / block_bytes) ** 0.5
        reasoning = (f"Segments of $k$ blocks hold $N/k$ block inputs of {fmt.sig(input_bytes / 2**20)} MiB plus, "
                     f"while one segment is recomputed, $k$ blocks' residuals of {fmt.sig(block_bytes / 2**20)} MiB "
                     "each, on top of the weights, the AdamW state and the gradients, which no segment size changes; "
                     f"the sum is least at $k^* = \\sqrt{{N \\cdot {input_bytes / 2**20:.0f} / "
                     f"{block_bytes / 2**20:.0f}}}$ = {optimum:.2f}, "
                     + ("below one block, so the finest split should give the lowest peak. Hypothesis: splitting "
                        "each block too, its attention and feed-forward branches checkpointed separately (two inputs "
                        "per block, half a block recomputed at a time), peaks lower than one block per segment. "
                        if optimum < 1
                        else "rounded to a whole block. "))
    heads_note = ""
    if preset and get_config(preset).num_heads != SNIPPET_HEADS:
        heads_note = (f"This is the model table's xl, with {get_config(preset).num_heads} heads (the snippet's block "
                      f"has {SNIPPET_HEADS}). ")
    held = float(resident[best.name])
    state = 12 * param_counts(preset)["total"] / 2**30 if preset else None
    left = float(best["leftover_GiB"]) if "leftover_GiB" in best and pd.notna(best["leftover_GiB"]) else None
    other = held - state if state is not None else 0.0
    owned = "" if state is None else (
        f" (the fp32 weights and AdamW state are {fmt.sig(state)} GiB of it" +
        ("" if other <= RESIDENT_SLACK_GIB else
         f", and {fmt.sig(left)} GiB were allocated before this configuration's model was built, by the "
         "measurement of one block's residuals that ran first in the same process; without them the peak is "
         f"{fmt.sig(best['peak_GiB'] - left)} GiB" if left is not None and abs(left - other) <= RESIDENT_SLACK_GIB else
         f", the other {fmt.sig(other)} GiB are neither the model's nor the optimizer's") +
        "; the gradients are allocated during the step)")
    group = [k, *(float(x) for x in tied["block_size"])]
    names = join_words([_segment_name(x, short=True) for x in sorted(group, key=_memory_order)])
    identical = not tied.empty and float((tied["peak_GiB"] - best["peak_GiB"]).abs().max()) < SAME_PEAK_GIB
    lead = (f"Best, measured: {_segment_name(k)}, a peak" if tied.empty else
            f"Best, measured: {names}, which peak identically; {_segment_name(k, short=True)}, a peak" if identical
            else f"Best, measured: {names}, within {TIE:.0%} of each other; {_segment_name(k, short=True)}, a peak")
    measured = (f"{lead} of {fmt.sig(best['peak_GiB'])} GiB, {fmt.sig(best['activation_peak_GiB'])} GiB of "
                f"it allocated during the step above the {fmt.sig(held)} GiB held between steps{owned}; one step "
                f"takes {fmt.sig(best['step_ms'] / 1e3)} s.")
    ordered = sorted((float(x) for x in table["block_size"]), key=_memory_order)
    inside = [i for i, x in enumerate(ordered) if x in group]
    neighbours = []
    for j in (min(inside) - 1, max(inside) + 1):
        if not 0 <= j < len(ordered):
            continue
        row = table[table["block_size"] == ordered[j]].iloc[0]
        name = _segment_name(ordered[j], short=True)
        if row["status"] != "ok":
            neighbours.append(f"{name}: out of memory")
        else:
            neighbours.append(f"{name}: a peak of {fmt.sig(row['peak_GiB'])} GiB "
                              f"({fmt.sig(row['activation_peak_GiB'])} GiB above what it held before the step)")
    for _, row in tied.iterrows():
        if not clean.get(row.name, True):
            position = list(table.index).index(row.name)
            before = table.iloc[position - 1]["status"] if position else "ok"
            neighbours.append(f"{_segment_name(float(row['block_size']), short=True)}'s own peak of "
                              f"{fmt.sig(row['peak_GiB'])} GiB is not comparable: it held "
                              f"{fmt.sig(resident[row.name] - usual)} GiB more between steps, left from the "
                              + ("out-of-memory run" if before != "ok" else "run") + " before it")
    said = f" {'Its' if tied.empty else 'Their'} neighbours: {'; '.join(neighbours)}." if neighbours else ""
    # what the measurement showed beyond the neighbours: the growth per block and where the peak is
    shown = _per_block(sweep, block_bytes)
    if SUBLAYER in group and len(group) > 1:
        shown += _where_the_peak_is(sweep[sweep["block_size"].isin(group)])
    elif reasoning and SUBLAYER not in set(ordered):
        shown += f" The sweep did not try the split below one block (block size {SUBLAYER:g})."
    timed = table[table["block_size"].isin(group) & (table["status"] == "ok")] if identical else best.to_frame().T
    timed = sorted(zip(timed["block_size"], timed["step_ms"]), key=lambda t: _memory_order(float(t[0])))
    step = "one step " + join_words([f"{fmt.sig(float(ms) / 1e3)} s" for _, ms in timed])  # in the names' order
    peak_only = (f"Best, measured: {names}, which peak identically at {fmt.sig(best['peak_GiB'])} GiB ({step})."
                 if identical else f"{lead} of {fmt.sig(best['peak_GiB'])} GiB ({step}).")
    return {"measured": measured, "peak_only": peak_only, "neighbours": said, "heads": heads_note,
            "reasoning": reasoning, "shown": shown,
            "verdict": _verdict(sweep, group, hypothesis=bool(reasoning) and optimum < 1)}


def _verdict(sweep: pd.DataFrame, group: list[float], hypothesis: bool) -> str:
    """The sublayer hypothesis's fate in one sentence, said only where the reasoning stated it (``hypothesis``),
    both strategies peak alike, and :func:`_peak_moment` puts that peak late in the backward (the appendix says
    where in full)."""
    if not hypothesis or SUBLAYER not in group or len(group) < 2:
        return ""
    tied = sweep[sweep["block_size"].isin(group)]
    if _peak_moment(tied) != "late backward" or float(tied["peak_GiB"].max() - tied["peak_GiB"].min()) >= SAME_PEAK_GIB:
        return ""
    return (" The measurement rejects the hypothesis: the peak comes late in the backward, where both strategies "
            "hold the same tensors, and splitting a block only lowers the memory earlier (the appendix shows where).")


def _peak_moment(tied: pd.DataFrame) -> str | None:
    """Where strategies that tie set the step's peak, from the forward and backward's own peak (read as the
    optimizer step begins): "optimizer" (every step peaks after its backward), "late backward" (the backward
    peaks are equal), "differs" (they are not); None where the sweep did not record them."""
    if "backward_peak_GiB" not in tied or not tied["backward_peak_GiB"].notna().all():
        return None
    if ((tied["peak_GiB"] - tied["backward_peak_GiB"]) > SAME_PEAK_GIB).all():
        return "optimizer"
    if float(tied["backward_peak_GiB"].max() - tied["backward_peak_GiB"].min()) < SAME_PEAK_GIB:
        return "late backward"
    return "differs"


def _per_block(sweep: pd.DataFrame, block_bytes: float | None) -> str:
    """What each further block per segment adds to the peak (the median over consecutive whole-block sizes that
    ran), against one block's residuals: equal, the peak is set while a segment is recomputed."""
    whole = sweep[sweep["block_size"] >= 1].sort_values("block_size")
    if len(whole) < 3:
        return ""
    slope = float((whole["peak_GiB"].diff() / whole["block_size"].diff()).median())
    sizes = f"{whole['block_size'].iloc[0]:g} to {whole['block_size'].iloc[-1]:g} blocks"
    residuals = f", about one block's residuals ({fmt.sig(block_bytes / 2**30)} GiB)" if block_bytes else ""
    return f" Each further block per segment adds {fmt.sig(slope)} GiB to the peak ({sizes}){residuals}."


def _memory_order(k: float) -> float:
    """Segment sizes from the least memory held to the most: by sublayer, 1, 2, ... blocks, then no checkpointing
    (one segment of every block)."""
    return float("inf") if k == 0 else k


def _where_the_peak_is(tied: pd.DataFrame) -> str:
    """Why strategies that hold different activations tie on the step's peak: where that peak comes (the forward
    and backward's own peak, read as the optimizer step begins, where the sweep recorded it)."""
    names = [_segment_name(float(k), short=True) for k in tied["block_size"]]
    moment = _peak_moment(tied)
    if moment is not None:
        peaks = join_words([f"{fmt.sig(v)} GiB ({n})" for n, v in zip(names, tied["backward_peak_GiB"])])
        if moment == "optimizer":  # the step's peak came after the backward
            return (" Their whole-step peaks tie because each comes in the optimizer step, where AdamW's update "
                    "allocates parameter-sized temporaries beside the gradients; the forward and backward, which "
                    f"checkpointing changes, peak at {peaks}.")
        if moment == "late backward":  # the same moment
            return (" The peak is set while the last segment is recomputed, late in the backward, when nearly "
                    "every gradient exists and most checkpoints are freed (a memory snapshot of each step puts "
                    "both peaks in the first block's attention backward): there the two hold the same tensors, that "
                    "block's input, its recomputed attention residuals and the attention backward's score-sized "
                    "temporaries. So the measurement rejects the hypothesis: splitting a block lowers the memory "
                    "earlier in the backward, not its peak.")
        return f" The forward and backward peak at {peaks}: at this shape splitting a block does not lower the peak."
    if float(tied["peak_GiB"].max() - tied["peak_GiB"].min()) < SAME_PEAK_GIB:  # within a MiB: the same moment of the step
        return (" Their peaks are equal to the MiB, so neither is set inside the checkpointed backward, which differs "
                "between them; the step's peak comes outside it, most likely in the optimizer step, where AdamW's "
                "update allocates parameter-sized temporaries beside the gradients. This sweep did not read the "
                "backward's own peak, so it cannot tell whether splitting a block lowers that one.")
    return " So at this shape splitting a block does not lower the step's peak."


def _shown_sweep(d: SectionData) -> pd.DataFrame | None:
    """The sweep as (b)'s table shows it: segments named, the peak above what is held between steps (gradients
    included, so not "activations") and the forward and backward's own peak where recorded, and MFU."""
    frame = _segment_labels(subset(_with_mfu(d), "block_size", "status", "peak_GiB", "activation_peak_GiB",
                                   "backward_peak_GiB", "step_ms", "MFU_pct"))
    if frame is None:
        return None
    ran = frame.dropna(subset=["peak_GiB", "backward_peak_GiB"]) if "backward_peak_GiB" in frame else frame.iloc[:0]
    if len(ran) and ((ran["peak_GiB"] - ran["backward_peak_GiB"]).abs() < SAME_PEAK_GIB).all():
        frame = frame.drop(columns="backward_peak_GiB")  # the step peaked in its forward and backward: no new column
    return frame.rename(columns={"activation_peak_GiB": "above_held_GiB", "backward_peak_GiB": "fwd_bwd_peak_GiB"})


def _segment_labels(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """The segment size as a reader names it: "none", "sublayer" or a number of blocks."""
    if frame is None or "block_size" not in frame:
        return frame
    words = ["none" if k == 0 else "sublayer" if k == SUBLAYER else f"{k:g} block{'s' if k != 1 else ''}"
             for k in frame["block_size"]]
    return frame.assign(block_size=words).rename(columns={"block_size": "segment"})


SECTION = Section(
    name="gradient_checkpointing", number="1.1.7",
    title="Autograd residuals and gradient checkpointing (2026 handout)",
    problems=("gradient_checkpointing", "memory_profiling (f), 2026"), answer=answer, presets=PRESETS, run=run,
    derive=derive, derive_inputs=("backward_by_block",),
    depends=(*MODEL, "cs336_systems/checkpointing.py", "cs336_systems/profiling/residuals.py",
             "cs336_systems/benchmarking/sweep.py"),
)
