"""§2.1–2.3: all-reduce benchmarks and the DDP variants (naive, flat, overlapped, bucketed)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.configs import param_counts
from cs336_systems.distributed.overhead_model import fit_latency_bandwidth, optimal_bucket_size_bytes
from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import join_words, question, subset


def _allreduce_fit(frame: pd.DataFrame | None, backend: str = "nccl", world_size: int = 2) -> dict | None:
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


def communication_single_node(d: SectionData) -> list[Block]:
    df = d.frame("allreduce")
    text = None
    if df is not None and {"backend", "world_size", "size_bytes", "time_ms"} <= set(df.columns) and len(df):
        parts = []
        big = df[df["size_bytes"] == df["size_bytes"].max()]
        for _, r in big.sort_values(["backend", "world_size"]).iterrows():
            bw = f" ({fmt.sig(r['busbw_GBps'])} GB/s bus bandwidth)" if "busbw_GBps" in r and pd.notna(r["busbw_GBps"]) else ""
            parts.append(f"{r['backend']} with {int(r['world_size'])} processes {fmt.ms(r['time_ms'])}{bw}")
        size = big["size"].iloc[0] if "size" in big.columns else fmt.sig(big["size_bytes"].iloc[0])
        vs = ""
        both = big[big["world_size"] == big["world_size"].min()].set_index("backend")["time_ms"]
        if {"nccl", "gloo"} <= set(both.index):
            vs = (f" With {int(big['world_size'].min())} processes NCCL (GPU memory, NVLink) is "
                  f"{fmt.ratio(both['gloo'] / both['nccl'])} faster than Gloo (host memory, CPU reduction).")
        text = Text(f"All-reducing {size}: " + join_words(parts) + "." + vs + " Small messages are latency bound "
                    "(the time hardly changes with size), large ones bandwidth bound; bus bandwidth, which scales "
                    "the rate by the $2(n-1)/n$ of the data a ring all-reduce moves per rank, makes process counts "
                    "comparable.")
    fit = d.frame("allreduce_alpha_beta")
    fit_text = None
    if fit is not None and len(fit) and {"backend", "world_size", "alpha_us", "bandwidth_GBps"} <= set(fit.columns):
        parts = [f"{r['backend']} with {int(r['world_size'])} processes $\\alpha$ = {fmt.sig(r['alpha_us'])} µs and "
                 f"$B$ = {fmt.sig(r['bandwidth_GBps'])} GB/s (worst at {r.get('worst_size', '?')}, "
                 f"{fmt.pct(r['max_rel_error'])} off)"
                 for _, r in fit.sort_values(["backend", "world_size"]).iterrows()]
        fit_text = Text("A ring all-reduce of $n$ bytes per rank over $p$ ranks takes "
                        "$t = 2(p-1)\\,\\alpha + 2\\frac{p-1}{p}\\,\\frac{n}{B}$ ($2(p-1)$ latency steps; each rank "
                        "sends and receives $2(p-1)/p$ of the data). Fitted to the measured points by least squares "
                        "on the relative error: " + join_words(parts) + ". One $\\alpha$–$B$ pair per process count is a "
                        "coarse model of NCCL, which changes algorithm and protocol with the message size, so the "
                        "misfit of the worst point is part of the answer; the dashed curve keeps the fitted latency "
                        "and takes $B$ from the link specification.")
    return [
        question(d, "all-reduce", "All-reduce latency for Gloo (CPU) and NCCL (GPU), 1 MB–1 GB of float32, "
                 "2, 4 and 6 processes.", [
                     text,
                     fit_text,
                     d.figure("allreduce_alpha_beta", caption="All-reduce time against the latency–bandwidth model "
                              "fitted per process count (solid) and with the link specification's bandwidth (dashed)."),
                     d.table("allreduce_alpha_beta", caption="Latency–bandwidth fit per backend and process count "
                             "(alpha per ring step, B per rank)."),
                     d.figure("allreduce_bandwidth", caption="All-reduce bus bandwidth by message size, backend and "
                              "process count (dashed: the topology's peak)."),
                     d.table("allreduce", caption="All-reduce time and bandwidth (algorithm bandwidth = bytes per "
                             "rank / time; bus bandwidth = algorithm bandwidth × 2(n−1)/n)."),
                 ], what="the all-reduce benchmark"),
    ]


def _preferred(names: list[str]) -> list[str]:
    """Several runs of one table (``<kind>_<preset>_<dtype>``): the XL fp32 one first."""
    return sorted(names, key=lambda n: ("_xl_" not in n + "_", "fp32" not in n, n))


def _named(names: list[str], kind: str) -> str | None:
    """The table/figure of ``kind`` (``overlap``, ``timeline``, ...), named ``kind_*`` or ``*_kind``."""
    hits = [n for n in names if n.startswith(kind + "_") or n.endswith("_" + kind)]
    return _preferred(hits)[0] if hits else None


def ddp_steps(d: SectionData) -> tuple[str | None, pd.DataFrame | None]:
    """The section's step-time table: ``steps_<preset>_<dtype>`` (the XL fp32 one when several)."""
    names = [n for n in d.tables if n.startswith("steps") and not n.endswith(("_timeline", "_overlap"))]
    if not names:
        return None, None
    name = _preferred(names)[0]
    return name, d.frame(name)


#: Modes of the DDP benchmark, with the overlapped per-parameter strategy under either name.
_MODE_ALIASES = {"overlap": ("individual", "overlap")}


def _row(df: pd.DataFrame | None, mode: str) -> pd.Series | None:
    if df is None or "mode" not in df.columns:
        return None
    sel = df[df["mode"].isin(_MODE_ALIASES.get(mode, (mode,)))]
    return sel.iloc[0] if len(sel) else None


def _steps_table(d: SectionData, name: str | None, caption: str):
    if name is None:
        return None
    frame = subset(d.frame(name), "variant", "num_buckets", "step_ms", "step_ms_std", "fwd_bwd_ms", "sync_ms",
                   "optimizer_ms", "overhead_ms", "vs_single")
    return d.table(name, frame=frame, caption=caption)


_STEPS_CAPTION = ("Time per training step by strategy, same model and data in one run: `sync` is the "
                  "communication the backward pass did not hide, `overhead` the step time minus the single-GPU step.")


def _setup(df: pd.DataFrame | None) -> Text | None:
    r = df.iloc[0] if df is not None and len(df) else None
    if r is None or "preset" not in df.columns:
        return None
    ws = int(df["world_size"].max()) if "world_size" in df.columns else "?"
    return Text(f"Setup: the {r['preset']} model, {r.get('autocast', 'fp32')}, {int(r['batch_per_rank'])} sequences "
                f"of {int(r['context_length'])} tokens per rank, {ws} GPUs on one node, mean over "
                f"{int(r['steps'])} steps after warm-up; every variant starts from the same weights.")


def naive_ddp(d: SectionData) -> list[Block]:
    name, df = ddp_steps(d)
    naive, single = _row(df, "naive"), _row(df, "single")
    text = None
    if naive is not None:
        text = Text(f"Naive DDP takes {fmt.ms(naive['step_ms'])} per step, of which {fmt.ms(naive['sync_ms'])} "
                    f"({fmt.pct(naive['sync_ms'] / naive['step_ms'])}) is spent all-reducing gradients one parameter "
                    "at a time after backward"
                    + (f"; the same step on one GPU without communication takes {fmt.ms(single['step_ms'])}."
                       if single is not None else "."))
    return [
        question(d, "naive_ddp", "Data parallelism by all-reducing every gradient after the backward pass.", [
            Text("Each rank holds a full replica, runs forward and backward on its $1/P$ slice of the batch, then "
                 "all-reduces (averages) each parameter's gradient before the optimizer step, so every replica "
                 "takes the same step; the tests compare the trained weights with single-process training, and "
                 "the benchmark checks every strategy against it before timing."),
            d.table(_named(d.tables, "toy_equivalence") or "", caption="Each strategy against single-process "
                    "training on the course's ToyModel.")]),
        question(d, "naive_ddp_benchmarking", "Time per training step and the share spent communicating gradients "
                 "(XL model, one node, 2 GPUs).", [_setup(df), text, _steps_table(d, name, _STEPS_CAPTION),
                                                   d.figure(name or "", caption="Step time split into phases.")],
                 what="naive DDP step and communication times"),
    ]


def ddp_flat(d: SectionData) -> list[Block]:
    name, df = ddp_steps(d)
    naive, flat = _row(df, "naive"), _row(df, "flat")
    text = None
    if naive is not None and flat is not None:
        text = Text(f"One all-reduce of the flattened gradients takes the step from {fmt.ms(naive['step_ms'])} to "
                    f"{fmt.ms(flat['step_ms'])} and the communication from {fmt.ms(naive['sync_ms'])} to "
                    f"{fmt.ms(flat['sync_ms'])}: the same bytes move, but one call instead of one per parameter "
                    "saves each call's fixed launch and synchronization cost (at the price of a copy into and "
                    "out of the flat buffer).")
    return [
        question(d, "minimal_ddp_flat_benchmarking", "One all-reduce of all gradients flattened into a single "
                 "tensor, compared with one all-reduce per parameter.",
                 [_setup(df), text, _steps_table(d, name, _STEPS_CAPTION), d.figure(name or "", caption="Step time "
                                                                                      "split into phases.")],
                 what="flat vs per-parameter all-reduce timings"),
    ]


def ddp_overlap_individual(d: SectionData) -> list[Block]:
    name, df = ddp_steps(d)
    rows = {m: _row(df, m) for m in ("naive", "flat", "overlap", "single")}
    text = None
    if rows["overlap"] is not None:
        others = [f"{m} {fmt.ms(rows[m]['step_ms'])}" for m in ("naive", "flat") if rows[m] is not None]
        text = Text(f"Overlapping each parameter's all-reduce with the rest of the backward pass gives "
                    f"{fmt.ms(rows['overlap']['step_ms'])} per step, with {fmt.ms(rows['overlap']['sync_ms'])} of "
                    "communication left after backward" + (f" (vs. {join_words(others)})." if others else "."))
    overlap_name = _named(d.tables, "overlap")
    ov = d.frame(overlap_name) if overlap_name else None
    ov_text = None
    if ov is not None and {"variant", "comm_ms", "comm_during_backward_ms"} <= set(ov.columns) and len(ov):
        ov_text = Text("Share of communication kernel time that ran during the backward pass: " + join_words(
            [f"{r['variant']} {fmt.pct(r['comm_during_backward_ms'] / r['comm_ms'])}" for _, r in ov.iterrows()
             if r["comm_ms"] > 0]) + ".")
    timeline = _named(d.figures, "timeline")
    timelines = [d.figure(timeline or "", caption="Kernels of one training step on rank 0, compute and "
                          "communication streams, per strategy.")]
    d.frame(_named(d.tables, "timeline") or "")  # the figure's data
    return [
        question(d, "a", "Overlapping per-parameter all-reduces with the backward pass, compared with the two "
                 "previous variants.", [_setup(df), text, _steps_table(d, name, _STEPS_CAPTION)],
                 what="time per iteration of the overlapping DDP"),
        question(d, "b", "Traces: communication overlapped with the backward pass.",
                 [ov_text, *timelines, d.table(overlap_name or "", caption="Communication kernel time and the part "
                                               "of it inside the backward pass.")],
                 what="the overlap timelines"),
    ]


def ddp_bucketed(d: SectionData) -> list[Block]:
    name, df = ddp_steps(d)
    text = None
    if df is not None and "mode" in df.columns and (df["mode"] == "bucketed").any():
        b = df[df["mode"] == "bucketed"].sort_values("bucket_size_mb")
        best = b.loc[b["step_ms"].idxmin()]
        parts = [f"{fmt.sig(r['bucket_size_mb'])} MB {fmt.ms(r['step_ms'])}" for _, r in b.iterrows()]
        refs = [f"{r['variant']} {fmt.ms(r['step_ms'])}" for m in ("naive", "flat", "overlap", "single", "torch")
                if (r := _row(df, m)) is not None]
        spread = b["step_ms"].max() / b["step_ms"].min() - 1
        single = _row(df, "single")
        if spread < 0.05:
            why = (f" All bucket sizes lie within {fmt.pct(spread, 2)} of each other"
                   + (f" and within {fmt.pct(b['step_ms'].max() / single['step_ms'] - 1, 2)} of the single-GPU step"
                      if single is not None else "")
                   + ": on this node's interconnect the gradients' all-reduce is a small part of the step, so "
                   "bucketing can only recover a little")
            if "step_ms_std" in b.columns and b["step_ms"].max() - b["step_ms"].min() < b["step_ms_std"].max():
                why += (f", and the differences are within the step-to-step standard deviation (up to "
                        f"{fmt.ms(b['step_ms_std'].max())})")
            why += "."
        else:
            why = (" Tiny buckets pay the per-call cost many times, huge ones cannot start communicating until most "
                   "of backward is done; in between, communication hides behind the remaining backward compute.")
        text = Text("Step time by bucket size: " + join_words(parts) + f"; the best is {fmt.sig(best['bucket_size_mb'])} "
                    "MB" + (f" (reference: {join_words(refs)})." if refs else ".") + why)
    sweep = _named(d.figures, "bucket_sweep")
    return [
        question(d, "a", "Bucketed DDP with bucket sizes 1, 10, 100 and 1000 MB, compared with the unbucketed "
                 "variants.", [_setup(df), text, _steps_table(d, name, _STEPS_CAPTION),
                               d.figure(sweep or "", caption="Step time against bucket size.")],
                 what="bucketed DDP timings"),
        question(d, "b", "A model of DDP's communication overhead and the bucket size that minimizes it.",
                 bucket_model(SectionData(d.root, "distributed_communication_single_node"), d)),
        *captured_steps(SectionData(d.root, "ddp_benchmark",
                                    command="python -m cs336_systems.distributed.ddp_benchmark ... --cuda-graph both")),
    ]


def _has_graph_column(frame: pd.DataFrame | None) -> bool:
    return frame is not None and {"variant", "mode", "step_ms", "cuda_graph", "autocast"} <= set(frame.columns)


def _ratio_range(r: pd.DataFrame) -> str:
    lo, hi, med = r["ratio_mean"].min(), r["ratio_mean"].max(), r["ratio_mean"].median()
    return (f"{fmt.ratio(lo)}–{fmt.ratio(hi)} (median {fmt.ratio(med)}; ours faster in "
            f"{int((r['ratio_mean'] < 1).sum())} of {len(r)})")


def captured_steps(bench: SectionData) -> list[Block]:
    """Beyond the assignment: the DDP benchmark's runs made with the ``cuda_graph`` option
    (``figures/ddp_benchmark/``), where every step is also captured in a CUDA graph, so that the
    comparison with torch DDP is about GPU time rather than host launches. Empty without such runs."""
    from cs336_systems.distributed.benchmark import with_overheads
    from cs336_systems.distributed.timeline_analysis import busy_by_kind, paired_ratios

    runs = {n: with_overheads(f) for n in bench.tables if _has_graph_column(f := bench.frame(n))}
    captured_runs = {n: f for n, f in runs.items() if f["cuda_graph"].astype(bool).any()}
    if not captured_runs:
        return []
    ratios = paired_ratios(runs)
    autocast = ratios["run"].map(lambda n: str(runs[n]["autocast"].iloc[0]))
    fp32_wire = ~ratios["variant"].str.contains("comm")

    # The run shown: bf16 autocast with eager and captured variants and both wire formats, else the largest.
    def rank(name: str) -> tuple:
        f = captured_runs[name]
        return (str(f["autocast"].iloc[0]) == "bf16", f["cuda_graph"].astype(bool).nunique(),
                f["comm_dtype"].nunique() if "comm_dtype" in f else 1, len(f), name)

    shown = max(captured_runs, key=rank)
    f = captured_runs[shown]
    graphed = f[f["cuda_graph"].astype(bool)]
    wire = graphed["comm_dtype"].fillna("fp32") if "comm_dtype" in graphed else pd.Series("fp32", index=graphed.index)
    pick = {m: graphed[(graphed["mode"] == m) & ((wire == "fp32") | (m == "single"))] for m in ("single", "torch", "bucketed")}
    parts = []
    if all(len(v) for v in pick.values()):
        single, torch_ddp, ours = (pick[m].iloc[0] for m in ("single", "torch", "bucketed"))
        parts.append(f"In `{shown}` ({f['preset'].iloc[0]}, {f['autocast'].iloc[0]} autocast) the captured step takes "
                     f"{fmt.ms(single['step_ms'])} on one GPU, {fmt.ms(torch_ddp['step_ms'])} with torch DDP and "
                     f"{fmt.ms(ours['step_ms'])} with {ours['variant']}, {fmt.ratio(ours['step_ms'] / torch_ddp['step_ms'])} "
                     "torch's.")
    for ac in ("bf16", "fp32"):
        cap = ratios[ratios["cuda_graph"] & (autocast == ac)]
        if len(cap):
            n_runs = cap["run"].nunique()
            parts.append(f"Ours over torch DDP in the same run, captured, {ac} autocast, over {len(cap)} pairings in "
                         f"{n_runs} run{'s' if n_runs != 1 else ''}: {_ratio_range(cap)}.")
    eager = ratios[~ratios["cuda_graph"] & (autocast == "bf16") & fp32_wire]
    if len(eager):
        parts.append(f"Eager under bf16 autocast, one pairing per process ({eager['run'].nunique()} processes): "
                     f"{_ratio_range(eager)}; that step is launch-bound and moves with host jitter.")
    blocks: list[Block | None] = [
        Text("Under bf16 autocast the XL step is launch-bound, so an eager comparison measures the host. These runs "
             "also capture every variant's whole step (forward, backward with the gradient hooks and their "
             "all-reduces, synchronisation, optimizer) in one CUDA graph and replay it "
             "(`cs336_systems/cuda_graphs.py`), in the same process as the eager runs; overheads are against the "
             "single-GPU step of the same kind. " + " ".join(parts)),
        bench.table(shown, frame=subset(f, "variant", "num_buckets", "step_ms", "step_ms_std", "overhead_ms", "vs_single"),
                    caption="Eager and captured steps in one run; a captured step is timed as a whole."),
    ]
    for name in bench.tables:
        tl = bench.frame(name) if name.endswith("_timeline_xl_bf16") else None
        if tl is None or "variant" not in tl or not tl["variant"].str.contains("CUDA graph").any():
            continue
        split = busy_by_kind(tl)
        blocks += [
            Text("Where a captured step's time goes (one profiled step, rank 0; union of kernel intervals over all "
                 "streams): communication overlaps compute almost entirely and the GPU is almost never idle, so "
                 "what data parallelism still costs is compute slowed by the concurrent all-reduce kernels."),
            bench.table(name, frame=split[split["variant"].str.contains("CUDA graph")].round(2),
                        caption="Captured steps split into compute, communication, both at once, and idle time (ms)."),
        ]
        break
    return [question(bench, "c", "Beyond the assignment: the same comparison with every step captured in a "
                     "CUDA graph.", blocks)]


def bucket_model(allreduce: SectionData | None = None, bucketed: SectionData | None = None) -> list[Block]:
    """The overhead model: ``n_b`` buckets of ``s / n_b`` bytes, each all-reduce costing ``o + s/(n_b w)``.

    Instantiated with the bucketed benchmark's own fit (``overhead_model_*``: ``o`` and ``w`` from
    all-reduces timed in the same run, ``s`` of the benchmarked model) when it exists, else with ``o``
    and ``w`` fitted to the §2.1.3 NCCL all-reduce times and the XL model's fp32 gradients."""
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
    own = _named(bucketed.records, "overhead_model") if bucketed is not None else None
    if own:
        m = bucketed.json(own)
        if isinstance(m, dict) and {"o_us", "w_GBps", "s_GB", "optimal_bucket_size_mb"} <= set(m):
            preset = bucketed.meta(own).get("params", {}).get("preset", "the benchmarked")
            blocks += [
                Text(f"Fitted in the bucketed benchmark's own run ({preset} model, `{own}.json`): "
                     f"$o = {fmt.tex_sig(m['o_us'])}$ µs, $w = {fmt.tex_sig(m['w_GBps'])}$ GB/s, "
                     f"$s = {fmt.tex_sig(m['s_GB'] * 1e3)}$ MB of gradients:"),
                Equation([(rf"n_b^* = {fmt.tex_sig(m.get('optimal_num_buckets', float('nan')))},\qquad "
                          rf"b^* = {fmt.tex_sig(m['optimal_bucket_size_mb'])}\,\mathrm{{MB}},\qquad "
                          rf"T^*_{{\mathrm{{overhead}}}} = {fmt.tex_sig(m.get('minimal_overhead_ms', float('nan')))}"
                          r"\,\mathrm{ms}")]),
                bucketed.table(own, caption="Measured overhead (step time minus the single-GPU step) against "
                               "the model's prediction, by bucket size."),
                bucketed.figure(own, caption="Measured and predicted overhead against bucket size."),
            ]
            return blocks
    fit = _allreduce_fit(allreduce.frame("allreduce")) if allreduce is not None else None
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
