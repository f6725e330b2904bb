"""§3 Optimizer-state sharding: memory and time per training step of DDP + AdamW with

- ``adamw``: every rank keeps the full AdamW state (plain ``torch.optim.AdamW``);
- ``sharded``: our :class:`~cs336_systems.distributed.sharded_optimizer.ShardedOptimizer`;
- ``zero``: PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer`` (the built-in equivalent),

all on the same ``torch.nn.parallel.DistributedDataParallel`` gradient sync, in one run.

Memory is measured at three points of a steady-state step — after model and optimizer construction,
just before ``optimizer.step()`` (after backward), just after it — as the CUDA allocator's current and
peak allocation, and broken down by counting tensors: parameters, gradients, optimizer state, and the
activations saved by the forward pass (allocation growth during forward). The same breakdown is
predicted by :func:`cs336_systems.accounting.training_memory_per_rank`. The measurement itself is
:mod:`cs336_systems.benchmarking.training_memory`'s, shared with the FSDP section.

Problem ``optimizer_state_sharding_accounting``. Run (writes ``figures/optimizer_state_sharding/``, or
``.scratch/...`` for CPU smoke runs)::

    python -m cs336_systems.experiments optimizer_state_sharding --set nproc=2        # spawns 2 local ranks
    torchrun --nproc-per-node 2 -m cs336_systems.experiments.optimizer_state_sharding  # or under torchrun

Figures and derived tables (:func:`derive`) are written by the run itself and can be redrawn from the
committed tables on any machine with ``python -m cs336_systems.writeup replot optimizer_state_sharding``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems import accounting
from cs336_systems.distributed import launch, runner
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.experiments.section import Section, param
from cs336_systems.derived import Derived
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Text
from cs336_systems.benchmarking.training_memory import (
    GIB,
    BenchConfig,
    MemoryProbe,
    init_snapshot,
    measure_training,
    random_batch,
)
from cs336_systems.measured_code import MODEL
from cs336_systems.results import ResultWriter

SECTION_NAME = "optimizer_state_sharding"
OPTIMIZERS = ("adamw", "sharded", "zero")


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)
    if name == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


#: Which accounting strategy predicts each optimizer's memory.
PREDICTED_AS = {"adamw": "ddp", "sharded": "sharded_optimizer", "zero": "zero1"}


def sharding_worker(config: dict[str, Any], optimizers: list[str]) -> list[dict[str, Any]]:
    """On every rank: for each optimizer, build the model, wrap in DDP, measure; one row per optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    ctx = launch.current_context()
    cfg = BenchConfig(**config)
    mcfg = cfg.model_config()
    probe = MemoryProbe(ctx.device)
    rows = []
    for name in optimizers:
        probe.release()
        torch.manual_seed(0)
        from cs336_systems.configs import build_model

        model = build_model(mcfg, device=ctx.device)
        ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = make_optimizer(name, ddp.parameters(), cfg.lr)
        snapshot = init_snapshot(ctx.device)
        batch = random_batch(mcfg, cfg.per_rank_batch(ctx.world_size), ctx.device, seed=ctx.rank)
        measured = measure_training(
            ddp, optimizer, batch, ctx.device, warmup=cfg.warmup, steps=cfg.steps, after_init=snapshot
        )
        predicted = accounting.training_memory_per_rank(
            mcfg, PREDICTED_AS[name], ctx.world_size, cfg.per_rank_batch(ctx.world_size), cfg.context_length
        )
        rows.append(
            {
                "optimizer": name,
                "rank": ctx.rank,
                "world_size": ctx.world_size,
                **measured,
                **{f"predicted_{k}": v / GIB for k, v in predicted.items()},
            }
        )
        del model, ddp, optimizer, batch
    probe.release()
    return rows


def summarise(rows: list[dict[str, Any]]) -> tuple[Any, Any, Any]:
    """(per-rank memory table, long breakdown table for plots, timing table with ratios)."""

    df = pd.DataFrame(rows)
    memory_cols = [
        "optimizer", "rank", "after_init_allocated", "after_init_peak", "before_step_allocated",
        "before_step_peak", "after_step_allocated", "after_step_peak",
    ]
    memory = df[memory_cols]
    long = []
    for r in rows:
        for comp in ("parameters", "gradients", "optimizer_state", "activations"):
            long.append({"optimizer": r["optimizer"], "rank": r["rank"], "component": comp,
                         "source": "measured", "GiB": r[comp]})
            long.append({"optimizer": r["optimizer"], "rank": r["rank"], "component": comp,
                         "source": "predicted", "GiB": r[f"predicted_{comp}"]})
    breakdown = pd.DataFrame(long)
    timing = (
        df.groupby("optimizer", sort=False)
        .agg(step_ms=("step_ms", "max"), step_ms_std=("step_ms_std", "max"), world_size=("world_size", "first"))
        .reset_index()
    )
    base = timing.loc[timing.optimizer == "adamw", "step_ms"]
    timing["slowdown_vs_adamw"] = timing.step_ms / float(base.iloc[0]) if len(base) else float("nan")
    return memory, breakdown, timing


# --------------------------------------------------------------------------------------------------
# Derived tables and figures (pure functions of the memory / memory_breakdown / timing tables)
# --------------------------------------------------------------------------------------------------

OPTIMIZER_LABELS = {"adamw": "AdamW", "sharded": "our ShardedOptimizer", "zero": "torch ZeRO"}
#: The three points of a step where memory is read, as (column prefix, axis label).
MEMORY_POINTS = (("after_init", "after init"), ("before_step", "before step\n(after backward)"),
                 ("after_step", "after step"))


def plot_memory_points(memory: Any, meta: dict[str, Any] | None = None, rank: int = 0) -> Any:
    """Allocated (bars) and peak (black lines) memory of one rank at the three points of a step."""
    import matplotlib.pyplot as plt

    from cs336_systems.plotting import grouped_bars, measured_on

    r = memory[memory["rank"] == rank].set_index("optimizer")
    names = [o for o in OPTIMIZERS if o in r.index]
    allocated = pd.DataFrame({label: r.loc[names, f"{p}_allocated"] for p, label in MEMORY_POINTS}).T
    peak = pd.DataFrame({label: r.loc[names, f"{p}_peak"] for p, label in MEMORY_POINTS}).T
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    grouped_bars(ax, allocated.rename(columns=OPTIMIZER_LABELS), markers=peak.rename(columns=OPTIMIZER_LABELS),
                 marker_label="peak since the previous point")
    ax.set(xlabel="", ylabel=f"GiB on rank {rank}",
           title=f"Memory allocated (bars) and peak (lines) during a step\n{measured_on(meta)}{_run_text(meta)}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_memory_components(breakdown: Any, meta: dict[str, Any] | None = None, rank: int = 0) -> Any:
    """Measured (bars) vs predicted (black lines) per-rank memory of each component, per optimizer."""
    import matplotlib.pyplot as plt

    from cs336_systems.plotting import grouped_bars, measured_on

    b = breakdown[breakdown["rank"] == rank]
    components = list(dict.fromkeys(b["component"]))
    names = [o for o in OPTIMIZERS if o in set(b["optimizer"])]

    def wide(source: str) -> Any:
        w = b[b["source"] == source].pivot_table(index="component", columns="optimizer", values="GiB")
        return w.reindex(index=components, columns=names).rename(columns=OPTIMIZER_LABELS)

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    grouped_bars(ax, wide("measured"), markers=wide("predicted"), marker_label="predicted (accounting)",
                 value_fmt="{:.2f}")
    ax.set_xticks(ax.get_xticks(), [c.replace("_", " ") for c in components])
    ax.set(xlabel="", ylabel=f"GiB on rank {rank}",
           title=f"Memory by component: measured (bars) vs predicted (lines)\n{measured_on(meta)}{_run_text(meta)}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_step_time(timing: Any, meta: dict[str, Any] | None = None) -> Any:
    """Time per training step (slowest rank, mean ± std over steps) of each optimizer, labelled with its
    ratio to plain AdamW."""
    import matplotlib.pyplot as plt

    from cs336_systems.plotting import measured_on

    t = timing.set_index("optimizer").reindex([o for o in OPTIMIZERS if o in set(timing["optimizer"])])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    bars = ax.bar([OPTIMIZER_LABELS.get(o, o) for o in t.index], t["step_ms"], yerr=t["step_ms_std"], capsize=4,
                  color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(t)])
    ax.bar_label(bars, labels=[f"{ms:.1f} ms\n{x:.3f}x AdamW" for ms, x in zip(t["step_ms"], t["slowdown_vs_adamw"])],
                 label_type="center", color="white", fontsize=9)
    ax.set(ylabel="ms per step (slowest rank)",
           title=f"Training step time\n{measured_on(meta)}{_run_text(meta)}")
    fig.tight_layout()
    return fig


def savings_vs_adamw(breakdown: Any, timing: Any, rank: int = 0) -> Any:
    """Per optimizer: measured optimizer state on ``rank``, the memory it saves against plain AdamW, and
    its step time as a multiple of AdamW's."""
    b = breakdown[(breakdown["rank"] == rank) & (breakdown["source"] == "measured")]
    state = b[b["component"] == "optimizer_state"].set_index("optimizer")["GiB"]
    table = timing.set_index("optimizer")[["step_ms", "slowdown_vs_adamw"]].join(state.rename("optimizer_state_GiB"))
    table["saved_vs_adamw_GiB"] = state.get("adamw", float("nan")) - table["optimizer_state_GiB"]
    return table.reset_index()


def zero1_comparison(params: dict[str, Any]) -> Any:
    """Predicted per-rank bytes sent per step and memory held for DDP, our sharded optimizer and ZeRO-1
    with the run's model, batch, context and world size (:mod:`cs336_systems.accounting`)."""
    cfg = accounting.ladder_config(params["model"]).replace(context_length=params["context_length"])
    world_size = params["world_size"]
    rows = []
    for strategy in ("ddp", "sharded_optimizer", "zero1"):
        comm = accounting.communication_per_step(cfg, strategy, world_size)
        mem = accounting.training_memory_per_rank(cfg, strategy, world_size, params["global_batch"] // world_size,
                                                  params["context_length"])
        rows.append({"strategy": strategy, "GB_sent_per_rank": comm["total"] / 1e9,
                     "optimizer_state_GiB": mem["optimizer_state"] / GIB, "gradients_GiB": mem["gradients"] / GIB})
    return pd.DataFrame(rows)


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """Figures and derived tables of the ``optimizer_state_sharding`` section from its measured tables."""
    memory, breakdown, timing = tables["memory"], tables["memory_breakdown"], tables["timing"]
    derived = Derived(
        figures={
            "memory_components": (plot_memory_components(breakdown, meta), "memory_breakdown"),
            "step_time": (plot_step_time(timing, meta), "timing"),
        },
        tables={"savings_vs_adamw": (savings_vs_adamw(breakdown, timing), "memory_breakdown")},
    )
    if memory.drop(columns=["optimizer", "rank"]).notna().any().any():  # no allocator statistics on CPU
        derived.figures["memory_points"] = (plot_memory_points(memory, meta), "memory")
    params = meta.get("params") or {}
    if {"model", "context_length", "world_size", "global_batch"} <= set(params):
        derived.tables["zero1_comparison"] = (zero1_comparison(params), "memory")
    return derived


def _run_text(meta: dict[str, Any] | None) -> str:
    p = (meta or {}).get("params") or {}
    if "model" not in p:
        return ""
    return f"; {p['model']} model, {p.get('world_size', '?')} ranks, global batch {p.get('global_batch')}, context {p.get('context_length')}"


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    model: str = param("xl", "model preset (or a larger GPT-3-shaped size of accounting.SCALE_LADDER)")
    global_batch: int = param(4, "sequences per step, split evenly over the ranks")
    context_length: int = param(512, "tokens per sequence")
    warmup: int = param(3, "untimed steps")
    steps: int = param(10, "timed steps")
    optimizers: list[str] = param(list(OPTIMIZERS), f"of {', '.join(OPTIMIZERS)}")
    nproc: list[int] = param([2], "local world sizes, one run each (ignored under torchrun/srun); the first is the "
                                  "run the answers discuss, the others add tables tagged with their size")

    def bench_config(self) -> dict[str, Any]:
        return dict(model=self.model, global_batch=self.global_batch, context_length=self.context_length,
                    warmup=self.warmup, steps=self.steps)

    def check(self) -> None:
        bad = [o for o in self.optimizers if o not in OPTIMIZERS]
        if bad:
            raise ValueError(f"unknown optimizer {bad[0]!r}; optimizers: {', '.join(OPTIMIZERS)}")
        BenchConfig(**self.bench_config()).model_config()  # a bad preset fails here, in one line
        if not self.nproc or any(n < 2 for n in self.nproc) or len(set(self.nproc)) != len(self.nproc):
            raise ValueError(f"sharding needs distinct world sizes >= 2, got nproc={self.nproc}")
        bad = [n for n in self.nproc if self.global_batch % n]
        if bad:
            raise ValueError(f"global_batch {self.global_batch} does not split over nproc={bad[0]} ranks")


PRESETS = {
    "full": Params(),
    "quick": Params(warmup=2, steps=5),
    "smoke": Params(model="tiny", global_batch=4, context_length=32, warmup=1, steps=2),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """All optimizers on the ranks, one after the other, once per world size; rank 0 writes the tables (the
    first world size's untagged, the answers' run; the others' tagged ``_np<N>``)."""
    written: dict[str, Any] = {}
    runner.check_local_gpus(p.nproc, "drop the larger world sizes")
    for i, n in enumerate([None] if runner.launched_externally() else p.nproc):
        rows_per_rank = runner.run_on_ranks(sharding_worker, n or 0, p.bench_config(), list(p.optimizers))
        if not runner.is_main_process():
            return {}
        rows = [r for rank_rows in rows_per_rank for r in rank_rows]
        memory, breakdown, timing = summarise(rows)
        tag = "" if i == 0 else f"_np{rows[0]['world_size']}"
        if i == 0:
            out.params["world_size"] = rows[0]["world_size"]
        for name, table in (("memory", memory), ("memory_breakdown", breakdown), ("timing", timing)):
            # A tagged table records its own world size (the run's params hold the first one's).
            out.table(table, name + tag, params={"world_size": rows[0]["world_size"]} if tag else None)
            written[name + tag] = table
        print(f"world size {rows[0]['world_size']}:")
        print(memory.to_string(index=False))
        print(timing.to_string(index=False))
    return written


def main(argv: list[str] | None = None) -> int:
    """The torchrun / srun form: every rank runs this; the launcher fixes the process count."""
    from cs336_systems.experiments.__main__ import run_section

    return run_section(SECTION_NAME, None, {}, argv=list(sys.argv[1:] if argv is None else argv))


# === Answers: formatting only; changes below this line do not make results stale ===


from cs336_systems.report.answers import handout_model, implemented, mfu_note, spread, step_mfu, step_verdict  # noqa: E402  (answers only)


def _zero1_bytes_note(d: SectionData) -> str:
    """The table's volumes as the formulas give them at the run's world size (Ψ counted in fp32 bytes)."""
    params = d.meta("zero1_comparison").get("params") or {}
    world = params.get("world_size")
    return (f" The table evaluates these at $p = {int(world)}$ in bytes, fp32 gradients and parameters taking 4 bytes "
            f"per element: DDP and ZeRO-1 send ${2 * (world - 1) / world:g} \\cdot 4\\Psi$ bytes, ours "
            f"${3 * (world - 1) / world:g} \\cdot 4\\Psi$." if world else "")


#: Why these step times are not the DDP sections' (same model and batch, another optimizer implementation).
OPTIMIZER_NOTE = (" These steps use torch's default multi-tensor AdamW, which makes several passes over the "
                  "parameters and both moments, where the DDP sections step the fused one; so their times do not "
                  "compare with the DDP sections' step times.")


def _sharding_verdict(timing: pd.DataFrame) -> str:
    """What the step times show about sharding's cost, judged against the rows' step-to-step spread."""
    by = timing.set_index("optimizer")
    why = ("The sharded step runs AdamW on its own shard only ($1/p$ of the update) and then broadcasts every "
           "parameter from its owner, an extra $\\frac{p-1}{p}\\Psi$ of traffic per step that the replicated "
           "optimizer does not need")
    if not {"adamw", "sharded"} <= set(by.index) or "step_ms_std" not in by.columns:
        return why + "."
    a, b = by.loc["adamw"], by.loc["sharded"]
    diff, noise = float(b["step_ms"] - a["step_ms"]), spread(a["step_ms_std"], b["step_ms_std"])
    if abs(diff) <= noise:
        return (why + f"; here the difference ({fmt.ms(diff)}) is within the steps' spread (replicated "
                f"AdamW's steps vary by ±{fmt.ms(a['step_ms_std'])}, a few slow steps in its mean), so this run cannot "
                "tell a cost or a saving of sharding from the noise.")
    if diff > 0:
        return why + (f"; the broadcast costs more than the smaller update saves: {fmt.ms(diff)} per step net "
                      "here.")
    return why + f"; the smaller update saves more than the broadcast costs, {fmt.ms(-diff)} per step here."


def _timing_with_mfu(timing: pd.DataFrame | None, meta: dict[str, Any]) -> pd.DataFrame | None:
    """The timing table with MFU per GPU, from the run's model, batch and context (fp32: no autocast)."""
    params = meta.get("params") or {}
    if timing is None or not {"model", "global_batch", "context_length"} <= set(params):
        return timing
    nproc = params.get("nproc")
    world = int(params.get("world_size") or (nproc[0] if isinstance(nproc, list) and nproc else nproc) or 1)
    return step_mfu(timing, meta, model=params["model"], batch=int(params["global_batch"]) // world,
                    context=int(params["context_length"]), precision="fp32").drop(columns="TFLOP_per_s")


def _shown(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """A timing table as printed: its ratio column says what it divides (below 1 is faster than AdamW)."""
    return None if frame is None else frame.rename(columns={"slowdown_vs_adamw": "time_vs_adamw"})


_OPTIMIZER_NAMES = {"adamw": "AdamW (replicated state)", "sharded": "our sharded AdamW", "zero": "ZeroRedundancyOptimizer"}


#: Editions whose handout does not ask how our sharding differs from ZeRO stage 1 (CS336's (c)).
ZERO1_BEYOND = ("cse599o",)


def answer(d: SectionData) -> list[Block]:
    memory = d.frame("memory")
    breakdown = d.frame("memory_breakdown")
    timing = d.frame("timing")
    mem_text = None
    detail = ""
    rank0 = memory[memory["rank"] == 0] if memory is not None and "rank" in memory.columns else None
    if rank0 is not None and len(rank0) and rank0["after_step_peak"].notna().any():
        parts = [f"{_OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])}: {fmt.sig(r['after_init_peak'])} / "
                 f"{fmt.sig(r['before_step_peak'])} / {fmt.sig(r['after_step_peak'])} GiB"
                 for _, r in rank0.iterrows()]
        mem_text = Text("Peak memory on rank 0 after initialization / before the optimizer step / after it (each the "
                        "peak since the point before): " + "; ".join(parts) + ".")
        init = rank0["after_init_peak"].astype(float)
        count = {2: "two", 3: "three", 4: "four"}.get(len(init), str(len(init)))
        same = (f"the {count} are equal" if init.max() - init.min() < 0.005 else
                f"the {count} lie within {fmt.sig(init.max() - init.min())} GiB of each other")
        detail = (f"After initialization {same} (no optimizer state yet); the state is allocated by the first "
                  "optimizer step, so the measured step, which follows warm-up steps, already holds it before its "
                  "update, and the saving shows at both later points.")
    bd = None
    if breakdown is not None and {"optimizer", "rank", "component", "source", "GiB"} <= set(breakdown.columns):
        sel = breakdown[breakdown["rank"] == 0]
        bd = sel.pivot_table(index="component", columns=["optimizer", "source"], values="GiB", sort=False)
        bd.columns = [f"{o} {s}" for o, s in bd.columns]
        bd = bd.reset_index()
    if mem_text is not None and bd is not None and {"adamw measured", "sharded measured"} <= set(bd.columns):
        st = bd.set_index("component")
        if "optimizer_state" in st.index:
            parts = [f"{c} {fmt.sig(st.loc[c, 'adamw measured'])} / {fmt.sig(st.loc[c, 'sharded measured'])} GiB"
                     for c in ("parameters", "gradients", "optimizer_state", "activations")
                     if c in st.index and pd.notna(st.loc[c, "adamw measured"])]
            buckets = _buckets_gib(rank0, st)
            if buckets:  # what the tensor count leaves out, so the parts add up to the peaks (details: the appendix)
                parts.append(f"torch DDP's gradient buckets {fmt.sig(buckets)} GiB in both: what the allocator holds "
                             "after initialization beyond the parameters, since DDP allocates its buckets when it "
                             "wraps the model")
            # (a) asks for 2-3 sentences: the peaks, the breakdown (with why its parts outsum the peak), the
            # expectation; how the activations compare with the accounting is the appendix's
            mem_text = Text(mem_text.markdown + " Measured breakdown on rank 0 (replicated AdamW / sharded): "
                            + "; ".join(parts).replace("_", " ") + "." + _not_all_at_once(rank0, st)
                            + _expectation(st, _step_saving(rank0, _state_saved(st))))
            detail += _buckets_note(rank0, st) + _activations_note(st) + _step_temporaries(rank0)
    time_text = None
    if timing is not None and {"optimizer", "step_ms"} <= set(timing.columns) and len(timing):
        parts = [f"{_OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])} {fmt.ms(r['step_ms'])}"
                 + (f" ({fmt.ratio(r['slowdown_vs_adamw'])})" if "slowdown_vs_adamw" in r else "")
                 for _, r in timing.iterrows()]
        setup = _setup(d.meta("timing"), d.edition)
        time_text = Text("Time per training step" + (f" ({setup})" if setup else "") + ", relative to replicated "
                         "AdamW: " + join_words(parts) + ". " + _sharding_verdict(timing) + OPTIMIZER_NOTE)
    # CSE599-O's Problem 10 asks (a) and (b) only: the comparison with ZeRO stage 1 goes beyond its handout
    beyond_zero1 = d.edition in ZERO1_BEYOND
    zero1 = question(d, "ZeRO-1" if beyond_zero1 else "c", "How this differs from ZeRO stage 1 ($P_{os}$).", [
        Text("Both keep AdamW's two moments only for the parameters a rank owns, cutting optimizer-state "
             "memory by the world size $p$. ZeRO-1 partitions a flat buffer of all $\\Psi$ parameters into exact "
             "$\\Psi/p$ slices and "
             "replaces DDP's all-reduce with a reduce-scatter of gradients and an all-gather of updated "
             "parameters, $2\\frac{p-1}{p}\\Psi$ sent per rank, the same volume as DDP's ring all-reduce; ours "
             "assigns whole parameter tensors to ranks (balanced greedily, so shards are only about equal), keeps "
             "the full all-reduce and then broadcasts each updated parameter from its owner, "
             "$3\\frac{p-1}{p}\\Psi$ in all: simpler and model-agnostic, but 1.5× ZeRO-1's communication."),
        d.table("zero1_comparison", caption="Our sharding against ZeRO stage 1, per rank and step."
                + _zero1_bytes_note(d) + _zero_note(d))])
    return [
        question(d, "optimizer_state_sharding", "An optimizer wrapper that keeps each parameter's state on one "
                 "rank only and broadcasts the updated parameters from their owners.", [implemented(
                     d, "`ShardedOptimizer` (parameters assigned to ranks greedily by size; each rank steps the "
                     "wrapped optimizer on its own shard, then every parameter is broadcast from its owner)",
                     "cs336_systems/distributed/sharded_optimizer.py", "tests/test_sharded_optimizer.py",
                     "test_sharded_optimizer.py", against="unsharded AdamW, bit for bit"),
                     Text("CSE599-O's script for Problem 10: `srun --gpus-per-node=2 uv run sharding_optimizer.py` "
                          "(in `cs336_systems/cse599o/`) prints these measurements, peaks at the three points, the "
                          "breakdown and the time per iteration, from the same benchmark as the tables below.")
                     if d.folder.endswith("/cse599o") else None]),
        question(d, "a", "Peak memory after model initialization, before and after the optimizer step, with and "
                 f"without optimizer-state sharding ({handout_model(str((d.meta('memory').get('params') or {}).get('model', 'xl')), d.edition)}, "
                 "one node, 2 GPUs), with a breakdown.",
                 [mem_text, d.table("memory", caption="Allocated and peak memory per rank at the three points "
                                    "(GiB)."),
                  d.table("memory_breakdown", frame=bd, caption="Rank 0's memory by component, measured by counting "
                          "tensors and predicted by our memory accounting (GiB).")],
                 what="peak memory with and without sharding"),
        question(d, "b", "Time per iteration with and without optimizer-state sharding.",
                 [time_text, d.table("timing", frame=_shown(_timing_with_mfu(d.frame("timing"), d.meta("timing"))),
                                     caption="Time per training step (max over ranks), and MFU per GPU (one rank's "
                                     "share of the batch over the step)." + mfu_note(d.meta("timing"))),
                  d.figure("step_time", "timing", caption="Time per training step.")],
                 what="iteration times with and without sharding"),
        *([] if beyond_zero1 else [zero1]),
        Text("", role=BEYOND_HANDOUT),  # the memory study in detail, and more GPUs: the appendix
        *([zero1] if beyond_zero1 else []),
        *([question(d, "a", "The memory study in detail: what the peaks hold beyond the breakdown.", [
            Text(detail),
            d.table("savings_vs_adamw", frame=_shown(d.frame("savings_vs_adamw")), caption="Optimizer-state memory saved against replicated AdamW, and the time "
                    "it costs."),
            d.figure("memory_points", caption="Memory at the three points of a step."),
            d.figure("memory_components", "memory_breakdown", caption="Measured and predicted memory by component.")])]
          if detail else []),
        *_more_gpus(d),
    ]


def _expectation(st: pd.DataFrame, after_step: str = "") -> str:
    """(a)'s "do the results align with your expectations?": the state against the accounting's prediction;
    ``after_step`` (:func:`_step_saving`) ends the sentence."""
    need = {"adamw measured", "sharded measured", "adamw predicted", "sharded predicted"}
    if not need <= set(st.columns) or "optimizer_state" not in st.index:
        return ""
    state = st.loc["optimizer_state"]
    if state[list(need)].isna().any():
        return ""
    close = all(abs(state[f"{o} measured"] / state[f"{o} predicted"] - 1) < 0.05 for o in ("adamw", "sharded")
                if state[f"{o} predicted"])
    return ((" As expected, sharding" if close else " Sharding should") + " divide" + ("s" if close else "")
            + " only AdamW's two fp32 moments ($8\\Psi$ bytes for $\\Psi$ parameters) by the world size: the "
            "optimizer state goes from "
            f"{fmt.sig(state['adamw measured'])} to {fmt.sig(state['sharded measured'])} GiB, "
            + _prediction(state, close) + ", while parameters and gradients do not change" + after_step + ".")


def _activations_note(st: pd.DataFrame) -> str:
    """The measured activations against the accounting's per-block estimate (the same with and without
    sharding)."""
    if not {"adamw measured", "adamw predicted"} <= set(st.columns) or "activations" not in st.index:
        return ""
    act = st.loc["activations"]
    if not act["adamw predicted"] or act["adamw measured"] != act["adamw measured"]:
        return ""
    off = act["adamw measured"] / act["adamw predicted"] - 1
    return (f" The measured activations ({fmt.sig(act['adamw measured'])} GiB) are {fmt.pct(abs(off))} "
            f"{'above' if off >= 0 else 'below'} the accounting's per-block estimate, with and without sharding.")


def _step_saving(rank0: pd.DataFrame, state_saved: float | None = None) -> str:
    """The clause of (a) on the saving after the step where it is larger than the state's (``state_saved``, GiB,
    when known; the detail: :func:`_step_temporaries`)."""
    by = rank0.set_index("optimizer")
    if not _step_temporaries(rank0):
        return ""
    saved = by.loc["adamw", "after_step_peak"] - by.loc["sharded", "after_step_peak"]
    if state_saved is not None and not saved > state_saved:
        return ""
    return (f"; the peak after the step falls by more ({fmt.sig(saved)} GiB), since the update's temporaries (one "
            "fp32 copy of the parameters it updates) shrink with the shard too")


def _prediction(state: pd.Series, close: bool) -> str:
    """The predicted state beside the measured: its numbers only where they read differently from the measured
    ones just given."""
    pred = [fmt.sig(state[f"{o} predicted"]) for o in ("adamw", "sharded")]
    if not close:
        return f"against a prediction of {pred[0]} → {pred[1]} GiB"
    same = pred == [fmt.sig(state[f"{o} measured"]) for o in ("adamw", "sharded")]
    return "as predicted" + ("" if same else f" ({pred[0]} → {pred[1]})")


def _zero_note(d: SectionData) -> str:
    """Where the run measured PyTorch's ZeroRedundancyOptimizer: that it communicates as ours does, so the
    comparison table's ``zero1`` row (the analytic ZeRO-1) is not its measurement."""
    runs = [d.frame(n) for n in ("timing", "memory")]
    table = d.frame("zero1_comparison")
    if not any(f is not None and "optimizer" in f.columns and "zero" in set(f["optimizer"]) for f in runs) \
            or table is None or "strategy" not in table.columns or "zero1" not in set(table["strategy"]):
        return ""
    return (" The ZeroRedundancyOptimizer rows of (a) and (b) are PyTorch's, which keeps DDP's full all-reduce and "
            "then broadcasts each parameter from its owner, our communication pattern; the table's `zero1` row is "
            "the analytic reduce-scatter/all-gather scheme above.")


def _state_saved(st: pd.DataFrame) -> float | None:
    """The optimizer state sharding removed on rank 0 (GiB), from the measured breakdown."""
    if "optimizer_state" not in st.index or not {"adamw measured", "sharded measured"} <= set(st.columns):
        return None
    return float(st.loc["optimizer_state", "adamw measured"] - st.loc["optimizer_state", "sharded measured"])


def _step_temporaries(rank0: pd.DataFrame) -> str:
    """Why the saving after the step exceeds the state sharding removes: the optimizer step's own transient
    memory (peak over what stays allocated), which sharding shrinks too, since each rank updates only its shard."""
    by = rank0.set_index("optimizer")
    if not {"adamw", "sharded"} <= set(by.index) or not {"after_step_peak", "after_step_allocated"} <= set(by.columns):
        return ""
    transient = by["after_step_peak"] - by["after_step_allocated"]
    saved = by.loc["adamw", "after_step_peak"] - by.loc["sharded", "after_step_peak"]
    if transient.isna().any() or transient.loc["adamw"] <= transient.loc["sharded"]:
        return ""
    return (f" After the step, the peak exceeds what stays allocated by {fmt.sig(transient.loc['adamw'])} GiB "
            f"replicated and {fmt.sig(transient.loc['sharded'])} GiB sharded: the update's temporaries (PyTorch's "
            "multi-tensor AdamW computes $\\sqrt{v}$ for all the parameters it updates at once, one fp32 copy of "
            "them), which shrink with the shard; so the saving "
            f"at the peak after the step ({fmt.sig(saved)} GiB) is larger than the state sharding removes.")


def _buckets_gib(rank0: pd.DataFrame, breakdown: pd.DataFrame) -> float | None:
    """What the allocator holds after initialization beyond the parameters, where it is torch DDP's gradient buckets
    (at least half the parameters' size), else None."""
    if "parameters" not in breakdown.index or "adamw measured" not in breakdown.columns:
        return None
    row = rank0[rank0["optimizer"] == "adamw"]
    if not len(row) or "after_init_allocated" not in row.columns:
        return None
    params = float(breakdown.loc["parameters", "adamw measured"])
    extra = float(row["after_init_allocated"].iloc[0]) - params
    return extra if params and extra >= 0.5 * params else None


def _buckets_note(rank0: pd.DataFrame, breakdown: pd.DataFrame) -> str:
    """What the tensor breakdown does not count: after initialization the allocator already holds more than the
    parameters, torch DDP's gradient buckets (flat buffers for every gradient, allocated when it wraps the
    model; with the default ``gradient_as_bucket_view=False`` they are a second copy of the gradients)."""
    extra = _buckets_gib(rank0, breakdown)
    if extra is None:
        return ""
    row = rank0[rank0["optimizer"] == "adamw"]
    params = float(breakdown.loc["parameters", "adamw measured"])
    return (f" The breakdown counts tensors the model and optimizer own; the allocator holds {fmt.sig(extra)} GiB "
            f"more from initialization on ({fmt.sig(float(row['after_init_allocated'].iloc[0]))} GiB allocated "
            f"against {fmt.sig(params)} GiB of parameters): torch DDP's gradient buckets, flat buffers for every "
            "gradient allocated when it wraps the model (a second copy of the gradients, as "
            "`gradient_as_bucket_view` is off by default), the same for every optimizer.")


def _setup(meta: dict[str, Any], edition: str = "2025") -> str:
    """The run's setup in one sentence (what a reader comparing with §2's DDP steps needs: a different batch
    or context explains a different step time)."""
    p = meta.get("params") or {}
    if not {"model", "global_batch", "context_length"} <= set(p):
        return ""
    world = int(p.get("world_size") or (p.get("nproc") or [2])[0])
    return (f"{handout_model(str(p['model']), edition)}, fp32, {p['global_batch']} sequences of {p['context_length']} "
            f"tokens per step over {world} GPUs, torch DDP for the gradients, torch's default (multi-tensor) AdamW, mean of {p.get('steps', '?')} steps after {p.get('warmup', '?')} "
            "warm-up steps")


def _not_all_at_once(rank0: pd.DataFrame, breakdown: pd.DataFrame) -> str:
    """Why the components add up to more than the peak: they are not resident together (backward frees a
    block's activations as it produces that block's gradients)."""
    parts = ("parameters", "gradients", "optimizer_state", "activations")
    row = rank0[rank0["optimizer"] == "adamw"]
    if not len(row) or "adamw measured" not in breakdown.columns or not set(parts) <= set(breakdown.index) \
            or not {"before_step_peak", "after_init_allocated"} <= set(row.columns):
        return ""
    params = float(breakdown.loc["parameters", "adamw measured"])
    total = sum(float(breakdown.loc[c, "adamw measured"]) for c in parts)
    total += max(0.0, float(row["after_init_allocated"].iloc[0]) - params)  # what the allocator holds beside them
    peak = float(row["before_step_peak"].iloc[0])
    if total <= 1.02 * peak:
        return ""
    return (f" Added up, these come to {fmt.sig(total)} GiB against a peak of {fmt.sig(peak)} GiB before the step: "
            "they are never all resident at once, as backward frees each block's saved activations while it "
            "produces that block's gradients.")


def _more_gpus(d: SectionData) -> list[Block]:
    """Beyond the handout, for each extra world size run (``--set nproc=2,4``): our sharding against PyTorch's
    ``ZeroRedundancyOptimizer`` and replicated AdamW on that many GPUs, memory and step time."""
    blocks: list[Block] = []
    for name in sorted((t for t in d.tables if t.startswith("timing_np")), key=lambda t: int(t.rsplit("np", 1)[1])):
        tag = name.removeprefix("timing")
        world, timing, memory = int(tag.removeprefix("_np")), d.frame(name), d.frame("memory" + tag)
        if timing is None or not {"optimizer", "step_ms"} <= set(timing.columns):
            continue
        rows = timing.set_index("optimizer")
        by = rows["step_ms"]
        parts = [f"{_OPTIMIZER_NAMES.get(o, o)} {fmt.ms(t)}" for o, t in by.items()]
        text = f"On {world} GPUs (the same global batch, split {world} ways): " + join_words(parts) + "."
        if {"sharded", "zero"} <= set(by.index):
            ours, theirs = by["sharded"], by["zero"]
            text += f" Ours takes {fmt.ratio(ours / theirs)} of ZeroRedundancyOptimizer's step time"
            if "step_ms_std" in rows.columns:
                noise = spread(rows.loc["sharded", "step_ms_std"], rows.loc["zero", "step_ms_std"])
                text += f" ({step_verdict(ours, theirs, noise)})"
            text += "."
        if memory is not None and {"optimizer", "rank", "after_step_peak"} <= set(memory.columns):
            peak = memory[memory["rank"] == 0].set_index("optimizer")["after_step_peak"]
            if peak.notna().any():
                text += " Peak memory on rank 0 after the step: " + join_words(
                    [f"{_OPTIMIZER_NAMES.get(o, o)} {fmt.sig(v)} GiB" for o, v in peak.items()]) + "."
        blocks.append(question(d, f"np{world}", f"Beyond the handout: sharding on {world} GPUs.", [
            Text(text),
            d.table("timing" + tag, frame=_shown(d.frame("timing" + tag)), caption=f"Time per training step on {world} GPUs (max over ranks)."),
            d.table("memory" + tag, caption=f"Allocated and peak memory per rank on {world} GPUs (GiB).")]))
    return blocks



SECTION = Section(
    name=SECTION_NAME, number="3", title="Optimizer-state sharding", problems=("optimizer_state_sharding", "optimizer_state_sharding_accounting"),
    answer=answer, presets=PRESETS, run=run, derive=derive, derive_inputs=("memory", "memory_breakdown", "timing"),
    gpus=2, sized_by=("model",), depends=(*MODEL, "cs336_systems/distributed/sharded_optimizer.py", "cs336_systems/distributed/launch.py",
                     "cs336_systems/distributed/runner.py", "cs336_systems/accounting.py",
                     "cs336_systems/benchmarking/timing.py", "cs336_systems/benchmarking/training_memory.py"),
)


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.experiments.optimizer_state_sharding"))
