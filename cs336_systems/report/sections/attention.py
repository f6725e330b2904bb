"""§1.2–1.3: naive PyTorch attention at scale, torch.compile, and FlashAttention-2 in Triton."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report import fmt
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Block, Equation, Text
from cs336_systems.report.sections.common import failed_rows, join_words, ok_rows, question, subset


def pytorch_attention(d: SectionData) -> list[Block]:
    timings = d.frame("timings")
    acc = d.json("oom_accounting")
    ok = ok_rows(timings)
    t_text = None
    if not ok.empty and {"seq_len", "forward_mean_ms", "backward_mean_ms"} <= set(ok.columns):
        big = ok[ok["seq_len"] == ok["seq_len"].max()]
        failed = failed_rows(timings)
        params = d.meta("timings").get("params", {})
        setup = ", ".join(x for x in (
            f"batch {params['batch_size']}" if params.get("batch_size") else "",
            f"{params['n_forward']} forward and {params.get('n_backward', params['n_forward'])} backward passes each"
            if params.get("n_forward") else "") if x)
        t_text = Text(
            f"{len(ok)} of {len(timings)} configurations ran" + (f" ({setup})" if setup else "") + ". "
            f"At the longest sequence that ran, {int(big['seq_len'].iloc[0]):,}, a forward pass takes "
            f"{fmt.ms(big['forward_mean_ms'].min())}–{fmt.ms(big['forward_mean_ms'].max())} and a backward pass "
            f"{fmt.ms(big['backward_mean_ms'].min())}–{fmt.ms(big['backward_mean_ms'].max())} across head sizes."
            + (" Out of memory or not run: " + join_words([f"$d={int(r['d_model'])}, T={fmt.tex_int(r['seq_len'])}$ "
               f"({r['status']})" for _, r in failed.iterrows()]) + "." if not failed.empty else ""))
    acc_blocks: list[Block | None] = []
    if isinstance(acc, dict) and "terms_MiB" in acc:
        B, T, dd = int(acc["batch_size"]), int(acc["seq_len"]), int(acc["d_model"])
        total = acc["terms_MiB"].get("total", float("nan"))
        acc_blocks = [
            Text(f"Configuration: $d = {dd}$, $T = {fmt.tex_int(T)}$, $B = {B}$ ({acc.get('source', '')}):"),
            Equation([(rf"M_{{\mathrm{{saved}}}} = 4 \cdot {B}\,(3 \cdot {T}^2 + 2 \cdot {T} + 5 \cdot {T} \cdot {dd})"
                      rf" + {T}^2 = {fmt.tex_sig(total, 4)}\,\mathrm{{MiB}}")]),
        ]
        below = acc.get("below")
        if isinstance(below, dict) and below.get("measured_MiB") is not None:
            acc_blocks.append(Text(
                f"Check one size below ($T = {fmt.tex_int(below['seq_len'])}$): measured "
                f"{fmt.sig(below['measured_MiB'], 4)} MiB before backward, predicted "
                f"{fmt.sig(below['predicted_MiB'], 4)} MiB."))
    return [
        question(d, "timings", "Forward and backward time and memory of naive attention (batch 8, one head) over "
                 "$d \\in \\{16, 32, 64, 128\\}$ and sequence lengths 256–16384.", [
                     t_text,
                     d.figure("attention_grid", caption="Forward and backward time and memory over the grid."),
                     d.table("grid_forward_ms", caption="Forward time (ms) by head size (rows) and sequence "
                             "length (columns); OOM: out of memory."),
                     d.table("grid_backward_ms", caption="Backward time (ms)."),
                     d.table("grid_memory_before_backward_MiB", caption="Memory in use before the backward pass "
                             "(MiB)."),
                 ], what="the attention sweep"),
        question(d, "memory", "Memory accounting for the smallest configuration that runs out of memory, and how "
                 "to remove that cost.", [
                     Text("Eager attention keeps, per batch element, three $T\\times T$ fp32 tensors alive for the "
                          "backward pass (the masked scores $S = QK^\\top/\\sqrt{d}$, their exponentials, and the "
                          "probabilities $P$), a boolean $T\\times T$ causal mask, the row max and sum, and "
                          "$Q, K, V$, the output $O$ and the upstream gradient ($T\\times d$ each):"),
                     Equation([r"M_{\mathrm{saved}}(B, T, d) = 4B\,(3T^2 + 2T + 5Td) + T^2\ \mathrm{bytes}."]),
                     *acc_blocks,
                     Text("The $T^2$ terms dominate: doubling $T$ quadruples the memory, whatever $d$. "
                          "FlashAttention removes them by recomputing $S$ and $P$ tile by tile in the backward pass "
                          "and saving only $O$ and the row-wise log-sum-exp $L$ ($T$ values), so the saved memory "
                          "becomes linear in $T$."),
                     d.table("memory_accounting", caption="Predicted vs. measured memory before backward."),
                 ], what="the memory accounting"),
        Text("Full timings with standard deviations: `timings.csv` in this folder." if timings is not None else ""),
    ]


def torch_compile(d: SectionData) -> list[Block]:
    att = d.frame("attention_speedup")
    model = d.frame("model_speedup")
    d.frame("attention_timings"), d.frame("model_timings")  # shown through the speed-up tables
    a_text = b_text = None
    if att is not None and {"forward_speedup", "backward_speedup"} <= set(att.columns) and att["forward_speedup"].notna().any():
        a_text = Text(f"Compiling the attention function changes the forward time by a factor of "
                      f"{fmt.ratio(att['forward_speedup'].min())}–{fmt.ratio(att['forward_speedup'].max())} "
                      f"(eager / compiled) and the backward by {fmt.ratio(att['backward_speedup'].min())}–"
                      f"{fmt.ratio(att['backward_speedup'].max())}: Inductor fuses the scaling, masking and "
                      "softmax into one or two Triton kernels, but the $T\\times T$ matrices are still written "
                      "to memory.")
    if model is not None and {"mode", "speedup"} <= set(model.columns) and len(model):
        parts = [f"{r['size']} {r['mode']} {fmt.ratio(r['speedup'])}" for _, r in model.iterrows()]
        b_text = Text("Speed-up of the compiled model (eager / compiled time): " + join_words(parts) + ".")
    return [
        question(d, "a", "Compiled versus eager attention, forward and backward.",
                 [a_text, d.table("attention_speedup", caption="Eager vs. compiled attention (ms) and speed-up.")],
                 what="compiled vs eager attention timings"),
        question(d, "b", "The compiled Transformer end to end: forward, and forward + backward + optimizer step.",
                 [b_text, d.table("model_speedup", caption="Vanilla vs. compiled model (ms per step)."),
                  d.figure("compile_speedup", caption="Speed-up from torch.compile.")],
                 what="compiled vs eager model timings"),
    ]


def flash_attention(d: SectionData) -> list[Block]:
    return [
        question(d, "flash_forward", "FlashAttention-2 forward in PyTorch and in Triton, with a causal flag.", [
            Text("The forward pass tiles $Q$ into row blocks of $B_q$ rows and streams $K, V$ in column blocks of "
                 "$B_k$ rows, keeping a running row maximum $m$, normalizer $\\ell$ and unnormalized output "
                 "$\\tilde O$ in on-chip memory; per key block $j$:"),
            Equation([
                (r"S^{(j)} = Q_i K_j^\top/\sqrt{d},\quad m^{(j)} = \max\left(m^{(j-1)}, \mathrm{rowmax}\,S^{(j)}\right),"
                r"\quad \tilde P^{(j)} = \exp\left(S^{(j)} - m^{(j)}\right)"),
                (r"\ell^{(j)} = e^{m^{(j-1)} - m^{(j)}}\,\ell^{(j-1)} + \mathrm{rowsum}\,\tilde P^{(j)},\quad "
                r"\tilde O^{(j)} = \mathrm{diag}\left(e^{m^{(j-1)} - m^{(j)}}\right)\tilde O^{(j-1)} + \tilde P^{(j)} V_j"),
                r"O_i = \mathrm{diag}\left(\ell\right)^{-1}\tilde O,\qquad L_i = m + \log \ell",
            ]),
            Text("With the causal flag, key blocks entirely above the diagonal are skipped and the diagonal block "
                 "is masked with $-10^6$ before the maximum."),
        ]),
        question(d, "flash_backward", "The backward pass by recomputation (compiled PyTorch).", [
            Text("Only $O$ and $L$ are saved. With $D = \\mathrm{rowsum}(O \\circ dO)$ the backward recomputes "
                 "$P = \\exp(S - L)$ tile by tile:"),
            Equation([
                r"dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),",
                r"dQ = dS\,K/\sqrt{d},\quad dK = dS^\top Q/\sqrt{d}",
            ]),
        ]),
        question(d, "flash_benchmarking", "Triton FlashAttention-2 versus PyTorch attention (batch 1, causal) over "
                 "sequence lengths $2^7$–$2^{16}$, head sizes $2^4$–$2^7$, bf16 and fp32: forward, backward and "
                 "forward + backward latency.", _flash_sweep(d), what="the FlashAttention benchmark sweep"),
        question(d, "leaderboard", "Leaderboard timing: forward + backward, batch 1, $T = 16384$, "
                 "$d_{\\mathrm{model}} = 1024$ in 16 heads, bf16, causal.", _leaderboard(d),
                 what="the leaderboard timing"),
        question(d, "model", "The Transformer's training step with each attention implementation.", [
            _model_step_sentence(d.frame("model_step")),
            d.table("model_step", frame=subset(d.frame("model_step"), "context_length", "attention_impl", "status",
                                               "total_mean_ms", "total_std_ms", "peak_memory_GiB"),
                    caption="Training step (forward, backward, AdamW) by context length and attention."),
            d.figure("model_step", caption="Step time and peak memory by context length."),
        ]),
    ]


def _flash_sweep(d: SectionData) -> list[Block | None]:
    d.frame("sweep")  # the long table; shown through the speed-up table
    sp = d.frame("sweep_speedup")
    blocks: list[Block | None] = []
    if sp is not None and {"dtype", "pass", "speedup_vs_builtin"} <= set(sp.columns) and len(sp):
        parts = []
        for (dtype, ph), g in sp.groupby(["dtype", "pass"], sort=False):
            v = g["speedup_vs_builtin"].dropna()
            if len(v):
                parts.append(f"{dtype} {ph}: median {fmt.ratio(v.median())} (range {fmt.sig(v.min())}–"
                             f"{fmt.sig(v.max())})")
        blocks.append(Text("Speed-up of our Triton kernels over the fastest built-in PyTorch attention in each cell "
                           "(built-in time / ours; above 1 means ours is faster): " + "; ".join(parts) + "."))
        for dtype, g in sp.groupby("dtype", sort=False):
            wide = g.pivot_table(index=["seq_len", "head_dim"], columns="pass",
                                 values=["ours_ms", "best_builtin_ms"], sort=False)
            wide.columns = [f"{ph} {'ours' if k == 'ours_ms' else 'built-in'} ms" for k, ph in wide.columns]
            order = [c for ph in ("forward", "backward", "forward+backward") for c in
                     (f"{ph} ours ms", f"{ph} built-in ms") if c in wide.columns]
            blocks.append(d.table("sweep_speedup", frame=wide[order].reset_index(), caption=f"Latency (ms) of our "
                                  f"Triton FlashAttention-2 and the fastest built-in, {dtype}, batch 1, causal."))
    blocks.append(d.figure("sweep_speedup", caption="Speed-up over the fastest built-in per cell."))
    blocks.append(d.figure("sweep_latency_d64", caption="Latency against sequence length, head size 64."))
    if len([b for b in blocks if b is not None]) == 0:
        blocks.append(d.table("sweep", caption="Latency by implementation, dtype, head size, sequence length and pass."))
    return blocks


def _model_step_sentence(df: pd.DataFrame | None) -> Text | None:
    if df is None or not {"context_length", "attention_impl", "total_mean_ms"} <= set(df.columns) or df.empty:
        return None
    longest = df[df["context_length"] == df["context_length"].max()]
    parts = []
    for _, r in longest.iterrows():
        if str(r.get("status", "ok")) == "ok":
            mem = f", {fmt.gib(r['peak_memory_GiB'] * 2**30)}" if pd.notna(r.get("peak_memory_GiB")) else ""
            parts.append(f"{r['attention_impl']} {fmt.ms(r['total_mean_ms'])}{mem}")
        else:
            parts.append(f"{r['attention_impl']} {r['status']}")
    return Text(f"At context {int(longest['context_length'].iloc[0]):,} a training step takes: "
                + join_words(parts) + ".")


def _leaderboard_sentence(summary: dict, head_dim: str = "") -> Text | None:
    ours = summary.get("ours", "triton")
    ms_ = summary.get(f"{ours}_fwd_bwd_ms")
    if ms_ is None:
        return None
    vs = [f"{k.removeprefix('speedup_vs_')} {fmt.ratio(v)}" for k, v in summary.items()
          if k.startswith("speedup_vs_") and isinstance(v, (int, float))]
    lead = f"{head_dim}our kernels" if head_dim else "Our kernels"
    return Text(f"{lead} ({ours}) take {fmt.ms(ms_)} for forward + backward"
                + (f" ({fmt.sig(summary['ours_fwd_bwd_TFLOP_per_s'])} TFLOP/s)"
                   if "ours_fwd_bwd_TFLOP_per_s" in summary else "")
                + ("; speed-up over " + join_words(vs) + " measured in the same run." if vs else "."))


def _leaderboard(d: SectionData) -> list[Block | None]:
    summary = d.json("leaderboard_summary", "leaderboard*_summary")
    text = _leaderboard_sentence(summary) if isinstance(summary, dict) else None
    d128 = d.json("leaderboard_d128_summary") if "leaderboard_d128_summary" in d.records and \
        d.frame_name("leaderboard") else None
    if isinstance(d128, dict) and text is not None:
        extra = _leaderboard_sentence(d128, "With head size 128, ")
        text = Text(text.markdown + (" " + extra.markdown if extra else ""))
    anchors = summary.get("anchors_ms") if isinstance(summary, dict) else None
    if isinstance(anchors, dict) and anchors and text is not None:
        refs = join_words([f"{name} {fmt.ms(ms_)}" for name, ms_ in anchors.items()])
        text = Text(text.markdown + f" For reference, times not measured in this run: {refs}.")
    main = d.frame_name("leaderboard", "leaderboard_d*")
    frame = subset(d.frame(main) if main else None, "impl", "fwd_bwd_sum_ms", "fwd_bwd_sum_median_ms", "forward_ms",
                   "fwd_bwd_TFLOP_per_s", "forward_TFLOP_per_s")
    return [text, d.table(main or "", frame=frame, caption="Leaderboard configuration, forward + backward "
                          "with `o.sum().backward()` and forward alone (heads folded into the batch)."),
            d.table("leaderboard_d128", frame=subset(d.frame("leaderboard_d128"), "impl", "fwd_bwd_sum_ms",
                                                     "forward_ms", "fwd_bwd_TFLOP_per_s"),
                    caption="The same with head size 128.")]
