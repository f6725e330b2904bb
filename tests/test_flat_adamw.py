"""FlatAdamW against cs336_basics' AdamW and torch.optim.AdamW; its kernel runs under Triton's interpreter."""

from __future__ import annotations

import io
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from cs336_basics.optimizer import AdamW

from cs336_systems.flat_adamw import FlatAdamW

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.GELU(), torch.nn.Linear(40, 7)).to(DEVICE)


def _groups(model: torch.nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 1e-3}]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen).to(DEVICE)
        y = torch.randn(16, 7, generator=gen).to(DEVICE)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("path", ["kernel", "torch ops"])
@pytest.mark.parametrize("reference", [AdamW, torch.optim.AdamW])
def test_matches_per_parameter_adamw(reference, path, monkeypatch) -> None:
    if path == "torch ops":
        if DEVICE == "cuda":
            pytest.skip("CUDA tensors always take the kernel")
        from cs336_systems import flat_adamw

        monkeypatch.setattr(flat_adamw, "_interpreting", lambda: False)  # CPU without the interpreter
    ours, theirs = _model(), _model()
    _train(ours, FlatAdamW(_groups(ours), **HP), steps=6)
    _train(theirs, reference(_groups(theirs), **HP), steps=6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_parameters_are_views_of_flat_buffers_and_gradients_stay_autograds() -> None:
    model = _model()
    opt = FlatAdamW(model.parameters(), **HP)
    flat = opt._flat[0]
    start = flat["p"].data_ptr()
    assert all(p.data_ptr() == start + 4 * o for p, o in zip(model.parameters(), flat["offsets"]))
    assert all(o % 16 == 0 for o in flat["offsets"])  # the kernel's vectorization hint relies on it
    assert all(p.grad is None for p in model.parameters()) and "g" not in flat  # no buffer held between steps
    _train(model, opt, steps=2)
    assert all(p.data_ptr() == start + 4 * o for p, o in zip(model.parameters(), flat["offsets"]))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_micro_batches_accumulate_however_the_gradients_are_zeroed(set_to_none: bool) -> None:
    ours, theirs = _model(), _model()
    opt_ours, opt_theirs = FlatAdamW(ours.parameters(), **HP), AdamW(theirs.parameters(), **HP)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(8, 12, generator=gen).to(DEVICE) for _ in range(6)]
    for step in range(3):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=set_to_none)
            for x in batches[2 * step: 2 * step + 2]:  # two micro-batches per step
                model(x).square().mean().backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_the_gradient_table_follows_the_gradients_addresses() -> None:
    model = _model()
    opt = FlatAdamW(model.parameters(), **HP)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    model(x).square().mean().backward()
    opt.step()
    first = opt._flat[0]["grad_ptrs"]
    assert first[0] == tuple(p.grad.data_ptr() for p in model.parameters())
    opt.zero_grad(set_to_none=False)  # same tensors, same addresses: the table is reused
    model(x).square().mean().backward()
    opt.step()
    assert opt._flat[0]["grad_ptrs"] is first
    for p in model.parameters():  # new tensors elsewhere: the table is rebuilt
        p.grad = p.grad.clone() + 1
    opt.step()
    assert opt._flat[0]["grad_ptrs"][0] == tuple(p.grad.data_ptr() for p in model.parameters()) != first[0]


def test_a_parameter_without_a_gradient_steps_as_with_a_zero_one() -> None:
    missing, zero = _model(), _model()
    opts = [FlatAdamW(m.parameters(), **HP) for m in (missing, zero)]
    for model, opt in zip((missing, zero), opts):
        _train(model, opt, steps=2)  # moments that a zero gradient still moves the weights with
        opt.zero_grad()
        model[2].weight.grad = torch.ones_like(model[2].weight)
        if model is zero:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
    for a, b in zip(missing.parameters(), zero.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_round_trip_continues_identically() -> None:
    straight, resumed = _model(), _model()
    opt = FlatAdamW(straight.parameters(), **HP)
    _train(straight, opt, steps=3)
    buf = io.BytesIO()
    torch.save({"model": straight.state_dict(), "opt": opt.state_dict()}, buf)
    _train(straight, opt, steps=2, seed=5)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed.load_state_dict(saved["model"])
    opt2 = FlatAdamW(resumed.parameters(), **HP)
    opt2.load_state_dict(saved["opt"])
    assert opt2._flat[0]["step"] == 3
    assert opt2.state[resumed[0].weight]["exp_avg"].data_ptr() == opt2._flat[0]["m"].data_ptr()
    _train(resumed, opt2, steps=2, seed=5)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_in_one_line() -> None:
    with pytest.raises(ValueError, match="needs float32 parameters; group 0 has torch.float16"):
        FlatAdamW(torch.nn.Linear(2, 2).half().parameters())
    with pytest.raises(ValueError, match="Invalid betas"):
        FlatAdamW(torch.nn.Linear(2, 2).parameters(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FlatAdamW(torch.nn.Linear(2, 2).parameters(), lr=-1)
