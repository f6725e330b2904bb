"""§2.4 Communication accounting: the handout's XXL feed-forward model on TPU v5p — memory on one device,
the FSDP degree that fits, the batch that keeps an FSDP × TP forward pass compute bound, and layouts that
lower it. Closed forms in :mod:`cs336_systems.accounting`.

Analytic: it runs anywhere, in seconds, and writes ``figures/communication_accounting/`` only when asked to
publish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from cs336_systems import accounting as acc
from cs336_systems.experiments.section import Section, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params:
    preset: str = param("xxl", "model preset (only its feed-forward layers count)")
    h100_bytes: float = param(80e9, "memory of one H100, for the H100-equivalents of (a)")
    tpu_bytes: float = param(95e9, "memory of one TPU v5p")
    X: int = param(16, "FSDP degree")
    Y: int = param(4, "tensor-parallel degree")
    M_X: int = param(2, "ICI axes the FSDP collectives use")
    M_Y: int = param(1, "ICI axes the TP collectives use")
    W_ici: float = param(2 * 9e10, "bytes/s per ICI axis, bidirectional (TPU v5p)")
    C: float = param(4.6e14, "FLOP/s per chip (TPU v5p, bf16)")
    tokens_per_device: int | None = param(None, "activation tokens per device (None: the compute-bound batch "
                                                "of (c), rounded up)")


PRESETS = {preset: Params() for preset in ("smoke", "quick", "full")}

#: Alternative layouts of (d): (name, FSDP degree, TP degree, FSDP ICI axes or None = M_X, bytes per gathered weight)
LEVERS = (
    ("baseline X=16, Y=4, bf16 gathers", 16, 4, None, 2),
    ("8-bit weight all-gathers", 16, 4, None, 1),
    ("more TP: X=8, Y=8", 8, 8, None, 2),
    ("more TP: X=4, Y=16", 4, 16, None, 2),
    ("too much TP: X=2, Y=32", 2, 32, None, 2),
)  # no layout gives FSDP a third ICI axis: a v5p torus has three, and TP needs one of its own


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The four parts' tables and figures."""
    model = acc.FFNModel.from_preset(p.preset)
    mesh = acc.Mesh(X=p.X, Y=p.Y, M_X=p.M_X, M_Y=p.M_Y, W_ici=p.W_ici, C=p.C)
    bound = acc.compute_bound_batch(model, mesh)
    tokens = p.tokens_per_device if p.tokens_per_device is not None else int(np.ceil(bound["per_device_tokens"]))
    out.params["tokens_per_device"] = tokens
    sns.set_theme(style="whitegrid")

    # (a) one device
    mem = acc.ffn_model_memory(model, tokens=tokens)
    rows = [(k, mem[k]) for k in ("master_weights", "gradients", "optimizer_state", "weights_grads_optimizer",
                                  "activations_per_token", "activations")]
    table_a = pd.DataFrame(rows, columns=["quantity", "bytes"])
    table_a["GB"] = table_a["bytes"] / 1e9
    table_a["H100_80GB_equivalents"] = table_a["bytes"] / p.h100_bytes
    out.table(table_a, "xxl_memory", extra={"num_params": model.num_params, "tokens": tokens})

    # (b) the FSDP degree that fits
    token_counts = [0, tokens, 1024, 2048, 4096, 8192]
    rows = []
    for t in token_counts:
        try:
            n_min = acc.min_fsdp_devices(model, p.tpu_bytes, t)
            rows.append({"tokens_per_device": t, "min_N_FSDP": n_min,
                         "GB_per_device_at_min_N": acc.fsdp_memory_per_device(model, n_min, t) / 1e9})
        except ValueError:  # no degree fits
            rows.append({"tokens_per_device": t, "min_N_FSDP": None, "GB_per_device_at_min_N": None})
    table_b = pd.DataFrame(rows)
    out.table(table_b, "min_fsdp_devices")
    n_grid = np.arange(8, 129)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for t in token_counts[:5]:
        ax.plot(n_grid, [acc.fsdp_memory_per_device(model, int(n), t) / 1e9 for n in n_grid], label=f"{t} tokens/device")
    ax.axhline(p.tpu_bytes / 1e9, color="k", ls="--", lw=1, label=f"TPU v5p ({p.tpu_bytes / 1e9:g} GB)")
    ax.set(xlabel="N_FSDP", ylabel="GB per device", yscale="log", title="XXL per-device memory under FSDP")
    ax.legend(fontsize=8)
    out.figure(fig, "fsdp_memory_vs_n")
    plt.close(fig)

    # (c) the compute-bound batch
    table_c = pd.DataFrame([{**bound, "X": p.X, "Y": p.Y, "M_X": p.M_X, "M_Y": p.M_Y}])
    out.table(table_c, "compute_bound_batch")
    ratios = []
    for b in np.geomspace(16, 8192, 200):
        t = acc.fsdp_tp_forward_times(model, b * mesh.N, mesh)
        ratios.append({"tokens_per_device": b, "T_math / T_FSDP": t["T_math"] / t["T_fsdp"],
                       "T_math / T_TP": t["T_math"] / t["T_tp"]})
    ratio_df = pd.DataFrame(ratios).melt("tokens_per_device", var_name="ratio", value_name="value")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sns.lineplot(data=ratio_df, x="tokens_per_device", y="value", hue="ratio", ax=ax)
    ax.axhline(1, color="k", lw=1, ls="--")
    ax.axvline(bound["per_device_tokens"], color="tab:red", lw=1, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="batch per device (tokens)", ylabel="compute / communication time",
           title=f"XXL forward on a {p.X}x{p.Y} FSDP x TP v5p mesh")
    out.figure(fig, "compute_bound_ratio")
    plt.close(fig)

    # (d) layouts that lower the compute-bound batch
    rows = []
    for name, x, y, m_x, comm_bytes in LEVERS:
        r = acc.compute_bound_batch(model, acc.Mesh(x, y, m_x or p.M_X, p.M_Y, p.W_ici, p.C), comm_bytes=comm_bytes)
        rows.append({"layout": name, "tokens_per_device": r["per_device_tokens"], "global_tokens": r["global_tokens"],
                     "tp_compute_bound": r["tp_compute_bound"]})
    table_d = pd.DataFrame(rows)
    out.table(table_d, "batch_reduction_levers")
    return {"xxl_memory": table_a, "min_fsdp_devices": table_b, "compute_bound_batch": table_c,
            "batch_reduction_levers": table_d}


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def _quantity(df: pd.DataFrame | None, name: str, col: str) -> float | None:
    if df is None or "quantity" not in df.columns or col not in df.columns:
        return None
    sel = df[df["quantity"] == name]
    return float(sel[col].iloc[0]) if len(sel) else None


def _activation_tokens(d: SectionData, mem: pd.DataFrame | None) -> str:
    """The tokens per device the table's activations total counts (the run's ``tokens_per_device``), and that
    they are (c)'s compute-bound batch per device where they are, or ""."""
    tokens = (d.meta("xxl_memory").get("params") or {}).get("tokens_per_device")
    total_gb = _quantity(mem, "activations", "GB")
    if not tokens or total_gb is None:
        return ""
    cb = d.frame("compute_bound_batch")
    from_c = (cb is not None and "per_device_tokens" in cb.columns and len(cb)
              and int(np.ceil(cb["per_device_tokens"].iloc[0])) == int(tokens))
    return (f", so {fmt.sig(total_gb)} GB for the table's {int(tokens):,} tokens per device"
            + (" (the compute-bound batch per device of part (c), rounded up)" if from_c else ""))


def answer(d: SectionData) -> list[Block]:
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
               "input)" + _activation_tokens(d, mem) if per_tok else "") + ".")
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
                     Text("With $A$ the bytes of bf16 activations saved for backward on a device ((a)'s per-token "
                          "bytes times the tokens the device holds), half of them sharded:"),
                     Equation([
                         (r"M_{\mathrm{device}} = \frac{16\,N + A/2}{N_{\mathrm{FSDP}}} + \frac{A}{2}"
                         r" < 95\,\mathrm{GB}"),
                     ]),
                     b_text, d.table("min_fsdp_devices", digits=5,  # 94.998 GB is below the bound; 95.00 reads as on it
                                     caption="Smallest $N_{\\mathrm{FSDP}}$ below 95 GB per device, by activation "
                                             "tokens per device."),
                 ], what="the sharded memory accounting"),
        question(d, "c", "Forward pass only, TPU v5p ($W_{\\mathrm{ici}} = 2\\cdot 9\\cdot 10^{10}$ B/s, "
                 "$C = 4.6\\cdot 10^{14}$ FLOP/s), $M_X = 2$, $M_Y = 1$, $X = 16$ (FSDP), $Y = 4$ (TP): the "
                 "per-device batch that is compute bound, and the overall batch.", [
                     Text("In the TPU Scaling Book's notation, $D = d_{\\mathrm{model}}$, $F = d_{\\mathrm{ff}}$ and "
                          "$B$ is the overall batch in tokens. Per layer, the math time and the two collectives "
                          "(FSDP all-gathers of bf16 weights over $X$, TP activations over $Y$) are"),
                     Equation([
                         (r"T_{\mathrm{math}} = \frac{4BDF}{XYC},\quad T_{\mathrm{FSDP}} = \frac{4DF}{Y\,W_{\mathrm{ici}}M_X},"
                         r"\quad T_{\mathrm{TP}} = \frac{4BD}{X\,W_{\mathrm{ici}}M_Y},"),
                         (r"T_{\mathrm{math}} \geq T_{\mathrm{FSDP}} \Leftrightarrow \frac{B}{XY} \geq \frac{C}{W_{\mathrm{ici}}\,Y M_X},"
                         r"\qquad T_{\mathrm{math}} \geq T_{\mathrm{TP}} \Leftrightarrow F \geq \frac{Y\,C}{W_{\mathrm{ici}}M_Y}."),
                     ]),
                     c_text, d.table("compute_bound_batch", caption="Compute-bound batch under FSDP × TP."),
                 ], what="the compute-bound batch size"),
        question(d, "d", "Tricks that keep throughput with a smaller overall batch.", [
            Text("More model parallelism along axes that do not multiply the batch: tensor parallelism on a larger "
                 "$Y$ (its condition $F \\geq YC/(W_{\\mathrm{ici}}M_Y)$ is independent of $B$), and "
                 "pipeline parallelism, where only activations cross stages; its cost is the bubble, the share "
                 "$(k-1)/(m+k-1)$ of a step that $k$ stages with $m$ micro-batches idle (GPipe), so it keeps "
                 "throughput only while $m \\gg k$, and the batch must hold $m$ micro-batches. Fewer bytes on "
                 "the wire: gathering fp8 weights instead of (c)'s bf16 halves them, and with them the "
                 "compute-bound threshold $B/X \\geq C/(W_{\\mathrm{ici}}M_X)$. Overlapping the FSDP all-gathers "
                 "of layer $\\ell+1$ with the compute of layer $\\ell$ is what lets a step run at that threshold "
                 "at all (the condition compares the two as if they ran side by side), not a way below it "
                 "(see the TPU Scaling Book, “How to Parallelize a Transformer for Training”)."),
            d.table("batch_reduction_levers", caption="Compute-bound batch under alternative layouts."),
        ]),
        Text("", role=BEYOND_HANDOUT),  # the answers' tables, plotted
        question(d, "b", "Memory per device against the FSDP degree, plotted.", [
            d.figure("fsdp_memory_vs_n", caption="Memory per device against the FSDP degree.")]),
        question(d, "c", "Math time over communication time against the batch, plotted.", [
            d.figure("compute_bound_ratio", caption="Math time over communication time against batch.")]),
    ]



SECTION = Section(
    name="communication_accounting", number="2.4", title="Communication accounting",
    problems=("communication_accounting",), answer=answer, presets=PRESETS, run=run, gpus=0,
    depends=("cs336_systems/accounting.py", "cs336_systems/configs.py"),
)
