"""Our training step against a torch-native reference of the same shapes, side by side in one process.

A step is forward, loss, backward, optimizer step and ``zero_grad(set_to_none=True)``, with no
synchronisation inside it (a per-phase sync would keep the host from running ahead of the GPU, which a
real training loop does). Each round times ``steps`` consecutive steps of every stack between two
CUDA events (``perf_counter`` and a final sync on CPU), the stacks alternating in an order that rotates
from round to round; the report is the median over rounds with the spread (max - min), model TFLOP/s
(:func:`cs336_systems.configs.step_flops`) and MFU against the device's data-sheet peak
(:mod:`cs336_systems.hardware`).

- ``ours``: :class:`cs336_basics.model.BasicsTransformerLM` with the chosen registered attention (and,
  with ``--fused-projections``, its Q/K/V and W1/W3 weights stacked), ``cs336_basics`` cross-entropy, and
  :class:`~cs336_systems.flat_adamw.FlatAdamW` (``--optimizer basics``: ``cs336_basics``' per-parameter AdamW);
- ``reference``: :class:`~cs336_systems.benchmarking.torch_native_lm.TorchNativeLM`, ``F.cross_entropy``
  and ``torch.optim.AdamW`` (``fused=True`` on CUDA), SDPA pinned to ``--reference-sdpa`` (cuDNN by default;
  memory-efficient in fp32, where cuDNN has no kernel).

Both use the same batch, autocast and ``--compile`` (``torch.compile`` of the model and its loss together).
:func:`measure_alone` times a third configuration on its own, :data:`BASELINE_CHANGES` applied: our model as it
ran before this work (eager, SDPA, per-parameter AdamW), the "before" that a speed-up is counted from.

    python -m cs336_systems.benchmarking.train_step --preset xl --context-length 1024 --batch-size 4 \\
        --precision bf16 --compile --attention flash_triton
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from cs336_systems.benchmarking.end_to_end import PRECISIONS, autocast_context, default_device
from cs336_systems.configs import get_config, step_flops
from cs336_systems.hardware import matmul_precision, mfu

STACKS = ("ours", "reference")
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
#: SDPA backends without a float32 kernel.
HALF_ONLY_BACKENDS = ("cudnn", "flash")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The modes whose compiled graphs replay as CUDA graphs (``torch.compile`` skips that on a CPU).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class StepSpec:
    preset: str = "small"
    context_length: int = 1024
    batch_size: int = 4
    precision: str = "bf16"
    compile: bool = False
    compile_mode: str = "default"
    """``torch.compile``'s mode for both stacks; ``reduce-overhead`` replays each graph as a CUDA graph."""
    attention: str = "sdpa"
    reference_sdpa: str = "auto"
    """The reference's SDPA backend; ``auto``: cuDNN in bf16/fp16, memory-efficient in fp32 (no cuDNN kernel)."""
    optimizer: str = "flat"
    checkpoint: tuple[int, ...] = ()
    """Our model's activation checkpointing (:func:`cs336_systems.checkpointing.checkpoint_layers` levels)."""
    fused_head: bool = False
    """Our model's LM head and loss as :func:`cs336_systems.lm_head_loss.linear_cross_entropy` (no logits)."""
    fused_projections: bool = False
    """Our model's Q/K/V and SwiGLU W1/W3 as one GEMM each, as the reference has them
    (:func:`cs336_systems.fused_projections.fuse_projections`)."""
    packed_attention: bool = True
    """With ``fused_projections`` and ``flash_triton``: attention over the QKV output whole, RoPE and the
    gradient's packing in its kernels (:mod:`cs336_systems.attention.flash_qkvpacked`); off: split heads."""
    lr: float = 1e-4

    @property
    def reference_backend(self) -> str:
        """The SDPA backend the reference is pinned to (``auto`` resolved)."""
        if self.reference_sdpa != "auto":
            return self.reference_sdpa
        return "efficient" if self.precision == "fp32" else "cudnn"

    def check(self) -> None:
        from cs336_basics.model import available_attention_impls

        get_config(self.preset)  # unknown presets fail in one line
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.attention not in available_attention_impls():
            raise ValueError(f"unknown attention {self.attention!r}; available: {available_attention_impls()}")
        if self.reference_sdpa not in SDPA_BACKENDS:
            raise ValueError(f"reference_sdpa must be one of {', '.join(SDPA_BACKENDS)}, got {self.reference_sdpa!r}")
        if self.precision == "fp32" and self.reference_sdpa in HALF_ONLY_BACKENDS:
            raise ValueError(f"reference_sdpa {self.reference_sdpa!r} has no float32 kernel; use auto, efficient "
                             "or math with precision fp32")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.optimizer not in ("flat", "basics"):
            raise ValueError(f"optimizer must be 'flat' (FlatAdamW) or 'basics' (cs336_basics AdamW), got {self.optimizer!r}")
        if min(self.context_length, self.batch_size) < 1:
            raise ValueError(f"context_length and batch_size must be positive, got {self.context_length}, "
                             f"{self.batch_size}")


def ms_per_call(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Milliseconds per call over ``calls`` back-to-back calls: CUDA events around them on a GPU (the host
    may run ahead; the GPU's time is what counts), ``perf_counter`` on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def parse_levels(text: str) -> tuple[int, ...]:
    """``"8,2"`` → ``(8, 2)``: checkpoint levels as given on a command line (``""``: none)."""
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"checkpoint levels are comma-separated positive integers, got {text!r}") from None


@contextlib.contextmanager
def _sdpa_backend(name: str, device: torch.device) -> Iterator[None]:
    if device.type != "cuda":  # CPU runs are smoke runs: SDPA picks its CPU kernel
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel(backend):
        yield


class TrainStep:
    """One stack's model, optimizer, batch and step function (see the module docstring)."""

    def __init__(self, stack: str, spec: StepSpec, device: torch.device, seed: int = 0):
        if stack not in STACKS:
            raise ValueError(f"unknown stack {stack!r}; choose from {', '.join(STACKS)}")
        self.stack, self.spec, self.device = stack, spec, device
        cfg = get_config(spec.preset)
        torch.manual_seed(seed)
        if stack == "ours":
            from cs336_basics.model import BasicsTransformerLM
            from cs336_basics.nn_utils import cross_entropy
            from cs336_basics.optimizer import AdamW

            kwargs = {**cfg.model_kwargs(), "context_length": spec.context_length}
            self.model = BasicsTransformerLM(**kwargs, attention_impl=spec.attention, device=device)
            if spec.fused_projections:  # before checkpointing and the optimizer: the fused weights are new
                from cs336_systems.fused_projections import fuse_projections

                fuse_projections(self.model, packed_attention=spec.packed_attention)
            if spec.checkpoint:
                from cs336_systems.checkpointing import checkpoint_layers

                checkpoint_layers(self.model, spec.checkpoint)
            if spec.optimizer == "flat":
                from cs336_systems.flat_adamw import FlatAdamW

                self.optimizer: torch.optim.Optimizer = FlatAdamW(self.model.parameters(), lr=spec.lr)
            else:
                self.optimizer = AdamW(self.model.parameters(), lr=spec.lr)
            body: Callable = self.model
            self.loss_fn: Callable = cross_entropy
            self.context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
            if spec.fused_head:  # the body stops before the LM head, whose GEMM the loss does under autocast
                from functools import partial

                from cs336_systems.lm_head_loss import hidden_states, linear_cross_entropy

                body = partial(hidden_states, self.model)
                self.loss_fn = lambda h, y: linear_cross_entropy(h, self.model.lm_head.weight, y)
        else:
            from cs336_systems.benchmarking.torch_native_lm import TorchNativeLM

            self.model = TorchNativeLM.from_config(cfg, spec.context_length).to(device)
            fused = device.type == "cuda"
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, fused=fused, foreach=not fused)
            self.loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, -2), y.flatten())
            self.context = lambda: _sdpa_backend(spec.reference_backend, device)
            body = self.model
        self.body: Callable = body
        self.loss_under_autocast = stack == "ours" and spec.fused_head
        # The loss is compiled with the model: left eager, a plain cross-entropy makes several logits-sized
        # passes (about 1 ms each at 8192 tokens x 10k vocab) outside the graph, where Inductor fuses them.
        mode = None if spec.compile_mode == "default" else spec.compile_mode
        self.forward_loss = torch.compile(self._forward_loss, mode=mode) if spec.compile else self._forward_loss
        self.cuda_graphs = spec.compile and spec.compile_mode in CUDA_GRAPH_MODES
        shape = (spec.batch_size, spec.context_length)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.inputs = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)
        self.targets = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.spec.precision, self.device):
            out = self.body(inputs)
            if self.loss_under_autocast:  # the fused head's GEMM runs in the autocast dtype
                return self.loss_fn(out, targets)
        return self.loss_fn(out, targets)

    def step(self) -> torch.Tensor:
        if self.cuda_graphs:  # a new iteration: the graphs may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.forward_loss(self.inputs, self.targets)
        loss.backward()
        with torch.profiler.record_function("optimizer"):  # for time_split; free without a profiler
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach().clone() if self.cuda_graphs else loss.detach()  # a replay would overwrite it

    def time_split(self, steps: int = 3) -> pd.DataFrame:
        """Where ``steps`` steps spend their time (:func:`cs336_systems.profiling.step_split.step_time_split`),
        against the unprofiled step time of the same steps."""
        from torch.profiler import ProfilerActivity, profile

        from cs336_systems.profiling.step_split import step_time_split
        from cs336_systems.profiling.torch_profiler import kernel_records, range_intervals

        step_ms = self.time_ms(steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with self.context(), profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                self.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return step_time_split(kernel_records(prof), range_intervals(prof, "optimizer"), steps, step_ms)

    def time_ms(self, steps: int) -> float:
        """Milliseconds per step over ``steps`` back-to-back steps."""
        with self.context():
            return ms_per_call(self.step, steps, self.device)


#: Our stack as it started, before this section's work: eager, SDPA, ``cs336_basics``' per-parameter AdamW, no
#: checkpointing or fused paths. :func:`baseline_spec` applies it to a cell's spec (batch, context and precision
#: stay), and :func:`measure_alone` times it: the "before" of the before/after comparison.
BASELINE_CHANGES = {"compile": False, "compile_mode": "default", "attention": "sdpa", "optimizer": "basics",
                    "checkpoint": (), "fused_head": False, "fused_projections": False}


def baseline_spec(spec: StepSpec) -> StepSpec:
    """``spec`` with :data:`BASELINE_CHANGES`: the same cell, run the way our model first ran."""
    return dataclasses.replace(spec, **BASELINE_CHANGES)


def measure_alone(spec: StepSpec, rounds: int = 3, steps: int = 5, warmup: int = 3,
                  device: torch.device | None = None, split_steps: int = 0, label: str = "baseline") -> pd.DataFrame:
    """Our stack at ``spec`` timed on its own: one row per round (``round``, ``stack`` = ``label``,
    ``step_ms``, ``num_params``), one build, ``warmup`` untimed steps first.

    Not alternated with :func:`compare`'s stacks: it is the reference point a speed-up is measured from, and
    holding a third model beside two compiled ones would not fit the largest presets. Running out of memory
    is a result, not an error: ``frame.attrs["status"]`` is ``"ok"`` or ``"OOM"`` (then no rows). With
    ``split_steps``, ``frame.attrs["split"]`` holds its :meth:`TrainStep.time_split`."""
    from cs336_systems.benchmarking.sweep import OK, OOM, free_memory, is_oom

    spec.check()
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, steps >= 1, warmup >= 0; got {rounds}, {steps}, {warmup}")
    device = device or default_device()
    free_memory()
    run = None
    try:
        run = TrainStep("ours", spec, device)
        with run.context():
            for _ in range(warmup):
                run.step()
        rows = [{"round": r, "stack": label, "step_ms": run.time_ms(steps), "num_params": run.num_params}
                for r in range(rounds)]
        split = run.time_split(split_steps).assign(stack=label) if split_steps else None
    except Exception as exc:
        if not is_oom(exc):
            raise
        frame = pd.DataFrame(columns=["round", "stack", "step_ms", "num_params"])
        frame.attrs["status"] = OOM
        return frame
    finally:
        del run
        torch._dynamo.reset()
        free_memory()
    frame = pd.DataFrame(rows)
    frame.attrs["status"] = OK
    if split is not None:
        frame.attrs["split"] = split
    return frame


RESIDENCY = ("auto", "both", "one")


def both_fit(spec: StepSpec, memory_bytes: float, stacks: int = 2) -> bool:
    """Whether ``stacks`` stacks' training state (fp32 weights, gradients and AdamW moments: 16 B per
    parameter each) plus one step's saved activations fit in 85% of ``memory_bytes``, by the calculator
    (:func:`cs336_systems.configs.memory_breakdown`; a flash or SDPA attention saves no score matrix)."""
    from cs336_systems.configs import activation_elements_per_layer, dtype_bytes, memory_breakdown

    act_dtype = "fp32" if spec.precision == "fp32" else "bf16"
    mem = memory_breakdown(spec.preset, spec.batch_size, spec.context_length, activation_dtype=act_dtype)
    activations = mem["activations"]
    if spec.attention != "naive":
        per_layer = activation_elements_per_layer(spec.preset, spec.batch_size, spec.context_length)
        activations -= per_layer["attention_scores"] * get_config(spec.preset).num_layers * dtype_bytes(act_dtype)
    state = mem["parameters"] + mem["gradients"] + mem["optimizer_state"]
    return stacks * state + activations <= 0.85 * memory_bytes


def compare(spec: StepSpec, rounds: int = 5, steps: int = 10, warmup: int = 3,
            stacks: tuple[str, ...] = STACKS, device: torch.device | None = None,
            split_steps: int = 0, resident: str = "auto") -> pd.DataFrame:
    """One row per (round, stack): ``step_ms``, the stacks alternating in an order that rotates by round.

    ``resident="both"`` builds every stack once and keeps them all on the device (fastest: one compile
    each). ``"one"`` keeps a single stack resident: each turn builds it afresh (two turns of one stack in a
    row share a build), warms it up (a compile after the first is a cache hit in Inductor's caches), times
    it and frees it, so a model whose
    two stacks do not fit together (xl at 8192 tokens, 2.7B: 32–44 GB of state each) is still compared
    alternately. ``"auto"`` picks ``both`` when :func:`both_fit` says so. ``frame.attrs["resident"]`` says
    which ran. With ``split_steps``, ``frame.attrs["split"]`` holds each stack's :meth:`TrainStep.time_split`
    (long table), taken after the stack's last timed turn."""
    from cs336_systems.benchmarking.sweep import free_memory

    spec.check()
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, steps >= 1, warmup >= 0; got {rounds}, {steps}, {warmup}")
    if resident not in RESIDENCY:
        raise ValueError(f"resident must be one of {', '.join(RESIDENCY)}, got {resident!r}")
    device = device or default_device()
    if resident == "auto":
        fits = device.type != "cuda" or both_fit(spec, torch.cuda.get_device_properties(device).total_memory,
                                                  len(stacks))
        resident = "both" if fits else "one"

    def build(stack: str) -> TrainStep:
        run = TrainStep(stack, spec, device)
        with run.context():
            for _ in range(warmup):  # compilation and autotuning happen here
                run.step()
        return run

    schedule = [(r, s) for r in range(rounds) for s in stacks[r % len(stacks):] + stacks[:r % len(stacks)]]
    runs = {s: build(s) for s in stacks} if resident == "both" else {}
    rows, num_params, splits = [], {}, {}
    for i, (r, s) in enumerate(schedule):
        if s not in runs:  # one resident: build it (the rotation puts a stack twice in a row at a round's end)
            runs = {s: build(s)}
        run = runs[s]
        rows.append({"round": r, "stack": s, "step_ms": run.time_ms(steps)})
        num_params[s] = run.num_params
        last_use = all(t != s for _, t in schedule[i + 1:])
        if split_steps and last_use:
            splits[s] = run.time_split(split_steps).assign(stack=s)
        if resident == "one" and (i + 1 == len(schedule) or schedule[i + 1][1] != s):
            del run
            runs.clear()
            torch._dynamo.reset()  # the compiled graph holds the model
            free_memory()
    frame = pd.DataFrame(rows)
    frame["num_params"] = frame["stack"].map(num_params)
    frame.attrs["resident"] = resident
    if split_steps:
        frame.attrs["split"] = pd.concat([splits[s] for s in stacks], ignore_index=True)
    return frame


def summarize(rows: pd.DataFrame, spec: StepSpec, device_name: str | None = None,
              float32_matmul_precision: str | None = None, ceiling_tflops: float | None = None) -> pd.DataFrame:
    """Median step time per stack with its spread, tokens/s, model TFLOP/s, MFU (against the data sheet and,
    given ``ceiling_tflops``, against the measured matmul ceiling:
    :mod:`cs336_systems.benchmarking.matmul_ceiling`) and the ratio to the reference (reference time / stack
    time: above 1 is faster than the reference)."""
    g = rows.groupby("stack", sort=False)["step_ms"]
    out = pd.DataFrame({"step_ms": g.median(), "spread_ms": g.max() - g.min()}).reset_index()
    tokens = spec.batch_size * spec.context_length
    out["tokens_per_s"] = tokens / (out["step_ms"] * 1e-3)
    flops = step_flops(spec.preset, spec.batch_size, spec.context_length, "train")
    out["TFLOP_per_s"] = flops / (out["step_ms"] * 1e-3) / 1e12
    fmp = float32_matmul_precision or torch.get_float32_matmul_precision()
    out["MFU_pct"] = [100 * mfu(t, device_name, matmul_precision(spec.precision, fmp)) for t in out["TFLOP_per_s"]]
    if ceiling_tflops:
        out["MFU_of_ceiling_pct"] = 100 * out["TFLOP_per_s"] / ceiling_tflops
    if "reference" in set(out["stack"]):
        ref = float(out.loc[out["stack"] == "reference", "step_ms"].iloc[0])
        out["vs_reference"] = ref / out["step_ms"]
    return out


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that make a :class:`StepSpec` and pick the stacks (this command's and ``step_kernels``')."""
    parser.add_argument("--preset", "--size", dest="preset", default="small")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models with their losses")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--attention", default="sdpa", help="our model's registered attention")
    parser.add_argument("--reference-sdpa", choices=SDPA_BACKENDS, default="auto",
                        help="the reference's SDPA backend (auto: cuDNN in bf16/fp16, efficient in fp32)")
    parser.add_argument("--optimizer", choices=["flat", "basics"], default="flat", help="our stack's AdamW")
    parser.add_argument("--checkpoint", default="", help="our model's checkpoint levels, e.g. 4 or 8,2 (empty: off)")
    parser.add_argument("--fused-head", action="store_true", help="our LM head + cross-entropy without logits")
    parser.add_argument("--fused-projections", action="store_true",
                        help="our Q/K/V and SwiGLU W1/W3 projections as one GEMM each")
    parser.add_argument("--packed-attention", action=argparse.BooleanOptionalAction, default=True,
                        help="with --fused-projections and flash_triton: attend over the QKV output whole (RoPE and "
                             "the gradient's packing in the kernels); --no-packed-attention: split heads")
    parser.add_argument("--stacks", default=",".join(STACKS))


def step_from_args(args: argparse.Namespace) -> tuple[StepSpec, tuple[str, ...]]:
    """The checked :class:`StepSpec` and stacks of :func:`add_step_arguments`' options (a bad one raises
    ``ValueError``, which the command line ends with in one line)."""
    try:
        levels = parse_levels(args.checkpoint)
    except ValueError as exc:
        raise ValueError(f"--checkpoint: {exc}") from None
    spec = StepSpec(preset=args.preset, context_length=args.context_length, batch_size=args.batch_size,
                    precision=args.precision, compile=args.compile, compile_mode=args.compile_mode,
                    attention=args.attention, reference_sdpa=args.reference_sdpa, optimizer=args.optimizer,
                    checkpoint=levels, fused_head=args.fused_head, fused_projections=args.fused_projections,
                    packed_attention=args.packed_attention)
    spec.check()
    stacks = tuple(s for s in args.stacks.split(",") if s)
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        raise ValueError(f"unknown stack {unknown[0]!r}; choose from {', '.join(STACKS)}")
    return spec, stacks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking train_step --help``."""
    add_step_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--resident", choices=RESIDENCY, default="auto",
                        help="keep both stacks on the device, or one at a time (rebuilt per round)")
    parser.add_argument("--csv", help="write every round's rows here")


def run_command(args: argparse.Namespace) -> int:
    spec, stacks = step_from_args(args)
    device = default_device()
    rows = compare(spec, args.rounds, args.steps, args.warmup, stacks, device, resident=args.resident)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    table = summarize(rows, spec, name)
    print(f"{spec.preset}, context {spec.context_length}, batch {spec.batch_size}, {spec.precision}, "
          f"compile={spec.compile}, ours with {spec.attention}, reference SDPA {spec.reference_backend}, on {name}: "
          f"median of {args.rounds} rounds of {args.steps} steps, {rows.attrs['resident']} resident")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        rows.to_csv(args.csv, index=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking train_step`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["train_step", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.train_step"))
