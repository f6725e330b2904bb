"""§1.1: end-to-end benchmarking, Nsight-style kernel profiles, mixed precision and memory profiling."""

from __future__ import annotations

from cs336_systems.configs import get_config, residual_stream_bytes
from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import col, question


def benchmarking(d: SectionData) -> list[Block]:
    timings = d.frame("end_to_end*", "*timing*", "benchmark*")
    table = d.table("end_to_end*", "*timing*", "benchmark*", caption="Forward and backward time per step by "
                    "model size (mean ± standard deviation over the measured steps).")
    warm = d.table("*warmup*", caption="The same measurement with 0, 1, 2 and 5 warm-up steps.")
    return [
        question(
            d, "a", "A script for end-to-end benchmarking of the forward and backward passes.",
            [Text("`cs336_systems.benchmarking` builds a model from a preset, generates a random batch, runs a "
                  "configurable number of warm-up steps and then times each phase with "
                  "`torch.cuda.synchronize()` around it (`python -m cs336_systems.benchmarking --help`).")],
        ),
        question(d, "b", "Forward and backward timings for the model sizes of §1.1.2 (5 warm-up, 10 measured steps).",
                 [_timing_sentence(timings), table], what="end-to-end timings by model size"),
        question(d, "c", "The effect of warm-up steps.", [_warmup_sentence(d), warm],
                 what="timings with 0, 1 and 2 warm-up steps"),
    ]


def _timing_sentence(df) -> Text | None:
    size, fwd, bwd = col(df, "size", "model", "model_size"), col(df, "forward*mean*", "forward_ms", "fwd*"), col(
        df, "backward*mean*", "backward_ms", "bwd*")
    if df is None or not (size and fwd and bwd):
        return None
    first, last = df.iloc[0], df.iloc[-1]
    return Text(
        f"A forward pass takes from {fmt.ms(first[fwd])} ({first[size]}) to {fmt.ms(last[fwd])} ({last[size]}); "
        f"the backward pass from {fmt.ms(first[bwd])} to {fmt.ms(last[bwd])}."
    )


def _warmup_sentence(d: SectionData) -> Text | None:
    return None


def nsys_profile(d: SectionData) -> list[Block]:
    return [
        question(d, "a", "Total forward time from the profiler, compared with the Python timer.",
                 [d.table("*forward*total*", "*range*", "*nvtx*")], what="profiled forward-pass time"),
        question(d, "b", "The kernel with the most cumulative GPU time in the forward pass; how often it runs; "
                 "whether forward+backward changes that.",
                 [d.table("*forward*kernel*", "kernels_forward*", "*kernel*")], what="kernel table of the forward pass"),
        question(d, "c", "Non-matmul kernels with non-trivial runtime in the forward pass.",
                 [d.figure("*categor*", "*share*")], what="kernel categories of the forward pass"),
        question(d, "d", "How the matmul share of GPU time changes for a full training step with AdamW.",
                 [d.table("*train*kernel*", "*step*kernel*", "*categor*")], what="kernel table of a training step"),
        question(d, "e", "Softmax versus matmul runtime inside self-attention, against their FLOP ratio.",
                 [d.table("*softmax*", "*attention*")], what="softmax vs matmul timings inside attention"),
    ]


def mixed_precision(d: SectionData) -> list[Block]:
    return [
        question(d, "accumulation", "Accumulating 0.01 a thousand times in fp32/fp16 and mixtures of the two.",
                 [d.table("*accumulat*")], what="the accumulation experiment"),
        question(d, "a", "Data types inside `torch.autocast(float16)` for the ToyModel.",
                 [d.table("*dtype*", "*toy*")], what="the autocast dtype table"),
        question(d, "b", "Which parts of layer normalization are sensitive to reduced precision, and whether bf16 "
                 "changes that.", [Text(
                     "LayerNorm/RMSNorm reduce over the feature dimension: the mean of squares (and, for "
                     "LayerNorm, the mean and variance) sums many terms, and the reciprocal square root "
                     "amplifies small errors in that sum. fp16's 5-bit exponent also overflows on $x^2$ for "
                     "$|x| > 256$ (its maximum is $65504$), so autocast keeps normalization in fp32. bf16 has "
                     "fp32's exponent range, so overflow is no longer a concern, but its 8-bit mantissa makes "
                     "the accumulation even less precise than fp16's, so the reduction still belongs in fp32.")]),
        question(d, "c", "Forward and backward timings with and without bf16 mixed precision, by model size.",
                 [d.table("*mixed*", "*bf16*", "*precision*")], what="bf16 vs fp32 timings by model size"),
    ]


def memory_profiling(d: SectionData) -> list[Block]:
    cfg = get_config("2.7B")
    act = residual_stream_bytes(cfg, cfg.batch_size, cfg.context_length, "fp32")
    return [
        question(d, "a", "Memory timelines of the 2.7B model: forward only and a full training step.",
                 [d.figure("*forward*timeline*", "*timeline*forward*"), d.figure("*train*timeline*", "*timeline*train*",
                                                                                 "*timeline*step*")],
                 what="memory timelines"),
        question(d, "b", "Peak memory by context length, forward only and full training step.",
                 [d.table("*peak*")], what="peak memory by context length"),
        question(d, "c", "Peak memory with bf16 mixed precision.", [d.table("*mixed*", "*bf16*", "*precision*")],
                 what="peak memory with mixed precision"),
        question(d, "d", "Size of one residual-stream activation of the 2.7B model in fp32.", [
            Equation([
                r"B \cdot T \cdot d_{\mathrm{model}} \cdot 4\,\mathrm{bytes} = "
                rf"{cfg.batch_size} \cdot {cfg.context_length} \cdot {cfg.d_model} \cdot 4 = {act:,}\,\mathrm{{B}}",
            ]),
            Text(f"That is {fmt.mib(act, 4)} at batch size {cfg.batch_size} and context length "
                 f"{cfg.context_length} (reference hyperparameters)."),
        ]),
        question(d, "e", "The largest allocations in the active-memory timeline and where they come from.",
                 [d.table("*largest*", "*allocation*")], what="the largest allocations"),
    ]
