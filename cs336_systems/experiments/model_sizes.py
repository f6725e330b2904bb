"""§1.1.2 The model presets: parameters, FLOPs per token and training-state memory, from the calculator in
:mod:`cs336_systems.configs`, checked against the model built on the meta device (no memory allocated).

Analytic: it runs anywhere, in a second, and writes ``figures/model_sizes/`` only when asked to publish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from cs336_systems import configs
from cs336_systems.experiments.section import Section, param
from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.results import ResultWriter


@dataclass(frozen=True)
class Params:
    sizes: list[str] = param([name for name in configs.PRESETS if name != "xxl"],
                             "presets described (xxl is the accounting-only feed-forward model of §2.4)")
    context_length: int = param(512, "tokens per sequence, for attention FLOPs and activation memory")


PRESETS = {preset: Params() for preset in ("smoke", "quick", "full")}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The preset table, with every parameter count checked against the built module."""
    table = pd.DataFrame(configs.describe_presets(p.sizes, context_length=p.context_length))
    built = []
    for name in p.sizes:
        model = configs.build_model(name, context_length=p.context_length, device="meta")
        built.append(sum(x.numel() for x in model.parameters()) / 1e6)
    table["built_params_M"] = built
    worst = (table["built_params_M"] - table["params_M"]).abs().max()
    if worst > 1e-9:
        raise RuntimeError(f"the parameter calculator disagrees with the built model by {worst:g} M parameters")
    out.table(table, "presets")
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    sns.barplot(data=table, x="size", y="params_M", ax=axes[0], color="tab:blue")
    axes[0].set(ylabel="parameters (millions)", xlabel="preset", yscale="log", title="Parameters")
    sns.barplot(data=table, x="size", y="train_GFLOP_per_token", ax=axes[1], color="tab:orange")
    axes[1].set(ylabel="GFLOP per token", xlabel="preset", yscale="log",
                title=f"Training FLOPs per token (context {p.context_length})")
    for ax in axes:  # names like "10B@2026" overlap when level
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    out.figure(fig, "presets")
    plt.close(fig)
    return {"presets": table}


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import edition_rows  # noqa: E402 (answers only)
from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def answer(d: SectionData) -> list[Block]:
    table = d.frame("presets")
    if table is None or table.empty or not {"size", "params_M"} <= set(table.columns):
        return []
    filtered = "/" not in d.folder  # the workbook's grid, every preset: show this writeup's handout's models
    if filtered:
        table = edition_rows(table[table["size"] != "tiny"], d.edition).drop(columns="preset")
    big = table.loc[table["params_M"].idxmax()]
    one = "/" in d.folder and len(table) == 1  # an edition grid of its handout's one model
    text = ((f"The handout's model ({big['size']}) has" if one else f"The largest preset, {big['size']}, has")
            + f" {fmt.sig(big['params_M'])} M parameters"
            + (f"; its fp32 weights, gradients and AdamW state alone take {fmt.gib(big['weights_grads_adam_GiB'] * 2**30)}"
               " before any activation" if "weights_grads_adam_GiB" in table.columns else "") + ".")
    if {"train_GFLOP_per_token", "fwd_GFLOP_per_token"} <= set(table.columns):
        ratio = table["train_GFLOP_per_token"] / table["fwd_GFLOP_per_token"]
        text += f" A training step costs {fmt.sig(ratio.iloc[0])}× the forward FLOPs (backward = 2× forward)."
    # An edition's own grid names its models as its handout does ("xl", not the workbook's "xl@2026").
    edition = d.folder.partition("/")[2]
    shown = table.assign(size=table["size"].astype(str).str.removesuffix(f"@{edition}")) if edition else \
        (table if filtered else None)
    text = text.replace(f"@{edition}", "") if edition else text
    return [Text(text + _names_elsewhere(edition)), d.table("presets", frame=shown,
                                caption="Model presets: parameters, FLOPs per token and memory."),
            Text("", role=BEYOND_HANDOUT),  # the table is the context later sections need; the plot repeats it
            d.figure("presets", caption="Parameters and training FLOPs per token by preset.")]


SECTION = Section(
    name="model_sizes", number="1.1.2", title="Model sizes", problems=(), answer=answer, presets=PRESETS, run=run,
    gpus=0, depends=("cs336-basics/cs336_basics/", "cs336_systems/configs.py"),
    editions={"cse599o": {"sizes": ["large"]},  # CSE599-O's Table 1 holds one model (1280/5120/36/20)
              "2026": {"sizes": ["small", "medium", "large", "xl@2026", "10B@2026"]}},  # the 2026 handout's Table 1
)


def _names_elsewhere(edition: str) -> str:
    """For an edition whose table renames the workbook's models: that the other sections' tables use this table's
    names, and how they name the 2025 handout's model of a clashing name (``CS336 2025's xl``)."""
    from cs336_systems.report.answers import handout_model, join_words

    if not edition or edition not in configs.HANDOUT_SIZES_BY_EDITION or len(configs.HANDOUT_SIZES_BY_EDITION[edition]) < 2:
        return ""
    mine = [n for n in configs.HANDOUT_SIZES_BY_EDITION[edition] if "@" in n]
    if not mine:
        return ""
    clashes = [n for n in configs.HANDOUT_SIZES if n in {m.partition("@")[0] for m in mine}]
    named = join_words([f"{handout_model(n, edition)} ({'/'.join(str(v) for v in configs.model_shape(n))})"
                        for n in clashes])
    return (" The other sections name these models as this table does"
            + (f"; one that also measures the 2025 handout's {join_words(clashes)} calls it {named}." if clashes
               else "."))
