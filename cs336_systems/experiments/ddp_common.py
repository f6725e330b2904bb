"""What the four DDP sections share (§2.2 naive, §2.3.1 flat, §2.3.2 overlapping, §2.3.3 bucketed): their
parameters, the run (one DDP step benchmark per autocast setting, written into the section's folder) and
the answer pieces about step tables. Each section module chooses the modes it runs and shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.benchmarking import ddp_steps
from cs336_systems.benchmarking.ddp_overhead_model import fit_latency_bandwidth, optimal_bucket_size_bytes
from cs336_systems.configs import get_config, param_counts
from cs336_systems.experiments.section import check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import handout_model, join_words, question, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.measured_code import MODEL
from cs336_systems.results import ResultWriter

#: What every DDP section's results depend on beyond its own module.
DEPENDS = (*MODEL, "cs336_systems/distributed/grad_sync.py", "cs336_systems/distributed/consistency.py",
           "cs336_systems/distributed/strategies.py", "cs336_systems/distributed/launch.py",
           "cs336_systems/distributed/runner.py", "cs336_systems/benchmarking/ddp_steps.py",
           "cs336_systems/benchmarking/allreduce.py",
           "cs336_systems/profiling/timeline.py", "cs336_systems/cuda_graphs.py", "cs336_systems/checks/",
           "cs336_systems/experiments/ddp_common.py")


@dataclass(frozen=True)
class DDPParams:
    preset: str = param("xl", "model preset")
    autocast: list[str] = param(["fp32", "bf16"], "compute precision per run: fp32 and/or bf16 autocast")
    nproc: list[int] = param([2], "world sizes, one run each (GPUs with NCCL, or CPU processes with gloo); the "
                                  "first is the run the answers discuss, several add a scaling table")
    batch_per_rank: int = param(2, "sequences per rank per step")
    context_length: int = param(512, "tokens per sequence")
    warmup: int = param(3, "untimed steps per variant")
    steps: int = param(10, "timed steps per variant")
    backend: str | None = param(None, "nccl or gloo (None: nccl with GPUs, else gloo)")

    def check(self) -> None:
        check_presets(self.preset)
        if not self.nproc or any(n < 2 for n in self.nproc):
            raise ValueError(f"data parallelism needs world sizes >= 2, got nproc={self.nproc}")
        if len(set(self.nproc)) != len(self.nproc):
            raise ValueError(f"nproc lists a world size twice: {self.nproc}")


def ddp_presets(params_type: type = DDPParams, **smoke: Any) -> dict[str, Any]:
    """``full``: the handout's XL setup; ``quick``: fewer steps; ``smoke``: the tiny preset on gloo CPU ranks."""
    return {
        "full": params_type(),
        "quick": params_type(warmup=2, steps=5),
        "smoke": params_type(preset="tiny", autocast=["fp32"], context_length=get_config("tiny").context_length,
                             warmup=1, steps=2, **smoke),
    }


def run_ddp(section: str, p: DDPParams, out: ResultWriter, run_modes: list[str], **config: Any) -> dict[str, Any]:
    """Time ``run_modes`` next to each other (one run per autocast setting) and write the section's tables;
    before timing, every strategy is checked against single-process training on the toy model, and a
    mismatch fails the run."""
    shown, timelines = ddp_steps.NOTEBOOK_SECTIONS[section]
    written: dict[str, Any] = {}
    scaling = []
    for n in p.nproc:
        for i, ac in enumerate(p.autocast):
            cfg = ddp_steps.DDPBenchConfig(preset=p.preset, context_length=p.context_length,
                                           batch_per_rank=p.batch_per_rank, autocast=ac, modes=run_modes,
                                           warmup=p.warmup, steps=p.steps, profile=timelines,
                                           check_toy=i == 0 and n == p.nproc[0], **config)
            cfg.validate()
            result = ddp_steps.run_benchmark(cfg, n, p.backend)
            # The first world size writes the tables the answers read; the others are tagged with theirs.
            name = "steps" if n == p.nproc[0] else f"np{n}"
            w = ddp_steps.write_section(out, result, cfg, name=name, modes=shown, timelines=timelines)
            written[ac if n == p.nproc[0] else f"{ac}_np{n}"] = w
            plt.close("all")
            failed = [r["variant"] for r in result.get("equivalence", []) if not r["ok"]]
            if failed:
                raise RuntimeError(f"strategies that do not match single-process training on the toy model: {failed}")
            scaling.append(w["steps"].assign(world_size=n, autocast=ac))
            print(f"world size {n}, {ac}:")
            print(w["steps"][ddp_steps.STEP_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if len(p.nproc) > 1:
        written["scaling"] = table = scaling_table(pd.concat(scaling, ignore_index=True))
        out.table(table, "scaling", extra={"throughput": "sequences per second over all ranks"})
        fig = plot_scaling(table, f"{p.preset}, {p.batch_per_rank}x{p.context_length} tokens per rank")
        out.figure(fig, "scaling")
        plt.close(fig)
    return written


def scaling_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Step time and throughput by world size, one row per (autocast, variant, world size): weak scaling,
    the batch per rank fixed, so an ideal strategy keeps the step time and multiplies the throughput.
    ``scaling_efficiency`` here is against the first single-GPU row of the autocast setting, the eager one; the
    writeup re-pairs each captured row with the captured single-GPU step (:func:`_paired_efficiency`)."""
    need = {"variant", "mode", "step_ms", "world_size", "autocast", "batch_per_rank"}
    if not need <= set(steps.columns):
        raise ValueError(f"step tables lack {sorted(need - set(steps.columns))}")
    d = steps[steps["mode"] != "single"].copy()
    d["sequences_per_s"] = d["world_size"] * d["batch_per_rank"] * 1e3 / d["step_ms"]
    single = steps[steps["mode"] == "single"].groupby(["autocast", "world_size"])["step_ms"].first()
    d["scaling_efficiency"] = [single.get((a, n), float("nan")) / t for a, n, t in
                               zip(d["autocast"], d["world_size"], d["step_ms"])]
    cols = ["autocast", "variant", "world_size", "step_ms", "sequences_per_s", "scaling_efficiency"]
    return d[cols].sort_values(["autocast", "variant", "world_size"]).reset_index(drop=True)


def plot_scaling(table: pd.DataFrame, title: str) -> plt.Figure:
    """Throughput against world size, one line per variant and autocast setting, with ideal scaling dotted."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (ac, variant), g in table.groupby(["autocast", "variant"], sort=False):
        ax.plot(g["world_size"], g["sequences_per_s"], marker="o", label=f"{variant} ({ac})")
    ax.set_xlabel("GPUs (world size)")
    ax.set_ylabel("sequences per second")
    ax.set_xticks(sorted(table["world_size"].unique()))
    ax.set_title(title, loc="left")
    ax.legend(fontsize=9)
    return fig


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import known, mfu_note, spread, step_mfu, step_verdict  # noqa: E402  (answers only)
from cs336_systems.report.document import BEYOND_HANDOUT  # noqa: E402  (answers only)


def other_precision_name(d: SectionData, shown: str | None) -> str | None:
    """The step table of the run's other precision (``steps_<preset>_bf16`` beside ``_fp32``), if measured."""
    other = [n for n in d.tables if n.startswith("steps") and n != shown and n.endswith(("_bf16", "_fp32"))
             and not n.endswith(("_timeline", "_overlap"))]
    return other[0] if other and shown is not None else None


def other_precision_table(d: SectionData, shown: str | None) -> pd.DataFrame | None:
    """The eager rows of the run's other precision (:func:`other_precision_name`), if measured."""
    other = other_precision_name(d, shown)
    return eager_rows(d.frame(other)).assign(precision="bf16 autocast" if other.endswith("_bf16") else "fp32") \
        if other else None


def outlier_note(r: Any) -> str:
    """Where one slow step inflates a row's mean (its spread over 5% of the mean and the median clearly below),
    a clause giving the median, which the comparison should read instead; else empty."""
    mean, std, median = (known(r.get(k)) for k in ("step_ms", "step_ms_std", "step_ms_median"))
    if mean is None or std is None or median is None or std < 0.05 * mean or mean - median < 0.02 * mean:
        return ""
    return (f" (a few slow steps inflate this mean, ±{fmt.ms(std)}; the median step is {fmt.ms(median)}, the "
            "better comparison)")


def published_fit(allreduce: SectionData, backend: str = "nccl", world_size: int = 2) -> dict | None:
    """Per-call latency ``o`` (s) and algorithm bandwidth ``w`` (bytes/s) from §2.1's own latency-bandwidth
    fit (``allreduce_alpha_beta``: t = 2(p-1) alpha + 2 (p-1)/p n/B, so o = 2(p-1) alpha and w = B p / (2(p-1))),
    so every section quotes the one cost model; else fitted here to its raw times."""
    fit = allreduce.frame("allreduce_alpha_beta")
    if fit is not None and {"backend", "world_size", "alpha_us", "bandwidth_GBps"} <= set(fit.columns):
        hit = fit[(fit["backend"] == backend) & (fit["world_size"] == world_size)]
        if len(hit):
            r, p = hit.iloc[0], world_size
            return {"o": 2 * (p - 1) * float(r["alpha_us"]) * 1e-6, "w": float(r["bandwidth_GBps"]) * 1e9 * p / (2 * (p - 1)),
                    "alpha_us": float(r["alpha_us"]), "backend": backend, "world_size": world_size,
                    "points": int(known(r.get("points")) or 0)}
    return allreduce_fit(allreduce.frame("allreduce"), backend, world_size)


def allreduce_fit(frame: pd.DataFrame | None, backend: str = "nccl", world_size: int = 2) -> dict | None:
    """Latency ``o`` (s) and algorithm bandwidth ``w`` (bytes/s) fitted to measured all-reduce times."""
    if frame is None or not {"backend", "world_size", "size_bytes", "time_ms"} <= set(frame.columns):
        return None
    sel = frame[(frame["backend"] == backend) & (frame["world_size"] == world_size)].dropna(subset=["time_ms"])
    if sel["size_bytes"].nunique() < 2:
        return None
    try:
        o, w = fit_latency_bandwidth(sel["size_bytes"].to_numpy(float), sel["time_ms"].to_numpy(float) / 1e3)
    except ValueError:
        return None
    return {"o": o, "w": w, "backend": backend, "world_size": world_size, "points": len(sel)}


def _preferred(names: list[str]) -> list[str]:
    """Several runs of one table (``<kind>_<preset>_<dtype>``): the XL fp32 one first."""
    return sorted(names, key=lambda n: ("_xl_" not in n + "_", "fp32" not in n, n))


def named(names: list[str], kind: str) -> str | None:
    """The table/figure of ``kind`` (``overlap``, ``timeline``, ...), named ``kind_*`` or ``*_kind``."""
    hits = [n for n in names if n.startswith(kind + "_") or n.endswith("_" + kind)]
    return _preferred(hits)[0] if hits else None


def _model_column(d: SectionData, name: str, kind: str) -> str | None:
    """The model of result ``<kind>_<preset>_<dtype>``, from its run's step table (``steps_<preset>_<dtype>``),
    for records that lack it (older records lost it to the run's preset)."""
    suffix = name.removeprefix(kind + "_") if name.startswith(kind + "_") else ""
    frame = d.frame(f"steps_{suffix}") if suffix else None
    if frame is None or "preset" not in frame.columns or frame["preset"].nunique() != 1:
        return None
    return str(frame["preset"].iloc[0])


def steps_table(d: SectionData) -> tuple[str | None, pd.DataFrame | None]:
    """The section's step-time table: ``steps_<preset>_<dtype>`` (the XL fp32 one when several)."""
    names = [n for n in d.tables if n.startswith("steps") and not n.endswith(("_timeline", "_overlap"))]
    if not names:
        return None, None
    name = _preferred(names)[0]
    return name, d.frame(name)


_MODE_ALIASES = {"overlap": ("individual", "overlap")}


def row(df: pd.DataFrame | None, mode: str) -> pd.Series | None:
    if df is None or "mode" not in df.columns:
        return None
    sel = df[df["mode"].isin(_MODE_ALIASES.get(mode, (mode,)))]
    return sel.iloc[0] if len(sel) else None


def _calls(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """A step table's bucket count under what it counts: a bucket is one all-reduce, and naive DDP's "buckets"
    are its per-parameter calls."""
    return None if frame is None else mib_labels(frame.rename(columns={"num_buckets": "all_reduce_calls"}))


def mib_labels(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """Variant names with their bucket caps in the unit the caps are in: ``bucketed (1MB)`` is a cap of 1 MiB."""
    if frame is None or "variant" not in frame.columns:
        return frame
    return frame.assign(variant=frame["variant"].astype(str).str.replace(r"\((\d[\d.]*)MB", r"(\1 MiB", regex=True))


def steps_blocks(d: SectionData, name: str | None, caption: str, eager_only: bool = False):
    if name is None:
        return None
    rows = step_mfu(d.frame(name), d.meta(name))
    # the median beside the mean: answers compare medians where one slow step moves a mean of ten
    frame = subset(eager_rows(rows) if eager_only else rows, "variant", "num_buckets", "step_ms", "step_ms_median",
                   "step_ms_std", "fwd_bwd_ms", "sync_ms", "optimizer_ms", "overhead_ms", "vs_single", "MFU_pct")
    frame = _calls(frame)
    precisions = tuple(rows["autocast"].dropna().astype(str).unique()) if rows is not None and "autocast" in rows \
        else ("fp32",)
    note = mfu_note(d.meta(name), precisions) if frame is not None and "MFU_pct" in frame else ""
    return d.table(name, frame=frame, caption=caption + (" MFU is per GPU: one rank's share of the batch over the "
                                                         "step." + note if note else ""))


STEPS_CAPTION = ("Time per training step by strategy, same model and data in one run: `sync` is the "
                  "communication the backward pass did not hide, `overhead` the step time minus the single-GPU step.")


def _paired_efficiency(d: SectionData, table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with each row's efficiency against the single-GPU step of its own run, autocast setting and
    timing mode: a step captured in a CUDA graph is held to the captured single-GPU step, not the eager one,
    which would credit the graph's saved launches to scaling (efficiencies above 1). Rows whose run recorded
    no such single-GPU step keep the table's value."""
    singles: dict[tuple[str, int, bool], float] = {}
    for name in _step_table_names(d):
        f = d.frame(name)
        if f is None or not {"mode", "step_ms", "world_size", "autocast"} <= set(f.columns):
            continue
        world = int(f["world_size"].max())  # the single-GPU rows record 1; the run's world is the others'
        single = f[f["mode"] == "single"]
        graph = _captured(single) if "cuda_graph" in single.columns else pd.Series(False, index=single.index)
        for (_, r), captured in zip(single.iterrows(), graph):
            singles[(str(r["autocast"]), world, bool(captured))] = float(r["step_ms"])
    out = table.copy()
    for i, r in out.iterrows():
        key = (str(r["autocast"]), int(r["world_size"]), "CUDA graph" in str(r["variant"]))
        if key in singles:
            out.at[i, "scaling_efficiency"] = singles[key] / float(r["step_ms"])
    return out


def scaling_blocks(d: SectionData) -> list[Block]:
    """With several world sizes (``--set nproc=2,4,8``): the scaling table and figure, after the answers;
    empty without them."""
    table = d.frame("scaling")
    if table is None or not {"variant", "world_size", "sequences_per_s", "scaling_efficiency"} <= set(table.columns):
        return []
    table = mib_labels(_paired_efficiency(d, table))
    sizes = sorted(table["world_size"].unique())
    best = table.loc[table.groupby("world_size")["sequences_per_s"].idxmax()]
    text = Text(f"Weak scaling over {join_words([str(n) for n in sizes])} GPUs (the batch per rank fixed): "
                + join_words([f"{int(r['world_size'])} GPUs {fmt.sig(r['sequences_per_s'], 3)} sequences/s with "
                              f"{r['variant']} ({r['autocast']}, {fmt.pct(r['scaling_efficiency'])} of the "
                              "single-GPU step rate per GPU)" for _, r in best.iterrows()]) + ".")
    return [Text("", role=BEYOND_HANDOUT),  # the appendix, wherever the section puts it
            question(d, "scaling", "Beyond the handout: the same step on more GPUs.", [
        text, d.table("scaling", frame=table, caption="Step time and throughput by world size; efficiency is the "
                      "single-GPU step time over the step time (1 is perfect weak scaling), each row against the "
                      "single-GPU step timed the same way (eager or captured in a CUDA graph) in the same run."),
        d.figure("scaling", caption="Throughput against the number of GPUs.")])]


def setup(df: pd.DataFrame | None, edition: str = "2025", first: bool = True) -> Text | None:
    """The setup line of a DDP section's table, the model named as ``edition``'s handout names it. ``first``: the
    first DDP answer (naive DDP's benchmark) says it in full; the later ones only what a reader checks."""
    r = df.iloc[0] if df is not None and len(df) else None
    if r is None or "preset" not in df.columns:
        return None
    ws = int(df["world_size"].max()) if "world_size" in df.columns else "?"
    shape = (f"the {handout_model(str(r['preset']), edition)} model, {r.get('autocast', 'fp32')}, "
             f"{int(r['batch_per_rank'])} sequences of {int(r['context_length'])} tokens per rank, {ws} GPUs")
    if not first:
        return Text(f"Setup: {shape}, fused AdamW, mean over {int(r['steps'])} steps (the naive DDP benchmark's "
                    "answer describes the setup in full).")
    return Text(f"Setup: {shape} on one node, AdamW (torch's fused implementation on GPUs; the sharding section uses "
                f"PyTorch's default AdamW), mean over {int(r['steps'])} steps after warm-up; every variant starts "
                "from the same weights.")


def _has_graph_column(frame: pd.DataFrame | None) -> bool:
    return frame is not None and {"variant", "mode", "step_ms", "cuda_graph", "autocast"} <= set(frame.columns)


def _ratio_span(r: pd.DataFrame) -> str:
    faster = int((r["ratio_mean"] < 1).sum())
    return (f"{fmt.ratio(r['ratio_mean'].min())}–{fmt.ratio(r['ratio_mean'].max())} torch's step time, faster at "
            f"{faster} of {len(r)} bucket sizes")


def _captured(frame: pd.DataFrame) -> pd.Series:
    return frame["cuda_graph"].fillna(False).astype(bool)


def eager_rows(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """The rows timed eagerly: by the ``cuda_graph`` column, else by the variant's name (tables derived from
    the step table, such as the overhead model's, keep only the name); all rows of a run without captures."""
    if frame is None:
        return None
    if "cuda_graph" in frame.columns:
        return frame[~_captured(frame)]
    if "variant" in frame.columns:
        return frame[~frame["variant"].astype(str).str.contains("CUDA graph")]
    return frame


def captured_steps(d: SectionData) -> list[Block]:
    """Beyond the assignment: the section's own runs with the ``cuda_graph`` option, where every variant's whole
    step is also captured in one CUDA graph and replayed in the same process as the eager runs, so that the
    comparison with torch DDP is about GPU time rather than host launches. Empty without captured rows."""
    from cs336_systems.profiling.timeline import paired_ratios

    runs = {n: f for n in d.tables if n.startswith("steps_") and _has_graph_column(f := d.frame(n))
            and _captured(f).any()}
    if not runs:
        return []
    ratios = paired_ratios(runs)
    ratios = ratios[~ratios["variant"].str.contains("comm") & ratios["variant"].str.startswith("bucketed")]
    parts = []
    for name in sorted(runs, key=lambda n: "fp32" not in n):
        f, r = runs[name], ratios[ratios["run"] == name]
        cap, eager = r[r["cuda_graph"]], r[~r["cuda_graph"]]
        if not len(cap):
            continue
        graphed = f[_captured(f)]
        spread = (f"; the step-to-step standard deviation is at most {fmt.ms(graphed['step_ms_std'].max())} captured "
                  f"against {fmt.ms(eager_rows(f)['step_ms_std'].max())} eager")
        parts.append(
            ("In fp32" if f["autocast"].iloc[0] == "fp32" else f"Under {f['autocast'].iloc[0]} autocast")
            + f", captured: one GPU {fmt.ms(cap['single_ms'].iloc[0])}, torch DDP {fmt.ms(cap['reference_ms'].iloc[0])}, "
            f"ours {fmt.ms(cap['ours_ms'].min())}–{fmt.ms(cap['ours_ms'].max())} over the bucket sizes: {_ratio_span(cap)}"
            + (f" (eager, in the same run: {_ratio_span(eager)})" if len(eager) else "") + spread + ".")
    bf16 = next((n for n in runs if n.endswith("_bf16")), None)
    shown = bf16 or sorted(runs)[0]
    f = runs[shown]
    table = d.table(shown, frame=_calls(subset(f[_captured(f)], "variant", "num_buckets", "step_ms", "step_ms_std",
                                               "overhead_ms", "vs_single")),
                    caption=f"The captured steps of the {f['autocast'].iloc[0]} autocast run (its eager rows, and the "
                            "fp32 run's, are in the CSVs).")
    return [question(d, "c", "Beyond the assignment: the same comparison with every step captured in a CUDA graph.", [
        Text("Under bf16 autocast this step is launch-bound, so an eager comparison measures the host as much as "
             "the GPU. The same run also captures every variant's whole step (forward, backward with the gradient "
             "hooks and their all-reduces, synchronisation, optimizer) in one CUDA graph and replays it "
             "(`cs336_systems/cuda_graphs.py`); overheads are against the captured single-GPU step, and each ratio "
             "pairs ours with torch DDP timed in the same process with the same gradient wire format. "
             + " ".join(parts)),
        table])]


def _step_table_names(d: SectionData) -> list[str]:
    """The section's step tables: ``steps_<preset>_<autocast>`` from the first world size,
    ``np<N>_<preset>_<autocast>`` from each further one (``--set nproc=2,4``)."""
    return [n for n in d.tables if n.startswith("steps_") or re.match(r"np\d+_", n)]


def _world_runs(d: SectionData) -> dict[str, pd.DataFrame]:
    """The step tables that time variants against torch DDP (eager and captured), by name."""
    return {n: f for n in _step_table_names(d)
            if not n.endswith(("_timeline", "_overlap")) and _has_graph_column(f := d.frame(n))}


def torch_parity(d: SectionData, bucket_mb: float = 25.0) -> Text | None:
    """The bar our bucketed DDP is held to, in one sentence per world size: its step time over torch DDP's
    (which buckets at 25 MiB by default) at the same bucket size and gradient wire format, eager and captured,
    per autocast setting, each pair timed in one process; a ratio within the two runs' spread is no difference."""
    from cs336_systems.profiling.timeline import paired_ratios

    runs = _world_runs(d)
    if not runs:
        return None
    ratios = paired_ratios(runs)
    by_world: dict[int, list[str]] = {}
    for name in sorted(runs, key=lambda n: "fp32" not in n):
        f = runs[name]
        wire = f["comm_dtype"].fillna("fp32") if "comm_dtype" in f.columns else pd.Series("fp32", index=f.index)
        ours = f[(f["mode"] == "bucketed") & (wire == "fp32") & (f["bucket_size_mb"] == bucket_mb)]
        cells = []
        for captured in (False, True):
            mine = ours[_captured(ours) == captured]
            if not len(mine):
                continue
            r = ratios[(ratios["run"] == name) & (ratios["variant"] == mine["variant"].iloc[0])]
            torch_row = f[(f["mode"] == "torch") & (wire == "fp32") & (_captured(f) == captured)]
            if not len(r) or not len(torch_row):
                continue
            ratio = float(r["ratio_mean"].iloc[0])
            noise = spread(mine["step_ms_std"].iloc[0], torch_row["step_ms_std"].iloc[0]) \
                if "step_ms_std" in f.columns else 0.0
            theirs = float(torch_row["step_ms"].iloc[0])
            verdict = step_verdict(ratio * theirs, theirs, noise)
            cells.append(f"{'captured' if captured else 'eager'} {fmt.ratio(ratio)} ({verdict})")
        if cells:
            ac = f["autocast"].iloc[0]
            by_world.setdefault(int(f["world_size"].max()), []).append(
                ("in fp32 " if ac == "fp32" else f"under {ac} autocast ") + ", ".join(cells))
    if not by_world:
        return None
    return Text(f"**Against torch DDP** (`DistributedDataParallel`, both with {bucket_mb:g} MiB buckets and fp32 "
                "gradients on the wire, timed in the same process), our bucketed step takes, of torch's step time: "
                + "; ".join(f"on {world} GPUs " + "; ".join(parts) for world, parts in sorted(by_world.items())) + ".")


def overhead_split(steps: pd.DataFrame | None) -> Text | None:
    """Where the measured overhead of the eager bucketed steps sits: in a longer backward pass (compute that
    runs beside the all-reduce kernels) or in communication left exposed after it, which is all the model counts."""
    if steps is None or not {"mode", "fwd_bwd_ms", "sync_ms", "overhead_ms"} <= set(steps.columns):
        return None
    eager = eager_rows(steps)
    wire = eager["comm_dtype"].fillna("fp32") if "comm_dtype" in eager.columns else "fp32"
    b = eager[(eager["mode"] == "bucketed") & (wire == "fp32")]
    single = row(eager, "single")
    if not len(b) or single is None:
        return None
    slower = b["fwd_bwd_ms"] - single["fwd_bwd_ms"]
    if slower.min() <= 0:
        return Text(f"The model counts only the communication left exposed after backward: "
                    f"{fmt.ms(b['sync_ms'].min())}–{fmt.ms(b['sync_ms'].max())} measured (eager, fp32 gradients), "
                    f"against a measured overhead of {fmt.ms(b['overhead_ms'].min())}–{fmt.ms(b['overhead_ms'].max())}.")
    return Text(
        "The model counts only the communication left exposed after backward, and that part is small: "
        f"{fmt.ms(b['sync_ms'].min())}–{fmt.ms(b['sync_ms'].max())} measured (eager, fp32 gradients). Most of the "
        f"measured overhead ({fmt.ms(b['overhead_ms'].min())}–{fmt.ms(b['overhead_ms'].max())}) is a longer forward "
        f"and backward, {fmt.ms(slower.min())}–{fmt.ms(slower.max())} more than on one GPU at every bucket size: "
        "the overlapped all-reduce kernels share the SMs and memory bandwidth with the backward's kernels, a cost "
        "the model assumes away (it treats overlapped communication as free). Nor does the exposed part follow the "
        "model: it takes the backward to last only as long as all-reducing every gradient ($s/w$), while here one "
        f"GPU's forward and backward take {fmt.ms(single['fwd_bwd_ms'])}, many times longer, so even the smallest "
        "buckets' all-reduces hide behind the backward and the model's charge of one latency $o$ per bucket never "
        "shows. Across bucket sizes the measured overhead varies by "
        f"{fmt.ms(b['overhead_ms'].max() - b['overhead_ms'].min())}.")


def bucket_model(allreduce: SectionData | None = None, bucketed: SectionData | None = None) -> list[Block]:
    """The overhead model: ``n_b`` buckets of ``s / n_b`` bytes, each all-reduce costing ``o + s/(n_b w)``.

    Instantiated with the bucketed benchmark's own fit (``overhead_model_*``: ``o`` and ``w`` from
    all-reduces timed in the same run, ``s`` of the benchmarked model) when it exists, else with ``o``
    and ``w`` fitted to the §2.1 NCCL all-reduce times and the XL model's fp32 gradients."""
    blocks: list[Block] = [
        Text("Split the $s$ bytes of gradients into $n_b$ equal buckets. One bucket's all-reduce takes "
             "$o + s/(n_b w)$; by assumption computing one bucket's gradients takes as long as its bandwidth term, "
             "$s/(n_b w)$, so the backward pass lasts $s/w$. The first bucket is ready after $s/(n_b w)$, and from "
             "then on the communication stream is the bottleneck (each call costs $o$ more than the compute "
             "that feeds it), so it ends at $s/(n_b w) + n_b\\,(o + s/(n_b w))$. Subtracting the backward pass "
             "gives the overhead"),
        Equation([
            r"T_{\mathrm{overhead}}(n_b) = n_b\,o + \frac{s}{n_b\,w}.",
        ]),
        Text("The per-call latency favours few buckets, the last bucket's transfer favours many. Setting "
             "$dT/dn_b = o - s/(n_b^2 w) = 0$:"),
        Equation([
            (r"n_b^{*} = \sqrt{\frac{s}{w\,o}},\qquad b^{*} = \frac{s}{n_b^{*}} = \sqrt{s\,w\,o},\qquad "
            r"T_{\mathrm{overhead}}^{*} = 2\sqrt{\frac{s\,o}{w}}."),
        ]),
    ]
    own = named(bucketed.records, "overhead_model") if bucketed is not None else None
    if own:
        m = bucketed.json(own)
        if isinstance(m, dict) and {"o_us", "w_GBps", "s_GB", "optimal_bucket_size_mb"} <= set(m):
            preset = (bucketed.meta(own).get("params", {}).get("preset")
                      or _model_column(bucketed, own, "overhead_model") or "the benchmarked")
            other = published_fit(allreduce) if allreduce is not None else None
            apart = ("; §2.1 fits the same link in a job of its own, to $o$ = "
                     f"{fmt.sig(other['o'] * 1e6, 3)} µs and $w$ = {fmt.sig(other['w'] / 1e9)} GB/s, from calls of one "
                     "size back to back rather than a training step's mix of sizes"
                     if other else "")
            blocks += [
                Text(f"Fitted to all-reduce timings taken in the bucketed benchmark's own run, on its process group "
                     f"({preset} model{apart}): "
                     f"$o = {fmt.tex_sig(m['o_us'])}$ µs, $w = {fmt.tex_sig(m['w_GBps'])}$ GB/s, "
                     f"$s = {fmt.tex_sig(m['s_GB'] * 1e3)}$ MB of gradients:"),
                Equation([(rf"n_b^* = {fmt.tex_sig(m.get('optimal_num_buckets', float('nan')))},\qquad "
                          rf"b^* = {fmt.tex_sig(m['optimal_bucket_size_mb'])}\,\mathrm{{MiB}},\qquad "
                          rf"T^*_{{\mathrm{{overhead}}}} = {fmt.tex_sig(m.get('minimal_overhead_ms', float('nan')))}"
                          r"\,\mathrm{ms}")]),
                Text("The sweep in (a) does not follow this optimum: the model takes the backward to last only as "
                     f"long as all-reducing every gradient ($s/w$ = {fmt.ms(m['s_GB'] / m['w_GBps'] * 1e3)}), but "
                     "one GPU's forward and backward last far longer, so even the smallest buckets' all-reduces "
                     "hide behind the backward and the per-bucket latency the model charges never shows (the "
                     "appendix compares the two by bucket size)."),
                bucketed.table(own, frame=mib_labels(eager_rows(bucketed.frame(own))),
                               caption="Measured overhead (step time minus the single-GPU step) against the model's "
                               "prediction, by bucket size, eager steps (the CSV also has the captured ones)."),
                overhead_split(steps_table(bucketed)[1]),
                bucketed.figure(own, caption="Measured and predicted overhead against bucket size."),
            ]
            return blocks
    fit = published_fit(allreduce) if allreduce is not None else None
    if fit is None:
        return blocks
    s_bytes = 4 * param_counts("xl")["total"]
    o, w = fit["o"], fit["w"]
    blocks += [
        Text(f"With $o$ and $w$ fitted to the measured NCCL all-reduce times ({fit['world_size']} GPUs, "
             f"{fit['points']} message sizes, `{allreduce.folder}/allreduce.csv`): $o = {fmt.tex_sig(o * 1e6)}$ µs, "
             f"$w = {fmt.tex_sig(w / 1e9)}$ GB/s; the XL model's fp32 gradients are $s = {fmt.tex_sig(s_bytes / 2**20)}$ MiB."),
        Equation([rf"b^* = \sqrt{{s\,w\,o}} = {fmt.tex_sig(optimal_bucket_size_bytes(s_bytes, w, o) / 2**20)}\,"
                  rf"\mathrm{{MiB}},\qquad T^*_{{\mathrm{{overhead}}}} = {fmt.tex_sig(2e3 * (s_bytes * o / w) ** 0.5)}"
                  rf"\,\mathrm{{ms}}" if o > 0 else r"o \approx 0:\ \mathrm{smaller\ buckets\ are\ always\ better}"]),
    ]
    return blocks


def printed_step_ms(d: SectionData, record: str) -> float | None:
    """The step time a CSE599-O script printed in its recorded output ``record`` ("individual DDP: 207.42 ms per
    iteration, ..."), or None where this edition shows no such output, it was not recorded, or it names no single
    step time."""
    from cs336_systems.report.editions import CONSOLE_FOLDER, entries

    shown = {name for e in (entries(d.edition) or ()) for name, _ in e.console}
    printed = d.sibling(CONSOLE_FOLDER).json(record) if record in shown else None
    times = [float(m.group(1)) for line in (printed or {}).get("lines", [])
             if (m := re.match(r"\S+ DDP: ([0-9.]+) ms per iteration", str(line)))]
    return times[0] if len(times) == 1 else None
