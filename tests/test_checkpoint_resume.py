"""Checkpoints: save with ``torch.save``, load in fresh processes, continue bit for bit.

Model under a DDP wrapper, a sharded AdamW with two parameter groups (decay / no decay) and a StepLR
schedule; 2 gloo ranks. Four steps in one run must equal two steps, a checkpoint, and two more steps in
a new set of processes, exactly. The negative control resumes without the optimizer and scheduler state
and must not match — otherwise the comparison could not tell a resume from a restart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.launch import spawn
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer


def _setup(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    ddp = DDPBucketed(model, 0.0001)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = ShardedOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                           torch.optim.AdamW, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return model, ddp, opt, sched


def _train(ddp, opt, sched, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        nn.functional.mse_loss(ddp(x[part]), y[part]).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _continuous() -> dict[str, torch.Tensor]:
    model, ddp, opt, sched = _setup(seed=0)
    _train(ddp, opt, sched, range(4))
    return _params(model)


def _save(path: str) -> None:
    model, ddp, opt, sched = _setup(seed=0)
    _train(ddp, opt, sched, range(2))
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)
    dist.barrier()


def _resume(path: str, restore_optimizer: bool) -> dict[str, torch.Tensor]:
    model, ddp, opt, sched = _setup(seed=1)  # another initialisation: everything must come from the file
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    if restore_optimizer:
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
    _train(ddp, opt, sched, range(2, 4))
    return _params(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, torch.Tensor]]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "step2.pt")
    spawn(_save, 2, path, backend="gloo", timeout_s=30)
    return {
        "continuous": spawn(_continuous, 2, backend="gloo", timeout_s=30),
        "resumed": spawn(_resume, 2, path, True, backend="gloo", timeout_s=30),
        "restarted": spawn(_resume, 2, path, False, backend="gloo", timeout_s=30),
    }


def test_resume_continues_bit_exactly(runs) -> None:
    for rank in (0, 1):
        for name, value in runs["continuous"][rank].items():
            assert torch.equal(runs["resumed"][rank][name], value), f"rank {rank} {name}"


def test_negative_control_without_optimizer_state_differs(runs) -> None:
    cont, restarted = runs["continuous"][0], runs["restarted"][0]
    assert any(not torch.equal(restarted[n], cont[n]) for n in cont)
