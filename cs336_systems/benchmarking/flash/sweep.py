"""The handout's FlashAttention sweep: forward, backward and forward+backward latency of every
implementation (ours, naive PyTorch, SDPA pinned to each backend) over sequence lengths, head dimensions and
dtypes, timed in one process; failures (out of memory, unsupported) are results."""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import (
    FlashAttentionPytorch,
    FlashAttentionTriton,
    naive_attention,
    options,
)
from cs336_systems.benchmarking.sweep import OK, OOM, free_memory, grid, is_oom, run_sweep
from cs336_systems.benchmarking.timing import TimingStats, do_bench
from cs336_systems.configs import attention_flops

PASSES = ("forward", "backward", "forward+backward")
UNSUPPORTED = "unsupported"

#: The handout's sweep.
SWEEP_SEQ_LENS = [2**i for i in range(7, 17)]  # 128 … 65536
SWEEP_HEAD_DIMS = [16, 32, 64, 128]
SWEEP_DTYPES = ["bfloat16", "float32"]

# --------------------------------------------------------------------------------------------------
# Implementations under test: fn(q, k, v, is_causal) on (batch, heads, seq, d)
# --------------------------------------------------------------------------------------------------


class PinnedSDPA:
    """``F.scaled_dot_product_attention`` on one backend: ``fn(q, k, v, is_causal)``.

    A call made outside :meth:`pinned` enters ``sdpa_kernel`` itself. Timed loops enter :meth:`pinned` once
    around their calls instead (:func:`pinned`), as an application selects its backend once: entering the context
    costs host time on every call, which a host-bound cell would otherwise charge to SDPA alone."""

    def __init__(self, backend: SDPBackend) -> None:
        self.backend = backend
        self.__name__ = f"sdpa_{backend.name.lower()}"
        self._depth = 0

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        if self._depth:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        with sdpa_kernel(self.backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        with sdpa_kernel(self.backend):
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1


def pinned(fn: Callable[..., Any]) -> contextlib.AbstractContextManager[Any]:
    """The block in which ``fn``'s calls run pinned (:class:`PinnedSDPA`); nothing to enter for other functions."""
    enter = getattr(fn, "pinned", None)
    return enter() if enter is not None else contextlib.nullcontext()


def _sdpa(backend: SDPBackend) -> PinnedSDPA:
    return PinnedSDPA(backend)


IMPLEMENTATIONS: dict[str, Callable[[Tensor, Tensor, Tensor, bool], Tensor]] = {
    "triton": FlashAttentionTriton.apply,
    "flash_pytorch": FlashAttentionPytorch.apply,
    "naive": naive_attention,
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
    "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    "sdpa_math": _sdpa(SDPBackend.MATH),
}
GPU_IMPLS = ["triton", "naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
SMOKE_IMPLS = ["flash_pytorch", "naive", "sdpa_math"]
#: The built-in baselines a speed-up is computed against (the fastest that ran, per cell).
BUILTIN_IMPLS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def _poly_exp2_label() -> str:
    """Which kernels exponentiate with the FMA-pipe polynomial under the current options, for provenance:
    the phases forced by ``poly_exp2``, or ``dkdv+tuned`` when each candidate tile's pin decides (the
    chosen configs then say which)."""
    forced = options.current().poly_exp2
    return ",".join(sorted(forced)) if forced is not None else "dkdv+tuned"


def _median_ms(stats: TimingStats) -> float:
    return statistics.median(stats.times_s) * 1e3


def _is_unsupported(exc: BaseException) -> bool:
    """SDPA raises a RuntimeError naming no usable kernel when a pinned backend cannot take the inputs."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("no available kernel" in text or "not supported" in text)


def _record_timing(row: dict[str, Any], name: str, measure: Callable[[], TimingStats]) -> None:
    """Run ``measure`` and store ``{name}_ms`` (mean), ``{name}_median_ms`` and ``{name}_status`` in ``row``.
    An OOM or an unsupported input is recorded as that cell's status; any other error propagates."""
    try:
        stats = measure()
    except Exception as exc:
        status = OOM if is_oom(exc) else UNSUPPORTED if _is_unsupported(exc) else None
        if status is None:
            raise
        del exc
        free_memory()
        row.update({f"{name}_ms": math.nan, f"{name}_median_ms": math.nan, f"{name}_status": status})
        return
    row.update({f"{name}_ms": stats.mean * 1e3, f"{name}_median_ms": _median_ms(stats), f"{name}_status": OK})


def time_attention_passes(
    fn: Callable[[Tensor, Tensor, Tensor, bool], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    *,
    is_causal: bool = True,
    passes: Sequence[str] = PASSES,
    warmup_ms: float = 10,
    rep_ms: float = 40,
) -> dict[str, Any]:
    """Time each pass of ``fn``; returns ``{pass}_ms`` (mean), ``{pass}_median_ms`` and ``{pass}_status``.

    ``backward`` replays a retained graph (the forward is outside the timed region); ``forward`` runs
    with autograd recording, as in training. An OOM or an unsupported input ends that pass only.
    """
    inputs = (q, k, v)
    unknown = [phase for phase in passes if phase not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; valid: {PASSES}")

    def forward() -> TimingStats:
        return do_bench(lambda: fn(q, k, v, is_causal), warmup_ms=warmup_ms, rep_ms=rep_ms)

    def backward() -> TimingStats:
        o = fn(q, k, v, is_causal)
        return do_bench(lambda: torch.autograd.grad(o, inputs, do, retain_graph=True), warmup_ms=warmup_ms, rep_ms=rep_ms)

    def forward_backward() -> TimingStats:
        return do_bench(lambda: torch.autograd.grad(fn(q, k, v, is_causal), inputs, do), warmup_ms=warmup_ms, rep_ms=rep_ms)

    measures = {"forward": forward, "backward": backward, "forward+backward": forward_backward}
    row: dict[str, Any] = {}
    with pinned(fn):
        for phase in passes:
            _record_timing(row, phase, measures[phase])
    return row


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


def _random_qkvdo(
    batch: int, heads: int, seq_len: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[Tensor, ...]:
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype)


def run_flash_sweep(
    seq_lens: Sequence[int] = SWEEP_SEQ_LENS,
    head_dims: Sequence[int] = SWEEP_HEAD_DIMS,
    dtypes: Sequence[str] = SWEEP_DTYPES,
    impls: Sequence[str] | None = None,
    *,
    batch: int = 1,
    is_causal: bool = True,
    warmup_ms: float = 10,
    rep_ms: float = 40,
    budget_s: float | None = None,
    device: str | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Long table: one row per (impl, dtype, head_dim, seq_len, pass) with mean/median ms, TFLOP/s, status."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    impls = list(impls or (GPU_IMPLS if device == "cuda" else SMOKE_IMPLS))

    def cell(dtype: str, head_dim: int, seq_len: int, impl: str) -> dict[str, Any]:
        q, k, v, do = _random_qkvdo(batch, 1, seq_len, head_dim, getattr(torch, dtype), device)
        return time_attention_passes(
            IMPLEMENTATIONS[impl], q, k, v, do, is_causal=is_causal, warmup_ms=warmup_ms, rep_ms=rep_ms
        )

    configs = grid(dtype=dtypes, head_dim=head_dims, seq_len=seq_lens, impl=impls)
    wide = run_sweep(cell, configs, desc="flash sweep", budget_s=budget_s, progress=progress)
    return _long_format(wide, batch_heads=batch, is_causal=is_causal)


def _long_format(wide: pd.DataFrame, batch_heads: int, is_causal: bool) -> pd.DataFrame:
    rows = []
    for rec in wide.to_dict("records"):
        for phase in PASSES:
            status = rec.get(f"{phase}_status", rec["status"])
            status = rec["status"] if (not isinstance(status, str) or rec["status"] != OK) else status
            ms = rec.get(f"{phase}_ms", math.nan)
            flops = attention_flops(batch_heads, rec["seq_len"], rec["seq_len"], rec["head_dim"], is_causal=is_causal,
                                    phase=phase)
            rows.append({
                **{key: rec[key] for key in ("impl", "dtype", "head_dim", "seq_len")},
                "pass": phase, "status": status, "mean_ms": ms,
                "median_ms": rec.get(f"{phase}_median_ms", math.nan),
                "TFLOP_per_s": math.nan if math.isnan(ms) else flops / (ms * 1e-3) / 1e12,
            })  # fmt: skip
    return pd.DataFrame(rows)


def speedup_table(long: pd.DataFrame, ours: str = "triton") -> pd.DataFrame:
    """Per cell: our time, the fastest built-in (which one, and its time) and ``speedup = builtin / ours``;
    also the naive time and ours' speed-up over it."""
    keys = ["dtype", "head_dim", "seq_len", "pass"]
    ok = long[long["status"] == OK]
    mine = ok[ok["impl"] == ours].set_index(keys)["mean_ms"].rename("ours_ms")
    builtin = ok[ok["impl"].isin(BUILTIN_IMPLS)]
    best = builtin.loc[builtin.groupby(keys)["mean_ms"].idxmin()].set_index(keys)
    naive = ok[ok["impl"] == "naive"].set_index(keys)["mean_ms"].rename("naive_ms")
    table = pd.concat(
        [mine, best["impl"].rename("best_builtin"), best["mean_ms"].rename("best_builtin_ms"), naive], axis=1
    ).reset_index()
    table["speedup_vs_builtin"] = table["best_builtin_ms"] / table["ours_ms"]
    table["speedup_vs_naive"] = table["naive_ms"] / table["ours_ms"]
    return table.sort_values(keys, kind="stable").reset_index(drop=True)


def plot_speedup(table: pd.DataFrame) -> plt.Figure:
    """Speed-up of ours over the fastest built-in per cell vs sequence length; a panel per dtype × pass."""
    data = table.dropna(subset=["speedup_vs_builtin"])
    g = sns.relplot(
        data=data, x="seq_len", y="speedup_vs_builtin", hue="head_dim", style="head_dim", col="pass",
        row="dtype", kind="line", markers=True, palette="viridis", height=2.8, aspect=1.2,
        facet_kws={"sharey": False},
    )  # fmt: skip
    for ax in g.axes.flat:
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    g.set_axis_labels("sequence length", "speed-up vs fastest SDPA backend")
    g.figure.suptitle("Triton FlashAttention-2 vs F.scaled_dot_product_attention (causal, batch 1)", y=1.02)
    return g.figure


def plot_latency(long: pd.DataFrame, head_dim: int) -> plt.Figure:
    """Latency of every implementation at one head dimension, vs sequence length (log-log)."""
    data = long[(long["head_dim"] == head_dim) & (long["status"] == OK)]
    g = sns.relplot(
        data=data, x="seq_len", y="mean_ms", hue="impl", style="impl", col="pass", row="dtype",
        kind="line", markers=True, height=2.8, aspect=1.2,
    )  # fmt: skip
    for ax in g.axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    g.set_axis_labels("sequence length", "latency (ms)")
    g.figure.suptitle(f"Attention latency, head dim {head_dim} (causal, batch 1)", y=1.02)
    return g.figure


# --------------------------------------------------------------------------------------------------
# Every shape: ours against SDPA's flash and cuDNN backends over (batch, heads, seq, d) × dtype × causal
# --------------------------------------------------------------------------------------------------
