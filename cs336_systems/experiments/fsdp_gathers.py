"""fsdp_accounting (b)'s answer: whether the forward's all-gathers finish in time, read from the profiled step
(``figures/fsdp/gathers_*``), and why they run late when they do: the gathers' transfer time by §2.1's
latency-bandwidth fit, compute's share of the forward, and how fast the host issued kernels. Answer text only:
nothing here measures, so nothing here makes a result stale."""

from __future__ import annotations

from typing import Any

import pandas as pd

from cs336_systems import accounting
from cs336_systems.configs import param_counts
from cs336_systems.report import fmt
from cs336_systems.report.answers import handout_model, join_words, stream_lanes, subset
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text


def _rank0(d: SectionData, name: str) -> pd.DataFrame | None:
    """A table's rows of rank 0, the summary's first variant: a profile of every rank holds each rank's rows."""
    frame, summary = d.frame(name), d.frame("gathers_summary")
    if frame is None or summary is None or not len(summary) or "variant" not in frame.columns \
            or "variant" not in summary.columns:
        return frame
    return frame[frame["variant"] == summary["variant"].iloc[0]]


def _idle_text(d: SectionData) -> Text | None:
    """Why the profiled forward is longer than its kernels: the GPU's idle time between kernels, read from the
    step's kernel timeline (the union of both streams' kernels inside the forward phase)."""
    tl, summary = _rank0(d, "gathers_timeline"), d.frame("gathers_summary")
    if tl is None or summary is None or not {"kind", "name", "start_ms", "dur_ms"} <= set(tl.columns):
        return None
    forward = tl[(tl["kind"] == "phase") & tl["name"].astype(str).str.contains("forward")]
    if not len(forward):
        return None
    start, span = float(forward["start_ms"].iloc[0]), float(forward["dur_ms"].iloc[0])
    kernels = tl[(tl["kind"] != "phase") & (tl["start_ms"] >= start) & (tl["start_ms"] < start + span)]
    if len(kernels) < 2:
        return None
    gaps, end = [], start
    for s, e in sorted(zip(kernels["start_ms"], kernels["start_ms"] + kernels["dur_ms"])):
        if s > end:
            gaps.append(s - end)
        end = max(end, e)
    idle = sum(gaps) + max(start + span - end, 0.0)
    if not gaps or idle / span < 0.3:  # the GPU is mostly busy: nothing beyond the gathers to explain
        return None
    compute = kernels[kernels["kind"] == "compute"]
    comm = kernels[(kernels["kind"] == "comm") & kernels["name"].astype(str).str.contains("AllGather")]
    model = (d.meta("gathers_summary").get("extra") or {}).get("model")
    layers = accounting.ladder_config(model).num_layers if model else None
    r = summary.iloc[0]
    per_layer = (f", {fmt.sig(len(comm) / layers, 2)} per layer where one gather of a layer's flat shard would do"
                 if layers and len(comm) > layers else "")
    return Text(
        f"**Why the forward is longer than its kernels.** Of its {fmt.ms(span)} the GPU is idle for {fmt.ms(idle)} "
        f"({fmt.pct(idle / span)}), in {len(gaps):,} gaps between kernels (median "
        f"{fmt.sig(float(pd.Series(gaps).median()) * 1e3, 2)} µs) spread over the whole forward, not bunched before "
        f"the gathers: the forward is launch-bound. Rank 0's host issued {len(compute):,} compute kernels and "
        f"{len(comm)} all-gathers{per_layer}, one every {fmt.sig(span / len(kernels) * 1e3, 2)} µs, while a compute "
        f"kernel ran {fmt.sig(float(compute['dur_ms'].mean()) * 1e3, 2)} µs on average (a small batch per rank, and "
        "the profiler adds host time to every operator). "
        + ("So the gathers are in time" if float(r["wait_ms"]) < 0.05 * span else
           f"The gathers also hold compute back ({fmt.ms(r['wait_ms'])} of waits), but less than the host does")
        + (f", and none of their {fmt.ms(r['gather_ms'])}" if float(r["gather_beside_compute_ms"]) < 0.05 else
           f", and only {fmt.ms(r['gather_beside_compute_ms'])} of their {fmt.ms(r['gather_ms'])}")
        + " overlaps a compute kernel because most of the time there is none to overlap: the GPU idles between "
        "launches, gathers or not. What would shorten the forward is on the host's side: more tokens per rank, fewer "
        "and larger gathers, or capturing the step in a CUDA graph"
        + (" (the last measured below)." if _has_graph_rows(d) else " (not measured here)."))


def _has_graph_rows(d: SectionData) -> bool:
    """Whether the unprofiled steps include our step captured in a CUDA graph."""
    table = d.frame("gathers_unprofiled")
    return table is not None and "strategy" in table.columns and bool((table["strategy"] == "fsdp_graph").any())


def _predicted_gather_ms(d: SectionData, model: str, world: Any, dtype: Any, r: Any) -> tuple[float, float] | None:
    """§2.1's latency-bandwidth fit for the forward's all-gathers: a ring all-gather of S bytes in all over p ranks
    takes (p-1)·alpha + (p-1)/p·S/B per call set. ``(predicted ms, bytes gathered)``, None without the fit."""
    from cs336_systems.experiments.ddp_common import published_fit

    try:
        p, width = int(world), {"bf16": 2, "fp16": 2, "fp32": 4}[str(dtype)]
        psi = param_counts(accounting.ladder_config(model))["total"]
    except (KeyError, TypeError, ValueError):
        return None
    fit = published_fit(d.sibling("distributed_communication_single_node"), world_size=p) if p > 1 else None
    if fit is None or "alpha_us" not in fit or not r["gathers"]:
        return None
    bandwidth = fit["w"] * 2 * (p - 1) / p  # back to the fit's B per rank
    return (int(r["gathers"]) * (p - 1) * fit["alpha_us"] * 1e-6 + (p - 1) / p * psi * width / bandwidth) * 1e3, \
        psi * width


def _gather_model(d: SectionData, model: str, world: Any, dtype: Any, r: Any) -> str:
    """The forward's all-gathers against §2.1's fit: kernel time far above it is waiting."""
    found = _predicted_gather_ms(d, model, world, dtype, r)
    if found is None:
        return ""
    predicted, nbytes = found
    if float(r["gather_ms"]) < 2 * predicted:
        return f" §2.1's fit predicts {fmt.ms(predicted)} for these gathers, close to what their kernels took."
    said = (f" §2.1's fit predicts {fmt.ms(predicted)} for these gathers ({fmt.sig(nbytes / 1e9)} GB gathered "
            f"in {int(r['gathers'])} calls); their kernels took {fmt.ratio(float(r['gather_ms']) / predicted)} "
            "that" + (" on rank 0." if _peer_summary(d) is not None else "."))
    peers = _peer_summary(d)
    if peers is not None:
        return (said + " An NCCL kernel also counts the time it waits for the other ranks to arrive; with that "
                f"taken out (the ranks' timelines, in the answer), the transfers took "
                f"{fmt.ms(peers[0]['transfer_ms'].iloc[0])}.")
    return said + (" An NCCL kernel also counts the time it waits for the other rank to arrive, and the other rank "
            "runs the same launch-bound forward, so this kernel time is an upper bound on the transfer; which part "
            "is waiting for the peer needs both ranks' timelines, which this profile does not record.")


#: How our FSDP schedules the forward's gathers (the appendix: the question asks for timings).
PREFETCH = Text(
    "Our FSDP prefetches one layer ahead: when layer $k$ starts its forward, the all-gather of layer $k+1$ is "
    "launched asynchronously, in the order the first forward recorded, so that it can overlap layer $k$'s compute; "
    "by then layer $k-1$ has finished, as the handout asks before gathering the layer two after it.")


def _profiled_fit(d: SectionData, r: Any) -> tuple[float, float] | None:
    """§2.1's fit for the gathers of the profiled step whose summary row is ``r`` (its model, world size and
    compute dtype from the record), or None."""
    meta = d.meta("gathers_summary")
    params, extra = meta.get("params", {}), meta.get("extra", {})
    return _predicted_gather_ms(d, extra.get("model", params.get("gathers_model", "?")),
                                (params.get("nproc") or ["?"])[0], extra.get("compute_dtype"), r)


def gathers_against_fit(d: SectionData) -> Text | None:
    """Beyond the question: the profiled forward's gathers against §2.1's fit (the appendix); None where
    :func:`host_paced` already weighs them against it."""
    summary = d.frame("gathers_summary")
    if summary is None or not len(summary) or not {"gathers", "gather_ms"} <= set(summary.columns) or host_paced(d):
        return None
    meta = d.meta("gathers_summary")
    params, extra = meta.get("params", {}), meta.get("extra", {})
    model = extra.get("model", params.get("gathers_model", "?"))
    text = _gather_model(d, model, (params.get("nproc") or ["?"])[0], extra.get("compute_dtype"), summary.iloc[0])
    return Text(text.strip()) if text else None


def _first_gather_late(d: SectionData) -> bool:
    """Whether the forward's first all-gather made compute wait: it has no compute before it to hide behind."""
    waits = _rank0(d, "gathers_forward")
    return waits is not None and bool(len(waits)) and "late" in waits.columns and bool(
        waits.sort_values("start_ms")["late"].iloc[0])


#: Compute below this share of the forward leaves the GPU idle most of the time: the host's launches set the pace.
HOST_PACED_BELOW = 0.5


def host_paced(d: SectionData) -> Text | None:
    """Why the gathers run late when the link could carry them in time: how little of the forward is compute and
    how often the host issued a kernel."""
    summary, tl = d.frame("gathers_summary"), _rank0(d, "gathers_timeline")
    if summary is None or tl is None or not len(summary) or not {"compute_ms", "span_ms", "late_gathers"} <= set(
            summary.columns) or not {"kind", "start_ms"} <= set(tl.columns):
        return None
    r = summary.iloc[0]
    if not r["late_gathers"] or not r["span_ms"] or float(r["compute_ms"]) / float(r["span_ms"]) > HOST_PACED_BELOW:
        return None  # compute fills the forward: the host does not set its pace
    if int(r["late_gathers"]) == 1 and _first_gather_late(d):
        return None  # the one late gather is the first, which no compute precedes: the verdict says so
    forward = tl[(tl["kind"] != "phase") & (tl["start_ms"] < float(r["span_ms"]))]
    if not len(forward):
        return None
    found = _profiled_fit(d, r)
    per_kernel = fmt.sig(float(r["span_ms"]) / len(forward) * 1e3, 2)
    if found is not None and float(r["gather_ms"]) >= 2 * found[0]:
        peers = _peers(d, found[0])
        if peers:
            return Text(
                f"The link is not what is slow: §2.1's fit carries these gathers in {fmt.ms(found[0])}, yet their "
                f"kernels took {fmt.ms(r['gather_ms'])} on rank 0. " + peers)
        return Text(
            f"The link is not what is slow: §2.1's fit carries these gathers in {fmt.ms(found[0])}, yet their kernels "
            f"took {fmt.ms(r['gather_ms'])}. Beside that, compute ran only {fmt.ms(r['compute_ms'])} of the forward "
            f"and rank 0's host issued a kernel every {per_kernel} µs. Two causes fit these numbers, and a profile of "
            "rank 0 alone cannot tell them apart: the host's launches setting the pace (a gather starts only when the "
            "host reaches its layer), and each gather's kernel waiting inside NCCL until the other rank issues the "
            "same gather. Traces of both ranks would separate them.")
    return Text(
        f"Compute ran only {fmt.ms(r['compute_ms'])} of the forward's {fmt.ms(r['span_ms'])} and rank 0's host issued "
        f"a kernel every {per_kernel} µs (the profiler adds host time to every operator): the forward is paced by "
        "the host's launches, not by the link.")


#: The ranks' clocks are trusted as one when the all-gathers' ends agree this closely after the shift.
ALIGNED_WITHIN_US = 50.0


def _peer_summary(d: SectionData) -> tuple[pd.DataFrame, float] | None:
    """The per-rank summary with its peer columns and the clocks' residual (µs), or None for a profile of one rank
    or clocks that do not line up."""
    summary = d.frame("gathers_summary")
    clocks = (d.meta("gathers_summary").get("extra") or {}).get("clocks") or []
    if summary is None or len(summary) < 2 or not {"peer_wait_ms", "arrived_last", "transfer_ms"} <= set(
            summary.columns) or summary["peer_wait_ms"].isna().any() or not clocks:
        return None
    residual = max(float(c.get("residual_us", float("inf"))) for c in clocks)
    return (summary.reset_index(drop=True), residual) if residual <= ALIGNED_WITHIN_US else None


def _rank_names(summary: pd.DataFrame) -> list[str]:
    """Each row's rank as its variant names it ("..., 2 ranks (rank 1)"), else by its position."""
    import re

    found = [re.search(r"\(rank (\d+)\)", str(v)) for v in summary["variant"]] if "variant" in summary else []
    return [f"rank {m.group(1)}" if m else f"rank {i}" for i, m in
            enumerate(found or [None] * len(summary))]


def _own_gpu(late: Any) -> str:
    """Of the rank that arrived last: where its own GPU computed for under half its forward, how long, and (when it
    also waited for no gather) that it waits for its host; else ""."""
    if not {"wait_ms", "compute_ms", "span_ms"} <= set(late.index) or not float(late["span_ms"]) > 0:
        return ""
    if float(late["compute_ms"]) / float(late["span_ms"]) >= HOST_PACED_BELOW:
        return ""
    waited = float(late["wait_ms"])
    clause = (", and its own GPU" + (", which waited for no gather," if not waited else
                                     f", which waited {fmt.ms(waited)} for gathers,")
              + f" ran compute for only {fmt.ms(late['compute_ms'])} of its {fmt.ms(late['span_ms'])} forward")
    return clause + (": it waits for its host" if not waited else "")


def _peers(d: SectionData, predicted_ms: float) -> str:
    """What the ranks' timelines say of the gathers' kernel time: how much of it was one rank waiting inside NCCL
    for another to reach the same gather, and how long the transfers took with no waiting in them (the kernel of
    the rank that arrived last). "" for a profile of one rank or clocks that do not line up."""
    found = _peer_summary(d)
    if found is None:
        return ""
    summary, residual = found
    names = _rank_names(summary)
    r0, transfer, gathers = summary.iloc[0], float(summary["transfer_ms"].iloc[0]), int(summary["gathers"].iloc[0])
    peer = names[1] if len(summary) == 2 else "the other ranks"
    text = (f"The timelines of {'both ranks' if len(summary) == 2 else f'all {len(summary)} ranks'}, put on one "
            "clock by the gathers' ends (a collective ends on every rank at nearly the same moment; after the shift "
            f"the ends agree within {fmt.sig(residual, 2)} µs), show where that time went: of {names[0]}'s "
            f"{fmt.ms(r0['gather_ms'])} of gather kernel time, {fmt.ms(r0['peer_wait_ms'])} passed before {peer} "
            f"reached the same gather, and the transfers themselves (the kernel of the rank that arrived last) took "
            f"{fmt.ms(transfer)}, ")
    text += (f"close to the fit's {fmt.ms(predicted_ms)}. " if transfer < 2 * predicted_ms else
             f"{fmt.ratio(transfer / predicted_ms)} the fit's {fmt.ms(predicted_ms)}. ")
    always = summary.index[summary["arrived_last"] == gathers]
    if len(always):
        late, who = summary.iloc[int(always[0])], names[int(always[0])]
        text += (f"{who[0].upper() + who[1:]} reached every one of the {gathers} gathers last"
                 + _own_gpu(late) + ". ")
    else:
        text += ("The last to arrive was " + join_words([f"{n} at {int(k)}" for n, k in
                                                         zip(names, summary["arrived_last"])])
                 + f" of the {gathers} gathers; the waiting adds to "
                 + join_words([f"{fmt.ms(w)} on {n}" for n, w in zip(names, summary["peer_wait_ms"])]) + ". ")
    waiting = max(float(w) / float(g) for w, g in zip(summary["peer_wait_ms"], summary["gather_ms"]) if float(g) > 0)
    if waiting <= 0.5:
        return text.rstrip() + (" The transfers themselves run slower than §2.1's collectives run alone, which "
                                "this profile does not explain." if transfer >= 2 * predicted_ms else "")
    why = ("So most of a gather's kernel time is one rank waiting for another's host to issue the same gather: each "
           "rank's host reaches a layer at its own pace, and a gather ends only when the slowest one gets there.")
    if transfer < 2 * predicted_ms:
        return text + why + " The cause is the hosts' launches, not the link."
    return text + why + (" The transfers themselves also run slower than §2.1's collectives run alone, which this "
                         "profile does not explain.")


def cause_in_brief(d: SectionData) -> Text | None:
    """fsdp_accounting (b) in one sentence: what the gathers' kernel time was, from both ranks' timelines (the
    appendix gives the whole account, :func:`host_paced`). None without a profile of every rank."""
    found, summary = _peer_summary(d), d.frame("gathers_summary")
    if found is None or summary is None:
        return None
    peers, _ = found
    r0, fit = peers.iloc[0], _profiled_fit(d, summary.iloc[0])
    names = _rank_names(peers)
    always = peers.index[peers["arrived_last"] == int(peers["gathers"].iloc[0])]
    whose = ("the other rank's kernels, on its own clock" if len(always) and int(always[0]) != 0 else
             "the kernels of the rank that arrived last, on their own clocks")
    text = (f"Of rank 0's {fmt.ms(r0['gather_ms'])} of gather kernel time, {fmt.ms(r0['peer_wait_ms'])} passed before "
            f"the other rank reached the same gather; the transfers themselves ({whose}, so the two need not add up "
            f"exactly) took {fmt.ms(float(peers['transfer_ms'].iloc[0]))}"
            + (f", close to §2.1's fit ({fmt.ms(fit[0])})" if fit and float(peers["transfer_ms"].iloc[0]) < 2 * fit[0]
               else f" (§2.1's fit: {fmt.ms(fit[0])})" if fit else ""))
    if len(always) and {"compute_ms", "span_ms"} <= set(peers.columns):
        late = peers.iloc[int(always[0])]
        if float(late["compute_ms"]) / float(late["span_ms"]) < HOST_PACED_BELOW:
            text += (f": {names[int(always[0])]}'s GPU sat idle waiting for its host's launches "
                     f"({fmt.ms(late['compute_ms'])} of compute in a {fmt.ms(late['span_ms'])} forward)")
    if d.frame("gathers_unprofiled") is not None:
        return Text(text + ". So the link keeps up and the hosts' launches do not (the appendix has the whole "
                    "account).")
    return Text(text + ". So the link keeps up and the hosts' launches do not; the profiler adds host time to every "
                "operator, so an unprofiled step should wait less (not measured here; the appendix has the whole "
                "account).")


#: A phase whose host issue time is at least this share of its GPU time kept the GPU waiting for launches.
HOST_ISSUE_SHARE = 0.8


def unprofiled_forward(d: SectionData) -> Text | None:
    """fsdp_accounting (b) without the profiler: each rank's forward on its GPU's clock and its host's, from the
    unprofiled steps (``gathers_unprofiled``), against the profiled step's compute kernel time; None before that
    table was measured."""
    table, summary = d.frame("gathers_unprofiled"), d.frame("gathers_summary")
    need = {"forward_gpu_ms", "forward_host_ms", "step_ms"}
    if table is None or not len(table) or not need <= set(table.columns):
        return None
    steps = table[table["strategy"] == "fsdp"].reset_index(drop=True) if "strategy" in table.columns else table
    if not len(steps):
        return None
    names = _rank_names(steps)
    statistic = (d.meta("gathers_unprofiled").get("extra") or {}).get("statistic", "median of the unprofiled steps")
    ranks = "; ".join(f"on {n}, the forward ran {fmt.ms(r['forward_gpu_ms'])} on the GPU, issued by the host in "
                      f"{fmt.ms(r['forward_host_ms'])}, in a step of {fmt.ms(r['step_ms'])}"
                      for n, (_, r) in zip(names, steps.iterrows()))
    text = f"Without the profiler ({statistic}): {ranks}. "
    compute = (summary["compute_ms"].reset_index(drop=True) if summary is not None and "compute_ms" in summary.columns
               and len(summary) == len(steps) else None)
    gpu, host = steps["forward_gpu_ms"].astype(float), steps["forward_host_ms"].astype(float)
    against = _captured(table, steps)
    if compute is None:
        return Text(text.rstrip() + against)
    slowest = int(gpu.idxmax())
    c, g, h = float(compute.iloc[slowest]), float(gpu.iloc[slowest]), float(host.iloc[slowest])
    if g <= 1.5 * c:
        late = "late_gathers" in summary.columns and float(summary["late_gathers"].sum()) > 0
        return Text(text + f"That is within 1.5× of the {fmt.ms(c)} of compute kernels the profile counted, so an "
                    "ordinary step keeps its GPU busy through the forward"
                    + (": the late gathers above were the profiler's host time." if late else ".") + against)
    if h >= HOST_ISSUE_SHARE * g:
        return Text(text + f"On {names[slowest]}, the GPU's forward lasts about as long as its host "
                    f"took to issue it, {fmt.ratio(g / c)} the {fmt.ms(c)} of compute kernels the profile counted: "
                    "an ordinary step's forward is paced by the host's launches too, not by the link." + against)
    return Text(text + f"The hosts ran ahead of their GPUs, yet {names[slowest]}'s forward lasted "
                f"{fmt.ratio(g / c)} its {fmt.ms(c)} of compute kernels: the GPU waited for the gathers." + against)


def unprofiled_in_brief(d: SectionData) -> Text | None:
    """The main answer's sentence on the unprofiled steps: our forward on the GPU against its host issue time and
    the profiled compute, and the captured step against the eager one (the slower rank's each); None without
    those numbers (:func:`unprofiled_forward` then says what there is, in the appendix)."""
    table, summary = d.frame("gathers_unprofiled"), d.frame("gathers_summary")
    need = {"strategy", "variant", "forward_gpu_ms", "forward_host_ms", "step_ms"}
    if table is None or summary is None or not need <= set(table.columns) or not {"compute_ms", "variant"} <= set(
            summary.columns):
        return None
    ours, graph = table[table["strategy"] == "fsdp"], table[table["strategy"] == "fsdp_graph"]
    if not len(ours) or len(graph) != len(ours):
        return None
    baseline, same_optimizer = _graph_baseline(table, ours)
    mine, replay, eager = _slowest(ours), _slowest(graph, "step_ms"), _slowest(baseline, "step_ms")
    same_rank = summary[summary["variant"] == mine["variant"]]  # the profile's compute of the same rank
    if not len(same_rank) or float(mine["forward_host_ms"]) < HOST_ISSUE_SHARE * float(mine["forward_gpu_ms"]):
        return None
    if float(replay["step_ms"]) >= float(eager["step_ms"]):
        return None  # the appendix says the graph was no faster
    compute = float(same_rank["compute_ms"].iloc[0])
    ratio = fmt.ratio(float(mine["forward_gpu_ms"]) / compute)
    return Text(f"Without the profiler the slower rank's forward still takes {fmt.ms(mine['forward_gpu_ms'])} on the "
                "GPU, about its "
                f"host's issue time ({fmt.ms(mine['forward_host_ms'])}) and {ratio} "
                f"the profiled compute, so the hosts set the pace." + _per_block(table, ours, brief=True)
                + " Replaying the per-weight step captured in a CUDA graph cuts it from "
                + f"{fmt.ms(eager['step_ms'])}" + (" (eager, with torch's fused AdamW, which the graph uses)"
                                                   if same_optimizer else "")
                + f" to {fmt.ms(replay['step_ms'])} (the appendix gives both accounts and torch's FSDP2 and DDP "
                "beside ours).")


def _graph_baseline(table: pd.DataFrame, ours: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """The eager rows a captured step is weighed against: ours with torch's fused AdamW, the graph's optimizer,
    where they were timed (``True``), else ours with our AdamW."""
    fused = _rows(table, "fsdp_fused")
    return (fused, True) if len(fused) == len(ours) and len(fused) else (ours, False)


def _per_block(table: pd.DataFrame, ours: pd.DataFrame, brief: bool = False) -> str:
    """Ours with one all-gather per Transformer block (``fsdp_block``) against ours per layer and FSDP2 (the slower
    rank's forward and step each), judged by the rounds' spread. "" without those rows, or (``brief``) unless the
    block's forward is faster beyond the spread."""
    block = _rows(table, "fsdp_block")
    if len(block) != len(ours) or not len(block):
        return ""
    b, mine = _slowest(block), _slowest(ours)
    b_step, my_step = _slowest(block, "step_ms"), _slowest(ours, "step_ms")
    faster = _apart(b, mine) and float(b["forward_gpu_ms"]) < float(mine["forward_gpu_ms"])
    if brief and not faster:
        return ""
    fsdp2 = table[table["strategy"] == "fsdp2"]
    against, level = "", False
    if len(fsdp2) == len(ours):
        t, t_step = _slowest(fsdp2), _slowest(fsdp2, "step_ms")
        apart = [_apart(b, t), _apart(b_step, t_step, "step_ms")]  # None: no ranges to judge by
        level = apart == [False, False]
        if level:
            against = (f"; FSDP2's take {fmt.ms(t['forward_gpu_ms'])} and {fmt.ms(t_step['step_ms'])}, neither apart "
                       f"from ours beyond the rounds' spread (round medians {_ranges(b, t)}; "
                       f"{_ranges(b_step, t_step, 'step_ms')})")
        else:
            said = [f"{what} {fmt.ms(theirs[col])} (" + ("level within the rounds' spread)" if far is False else
                    f"ours {fmt.ratio(float(mine_[col]) / float(theirs[col]))} it"
                    + (", beyond the spread)" if far else ")"))
                    for what, col, mine_, theirs, far in (("forward", "forward_gpu_ms", b, t, apart[0]),
                                                         ("step", "step_ms", b_step, t_step, apart[1]))]
            against = "; FSDP2's " + " and ".join(said)
    if brief:
        return (" Gathering each Transformer block's weights in one all-gather instead of each weight's "
                "(`gather_units`) " + ("removes" if level else "shrinks") + " the host time our wrapper adds beyond "
                f"FSDP2's: the forward then takes {fmt.ms(b['forward_gpu_ms'])} and the step "
                f"{fmt.ms(b_step['step_ms'])} ({fmt.ms(my_step['step_ms'])} with a gather per weight){against}.")
    spread = f" (round medians {_ranges(b, mine)})" if _apart(b, mine) is not None else ""
    verdict = (f"{fmt.ratio(float(b['forward_gpu_ms']) / float(mine['forward_gpu_ms']))} of the per-layer forward"
               if faster else "no faster than per layer beyond the rounds' spread")
    return (f" With every Transformer block's seven weights gathered in one collective (`gather_units`, one "
            f"packed all-gather and one copy-out per block), our forward takes {fmt.ms(b['forward_gpu_ms'])} on the "
            f"GPU, issued in {fmt.ms(b['forward_host_ms'])}{spread}, {verdict}, and the step "
            f"{fmt.ms(b_step['step_ms'])} against {fmt.ms(my_step['step_ms'])}{against}.")


#: Names of the strategies timed beside ours, as the answer says them.
_TORCH_STRATEGIES = {"fsdp2": "torch's FSDP2 (one all-gather per Transformer block)",
                     "ddp": "torch DDP (no gathers: the unsharded model{autocast})"}


def unprofiled_blocks(d: SectionData) -> list[Block | None]:
    """Beyond the question (the appendix): the unprofiled forward of torch's FSDP2 and DDP beside ours, and the
    unprofiled steps' table (its label column and idle phases left to the CSV)."""
    table = d.frame("gathers_unprofiled")
    if table is None or "strategy" not in table.columns or "forward_gpu_ms" not in table.columns:
        return []
    ours = table[table["strategy"] == "fsdp"].reset_index(drop=True)
    text = _against_torch(table, ours, (d.meta("gathers_unprofiled").get("extra") or {}).get("compute_dtype"))
    shown = subset(table, "strategy", "rank", "forward_host_ms", "forward_gpu_ms", "forward_gpu_ms_round_lo",
                   "forward_gpu_ms_round_hi", "backward_gpu_ms", "optimizer_gpu_ms", "step_ms", "step_ms_round_lo",
                   "step_ms_round_hi")
    text = (text or "") + _per_block(table, ours)
    return [Text(text.strip()) if text else None, d.table(
        "gathers_unprofiled", frame=shown, caption="Unprofiled steps, per strategy and rank (medians): the forward's "
        "host issue time and GPU time by CUDA events (each step starts on an idle GPU, so the forward's GPU time "
        "starts when its host issues it; a later phase's starts when the GPU finishes the one before), the lowest "
        "and highest round median, and the step's wall time. fsdp is ours, one gather per layer, and fsdp_block ours "
        "with one per Transformer block (our AdamW); fsdp2 and ddp are torch's (torch's AdamW); fsdp_fused is ours "
        "with torch's fused AdamW, and fsdp_graph that step captured in a CUDA graph, timed as whole steps (all "
        "columns: the CSV).")]


def _rows(table: pd.DataFrame, strategy: str) -> pd.DataFrame:
    """The rows of one strategy (none in a table without the column)."""
    return table[table["strategy"] == strategy] if "strategy" in table.columns else table.iloc[:0]


def _ranges(a: pd.Series, b: pd.Series, column: str = "forward_gpu_ms") -> str:
    """``lo-hi ms against lo-hi ms``: two rows' ranges of round medians of ``column``."""
    lo, hi = f"{column}_round_lo", f"{column}_round_hi"
    return f"{_range_ms(a[lo], a[hi])} against {_range_ms(b[lo], b[hi])}"


def _range_ms(lo: Any, hi: Any) -> str:
    """``lo-hi ms``, or one value where both read alike at three figures."""
    return fmt.ms(lo) if fmt.sig(lo) == fmt.sig(hi) else f"{fmt.sig(lo)}-{fmt.ms(hi)}"


def _captured(table: pd.DataFrame, ours: pd.DataFrame) -> str:
    """Our step captured in a CUDA graph and replayed, against our eager step (the slower rank's each): what the
    host's launches cost. "" without that row."""
    if "strategy" not in table.columns:
        return ""
    graph = table[table["strategy"] == "fsdp_graph"]
    if len(graph) != len(ours) or not len(graph):
        return ""
    baseline, same_optimizer = _graph_baseline(table, ours)
    g, eager = _slowest(graph, "step_ms"), _slowest(baseline, "step_ms")
    spread = (f" (round medians {_ranges(g, eager, 'step_ms')})"
              if {"step_ms_round_lo", "step_ms_round_hi"} <= set(g.index) else "")
    if float(g["step_ms"]) >= float(eager["step_ms"]) or (spread and float(g["step_ms_round_hi"]) >= float(
            eager["step_ms_round_lo"])):
        return (f" Captured in a CUDA graph and replayed, the whole step takes {fmt.ms(g['step_ms'])} against the "
                f"eager step's {fmt.ms(eager['step_ms'])}{spread}: no faster beyond the rounds' spread.")
    if same_optimizer:
        optimizer = f"; with our AdamW the eager step takes {fmt.ms(_slowest(ours, 'step_ms')['step_ms'])}"
    else:
        optimizer = (f"; without its optimizer phase (our AdamW, {fmt.ms(eager['optimizer_gpu_ms'])}) the eager "
                     f"step still takes {fmt.ms(float(eager['step_ms']) - float(eager['optimizer_gpu_ms']))}"
                     if "optimizer_gpu_ms" in eager.index and pd.notna(eager["optimizer_gpu_ms"]) else "")
    return (f" Captured in a CUDA graph and replayed (our FSDP with torch's fused AdamW, whose state a graph needs "
            f"on the GPU), the whole step takes {fmt.ms(g['step_ms'])} against the eager step's "
            f"{fmt.ms(eager['step_ms'])}" + (" with the same optimizer" if same_optimizer else "")
            + f"{spread}, {fmt.ratio(float(eager['step_ms']) / float(g['step_ms']))} faster"
            f"{optimizer}: with one launch per step the host no longer sets the pace, which is the fix for a step "
            "this small.")


def _slowest(frame: pd.DataFrame, column: str = "forward_gpu_ms") -> pd.Series:
    """The row of the rank whose ``column`` is longest (by default: whose forward ran longest on its GPU)."""
    return frame.loc[frame[column].astype(float).idxmax()]


def _apart(a: pd.Series, b: pd.Series, column: str = "forward_gpu_ms") -> bool | None:
    """Whether two rows' ``column`` (by default the forward) lie apart beyond the rounds' spread (their ranges of
    round medians do not overlap); None where the rows carry no ranges."""
    lo, hi = f"{column}_round_lo", f"{column}_round_hi"
    if not {lo, hi} <= set(a.index) or not {lo, hi} <= set(b.index):
        return None
    return bool(float(a[lo]) > float(b[hi]) or float(b[lo]) > float(a[hi]))


def _against_torch(table: pd.DataFrame, ours: pd.DataFrame, dtype: str | None = None) -> str:
    """The same step's forward under torch's strategies (the slower rank's), beside ours: whose host sets the
    pace. "" without them."""
    if "strategy" not in table.columns:
        return ""
    said, rows = [], {}
    autocast = f" under {dtype} autocast" if dtype in ("bf16", "fp16") else ""
    for strategy, name in _TORCH_STRATEGIES.items():
        name = name.format(autocast=autocast)
        theirs = table[table["strategy"] == strategy].reset_index(drop=True)
        if len(theirs) != len(ours) or not len(theirs):
            continue
        rows[strategy] = row = _slowest(theirs)
        said.append(f"under {name}, {fmt.ms(row['forward_gpu_ms'])} on the GPU, issued in "
                    f"{fmt.ms(row['forward_host_ms'])}")
    if not said:
        return ""
    text = " The same step's forward (the slower rank's) " + "; ".join(said) + ". "
    if "fsdp2" in rows:
        mine, theirs = _slowest(ours), rows["fsdp2"]
        r = float(mine["forward_gpu_ms"]) / float(theirs["forward_gpu_ms"])
        apart = _apart(mine, theirs)
        spread = (f" (round medians {_ranges(mine, theirs)})"
                  if apart is not None else "")
        paced = all(float(x["forward_host_ms"]) >= HOST_ISSUE_SHARE * float(x["forward_gpu_ms"]) for x in (mine, theirs))
        if (apart if apart is not None else abs(r - 1) >= 0.2) and r > 1:
            text += (f"Ours takes {fmt.ratio(r)} FSDP2's{spread}" + (
                ": both are paced by their hosts, so the extra host time is our wrapper's (a gather, a cast and an "
                "autograd node per weight where FSDP2 issues one per block)." if paced else "."))
        elif apart or (apart is None and abs(r - 1) >= 0.2):
            text += f"Ours takes {fmt.ratio(r)} FSDP2's{spread}."
        else:
            text += (f"Ours is within {fmt.pct(abs(r - 1))} of FSDP2's" + (f", inside the rounds' spread{spread}"
                     if apart is not None else ""))
            unsharded = float(rows["ddp"]["forward_gpu_ms"]) if "ddp" in rows else float("nan")
            both = sorted(float(x["forward_gpu_ms"]) / unsharded for x in (mine, theirs))
            if "ddp" in rows and paced and both[0] > 1.2:
                text += (f"; the sharded forwards take {fmt.sig(both[0], 2)}-{fmt.ratio(both[1], 2)} the unsharded "
                         "one's, so most of the host time beyond the model's own launches is what gathering every "
                         "layer's weights costs in eager PyTorch, and what ours adds to FSDP2's is within the noise "
                         "of these rounds.")
            else:
                text += ": the host time is not our wrapper's in particular." if paced else "."
    return text


def gathers_blocks(d: SectionData) -> list[Block | None]:
    """fsdp_accounting (b): does the forward's all-gather finish in time? From the profiled step."""
    summary = d.frame("gathers_summary")
    text = None
    if summary is not None and len(summary) and {"span_ms", "gathers", "late_gathers", "wait_ms"} <= set(summary.columns):
        r = summary.iloc[0]
        meta = d.meta("gathers_summary")
        params, extra = meta.get("params", {}), meta.get("extra", {})
        ws = (params.get("nproc") or ["?"])[0]
        model = extra.get("model", params.get("gathers_model", "?"))
        first_late = _first_gather_late(d)
        who = "every rank (the numbers are rank 0's)" if len(summary) > 1 else "rank 0"
        share = r["wait_ms"] / r["span_ms"] if r["span_ms"] else float("nan")
        if r["gathers"] == 0:
            verdict = ("The timeline shows no all-gather kernel in the forward, so it cannot answer the question: "
                       "on CPU processes gloo's collectives are host operators, merged with the compute around them.")
        elif r["late_gathers"] == 0:
            verdict = ("Yes: every all-gather ended while compute was still busy with an earlier layer, so the "
                       "prefetch hides the forward's communication completely.")
        elif r["late_gathers"] == 1 and first_late:
            verdict = "Yes, except the first gather, which no compute precedes to hide it."
        else:
            late, total = int(r["late_gathers"]), int(r["gathers"])
            verdict = ("In time but for a few." if share < 0.05 else
                       "No: most of the forward's all-gathers finish after the compute that should hide them."
                       if late > total / 2 else f"No: {late} of the forward's {total} all-gathers finish after the "
                       "compute that should hide them.")
        if len(summary) > 1 and "late_gathers" in summary.columns and r["gathers"]:
            names = _rank_names(summary)
            last = summary["arrived_last"] if "arrived_last" in summary.columns else [None] * len(summary)
            head = verdict.removesuffix(".")
            head = (head.replace("No: ", f"No on {names[0]}: ", 1) if head.startswith("No: ") else
                    f"On {names[0]}, {head[0].lower()}{head[1:]}")
            if r["late_gathers"]:  # late for what: its own compute, or the other rank's host
                head += _why_rank_waited(summary.iloc[0], list(last)[0], int(r["gathers"]),
                                         names[1] if len(names) == 2 else "the other ranks")
            verdict = head + "; " + join_words(
                [f"on {n}, compute waited for {'none' if not int(row['late_gathers']) else int(row['late_gathers'])}"
                 " of them" + _why_rank_waited(row, a, int(r["gathers"]), names[0])
                 for n, (_, row), a in zip(names[1:], summary.iloc[1:].iterrows(), list(last)[1:])]) + "."
        text = Text(
            f"{verdict} One training step of {handout_model(model, d.edition)} "
            f"({fmt.params(param_counts(accounting.ladder_config(model))['total'])} parameters) with our FSDP on {ws} "
            f"{'GPUs' if meta.get('device_type') == 'cuda' else 'CPU processes'}, {extra.get('compute_dtype', '?')} "
            "compute" + (" (the handout's mixed precision: each weight is cast before it is gathered, halving the "
                         "bytes sent)" if extra.get("compute_dtype") in ("bf16", "fp16") else "")
            + f", {params.get('global_batch', '?')} sequences of {params.get('context_length', '?')} tokens, "
            f"profiled on {who}: the forward ran {fmt.ms(r['span_ms'])} on the GPU with {int(r['gathers'])} "
            "all-gathers, one per sharded weight matrix (each Linear and Embedding), "
            f"{fmt.ms(r['gather_ms'])} of kernel time, "
            + ("none of which overlapped compute" if float(r["gather_beside_compute_ms"]) < 0.05 else
               f"of which {fmt.ms(r['gather_beside_compute_ms'])} overlapped compute")
            + (f"; compute waited for {int(r['late_gathers'])} of them, {fmt.ms(r['wait_ms'])} in all "
               f"({fmt.pct(share)} of the forward; the longest wait {fmt.ms(r['max_wait_ms'])})."
               if r["late_gathers"] else "."))
    ranks = d.frame("gathers_summary")
    aligned = bool((d.meta("gathers_summary").get("extra") or {}).get("clocks"))
    where = ("on rank 0" if ranks is None or len(ranks) < 2 else
             "on each rank, on rank 0's clock," if aligned else "on each rank, each on its own clock,")
    return [
        text,
        _idle_text(d),
        d.figure("gathers_timeline", caption=f"Kernels of one FSDP training step {where} by stream (compute grey, "
                 "communication red) under the phases the GPU ran; the forward's all-gathers are the red bars "
                 "beside its compute." + _lanes_named(d) + " Drawn from PyTorch's profiler (CUPTI kernel records) in "
                 "place of an Nsight Systems screenshot: Nsight Systems is not installed on these machines."),
        d.figure("gathers_zoom", caption="The same step zoomed, as in Nsight, to fourteen consecutive all-gathers "
                 "(two Transformer blocks' weights) from the middle of rank 0's forward, on every rank: each gather "
                 "beside the compute kernels around it, and the gaps where the compute stream waits for its host's "
                 "next launch. A gather kernel that fills the window is waiting inside NCCL for the other rank to "
                 "issue the same gather."),
        d.table("gathers_summary", frame=_named_for_the_handout(d.frame("gathers_summary"), d.edition),
                caption="The forward's all-gathers: kernel time, the part that overlapped compute, and how long compute "
                "waited for a gather (it resumed within 30 µs of the gather's end)"
                + ("; per rank, the gathers' time waiting for the other rank to arrive (peer_wait_ms), how many it "
                   "reached last, and the transfers' time with no waiting (transfer_ms)."
                   if ranks is not None and "peer_wait_ms" in ranks.columns else ".")),
    ]


def _why_rank_waited(row: pd.Series, arrived_last: Any, gathers: int, first: str) -> str:
    """Why another rank's compute waited for as many gathers as it did: it reached every gather last (so none),
    or its gathers spent most of their time waiting for ``first`` (rank 0) to issue the same gathers; else ""."""
    if arrived_last is not None and int(arrived_last) == gathers and not int(row.get("late_gathers", 0)):
        return ", since that rank reached every gather last"
    if not int(row.get("late_gathers", 0)) or not {"wait_ms", "peer_wait_ms"} <= set(row.index):
        return ""
    if float(row["peer_wait_ms"]) < 0.5 * float(row["wait_ms"]):
        return ""
    return (f" (compute stalled {fmt.ms(row['wait_ms'])}), because its gathers spent {fmt.ms(row['peer_wait_ms'])} "
            f"waiting for {first} to issue the same gathers")


def _lanes_named(d: SectionData) -> str:
    """The figure's lane and title labels in words: its rows are CUDA streams named as the profiler names them
    (``cuda:7``), and its title names the preset (``xl@2026`` is the 2026 handout's xl)."""
    named = stream_lanes(d.frame("gathers_timeline"))
    model = (d.meta("gathers_summary").get("extra") or {}).get("model")
    title = (f"; the title's {model} is this handout's {handout_model(model, d.edition)}"
             if model and handout_model(model, d.edition) != model else "")
    return (" Rows: " + named + title + ".") if named else ""


def _named_for_the_handout(summary: pd.DataFrame | None, edition: str) -> pd.DataFrame | None:
    """The table with its variant labels' model named as this writeup's handout names it (``xl@2026`` -> ``xl``)."""
    from cs336_systems.report.answers import handout_model

    if summary is None or "variant" not in summary.columns:
        return summary
    def label(text: object) -> object:
        if not isinstance(text, str) or "," not in text:
            return text
        model, rest = text.split(",", 1)
        return f"{handout_model(model, edition)},{rest}"
    return summary.assign(variant=summary["variant"].map(label))
