"""Timing primitives shared by every benchmark.

Three ways to time GPU work, each right for a different job:

- :func:`time_calls` — host wall clock (``timeit.default_timer``) with ``torch.cuda.synchronize()`` before
  and after each call. CUDA launches are asynchronous, so without the synchronisation the timer would
  measure only the launch overhead. This is what the handout's end-to-end benchmark asks for.
- :func:`cuda_event_times` — CUDA events recorded on the stream around each call; the GPU clock measures
  the stream's work without host jitter (still synchronising once per call to read the result).
- :func:`phase_times` — a step's phases on both clocks (host issue time, GPU time by events): whether a
  phase kept the GPU busy or waiting for launches.
- :func:`do_bench` — ``triton.testing.do_bench``: flushes the L2 cache between calls and picks the
  number of repetitions from a time budget; the right tool for single kernels. Falls back to
  :func:`time_calls` on CPU.

All but :func:`phase_times` return :class:`TimingStats` (mean, std, min, max over the individual calls).
"""

from __future__ import annotations

import math
import statistics
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued CUDA work on ``device`` (no-op on CPU, where work is synchronous)."""
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        torch.cuda.synchronize(dev)


@dataclass(frozen=True)
class TimingStats:
    """Summary statistics of per-call durations, kept in seconds; ``times_s`` holds the raw samples."""

    times_s: tuple[float, ...] = field(default_factory=tuple)

    @classmethod
    def from_seconds(cls, times: Sequence[float]) -> TimingStats:
        return cls(tuple(float(t) for t in times))

    @classmethod
    def from_milliseconds(cls, times: Sequence[float]) -> TimingStats:
        return cls(tuple(float(t) / 1e3 for t in times))

    @property
    def n(self) -> int:
        return len(self.times_s)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times_s) if self.times_s else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation (``n - 1``); 0 for a single sample, NaN for none."""
        if not self.times_s:
            return math.nan
        return statistics.stdev(self.times_s) if self.n > 1 else 0.0

    @property
    def min(self) -> float:
        return min(self.times_s) if self.times_s else math.nan

    @property
    def max(self) -> float:
        return max(self.times_s) if self.times_s else math.nan

    def summary(self, prefix: str = "", unit: str = "ms") -> dict[str, float]:
        """``{prefix}mean_{unit}``, ``std``, ``min``, ``max`` in the requested unit (s, ms or us)."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}.get(unit)
        if scale is None:
            raise ValueError(f"unit must be 's', 'ms' or 'us', got {unit!r}")
        return {
            f"{prefix}{stat}_{unit}": getattr(self, stat) * scale for stat in ("mean", "std", "min", "max")
        }

    def __str__(self) -> str:
        return f"{self.mean * 1e3:.3f} ± {self.std * 1e3:.3f} ms (n={self.n})"


def time_calls(
    fn: Callable[[], Any],
    *,
    warmup: int = 5,
    steps: int = 10,
    device: torch.device | str | None = None,
    timer: Callable[[], float] = timeit.default_timer,
) -> TimingStats:
    """Run ``fn`` ``warmup`` times untimed, then ``steps`` times, timing each call with host wall clock
    between two synchronisations."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = timer()
        fn()
        synchronize(device)
        times.append(timer() - start)
    return TimingStats.from_seconds(times)


def cuda_event_times(fn: Callable[[], Any], *, warmup: int = 5, steps: int = 10) -> TimingStats:
    """Like :func:`time_calls` but measured by CUDA events on the current stream (GPU clock)."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_event_times needs a CUDA device; use time_calls on CPU")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return TimingStats.from_milliseconds([s.elapsed_time(e) for s, e in pairs])


def phase_times(
    phases: Sequence[tuple[str, Callable[[], Any]]],
    device: torch.device | str,
    *,
    warmup: int = 2,
    steps: int = 10,
    timer: Callable[[], float] = timeit.default_timer,
) -> list[dict[str, float]]:
    """Run the step made of ``phases`` (``(name, fn)`` in order) ``warmup`` times untimed, then ``steps``
    times; one row per timed step: ``<name>_host_ms`` (how long the host took to issue the phase), ``<name>_gpu_ms``
    (the stream's time from the phase's first to its last queued work, by CUDA events) and ``step_ms`` (host
    wall clock, synchronised before and after).

    Why both clocks: a phase whose GPU time is about its host time kept the GPU waiting for launches (host
    paced); a GPU time well above the host time means the queue ran ahead of the GPU. Each step starts on an
    idle GPU, so the first phase's start event fires when the host records it; a later phase's fires when the
    GPU has finished the work queued before it, so its GPU time runs from there. On CPU both clocks are the
    host's."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    names = [name for name, _ in phases]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"phases need distinct names, got {names}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        for _, fn in phases:
            fn()
    synchronize(dev)
    rows = []
    for _ in range(steps):
        row: dict[str, float] = {}
        events = []
        start = timer()
        for name, fn in phases:
            begin = timer()
            if cuda:
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
            fn()
            if cuda:
                events[-1][1].record()
            row[f"{name}_host_ms"] = (timer() - begin) * 1e3
        synchronize(dev)
        row["step_ms"] = (timer() - start) * 1e3
        for i, name in enumerate(names):
            row[f"{name}_gpu_ms"] = events[i][0].elapsed_time(events[i][1]) if cuda else row[f"{name}_host_ms"]
        rows.append(row)
    return rows


def round_summary(steps: Any, keys: list[str], spread: list[str]) -> Any:
    """Steps timed in alternating rounds (a pandas frame with ``round`` and ``step`` columns) summarised per
    ``keys``: the median of every other column over all rounds' steps, and for each column in ``spread`` the
    lowest and highest of the rounds' own medians (``<column>_round_lo``, ``<column>_round_hi``). A difference
    between two variants inside that range is no difference."""
    table = steps.drop(columns=["round", "step"]).groupby(keys, as_index=False, sort=False).median()
    per_round = steps.groupby([*keys, "round"], sort=False)[spread].median()
    ranges = per_round.groupby(level=keys, sort=False).agg(["min", "max"])
    ranges.columns = [f"{c}_round_{'lo' if s == 'min' else 'hi'}" for c, s in ranges.columns]
    return table.merge(ranges.reset_index(), on=keys, how="left")


def do_bench(
    fn: Callable[[], Any],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> TimingStats:
    """``triton.testing.do_bench`` with every sample returned as :class:`TimingStats`.

    On CPU (or without Triton) it falls back to :func:`time_calls` with 3 warm-up and 10 timed calls,
    so code written against it runs in CPU smoke tests.
    """
    if not torch.cuda.is_available():
        return time_calls(fn, warmup=3, steps=10)
    import triton.testing

    grads = list(grad_to_none) if grad_to_none else None
    try:
        times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads, return_mode="all")
    except ValueError:  # a Triton without return_mode="all": keep the quantiles we can get
        times = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads, quantiles=[0.0, 0.5, 1.0]
        )
    return TimingStats.from_milliseconds(list(times))
