"""The autograd function's validated signatures: a call whose inputs were checked before skips the checks.

On CPU the kernels run in Triton's interpreter (tiny shapes); on a GPU the same calls also go through the
launch plans, whose keys the remembered signature feeds.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_triton import VALIDATED, FlashAttentionTriton, ValidatedCalls, validated_calls_off

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3)]


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: object = True) -> list[torch.Tensor]:
    o = FlashAttentionTriton.apply(q, k, v, causal)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))]


@pytest.fixture(autouse=True)
def _fresh() -> None:
    VALIDATED.clear()


def test_a_seen_signature_skips_the_checks_and_gives_the_same_numbers(monkeypatch) -> None:
    q, k, v = _qkv((1, 2, 24, 16))
    checked = _call(q, k, v)  # validated, then remembered
    assert len(VALIDATED) == 1

    def no_checks(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the checks ran for a signature validated before")

    monkeypatch.setattr(flash_triton, "validate_attention_inputs", no_checks)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))  # other tensors, same signature
    remembered = _call(q2, k2, v2)
    for a, b in zip(checked, remembered, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with validated_calls_off(), pytest.raises(AssertionError, match="the checks ran"):
        _call(q2, k2, v2)  # the A/B switch sends the call through the checks again


def test_bad_calls_raise_every_time_and_are_never_remembered() -> None:
    q, k, v = _qkv((1, 2, 24, 16))
    _call(q, k, v, True)
    for _ in range(2):
        with pytest.raises(ValueError, match="is_causal must be a bool"):
            _call(q, k, v, 1)  # equal to True and hashed alike, but not a bool
    short_v = v.detach()[:, :, :20].requires_grad_()
    for _ in range(2):
        with pytest.raises(ValueError, match="same number of keys"):
            _call(q, k, short_v)
    assert len(VALIDATED) == 1


def test_calls_that_need_reshaping_are_not_remembered() -> None:
    _call(*_qkv((2, 24, 16)))  # 3-D: viewed as one head on every call
    q, k, v = _qkv((1, 2, 16, 24))
    _call(*(t.transpose(-1, -2) for t in (q, k, v)))  # head dim not contiguous: copied on every call
    _call(*_qkv((1, 2, 24, 7)))  # 7 columns of float32 are no whole 16-byte rows: padded on every call
    assert len(VALIDATED) == 0
    _call(*_qkv((1, 2, 24, 16)))
    assert len(VALIDATED) == 1


def test_validated_calls_are_bounded_and_least_recent_go_first() -> None:
    cache = ValidatedCalls(max_entries=2)
    calls = [_qkv((1, 2, n, 16)) for n in (8, 16, 24)]
    cache.add(*calls[0], True)
    cache.add(*calls[1], True)
    assert cache.lookup(*calls[0], True) is not None  # now the most recent
    cache.add(*calls[2], True)
    assert len(cache) == 2
    assert cache.lookup(*calls[1], True) is None and cache.lookup(*calls[0], True) is not None
    assert cache.lookup(*calls[0], False) is None  # the mask is part of the signature
    with pytest.raises(ValueError, match="max_entries"):
        ValidatedCalls(max_entries=0)
