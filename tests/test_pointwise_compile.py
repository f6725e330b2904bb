"""Compiling a model's pointwise parts (RMSNorm, RoPE, SwiGLU's gate) and marking a checkpoint's recomputation."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.benchmarking.leaderboard_8b import StepOptions
from cs336_systems.checkpointing import RECOMPUTE_RANGE, checkpoint_layers
from cs336_systems.pointwise_compile import compile_pointwise

KW = dict(vocab_size=64, context_length=16, d_model=32, num_layers=3, num_heads=4, d_ff=48, rope_theta=10000.0)


def _twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain, compiled = BasicsTransformerLM(**KW), BasicsTransformerLM(**KW)
    compiled.load_state_dict(plain.state_dict())
    return plain, compiled


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).float().logsumexp(-1).sum()
    loss.backward()
    return loss


def test_pointwise_compiled_model_matches_eager_with_three_graphs_for_all_blocks() -> None:
    """The same loss and gradients as the eager model, and one graph each for the norms, the rotation and the
    gate, however many blocks share them (aot_eager: Dynamo's capture and AOT autograd without codegen;
    Inductor's kernels run in the GPU test)."""
    plain, compiled = _twins()
    torch._dynamo.reset()
    counters.clear()
    compile_pointwise(compiled, backend="aot_eager")
    x = torch.randint(0, KW["vocab_size"], (2, KW["context_length"]))
    torch.testing.assert_close(_loss(compiled, x), _loss(plain, x))
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert counters["stats"]["unique_graphs"] == 3
    assert sorted(compiled.state_dict()) == sorted(plain.state_dict())


def test_pointwise_compile_under_checkpointing_recomputes_the_same_gradients() -> None:
    plain, compiled = _twins()
    checkpoint_layers(compiled, [1])
    compile_pointwise(compiled, backend="aot_eager")
    x = torch.randint(0, KW["vocab_size"], (2, KW["context_length"]))
    torch.testing.assert_close(_loss(compiled, x), _loss(plain, x))
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_model_without_pointwise_modules_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="compile_pointwise found no RMSNorm, RotaryEmbedding or SwiGLU in Linear"):
        compile_pointwise(nn.Linear(2, 2))


def test_compile_and_compile_pointwise_are_exclusive() -> None:
    with pytest.raises(ValueError, match="choose one"):
        StepOptions(attention="sdpa", compile=True, compile_pointwise=True).check()
    assert not StepOptions(attention="sdpa", compile_pointwise=True).reference().compile_pointwise


def _annotations(model: nn.Module, x: torch.Tensor) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _loss(model, x)
    return [e.name for e in prof.events() if e.name == RECOMPUTE_RANGE]


@pytest.mark.parametrize("levels, sublayers", [([1], False), ([2, 1], False), ([], True)])
def test_recomputation_is_marked_in_the_backward_only(levels: list[int], sublayers: bool) -> None:
    """A checkpointed segment's replay in the backward runs in a ``recompute`` range (the time split's
    recomputation bucket); its first run in the forward does not."""
    torch.manual_seed(0)
    model = BasicsTransformerLM(**KW)
    x = torch.randint(0, KW["vocab_size"], (2, KW["context_length"]))
    assert _annotations(model, x) == []  # nothing checkpointed, nothing recomputed
    checkpoint_layers(model, levels, sublayers=sublayers)
    marked = _annotations(model, x)
    assert marked, "no recompute range in the backward"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)  # the forward alone
    assert not [e for e in prof.events() if e.name == RECOMPUTE_RANGE]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_pointwise_kernels_match_eager_on_gpu() -> None:
    plain, compiled = _twins()
    plain, compiled = plain.cuda().bfloat16(), compiled.cuda().bfloat16()
    compile_pointwise(compiled)
    x = torch.randint(0, KW["vocab_size"], (2, KW["context_length"]), device="cuda")
    torch.testing.assert_close(_loss(compiled, x), _loss(plain, x), rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=5e-2, atol=5e-2, msg=name)
