"""§2.4 communication accounting, §3 optimizer-state sharding, and FSDP."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import join_words, question, subset


def _quantity(df: pd.DataFrame | None, name: str, col: str) -> float | None:
    if df is None or "quantity" not in df.columns or col not in df.columns:
        return None
    sel = df[df["quantity"] == name]
    return float(sel[col].iloc[0]) if len(sel) else None


def communication_accounting(d: SectionData) -> list[Block]:
    mem = d.frame("xxl_memory")
    extra = d.meta("xxl_memory").get("extra", {}) if mem is not None else {}
    a_text = None
    total_gb = _quantity(mem, "weights_grads_optimizer", "GB")
    if total_gb is not None:
        h100 = _quantity(mem, "weights_grads_optimizer", "H100_80GB_equivalents")
        per_tok = _quantity(mem, "activations_per_token", "bytes")
        n = extra.get("num_params")
        a_text = Text(
            (f"With $N = {fmt.tex_sig(n / 1e9)}$ billion feed-forward parameters, " if n else "")
            + f"fp32 master weights, gradients and AdamW state take {fmt.sig(total_gb)} GB, "
            f"{fmt.sig(h100)} H100s' worth of 80 GB"
            + (f"; the bf16 activations saved for backward add {fmt.sig(per_tok / 1e6)} MB per token "
               f"($2\\,L\\,(d_{{\\mathrm{{model}}}} + d_{{\\mathrm{{ff}}}})$ bytes: each linear keeps its "
               "input)" if per_tok else "") + ".")
    mins = d.frame("min_fsdp_devices")
    b_text = None
    if mins is not None and {"tokens_per_device", "min_N_FSDP"} <= set(mins.columns) and len(mins):
        first = mins.iloc[0]
        b_text = Text(f"Without activations, $N_{{\\mathrm{{FSDP}}}} = {int(first['min_N_FSDP'])}$ devices bring the "
                      f"memory below 95 GB ({fmt.sig(first['GB_per_device_at_min_N'])} GB each); the unsharded half "
                      "of the activations raises that quickly with the tokens each device holds: " + join_words(
                          [f"{int(r['min_N_FSDP'])} at {int(r['tokens_per_device']):,} tokens"
                           for _, r in mins.iloc[1:].iterrows()]) + ".")
    cb = d.frame("compute_bound_batch")
    c_text = None
    if cb is not None and {"per_device_tokens", "global_tokens"} <= set(cb.columns) and len(cb):
        r = cb.iloc[0]
        c_text = Text(f"With $\\alpha = C/W_{{\\mathrm{{ici}}}} = {fmt.tex_sig(r['alpha'])}$ the forward pass is compute "
                      f"bound from {fmt.sig(r['per_device_tokens'])} tokens per device, i.e. an overall batch of "
                      f"{fmt.sig(r['global_tokens'])} tokens over {int(r['num_devices'])} chips; the TP condition "
                      + ("holds" if bool(r.get("tp_compute_bound", True)) else "fails")
                      + f" ($d_{{\\mathrm{{ff}}}} \\geq {fmt.tex_sig(r['tp_min_d_ff'])}$).")
    return [
        question(d, "a", "Memory of fp32 master weights, gradients and AdamW state for the XXL model's feed-forward "
                 "layers on one device; memory saved for backward in bf16; in H100s.", [
                     Text("Counting only the two feed-forward matrices of each of the $L$ blocks:"),
                     Equation([
                         (r"N = 2\,L\,d_{\mathrm{model}}\,d_{\mathrm{ff}},\qquad "
                         r"M_{\mathrm{fp32}} = N\,(4_{\mathrm{weights}} + 4_{\mathrm{grads}} + 8_{\mathrm{Adam}})"
                         r" = 16\,N\ \mathrm{bytes}"),
                     ]),
                     a_text, d.table("xxl_memory", caption="XXL feed-forward model on one device."),
                 ], what="the single-device memory accounting"),
        question(d, "b", "Memory per device when master weights, optimizer state, gradients and half the "
                 "activations are sharded over $N_{\\mathrm{FSDP}}$ devices; the $N_{\\mathrm{FSDP}}$ that fits "
                 "one TPU v5p (95 GB).", [
                     Equation([
                         (r"M_{\mathrm{device}} = \frac{16\,N + A/2}{N_{\mathrm{FSDP}}} + \frac{A}{2}"
                         r" < 95\,\mathrm{GB}"),
                     ]),
                     b_text, d.table("min_fsdp_devices", caption="Smallest $N_{\\mathrm{FSDP}}$ below 95 GB per "
                                     "device, by activation tokens per device."),
                     d.figure("fsdp_memory_vs_n", caption="Memory per device against the FSDP degree."),
                 ], what="the sharded memory accounting"),
        question(d, "c", "Forward pass only, TPU v5p ($W_{\\mathrm{ici}} = 2\\cdot 9\\cdot 10^{10}$ B/s, "
                 "$C = 4.6\\cdot 10^{14}$ FLOP/s), $M_X = 2$, $M_Y = 1$, $X = 16$ (FSDP), $Y = 4$ (TP): the "
                 "per-device batch that is compute bound, and the overall batch.", [
                     Text("Per layer and batch of $B$ tokens, the math time and the two collectives "
                          "(FSDP all-gathers of bf16 weights over $X$, TP activations over $Y$) are"),
                     Equation([
                         (r"T_{\mathrm{math}} = \frac{4BDF}{XYC},\quad T_{\mathrm{FSDP}} = \frac{4DF}{Y\,W_{\mathrm{ici}}M_X},"
                         r"\quad T_{\mathrm{TP}} = \frac{4BD}{X\,W_{\mathrm{ici}}M_Y},"),
                         (r"T_{\mathrm{math}} \geq T_{\mathrm{FSDP}} \Leftrightarrow \frac{B}{XY} \geq \frac{C}{W_{\mathrm{ici}}\,Y M_X},"
                         r"\qquad T_{\mathrm{math}} \geq T_{\mathrm{TP}} \Leftrightarrow F \geq \frac{Y\,C}{W_{\mathrm{ici}}M_Y}."),
                     ]),
                     c_text, d.table("compute_bound_batch", caption="Compute-bound batch under FSDP × TP."),
                     d.figure("compute_bound_ratio", caption="Math time over communication time against batch."),
                 ], what="the compute-bound batch size"),
        question(d, "d", "Tricks that keep throughput with a smaller overall batch.", [
            Text("More model parallelism along axes that do not multiply the batch: tensor parallelism on a larger "
                 "$Y$ (its condition $F \\geq YC/(W_{\\mathrm{ici}}M_Y)$ is independent of $B$), pipeline "
                 "parallelism (only activations cross stages, and micro-batches hide the bubble), and expert "
                 "parallelism. Overlapping the FSDP all-gathers of layer $\\ell+1$ with the compute of layer "
                 "$\\ell$ hides communication rather than amortizing it over a larger batch, and lower-precision "
                 "weights (bf16/fp8 all-gathers) halve or quarter the bytes moved, lowering the "
                 "compute-bound threshold $B/X \\geq C/(W_{\\mathrm{ici}}M_X)$ proportionally "
                 "(see the TPU Scaling Book, “How to Parallelize a Transformer for Training”)."),
            d.table("batch_reduction_levers", caption="Compute-bound batch under alternative layouts."),
        ]),
    ]


_OPTIMIZER_NAMES = {"adamw": "AdamW (replicated state)", "sharded": "our sharded AdamW", "zero": "ZeroRedundancyOptimizer"}


def optimizer_state_sharding(d: SectionData) -> list[Block]:
    memory = d.frame("memory")
    breakdown = d.frame("memory_breakdown")
    timing = d.frame("timing")
    mem_text = None
    rank0 = memory[memory["rank"] == 0] if memory is not None and "rank" in memory.columns else None
    if rank0 is not None and len(rank0) and rank0["after_step_peak"].notna().any():
        parts = [f"{_OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])}: {fmt.sig(r['after_init_peak'])} / "
                 f"{fmt.sig(r['before_step_peak'])} / {fmt.sig(r['after_step_peak'])} GiB"
                 for _, r in rank0.iterrows()]
        mem_text = Text("Peak memory on rank 0 after initialization / before the optimizer step / after it: "
                        + "; ".join(parts) + ". Sharding leaves parameters, gradients and activations unchanged "
                        "and divides AdamW's two fp32 moments ($8\\Psi$ bytes) by the world size, so the saving "
                        "appears only from the first optimizer step on, when the state is allocated.")
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
            mem_text = Text(mem_text.markdown + " Measured breakdown on rank 0 (replicated AdamW / sharded): "
                            + "; ".join(parts).replace("_", " ") + ".")
    time_text = None
    if timing is not None and {"optimizer", "step_ms"} <= set(timing.columns) and len(timing):
        parts = [f"{_OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])} {fmt.ms(r['step_ms'])}"
                 + (f" ({fmt.ratio(r['slowdown_vs_adamw'])})" if "slowdown_vs_adamw" in r else "")
                 for _, r in timing.iterrows()]
        time_text = Text("Time per training step (relative to replicated AdamW): " + join_words(parts) + ". The "
                         "sharded step updates only the local shard, but then broadcasts every parameter from "
                         "its owner, an extra $\\Psi$ of traffic per step that the replicated optimizer does not "
                         "need.")
    return [
        question(d, "a", "Peak memory after model initialization, before and after the optimizer step, with and "
                 "without optimizer-state sharding (XL, one node, 2 GPUs), with a breakdown.",
                 [mem_text, d.table("memory", caption="Allocated and peak memory per rank at the three points "
                                    "(GiB)."),
                  d.table("memory_breakdown", frame=bd, caption="Rank 0's memory by component, measured by counting "
                          "tensors and predicted by `accounting.training_memory_per_rank` (GiB)."),
                  d.table("savings_vs_adamw", caption="Optimizer-state memory saved against replicated AdamW, "
                          "and the time it costs."),
                  d.figure("memory_points", caption="Memory at the three points of a step."),
                  d.figure("memory_components", "memory_breakdown", caption="Measured and predicted memory by "
                           "component.")],
                 what="peak memory with and without sharding"),
        question(d, "b", "Time per iteration with and without optimizer-state sharding.",
                 [time_text, d.table("timing", caption="Time per training step (max over ranks)."),
                  d.figure("step_time", "timing", caption="Time per training step.")],
                 what="iteration times with and without sharding"),
        question(d, "c", "How this differs from ZeRO stage 1 ($P_{os}$).", [
            Text("Both keep AdamW's two moments only for the parameters a rank owns, cutting optimizer-state "
                 "memory by the world size $P$. ZeRO-1 partitions a flat buffer at element granularity, so every "
                 "rank owns exactly $\\Psi/P$ elements, and replaces DDP's all-reduce with a reduce-scatter of "
                 "gradients and an all-gather of updated parameters, $2\\Psi$ per rank in total, the same volume "
                 "as DDP. Our sharding assigns whole parameter tensors to ranks (balanced greedily, so shards are "
                 "only approximately equal), keeps the full gradient all-reduce ($2\\Psi$) and then broadcasts each "
                 "updated parameter from its owner ($\\Psi$ more), $3\\Psi$ in total: simpler and model-agnostic, "
                 "but with 1.5× the communication volume of ZeRO-1."),
            d.table("zero1_comparison", caption="Our sharding against ZeRO stage 1, per rank and step.")]),
    ]


def _fsdp_sentence(df: pd.DataFrame | None, peak: str = "after_step_peak",
                   label: str = "Peak memory per GPU after the optimizer step") -> Text | None:
    """Memory and time of every strategy for each (model, dtype, world size) they were run on."""
    need = {"model", "world_size", "strategy", peak, "step_ms"}
    if df is None or not need <= set(df.columns) or df.empty:
        return None
    sentences = []
    keys = [k for k in ("model", "dtype", "world_size") if k in df.columns]
    for key, g in df.groupby(keys, sort=False):
        key = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        parts = []
        for _, r in g.iterrows():
            if str(r.get("status", "ok")) != "ok":
                parts.append(f"{r['strategy']} {r['status']}")
            elif pd.notna(r[peak]):
                parts.append(f"{r['strategy']} ({fmt.sig(r[peak])} GiB, {fmt.ms(r['step_ms'])})")
        if parts:
            where = f"{key['model']}" + (f" {key['dtype']}" if "dtype" in key else "") + f" on {key['world_size']} GPUs"
            sentences.append(f"{where}: " + join_words(parts))
    if not sentences:
        return None
    return Text(f"{label} and time per step: " + "; ".join(sentences) + ".")


def fsdp(d: SectionData) -> list[Block]:
    return [
        question(d, "fsdp", "Fully sharded data parallelism: per-layer all-gather of parameters before use, "
                 "reduce-scatter of gradients after the backward pass.", [
                     Text("With $P$ ranks and $\\Psi$ parameters, each rank stores $\\Psi/P$ parameters, gradients "
                          "and optimizer state; a step moves $\\Psi$ per rank in the forward all-gathers, $\\Psi$ in "
                          "the backward re-gathers and $\\Psi$ in the gradient reduce-scatter:"),
                     Equation([(r"M_{\mathrm{rank}} = \frac{16\,\Psi}{P} + M_{\mathrm{act}} + "
                               r"M_{\mathrm{gathered\ layers}},\qquad V_{\mathrm{rank}} \approx 3\,\Psi"
                               r"\ \mathrm{elements}")]),
                     _fsdp_sentence(d.frame("relative_to_ddp"), "peak_GiB", "Peak memory per GPU")
                     or _fsdp_sentence(d.frame("fsdp_vs_ddp")),
                     d.figure("memory_and_time", caption="Per-GPU memory and step time: DDP, our FSDP and "
                              "PyTorch's FSDP2."),
                     d.table("relative_to_ddp", caption="Per-GPU peak memory (GiB, measured and predicted) and "
                             "step time, and both relative to DDP (all measured columns: `fsdp_vs_ddp.csv`).")
                     or d.table("fsdp_vs_ddp", frame=subset(d.frame("fsdp_vs_ddp"), "model", "dtype", "world_size",
                                                            "strategy", "status", "predicted_total", "before_step_peak",
                                                            "after_step_peak", "step_ms", "tokens_per_s"),
                                caption="Per-GPU memory (GiB: predicted, and measured peaks before and after the "
                                "optimizer step) and step time by model, dtype, world size and strategy (all columns: "
                                "the CSV)."),
                     d.table("predicted_vs_measured", caption="Predicted vs. measured memory per rank."),
                     d.table("largest_model", caption="Largest model each strategy can train on one node: predicted "
                             "by `accounting` and the largest it trained here."),
                     d.table("largest_model_predicted", caption="Largest model each strategy can train, predicted."),
                     d.table("largest_model_measured", caption="Largest model each strategy trained, measured."),
                 ], what="FSDP memory and step time"),
    ]
