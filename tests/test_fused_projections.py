"""Fused Q/K/V and W1/W3 projections: the same model, the same training, the same checkpoints."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in the interpreter on CPU (set before first launch)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_basics.model import BasicsTransformerLM, CausalMultiHeadSelfAttention, SwiGLU
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_systems.fused_projections import FusedQKVSelfAttention, FusedSwiGLU, fuse_projections


def _tiny(attention: str = "sdpa", dtype: torch.dtype = torch.float64, device: str = "cpu") -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48,
                               attention_impl=attention, dtype=dtype, device=device)


def test_fused_model_computes_and_trains_as_the_plain_one() -> None:
    plain = _tiny()
    fused = fuse_projections(copy.deepcopy(plain))
    assert all(isinstance(layer.attn, FusedQKVSelfAttention) and isinstance(layer.ffn, FusedSwiGLU)
               for layer in fused.layers)
    assert not any(isinstance(m, (CausalMultiHeadSelfAttention, SwiGLU)) for m in fused.modules())
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    assert len(list(fused.parameters())) == len(list(plain.parameters())) - 3 * len(plain.layers)
    x = torch.randint(0, 50, (3, 16))
    y = torch.randint(0, 50, (3, 16))
    opts = [AdamW(m.parameters(), lr=1e-2) for m in (plain, fused)]
    for _ in range(3):  # float64: the fused GEMMs agree with the separate ones to round-off, step after step
        losses = []
        for model, opt in zip((plain, fused), opts):
            opt.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
    grads = fused.layers[0].attn.qkv_proj.weight.grad.split(32)
    for name, g in zip(("q_proj", "k_proj", "v_proj"), grads):
        torch.testing.assert_close(g, getattr(plain.layers[0].attn, name).weight.grad)
    torch.testing.assert_close(fused.layers[1].ffn.w13.weight.grad.split(48)[1], plain.layers[1].ffn.w3.weight.grad)


def test_checkpoints_keep_the_unfused_names_both_ways() -> None:
    plain = _tiny(dtype=torch.float32)
    fused = fuse_projections(copy.deepcopy(plain))
    state = fused.state_dict()
    assert state.keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value), key
    other = _tiny(dtype=torch.float32)
    torch.nn.init.normal_(other.layers[1].attn.k_proj.weight)
    fused.load_state_dict(other.state_dict())  # an unfused checkpoint into the fused model, strict
    assert torch.equal(fused.layers[1].attn.qkv_proj.weight[32:64], other.layers[1].attn.k_proj.weight)
    plain.load_state_dict(fused.state_dict())  # and back
    assert torch.equal(plain.layers[1].attn.k_proj.weight, other.layers[1].attn.k_proj.weight)


def test_attention_switch_and_triton_kernels_take_the_strided_projections() -> None:
    """Q, K and V are column slices of one GEMM's output (not contiguous): the registered attention
    implementations take them as they are, and ``set_attention_impl`` still reaches every layer."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = _tiny("flash_triton", torch.float32, device)
    fused = fuse_projections(copy.deepcopy(plain))
    x = torch.randint(0, 50, (2, 16), device=device)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-4)
    fused.set_attention_impl("naive")
    assert {layer.attn.attention_impl for layer in fused.layers} == {"naive"}
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-4)


def test_bad_targets_fail_in_one_line() -> None:
    with pytest.raises(ValueError, match="Linear holds no CausalMultiHeadSelfAttention or SwiGLU"):
        fuse_projections(torch.nn.Linear(2, 2))
    model = _tiny()
    with pytest.raises(ValueError, match="pass the module that holds the SwiGLU"):
        fuse_projections(model.layers[0].ffn)
    fused = fuse_projections(model)
    assert fuse_projections(fused) is fused  # already fused: left alone
    assert isinstance(fused.layers[0].attn, FusedQKVSelfAttention)
