"""§2.3.1 DDP with one all-reduce of all gradients flattened into a single buffer, against one all-reduce per
parameter (naive) and torch DDP, same model and data in one run.

Problem ``minimal_ddp_flat_benchmarking``.
"""

from __future__ import annotations

from typing import Any

from cs336_systems.experiments import ddp_common
from cs336_systems.experiments.ddp_common import (
    STEPS_CAPTION,
    DDPParams,
    row,
    setup,
    steps_blocks,
    steps_table,
)
from cs336_systems.experiments.section import Section
from cs336_systems.report import fmt
from cs336_systems.report.answers import known, question, spread
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Text
from cs336_systems.results import ResultWriter

PRESETS = ddp_common.ddp_presets()


def run(p: DDPParams, out: ResultWriter) -> dict[str, Any]:
    return ddp_common.run_ddp("ddp_flat", p, out, ["single", "torch", "naive", "flat"])


# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.document import BEYOND_HANDOUT  # noqa: E402  (answers only)


#: Naive DDP's measured wait below this share of its calls' modelled cost means the calls overlapped.
OVERLAPPED = 0.9


def _copy_tbps(d: SectionData, name: str | None) -> float | None:
    """The run's HBM copy rate (TB/s of bytes read plus written) by its calibration at the start, slowest GPU."""
    start = ((d.meta(name or "").get("calibration") or {}).get("start")) or []
    rates = [float(g["hbm_copy_tbps"]) for g in start if isinstance(g, dict) and known(g.get("hbm_copy_tbps"))]
    return min(rates) if rates else None


def _copies(flat: Any, transfer_ms: float, gb: float, copy_tbps: float | None) -> str:
    """Flat's wait against what it has to do: the fit's transfer plus copying every gradient into the flat buffer
    and back (each copy reads and writes it), at the run's own calibrated copy rate."""
    waited = known(flat.get("sync_ms"))
    if copy_tbps is None or waited is None:
        return ""
    copies = 2 * 2 * gb / (copy_tbps * 1e12) * 1e3
    left = waited - transfer_ms - copies
    said = (f" The two copies move {fmt.sig(4 * gb / 1e9)} GB through memory, {fmt.ms(copies)} at this GPU's "
            f"calibrated {fmt.sig(copy_tbps)} TB/s; with the fit's transfer that is {fmt.ms(transfer_ms + copies)}")
    if left > 0:
        return said + f" of flat's {fmt.ms(waited)} wait, and {fmt.ms(left)} the two do not account for."
    return said + (f", {fmt.ms(-left)} more than flat's {fmt.ms(waited)} wait: the two account for all of it "
                   "(the estimate overshoots a little: the fit and the copy rate were each measured alone).")


def _verdict(naive: Any, flat: Any, fit: dict | None = None, copy_tbps: float | None = None) -> str:
    """The handout's one or two sentences: the step and the communication, batched against per parameter, judged
    against the two rows' step-to-step spread; then why, with the per-call cost and bandwidth of §2.1's fit
    where it is measured."""
    calls, gb = known(naive.get("num_buckets")), known(naive.get("grad_bytes"))
    n = f"{int(calls)} calls" if calls else "one call per parameter"
    noise = spread(naive.get("step_ms_std"), flat.get("step_ms_std"))
    saved = float(naive["step_ms"]) - float(flat["step_ms"])
    if saved > noise:
        judged = f"{fmt.ms(saved)} shorter, more than the two rows' summed spread (±{fmt.ms(noise)}): batching pays"
    elif abs(saved) <= noise:
        judged = (f"{fmt.ms(abs(saved))} ({fmt.pct(abs(saved) / float(naive['step_ms']))}) "
                  f"{'shorter' if saved >= 0 else 'longer'}, within the two rows' summed step-to-step spread "
                  f"(±{fmt.ms(noise)}): a difference this run cannot resolve")
    else:
        judged = f"{fmt.ms(-saved)} longer, more than the two rows' summed spread (±{fmt.ms(noise)}): flat DDP is slower"
    comm = ""
    if known(naive.get("sync_ms")) and known(flat.get("sync_ms")):
        change = float(naive["sync_ms"]) - float(flat["sync_ms"])
        comm = (f"; the communication (the wait after backward: the all-reduces, and for flat also the copies "
                f"into and out of its buffer) {'shrinks' if change >= 0 else 'grows'} from "
                f"{fmt.ms(naive['sync_ms'])} to {fmt.ms(flat['sync_ms'])} "
                f"({fmt.pct(abs(change) / float(naive['sync_ms']))} {'less' if change >= 0 else 'more'})")
    first = (f"One all-reduce of the flattened gradients takes the step from {fmt.ms(naive['step_ms'])} (naive "
             "DDP, timed in this run beside it) to "
             f"{fmt.ms(flat['step_ms'])}, {judged}{comm}.")
    if fit is not None and calls and gb:
        fixed, transfer = calls * fit["o"] * 1e3, gb / fit["w"] * 1e3
        waited = known(naive.get("sync_ms"))
        head = f" With §2.1's fit, {n}' fixed cost is {fmt.ms(fixed)} against {fmt.ms(transfer)} to move {fmt.sig(gb / 1e9)} GB"
        if waited is not None and waited < OVERLAPPED * (fixed + transfer):
            # naive waited less than its calls cost one at a time: back-to-back calls overlapped their fixed costs
            return first + (head + f", and naive's wait ({fmt.ms(waited)}) is less than their sum: calls launched "
                            "back to back overlap even the fixed cost (the fit times one synchronized call at a "
                            "time), so the fit overstates what flattening can remove, while it adds a copy of every "
                            "gradient into the flat buffer and back.") + _copies(flat, transfer, gb, copy_tbps)
        return first + (head + ", so flattening can remove at most the fixed cost, while it adds a copy of every "
                        "gradient into the flat buffer and back.") + _copies(flat, transfer, gb, copy_tbps)
    if saved > noise:
        return first + (" One call instead of many saves each call's fixed launch and synchronization cost, which "
                        "outweighs the copies into and out of the flat buffer.")
    return first + " Flattening removes the calls' fixed cost but adds a copy of every gradient into the flat buffer and back."


def _memory(naive: Any, flat: Any) -> str:
    """What flattening costs in memory: a buffer the size of all gradients, beside them."""
    a, b = known(naive.get("peak_mem_gib")), known(flat.get("peak_mem_gib"))
    if a is None or b is None or b - a < 0.05 * a:
        return ""
    return (f" Flattening also raises the peak from {fmt.sig(a)} to {fmt.sig(b)} GiB per GPU: the flat buffer holds "
            "a second copy of every gradient.")


def _fit(d: SectionData, naive: Any, name: str | None) -> dict | None:
    """§2.1's all-reduce fit for this grid and world size, where it was measured on the same device."""
    allreduce = d.sibling("distributed_communication_single_node")
    if "world_size" not in naive.index or allreduce.meta("allreduce").get("device") != d.meta(name or "").get("device"):
        return None  # another machine's links say nothing about this run
    return ddp_common.published_fit(allreduce, world_size=int(naive["world_size"]))


def answer(d: SectionData) -> list[Block]:
    name, df = steps_table(d)
    naive, flat = row(df, "naive"), row(df, "flat")
    text = memory = None
    if naive is not None and flat is not None:
        text = Text(_verdict(naive, flat, _fit(d, naive, name), _copy_tbps(d, name)))
        memory = _memory(naive, flat).strip() or None
    return [
        question(d, "minimal_ddp_flat_benchmarking", "One all-reduce of all gradients flattened into a single "
                 "tensor, compared with one all-reduce per parameter.",
                 [setup(df, d.edition, first=False), text, steps_blocks(d, name, STEPS_CAPTION), d.figure(name or "", caption="Step time "
                                                                                      "split into phases.")],
                 what="flat vs per-parameter all-reduce timings"),
        *([Text("", role=BEYOND_HANDOUT),
           question(d, "minimal_ddp_flat_benchmarking", "What the flat buffer costs in memory.", [Text(memory)])]
          if memory else []),
        *ddp_common.scaling_blocks(d),
    ]



SECTION = Section(
    name="ddp_flat", number="2.3.1", title="DDP with one flat all-reduce", problems=("minimal_ddp_flat_benchmarking",),
    answer=answer, presets=PRESETS, run=run, gpus=2, sized_by=("preset",),
    depends=(*ddp_common.DEPENDS, "cs336_systems/distributed/ddp_flat.py", "cs336_systems/distributed/ddp_naive.py"),
)
