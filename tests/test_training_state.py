"""Training state stays exactly right under every strategy, or fails loudly naming the cause (2 gloo ranks).

The fault suite for what used to go wrong silently: parameters a step does not use, layers used on one
rank only, ranks that run out of batches early, NaN/inf from one rank, buffers that each rank updates
from its own batch, and arguments that are not what they claim to be.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Linear
from cs336_systems.distributed.consistency import out_of_step_message
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import WorkerError, spawn
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.distributed.strategies import STRATEGIES, wrap

KINDS = [*STRATEGIES, "fsdp"]


class WithUnused(nn.Module):
    """``unused`` never takes part in the forward; ``extra`` only where ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = Linear(4, 4)
        self.extra = Linear(4, 4)
        self.unused = Linear(4, 4)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.extra(h) if self.use_extra else h


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(step))


def _wrapped(kind: str, module: nn.Module, **options):
    if kind == "fsdp":
        return FSDP(module, **options)
    return wrap(module, kind, bucket_size_mb=0.0001 if kind == "bucketed" else None, **options)


def _one_process_reference(extra_on: set[int] | None, steps: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the full batch (the rows rank r would see, for ``extra_on``)."""
    model = WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x = _batch(step)
        loss = 0.0
        for rank in range(2):
            model.use_extra = extra_on is not None and rank in extra_on
            loss = loss + model(x[rank * 4 : (rank + 1) * 4]).square().sum() / 8
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_with_unused(kind: str, extra_on: list[int] | None, sharded: bool, views: bool) -> dict:
    rank = dist.get_rank()
    model = WithUnused()
    model.use_extra = extra_on is not None and rank in extra_on
    options = {"gradient_as_bucket_view": True} if views else {}
    wrapped = _wrapped(kind, model, **options)
    opt = ShardedOptimizer(wrapped.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1) if sharded \
        else torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    grads_none = []
    for step in range(2):
        x = _batch(step)[rank * 4 : (rank + 1) * 4]
        (wrapped(x).square().sum() / 4).backward()
        wrapped.finish_gradient_synchronization()
        grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = wrapped.full_state_dict() if kind == "fsdp" else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "grads_none": grads_none}


def _unused_parameter_cases() -> list:
    cases = []
    for kind in STRATEGIES:
        cases.append((kind, False, False))
    cases += [("bucketed", True, False), ("individual", True, False), ("bucketed", False, True),
              ("flat", False, True), ("fsdp", False, False)]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("kind, sharded, views", _unused_parameter_cases())
def test_unused_parameters_keep_no_gradient_and_match_one_process(kind: str, sharded: bool, views: bool) -> None:
    """``unused`` gets ``grad=None`` and AdamW leaves it alone, as in one process; before, it got zeros and
    weight decay moved it. ``extra`` (used by no rank here) likewise."""
    ranks = spawn(_train_with_unused, 2, kind, None, sharded, views, backend="gloo", timeout_s=60)
    reference = _one_process_reference(None, 2)
    for result in ranks:
        for step in result["grads_none"]:
            assert step["unused.weight"] and step["extra.weight"] and not step["a.weight"]
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert torch.equal(ranks[0]["params"]["unused.weight"], WithUnused().unused.weight.detach())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["individual", "bucketed", "naive", "flat"])
def test_a_layer_used_on_one_rank_trains_as_one_process_with_the_check_on(kind: str) -> None:
    """Rank 0 alone runs ``extra``: with the replica check at its default (every step on gloo) this used to
    time out, the check's collective pairing with an in-flight all-reduce. Now its gradient is the average
    with rank 1's zeros, exactly one process's, and ``unused`` still ends with no gradient."""
    ranks = spawn(_train_with_unused, 2, kind, [0], False, False, backend="gloo", timeout_s=60)
    reference = _one_process_reference({0}, 2)
    for result in ranks:
        assert not result["grads_none"][0]["extra.weight"] and result["grads_none"][0]["unused.weight"]
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)


def _uneven_steps(kind: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(4, 8), nn.ReLU(), Linear(8, 2))
    wrapped = _wrapped(kind, model)
    steps = 3 if dist.get_rank() == 0 else 2  # rank 1 runs out of batches one step early
    for step in range(steps):
        wrapped(_batch(step)[:4]).square().mean().backward()
        wrapped.finish_gradient_synchronization()
    return "x" * 1000  # a large result: its pickled size once read as a synchronization count


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bucketed", "naive", "fsdp"])
def test_uneven_step_counts_are_named(kind: str) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_uneven_steps, 2, kind, backend="gloo", timeout_s=60, collective_timeout_s=20)
    assert "uneven steps: rank 1 stopped after 2 steps (its function returned), rank 0 is at step 3" \
        in str(info.value)


def test_out_of_step_messages_name_both_ranks() -> None:
    assert out_of_step_message([[0, 2, 3, 0], [0, 2, 3, 0]], "DDP") is None
    assert out_of_step_message([[0, 2, 3, 0], [3, 2, 2, 0]], "DDP").startswith(
        "uneven steps: rank 1 stopped after 2 steps (its function returned), rank 0 is at step 3 (at a forward "
        "after 2 finished gradient synchronizations)")
    assert "rank 0 is at training forward 3, rank 1 at forward 4" in \
        out_of_step_message([[0, 2, 3, 0], [0, 2, 4, 0]], "DDP")
    assert "rank 1 is at a forward after 0 finished gradient synchronizations, rank 0 in " \
        "finish_gradient_synchronization() after 0 finished" in out_of_step_message([[1, 0, 1, 0], [0, 0, 2, 0]], "DDP")


def _nonfinite(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(4, 8), nn.ReLU(), Linear(8, 2))
    wrapped = _wrapped(kind, model)
    for step in range(3):
        x = _batch(step)[:4]
        if step == 1 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        wrapped(x).square().mean().backward()
        wrapped.finish_gradient_synchronization()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bucketed", "naive", "fsdp"])
def test_a_nonfinite_gradient_is_named_with_its_rank_and_parameter(kind: str) -> None:
    """NaN in rank 1's input: every gradient of rank 1 is NaN, and the error names rank 1 and the parameter
    backward reached first (the output layer), not "replicas diverged" between two NaN sums."""
    with pytest.raises(WorkerError) as info:
        spawn(_nonfinite, 2, kind, backend="gloo", timeout_s=60, collective_timeout_s=20)
    assert "a non-finite gradient (NaN/inf) appeared first on rank 1, in parameter '2.weight', in its own " \
        "gradient of step 2" in str(info.value)
    assert all("FloatingPointError" in o for o in info.value.outcomes.values()), info.value.outcomes


def _batchnorm(broadcast_buffers: bool) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrapped = wrap(model, "bucketed", broadcast_buffers=broadcast_buffers) if broadcast_buffers is not None \
        else wrap(model, "bucketed")
    for step in range(3):
        x = _batch(step)[dist.get_rank() * 4 : (dist.get_rank() + 1) * 4] * (1 + dist.get_rank())
        wrapped(x).square().mean().backward()
        wrapped.finish_gradient_synchronization()
    return model[1].running_mean.tolist()


@pytest.mark.slow
def test_buffers_are_rank_zeros_by_default_and_drift_is_an_error_otherwise() -> None:
    same = spawn(_batchnorm, 2, None, backend="gloo", timeout_s=60, collective_timeout_s=20)
    # Each forward starts from rank 0's statistics, so after the last forward only that forward's batch differs;
    # what matters is that the statistics entering every forward were rank 0's (else the check would fail below).
    assert len(same) == 2
    with pytest.raises(WorkerError, match=r"replicas diverged: buffer '1.running_mean' differs between rank 0"):
        spawn(_batchnorm, 2, False, backend="gloo", timeout_s=60, collective_timeout_s=20)


def _fsdp_swapped_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(4, 4), Linear(4, 4), Linear(4, 4))
    wrapped = FSDP(model)
    for step in range(2):
        x = _batch(step)[:4]
        # Rank 1 runs the same-sized layers in another order: their gathers pair up silently.
        order = [0, 1, 2] if dist.get_rank() == 0 or step == 0 else [0, 2, 1]
        for i in order:
            x = model[i](x)
        x.square().mean().backward()
        wrapped.finish_gradient_synchronization()


@pytest.mark.slow
def test_fsdp_ranks_that_gather_different_layers_are_named() -> None:
    with pytest.raises(WorkerError, match="the ranks gathered different sharded layers"):
        spawn(_fsdp_swapped_layers, 2, backend="gloo", timeout_s=60, collective_timeout_s=20)


def _bad_options(kind: str) -> list[str]:
    model = nn.Sequential(Linear(4, 4))
    errors = []
    bad = {"bucket_size_mb": ["25", [1], True, math.inf, math.nan, 0],
           "broadcast_buffers": [1, "yes"], "detect_nonfinite": ["often", 1], "check_every": [0, 2.5]} \
        if kind != "fsdp" else \
        {"max_reductions_in_flight": [math.nan, 0, 2.5, True], "broadcast_buffers": ["no"], "prefetch": [None]}
    for option, values in bad.items():
        for value in values:
            try:
                if kind == "fsdp":
                    FSDP(model, **{option: value})
                else:
                    wrap(model, "bucketed", **{option: value})
            except ValueError as exc:
                assert "\n" not in str(exc) and option in str(exc), str(exc)
                errors.append(option)
    try:
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, broadcast_bucket_mb=math.inf)
    except ValueError as exc:
        assert "broadcast_bucket_mb" in str(exc)
        errors.append("broadcast_bucket_mb")
    return errors


def test_bad_options_are_one_line_errors_naming_the_option() -> None:
    ddp, fsdp = spawn(_bad_options, 2, "bucketed", backend="gloo", timeout_s=30)[0], \
        spawn(_bad_options, 2, "fsdp", backend="gloo", timeout_s=30)[0]
    assert ddp.count("bucket_size_mb") == 6 and ddp.count("broadcast_buffers") == 2
    assert ddp.count("detect_nonfinite") == 2 and ddp.count("check_every") == 2
    assert fsdp.count("max_reductions_in_flight") == 4 and "prefetch" in fsdp and "broadcast_bucket_mb" in fsdp


def _on_gpus(kind: str, uneven: bool) -> dict:
    """:func:`_train_with_unused` on NCCL (the one-rank layer on rank 0, except under FSDP, which needs every
    rank to run the same sharded layers); with ``uneven``, then rank 1 stops a step early. NCCL collectives
    never block the host, so the end-of-step message must catch it."""
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    model = WithUnused().to(device)
    model.use_extra = rank == 0 and kind != "fsdp"
    wrapped = _wrapped(kind, model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    grads_none = []
    for step in range(2 + (uneven and rank == 0)):
        x = _batch(step)[rank * 4 : (rank + 1) * 4].to(device)
        (wrapped(x).square().sum() / 4).backward()
        wrapped.finish_gradient_synchronization()
        grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    if uneven:  # rank 0 is still training; any collective here would pair with its step
        return {}
    params = wrapped.full_state_dict() if kind == "fsdp" else dict(model.named_parameters())
    return {"params": {n: p.detach().cpu() for n, p in params.items()}, "grads_none": grads_none}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kind", ["bucketed", "naive", "fsdp"])
def test_on_nccl_unused_parameters_keep_no_gradient(kind: str) -> None:
    ranks = spawn(_on_gpus, 2, kind, False, backend="nccl", timeout_s=300, collective_timeout_s=60)
    reference = _one_process_reference(None if kind == "fsdp" else {0}, 2)
    for result in ranks:
        assert result["grads_none"][1]["unused.weight"]
        assert result["grads_none"][1]["extra.weight"] == (kind == "fsdp")
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kind", ["bucketed", "fsdp"])
def test_on_nccl_uneven_steps_are_named(kind: str) -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_on_gpus, 2, kind, True, backend="nccl", timeout_s=300, collective_timeout_s=60)
    assert "uneven steps: rank 1 stopped after 2 steps (its function returned), rank 0 is at step 3" \
        in str(info.value)


def _nan_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(4, 8), nn.ReLU(), Linear(8, 2))
    wrapped = wrap(model, "bucketed", detect_nonfinite=False)
    for step in range(2):
        wrapped(_batch(step)[:4]).square().mean().backward()
        wrapped.finish_gradient_synchronization()
        with torch.no_grad():
            model[2].weight.fill_(float("nan"))  # NaN on every rank: the same, yet NaN != NaN


def test_nan_parameters_are_named_as_such_not_as_diverged_replicas() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_nan_parameters, 2, backend="gloo", timeout_s=60, collective_timeout_s=20)
    assert "parameter '2.weight' holds NaN/inf on rank(s) 0, 1 after 1 synchronizations" in str(info.value)
    assert "diverged" not in str(info.value)
