"""§1.1: end-to-end benchmarking, kernel profiles, mixed precision and memory profiling.

Artefact names follow :mod:`cs336_systems.benchmarking.sections` (one ``run_<section>`` per folder).
"""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.configs import get_config, residual_stream_bytes
from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import failed_rows, join_words, ok_rows, question, subset

# --------------------------------------------------------------------------------------------------
# §1.1.3
# --------------------------------------------------------------------------------------------------


def benchmarking(d: SectionData) -> list[Block]:
    timings = d.frame("timings")
    study = d.frame("warmup_study")
    return [
        question(d, "a", "A script for end-to-end benchmarking of the forward and backward passes.", [
            Text("`python -m cs336_systems.benchmarking model --size SIZE --mode forward_backward` builds a "
                 "preset, draws a random batch, runs `--warmup` untimed steps and then times each phase "
                 "(forward, backward, optimizer) with `timeit.default_timer`, calling "
                 "`torch.cuda.synchronize()` after each; `python -m cs336_systems.benchmarking benchmarking` "
                 "runs this section's whole sweep.")]),
        question(d, "b", "Forward and backward timings for the model sizes of §1.1.2 (5 warm-up, 10 measured "
                 "steps).", [_timing_sentence(timings),
                             d.table("timings", caption="Time per step by model size, forward + backward mode."),
                             d.figure("timings", caption="Forward and backward time per step (error bars: one "
                                      "standard deviation).")], what="end-to-end timings by model size"),
        question(d, "c", "The effect of warm-up steps.", [
            _warmup_sentence(study),
            d.table("warmup_study", caption="Timings after 0, 1, 2 and 5 warm-up steps, each setting in a "
                    "fresh process."),
            d.figure("warmup_study", caption="Spread of the forward time against the number of warm-up steps."),
            None if study is None else Text("The first steps of a process pay one-time costs that are not part of steady-state training: "
                 "CUDA context and cuBLAS handle creation, lazy loading of kernel modules, cuBLAS heuristics "
                 "choosing a GEMM algorithm per shape, and the caching allocator obtaining memory with "
                 "`cudaMalloc`. Without warm-up these land in the measured steps, inflating the mean and above "
                 "all the standard deviation; after one or two steps every shape has been seen once and the "
                 "allocator's pool is warm, so later steps reuse both."),
        ], what="timings with 0, 1 and 2 warm-up steps"),
    ]


def _timing_sentence(df: pd.DataFrame | None) -> Text | None:
    ok = ok_rows(df)
    if ok.empty or not {"forward_mean_ms", "backward_mean_ms"} <= set(ok.columns):
        return None
    parts = [f"{r['size']} {fmt.ms(r['forward_mean_ms'])} / {fmt.ms(r['backward_mean_ms'])}" for _, r in ok.iterrows()]
    text = f"Forward / backward time per step: {join_words(parts)}."
    if {"forward_std_ms", "backward_std_ms"} <= set(ok.columns):
        cv = pd.concat([ok["forward_std_ms"] / ok["forward_mean_ms"], ok["backward_std_ms"] / ok["backward_mean_ms"]],
                       keys=["forward", "backward"])
        phase, idx = cv.idxmax()
        text += (f" The standard deviation is a median {fmt.pct(cv.median(), 2)} of the mean and at most "
                 f"{fmt.pct(cv.max(), 2)} ({ok.loc[idx, 'size']} {phase})"
                 + (": after warm-up the variability is low." if cv.median() < 0.05 else "."))
    failed = failed_rows(df)
    if not failed.empty:
        text += " Not measured: " + join_words([f"{r['size']} ({r['status']})" for _, r in failed.iterrows()]) + "."
    return Text(text)


def _warmup_sentence(df: pd.DataFrame | None) -> Text | None:
    ok = ok_rows(df)
    if ok.empty or not {"warmup", "forward_mean_ms", "forward_std_ms"} <= set(ok.columns):
        return None
    sentences = []
    for size, g in ok.groupby("size", sort=False):
        g = g.sort_values("warmup")
        parts = [f"{fmt.ms(r['forward_mean_ms'])} ± {fmt.sig(r['forward_std_ms'], 2)} after {int(r['warmup'])}"
                 for _, r in g.iterrows()]
        sentences.append(f"{size}: forward {join_words(parts)} warm-up steps")
    return Text("Forward time (mean ± standard deviation) by warm-up steps: " + "; ".join(sentences) + ".")


# --------------------------------------------------------------------------------------------------
# §1.1.4
# --------------------------------------------------------------------------------------------------

_KERNEL_PARTS = re.compile(r"\b(\w*Functor\w*|\w+_kernel\w*|\w+_sgemm\w*|\w*[Ss]oftmax\w*|\w*[Rr]educe\w*)\b")


_GENERIC_KERNEL_PARTS = {"gpu_kernel_impl_nocast", "gpu_kernel_impl", "BinaryFunctor", "AUnaryFunctor",
                         "BUnaryFunctor", "unrolled_elementwise_kernel", "vectorized_elementwise_kernel"}


def short_kernel(name: object, limit: int = 64) -> str:
    """A readable name for a demangled CUDA kernel: ``void at::native::elementwise_kernel<128, 2,
    …DivFunctor<float>…>(…)`` → ``elementwise_kernel<DivFunctor>``; long cuBLAS names are cut to
    ``limit`` characters. The full names stay in the CSV."""
    text = re.sub(r"^void\s+", "", str(name)).replace("(anonymous namespace)::", "")
    if "<" in text or "(" in text:
        head = text.split("<")[0].split("(")[0]
        base = head.split("::")[-1].strip() or head
        inner = [m for m in dict.fromkeys(_KERNEL_PARTS.findall(text[len(head):]))
                 if m != base and m not in _GENERIC_KERNEL_PARTS]
        text = f"{base}<{', '.join(inner[-2:])}>" if inner else base
    text = re.sub(r"_stage\d+_warpsize.*$", "", text)  # cuBLAS: keep arch, dtypes, layout and tile
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _largest_ok(df: pd.DataFrame) -> pd.Series | None:
    """The row of the largest model at its longest context (the summary's most informative row)."""
    ok = ok_rows(df)
    if ok.empty:
        return None
    order = {name.lower(): i for i, name in enumerate(["tiny", "small", "medium", "large", "xl", "2.7b"])}
    key = ok.assign(_s=ok["size"].astype(str).str.lower().map(order).fillna(-1),
                    _c=ok.get("context_length", 0))
    return ok.loc[key.sort_values(["_s", "_c"]).index[-1]]


def nsys_profile(d: SectionData) -> list[Block]:
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

    a = b = c = dd = e = None
    if row is not None:
        ratios = ok_rows(summary)["profiled_forward_kernels_ms"] / ok_rows(summary)["python_forward_ms"]
        a = Text(f"For {where} the profiler's kernels sum to {fmt.ms(row['profiled_forward_kernels_ms'])} per forward "
                 f"pass against {fmt.ms(row['python_forward_ms'])} from the Python timer; over all configurations "
                 f"the kernel time is {fmt.pct(ratios.min(), 2)}–{fmt.pct(ratios.max(), 2)} of the timed forward "
                 "pass. Below 100% the GPU idles between kernels (launch overhead, which dominates small models "
                 "and short contexts), time the Python timer sees and the kernel sum does not"
                 + ("; above 100% the profiler's own instrumentation slows the kernels it records." if ratios.max() > 1
                    else "."))
        step_top = None
        if top is not None and {"range", "rank", "name"} <= set(top.columns):
            sel = top[(top["size"] == row["size"]) & (top["context_length"] == row["context_length"])
                      & (top["range"] == "step") & (top["rank"] == 1)]
            step_top = sel["name"].iloc[0] if not sel.empty else None
        same = ("the same kernel also leads the full training step" if step_top == row["top_forward_kernel"]
                else f"in the full training step `{short_kernel(step_top)}` leads instead" if step_top else "")
        b = Text(f"For {where} the kernel with the most GPU time in the forward pass is "
                 f"`{short_kernel(row['top_forward_kernel'])}`, {fmt.pct(row['top_kernel_percent'] / 100)} of the forward "
                 f"kernel time, launched {fmt.count(row['top_kernel_calls_per_forward'])} times per forward pass"
                 + (f"; {same}." if same else "."))
        c = Text(f"The largest non-matmul kernel is `{short_kernel(row['top_non_matmul_kernel'])}` with "
                 f"{fmt.pct(row['top_non_matmul_percent'] / 100)} of the forward time; elementwise kernels "
                 "(softmax pieces, SwiGLU's SiLU and product, RMSNorm, RoPE, masking) each read and write whole "
                 "activations for few FLOPs, so they are memory bound and take time out of proportion to "
                 "their FLOPs.")
        mm = ok_rows(summary)
        fwd_share, step_share = mm["matmul_percent_forward"], mm["matmul_percent_train_step"]
        dd = Text(f"Matmuls take {fmt.pct(fwd_share.min() / 100)}–{fmt.pct(fwd_share.max() / 100)} of the kernel "
                  f"time in the forward pass and {fmt.pct(step_share.min() / 100)}–{fmt.pct(step_share.max() / 100)}"
                  " of a full training step"
                  + (": the AdamW update (elementwise over every parameter) and the backward of the elementwise "
                     "ops add non-matmul time." if (step_share < fwd_share).mean() > 0.5 else "."))
        per_flop = row["softmax_to_matmul_time"] / row["softmax_to_matmul_flops"]
        e = Text(f"For {where}, attention's softmax takes {fmt.ratio(row['softmax_to_matmul_time'])} the time of "
                 f"its two matmuls for {fmt.ratio(row['softmax_to_matmul_flops'])} their FLOPs, i.e. "
                 f"{fmt.sig(per_flop)} times the time per FLOP"
                 + (": the matmuls run on tensor cores near peak FLOP/s while the softmax reads and writes the "
                    "whole score matrix several times and is limited by memory bandwidth." if per_flop > 1 else "."))
    return [
        question(d, "a", "Total forward time from the profiler, compared with the Python timer.",
                 [a, part("Forward time: Python timer vs. the sum of profiled kernels.", "python_forward_ms",
                          "python_forward_std_ms", "profiled_forward_kernels_ms", "profiled_step_kernels_ms")],
                 what="profiled forward-pass time"),
        question(d, "b", "The kernel with the most cumulative GPU time in the forward pass; how often it runs; "
                 "whether a full training step changes that.",
                 [b, part("Top kernels of the forward pass.", "top_forward_kernel", "top_kernel_calls_per_forward",
                          "top_kernel_percent", "top_non_matmul_kernel", "top_non_matmul_percent")],
                 what="kernel table of the forward pass"),
        question(d, "c", "Non-matmul kernels with non-trivial runtime in the forward pass.",
                 [c, _top_kernels(d, top, row)], what="kernel categories of the forward pass"),
        question(d, "d", "How the matmul share of GPU time changes for a full training step with AdamW.",
                 [dd, part("Share of kernel time in matmuls (%).", "matmul_percent_forward",
                           "matmul_percent_train_step"), d.figure("matmul_share", caption="Share of GPU kernel "
                                                                  "time spent in matmuls.")],
                 what="kernel shares of a training step"),
        question(d, "e", "Softmax versus matmul runtime inside self-attention, against their FLOP ratio.",
                 [e, part("Attention's matmuls vs. its softmax, time and FLOPs.", "attention_matmul_ms",
                          "attention_softmax_ms", "softmax_to_matmul_time", "softmax_to_matmul_flops")],
                 what="softmax vs matmul timings inside attention"),
    ]


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


# --------------------------------------------------------------------------------------------------
# §1.1.5
# --------------------------------------------------------------------------------------------------


def mixed_precision(d: SectionData) -> list[Block]:
    acc = d.frame("accumulation")
    dtypes = d.frame("toy_model_dtypes")
    speed = d.frame("bf16_speedup")
    acc_text = None
    if acc is not None and {"loop", "result", "abs_error"} <= set(acc.columns):
        parts = [f"`{r['loop']}` gives {r['result']:.6f} (error {fmt.sig(r['abs_error'], 2)})" for _, r in acc.iterrows()]
        acc_text = Text(
            "Adding 0.01 one thousand times: " + "; ".join(parts) + ". 0.01 is not exactly representable in "
            "either format, and fp16's 10-bit mantissa makes its spacing near 10 about $2^{-7} \\approx 0.008$, "
            "so every addition into an fp16 accumulator rounds away a large part of the summand. Keeping the "
            "accumulator in fp32 leaves only the one-time error of rounding 0.01 to fp16: accumulate in fp32.")
    dtype_text = None
    if dtypes is not None and {"quantity", "dtype"} <= set(dtypes.columns):
        groups = dtypes.groupby("dtype", sort=False)["quantity"].apply(list)
        dtype_text = Text("Under `torch.autocast(\"cuda\", dtype=torch.float16)`: " + "; ".join(
            f"{join_words(q)}: `{dt}`" for dt, q in groups.items()) + ". Parameters stay fp32 (autocast casts "
            "copies for each matmul), so their gradients are fp32 too.")
    speed_text = None
    if speed is not None and {"size", "forward_speedup", "backward_speedup"} <= set(speed.columns) and len(speed):
        first, last = speed.iloc[0], speed.iloc[-1]
        speed_text = Text(
            f"bf16 autocast speeds the forward pass up {fmt.ratio(first['forward_speedup'])} for {first['size']} "
            f"and {fmt.ratio(last['forward_speedup'])} for {last['size']}; the backward pass "
            f"{fmt.ratio(first['backward_speedup'])} and {fmt.ratio(last['backward_speedup'])}. Larger models "
            "spend a larger share of their time in big matmuls, where bf16 tensor cores have the most advantage "
            "over fp32 (TF32 off), while small models are bound by elementwise kernels and launch overhead that "
            "autocast does not speed up (and its casts add to).")
    return [
        question(d, "mixed_precision_accumulation", "Accumulating 0.01 a thousand times in fp32, fp16 and "
                 "mixtures.", [acc_text, d.table("accumulation", caption="The four accumulation loops.", digits=7)],
                 what="the accumulation experiment"),
        question(d, "a", "Data types inside `torch.autocast(float16)` for the ToyModel.",
                 [dtype_text, d.table("toy_model_dtypes", caption="ToyModel tensors under fp16 autocast.")],
                 what="the autocast dtype table"),
        question(d, "b", "Which parts of layer normalization are sensitive to reduced precision, and whether "
                 "bf16 changes that.", [Text(
                     "The reductions: the mean and the variance (RMSNorm: the mean of squares) sum many terms, "
                     "and $1/\\sqrt{\\sigma^2 + \\epsilon}$ amplifies errors in a small variance. fp16 also "
                     "overflows on $x^2$ once $|x| > 256$ (its maximum is 65504), so autocast keeps "
                     "normalization in fp32. bf16 has fp32's exponent range, so overflow is no longer the risk, "
                     "but its 8-bit significand makes the sums even less precise than fp16's: the statistics "
                     "still belong in fp32.")]),
        question(d, "c", "Forward and backward timings with and without bf16 mixed precision, by model size.",
                 [speed_text, d.table("bf16_speedup", caption="fp32 vs. bf16 autocast, mean time per step and "
                                      "speed-up (fp32 time / bf16 time)."),
                  d.figure("bf16_speedup", caption="bf16 autocast speed-up by model size.")],
                 what="bf16 vs fp32 timings by model size"),
    ]


# --------------------------------------------------------------------------------------------------
# §1.1.6
# --------------------------------------------------------------------------------------------------


def _peak_pivot(peaks: pd.DataFrame, precision: str) -> pd.DataFrame | None:
    ok = ok_rows(peaks)
    if ok.empty or not {"precision", "mode", "context_length", "peak_GiB"} <= set(ok.columns):
        return None
    sel = ok[ok["precision"] == precision]
    if sel.empty:
        return None
    wide = sel.pivot_table(index="context_length", columns="mode", values="peak_GiB").reset_index()
    wide.columns = [c if c == "context_length" else f"{c}_peak_GiB" for c in wide.columns]
    return wide


def memory_profiling(d: SectionData) -> list[Block]:
    cfg = get_config("2.7B")
    act = residual_stream_bytes(cfg, cfg.batch_size, cfg.context_length, "fp32")
    peaks = d.frame("peak_memory")
    fp32 = _peak_pivot(peaks, "fp32") if peaks is not None else None
    bf16 = _peak_pivot(peaks, "bf16") if peaks is not None else None
    b_text = c_text = None
    if fp32 is not None and {"forward_peak_GiB", "train_peak_GiB"} <= set(fp32.columns):
        b_text = Text("Peak memory of the 2.7B model: " + join_words([
            f"{fmt.gib(r['forward_peak_GiB'] * 2**30)} forward / {fmt.gib(r['train_peak_GiB'] * 2**30)} training "
            f"step at context {int(r['context_length'])}" for _, r in fp32.iterrows()]) + ". The training step "
            "adds gradients and AdamW's two moments (three more copies of the weights) to the forward pass's "
            "weights and activations.")
    if fp32 is not None and bf16 is not None:
        m = fp32.merge(bf16, on="context_length", suffixes=("_fp32", "_bf16"))
        parts, ratios = [], []
        for mode in ("forward", "train"):
            a, bcol = f"{mode}_peak_GiB_fp32", f"{mode}_peak_GiB_bf16"
            if a in m and bcol in m:
                r = (m[bcol] / m[a]).dropna()
                if not r.empty:
                    ratios.append(r)
                    parts.append(f"{'forward' if mode == 'forward' else 'training-step'} peaks by a factor of "
                                 f"{fmt.sig(r.min(), 2)}–{fmt.sig(r.max(), 2)}")
        if parts:
            grows = any(x.max() > 1 for x in ratios)
            c_text = Text("bf16 autocast changes the " + join_words(parts) + " (bf16 / fp32). Autocast keeps the "
                          "fp32 weights, gradients and optimizer state and adds bf16 copies of weights for the "
                          "matmuls, so only the activations saved for backward shrink"
                          + ("; where the peak grows, those weight copies outweigh the smaller activations." if grows
                             else "; the saving grows with context length, where activations dominate."))
    timeline = d.figure("timeline_fp32", caption="Active memory over allocation events, 2.7B, fp32: forward pass "
                        "(top) and training step (bottom) by context length.")
    rs = d.json("residual_stream")
    rs_text = None
    if isinstance(rs, dict) and "measured_bytes" in rs:
        rs_text = Text(f"Measured in a forward pass (the first block's output, shape {tuple(rs.get('shape', []))}, "
                       f"`{rs.get('dtype')}`): {int(rs['measured_bytes']):,} bytes, "
                       + ("matching the formula." if rs.get("measured_bytes") == rs.get("predicted_bytes") else
                          f"against {int(rs.get('predicted_bytes', 0)):,} predicted."))
    return [
        question(d, "a", "Memory timelines of the 2.7B model: forward pass and full training step.", [
            timeline,
            None if timeline is None else Text("In the forward pass memory climbs in a staircase, one step per block as its activations are "
                 "saved, and peaks at the logits. The training step repeats that ramp, then falls as backward "
                 "frees each block's activations while gradients appear, and the optimizer step adds AdamW's "
                 "state: the phases are recognizable from the shape alone."),
        ], what="memory timelines"),
        question(d, "b", "Peak memory by context length, forward pass and full training step.",
                 [b_text, d.table("peak_memory", frame=fp32, caption="Peak allocated memory of the 2.7B model, "
                                  "fp32 (GiB).")], what="peak memory by context length"),
        question(d, "c", "Peak memory with bf16 mixed precision.",
                 [c_text, d.table("peak_memory", frame=bf16, caption="Peak allocated memory of the 2.7B model "
                                  "under bf16 autocast (GiB)."),
                  d.figure("timeline_bf16", caption="Active memory timelines under bf16 autocast.")],
                 what="peak memory with mixed precision"),
        question(d, "d", "Size of one residual-stream activation of the 2.7B model in fp32.", [
            Equation([
                (r"B \cdot T \cdot d_{\mathrm{model}} \cdot 4\,\mathrm{bytes} = "
                rf"{cfg.batch_size} \cdot {cfg.context_length} \cdot {cfg.d_model} \cdot 4 = {fmt.tex_int(act)}\,\mathrm{{B}}"
                rf" = {act / 2**20:g}\,\mathrm{{MiB}}"),
            ]),
            Text(f"At the reference batch size {cfg.batch_size} and context length {cfg.context_length} one "
                 f"residual-stream tensor is {fmt.mib(act, 4)}."),
            rs_text,
        ]),
        question(d, "e", "The largest allocations in the active-memory timeline and where they come from.",
                 [_largest_text(d.frame("largest_allocations")),
                  d.table("largest_allocations", frame=subset(d.frame("largest_allocations"), "size_MiB", "count",
                                                              "origin"),
                          caption="Largest allocations of the fp32 training step (stacks: the CSV).")],
                 what="the largest allocations"),
    ]


def _largest_text(df: pd.DataFrame | None) -> Text | None:
    if df is None or df.empty or not {"size_MiB", "origin"} <= set(df.columns):
        return None

    explained = []

    def where(origin: str) -> str:
        if not origin.startswith("(no user frame"):
            return f"`{origin}`"
        if explained:
            return "no Python frame"
        explained.append(True)
        return "no Python frame on the stack (allocated inside autograd's backward or the optimizer's C++ code)"

    parts = [f"{fmt.mib(r['size_MiB'] * 2**20)}" + (f" ×{int(r['count'])}" if "count" in df.columns else "")
             + f" from {where(str(r['origin']))}" for _, r in df.head(3).iterrows()]
    return Text("The largest allocations: " + "; ".join(parts) + ".")
