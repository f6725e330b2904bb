"""Every data-parallel strategy must train exactly like single-process full-batch training.

All distributed checks run inside ONE spawned 2-rank gloo group (spawning costs seconds on CPU); the
module-scoped fixture collects each case's measurements and the tests below assert on them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.distributed import collectives, grad_sync
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_flat import DataParallelFlat
from cs336_systems.distributed.ddp_naive import DataParallelNaive
from cs336_systems.distributed.ddp_overlap import DDPIndividualParameters
from cs336_systems.checks.equivalence import train_and_compare
from cs336_systems.distributed.launch import spawn
from cs336_systems.checks.toy_models import make_toy_batch, make_toy_model
from tests import adapters

WORLD_SIZE = 2
GLOBAL_BATCH = 8
STEPS = 4
SEED = 1234  # rank r builds its replica from SEED + r; rank 0's init is the reference

WRAPPERS = {
    "naive": DataParallelNaive,
    "flat": DataParallelFlat,
    "individual": DDPIndividualParameters,
    "bucketed_one": functools.partial(DDPBucketed, bucket_size_mb=None),
    "bucketed_small": functools.partial(DDPBucketed, bucket_size_mb=450 / 2**20),  # three buckets
    "bucketed_tiny": functools.partial(DDPBucketed, bucket_size_mb=1 / 2**20),  # one per parameter
    "adapter_individual": adapters.get_ddp_individual_parameters,
    "adapter_bucketed": functools.partial(adapters.get_ddp_bucketed, bucket_size_mb=450 / 2**20),
    "adapter_ddp": adapters.get_ddp,
}
AFTER_BACKWARD = {
    "adapter_individual": adapters.ddp_individual_parameters_on_after_backward,
    "adapter_bucketed": adapters.ddp_bucketed_on_after_backward,
    "adapter_ddp": adapters.ddp_on_after_backward,
}
MODELS = ("toy", "tied", "frozen_buffer")


def _train(wrapper_name: str, kind: str, *, accumulate: int = 1, comm_dtype: torch.dtype | None = None) -> dict[str, Any]:
    kwargs = {"comm_dtype": comm_dtype} if comm_dtype is not None else {}
    return train_and_compare(
        lambda m: WRAPPERS[wrapper_name](m, **kwargs),
        kind,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        accumulate=accumulate,
        seed=SEED,
        after_backward=AFTER_BACKWARD.get(wrapper_name, lambda m, o: m.finish_gradient_synchronization()),
        on_batch_start=adapters.ddp_bucketed_on_train_batch_start if wrapper_name == "adapter_bucketed" else None,
    )


def _double_backward_is_an_error() -> dict[str, bool]:
    """Two backward passes without synchronising (and outside no_sync) must raise, not double-count;
    ``on_train_batch_start`` must then recover a clean state."""
    out = {}
    for name in ("individual", "bucketed_small"):
        ddp = WRAPPERS[name](make_toy_model("toy", seed=SEED))
        x, y = make_toy_batch(4, seed=0)
        F.mse_loss(ddp(x), y).backward()
        try:
            F.mse_loss(ddp(x), y).backward()
            out[name] = False
        except RuntimeError as e:
            out[name] = "ready twice" in str(e)
        ddp.on_train_batch_start()
        ddp.module.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        out[name + "_recovered"] = all(p.grad is not None for p in ddp.parameters())
    return out


def _all_checks() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in MODELS:
        for name in WRAPPERS:
            results[f"{name}/{kind}"] = _train(name, kind)
    for name in ("flat", "individual", "bucketed_small", "naive"):
        results[f"{name}/toy/accumulate"] = _train(name, "toy", accumulate=2)
    for name in ("bucketed_small", "individual", "flat"):
        results[f"{name}/tied/bf16"] = _train(name, "tied", comm_dtype=torch.bfloat16)
    results["bucketed_small/toy/fp16"] = _train("bucketed_small", "toy", comm_dtype=torch.float16)
    results["double_backward"] = _double_backward_is_an_error()
    ddp = DDPBucketed(make_toy_model("toy"), bucket_size_mb=450 / 2**20)
    results["bucket_summary"] = ddp.bucket_summary()
    return results


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, Any]]:
    return spawn(_all_checks, WORLD_SIZE, backend="gloo", timeout_s=120)


FP32_CASES = [f"{n}/{k}" for k in MODELS for n in WRAPPERS] + [
    f"{n}/toy/accumulate" for n in ("flat", "individual", "bucketed_small", "naive")
]


@pytest.mark.slow
@pytest.mark.parametrize("case", FP32_CASES)
def test_matches_single_process_training(rank_results: list[dict[str, Any]], case: str) -> None:
    for r in rank_results:
        res = r[case]
        assert res["init_diff"] == 0.0, "replicas must start from rank 0's parameters and buffers"
        assert res["moved"] > 1e-3, "training must actually change the parameters"
        assert res["final_diff"] < 1e-5, f"{case}: differs from single-process training by {res['final_diff']}"
        assert res["grad_dtypes"] == ["torch.float32"]
    torch.testing.assert_close(rank_results[0][case]["final"], rank_results[1][case]["final"], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["bucketed_small/tied/bf16", "individual/tied/bf16", "flat/tied/bf16", "bucketed_small/toy/fp16"])
def test_low_precision_communication_keeps_fp32_gradients(rank_results: list[dict[str, Any]], case: str) -> None:
    for r in rank_results:
        res = r[case]
        assert res["grad_dtypes"] == ["torch.float32"]
        assert 0 < res["final_diff"] < 2e-2, res["final_diff"]  # rounded on the wire, yet close
    torch.testing.assert_close(rank_results[0][case]["final"], rank_results[1][case]["final"], rtol=0, atol=0)


def test_backward_twice_without_sync_raises(rank_results: list[dict[str, Any]]) -> None:
    for r in rank_results:
        assert all(r["double_backward"].values()), r["double_backward"]


def test_bucket_summary_in_reverse_order(rank_results: list[dict[str, Any]]) -> None:
    summary = rank_results[0]["bucket_summary"]
    assert [b["params"] for b in summary] == [["fc2.weight"], ["ln.bias", "ln.weight"], ["fc1.weight"]]


# ---------------------------------------------------------------------------------------------------
# Pure (no process group) checks
# ---------------------------------------------------------------------------------------------------


def test_size_capped_buckets_hand_checked() -> None:
    # ToyModel, reverse order: fc2 (50x10 = 2000 B), ln.bias (40 B), ln.weight (40 B), fc1 (10x10 = 400 B)
    model = make_toy_model("toy")
    params = grad_sync.trainable_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}

    def plan(cap_bytes: float | None) -> list[list[str]]:
        mb = None if cap_bytes is None else cap_bytes / 2**20
        return [[names[id(p)] for p in b] for b in grad_sync.size_capped_buckets(params, mb)]

    assert plan(None) == [["fc2.weight", "ln.bias", "ln.weight", "fc1.weight"]]
    assert plan(1000) == [["fc2.weight"], ["ln.bias", "ln.weight", "fc1.weight"]]  # 2000 B alone, then 480 B
    assert plan(450) == [["fc2.weight"], ["ln.bias", "ln.weight"], ["fc1.weight"]]
    assert plan(2080) == [["fc2.weight", "ln.bias", "ln.weight"], ["fc1.weight"]]
    assert plan(1) == [["fc2.weight"], ["ln.bias"], ["ln.weight"], ["fc1.weight"]]
    with pytest.raises(ValueError, match="bucket_size_mb must be a finite number of MiB > 0"):
        grad_sync.size_capped_buckets(params, 0)


def test_tied_and_frozen_parameters_counted_once() -> None:
    tied = make_toy_model("tied")
    params = grad_sync.trainable_parameters(tied)
    assert len(params) == len({id(p) for p in params}) == 5
    assert tied.fc4.weight is tied.fc1.weight
    frozen = make_toy_model("frozen_buffer")
    assert all(p.requires_grad for p in grad_sync.trainable_parameters(frozen))
    assert len(grad_sync.trainable_parameters(frozen)) == len(list(frozen.parameters())) - 1


def test_shard_batch_rejects_uneven_batches() -> None:
    x = torch.arange(10)
    assert grad_sync.shard_batch(x, 1, 2).tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="does not divide"):
        grad_sync.shard_batch(x, 0, 3)
    with pytest.raises(ValueError, match="invalid rank"):
        grad_sync.shard_batch(x, 2, 2)


def test_wrapping_without_process_group_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        DDPBucketed(make_toy_model("toy"), 1.0)
    with pytest.raises(ValueError, match="comm_dtype"):
        collectives.check_comm_dtype(torch.int8)


class _SyncingProcessGroup:
    """Stands in for NCCL, whose synchronous all-reduce (``asyncOp=False``) synchronises in C++ and returns
    no work handle; an asynchronous one returns a handle that records its ``wait``."""

    def __init__(self) -> None:
        self.waited = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not getattr(opts, "asyncOp", True):
            return None
        group = self

        class _Work:
            def wait(self) -> None:
                group.waited += 1

        return _Work()


def test_synchronous_all_reduce_without_a_work_handle() -> None:
    reduce = collectives.MeanAllReduce.__new__(collectives.MeanAllReduce)
    reduce.process_group = group = _SyncingProcessGroup()
    reduce._options = {a: type("Opts", (), {"asyncOp": a})() for a in (True, False)}
    reduce.post_divide = 1
    t = torch.ones(3)
    assert reduce(t, async_op=False).wait() is t and group.waited == 0
    reduce(t, async_op=True).wait()
    assert group.waited == 1


def test_a_bucket_size_is_checked_once_the_same_way_wherever_it_enters() -> None:
    """One check for every way a bucket size comes in (a strategy, the benchmark's config, the section): a
    finite number of MiB > 0, one line naming the parameter otherwise; True is not 1 MiB, '25' is not 25."""
    import torch.nn as nn

    from cs336_systems.benchmarking.ddp_steps import DDPBenchConfig
    from cs336_systems.distributed.ddp_bucketed import DDPBucketed
    from cs336_systems.distributed.grad_sync import bucket_size_mb_value, size_capped_buckets
    from cs336_systems.experiments import get

    assert bucket_size_mb_value(25) == 25.0 and bucket_size_mb_value(None) is None
    for bad in (True, "25", [1], float("inf"), float("nan"), 0, -1.0):
        with pytest.raises(ValueError, match=r"^bucket_size_mb must be a finite number of MiB > 0"):
            bucket_size_mb_value(bad)
        with pytest.raises(ValueError, match="bucket_size_mb must be"):
            DDPBucketed(nn.Linear(2, 2), bad)
        with pytest.raises(ValueError, match="bucket_size_mb must be"):
            size_capped_buckets(list(nn.Linear(2, 2).parameters()), bad)
    with pytest.raises(ValueError, match=r"^bucket_sizes_mb must be a finite number of MiB > 0, got 0"):
        DDPBenchConfig(preset="tiny", bucket_sizes_mb=[25.0, 0]).validate()
    with pytest.raises(ValueError, match=r"^ddp_bucketed.bucket_sizes_mb must be a finite number of MiB > 0, got -1"):
        get("ddp_bucketed").params("smoke", {"bucket_sizes_mb": [1.0, -1.0]})
