"""Host (CPU) time and GPU time per attention call: our FlashAttention-2 against SDPA's flash and cuDNN.

A call costs the larger of two times: what the host spends issuing it (Python, the dispatcher, kernel
launches) and what the GPU spends running it. At short sequences the kernels finish in tens of
microseconds, so the host path decides the speed a user sees. Per implementation, alternating between
implementations in one process, and per round:

- **host µs** per forward+backward: the GPU is first handed a long ``torch.cuda._sleep``, so each call only
  enqueues work; the host time of ``calls`` calls divided by ``calls`` is the issuing cost alone (few
  enough calls not to fill the launch queue, which would block the host);
- **GPU µs** per forward+backward: the device time of the kernels the calls launched (torch.profiler);
- **wall µs** per forward+backward back to back (CUDA events around ``calls`` calls): about the larger of the
  two.

    python -m cs336_systems.benchmarking.flash_host_overhead --shape 1,16,1024,64 --causal
    python -m cs336_systems.benchmarking.flash_host_overhead --shape 1,16,1024,64 --profile   # + cProfile of ours
    python -m cs336_systems.benchmarking.flash_host_overhead --impls ours,ours_uncached,sdpa_cudnn  # launch cache A/B
    python -m cs336_systems.benchmarking.flash_host_overhead --impls ours,ours_unplanned,sdpa_cudnn  # launch plans A/B
    python -m cs336_systems.benchmarking.flash_host_overhead --impls ours,ours_python_entry,sdpa_cudnn  # C++ entry A/B
    python -m cs336_systems.benchmarking.flash_host_overhead --shape 8,12,1024,64 --layout bshd --kernels
    python -m cs336_systems.benchmarking.flash_host_overhead --layout bshd \
        --impls ours_gluon_views,ours_no_gluon_views,sdpa_cudnn     # Gluon forward on head views A/B
    python -m cs336_systems.benchmarking.flash_host_overhead --shape 8,32,256,64 --kernels \
        --impls ours,ours_gluon_short,sdpa_cudnn     # short rows: Triton forward (default) against Gluon
    python -m cs336_systems.benchmarking.flash_host_overhead --layout bshd --kernels --impls ours,fwd128 \
        --variant 'fwd128={"candidates": {"forward": [[128, 128, 8, 3]]}}'   # any options, A/B

Forward and backward run as ``torch.autograd.grad(o, (q, k, v), do)``, so no gradient accumulates.
``--layout bshd`` gives every implementation what a Transformer block hands its attention: ``(batch, heads,
seq, d)`` views of ``(batch, seq, heads, d)`` tensors (the heads split off a projection's output), not
contiguous ``(batch, heads, seq, d)`` tensors. ``--kernels`` adds the GPU time per call of each kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import pstats
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from torch import Tensor

IMPLS = ("ours", "sdpa_flash", "sdpa_cudnn")
#: Memory layouts of the inputs: contiguous ``(batch, heads, seq, d)``, or heads-inside-a-token views.
LAYOUTS = ("bhsd", "bshd")
#: Also measurable: ours with every launch through Triton's own Python path (launch cache off, and with it
#: the launch plans), or through the launch cache without whole-call plans, for A/B.
UNCACHED = "ours_uncached"
UNPLANNED = "ours_unplanned"
#: Ours with the Gluon forward on or off for head views (``options.gluon_head_views``; on: at any length), for A/B.
GLUON_VIEWS, NO_GLUON_VIEWS = "ours_gluon_views", "ours_no_gluon_views"
#: Ours with the Gluon forward at every length, short rows included (``options.gluon_min_key_work = 0``).
GLUON_SHORT = "ours_gluon_short"
#: Ours with the Triton backward kernels at every length (``options.gluon_backward = False``), and with the fused
#: Gluon backward at every length it applies to (``options.gluon_backward_min_keys = 0``).
TRITON_BACKWARD, GLUON_BACKWARD_SHORT = "ours_triton_backward", "ours_gluon_backward_short"
#: Ours with its plans replayed from Python instead of the C++ host entry (``options.host_entry = False``).
PYTHON_ENTRY = "ours_python_entry"
#: Named variants of ours: the :class:`~cs336_systems.attention.options.FlashOptions` fields each one sets
#: for its whole measurement. ``--variant NAME=JSON`` adds more (e.g. other forward tiles).
VARIANTS: dict[str, dict[str, Any]] = {GLUON_VIEWS: {"gluon_head_views": True, "gluon_min_key_work": 0},
                                       NO_GLUON_VIEWS: {"gluon_head_views": False},
                                       GLUON_SHORT: {"gluon_min_key_work": 0},
                                       TRITON_BACKWARD: {"gluon_backward": False},
                                       GLUON_BACKWARD_SHORT: {"gluon_backward_min_keys": 0},
                                       PYTHON_ENTRY: {"host_entry": False}}
OURS_VARIANTS = ("ours", UNCACHED, UNPLANNED, *VARIANTS)
_ALL = tuple(dict.fromkeys((*IMPLS, *OURS_VARIANTS)))
#: GPU sleep before a host measurement: long enough that the GPU is still asleep when the host finishes.
_SLEEP_S = 0.2


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=JSON`` (``--variant``) as a name and the option fields it sets, checked by building the options:
    ``'fwd128={"candidates": {"forward": [[128, 128, 8, 3]]}, "autotune": false}'``."""
    from cs336_systems.attention.options import FlashOptions

    name, sep, spec = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise ValueError(f"a variant is NAME=JSON with a plain NAME, got {text!r}")
    if name in _ALL:
        raise ValueError(f"variant name {name!r} is taken; choose another")
    try:
        changes = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"variant {name}: its options are not JSON ({e.msg}): {spec!r}") from None
    if not isinstance(changes, dict):
        raise ValueError(f"variant {name}: options must be a JSON object of FlashOptions fields, got {spec!r}")
    fields = {f.name for f in dataclasses.fields(FlashOptions)}
    if set(changes) - fields:
        raise ValueError(f"variant {name}: unknown options {sorted(set(changes) - fields)}; "
                         f"valid: {', '.join(sorted(fields))}")
    try:
        FlashOptions(**changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"variant {name}: {e}") from None
    return name, changes


@contextlib.contextmanager
def _backend(impl: str, variants: Mapping[str, dict[str, Any]] | None = None) -> Iterator[None]:
    """The implementation's policy for the whole measurement: a variant of ours sets its options, SDPA is
    pinned to one backend (entering a context per call would add its own host cost to the timings)."""
    variants = {**VARIANTS, **(variants or {})}
    if impl in ("ours", UNCACHED, UNPLANNED, *variants):
        from cs336_systems.attention import launch_cache, launch_plan, options

        policy = (contextlib.nullcontext() if impl == "ours" else launch_cache.disabled() if impl == UNCACHED
                  else launch_plan.disabled() if impl == UNPLANNED else options.use(**variants[impl]))
        with policy:
            yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    with sdpa_kernel(backend):
        yield


def attention_fn(impl: str, variants: Mapping[str, dict[str, Any]] | None = None,
                 ) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    if impl in OURS_VARIANTS or impl in (variants or {}):
        from cs336_systems.attention.flash_triton import FlashAttentionTriton

        return FlashAttentionTriton.apply
    if impl in IMPLS:
        return lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join((*_ALL, *(variants or {})))}")


def make_inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, layout: str = "bhsd",
                generator: torch.Generator | None = None, device: str = "cuda") -> tuple[Tensor, ...]:
    """Random ``q, k, v`` (requiring grad) and ``do`` of ``shape`` = (batch, heads, seq, head_dim), laid out as
    ``layout`` says (:data:`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    batch, heads, seq, d = shape
    stored = shape if layout == "bhsd" else (batch, seq, heads, d)

    def one(grad: bool) -> Tensor:
        t = torch.randn(stored, device=device, dtype=dtype, generator=generator)
        t = t if layout == "bhsd" else t.transpose(1, 2)
        return t.requires_grad_() if grad else t

    return one(True), one(True), one(True), one(False)


def make_step(impl: str, shape: tuple[int, int, int, int], dtype: torch.dtype, causal: bool,
              layout: str = "bhsd", variants: Mapping[str, dict[str, Any]] | None = None) -> Callable[[], None]:
    """One forward+backward of ``impl`` on fixed random inputs of ``shape`` = (batch, heads, seq, head_dim)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = make_inputs(shape, dtype, layout, gen)
    fn = attention_fn(impl, variants)

    def step() -> None:
        o = fn(q, k, v, causal)
        torch.autograd.grad(o, (q, k, v), do)

    return step


def sleep_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` counts clock cycles; the SM clock is read from the device (1.98 GHz on an H100
    at boost), defaulting to 2 GHz."""
    try:
        rate_khz = torch.cuda.get_device_properties(0).clock_rate  # type: ignore[attr-defined]
    except AttributeError:
        rate_khz = 2_000_000
    return int(seconds * rate_khz * 1e3)


def issue_seconds(step: Callable[[], object], calls: int, sleep_s: float) -> tuple[float, bool]:
    """Seconds the host takes to issue ``calls`` calls queued behind a ``sleep_s`` GPU sleep, and whether
    the GPU was awake when the host finished (then the calls waited on it somewhere). Without a GPU, the
    calls' own time, never awake."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles(sleep_s))
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    awake = cuda and torch.cuda.current_stream().query()
    if cuda:
        torch.cuda.synchronize()
    return elapsed, bool(awake)


def host_us(step: Callable[[], None], calls: int) -> float:
    """Host microseconds per call while the GPU is busy sleeping (see the module docstring)."""
    elapsed, awake = issue_seconds(step, calls, _SLEEP_S)
    if awake:
        raise RuntimeError(f"the GPU finished its {_SLEEP_S} s sleep before the host issued {calls} calls: "
                           "the measurement may include waits; use fewer calls")
    return elapsed / calls * 1e6


def kernel_us(step: Callable[[], None], calls: int) -> pd.Series:
    """Device time per call of each kernel ``step`` launches (by kernel name), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from cs336_systems.profiling.torch_profiler import kernel_records

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return kernel_records(prof).groupby("name")["duration_us"].sum() / calls


def wall_us(step: Callable[[], None], calls: int) -> float:
    """Back-to-back microseconds per call between two CUDA events."""
    from cs336_systems.benchmarking.train_step import ms_per_call

    return ms_per_call(step, calls, torch.device("cuda")) * 1e3


def measure(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16, causal: bool = True,
            impls: tuple[str, ...] = IMPLS, rounds: int = 5, calls: int = 20, warmup: int = 10,
            layout: str = "bhsd", kernels: bool = False,
            variants: Mapping[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """One row per (round, implementation): ``host_us``, ``gpu_us``, ``wall_us`` per forward+backward, and
    with ``kernels`` one ``kernel: <name>`` column per kernel (µs per call). Implementations alternate
    within each round, in an order that rotates from round to round. ``variants`` names further variants of
    ours (name: FlashOptions fields, as :func:`parse_variant` returns), usable in ``impls``."""
    if not torch.cuda.is_available():
        raise RuntimeError("the host-overhead benchmark needs a CUDA GPU")
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"shape must be four positive sizes (batch, heads, seq, head_dim), got {shape}")
    for impl in impls:
        attention_fn(impl, variants)  # unknown names fail before anything runs
    steps = {impl: make_step(impl, shape, dtype, causal, layout, variants) for impl in impls}
    for impl, step in steps.items():
        with _backend(impl, variants):
            for _ in range(warmup):  # compiles, autotunes and caches
                step()
    torch.cuda.synchronize()
    rows = []
    for r in range(rounds):
        order = list(impls[r % len(impls):]) + list(impls[: r % len(impls)])
        for impl in order:
            with _backend(impl, variants):
                step = steps[impl]
                per_kernel = kernel_us(step, calls)
                row = {"round": r, "impl": impl, "host_us": host_us(step, calls),
                       "gpu_us": float(per_kernel.sum()), "wall_us": wall_us(step, calls)}
                if kernels:
                    row.update({f"kernel: {name}": us for name, us in per_kernel.items()})
                rows.append(row)
    batch, heads, seq, d = shape
    return pd.DataFrame(rows).assign(batch=batch, heads=heads, seq_len=seq, head_dim=d,
                                     dtype=str(dtype).removeprefix("torch."), causal=causal, layout=layout)


def kernel_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Median µs per call of each kernel (rows) per implementation (columns), from :func:`measure`'s
    ``kernels`` columns; kernel names shortened to 60 characters."""
    cols = [c for c in rows.columns if c.startswith("kernel: ")]
    table = rows.groupby("impl", sort=False)[cols].median().T.dropna(how="all")
    table.index = [c.removeprefix("kernel: ")[:60] for c in table.index]
    return table


def summarize(rows: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Median over rounds per implementation (and per ``by`` columns, e.g. the shape, before it), with the spread
    (max - min) of the host time."""
    g = rows.groupby([*by, "impl"], sort=False)
    out = g[["host_us", "gpu_us", "wall_us"]].median()
    out["host_spread_us"] = g["host_us"].max() - g["host_us"].min()
    return out.reset_index()


def profile_host(step: Callable[[], object], calls: int = 200, top: int = 30) -> str:
    """cProfile of ``calls`` calls issued while the GPU sleeps (as in :func:`host_us`; on a machine without
    one, as they run), the ``top`` functions by own time. A synchronization shows up as one call that owns the
    rest of the sleep."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles(2.0))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


__all__ = ["GLUON_BACKWARD_SHORT", "GLUON_SHORT", "GLUON_VIEWS", "IMPLS", "LAYOUTS", "NO_GLUON_VIEWS", "OURS_VARIANTS",
           "TRITON_BACKWARD", "UNCACHED", "UNPLANNED", "VARIANTS",
           "parse_variant", "selected_impls", "host_us", "issue_seconds", "kernel_table", "kernel_us",
           "make_inputs", "measure", "profile_host", "sleep_cycles", "summarize", "wall_us"]


def selected_impls(impls: str, variants: Mapping[str, dict[str, Any]]) -> tuple[str, ...]:
    """``--impls`` (comma-separated) followed by the ``--variant`` names it does not place itself: a variant
    is defined to be measured."""
    named = tuple(x for x in impls.split(",") if x)
    return (*named, *(name for name in variants if name not in named))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking flash_host_overhead --help``."""
    parser.add_argument("--shape", action="append", default=None,
                        help="batch,heads,seq,head_dim (repeatable; default 1,16,1024,64)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layout", default="bhsd", choices=LAYOUTS,
                        help="bhsd: contiguous (batch, heads, seq, d); bshd: views of (batch, seq, heads, d), as in a model")
    parser.add_argument("--kernels", action="store_true", help="also print each kernel's GPU µs per call")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated, of {', '.join(_ALL)} and the --variant names")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="a variant of ours with these FlashOptions fields, measured after --impls unless "
                             "--impls places it (repeatable): "
                             """'fwd128={"candidates": {"forward": [[128, 128, 8, 3]]}}'""")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of our host path")
    parser.add_argument("--csv", help="write every round's rows here")


def run_command(args: argparse.Namespace) -> int:
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["1,16,1024,64"])]
    except ValueError:
        raise ValueError(f"--shape takes four integers batch,heads,seq,head_dim, got {args.shape}")
    variants = dict(parse_variant(v) for v in args.variant)
    impls = selected_impls(args.impls, variants)
    for impl in impls:
        attention_fn(impl, variants)  # unknown names fail here, in one line
    dtype = getattr(torch, args.dtype)
    frames = []
    for shape in shapes:
        rows = measure(shape, dtype, args.causal, impls, args.rounds, args.calls,  # type: ignore[arg-type]
                       layout=args.layout, kernels=args.kernels, variants=variants)
        frames.append(rows)
        s = summarize(rows)
        print(f"shape {shape}, {args.dtype}, causal={args.causal}, layout {args.layout}: median of {args.rounds} "
              "rounds, µs per fwd+bwd")
        print(s.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        if args.kernels:
            print(kernel_table(rows).to_string(float_format=lambda v: f"{v:.1f}", na_rep="-"))
        if args.profile and "ours" in impls:
            print(profile_host(make_step("ours", shape, dtype, args.causal, args.layout)))  # type: ignore[arg-type]
    if args.csv:
        pd.concat(frames, ignore_index=True).to_csv(args.csv, index=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking flash_host_overhead`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["flash_host_overhead", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.flash_host_overhead"))
