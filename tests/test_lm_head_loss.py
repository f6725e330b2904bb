"""The chunked LM head + cross-entropy against the plain ``F.cross_entropy(hidden @ Wᵀ)``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.lm_head_loss import LinearCrossEntropy, linear_cross_entropy


def _plain(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.t()).reshape(-1, weight.shape[0]), targets.reshape(-1))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_the_plain_loss_and_gradients(chunk: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 21))
    got = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    dh, dw = torch.autograd.grad(got * 3.0, (hidden, weight))
    want = _plain(hidden, weight, targets)
    eh, ew = torch.autograd.grad(want * 3.0, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, eh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, ew, rtol=1e-10, atol=1e-12)


def test_float32_and_bfloat16_autocast() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True) * 0.1
    weight = weight.detach().requires_grad_()
    targets = torch.randint(0, 100, (40,))
    got = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    torch.testing.assert_close(got, _plain(hidden, weight, targets), rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
        ref = F.cross_entropy((hidden @ weight.t()).float(), targets)
    torch.testing.assert_close(low, ref, rtol=2e-2, atol=2e-2)
    dh, dw = torch.autograd.grad(low, (hidden, weight))
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32 and torch.isfinite(dh).all()
    eh, ew = torch.autograd.grad(_plain(hidden, weight, targets), (hidden, weight))
    torch.testing.assert_close(dh, eh, rtol=5e-2, atol=5e-3)


def test_nothing_of_size_tokens_by_vocab_is_saved() -> None:
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 1000, (64,)), chunk_size=16)
    saved = loss.grad_fn.saved_tensors
    assert max(t.numel() for t in saved) == weight.numel()  # hidden, W, targets, one float per token
    assert isinstance(loss.grad_fn, LinearCrossEntropy._backward_cls)


def test_bad_input_in_one_line() -> None:
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="does not match weight's d_model 8"):
        linear_cross_entropy(torch.randn(4, 6), w, t)
    with pytest.raises(ValueError, match=r"targets of shape \(5,\) do not match"):
        linear_cross_entropy(h, w, torch.randint(0, 10, (5,)))
    with pytest.raises(ValueError, match="integer class indices"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, torch.randn(8), t)
