"""End-to-end benchmark of ``BasicsTransformerLM``: forward, forward + backward, or a full AdamW step.

One :class:`ModelBenchmark` owns a model, a random batch and (for training) our AdamW; calling
:meth:`ModelBenchmark.step` runs one step and returns how long each phase took. Phases are separated by
``torch.cuda.synchronize()`` so that each phase's wall time is its GPU time plus launch overhead,
which is what the handout's ``timeit`` methodology measures.

Every phase runs inside an NVTX range (``forward``, ``backward``, ``optimizer``), and steps run inside
``warmup`` or ``measured`` ranges, through ``cs336_basics.nvtx``: free when annotation is off, visible to
Nsight Systems and torch.profiler when it is on (see :mod:`cs336_systems.profiling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cs336_basics import nvtx
from cs336_basics.model import BasicsTransformerLM, available_attention_impls
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW

from ..configs import ModelConfig, get_config, step_flops
from .timing import TimingStats, synchronize

#: ``inference`` is a forward pass under ``torch.no_grad`` (no activations kept for backward);
#: ``forward`` keeps the autograd graph, as the forward half of training does.
MODES = ("inference", "forward", "forward_backward", "train")
PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_context(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``bf16``/``fp16`` mixed precision, a ``nullcontext`` for ``fp32``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=_AUTOCAST_DTYPES[precision])


@dataclass(frozen=True)
class BenchmarkSpec:
    """What to benchmark. ``model`` is a preset name or an explicit :class:`ModelConfig`;
    ``context_length`` / ``batch_size`` default to the preset's."""

    model: str | ModelConfig = "small"
    mode: str = "forward_backward"
    context_length: int | None = None
    batch_size: int | None = None
    warmup: int = 5
    steps: int = 10
    precision: str = "fp32"
    compile: bool = False
    attention_impl: str = "naive"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"need warmup >= 0 and steps >= 1, got {self.warmup}, {self.steps}")
        impls = available_attention_impls()
        if self.attention_impl not in impls:
            raise ValueError(f"unknown attention implementation {self.attention_impl!r}; available: {impls}")
        for name in ("context_length", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def config(self) -> ModelConfig:
        cfg = get_config(self.model)
        changes = {k: v for k, v in (("context_length", self.context_length), ("batch_size", self.batch_size)) if v}
        return cfg.replace(**changes) if changes else cfg

    def replace(self, **changes: Any) -> BenchmarkSpec:
        return dataclasses.replace(self, **changes)


class ModelBenchmark:
    """A model, a random batch and an optimizer, ready to run timed steps of ``spec.mode``.

    Building is separate from running so that a sweep can reuse one (large) model across modes, and so
    that profilers can wrap :meth:`step` without the timing loop.
    """

    def __init__(self, spec: BenchmarkSpec, model: BasicsTransformerLM | None = None):
        self.spec = spec
        self.cfg = spec.config
        self.device = torch.device(spec.device) if spec.device else default_device()
        torch.manual_seed(spec.seed)
        if model is None:
            model = BasicsTransformerLM(
                **self.cfg.model_kwargs(), attention_impl=spec.attention_impl, device=self.device
            )
        else:
            model.set_attention_impl(spec.attention_impl)
        self.model = model
        self.forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if spec.compile else model
        shape = (self.cfg.batch_size, self.cfg.context_length)
        self.inputs = torch.randint(0, self.cfg.vocab_size, shape, device=self.device)
        self.targets = torch.randint(0, self.cfg.vocab_size, shape, device=self.device)
        self.optimizer = AdamW(model.parameters(), lr=1e-4) if spec.mode == "train" else None

    def _phase(self, name: str, times: dict[str, float], fn: Callable[[], Any]) -> Any:
        start = timeit.default_timer()
        with nvtx.range(name):
            result = fn()
        synchronize(self.device)
        times[name] = timeit.default_timer() - start
        return result

    def _loss(self) -> torch.Tensor:
        with autocast_context(self.spec.precision, self.device):
            logits = self.forward(self.inputs)
        return cross_entropy(logits, self.targets)

    def step(self) -> dict[str, float]:
        """One step of ``spec.mode``; returns seconds per phase (``forward``, ``backward``,
        ``optimizer`` as applicable) and ``total``."""
        mode = self.spec.mode
        times: dict[str, float] = {}
        synchronize(self.device)
        start = timeit.default_timer()
        if mode == "inference":
            with torch.no_grad():
                self._phase("forward", times, self._loss)
        else:
            loss = self._phase("forward", times, self._loss)
            if mode in ("forward_backward", "train"):
                self._phase("backward", times, loss.backward)
            if self.optimizer is not None:
                self._phase("optimizer", times, self.optimizer.step)
            del loss
            if mode != "forward":
                self.model.zero_grad(set_to_none=True)
        times["total"] = timeit.default_timer() - start
        return times

    def run(self, warmup: int | None = None, steps: int | None = None) -> dict[str, TimingStats]:
        """``warmup`` untimed steps then ``steps`` timed ones (defaults from the spec), inside
        ``warmup`` / ``measured`` ranges; returns stats per phase."""
        warmup = self.spec.warmup if warmup is None else warmup
        steps = self.spec.steps if steps is None else steps
        with nvtx.range("warmup"):
            for _ in range(warmup):
                self.step()
        samples: dict[str, list[float]] = {}
        with nvtx.range("measured"):
            for _ in range(steps):
                for phase, seconds in self.step().items():
                    samples.setdefault(phase, []).append(seconds)
        return {phase: TimingStats.from_seconds(v) for phase, v in samples.items()}


def benchmark_model(spec: BenchmarkSpec, model: BasicsTransformerLM | None = None) -> dict[str, Any]:
    """Build and run one benchmark; returns a flat row: ``{phase}_{mean,std,min,max}_ms`` per phase,
    tokens/s and achieved TFLOP/s of the whole step, and peak GPU memory."""
    bench = ModelBenchmark(spec, model)
    if torch.cuda.is_available() and bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    stats = bench.run()
    row: dict[str, Any] = {}
    for phase, st in stats.items():
        row.update(st.summary(prefix=f"{phase}_"))
    cfg = bench.cfg
    total = stats["total"].mean
    row["tokens_per_s"] = cfg.batch_size * cfg.context_length / total
    flop_mode = "forward" if spec.mode in ("inference", "forward") else "train"
    row["TFLOP_per_s"] = step_flops(cfg, cfg.batch_size, cfg.context_length, flop_mode) / total / 1e12
    if bench.device.type == "cuda":
        row["peak_memory_GiB"] = torch.cuda.max_memory_allocated(bench.device) / 2**30
    return row


PHASES = ("forward", "backward", "optimizer")


def phase_kernels(bench: ModelBenchmark) -> tuple[dict[str, float], dict[str, Any]]:
    """Profile one step of ``bench`` (after one warm-up step): per phase, the kernels launched and their
    summed GPU time, as ``{phase}_kernels`` / ``{phase}_kernel_ms``; also returns each phase's kernel table.

    A phase whose wall time (``{phase}_mean_ms`` of :func:`benchmark_model`) is well above its kernel
    time is waiting on the host that launches the kernels, not on the GPU; the kernel count is what the
    host has to launch.
    """
    from ..profiling import kernel_table, profile_steps

    prof = profile_steps(bench.step, warmup=1, steps=1)
    row: dict[str, float] = {}
    tables = {}
    for name in PHASES:
        table = kernel_table(prof, name)
        row[f"{name}_kernels"] = int(table["calls"].sum())
        row[f"{name}_kernel_ms"] = float(table["total_ms"].sum())
        tables[name] = table
    return row, tables


def model_source_id() -> str:
    """First 12 hex digits of the SHA-1 of ``cs336_basics/model.py``: which model code produced a row,
    also when a comparison loads an older copy of the package through ``PYTHONPATH``."""
    import hashlib
    import inspect

    import cs336_basics.model

    return hashlib.sha1(inspect.getsource(cs336_basics.model).encode()).hexdigest()[:12]


def spec_row(spec: BenchmarkSpec) -> dict[str, Any]:
    """The identifying columns of a result row."""
    cfg = spec.config
    return {
        "size": cfg.name,
        "mode": spec.mode,
        "context_length": cfg.context_length,
        "batch_size": cfg.batch_size,
        "precision": spec.precision,
        "compile": spec.compile,
        "attention_impl": spec.attention_impl,
        "warmup": spec.warmup,
        "steps": spec.steps,
    }


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """Temporarily set ``torch.set_float32_matmul_precision`` (``highest`` = true fp32, ``high`` = TF32)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
