"""Cross-rank checks: different models at wrap time, skipped synchronisations and diverged replicas end
with one clear error on every rank (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Linear
from cs336_systems.distributed.consistency import first_parameter_mismatch, resolve_check_every
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import WorkerError, spawn
from cs336_systems.distributed.strategies import STRATEGIES, wrap


def test_first_parameter_mismatch_names_the_parameter_and_ranks() -> None:
    a = [("w", (8, 4), "float32"), ("b", (8,), "float32")]
    assert first_parameter_mismatch([a, a, a]) is None
    assert first_parameter_mismatch([a, a, [("w", (6, 4), "float32"), a[1]]]) == \
        "parameter 'w' has shape (8, 4) on rank 0 but (6, 4) on rank 2"
    assert first_parameter_mismatch([a, [a[0], ("b", (8,), "bfloat16")]]) == \
        "parameter 'b' is float32 on rank 0 but bfloat16 on rank 1"
    assert first_parameter_mismatch([a, [("v", (8, 4), "float32"), a[1]]]) == \
        "parameter #0 is 'w' on rank 0 but 'v' on rank 1"
    assert first_parameter_mismatch([a, a[:1]]) == \
        "rank 0 has 2 parameters and rank 1 has 1 (first unmatched: 'b' on rank 0)"


def test_check_every_rejects_nonsense() -> None:
    assert resolve_check_every(None) is None and resolve_check_every(7) == 7
    for bad in (0, -1, 2.5, True, "often"):
        with pytest.raises(ValueError, match="check_every"):
            resolve_check_every(bad)


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Linear(4, hidden), nn.ReLU(), Linear(hidden, 2))


def _wrap_different_models(kind: str) -> None:
    model = _model(8 if dist.get_rank() == 0 else 6)
    FSDP(model) if kind == "fsdp" else wrap(model, kind)


@pytest.mark.parametrize("kind", [*STRATEGIES, "fsdp"])
def test_different_models_are_refused_at_wrap_time_on_every_rank(kind: str) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_wrap_different_models, 2, kind, backend="gloo", timeout_s=60, collective_timeout_s=10)
    message = str(info.value)
    assert "the ranks hold different models: parameter '0.weight' has shape (8, 4) on rank 0 but (6, 4) on rank 1" \
        in message
    assert all("ValueError" in outcome for outcome in info.value.outcomes.values()), info.value.outcomes


def _train(kind: str, skip_sync_on_rank1: bool, perturb_rank1: bool, check_every) -> int:
    model = _model(8)
    wrapped = FSDP(model, check_every=check_every) if kind == "fsdp" else wrap(model, kind, check_every=check_every)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(3):
        torch.manual_seed(step)
        wrapped(torch.randn(4, 4)).square().mean().backward()
        if not (skip_sync_on_rank1 and rank == 1 and step == 0):
            wrapped.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if perturb_rank1 and rank == 1 and step == 0:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-3
    return step


@pytest.mark.parametrize("kind", ["naive", "bucketed", "fsdp"])
def test_a_skipped_synchronization_fails_at_the_next_step_on_every_rank(kind: str) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_train, 2, kind, True, False, "auto", backend="gloo", timeout_s=60, collective_timeout_s=10)
    assert ("replicas out of step: rank 1 is at a forward after 0 finished gradient synchronizations, rank 0 "
            "in finish_gradient_synchronization() after 0 finished") in str(info.value)
    assert all("replicas out of step" in o for o in info.value.outcomes.values()), info.value.outcomes


def test_diverged_parameters_are_named() -> None:
    with pytest.raises(WorkerError, match=r"replicas diverged: parameter '2.weight' differs between rank 0"):
        spawn(_train, 2, "bucketed", False, True, 1, backend="gloo", timeout_s=60, collective_timeout_s=10)


def test_without_the_check_the_drift_goes_unnoticed() -> None:
    """Negative control: the same faulty loop with the check off completes, so the check is what catches it."""
    assert spawn(_train, 2, "bucketed", False, True, None, backend="gloo", timeout_s=60, collective_timeout_s=10) == [2, 2]


def test_capturing_never_initializes_cuda(monkeypatch):
    """A CPU rank forked from a parent that counted the GPUs must not touch CUDA to ask about graph capture:
    there the call fails with CUDA's initialization error, so an uninitialized process answers False."""
    from cs336_systems.distributed import consistency

    def touched():
        raise AssertionError("asked CUDA about capture in a process that never initialized it")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", touched)
    assert consistency.capturing() is False
