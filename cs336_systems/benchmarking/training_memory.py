"""Memory and time of one training configuration, measured the same way wherever it is compared: the CUDA
allocator's current and peak allocation at three points of a steady-state step (after construction, just
before ``optimizer.step()``, just after it) and the tensors counted by kind (parameters, gradients, optimizer
state, and the activations the forward saves). The optimizer-state sharding and FSDP sections both measure
through :func:`measure_training`, so their tables agree on what a number means.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import accounting
from cs336_systems.benchmarking.timing import time_calls
from cs336_systems.configs import ModelConfig

GIB = 2**30


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting; ``global_batch`` is split evenly over the ranks."""

    model: str
    global_batch: int
    context_length: int
    warmup: int
    steps: int
    lr: float = 1e-4

    def model_config(self) -> ModelConfig:
        return accounting.ladder_config(self.model).replace(context_length=self.context_length)

    def per_rank_batch(self, world_size: int) -> int:
        if self.global_batch % world_size:
            raise ValueError(f"global batch {self.global_batch} does not divide over {world_size} ranks")
        return self.global_batch // world_size


class MemoryProbe:
    """CUDA allocator statistics on a CUDA device; NaN on CPU (no allocator statistics there)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def allocated(self) -> float:
        return float(torch.cuda.memory_allocated(self.device)) if self.cuda else float("nan")

    def peak(self) -> float:
        return float(torch.cuda.max_memory_allocated(self.device)) if self.cuda else float("nan")

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)


def _unique_bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        if hasattr(t, "to_local"):  # DTensor (torch FSDP2): count this rank's local shard
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state tensors this rank holds (looks through ZeRO's and our wrappers)."""
    inner = getattr(optimizer, "optim", None) or getattr(optimizer, "inner", None) or optimizer
    return _unique_bytes(v for state in inner.state.values() for v in state.values())


def random_batch(cfg: ModelConfig, batch: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length), generator=g)
    return x.to(device), y.to(device)


def measure_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    after_backward: Callable[[], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
    after_init: dict[str, float] | None = None,
) -> dict[str, float]:
    """Warm up, then measure one instrumented step (memory) and ``steps`` timed steps.

    Returns allocator numbers at the three points of a step (GiB), the tensor-counted breakdown
    (GiB) and the step time (ms, mean and std of this rank).
    """
    x, y = batch
    probe = MemoryProbe(device)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else _null_context()
    )

    def step(record: dict[str, float] | None = None) -> None:
        if record is not None:
            probe.reset_peak()
            before_forward = probe.allocated()
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        if record is not None:
            record["activations"] = probe.allocated() - before_forward
        loss.backward()
        if after_backward is not None:
            after_backward()
        if record is not None:
            record["before_step_allocated"] = probe.allocated()
            record["before_step_peak"] = probe.peak()
            record["gradients"] = float(_unique_bytes(p.grad for p in model.parameters() if p.grad is not None))
            probe.reset_peak()
        optimizer.step()
        if record is not None:
            record["after_step_allocated"] = probe.allocated()
            record["after_step_peak"] = probe.peak()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    record: dict[str, float] = {}
    step(record)
    record["parameters"] = float(_unique_bytes(model.parameters()))
    record["optimizer_state"] = float(optimizer_state_bytes(optimizer))
    timing = time_calls(step, warmup=0, steps=steps, device=device)
    out = {k: v / GIB for k, v in record.items()}
    if after_init:
        out.update({k: v / GIB for k, v in after_init.items()})
    out["step_ms"] = timing.mean * 1e3
    out["step_ms_std"] = timing.std * 1e3
    return out


class _null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def init_snapshot(device: torch.device) -> dict[str, float]:
    probe = MemoryProbe(device)
    return {"after_init_allocated": probe.allocated(), "after_init_peak": probe.peak()}


def step_phases(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
               after_backward: Any, autocast_dtype: torch.dtype | None) -> list[tuple[str, Any]]:
    """A training step as named phases (forward with the loss, backward, gradient sync, optimizer), for
    :func:`~cs336_systems.benchmarking.timing.phase_times` and the profiler's ranges alike."""
    x, y = batch
    loss: list[torch.Tensor] = []

    def forward() -> None:
        with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)
        loss[:] = [F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))]

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return [("forward", forward), ("backward", lambda: loss.pop().backward()),
            ("grad_sync", after_backward or (lambda: None)), ("optimizer", optimizer_step)]


# --------------------------------------------------------------------------------------------------
# Optimizer-state sharding
# --------------------------------------------------------------------------------------------------
