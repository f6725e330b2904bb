"""§1.1.4 Profiling the model's kernels (the handout's Nsight Systems questions, answered with
``torch.profiler`` because the GPU machines have no ``nsys``; ``python -m cs336_systems.benchmarking nsys``
runs the same model under Nsight Systems where it is installed).

Problem ``nsys_profile``: per size × context, the profiled forward time against the Python timer, the top
forward kernel and its calls per forward, matmul share in the forward pass vs a full AdamW step, and
softmax vs matmul time inside attention against their FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, ModelBenchmark
from cs336_systems.benchmarking.sweep import OK, free_memory, run_sweep
from cs336_systems.configs import HANDOUT_SIZES, attention_flops, get_config, softmax_flops
from cs336_systems.experiments.section import Section, check_positive, check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, ok_rows, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import SCRATCH_DIR, ResultWriter


@dataclass(frozen=True)
class Params:
    sizes: list[str] = param(list(HANDOUT_SIZES), "model presets to profile")
    context_lengths: list[int] = param([128, 256, 512, 1024], "contexts per preset")
    warmup: int = param(2, "untimed steps before the Python-timed forward passes")
    steps: int = param(5, "Python-timed forward passes per cell")
    profile_steps: int = param(2, "training steps recorded by the profiler per cell")
    trace_config: list[str | int] = param(["small", 256], "(preset, context) whose Chrome trace is kept in .scratch")
    budget_s: float = param(900.0, "time budget in seconds; cells past it are recorded as skipped")

    def check(self) -> None:
        check_presets(*self.sizes, str(self.trace_config[0]))
        check_positive(steps=self.steps, profile_steps=self.profile_steps, budget_s=self.budget_s,
                       **{f"context_length {c}": c for c in self.context_lengths})


PRESETS = {
    "full": Params(),
    "quick": Params(steps=3, profile_steps=1, budget_s=170.0),
    "smoke": Params(sizes=["tiny"], context_lengths=[16], warmup=1, steps=1, profile_steps=1,
                    trace_config=["tiny", 16], budget_s=60.0),
}


def attention_products(tables: list[pd.DataFrame]) -> tuple[float, float]:
    """``(matmul ms, other ms)`` of the kernel tables of attention's two product ranges: the matmuls are their
    matmul kernels; the scores' range also runs the 1/sqrt(d) scaling and the mask, elementwise passes over the
    score matrix like the softmax's, which are the other part."""
    products = pd.concat(tables)
    if products.empty:
        return 0.0, 0.0
    matmul = float(products.loc[products["category"] == "matmul", "total_ms"].sum())
    return matmul, float(products["total_ms"].sum()) - matmul


def run(p: Params, out: ResultWriter) -> dict[str, pd.DataFrame]:
    """Profile each (size, context): a Python-timed forward pass and ``profile_steps`` full training steps
    under ``torch.profiler``, reduced to per-range kernel tables."""
    from cs336_systems.profiling import category_shares, export_chrome_trace, kernel_table, profile_steps

    top_rows: list[pd.DataFrame] = []
    models: dict[str, Any] = {}
    max_ctx = max(p.context_lengths)

    def one(size: str, context_length: int) -> dict[str, Any]:
        if size not in models:  # one model per size, built for the longest context, reused
            models.clear()
            free_memory()
            models[size] = ModelBenchmark(BenchmarkSpec(size, mode="inference", context_length=max_ctx)).model
        model = models[size]
        spec = BenchmarkSpec(size, mode="forward", context_length=context_length, warmup=p.warmup, steps=p.steps)
        fwd_bench = ModelBenchmark(spec, model)
        python_fwd = fwd_bench.run()["forward"]
        train = ModelBenchmark(spec.replace(mode="train"), model)
        n = p.profile_steps
        prof = profile_steps(train.step, warmup=1, steps=n)
        del train
        if (size, context_length) == tuple(p.trace_config):
            export_chrome_trace(prof, SCRATCH_DIR / "traces" / f"{size}_ctx{context_length}_train.json")
        fwd = kernel_table(prof, "forward", per=n)
        step = kernel_table(prof, "step", per=n)
        matmul, scale_mask = attention_products(
            [kernel_table(prof, r, per=n) for r in ("computing attention scores", "final matmul")])
        softmax = kernel_table(prof, "computing softmax", per=n)["total_ms"].sum()
        for name, table in (("forward", fwd), ("step", step)):
            top_rows.append(table.head(10).assign(size=size, context_length=context_length, range=name,
                                                  rank=range(1, min(10, len(table)) + 1)))
        cfg = get_config(size)
        heads = cfg.batch_size * cfg.num_heads
        matmul_flops = attention_flops(heads, context_length, context_length, cfg.d_model // cfg.num_heads)
        top = fwd.iloc[0] if not fwd.empty else None
        non_matmul = fwd[fwd["category"] != "matmul"]
        return {
            "python_forward_ms": python_fwd.mean * 1e3,
            "python_forward_std_ms": python_fwd.std * 1e3,
            "profiled_forward_kernels_ms": fwd["total_ms"].sum(),
            "profiled_step_kernels_ms": step["total_ms"].sum(),
            "top_forward_kernel": top["name"] if top is not None else "",
            "top_kernel_calls_per_forward": top["calls"] if top is not None else math.nan,
            "top_kernel_percent": top["percent"] if top is not None else math.nan,
            "top_non_matmul_kernel": non_matmul.iloc[0]["name"] if not non_matmul.empty else "",
            "top_non_matmul_percent": non_matmul.iloc[0]["percent"] if not non_matmul.empty else math.nan,
            "matmul_percent_forward": category_shares(fwd).get("matmul", 0.0),
            "matmul_percent_train_step": category_shares(step).get("matmul", 0.0),
            "attention_matmul_ms": matmul,
            "attention_scale_mask_ms": scale_mask,
            "attention_softmax_ms": softmax,
            "softmax_to_matmul_time": softmax / matmul if matmul else math.nan,
            "softmax_to_matmul_flops": softmax_flops(heads, context_length, context_length) / matmul_flops,
        }

    configs = [{"size": s, "context_length": c} for s in p.sizes for c in p.context_lengths]
    summary = run_sweep(one, configs, desc="profiling", budget_s=p.budget_s)
    models.clear()
    free_memory()
    out.table(summary, "summary", extra={"profiler": "torch.profiler", "ranges": "forward / step (fwd+bwd+AdamW)"})
    top = pd.concat(top_rows, ignore_index=True) if top_rows else pd.DataFrame()
    if not top.empty:
        top = top[["size", "context_length", "range", "rank", "name", "calls", "total_ms", "avg_us", "percent", "category"]]
    out.table(top, "top_kernels")
    ok = summary[summary["status"] == OK]
    if not ok.empty:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        long = pd.concat([
            ok.assign(where="forward", matmul_percent=ok["matmul_percent_forward"]),
            ok.assign(where="train step", matmul_percent=ok["matmul_percent_train_step"]),
        ])
        long["config"] = long["size"] + "/" + long["context_length"].astype(str)
        sns.barplot(long, x="config", y="matmul_percent", hue="where", ax=ax)
        ax.tick_params(axis="x", rotation=60)
        ax.set(ylabel="% of GPU kernel time in matmuls", xlabel="size / context")
        out.figure(fig, "matmul_share")
        plt.close(fig)
    return {"summary": summary, "top_kernels": top}



# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.profiling.torch_profiler import short_kernel  # noqa: E402 (answers only)
from cs336_systems.report.data import short_device  # noqa: E402 (answers only)


def _largest_ok(df: pd.DataFrame) -> pd.Series | None:
    """The row of the largest model at its longest context (the summary's most informative row)."""
    ok = ok_rows(df)
    if ok.empty:
        return None
    key = ok.assign(_s=ok["size"].map(_parameters), _c=ok.get("context_length", 0))
    return ok.loc[key.sort_values(["_s", "_c"]).index[-1]]


def _parameters(size: object) -> float:
    from cs336_systems.configs import param_counts

    try:
        return float(param_counts(str(size))["total"])
    except (KeyError, ValueError):
        return -1.0


def _status_words(status: str) -> str:
    """A failed cell's status as the answers say it."""
    return "out of memory" if status == "OOM" else str(status)


def _longest_fit(df: pd.DataFrame | None) -> str:
    """Per size, the longest context that ran and the shortest that did not (the grid's memory limit)."""
    from cs336_systems.report.answers import join_words

    if df is None or not {"size", "context_length", "status"} <= set(df.columns):
        return ""
    parts = []
    for size, g in df.groupby("size", sort=False):
        ran = g[g["status"] == "ok"]["context_length"]
        failed = g[(g["status"] != "ok") & (g["context_length"] > (ran.max() if not ran.empty else 0))]
        if failed.empty:
            continue  # every context ran: the grid did not reach this size's limit
        first = failed.sort_values("context_length").iloc[0]
        why = _status_words(first["status"])
        parts.append(f"{size} up to {int(ran.max()):,} ({int(first['context_length']):,}: {why})" if not ran.empty
                     else f"{size} at none of its contexts ({why})")
    return ("The longest context each size trained at on this GPU: " + join_words(parts) + ".") if parts else ""


def _grid_sentence(df: pd.DataFrame | None) -> str:
    """The profiled grid in one sentence: sizes, contexts, how many ran, and the cells that did not (the
    handout asks to note where a size runs out of memory)."""
    from cs336_systems.report.answers import join_words

    if df is None or not {"size", "context_length", "status"} <= set(df.columns) or df.empty:
        return ""
    sizes = list(dict.fromkeys(df["size"].astype(str)))
    contexts = sorted({int(c) for c in df["context_length"]})
    failed = df[df["status"] != "ok"]
    oom = failed[failed["status"] == "OOM"]
    cells = [f"{r['size']} at {int(r['context_length']):,} ({_status_words(r['status'])})"
             for _, r in failed.drop(oom.index).iterrows()]
    return (f"Profiled: {join_words(sizes)} at contexts {join_words([f'{c:,}' for c in contexts])}, "
            + (f"{len(df) - len(failed)} of {len(df)} configurations" if len(failed) else f"all {len(df)} "
               "configurations")
            + (f"; out of memory: {join_words([f'{r.size} at {int(r.context_length):,}' for r in oom.itertuples()])}"
               if len(oom) else "")
            + (f"; not run: {join_words(cells)}" if cells else "") + ". ")


def _why_these_sizes(summary: pd.DataFrame) -> str:
    """Where the grid profiles two sizes (the 2026 handout's choice of two): why a small and a large one."""
    sizes = list(dict.fromkeys(summary["size"].astype(str)))
    if len(sizes) != 2:
        return ""
    return (f" Two sizes, {sizes[0]} and {sizes[1]}: the smaller shows the launch overhead of short kernels, the "
            "larger the matmuls that dominate at scale.")


def _profiles(summary: pd.DataFrame) -> pd.DataFrame:
    return summary[summary["status"] == "ok"] if "status" in summary.columns else summary


def _one_sentence(first: str, second: str) -> str:
    """Two sentences (each with its leading space, or empty) joined into one by a semicolon: the handout asks
    for one or two sentences."""
    if not first or not second:
        return first + second
    second = second.strip()
    return f"{first.rstrip('.')}; {second[0].lower()}{second[1:]}"


def _across(summary: pd.DataFrame, kernel: str, percent: str, what: str) -> str:
    """The same answer for every profile, in one sentence: which kernel it is, in how many profiles, and its
    share's range (the handout asks each profile's)."""
    ok = _profiles(summary)
    if len(ok) < 2 or not {kernel, percent} <= set(ok.columns):
        return ""
    counts = ok[kernel].map(short_kernel).value_counts()
    names = [f"`{k}` in {n}" for k, n in counts.items()]
    return (f" Across all {len(ok)} profiles {what} is " + join_words(names) + f", with {fmt.pct(ok[percent].min() / 100)}"
            f"–{fmt.pct(ok[percent].max() / 100)} of the forward kernel time.")


def _softmax_across(summary: pd.DataFrame) -> str:
    ok = _profiles(summary)
    if len(ok) < 2 or not {"softmax_to_matmul_time", "softmax_to_matmul_flops"} <= set(ok.columns):
        return ""
    per_flop = ok["softmax_to_matmul_time"] / ok["softmax_to_matmul_flops"]

    def span(values: pd.Series, form: Any) -> str:
        low, high = form(values.min()), form(values.max())
        return low if low == high else f"{low}–{high}"

    return (f" Across all {len(ok)} profiles the softmax takes {span(ok['softmax_to_matmul_time'], fmt.ratio)} the "
            f"matmuls' time for {span(ok['softmax_to_matmul_flops'], fmt.ratio)} their FLOPs, "
            f"{span(per_flop, fmt.sig)} times the time per FLOP.")


def _reconciled(d: SectionData) -> str | None:
    """How this section's Python-timed forwards compare with §1.1.3's, §1.1.5's and §1.3's of the same models."""
    from cs336_systems.report.agreement import reconcile

    from cs336_systems.experiments import SECTIONS

    def section(folder: str) -> str:
        spec = SECTIONS.get(folder.split("/")[0])
        return f"§{spec.number}" if spec is not None else folder

    return reconcile(d.root, d.folder, "summary", "The Python-timed forward passes", section)


def _matmul_shares(summary: pd.DataFrame) -> Text:
    """(d): the matmul share of the kernel time in the forward and in the training step, and the other kernels'."""
    mm = ok_rows(summary)
    fwd_share, step_share = mm["matmul_percent_forward"], mm["matmul_percent_train_step"]
    others_fwd, others_step = 100 - fwd_share, 100 - step_share
    return Text(f"Matmuls take {fmt.pct(fwd_share.min() / 100)}–{fmt.pct(fwd_share.max() / 100)} of the kernel "
                f"time in the forward pass and {fmt.pct(step_share.min() / 100)}–{fmt.pct(step_share.max() / 100)}"
                " of a full training step, so the other kernels take "
                f"{fmt.pct(others_fwd.min() / 100)}–{fmt.pct(others_fwd.max() / 100)} of the forward and "
                f"{fmt.pct(others_step.min() / 100)}–{fmt.pct(others_step.max() / 100)} of the step"
                + (": the AdamW update (elementwise over every parameter) and the backward of the elementwise "
                   "ops add non-matmul time." if (step_share < fwd_share).mean() > 0.5 else ".")
                + _per_configuration(mm.assign(drop=fwd_share - step_share)))


def _per_configuration(mm: pd.DataFrame) -> str:
    """How the share moves within each configuration (``drop``: forward share minus step share, in points),
    which the ranges above do not show."""
    drop = mm["drop"]
    if not (drop > 0).all():
        return f" The share falls in {int((drop > 0).sum())} of {len(drop)} configurations."
    shortest = {"size", "context_length"} <= set(mm.columns) and all(
        g.sort_values("context_length")["drop"].iloc[0] == g["drop"].max() for _, g in mm.groupby("size", sort=False))
    return (f" In every configuration the share falls, by {fmt.sig(drop.min(), 2)}–{fmt.sig(drop.max(), 2)} points"
            + (", most at each size's shortest context, where the optimizer update (fixed per parameter) weighs "
               "most against matmul work that grows with the tokens." if shortest else "."))


def _share_above_one(x: float) -> str:
    """``x`` as a percentage with two significant digits, or as many more as show it above 100% where it is."""
    digits = 2
    while x > 1 and digits < 8 and float(fmt.pct(x, digits).rstrip("%").replace(",", "")) <= 100:
        digits += 1
    return fmt.pct(x, digits)


def answer(d: SectionData) -> list[Block]:
    summary = d.frame("summary")
    top = d.frame("top_kernels")
    row = _largest_ok(summary) if summary is not None else None
    where = f"{row['size']} at context {int(row['context_length'])}" if row is not None else ""

    def part(caption: str, *cols: str):
        frame = subset(summary, "size", "context_length", *cols)
        if frame is not None:
            frame = frame.copy()
            for col in ("top_forward_kernel", "top_non_matmul_kernel"):
                if col in frame.columns:
                    frame[col] = frame[col].map(short_kernel)
        return d.table("summary", caption=caption, frame=frame)

    a = b = c = dd = e = a_more = b_more = e_more = matches = intro = None
    if row is not None:
        ratios = ok_rows(summary)["profiled_forward_kernels_ms"] / ok_rows(summary)["python_forward_ms"]
        device = short_device(d.meta("summary"))
        a = Text(f"For {where} on the {device} the profiled kernels sum to "
                 f"{fmt.ms(row['profiled_forward_kernels_ms'])} per forward pass against "
                 f"{fmt.ms(row['python_forward_ms'])} from the Python timer, and over all {len(ratios)} profiles "
                 f"to {fmt.pct(ratios.min(), 2)}–{_share_above_one(ratios.max())} of the timed pass: the rest is the GPU "
                 "idle between kernels (launch overhead, most at small models and short contexts)"
                 + (", and above 100% a profiled pass ran slower than the timed one." if ratios.max() > 1 else "."))
        # (a) asks for 1-2 sentences: the other sections' timings of the same passes are the appendix's
        matches = _reconciled(d)
        intro = Text("Nsight Systems is not installed on these machines, so we profiled with PyTorch's profiler, "
                     "which reads the same CUDA kernel records (CUPTI); the model's NVTX ranges mark the same regions. "
                     + _grid_sentence(summary).strip()
                     + _why_these_sizes(summary))
        a_more = _longest_fit(summary) or None
        step_top, step_matmul = None, False
        if top is not None and {"range", "rank", "name"} <= set(top.columns):
            sel = top[(top["size"] == row["size"]) & (top["context_length"] == row["context_length"])
                      & (top["range"] == "step") & (top["rank"] == 1)]
            step_top = sel["name"].iloc[0] if not sel.empty else None
            step_matmul = not sel.empty and "category" in sel and sel["category"].iloc[0] == "matmul"
        # The step's profile is forward, backward and the optimizer; the optimizer runs no matrix products, so a
        # matmul that leads the step leads forward and backward together, which is what the handout asks.
        scope = ("forward and backward together (profiled as the training step, whose optimizer runs no matrix "
                 "products)" if step_top and step_matmul else "the full training step")
        same = (f"the same kernel also leads {scope}" if step_top == row["top_forward_kernel"]
                else f"in {scope} `{short_kernel(step_top)}` leads instead" if step_top else "")
        b = Text(f"For {where} the kernel with the most GPU time in the forward pass is "
                 f"`{short_kernel(row['top_forward_kernel'])}`, {fmt.pct(row['top_kernel_percent'] / 100)} of the forward "
                 f"kernel time, launched {fmt.count(row['top_kernel_calls_per_forward'])} times per forward pass"
                 + _calls_per_block(row)
                 + (f"; {same}." if same else ".") + _step_leaders(top, summary))
        b_more = _across(summary, "top_forward_kernel", "top_kernel_percent", "the top forward kernel").strip()
        c = Text(f"For {where}, " + (_non_matmul(top, row) or
                 f"the largest non-matmul kernel is `{short_kernel(row['top_non_matmul_kernel'])}` with "
                 f"{fmt.pct(row['top_non_matmul_percent'] / 100)} of the forward time")
                 + ": elementwise kernels that read and write whole activations for a few FLOPs each, so they are "
                 "memory bound and take time out of proportion to their FLOPs."
                 + _across(summary, "top_non_matmul_kernel", "top_non_matmul_percent", "the largest non-matmul kernel"))
        dd = _matmul_shares(summary)
        per_flop = row["softmax_to_matmul_time"] / row["softmax_to_matmul_flops"]
        e = Text(f"For {where}, attention's softmax takes {fmt.ratio(row['softmax_to_matmul_time'])} the time of "
                 f"its two matmuls for {fmt.ratio(row['softmax_to_matmul_flops'])} their FLOPs, the ratio "
                 "$5 / (4 d_h)$ of about 5 FLOPs per score (the max, subtraction, exponential, sum and division) to "
                 "$2 \\cdot 2T^2 d_h$ for $QK^\\top$ and $PV$ per head; that is "
                 f"{fmt.sig(per_flop)} times the time per FLOP"
                 + (f": the matmuls are compute-bound GEMMs ({_gemm_kind(row['top_forward_kernel'])}) that "
                    "reuse each loaded element many times, while the softmax reads and writes the whole score "
                    "matrix several times for a few FLOPs per element and is limited by memory bandwidth."
                    if per_flop > 1 else ".")
                 + ("" if "attention_scale_mask_ms" in row and pd.notna(row["attention_scale_mask_ms"]) else
                    " (This run counted the score scaling and the mask, which share the scores' range, as matmul "
                    "time, so the softmax's share is understated.)"))
        e_more = _softmax_across(summary).strip()
    grid = [part("Forward time: Python timer vs. the sum of profiled kernels.", "python_forward_ms",
                 "python_forward_std_ms", "profiled_forward_kernels_ms", "profiled_step_kernels_ms"),
            part("Top kernels of the forward pass.", "top_forward_kernel", "top_kernel_calls_per_forward",
                 "top_kernel_percent", "top_non_matmul_kernel", "top_non_matmul_percent"),
            part("Attention's matmuls vs. its softmax, time and FLOPs.", "attention_matmul_ms",
                 "attention_scale_mask_ms", "attention_softmax_ms", "softmax_to_matmul_time",
                 "softmax_to_matmul_flops")]
    # The handout asks (a)-(e) "for each profile": the sentences take one configuration, this table every one
    each = None
    parts_of = {"a": (("python_forward_ms", "profiled_forward_kernels_ms"), "the forward pass by the Python timer "
                      "and by the sum of its profiled kernels (a)"),
                "b": (("top_forward_kernel", "top_kernel_calls_per_forward", "top_kernel_percent"), "the forward's "
                      "top kernel, its launches per pass and its share of the forward's kernel time (b)"),
                "e": (("softmax_to_matmul_time", "softmax_to_matmul_flops"), "attention's softmax against its two "
                      "matmuls, as a ratio of times and of FLOPs (e)")}
    present = {k: v for k, v in parts_of.items() if summary is not None and set(v[0]) <= set(summary.columns)}
    if present and "status" in summary.columns and len(ok_rows(summary)):
        frame = subset(ok_rows(summary), "size", "context_length", *(c for cols, _ in present.values() for c in cols))
        if "top_forward_kernel" in frame.columns:
            frame = frame.assign(top_forward_kernel=frame["top_forward_kernel"].map(short_kernel))
        each = d.table("summary", frame=frame, caption="Every profile: "
                       + "; ".join(words for _, words in present.values()) + ".")
    # An answer in words needs no "not measured yet": the tables and plot behind it continue in the appendix.
    return [
        *([intro] if intro is not None else []),
        question(d, "a", "Total forward time from the profiler, compared with the Python timer.", [a, each],
                 what=None if a else "profiled forward-pass time"),
        question(d, "b", "The kernel with the most cumulative GPU time in the forward pass; how often it runs; "
                 "whether a full training step changes that.", [b],
                 what=None if b else "kernel table of the forward pass"),
        question(d, "c", "Non-matmul kernels with non-trivial runtime in the forward pass.", [c],
                 what=None if c else "kernel categories of the forward pass"),
        question(d, "d", "How the matmul share of GPU time changes for a full training step with AdamW.",
                 [dd, part("Share of kernel time in matmuls (%), forward pass and training step, per "
                           "configuration.", "matmul_percent_forward", "matmul_percent_train_step")],
                 what=None if dd else "kernel shares of a training step"),
        question(d, "e", "Softmax versus matmul runtime inside self-attention, against their FLOP ratio.", [e],
                 what=None if e else "softmax vs matmul timings inside attention"),
        # The answers above quote one configuration; every size and context is the appendix's.
        Text("", role=BEYOND_HANDOUT),
        *([question(d, "a", "The timed forward passes against the other sections', and the longest contexts.",
                    [Text(t) for t in (matches, a_more) if t])] if matches or a_more else []),
        *([question(d, "b", "The top kernels of every profile.", [Text(b_more)])] if b_more else []),
        *([question(d, "e", "Softmax against matmuls in every profile.", [Text(e_more)])] if e_more else []),
        *([Text("The ten largest kernels behind (b) and (c), and the matmul share behind (d).")]
          if row is not None else []),
        *[b for b in (_top_kernels(d, top, row),
                      d.figure("matmul_share", caption="Share of GPU kernel time spent in matmuls.")) if b is not None],
        *([Text("Every size and context behind the answers (a), (b), (d) and (e) of this section.")]
          + [t for t in grid if t is not None] if any(t is not None for t in grid) else []),
    ]


#: What the elementwise kernels of the model's forward compute, by a part of their short name.
#: An exact short name first (the broadcasting ``elementwise_kernel`` and the contiguous
#: ``vectorized_elementwise_kernel`` of one functor are different operations of the model), else a part of it.
_KERNEL_OPS = (("elementwise_kernel<DivFunctor>", "the softmax's division by its row sums"),
               ("elementwise_kernel<CUDAFunctor_add>", "the softmax's subtraction of its row maxima"),
               ("vectorized_elementwise_kernel<CUDAFunctor_add>", "the residual additions"),
               ("masked_fill", "the causal mask"), ("exp_kernel", "the softmax's exponential"),
               ("direct_copy", "copies to contiguous memory (the heads' transposes)"), ("silu", "SwiGLU's SiLU"))


#: Kernels the short name cannot tell apart, by a part of the full name: a tensor times a Python scalar runs as
#: ``BUnaryFunctor<…MulFunctor…>``, and the model's only such multiply in the forward is the score scaling
#: (``scores / math.sqrt(d)`` multiplies by the reciprocal).
_FULL_NAME_OPS = (("BUnaryFunctor<float, float, float, at::native::binary_internal::MulFunctor",
                   "the $1/\\sqrt{d}$ score scaling, a multiply by the reciprocal"),)


def _calls_per_block(row: pd.Series) -> str:
    """The top kernel's launch count as so many per block plus the rest (the LM head's), so it can be checked."""
    try:
        calls, layers = int(row["top_kernel_calls_per_forward"]), get_config(str(row["size"])).num_layers
    except (KeyError, TypeError, ValueError):
        return ""
    per, rest = divmod(calls, layers)
    if not per or rest > 1:  # not so many per block plus at most the LM head: no count worth decomposing
        return ""
    return f" ({per} per block × {layers} blocks" + (f" + {rest}, the LM head's" if rest else "") + ")"


def _step_leaders(top: pd.DataFrame | None, summary: pd.DataFrame) -> str:
    """Across the profiles: in how many the training step's top kernel is the forward's, and the profiles whose
    step is led by a kernel that is not a matmul (named, with its share of the step)."""
    if top is None or not {"range", "rank", "name", "percent", "category"} <= set(top.columns):
        return ""
    first = top[(top["range"] == "step") & (top["rank"] == 1)]
    ok = summary[summary["status"] == "ok"] if "status" in summary.columns else summary
    merged = ok.merge(first, on=["size", "context_length"])
    if merged.empty:
        return ""
    same_kernel = merged["name"] == merged["top_forward_kernel"]
    other = merged[merged["category"] != "matmul"]
    another_gemm = int((~same_kernel & (merged["category"] == "matmul")).sum())
    text = f" The training step's top kernel is the forward's in {int(same_kernel.sum())} of {len(merged)} profiles"
    if another_gemm:
        text += (f", another matmul kernel (the backward's products, of other shapes and transposes) in "
                 f"{another_gemm}")
    if other.empty:
        return text + "."
    cells = [f"{r['size']} at {int(r['context_length']):,} (`{short_kernel(r['name'])}`, "
             f"{fmt.pct(r['percent'] / 100)} of the step)" for _, r in other.iterrows()]
    return (text + f"; in {join_words(cells)} it is not a matmul: the softmax over the scores grows as $T^2$, most "
            "of the matmul work as $T$.")


def _non_matmul(top: pd.DataFrame | None, row: pd.Series, n: int = 5) -> str:
    """The largest non-matmul kernels of ``row``'s forward profile, with their share and (where known) the
    model's operation, and all non-matmul kernels' share; "" without the kernel table."""
    if top is None or not {"range", "rank", "name", "percent", "category"} <= set(top.columns):
        return ""
    mine = top[(top["size"] == row["size"]) & (top["context_length"] == row["context_length"])
               & (top["range"] == "forward") & (top["category"] != "matmul")].sort_values("rank").head(n)
    if mine.empty:
        return ""
    parts = []
    for _, r in mine.iterrows():
        name = short_kernel(r["name"])
        op = next((words for key, words in _KERNEL_OPS if key == name), None) or next(
            (words for key, words in _KERNEL_OPS if "<" not in key and key in name), None) or next(
            (words for key, words in _FULL_NAME_OPS if key in str(r["name"])), None)
        parts.append(f"`{name}` {fmt.pct(r['percent'] / 100)}" + (f" ({op})" if op else ""))
    share = (f"non-matmul kernels take {fmt.pct(1 - row['matmul_percent_forward'] / 100)} of the forward kernel "
             "time; the largest are " if "matmul_percent_forward" in row else "the largest non-matmul kernels are ")
    return share + join_words(parts)


def _gemm_kind(kernel: object) -> str:
    """What the profiled GEMM kernel's name says about the hardware path it takes."""
    name = str(kernel).lower()
    if "simt" in name or "sgemm" in name or ("f32f32" in name and "tf32" not in name):
        return "fp32 with TF32 off: CUDA-core FFMA kernels, not tensor cores"
    if any(tag in name for tag in ("bf16", "f16", "h16", "tf32", "s16816", "wgmma", "sm90_xmma", "tensorop")):
        return "tensor-core kernels"
    return "cuBLAS GEMM kernels"


def _top_kernels(d: SectionData, top: pd.DataFrame | None, row: pd.Series | None):
    if top is None or row is None or "range" not in top.columns:
        return None
    sel = top[(top["size"] == row["size"]) & (top["context_length"] == row["context_length"])
              & (top["range"] == "forward")]
    sel = subset(sel, "rank", "name", "category", "calls", "total_ms", "avg_us", "percent")
    if sel is not None and "name" in sel.columns:
        sel = sel.assign(name=sel["name"].map(short_kernel))
    return d.table("top_kernels", frame=sel, caption=f"The ten kernels with the most forward-pass time, "
                   f"{row['size']} at context {int(row['context_length'])} (all configurations: the CSV).")



SECTION = Section(
    name="nsys_profile", number="1.1.4", title="Profiling the forward and backward passes",
    problems=("nsys_profile",), answer=answer, presets=PRESETS, run=run,
    # 2026: two sizes at three power-of-two contexts above 128 each, up to the longest that fits. large is
    # the largest 2026 size with three such contexts on 80 GB (xl@2026 fits 256 and 512 only); the grid runs
    # one context past the longest small fitted on an H200 (4,096), so each size's limit is found, not assumed.
    editions={"2026": {"sizes": ["small", "large"], "context_lengths": [256, 512, 1024, 2048, 4096, 8192]}},
    depends=(*MODEL, *TIMING, "cs336_systems/profiling/torch_profiler.py"),
)
