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


def test_parameters_and_gradients_are_views_of_flat_buffers() -> None:
    model = _model()
    opt = FlatAdamW(model.parameters(), **HP)
    flat = opt._flat[0]
    start = flat["p"].data_ptr()
    for p, offset in zip(model.parameters(), flat["offsets"]):
        assert p.data_ptr() == start + 4 * offset and p.grad.data_ptr() == flat["g"].data_ptr() + 4 * offset
    _train(model, opt, steps=2)
    assert all(p.data_ptr() == start + 4 * o for p, o in zip(model.parameters(), flat["offsets"]))


def test_gradients_freed_by_other_code_are_taken_back() -> None:
    ours, theirs = _model(), _model()
    opt_ours, opt_theirs = FlatAdamW(ours.parameters(), **HP), AdamW(theirs.parameters(), **HP)
    for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        model.zero_grad(set_to_none=True)  # the model frees the views; the next backward allocates afresh
        model(x).square().mean().backward()
        opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    assert ours[0].weight.grad.data_ptr() == opt_ours._flat[0]["g"].data_ptr()  # re-attached


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_drops_or_keeps_the_views_and_accumulation_works_either_way(set_to_none: bool) -> None:
    """set_to_none: autograd's fresh gradients, copied into the buffer at the step; otherwise the views stay
    and backward accumulates into them. Two backward passes per step sum their gradients in both cases."""
    ours, theirs = _model(), _model()
    opt_ours, opt_theirs = FlatAdamW(ours.parameters(), **HP), AdamW(theirs.parameters(), **HP)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(8, 12, generator=gen).to(DEVICE) for _ in range(6)]
    g = opt_ours._flat[0]["g"]
    for step in range(3):
        opt_ours.zero_grad(set_to_none=set_to_none)
        opt_theirs.zero_grad(set_to_none=True)
        if set_to_none:
            assert all(p.grad is None for p in ours.parameters())
        else:
            assert all(p.grad is not None and p.grad.data_ptr() >= g.data_ptr() for p in ours.parameters())
            assert not g.any()
        for x in batches[2 * step: 2 * step + 2]:  # two micro-batches per step
            ours(x).square().mean().backward()
            theirs(x).square().mean().backward()
        offsets = opt_ours._flat[0]["offsets"]
        views = [p.grad.data_ptr() == g.data_ptr() + 4 * o for p, o in zip(ours.parameters(), offsets)]
        assert all(views) is (not set_to_none)
        opt_ours.step()
        opt_theirs.step()
        assert ours[0].weight.grad.data_ptr() == g.data_ptr()  # a view again after the step
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_a_parameter_without_a_gradient_steps_on_zeros_not_on_a_stale_gradient() -> None:
    model = _model()
    opt = FlatAdamW(model.parameters(), **HP)
    _train(model, opt, steps=1)
    opt.zero_grad()
    model[2].weight.grad = torch.ones_like(model[2].weight)  # only this parameter has a gradient
    opt.step()
    offset = opt._flat[0]["offsets"][0]
    assert not opt._flat[0]["g"][offset:offset + model[0].weight.numel()].any()
    assert bool((model[2].weight.grad == 1).all())


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
