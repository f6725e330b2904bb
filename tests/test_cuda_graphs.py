"""Captured training steps (``cs336_systems.cuda_graphs``) and the DDP benchmark's ``cuda_graph`` variants.

Without a GPU only the argument checks and the benchmark plumbing run; the captured-training checks
need one GPU (single process) or two (every DDP wrapper, torch DDP included, on an NCCL group).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cs336_systems import cuda_graphs
from cs336_systems.benchmarking import ddp_steps as benchmark
from cs336_systems.checks.equivalence import SGDMomentum, state_vector
from cs336_systems.checks.toy_models import make_toy_batch, make_toy_model


def test_capture_needs_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_graphs.CapturedStep(lambda: None)
    with pytest.raises(ValueError, match="CUDA device"), cuda_graphs.side_stream():
        pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="got cpu"):
        cuda_graphs.CapturedStep(lambda: None, "cpu")
    with pytest.raises(ValueError, match="warmup"):
        cuda_graphs.CapturedStep(lambda: None, "cuda", warmup=0)
    with pytest.raises(ValueError, match="callable"):
        cuda_graphs.CapturedStep(None)  # type: ignore[arg-type]


def test_benchmark_graph_variants_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = benchmark.DDPBenchConfig(modes=["single", "torch", "bucketed"], cuda_graph=[False, True])
    labels = [v.label for v in benchmark.expand_variants(cfg)]
    assert labels == ["single", "torch", "bucketed (25MB)",
                      "single (CUDA graph)", "torch (CUDA graph)", "bucketed (25MB, CUDA graph)"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda_graph needs CUDA"):
        cfg.validate()
    benchmark.DDPBenchConfig(modes=["single", "bucketed"]).validate()  # eager alone is fine on CPU

    parser = argparse.ArgumentParser()
    benchmark.add_run_arguments(parser, modes_default=["single", "bucketed"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CS336_SMOKE", "1")
    (parsed,) = benchmark.configs_from_args(parser.parse_args(["--cuda-graph", "both"]))
    assert parsed.cuda_graph == [False, True]
    (parsed,) = benchmark.configs_from_args(parser.parse_args([]))
    assert parsed.cuda_graph == [False]


def _eager_and_captured(steps: int, warmup: int) -> tuple[torch.Tensor, torch.Tensor, list[float], list[float]]:
    """The same SGD training, eager and captured-then-replayed, from the same initial weights."""
    device = torch.device("cuda")
    batches = [tuple(t.to(device) for t in make_toy_batch(8, seed=s)) for s in range(steps + 1)]
    eager, graphed = (make_toy_model("tied", seed=0).to(device) for _ in range(2))
    opt_eager, opt_graphed = SGDMomentum(eager.parameters()), SGDMomentum(graphed.parameters())
    eager_losses = []
    for s in [0] * warmup + list(range(1, steps + 1)):
        opt_eager.zero_grad()
        loss = F.mse_loss(eager(batches[s][0]), batches[s][1])
        loss.backward()
        opt_eager.step()
        eager_losses.append(loss.item())
    x, y = batches[0][0].clone(), batches[0][1].clone()

    def step() -> torch.Tensor:
        opt_graphed.zero_grad()
        loss = F.mse_loss(graphed(x), y)
        loss.backward()
        opt_graphed.step()
        return loss

    captured = cuda_graphs.CapturedStep(step, device, warmup=warmup)
    graphed_losses = []
    for s in range(1, steps + 1):
        x.copy_(batches[s][0])
        y.copy_(batches[s][1])
        graphed_losses.append(captured().item())
    return state_vector(eager), state_vector(graphed), eager_losses[warmup:], graphed_losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_training_matches_eager() -> None:
    eager, graphed, eager_losses, graphed_losses = _eager_and_captured(steps=5, warmup=3)
    assert (eager - graphed).abs().max().item() < 1e-5
    assert graphed_losses == pytest.approx(eager_losses, rel=1e-5)
    assert len(set(graphed_losses)) == len(graphed_losses)  # replays read the new batches


# --------------------------------------------------------------------------------------------------
# Every DDP wrapper, captured on a 2-rank NCCL group
# --------------------------------------------------------------------------------------------------

SMALL_BUCKETS_MB = 450 / 2**20  # toy model: three buckets, one of them shared by two parameters


def _torch_ddp(module: torch.nn.Module) -> torch.nn.Module:
    from cs336_systems.distributed.launch import current_context

    return torch.nn.parallel.DistributedDataParallel(module, device_ids=[current_context().device.index])


def _captured_cases() -> dict[str, Any]:
    from cs336_systems.distributed.ddp_bucketed import DDPBucketed
    from cs336_systems.distributed.ddp_flat import DataParallelFlat
    from cs336_systems.distributed.ddp_overlap import DDPIndividualParameters
    from cs336_systems.checks.equivalence import train_captured_and_compare
    from cs336_systems.distributed.launch import current_context

    device = current_context().device
    wrappers = {
        "bucketed_copies": functools.partial(DDPBucketed, bucket_size_mb=SMALL_BUCKETS_MB),
        "bucketed_views": functools.partial(DDPBucketed, bucket_size_mb=SMALL_BUCKETS_MB, gradient_as_bucket_view=True),
        "bucketed_bf16_wire": functools.partial(DDPBucketed, bucket_size_mb=SMALL_BUCKETS_MB, comm_dtype=torch.bfloat16),
        "flat_views": functools.partial(DataParallelFlat, gradient_as_bucket_view=True),
        "individual": DDPIndividualParameters,
        "torch_ddp": _torch_ddp,
    }
    out = {}
    for name, make in wrappers.items():
        res = train_captured_and_compare(make, "tied", steps=4, global_batch=8, device=device)
        out[name] = {k: res[k] for k in ("init_diff", "final_diff", "moved")}
    return out


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_every_ddp_wrapper_trains_correctly_when_captured() -> None:
    from cs336_systems.distributed.launch import spawn

    results = spawn(_captured_cases, 2, backend="nccl")
    for rank_result in results:
        for name, r in rank_result.items():
            assert r["init_diff"] == 0.0, name
            assert r["moved"] > 1e-3, name
            tol = 2e-2 if "bf16" in name else 1e-5
            assert r["final_diff"] < tol, (name, r)


def _fsdp_eager_and_captured() -> dict[str, float]:
    """Our FSDP trained eagerly and, from the same weights, captured in a CUDA graph and replayed on the same
    batches (the tiny LM, this rank's sequences): the largest difference of the gathered full weights after the
    steps, per variant, and how far training moved them."""
    from cs336_basics.model import TransformerBlock
    from cs336_systems.benchmarking.training_memory import BenchConfig, random_batch
    from cs336_systems.configs import build_model
    from cs336_systems.distributed.fsdp import FSDP
    from cs336_systems.distributed.launch import current_context

    ctx = current_context()
    device = ctx.device
    mcfg = BenchConfig(model="tiny", global_batch=4, context_length=32, warmup=1, steps=1).model_config()
    batches = [random_batch(mcfg, 2, device, seed=10 * s + ctx.rank) for s in range(5)]
    out = {}
    for name, dtype, units, fused in (("fp32", None, (), False), ("bf16", torch.bfloat16, (), False),
                                      ("bf16_fused", torch.bfloat16, (), True),
                                      ("bf16_per_block_fused", torch.bfloat16, (TransformerBlock,), True)):
        models, optimizers = [], []
        for _ in range(2):
            torch.manual_seed(0)
            with cuda_graphs.side_stream(device):  # the capture's rule: built and first run off the default stream
                models.append(FSDP(build_model(mcfg, device=device), compute_dtype=dtype, gather_units=units))
            optimizers.append(torch.optim.AdamW(models[-1].parameters(), lr=1e-2, capturable=True, fused=fused))
        initial = {k: v.clone() for k, v in models[0].full_state_dict().items()}
        x, y = (t.clone() for t in batches[0])

        def step(model: FSDP, optimizer: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), yb.reshape(-1)).backward()
            model.finish_gradient_synchronization()
            optimizer.step()

        captured = cuda_graphs.CapturedStep(lambda: step(models[1], optimizers[1], x, y), device, warmup=3)
        with cuda_graphs.side_stream(device):
            for xb, yb in [batches[0]] * 3 + batches[1:]:
                step(models[0], optimizers[0], xb, yb)
        for xb, yb in batches[1:]:
            x.copy_(xb)
            y.copy_(yb)
            captured()
        torch.cuda.synchronize(device)
        eager, graphed = models[0].full_state_dict(), models[1].full_state_dict()
        out[name] = max((eager[k].float() - graphed[k].float()).abs().max().item() for k in eager)
        out[name + "_moved"] = max((eager[k].float() - initial[k].float()).abs().max().item() for k in eager)
        captured.reset()
    return out


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_our_fsdp_step_trains_the_same_when_captured() -> None:
    """A captured FSDP step replays the gathers, reduce-scatters and update of the eager one: after the same
    batches the full weights equal the eager run's: in fp32; with bf16 compute; with torch's fused AdamW as well (the
    step §3.1 captures); and with that and one gather per Transformer block."""
    from cs336_systems.distributed.launch import spawn

    for rank_result in spawn(_fsdp_eager_and_captured, 2, backend="nccl"):
        for name in ("fp32", "bf16", "bf16_fused", "bf16_per_block_fused"):
            assert rank_result[name + "_moved"] > 1e-3, rank_result  # training changed the weights
            assert rank_result[name] <= 1e-6, rank_result
