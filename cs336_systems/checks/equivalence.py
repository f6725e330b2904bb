"""Checking a data-parallel wrapper against single-process training on the full batch.

Data parallelism is only correct if ``world_size`` replicas, each seeing ``1/world_size`` of every batch
and averaging gradients, take *exactly* the steps one process would take on the whole batch.
:func:`train_and_compare` runs both side by side on a toy model and reports how far apart they end up;
the tests, the ``naive_ddp_benchmark --model toy`` check and the notebooks all use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.checks.toy_models import make_toy_batch, make_toy_model
from cs336_systems.distributed.grad_sync import shard_batch


class SGDMomentum:
    """SGD with momentum (``v ← μ v + g``, ``p ← p − lr v``, as ``torch.optim.SGD``), written out.

    Plain SGD exposes gradient-*scale* mistakes (summing instead of averaging) that Adam's normalisation
    would hide. It is spelled out rather than taken from ``torch.optim`` because constructing a torch
    optimizer imports ``torch._dynamo``, which costs every freshly spawned CPU worker several seconds.
    """

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9):
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        self.velocity = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, v in zip(self.params, self.velocity):
            if p.grad is not None:
                v.mul_(self.momentum).add_(p.grad)
                p.sub_(self.lr * v)


def state_vector(model: nn.Module) -> torch.Tensor:
    """All parameters (trainable and frozen) and buffers, flattened and concatenated."""
    return torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])


def _finish(model: Any, optimizer: Any) -> None:
    model.finish_gradient_synchronization()


def train_and_compare(
    make_wrapper: Callable[[nn.Module], Any],
    kind: str = "toy",
    *,
    steps: int = 4,
    global_batch: int = 8,
    accumulate: int = 1,
    seed: int = 1234,
    after_backward: Callable[[Any, Any], None] = _finish,
    on_batch_start: Callable[[Any, Any], None] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Train ``make_wrapper(replica)`` on this rank's shards and a single-process reference on the full
    batches, with identical SGD-with-momentum steps; call on every rank of an initialised group.

    Rank ``r`` builds its replica from ``seed + r`` (so the wrapper's broadcast from rank 0 is tested);
    the reference uses ``seed``. With ``accumulate > 1`` each rank splits its shard into micro-batches,
    backpropagating all but the last inside ``no_sync()``. ``device`` must suit the process group's
    backend (CUDA tensors for NCCL).

    Returns ``init_diff`` (replica vs reference right after wrapping, parameters and buffers),
    ``final_diff`` (after training), ``moved`` (how far training moved the reference), ``grad_dtypes``
    and ``final`` (this replica's final state, to compare across ranks).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if global_batch % (world_size * accumulate):
        raise ValueError(f"global batch {global_batch} must divide by world size x accumulate = {world_size * accumulate}")
    reference = make_toy_model(kind, seed=seed).to(device)
    initial = state_vector(reference)
    ddp = make_wrapper(make_toy_model(kind, seed=seed + rank).to(device))
    init_diff = (state_vector(ddp.module) - initial).abs().max().item()

    opt_ref, opt = SGDMomentum(reference.parameters()), SGDMomentum(ddp.parameters())
    grad_dtypes: set[str] = set()
    for step in range(steps):
        x, y = (t.to(device) for t in make_toy_batch(global_batch, seed=step))
        opt_ref.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt_ref.step()

        if on_batch_start is not None:
            on_batch_start(ddp, opt)
        opt.zero_grad()
        micro = zip(shard_batch(x, rank, world_size).chunk(accumulate), shard_batch(y, rank, world_size).chunk(accumulate))
        for i, (mx, my) in enumerate(micro):
            if i < accumulate - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(mx), my) / accumulate).backward()
                    after_backward(ddp, opt)  # a no-op inside no_sync: gradients stay local
            else:
                (F.mse_loss(ddp(mx), my) / accumulate).backward()
        after_backward(ddp, opt)
        grad_dtypes |= {str(p.grad.dtype) for p in ddp.parameters() if p.grad is not None}
        opt.step()

    return _comparison(ddp.module, reference, initial, init_diff, grad_dtypes)


def _comparison(replica: nn.Module, reference: nn.Module, initial: torch.Tensor, init_diff: float,
                grad_dtypes: set[str]) -> dict[str, Any]:
    """The report both training checks return (see :func:`train_and_compare`)."""
    final = state_vector(replica)
    return {
        "init_diff": init_diff,
        "final_diff": (final - state_vector(reference)).abs().max().item(),
        "moved": (state_vector(reference) - initial).abs().max().item(),
        "grad_dtypes": sorted(grad_dtypes),
        "final": final.cpu(),
    }


def train_captured_and_compare(
    make_wrapper: Callable[[nn.Module], Any],
    kind: str = "toy",
    *,
    steps: int = 4,
    global_batch: int = 8,
    warmup: int = 11,
    seed: int = 1234,
    device: torch.device | str = "cuda",
) -> dict[str, Any]:
    """:func:`train_and_compare` with the wrapper's training step captured in a CUDA graph
    (:class:`cs336_systems.cuda_graphs.CapturedStep`) and replayed; call on every rank of an NCCL group.

    The captured step reads this rank's shard from static tensors. Its ``warmup`` eager steps (before
    capture) train on batch 0, and each replay trains on the next batch copied into the static
    tensors; the reference takes the same steps eagerly on the full batches. The wrapper is built on
    the capture's side stream, as torch DDP requires. Returns the same keys as :func:`train_and_compare`.
    """
    from cs336_systems.cuda_graphs import CapturedStep, side_stream

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} must divide by the world size {world_size}")
    reference = make_toy_model(kind, seed=seed).to(device)
    initial = state_vector(reference)
    with side_stream(device):
        ddp = make_wrapper(make_toy_model(kind, seed=seed + rank).to(device))
    init_diff = (state_vector(ddp.module) - initial).abs().max().item()
    opt_ref, opt = SGDMomentum(reference.parameters()), SGDMomentum(ddp.parameters())
    sync = getattr(ddp, "finish_gradient_synchronization", lambda: None)  # torch DDP syncs inside backward

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.to(device) for t in make_toy_batch(global_batch, seed=step))  # type: ignore[return-value]

    x_full, y_full = batch(0)
    x, y = shard_batch(x_full, rank, world_size).clone(), shard_batch(y_full, rank, world_size).clone()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        sync()
        opt.step()
        return loss

    def reference_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt_ref.zero_grad()
        F.mse_loss(reference(xb), yb).backward()
        opt_ref.step()

    captured = CapturedStep(step, device, warmup=warmup)
    for _ in range(warmup):
        reference_step(x_full, y_full)
    for s in range(1, steps + 1):
        xb, yb = batch(s)
        x.copy_(shard_batch(xb, rank, world_size))
        y.copy_(shard_batch(yb, rank, world_size))
        captured()
        reference_step(xb, yb)
    torch.cuda.synchronize(device)
    result = _comparison(ddp.module, reference, initial, init_diff,
                         {str(p.grad.dtype) for p in ddp.parameters() if p.grad is not None})
    captured.reset()
    return result
