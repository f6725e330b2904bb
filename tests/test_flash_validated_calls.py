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


def test_the_signature_holds_strides_and_every_dtype(monkeypatch) -> None:
    q, k, v = _qkv((1, 2, 24, 16))
    _call(q, k, v)
    ran = []
    real = flash_triton.validate_attention_inputs

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        ran.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_triton, "validate_attention_inputs", counting)
    heads_view = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    assert heads_view[0].shape == q.shape and heads_view[0].stride() != q.stride()
    _call(*heads_view)  # same shape, other strides: a head view is checked (and keys its own plans)
    assert len(ran) == 1
    with pytest.raises(ValueError, match="one dtype"):
        _call(q, k, v.detach().half().requires_grad_())  # same shapes and strides, another dtype
    assert len(ran) == 2


def test_the_first_call_keys_its_plan_as_the_later_ones_do(monkeypatch) -> None:
    """The call that validates a signature hands it to the forward's plan key already, so a signature is
    recorded into a plan once, not once per key format."""
    seen = []
    real = flash_triton._forward

    def spy(q, k, v, is_causal, scale, signature=None):  # noqa: ANN001, ANN202
        seen.append(signature)
        return real(q, k, v, is_causal, scale, signature)

    monkeypatch.setattr(flash_triton, "_forward", spy)
    q, k, v = _qkv((1, 2, 24, 16))
    _call(q, k, v)
    _call(q, k, v)
    assert seen[0] is not None and seen[0] == seen[1]
    keys = [flash_triton._forward_key(q, k, v, True, 0.25, s) for s in seen]
    assert keys[0] == keys[1]


def test_the_backward_key_reads_the_saved_tensors_own_strides() -> None:
    """Saved-tensor hooks (``save_on_cpu``, offloading) can hand the backward other layouts than the forward
    saw; a plan bakes in every stride, so the backward's key must come from the tensors it launches with."""
    q, k, v = (t.detach() for t in _qkv((1, 2, 24, 16)))
    packed = torch.randn(1, 24, 3, 2, 16)  # q, k, v as head views of one projection's output
    pq, pk, pv = (packed[:, :, i].transpose(1, 2) for i in range(3))
    o, lse, do = torch.empty_like(q), torch.empty(1, 2, 24), torch.randn_like(q)
    contiguous = flash_triton._backward_key(do, q, k, v, o, lse, True, 0.25)
    views = flash_triton._backward_key(do, pq, pk, pv, o, lse, True, 0.25)
    assert contiguous != views
    assert contiguous == flash_triton._backward_key(do, q.clone(), k.clone(), v.clone(), o, lse, True, 0.25)


def test_a_remembered_cpu_call_still_needs_the_interpreter(monkeypatch) -> None:
    if DEVICE != "cpu":
        pytest.skip("the interpreter check concerns CPU tensors")
    q, k, v = _qkv((1, 2, 24, 16))
    _call(q, k, v)
    monkeypatch.setattr(flash_triton, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _call(q, k, v)
