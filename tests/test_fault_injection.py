"""Fault injection on 2 gloo ranks: a raise, an ``os._exit``, a SIGKILL and a hang on rank 1, at forward,
backward or the optimizer step, under DDP and FSDP. Every case must end within a bounded time with a
:class:`WorkerError` that names the rank that failed first and how — never blame the survivor, never hang.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Linear
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import WorkerError, spawn

TIMEOUT_S = 3.0  # collective timeout: how long a survivor waits for a hung peer
LIMIT_S = 60.0  # the whole run's limit: far above start-up on a loaded two-core machine


def _inject(fault: str) -> None:
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "exit":
        os._exit(3)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        time.sleep(3600)


def _train_with_fault(wrapper: str, fault: str, phase: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(8, 16), nn.ReLU(), Linear(16, 4))
    wrapped = DDPBucketed(model, 0.0001) if wrapper == "ddp" else FSDP(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    faulty = dist.get_rank() == 1
    for step in range(3):
        x = torch.randn(4, 8)
        if faulty and step == 1 and phase == "forward":
            _inject(fault)
        out = wrapped(x)
        if faulty and step == 1 and phase == "backward":
            out.register_hook(lambda grad: _inject(fault))
        out.square().mean().backward()
        wrapped.finish_gradient_synchronization()
        if faulty and step == 1 and phase == "step":
            _inject(fault)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


EXPECTED = {
    "raise": "RuntimeError: injected fault",
    "exit": "exited with code 3",
    "sigkill": "killed by SIGKILL — often the out-of-memory killer",
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
@pytest.mark.parametrize("fault", ["raise", "exit", "sigkill", "hang"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_the_failing_rank_and_its_cause_are_reported(wrapper: str, fault: str, phase: str) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(_train_with_fault, 2, wrapper, fault, phase, backend="gloo", timeout_s=LIMIT_S,
              collective_timeout_s=TIMEOUT_S, grace_s=1.0)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < LIMIT_S, f"took {elapsed:.1f} s"
    if fault == "hang":
        # The hung rank never fails by itself: its peer times out in the next collective, and the report
        # says so and points at the rank that never arrived.
        assert err.rank == 0 and "timed out after 3 s" in err.cause, str(err)
        assert "stopped by the launcher" in err.outcomes[1]
        assert "never reached the collective" in str(err)
    else:
        assert err.rank == 1, str(err)
        assert EXPECTED[fault] in err.cause, str(err)
        assert str(err).startswith(f"rank 1 of 2 failed first: {err.cause}")


def _healthy() -> int:
    return dist.get_rank()


def test_a_healthy_run_is_not_reported() -> None:
    assert spawn(_healthy, 2, backend="gloo", timeout_s=LIMIT_S, collective_timeout_s=TIMEOUT_S) == [0, 1]
