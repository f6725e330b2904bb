# === Answers: formatting only; changes below this line do not make results stale ===
"""§1.3.2's answers: the deliverables' text, tables and figures formatted from its results (nothing here
measures, so a change here stales no result)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from cs336_systems.benchmarking.flash.host import HOST_KEYS
from cs336_systems.benchmarking.flash.shapes import SHAPE_KEYS
from cs336_systems.experiments.flash_benchmarking import SWEEP_TABLES
from cs336_systems.experiments.flash_benchmarking.goals import (
    _host_bound_losers, _leaderboard_verdict, goals, kernel_gaps, pct_span, shapes_unmeasured, unmeasured_words)
from cs336_systems.experiments.flash_benchmarking.model_answers import (
    _model_ab, _model_setting, _model_step_sentence, _model_step_table)
from cs336_systems.report import fmt
from cs336_systems.report.answers import implemented, join_words, mfu_note, question, subset
from cs336_systems.report.data import SectionData, short_device
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Equation, Text


def answer(d: SectionData) -> list[Block]:
    sweep, sweep_rest = _flash_sweep(d)
    d128 = None
    if d.frame_name("leaderboard", "leaderboard_d*") != "leaderboard_d128":  # else it is the answer's own table
        d128 = d.table("leaderboard_d128", frame=subset(d.frame("leaderboard_d128"), "impl", "fwd_bwd_sum_ms",
                                                        "forward_ms", "fwd_bwd_TFLOP_per_s"),
                       caption="The leaderboard configuration with head size 128.")
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
                 "is masked with $-10^6$ before the maximum. On Hopper, long 16-bit rows at head dims 64 and 128 run "
                 "a warp-specialized Gluon forward instead."),
        ]),
        question(d, "flash_backward", "The backward pass by recomputation.", [
            Text("Besides the inputs $Q, K, V$, the forward saves only $O$ and the log-sum-exp $L$: no $T \\times T$ "
                 "matrix. With $D = \\mathrm{rowsum}(O \\circ dO)$ the backward recomputes "
                 "$P = \\exp(S - L)$ tile by tile:"),
            Equation([
                r"dV = P^\top dO,\quad dP = dO\,V^\top,\quad dS = P \circ (dP - D),",
                r"dQ = dS\,K/\sqrt{d},\quad dK = dS^\top Q/\sqrt{d}",
            ]),
            Text("It exists twice: `FlashAttentionPytorch` does it in tiled PyTorch under `torch.compile` (the "
                 "handout's version), and `FlashAttentionTriton`, benchmarked below, in two Triton kernels: the first "
                 "owns a query block, computes its $D$ and accumulates $dQ$ over the key blocks, writing $D$ and $L$ "
                 "for the second, which owns a key block and accumulates $dK, dV$; no two programs write the same "
                 "output, so no atomics. On Hopper, 16-bit long rows take FlashAttention-3's form instead: the first "
                 "kernel writes only $D$ and $L$, and a Gluon kernel per key block also forms $dQ$'s share, adding it "
                 "to float32 sums by TMA reduce-adds (five products per tile pair instead of seven)."
                 + _gluon_rows(d)),
            implemented(d, "`FlashAttentionPytorch` and `FlashAttentionTriton` (autograd functions, forward and "
                        "backward)", "cs336_systems/attention/", "tests/test_flash_attention.py",
                        "test_attention.py", against="regular attention in float64"),
        ]),
        question(d, "flash_benchmarking", "Triton FlashAttention-2 versus PyTorch attention (batch 1, causal) over "
                 "sequence lengths $2^7$–$2^{16}$, head sizes $2^4$–$2^7$, bf16 and fp32: forward, backward and "
                 "forward + backward latency.", sweep, what="the FlashAttention benchmark sweep"),
        question(d, "leaderboard", "Leaderboard timing: forward + backward, batch 1, $T = 16384$, "
                 "$d_{\\mathrm{model}} = 1024$ in 16 heads, bf16, causal.", _leaderboard(d),
                 what="the leaderboard timing"),
        Text("", role=BEYOND_HANDOUT),  # the rest measures what the handout does not ask: the writeup's appendix
        *goals(d),
        *([question(d, "flash_benchmarking", "Every head size of the sweep, and the sweep plotted.", sweep_rest)]
          if any(b is not None for b in sweep_rest) else []),
        *([question(d, "leaderboard", "The leaderboard configuration with head size 128.", [d128])]
          if d128 is not None else []),
        question(d, "model", "The Transformer's training step with each attention implementation.", [
            _model_step_sentence(d.frame("model_step")),
            d.table("model_step", frame=_model_step_table(d.frame("model_step"), d.meta("model_step")),
                    caption="Training step (forward, backward, AdamW) by context length" + _model_setting(
                        d.frame("model_step")) + ", one column group per "
                            "attention: mean ms, MFU and peak memory (OOM: out of memory; spreads and the "
                            "forward/backward/optimizer split: the CSV)." + mfu_note(d.meta("model_step"), ("bf16",))),
            d.figure("model_step", caption="Step time and peak memory by context length."),
        ]),
        *_shapes(d),
        *_losers(d),
        *_host(d),
        *_model_ab(d),
    ]


def _losers(d: SectionData) -> list[Block]:
    """Beyond the handout: where the worst shapes of the grid lose, kernel by kernel (empty without results)."""
    summary = d.frame("losers")
    if summary is None or summary.empty or "loses_most_in" not in summary:
        return []
    text = (f"Profiled at the {len(summary)} shapes where ours loses most to cuDNN (forward+backward, GPU time per "
            "kernel, alternating). " + _losers_per_shape(summary) + " (GPU µs per call by phase and kernel: "
            "`losers.csv`, `losers_kernels.csv` in the results index)")
    host_bound = _host_bound_losers(summary, d.frame("shapes_ratio"))
    if len(host_bound):
        text += (f". At {len(host_bound)} of them a call in the grid took well over its kernels' GPU time (ours, "
                 "grid µs against GPU µs: " + "; ".join(
                     f"{_loser_shape(r)} {fmt.sig(r['grid_us'])} against {fmt.sig(r['ours_total_us'])}"
                     for _, r in host_bound.iterrows())
                 + "): the grid times calls back to back, so there it measures the host's time to issue a call, "
                 "not the kernels, and a faster kernel would not close the gap")
    gpu_bound = summary.drop(host_bound.index)
    if len(gpu_bound):
        counts = gpu_bound["loses_most_in"].value_counts()
        slowest = gpu_bound["ours_slowest_kernel"].value_counts()
        which = (("the other one" if len(gpu_bound) == 1 else f"the other {len(gpu_bound)}") if len(host_bound)
                 else str(len(gpu_bound)))
        def at(n: int) -> str:
            return "" if len(gpu_bound) == 1 else " at all of them" if n == len(gpu_bound) else f" at {n} of them"

        text += (f". At {which} the kernels lose{_gpu_gaps(gpu_bound, d.json('shapes_summary'))}: the larger part "
                 "of the GPU gap lies in the " + join_words([f"{phase}{at(n)}" for phase, n in counts.items()])
                 + ", and our slowest kernel is " + join_words([f"`{k}`{at(n)}" for k, n in slowest.items()]))
        levers = [_forward_lever(gpu_bound[gpu_bound["loses_most_in"] == "forward"]) if phase == "forward" else
                  _backward_lever(gpu_bound[gpu_bound["loses_most_in"] == "backward"]) if phase == "backward" else
                  LOSER_LEVERS[phase] for phase in counts.index if phase in LOSER_LEVERS]
        if levers:
            text += ". What the kernel notes say of each: " + "; ".join(levers)
    d.frame("losers_kernels")  # cited above, listed in the index
    return [question(d, "losers", "Beyond the handout: where the shapes that lose most lose, from a profile.",
                     [Text(text + ".")])]


#: Per losing phase, the lever the kernel notes point to (``docs/flash_attention/NOTES.md``, "Next levers").
LOSER_LEVERS = {
    "backward": "in the backward, on rows shorter than `options.gluon_backward_min_keys` our Triton dQ and dK/dV "
                "kernels each recompute $QK^T$ and $dO\\,V^T$: seven products where cuDNN's fused backward does five. Our "
                "five-product Hopper backward, which adds dQ tiles inside the dK/dV kernel by TMA reductions as "
                "FlashAttention-3 does, runs from that many keys on, where it measured faster; below it, it measured "
                "slower (`docs/flash_attention/dq_atomic.md`)",
    "forward": "the tile is already chosen per sequence length; a persistent Triton schedule (each program "
               "taking tiles in turn) measured slower, because a program does not overlap one tile's loads "
               "with the previous tile's epilogue; the persistent Gluon forward, whose producer warp does, runs by "
               "default at d = 128, and at d = 64's short rows it lost to the Triton forward that runs there "
               "(`docs/flash_attention/persistent.md`); a second Q buffer, so that an item's Q loads during the "
               "item before, measured a little faster at d = 64 but slower at d = 128, where it costs the ring a "
               "stage (`docs/flash_attention/q_buffers.md`)",
}


def _gpu_gaps(shapes: pd.DataFrame, grid: Any) -> str:
    """By how much ours' GPU time exceeds cuDNN's at ``shapes``, and at how many by less than the grid's median
    round-to-round spread (a gap that small is no evidence on its own)."""
    if not {"ours_total_us", "cudnn_total_us"} <= set(shapes):
        return ""
    gap = kernel_gaps(shapes)
    if gap.empty:
        return " (by the kernels alone ours takes no more GPU time than cuDNN's at any of them)"
    said = f" (ours' GPU time {pct_span(gap)} over cuDNN's"
    if len(gap) < len(shapes):
        said += f" at {len(gap)}; no more than cuDNN's at {len(shapes) - len(gap)}"
    spread = (grid.get("forward+backward") or {}).get("spread_median") if isinstance(grid, dict) else None
    if isinstance(spread, (int, float)):
        small = int((gap < spread).sum())
        said += f"; at {small or 'none'} by less than the grid's median round-to-round spread, {fmt.pct(spread, 2)}"
    return said + ")"


def _backward_lever(shapes: pd.DataFrame) -> str:
    """Why the backward loses at ``shapes``: below ``gluon_backward_min_keys`` the seven-product Triton kernels
    (the notes' lever); where the five-product Hopper backward already runs, its own gap to cuDNN's backward."""
    kernel = shapes["ours_slowest_kernel"].astype(str) if "ours_slowest_kernel" in shapes else None
    hopper = shapes[kernel.str.contains("backward") & kernel.str.contains("gluon")] if kernel is not None \
        else shapes.iloc[:0]
    said = LOSER_LEVERS["backward"] if len(hopper) < len(shapes) else "in the backward"
    if len(hopper) and {"ours_backward_us", "cudnn_backward_us"} <= set(hopper):
        ratio = hopper["ours_backward_us"] / hopper["cudnn_backward_us"]
        lo, hi = fmt.ratio(ratio.min()), fmt.ratio(ratio.max())
        said += (f"; at the {len(hopper)} backward-bound {'shape' if len(hopper) == 1 else 'shapes'} where the "
                 f"Hopper backward runs, it issues cuDNN's five products and takes {lo if lo == hi else f'{lo}–{hi}'} "
                 "its backward GPU time: a gap of "
                 "kernel efficiency, not of work (its dK/dV kernel's tensor-pipe use beside cuDNN's, profiled at "
                 "the floor shape: `docs/flash_attention/refresh_0818d16.md`)")
    return said


def _forward_lever(shapes: pd.DataFrame) -> str:
    """Why the forward loses at ``shapes``, from the Hopper forward's tile arithmetic (``tile_for``, the tile it
    runs at each length): how many of the rows its query tiles compute are padding, and how few key blocks a
    program streams through its ring."""
    from cs336_systems.attention.flash_fwd_sm90 import TILES, tile_for

    facts = []
    for seq, d in sorted({(int(r["seq_len"]), int(r["head_dim"])) for _, r in shapes.iterrows()}):
        if d not in TILES:
            continue
        block_m, block_n, stages = tile_for(d, seq)
        rows = math.ceil(seq / block_m) * block_m
        facts.append(f"at {seq:,} tokens and d = {d}, {block_m}-row query tiles compute {rows:,} rows "
                     f"({1 - seq / rows:.0%} padding) and a program streams at most {math.ceil(seq / block_n)} "
                     f"{block_n}-key blocks through a {stages}-deep ring")
    why = ("in the forward, " + "; ".join(facts)
           + ", so filling and draining the ring is a larger share of a program's time than on long rows (from "
             "the tile arithmetic, not profiled per instruction); ") if facts else "in the forward, "
    return why + LOSER_LEVERS["forward"]


def _loser_shape(r: pd.Series) -> str:
    return (f"{r['dtype']} ({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, {int(r['head_dim'])})"
            f"{' causal' if str(r['causal']) == 'True' else ''}")


def _losers_per_shape(summary: pd.DataFrame) -> str:
    """Each profiled shape with ours' and cuDNN's forward and backward µs, in one sentence."""
    return "Forward and backward, ours against cuDNN's, in µs: " + "; ".join(
        f"{_loser_shape(r)} {fmt.sig(r['ours_forward_us'])}/{fmt.sig(r['cudnn_forward_us'])} and "
        f"{fmt.sig(r['ours_backward_us'])}/{fmt.sig(r['cudnn_backward_us'])}" for _, r in summary.iterrows())


def _host(d: SectionData) -> list[Block]:
    """Beyond the handout: CPU µs per call against the GPU's, ours and SDPA's (empty without results)."""
    summary = d.frame("host_overhead_summary")
    if summary is None or summary.empty or "impl" not in summary:
        return []
    keyed = summary.set_index([*HOST_KEYS, "impl"])["host_us"].unstack("impl")
    ours = summary[summary["impl"] == "ours"]

    def span(values: pd.Series, unit: str = " µs", show: Callable[[Any], str] = fmt.sig) -> str:
        lo, hi = show(values.min()), show(values.max())
        return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"

    text = (f"Issuing one causal forward+backward costs our attention {span(ours['host_us'])} of CPU time over "
            f"{len(ours)} shape{'' if len(ours) == 1 else 's'} and layouts")
    if "sdpa_cudnn" in keyed and "ours" in keyed:
        over = (keyed["ours"] / keyed["sdpa_cudnn"]).dropna()
        text += (f"; SDPA pinned to cuDNN costs {span(keyed['sdpa_cudnn'].dropna())} on the same host, so ours "
                 f"takes {span(over, '', fmt.ratio)} cuDNN's host time. The forward and backward through "
                 "`torch.autograd.grad` are in both numbers")
        entry = ("A call of a signature seen before is issued from C++: the host entry keys it, allocates its "
                 "outputs and launches the kernels from the launch plans recorded on an earlier call, with a C++ "
                 "autograd node for the backward, so no Python runs between the caller and the GPU "
                 "(`docs/flash_attention/host_entry.md`)")
        if over.max() > 1:
            text += (f". Where ours costs more, it is not its own code's language: {entry[0].lower()}{entry[1:]}; "
                     "the rest is autograd's own machinery, which cuDNN's path pays too")
        else:
            text += f". {entry}"
    if "host_spread_us" in summary:
        spreads = summary["host_spread_us"]
        text += (f". Single cells are noisy on this host: a time's round-to-round spread is {fmt.sig(spreads.median())}"
                 f" µs at the median and {fmt.sig(spreads.max())} µs at the widest, so one cell's ratio is rough; "
                 "the interleaved decomposition and the A/B runs of that note are the finer measure")
    if "gpu_us" in summary:
        gpu = summary.set_index([*HOST_KEYS, "impl"])["gpu_us"].unstack("impl")
        if {"ours", "sdpa_cudnn"} <= set(gpu):
            kernels = (gpu["ours"] / gpu["sdpa_cudnn"]).dropna()
            slower = int((kernels > 1).sum())
            host_over = (keyed["ours"] / keyed["sdpa_cudnn"]).reindex(kernels.index)
            differs = bool(((host_over > 1) != (kernels > 1)).any())
            text += (f". By the kernels alone the order {'is not' if differs else 'is'} the same: the same calls' "
                     f"GPU µs are {span(kernels, '', fmt.ratio)} cuDNN's, ours slower at {slower} of {len(kernels)}")
    host_bound = ours[ours["bound"] == "host"]
    where = (f"all {len(ours)} shapes" if len(host_bound) == len(ours) else f"{len(host_bound)} of {len(ours)}"
             + (": " + join_words([f"({int(r['batch'])}, {int(r['heads'])}, {int(r['seq_len'])}, "
                                   f"{int(r['head_dim'])}) {r['layout']}" for _, r in host_bound.iterrows()])
                if len(host_bound) else ""))
    text += (". Ours is host-bound (issuing a call takes longer than the GPU runs it) at " + where
             + "; there a call's wall time is the host's, unless a CUDA graph replays it (§1.4's compiled steps)."
             " Measured with `python -m cs336_systems.benchmarking.flash_host_overhead` (a queued sleep kernel keeps"
             " the GPU busy while the host issues the calls, so the host's time is not hidden behind the GPU's;"
             " `docs/flash_attention/host_overhead.md` has the method and the profile).")
    return [question(d, "host", "Beyond the handout: what one call costs the CPU, beside what it costs the GPU.", [
        Text(text),
        d.table("host_overhead_summary", frame=_host_table(summary), caption="Median over alternating rounds of "
                "the CPU µs to issue one forward+backward and of the kernels' GPU µs, per implementation, bf16, "
                "causal (spreads and wall times: the CSV)."),
    ])]


def _host_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per shape and layout: each implementation's host µs, then its GPU µs."""
    wide = summary.pivot_table(index=list(HOST_KEYS), columns="impl", values=["host_us", "gpu_us"], sort=False)
    impls = list(dict.fromkeys(summary["impl"]))
    wide = wide.reindex(columns=[(v, i) for v in ("host_us", "gpu_us") for i in impls if (v, i) in wide.columns])
    wide.columns = [f"{impl} {value.removesuffix('_us')} µs" for value, impl in wide.columns]
    return wide.reset_index()


def _shapes(d: SectionData) -> list[Block]:
    """Beyond the handout: the shapes grid against SDPA's flash and cuDNN backends (empty without results)."""
    summary = d.json("shapes_summary")
    if not isinstance(summary, dict) or "baseline" not in summary:
        return []
    baseline = summary["baseline"]
    parts = []
    for phase in ("forward+backward", "forward"):
        g = summary.get(phase)
        if isinstance(g, dict):
            spread = (f" (round-to-round spread of a time: median {fmt.pct(g['spread_median'])}, 90th percentile "
                      f"{fmt.pct(g['spread_p90'])})" if "spread_median" in g else "")
            parts.append(f"{phase}: geometric mean {fmt.ratio(g['geomean'])} of {baseline}'s speed over "
                         f"{g['cells']} shapes, lowest {fmt.ratio(g['min'])} ({g['worst']}), "
                         f"{g['below_0.9']} below 0.9× and {g['below_1.0']} below 1.0×{spread}")
    d.frame("shapes")  # the heatmap's data
    missing = shapes_unmeasured(d)
    rest = (f" The grid is measured one dtype per job; {unmeasured_words(missing)} (`python -m "
            "cs336_systems.experiments flash_benchmarking --set parts=shapes --set shapes.dtypes="
            f"{','.join(missing)}` adds them); the numbers above leave them out." if missing else "")
    return [question(d, "shapes", "Beyond the handout: every shape, against SDPA's flash and cuDNN backends "
                     "(batch 1-8, heads 8-32, sequences 256-65536 including lengths that are no multiple of a "
                     "tile, head dims 64 and 128, bf16 and fp16, causal and not).", [
        Text("Ours against " + baseline + ", as its time over ours (above 1: ours faster): " + "; ".join(parts)
             + "." + rest),
        d.figure("shapes_ratio", caption=f"{baseline} time over ours per shape, dtype and masking."),
        d.table("shapes_ratio", frame=_worst_shapes(d.frame("shapes_ratio"), f"vs_{baseline}"),
                caption=f"The {WORST_SHAPES} (shape, pass) pairs where ours loses most to {baseline} (each backend's time "
                        f"over ours, {_rounds_words(summary)}); every shape is in the CSV and the heatmap."),
    ])]


def _rounds_words(summary: Mapping[str, Any]) -> str:
    rounds = summary.get("rounds", 1)
    if rounds == 1:
        return "medians of `do_bench`"
    return f"medians over {rounds} alternating rounds of `do_bench` medians"


#: Rows of the shapes table in the writeup: the losing end of the grid, which is what needs explaining.
WORST_SHAPES = 12


def _worst_shapes(ratio: pd.DataFrame | None, column: str) -> pd.DataFrame | None:
    if ratio is None or column not in ratio:
        return ratio
    shown = [c for c in (*SHAPE_KEYS, "vs_sdpa_flash", "vs_sdpa_cudnn", "vs_sdpa_math", "vs_best") if c in ratio]
    return ratio.sort_values(column).head(WORST_SHAPES)[shown].reset_index(drop=True)


def _flash_sweep(d: SectionData) -> tuple[list[Block | None], list[Block | None]]:
    """The sweep's answer (sentences and every dtype's table, as the handout asks) and what continues in the
    appendix (the plots)."""
    frames = [f for f in (d.frame(name) for name in SWEEP_TABLES) if f is not None]
    sweep = pd.concat(frames, ignore_index=True) if frames else None  # shown through the speed-up table
    sp = d.frame("sweep_speedup")
    blocks: list[Block | None] = []
    rest: list[Block | None] = []
    if sp is not None and {"dtype", "pass", "speedup_vs_builtin"} <= set(sp.columns) and len(sp):
        parts = []
        for (dtype, ph), g in sp.groupby(["dtype", "pass"], sort=False):
            v = g["speedup_vs_builtin"].dropna()
            if len(v):
                parts.append(f"{dtype} {ph}: median {fmt.ratio(v.median())} (range {fmt.sig(v.min())}–"
                             f"{fmt.sig(v.max())})")
        naive_text = _naive_sentence(sp, sweep)
        if naive_text is not None:
            blocks.append(naive_text)
        fp32 = _float32_products(d.meta("sweep_float32") if "float32" in set(sp["dtype"]) else {})
        if fp32 is not None:
            blocks.append(fp32)
        # beyond the handout's comparison (regular PyTorch attention): the appendix's
        against_sdpa = Text("Speed-up of our Triton kernels over the fastest SDPA backend in each cell "
                            "(built-in time / ours; above 1 means ours is faster): " + "; ".join(parts) + ".")
        label = {"ours_ms": "ours", "naive_ms": "PyTorch", "best_builtin_ms": "best SDPA"}
        for dtype, g in sp.groupby("dtype", sort=False):
            values = [v for v in ("ours_ms", "naive_ms", "best_builtin_ms") if v in g.columns]
            wide = g.pivot_table(index=["seq_len", "head_dim"], columns="pass", values=values, sort=False)
            wide.columns = [f"{ph} {label[k]} ms" for k, ph in wide.columns]
            order = [c for ph in ("forward", "backward", "forward+backward") for c in
                     (f"{ph} ours ms", f"{ph} PyTorch ms", f"{ph} best SDPA ms") if c in wide.columns]
            wide = wide[order].reset_index()
            measured = f"sweep_{dtype}" if f"sweep_{dtype}" in SWEEP_TABLES else "sweep_speedup"
            rest.append(d.table(measured, frame=wide, caption=f"Latency (ms) of our "
                                f"Triton FlashAttention-2, regular PyTorch attention (eager, unfused) and the "
                                f"fastest SDPA backend, {dtype}, batch 1, causal, each the mean of a "
                                f"`triton.testing.do_bench` run"
                                f"{'; —: out of memory' if wide.isna().any().any() else ''}. "
                                + _FWD_BWD_NOTE))
        # the handout's deliverable is the table of the whole sweep: every dtype's, in the answer
        blocks += rest
        rest = [against_sdpa]
    rest.append(d.figure("sweep_speedup", caption="Speed-up over the fastest built-in per cell."))
    rest.append(d.figure("sweep_latency_d64", caption="Latency against sequence length, head size 64."))
    if not any(b is not None for b in blocks[-1:]):  # no speed-up table: whatever there is answers
        blocks, rest = blocks + rest, []
    if len([b for b in blocks if b is not None]) == 0:
        blocks += [d.table(name, caption=f"Latency by implementation, head size, sequence length and pass "
                           f"({name.removeprefix('sweep_')}).") for name in SWEEP_TABLES]
    return blocks, rest


#: Why a short sequence's forward + backward exceeds its two passes' sum.
_FWD_BWD_NOTE = ("Forward + backward is one timed call of the forward and `backward()` through autograd, host work "
                 "included, whereas each pass alone is timed on its own; at short sequences, where a pass takes "
                 "microseconds, the host's launches and autograd bookkeeping set that call's time, so it exceeds the "
                 "sum of the two.")


#: Hopper GPUs by the names their results record: where the forward of 16-bit inputs may run the Gluon kernel.
_HOPPER = ("H100", "H200", "H800", "GH200")


def _gluon_rows(d: SectionData) -> str:
    """Which rows of the bf16 sweep's forward ran the Gluon kernel, by the rule the recorded options give
    (``flash_fwd_sm90.ineligibility``: the head dims of its ``TILES``, and keys × head dim, halved when causal as the
    sweep is, at least ``gluon_min_key_work``); "" where the sweep's GPU is no Hopper or Gluon was off."""
    meta = d.meta("sweep_bfloat16")
    options = (meta.get("params") or {}).get("kernel_options") or {}
    if not any(name in str(meta.get("device", "")) for name in _HOPPER) or not options.get("gluon"):
        return ""
    sweep = (meta.get("params") or {}).get("sweep") or {}
    lengths = sorted(sweep.get("seq_lens") or [])
    work = options.get("gluon_min_key_work")
    if not lengths or not isinstance(work, int):
        return ""
    from cs336_systems.attention.flash_fwd_sm90 import TILES  # the head dims the Gluon forward takes

    head_dims = sweep.get("head_dims") or ()
    cells = _first_rows(TILES, head_dims, lengths, lambda t, head_dim: t * head_dim / 2 >= work)
    if not cells:
        return ""
    backward = _gluon_backward_rows(options, lengths, head_dims)
    return (f" In the bf16 sweep below the Gluon forward runs at {join_words(cells)} tokens"
            + (f", the Gluon backward at {join_words(backward)} tokens" if backward else "")
            + "; every other kernel, and every float32 one, is Triton's.")


def _gluon_backward_rows(options: dict, lengths: list[int], head_dims: Sequence[int]) -> list[str]:
    """The sweep's rows whose backward ran the Gluon kernel, by the recorded ``gluon_backward_min_keys`` (the sweep's
    rows are square: keys = tokens); none where the options predate the rule or turned the kernel off."""
    thresholds = options.get("gluon_backward_min_keys")
    if not options.get("gluon_backward") or not isinstance(thresholds, dict):
        return []
    from cs336_systems.attention.flash_bwd_sm90 import TILES  # the head dims the Gluon backward takes

    def reaches(t: int, head_dim: int) -> bool:
        keys = thresholds.get(str(head_dim), thresholds.get(head_dim))
        return keys is not None and t >= keys

    return _first_rows(TILES, head_dims, lengths, reaches)


def _first_rows(kernel_head_dims: Any, head_dims: Sequence[int], lengths: list[int],
                reaches: Callable[[int, int], bool]) -> list[str]:
    """"d = 64 from 4,096" per head dim both the kernel and the sweep have: the first length at which ``reaches``
    (length, head dim) holds, where one does."""
    rows = []
    for head_dim in (d_ for d_ in sorted(kernel_head_dims) if d_ in head_dims):
        first = next((t for t in lengths if reaches(t, head_dim)), None)
        if first is not None:
            rows.append(f"d = {head_dim} from {first:,}")
    return rows


def _cells_by_head(cells: pd.DataFrame, lengths: list[int] | None = None) -> str:
    """Sweep cells as "d = 128 at 2,048–8,192 tokens, d = 16 at 128". With the grid's ``lengths``, a head dim
    whose cells skip a length of the grid lists them instead of giving a range that would cover the gap."""
    said = []
    for d, g in cells.groupby("head_dim", sort=True):
        mine = sorted({int(t) for t in g["seq_len"]})
        lo, hi = mine[0], mine[-1]
        between = [t for t in (lengths or []) if lo <= t <= hi]
        if lengths is not None and between != mine:
            said.append(f"d = {int(d)} at {join_words([f'{t:,}' for t in mine])} tokens")
        else:
            said.append(f"d = {int(d)} at {lo:,}" + (f"–{hi:,}" if hi != lo else "") + " tokens")
    return ", ".join(said)


def _passes_alone(sp: pd.DataFrame, dtype: str) -> str:
    """Where each pass alone is slower than PyTorch's over the whole grid: the forward + backward verdict can
    hide a backward that loses in more cells than the sum does."""
    lengths = sorted({int(t) for t in sp["seq_len"]})
    said = []
    for phase in ("forward", "backward"):
        rows = sp[(sp["pass"] == phase) & (sp["dtype"] == dtype)].dropna(subset=["speedup_vs_naive"])
        losing = rows[rows["speedup_vs_naive"] < 1]
        if len(losing):
            said.append(f"our {phase} {'is slower ' if not said else ''}in {len(losing)} of {len(rows)} cells "
                        f"({_cells_by_head(losing, lengths)})")
    return f"in {dtype} {' and '.join(said)}" if said else ""


def _slower_pass(sp: pd.DataFrame, slower: pd.DataFrame, dtype: str) -> str:
    """Which pass loses in the cells where ours is slower overall: the forward, the backward or both."""
    if "speedup_vs_naive" not in sp.columns:
        return ""
    keys = set(zip(slower["head_dim"], slower["seq_len"]))
    losing = {}
    for phase in ("forward", "backward"):
        rows = sp[(sp["pass"] == phase) & (sp["dtype"] == dtype)]
        rows = rows[[(d, t) in keys for d, t in zip(rows["head_dim"], rows["seq_len"])]]
        losing[phase] = int((rows["speedup_vs_naive"] < 1).sum())
    n = len(slower)
    if losing["backward"] == n and losing["forward"] == 0:
        return ": in every one of them our backward is the slower pass and our forward is faster"
    if losing["forward"] == n and losing["backward"] == 0:
        return ": in every one of them our forward is the slower pass and our backward is faster"
    return f": our forward is slower in {losing['forward']} of them, our backward in {losing['backward']}"


def _float32_products(meta: Mapping[str, Any]) -> Text | None:
    """How each side multiplies float32, which the float32 table's comparison turns on."""
    precision = (meta or {}).get("float32_matmul_precision")
    if precision is None:
        return None
    if precision == "highest":
        return Text("In float32, each of our kernels' products is three TF32 tensor-core products (Triton's "
                    "`tf32x3`), which keeps float32's accuracy, while PyTorch's eager float32 matmuls run on the "
                    "FP32 cores, since the matmul precision was `highest`.")
    return Text(f"In float32, our kernels and PyTorch's matmuls both multiply in TF32 on the tensor cores (the "
                f"matmul precision was `{precision}`).")


def _naive_sentence(sp: pd.DataFrame, sweep: pd.DataFrame | None) -> Text | None:
    """Ours against regular PyTorch attention (what the handout compares with), forward + backward."""
    if "speedup_vs_naive" not in sp.columns:
        return None
    oom = pd.DataFrame()
    if sweep is not None and {"impl", "status", "pass"} <= set(sweep.columns):
        oom = sweep[(sweep["impl"] == "naive") & (sweep["status"] == "OOM") & (sweep["pass"] == "forward+backward")]
    parts, alone_clauses = [], []
    for dtype, g in sp[sp["pass"] == "forward+backward"].groupby("dtype", sort=False):
        v = g.dropna(subset=["speedup_vs_naive"])
        if v.empty:
            continue
        slower = v[v["speedup_vs_naive"] < 1]
        longest = v[v["seq_len"] == v["seq_len"].max()]
        low, high = (fmt.ratio(1 / longest["speedup_vs_naive"].max()), fmt.ratio(1 / longest["speedup_vs_naive"].min()))
        text = (f"{dtype}: in the median cell ours takes {fmt.ratio(1 / v['speedup_vs_naive'].median())} PyTorch's "
                f"time, at {int(longest['seq_len'].iloc[0]):,} tokens {low}" + (f"–{high}" if high != low else ""))
        if slower.empty:
            text += f"; ours is faster in all {len(v)} cells"
        else:
            lengths = sorted({int(t) for t in v["seq_len"]})
            text += f"; ours is slower in {len(slower)} of {len(v)} cells ({_cells_by_head(slower, lengths)})" + \
                _slower_pass(sp, slower, dtype)
        alone_clauses.append(_passes_alone(sp, dtype))
        mine = oom[oom["dtype"] == dtype] if "dtype" in oom.columns else oom
        if not mine.empty:
            first = int(mine["seq_len"].min())
            ours = "triton" if (sweep["impl"] == "triton").any() else "flash_pytorch"  # as the speed-ups pick it
            ours_failed = sweep[(sweep["impl"] == ours) & (sweep["status"] == "OOM") & (sweep["seq_len"] >= first)
                                & (sweep["pass"] == "forward+backward")
                                & ((sweep["dtype"] == dtype) if "dtype" in sweep.columns else True)]
            forward = sweep[(sweep["impl"] == "naive") & (sweep["pass"] == "forward") & (sweep["seq_len"] == first)
                            & ((sweep["dtype"] == dtype) if "dtype" in sweep.columns else True)]
            alone = ("its forward alone runs there" if (forward["status"] == "ok").any() else
                     "its forward alone too" if len(forward) else "its forward alone not measured there")
            text += (f"; in {dtype} PyTorch's forward + backward runs out of memory "
                     + (f"at {first:,} tokens" if first == int(g["seq_len"].max()) else f"from {first:,} tokens")
                     + " "
                     f"({alone}), " + ("ours does not" if ours_failed.empty else
                                       f"ours from {int(ours_failed['seq_len'].min()):,}"))
        parts.append(text)
    if not parts:
        return None
    alone = [c for c in alone_clauses if c]
    return Text("Against regular PyTorch attention (eager, materializing the $T\\times T$ scores), forward + "
                "backward: " + "; ".join(parts) + "."
                + (f" Each pass alone, against PyTorch's: {'; '.join(alone)}." if alone else ""))


def _leaderboard_sentence(summary: dict, head_dim: str = "") -> Text | None:
    ours = summary.get("ours", "triton")
    ms_ = summary.get(f"{ours}_fwd_bwd_ms")
    if ms_ is None:
        return None
    vs = [f"{k.removeprefix('speedup_vs_')} {fmt.ratio(v)} ({_leaderboard_verdict(summary, ours, k.removeprefix('speedup_vs_'))})"
          for k, v in summary.items() if k.startswith("speedup_vs_") and isinstance(v, (int, float))]
    lead = f"{head_dim}our kernels" if head_dim else "Our kernels"
    return Text(f"{lead} ({ours}) take {fmt.ms(ms_)} for forward + backward"
                + (f" ({fmt.sig(summary['ours_fwd_bwd_TFLOP_per_s'])} TFLOP/s)"
                   if "ours_fwd_bwd_TFLOP_per_s" in summary else "")
                + ("; speed-up over " + join_words(vs) + " measured in the same run (their time over ours: "
                   "above 1 we are faster)." if vs else "."))


def _leaderboard(d: SectionData) -> list[Block | None]:
    summary = d.json("leaderboard_summary", "leaderboard*_summary")
    text = _leaderboard_sentence(summary) if isinstance(summary, dict) else None
    meta = d.json_meta("leaderboard_summary", "leaderboard*_summary")
    if text is not None and meta.get("device"):  # the handout's timing machine is an H100; say where ours ran
        text = Text(f"On one {short_device(meta)} (the handout times an H100), one process timing each "
                    "implementation in turn: " + text.markdown[0].lower() + text.markdown[1:])
    d128 = d.json("leaderboard_d128_summary") if "leaderboard_d128_summary" in d.records and \
        d.frame_name("leaderboard") else None
    if isinstance(d128, dict) and text is not None:
        extra = _leaderboard_sentence(d128, "With head size 128, ")
        text = Text(text.markdown + (" " + extra.markdown if extra else ""))
    if text is not None:  # the leaderboard's rule: "you must use Triton (no CUDA)"
        text = Text(text.markdown + " The Hopper kernels that run here are Gluon, the lower-level language of the "
                    "`triton` package, compiled by Triton's own compiler: no CUDA source, which is what the "
                    "leaderboard's rule excludes. Where the rule is read as the `triton.language` dialect only, "
                    "`with options.use(gluon=False, gluon_backward=False):` runs the Triton kernels alone.")
    main = d.frame_name("leaderboard", "leaderboard_d*")
    frame = subset(d.frame(main) if main else None, "impl", "fwd_bwd_sum_ms", "fwd_bwd_sum_median_ms", "forward_ms",
                   "fwd_bwd_TFLOP_per_s", "forward_TFLOP_per_s")
    return [text, d.table(main or "", frame=frame, caption="Leaderboard configuration, forward + backward "
                          "with `o.sum().backward()` and forward alone (heads folded into the batch; head size "
                          "128: the appendix).")]



