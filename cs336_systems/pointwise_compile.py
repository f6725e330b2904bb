"""Compile only the pointwise parts of a ``cs336_basics`` model: RMSNorm, the rotary embedding, SwiGLU's gate.

Why not the whole block: our FSDP gathers each block's weights from Python hooks and its checkpointing replays
segments from Python, so a compiled block breaks its graph at every hook. The pointwise parts are where eager
mode pays most for that freedom: each RMSNorm is a cast, the fused norm and a cast back in each direction, a
rotation is a dozen elementwise kernels forward and backward, and ``silu(a) * b`` materializes ``silu(a)``
for the backward. Inductor fuses each into one kernel per direction. The matmuls and attention stay eager,
where they already are single kernels.

Every block's norms share one compiled graph (Dynamo treats a module's parameters as inputs, so the modules
of one class differ only in their tensors), as do the blocks' gates; the model compiles three small graphs
however deep it is, a few seconds, instead of a graph per block.

    model = compile_pointwise(BasicsTransformerLM(...))   # in place; before wrapping it in FSDP

Under our FSDP a module's parameters are views of the gathered buffer, not leaves, and Dynamo reads ``.grad`` of
every tensor it wraps: tracing warns about it once per graph, which is harmless (``tests/test_fsdp.py`` trains
such a model against micro-batched training).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cs336_basics.model import RMSNorm, RotaryEmbedding, SwiGLU


def swiglu_gate(a: Tensor, b: Tensor) -> Tensor:
    """SwiGLU's elementwise part, ``SiLU(a) * b`` (``a = W1 x``, ``b = W3 x``)."""
    return F.silu(a) * b


def _gated_forward(gate: Callable[[Tensor, Tensor], Tensor]) -> Callable[[SwiGLU, Tensor], Tensor]:
    def forward(self: SwiGLU, x: Tensor) -> Tensor:
        return self.w2(gate(self.w1(x), self.w3(x)))

    return forward


def compile_pointwise(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile, in place, every :class:`RMSNorm` and :class:`RotaryEmbedding` of ``model`` and the gate of every
    :class:`SwiGLU` (its three projections stay eager modules, so hooks on them and their weights still see
    every call); returns the model. Parameters, state-dict keys and the modules' results are unchanged."""
    found = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, SwiGLU))]
    if not found:
        raise ValueError(f"compile_pointwise found no RMSNorm, RotaryEmbedding or SwiGLU in {type(model).__name__}")
    gate = torch.compile(swiglu_gate, backend=backend, dynamic=False)
    for module in found:
        if isinstance(module, SwiGLU):
            module.forward = types.MethodType(_gated_forward(gate), module)  # type: ignore[method-assign]
        else:
            module.compile(backend=backend, dynamic=False)
    return model


__all__ = ["compile_pointwise", "swiglu_gate"]
