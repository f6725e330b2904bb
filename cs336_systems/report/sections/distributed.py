"""§2.1–2.3: all-reduce benchmarks and the DDP variants (naive, flat, overlapped, bucketed)."""

from __future__ import annotations

from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import question


def communication_single_node(d: SectionData) -> list[Block]:
    return [
        question(d, "all-reduce", "All-reduce latency for Gloo (CPU) and NCCL (GPU), 1 MB–1 GB of float32, "
                 "2, 4 and 6 processes.", [d.figure("*all_reduce*", "*allreduce*", "*"),
                                           d.table("*all_reduce*", "*allreduce*", "*")],
                 what="the all-reduce benchmark"),
    ]


def naive_ddp(d: SectionData) -> list[Block]:
    return [
        question(d, "naive_ddp", "Data parallelism by all-reducing every gradient after the backward pass.", [
            Text("Each rank holds a full replica, runs forward and backward on its $1/P$ slice of the batch, then "
                 "all-reduces (averages) each parameter's gradient before the optimizer step, so every replica "
                 "takes the same step; the test compares the trained weights with single-process training.")]),
        question(d, "naive_ddp_benchmarking", "Time per training step and the share spent communicating gradients "
                 "(XL model, one node, 2 GPUs).", [d.table("*naive*", "*step*", "*timing*")],
                 what="naive DDP step and communication times"),
    ]


def ddp_flat(d: SectionData) -> list[Block]:
    return [
        question(d, "minimal_ddp_flat_benchmarking", "One all-reduce of all gradients flattened into a single "
                 "tensor, compared with one all-reduce per parameter.", [d.table("*flat*", "*")],
                 what="flat vs per-parameter all-reduce timings"),
    ]


def ddp_overlap_individual(d: SectionData) -> list[Block]:
    return [
        question(d, "a", "Overlapping per-parameter all-reduces with the backward pass, compared with the two "
                 "previous variants.", [d.table("*overlap*", "*compar*", "*timing*")],
                 what="time per iteration of the overlapping DDP"),
        question(d, "b", "Traces: communication overlapped with the backward pass.",
                 [d.figure("*naive*timeline*", "*timeline*naive*", "*no_overlap*"),
                  d.figure("*overlap*timeline*", "*timeline*overlap*", "*timeline*", "*trace*")],
                 what="the overlap timelines"),
    ]


def ddp_bucketed(d: SectionData) -> list[Block]:
    return [
        question(d, "a", "Bucketed DDP with bucket sizes 1, 10, 100 and 1000 MB, compared with the unbucketed "
                 "variants.", [d.table("*bucket*", "*")], what="bucketed DDP timings"),
        question(d, "b", "A model of DDP's communication overhead and the bucket size that minimizes it.",
                 bucket_model()),
    ]


def bucket_model() -> list[Block]:
    """The overhead model: ``n_b`` buckets of ``s / n_b`` bytes, each all-reduce costing ``o + s/(n_b w)``."""
    return [
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
            r"n_b^{*} = \sqrt{\frac{s}{w\,o}},\qquad b^{*} = \frac{s}{n_b^{*}} = \sqrt{s\,w\,o},\qquad "
            r"T_{\mathrm{overhead}}^{*} = 2\sqrt{\frac{s\,o}{w}}.",
        ]),
    ]
