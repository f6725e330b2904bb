"""§1.1.5 Mixed precision: what reduced precision does to sums, which dtypes autocast produces inside a
model, and what bf16 autocast buys the Transformer.

Problems ``mixed_precision_accumulation`` and ``benchmarking_mixed_precision``.
:func:`accumulation_experiments` runs the handout's four loops that add 0.01 a thousand times: an fp16
accumulator loses the small increments once the sum is large (fp16 has 10 mantissa bits), while fp16
summands accumulated in fp32 only carry 0.01's fp16 representation error. :func:`autocast_dtypes` shows
the dtype of every intermediate of the course's ToyModel under autocast: parameters stay fp32, matmul
outputs are low precision, LayerNorm and the loss are computed in fp32, and gradients match their (fp32)
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from torch import nn

from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, benchmark_model, default_device
from cs336_systems.benchmarking.sweep import OK, run_sweep
from cs336_systems.checks.toy_models import ToyModel  # the course's toy, shared with the DDP tests
from cs336_systems.configs import BOTH_EDITIONS_SIZES
from cs336_systems.experiments.section import Section, check_positive, check_presets, param
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question
from cs336_systems.report.data import SectionData, short_device
from cs336_systems.report.document import Block, Text
from cs336_systems.measured_code import MODEL, TIMING
from cs336_systems.results import ResultWriter

ACCUMULATION_STEPS = 1000


INCREMENT = 0.01


def accumulation_experiments(steps: int = ACCUMULATION_STEPS, increment: float = INCREMENT) -> pd.DataFrame:
    """The four loops: (accumulator, summand) in (fp32, fp32), (fp16, fp16), (fp32, fp16 added as is),
    (fp32, fp16 cast to fp32 explicitly). Reports the sum, the exact answer and the error."""
    cases = [
        ("fp32 += fp32", torch.float32, torch.float32, False),
        ("fp16 += fp16", torch.float16, torch.float16, False),
        ("fp32 += fp16", torch.float32, torch.float16, False),
        ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True),
    ]
    rows = []
    for label, acc_dtype, x_dtype, cast in cases:
        s = torch.tensor(0, dtype=acc_dtype)
        for _ in range(steps):
            x = torch.tensor(increment, dtype=x_dtype)
            s += x.type(torch.float32) if cast else x
        rows.append(
            {
                "loop": label,
                "accumulator": str(acc_dtype).removeprefix("torch."),
                "summand": str(x_dtype).removeprefix("torch."),
                "result": s.item(),
                "exact": steps * increment,
                "abs_error": abs(s.item() - steps * increment),
            }
        )
    return pd.DataFrame(rows)


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast to ``dtype`` runs a Linear on ``device_type`` in this build."""
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = nn.Linear(2, 2).to(device_type)(torch.ones(1, 2, device=device_type))
        return out.dtype == dtype
    except (RuntimeError, AssertionError):
        return False


def autocast_dtypes(
    dtype: torch.dtype = torch.float16, device: str | torch.device | None = None, batch_size: int = 8
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run one forward/backward of :class:`ToyModel` under ``torch.autocast(dtype)`` and record the dtype of
    the parameters, fc1's output, the LayerNorm output, the logits, the loss and the gradients.

    Returns the table and ``{"device", "requested", "autocast_dtype", "note"}``; on a device whose autocast
    does not support ``dtype`` (fp16 on some CPU builds) it falls back to bfloat16 and says so in
    ``note``.
    """
    device = torch.device(device) if device else default_device()
    used, note = dtype, ""
    if not autocast_supported(device.type, dtype):
        used = torch.bfloat16
        note = f"{dtype} autocast is not supported on {device.type} here; used {used} instead"
    torch.manual_seed(0)
    model = ToyModel(16, 4).to(device)
    seen: dict[str, torch.dtype] = {}
    hooks = [
        model.fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1 output", o.dtype)),
        model.ln.register_forward_hook(lambda m, i, o: seen.__setitem__("LayerNorm output", o.dtype)),
    ]
    x = torch.randn(batch_size, 16, device=device)
    y = torch.randint(0, 4, (batch_size,), device=device)
    try:
        with torch.autocast(device_type=device.type, dtype=used):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    rows = [{"quantity": f"parameter {n}", "dtype": p.dtype} for n, p in model.named_parameters()]
    rows += [{"quantity": k, "dtype": v} for k, v in seen.items()]
    rows += [{"quantity": "logits", "dtype": logits.dtype}, {"quantity": "loss", "dtype": loss.dtype}]
    rows += [{"quantity": f"gradient {n}", "dtype": p.grad.dtype} for n, p in model.named_parameters()]
    table = pd.DataFrame(rows)
    table["dtype"] = table["dtype"].map(lambda d: str(d).removeprefix("torch."))
    info = {"device": str(device), "requested": str(dtype), "autocast_dtype": str(used), "note": note}
    return table, info



@dataclass(frozen=True)
class Params:
    sizes: list[str] = param(BOTH_EDITIONS_SIZES, "model presets timed in fp32 and under bf16 autocast (default: "
                                                  "both handouts' tables, each model once)")
    context_length: int = param(512, "tokens per sequence")
    warmup: int = param(5, "untimed steps per cell")
    steps: int = param(10, "timed steps per cell")
    budget_s: float = param(600.0, "time budget in seconds; cells past it are recorded as skipped")

    def check(self) -> None:
        check_presets(*self.sizes)
        check_positive(context_length=self.context_length, steps=self.steps, budget_s=self.budget_s)


PRESETS = {
    "full": Params(),
    "quick": Params(warmup=3, steps=5, budget_s=120.0),
    "smoke": Params(sizes=["tiny"], context_length=32, warmup=1, steps=2, budget_s=60.0),
}


def run(p: Params, out: ResultWriter) -> dict[str, Any]:
    """The accumulation loops, the ToyModel's dtypes under fp16 autocast, fp32 vs bf16 timings."""
    acc = accumulation_experiments()
    out.table(acc, "accumulation", floatfmt=".6f")
    dtypes, info = autocast_dtypes(torch.float16)
    out.table(dtypes, "toy_model_dtypes", extra=info)

    def one(size: str, precision: str) -> dict[str, Any]:
        spec = BenchmarkSpec(size, mode="forward_backward", context_length=p.context_length, warmup=p.warmup,
                             steps=p.steps, precision=precision)
        row = benchmark_model(spec)
        return {k: v for k, v in row.items() if k.startswith(("forward_", "backward_")) or k == "peak_memory_GiB"}

    configs = [{"size": s, "precision": pr} for s in p.sizes for pr in ("fp32", "bf16")]
    timings = run_sweep(one, configs, desc="fp32 vs bf16", budget_s=p.budget_s)
    out.table(timings, "precision_timings")
    speedup = pd.DataFrame()
    ok = timings[timings["status"] == OK]
    if not ok.empty and set(ok["precision"]) >= {"fp32", "bf16"}:
        wide = ok.pivot(index="size", columns="precision", values=["forward_mean_ms", "backward_mean_ms"])
        speedup = pd.DataFrame({
            "forward_fp32_ms": wide[("forward_mean_ms", "fp32")],
            "forward_bf16_ms": wide[("forward_mean_ms", "bf16")],
            "backward_fp32_ms": wide[("backward_mean_ms", "fp32")],
            "backward_bf16_ms": wide[("backward_mean_ms", "bf16")],
        }).dropna()
        speedup["forward_speedup"] = speedup["forward_fp32_ms"] / speedup["forward_bf16_ms"]
        speedup["backward_speedup"] = speedup["backward_fp32_ms"] / speedup["backward_bf16_ms"]
        speedup = speedup.reindex([s for s in p.sizes if s in speedup.index]).reset_index()
        out.table(speedup, "bf16_speedup")
        fig, ax = plt.subplots(figsize=(7, 3.5))
        long = speedup.melt(id_vars="size", value_vars=["forward_speedup", "backward_speedup"], var_name="phase",
                            value_name="speedup")
        sns.barplot(long, x="size", y="speedup", hue="phase", ax=ax)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set(ylabel="fp32 time / bf16 time", title="bf16 autocast speed-up")
        out.figure(fig, "bf16_speedup")
        plt.close(fig)
    return {"accumulation": acc, "toy_model_dtypes": dtypes, "toy_model_dtypes_info": info,
            "precision_timings": timings, "bf16_speedup": speedup}



# === Answers: formatting only; changes below this line do not make results stale ===

from cs336_systems.report.answers import (  # noqa: E402 (answers only)
    batch_and_context, edition_preset, edition_rows, mfu_note, model_tflops, with_mfu)
from cs336_systems.report.document import BEYOND_HANDOUT  # (answers only)


def _not_monotonic(speed: pd.DataFrame, fastest: bool = False) -> str:
    """Where a larger model's bf16 pass is faster than a smaller one's (the table's rows in size order), stated
    without a cause, since none was profiled. ``fastest``:
    the times are each run's fastest step (:func:`_robust`), and the text says so."""
    from cs336_systems.configs import get_config

    found = []
    for phase in ("forward", "backward"):
        col = f"{phase}_bf16_ms"
        if col not in speed or "preset" not in speed:
            continue
        rows = list(speed.dropna(subset=[col]).itertuples(index=False))
        for small, large in zip(rows, rows[1:]):
            if getattr(large, col) < getattr(small, col):
                found.append((phase, small, large))
    if not found:
        return ""
    phase, small, large = found[0]
    layers = {r.size: get_config(str(r.preset)).num_layers for r in (small, large)}
    which = f"fastest bf16 {phase} step" if fastest else f"bf16 {phase}"
    return (f"; not monotonically, though: {large.size}'s {which} ({fmt.ms(getattr(large, f'{phase}_bf16_ms'))})"
            f" is faster than {small.size}'s ({fmt.ms(getattr(small, f'{phase}_bf16_ms'))}); the larger model "
            f"has {layers[large.size]} layers to {layers[small.size]}, and so fewer, larger matmuls. Which kernels "
            f"make {small.size}'s bf16 pass the slower one was not profiled, so no cause is claimed here.")


NOISY = 0.1  # a standard deviation, as a share of the mean, past which a phase's means blur the trend


def _fastest(timings: pd.DataFrame | None, phase: str = "forward") -> pd.DataFrame | None:
    """For ``phase``, by size (in the table's order), from the rows that ran: each precision's spread (standard
    deviation / mean: ``fp32_cv``, ``bf16_cv``), bf16's fastest step (``bf16_min_ms``) and the speed-up by each
    run's fastest step (``speedup``: fp32's fastest / bf16's; NaN where one precision is missing); None without
    the columns or any bf16 row."""
    cols = [f"{phase}_mean_ms", f"{phase}_std_ms", f"{phase}_min_ms"]
    if timings is None or not {"size", "precision", *cols} <= set(timings.columns):
        return None
    ok = timings[timings["status"].astype(str) == "ok"] if "status" in timings.columns else timings
    t = ok[ok["precision"].isin(["fp32", "bf16"])].groupby(["size", "precision"], sort=False)[cols].mean()
    if "bf16" not in t.index.get_level_values("precision"):
        return None
    mean, std, low = cols
    bf16 = t.xs("bf16", level="precision")
    fp32 = t.xs("fp32", level="precision").reindex(bf16.index) if "fp32" in t.index.get_level_values(
        "precision") else bf16 * float("nan")
    return pd.DataFrame({"fp32_cv": fp32[std] / fp32[mean], "bf16_cv": bf16[std] / bf16[mean],
                         "bf16_min_ms": bf16[low], "speedup": fp32[low] / bf16[low]})


def _noise_note(timings: pd.DataFrame | None) -> str:
    """The bf16 rows' spread, where it is large enough to blur the means: with the fastest steps beside them."""
    f = _fastest(timings, "forward")
    cv = pd.Series(dtype=float) if f is None else f["bf16_cv"].dropna()
    if cv.empty or cv.max() < NOISY:
        return ""
    fastest = [f"{s} {fmt.ratio(x)}" for s, x in f["speedup"].dropna().items()]
    if not fastest:
        return ""
    return (f" The bf16 forward times are noisy in this run (standard deviation up to {fmt.pct(cv.max(), 2)} of the "
            f"mean, {cv.idxmax()}), so their means blur the trend; by each run's fastest step the forward speed-up is "
            + join_words(fastest) + ".")


def _robust(speed: pd.DataFrame, timings: pd.DataFrame | None) -> tuple[pd.DataFrame, list[str], str]:
    """Where either phase's means are noisy (either precision's standard deviation past :data:`NOISY` of the
    mean, in a size of the table): ``speed`` with every phase whose fastest steps were recorded timed by them
    instead (its ``*_bf16_ms`` and ``*_speedup``; one basis for both passes), those phases, and a clause saying
    so; ``speed``, [] and "" where no phase is noisy or the steps' spread was not recorded."""
    out, noisy, fastest = speed.copy(), {}, {}
    for phase in ("forward", "backward"):
        f = _fastest(timings, phase)
        if f is None:
            continue
        f = f.reindex(speed["size"].astype(str))
        if f["speedup"].isna().any():
            continue
        fastest[phase] = f
        cv = f[["fp32_cv", "bf16_cv"]].rename(columns=lambda c: c.removesuffix("_cv")).stack().dropna()
        if not cv.empty and cv.max() >= NOISY:
            noisy[phase] = cv
    if not noisy:
        return speed, [], ""
    # one basis for both passes: a noisy pass is read by its fastest steps, so the steady one is too
    for phase, f in fastest.items():
        out[f"{phase}_speedup"] = f["speedup"].to_numpy()
        out[f"{phase}_bf16_ms"] = f["bf16_min_ms"].to_numpy()
    out.attrs["noisy"] = list(noisy)  # the phases whose means are blurred (the others are steady, only rebased)
    cv = pd.concat(noisy)
    phase, size, precision = cv.idxmax()
    passes = "in both passes" if len(fastest) == 2 else f"in the {next(iter(fastest))} pass"
    return out, list(fastest), (f" by each run's fastest step {passes}, since the means are noisy (standard "
                                f"deviation up to {fmt.pct(cv.max(), 2)} of the mean, {size} {precision} {phase})")


def _slower_by_the_mean(speed: pd.DataFrame, robust: list[str]) -> str:
    """Where the text quotes fastest steps: the cells whose *means* make bf16 slower, said outright, so the
    table's mean columns and the text do not seem to disagree."""
    slower = [f"{r['size']} {phase} {fmt.ratio(r[f'{phase}_speedup'])}" for phase in robust
              for _, r in speed.iterrows() if r[f"{phase}_speedup"] < 1]
    if not slower:
        return ""
    return (f" By the means, bf16 is slower in {join_words(slower)}: a few slow bf16 steps (the spread above), "
            "not the precision, since the same runs' fastest steps are faster in bf16.")


def _not_run(speed: pd.DataFrame, timings: pd.DataFrame | None, edition: str) -> str:
    """The handout's sizes with no row in ``speed``: each with its status where its run failed."""
    from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION

    have = set(speed["size"].astype(str))
    missing = [n.partition("@")[0] for n in HANDOUT_SIZES_BY_EDITION.get(edition, [])]
    missing = [n for n in missing if n not in have]
    if not missing:
        return ""
    failed = {}
    if timings is not None and {"size", "status"} <= set(timings.columns):
        failed = {str(r["size"]): str(r["status"]) for _, r in timings.iterrows() if str(r["status"]) != "ok"}
    parts = [f"{n} ({failed[n]})" if n in failed else n + _why_not(n, edition) for n in missing]
    return f" The handout's {join_words(parts)} {'was' if len(parts) == 1 else 'were'} not run."


def _why_not(size: str, edition: str) -> str:
    """Why a run has no row of a size of this edition's handout that the 2025 handout lacks (runs before the
    default grid took both handouts' tables timed the 2025 one): said so, with what its fp32 state needs."""
    from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION, param_counts

    preset = next((p for p in HANDOUT_SIZES_BY_EDITION.get(edition, ()) if p.partition("@")[0] == size), None)
    if preset is None or edition_preset(preset, "2025") is not None:
        return ""
    n = param_counts(preset)["total"]
    return f" (this run's sizes leave it out; its fp32 weights and gradients alone take {fmt.gib(8 * n)})"


def _host_bound_forward(timings: pd.DataFrame | None) -> str:
    """Sizes whose bf16 forward takes about as long as their bf16 backward (by the means), where fp32's takes
    about half: the host issuing autocast's casts and kernels, not the GPU, sets that forward's time."""
    cols = {"size", "precision", "forward_mean_ms", "backward_mean_ms"}
    if timings is None or not cols <= set(timings.columns):
        return ""
    t = timings.set_index(["size", "precision"])
    found = []
    for size in dict.fromkeys(timings["size"]):
        try:
            bf16, fp32 = t.loc[(size, "bf16")], t.loc[(size, "fp32")]
        except KeyError:
            continue
        if bf16["forward_mean_ms"] >= 0.9 * bf16["backward_mean_ms"] and \
                fp32["forward_mean_ms"] <= 0.6 * fp32["backward_mean_ms"]:
            found.append(f"{size}'s bf16 forward takes as long as its backward ({fmt.ms(bf16['forward_mean_ms'])} "
                         f"against {fmt.ms(bf16['backward_mean_ms'])}), where in fp32 it takes "
                         f"{fmt.pct(fp32['forward_mean_ms'] / fp32['backward_mean_ms'], 2)} of it")
    if not found:
        return ""
    return (" Where the bf16 kernels finish sooner than the host issues them, autocast's extra casts and dispatches "
            "set the time: " + "; ".join(found) + ".")


def _setting(meta: dict[str, Any] | None) -> str:
    """The run's batch, context and step counts, as a caption's clause (", batch 4, context 512, ...")."""
    params = (meta or {}).get("params") or {}
    if not params.get("context_length"):
        return ""
    return (f", {batch_and_context(meta)}, {params.get('warmup', '?')} warm-up and {params.get('steps', '?')} "
            "timed steps")


def _with_spread(table: pd.DataFrame, timings: pd.DataFrame | None) -> pd.DataFrame:
    """The speed-up table with each mean shown as ``mean ± standard deviation`` over the steps, from the timings it
    was computed from: a reader sees which means are noisy."""
    cols = {"size", "precision", "forward_std_ms", "backward_std_ms"}
    if timings is None or not cols <= set(timings.columns):
        return table
    std = timings.set_index(["size", "precision"])
    out = table.copy()
    for phase in ("forward", "backward"):
        for prec in ("fp32", "bf16"):
            mean = f"{phase}_{prec}_ms"
            if mean in out.columns:
                out[mean] = [f"{fmt.sig(m, 4)} ± {fmt.sig(std[f'{phase}_std_ms'].get((size, prec), float('nan')), 2)}"
                             for size, m in zip(out["size"], out[mean])]
    return out


def _other_machine(d: SectionData) -> str:
    """Where §1.1.3's fp32 timings of the same models come from another GPU model than this section's: a clause
    saying so, since the agreement check compares only one machine's tables."""
    mine, theirs = d.meta("precision_timings"), d.sibling("benchmarking").meta("timings")
    if not mine or not theirs or not mine.get("device") or not theirs.get("device") \
            or mine.get("device") == theirs.get("device"):
        return ""
    return (f" These runs are an {short_device(mine)}'s and §1.1.3's fp32 timings an {short_device(theirs)}'s: "
            "compare the two sections' ratios, not their times.")


def answer(d: SectionData) -> list[Block]:
    acc = d.frame("accumulation")
    dtypes = d.frame("toy_model_dtypes")
    speed = edition_rows(d.frame("bf16_speedup"), d.edition)  # this writeup's handout's models, by its names
    acc_text = None
    if acc is not None and {"loop", "result", "abs_error"} <= set(acc.columns):
        parts = [f"`{r['loop']}` gives {r['result']:.6f} (error {fmt.sig(r['abs_error'], 2)})" for _, r in acc.iterrows()]
        acc_text = Text(
            "Adding 0.01 one thousand times: " + "; ".join(parts) + ". 0.01 is not exactly representable in "
            "either format, and fp16's 10 stored mantissa bits make its spacing near 10 about "
            "$2^{-7} \\approx 0.008$, so every addition into an fp16 accumulator rounds away a large part of the "
            "summand. Keeping the accumulator in fp32 leaves only the one-time error of rounding 0.01 to fp16: "
            "accumulate in fp32.")
    dtype_text = None
    if dtypes is not None and {"quantity", "dtype"} <= set(dtypes.columns):
        groups = dtypes.groupby("dtype", sort=False)["quantity"].apply(list)
        dtype_text = Text("Under `torch.autocast(\"cuda\", dtype=torch.float16)`: " + "; ".join(
            f"{join_words(q)}: `{dt}`" for dt, q in groups.items()) + ". Parameters stay fp32 (autocast casts "
            "copies for each matmul), so their gradients are fp32 too.")
    timings = edition_rows(d.frame("precision_timings"), d.edition)
    speed_text, table = None, None if speed is None else speed.drop(columns="preset")
    fastest_note = ""  # the table's columns by each run's fastest step, where the text quotes them
    if speed is not None and {"size", "forward_speedup", "backward_speedup"} <= set(speed.columns) and len(speed):
        shown, robust, why = _robust(speed, timings)
        table = _with_spread(table, timings).assign(
            **{f"{p}_fastest_speedup": shown[f"{p}_speedup"].to_numpy() for p in robust})
        fastest_note = ("; fastest speed-up: fp32's fastest step / bf16's" if robust else "")
        first, last = shown.iloc[0], shown.iloc[-1]

        def effect(x: float) -> str:
            return f"{fmt.ratio(x)}" + (" (slower)" if x < 1 else "")

        speed_text = Text(
            f"Speed-up of bf16 autocast (fp32 time / bf16 time){why}: the forward pass "
            f"{effect(first['forward_speedup'])} for {first['size']} and {effect(last['forward_speedup'])} for "
            f"{last['size']}; the backward pass {effect(first['backward_speedup'])} and "
            f"{effect(last['backward_speedup'])}.{_slower_by_the_mean(speed, shown.attrs.get('noisy', robust))} Larger models "
            "spend a larger share of their time in big matmuls, where bf16 tensor cores have the most advantage "
            "over fp32 (TF32 off); the small models' steps are short and their matmuls small, so elementwise "
            "kernels (which autocast does not speed up and its casts add to) and the host's kernel launches, which "
            "no precision shortens, weigh more"
            + (_not_monotonic(shown, fastest=bool(robust)) or ".") + _host_bound_forward(timings) + _not_run(speed, timings, d.edition))
    noise = _noise_note(timings).strip()
    if speed_text is not None:
        speed_text = Text(speed_text.markdown + _other_machine(d))
    return [
        question(d, "mixed_precision_accumulation", "Accumulating 0.01 a thousand times in fp32, fp16 and "
                 "mixtures.", [acc_text, d.table("accumulation", caption="The four accumulation loops.", digits=7)],
                 what="the accumulation experiment"),
        question(d, "a", "Data types inside `torch.autocast(float16)` for the ToyModel.", [dtype_text],
                 what=None if dtype_text else "the autocast dtype table"),
        question(d, "b", "Which parts of layer normalization are sensitive to reduced precision, and whether "
                 "bf16 changes that.", [Text(
                     "The reductions: the mean and the variance (RMSNorm: the mean of squares) sum many terms, "
                     "and $1/\\sqrt{\\sigma^2 + \\epsilon}$ amplifies errors in a small variance. fp16 also "
                     "overflows on $x^2$ once $|x| > 256$ (its maximum is 65504), so autocast keeps "
                     "normalization in fp32. bf16 has fp32's exponent range, so overflow is no longer the risk, "
                     "but its 7 stored mantissa bits (fp16 has 10) make the sums even less precise than "
                     "fp16's: the statistics still belong in fp32.")]),
        question(d, "c", "Forward and backward timings with and without bf16 mixed precision, by model size.",
                 [speed_text, d.table("bf16_speedup", frame=table,
                                      caption="fp32 vs. bf16 autocast, time per pass (mean ± standard deviation"
                                              f"{_setting(d.meta('precision_timings'))}) and speed-up (fp32 time / "
                                              "bf16 time, by the means)" + fastest_note + ".")],
                 what="bf16 vs fp32 timings by model size"),
        Text("", role=BEYOND_HANDOUT),  # the tables and plot behind the answers in words
        question(d, "a", "The ToyModel's tensors and their dtypes under fp16 autocast, as measured.", [
            d.table("toy_model_dtypes", caption="ToyModel tensors under fp16 autocast.")]),
        question(d, "c", "The same steps as throughput, and the speed-up plotted.", [
            Text(noise) if noise else None, _mfu_table(d), d.figure("bf16_speedup", caption="bf16 autocast speed-up by model size.")]),
    ]




def _mfu_table(d: SectionData):
    """Forward + backward throughput in model TFLOP/s and MFU, fp32 against bf16, from the speed-up table."""
    speed = edition_rows(d.frame("bf16_speedup"), d.edition)
    need = {"size", "forward_fp32_ms", "backward_fp32_ms", "forward_bf16_ms", "backward_bf16_ms"}
    if speed is None or not need <= set(speed.columns):
        return None
    meta = d.meta("bf16_speedup")
    ctx = int((meta.get("params") or {}).get("context_length", 512))
    rows = []
    for _, r in speed.iterrows():
        row = {"size": r["size"]}
        for p in ("fp32", "bf16"):
            ms = r[f"forward_{p}_ms"] + r[f"backward_{p}_ms"]
            row[f"{p}_TFLOP_per_s"] = model_tflops(str(r["preset"]), ms, ctx, "train")
        rows.append(row)
    frame = pd.DataFrame(rows)
    for p in ("fp32", "bf16"):
        frame[f"{p}_MFU_pct"] = with_mfu(frame.rename(columns={f"{p}_TFLOP_per_s": "TFLOP_per_s"}), meta, p)["MFU_pct"]
    return d.table("bf16_speedup", frame=frame, caption="The same steps as model TFLOP/s and MFU, forward + "
                   "backward." + mfu_note(meta, ("fp32", "bf16")))


SECTION = Section(
    name="mixed_precision", number="1.1.5", title="Mixed precision",
    problems=("mixed_precision_accumulation", "benchmarking_mixed_precision"), answer=answer, presets=PRESETS,
    run=run, depends=(*MODEL, *TIMING, "cs336_systems/checks/toy_models.py"),
)
