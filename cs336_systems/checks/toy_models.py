"""Small models for checking distributed training strategies against single-process training.

They are tiny on purpose (hundreds of parameters) so that a 2-rank gloo test runs in milliseconds, yet
each exercises a case a gradient-synchronisation strategy can get wrong:

- :class:`ToyModel` — the course's model: ``fc1 → relu → LayerNorm → fc2``; several parameter shapes,
  bias-free linears and LayerNorm's weight/bias.
- :class:`ToyModelWithTiedWeights` — one ``nn.Parameter`` used by two layers. ``module.parameters()``
  yields it once; its gradient is the sum of both uses and must be all-reduced exactly once.
- :class:`ToyModelWithFrozenParamAndBuffer` — a parameter with ``requires_grad=False`` (no gradient,
  no hook may be registered on it) and a registered buffer. Both are randomly initialised, so ranks
  that seed differently disagree until the wrapper broadcasts rank 0's state.

All models take ``(batch, in_features)`` inputs and return ``(batch, out_features)``.
"""

from __future__ import annotations

import torch
from torch import nn

TOY_IN_FEATURES = 10
TOY_OUT_FEATURES = 50


class ToyModel(nn.Module):
    """``fc1 (in→10, no bias) → ReLU → LayerNorm(10) → fc2 (10→out, no bias)``."""

    def __init__(self, in_features: int = TOY_IN_FEATURES, out_features: int = TOY_OUT_FEATURES):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


class ToyModelWithTiedWeights(nn.Module):
    """The toy model with an expansion ``fc2 (10→50)`` whose weight is reused, transposed, by a
    projection back ``50→10`` (``fc3``), like a tied embedding / LM head.

    ``fc3`` holds no parameter of its own: ``F.linear(x, fc2.weight.T)``. The shared weight therefore
    appears once in ``parameters()`` but receives two gradient contributions per backward pass.
    A second tie (``fc4.weight is fc1.weight``) is a plain module-attribute tie, the other common form.
    """

    def __init__(self, in_features: int = TOY_IN_FEATURES, out_features: int = TOY_OUT_FEATURES):
        super().__init__()
        if in_features != 10:
            raise ValueError(f"the tied-weights toy model ties a 10x10 layer, so in_features must be 10, got {in_features}")
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc4 = nn.Linear(10, 10, bias=False)
        self.fc4.weight = self.fc1.weight  # module-attribute tie
        self.head = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        h = self.relu(self.fc2(x))  # (batch, 50)
        x = x + nn.functional.linear(h, self.fc2.weight.t())  # functional tie: 50 → 10 with fc2's weight
        x = self.relu(self.fc4(x))
        return self.head(x)


class ToyModelWithFrozenParamAndBuffer(ToyModel):
    """The toy model plus a frozen per-feature scale (``requires_grad=False``) and a buffer added to the
    input. Both are random at construction, so rank-dependent seeds give rank-dependent values."""

    def __init__(self, in_features: int = TOY_IN_FEATURES, out_features: int = TOY_OUT_FEATURES):
        super().__init__(in_features, out_features)
        self.frozen_scale = nn.Parameter(1.0 + 0.1 * torch.randn(out_features), requires_grad=False)
        self.register_buffer("input_shift", 0.1 * torch.randn(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.input_shift) * self.frozen_scale


TOY_MODELS: dict[str, type[nn.Module]] = {
    "toy": ToyModel,
    "tied": ToyModelWithTiedWeights,
    "frozen_buffer": ToyModelWithFrozenParamAndBuffer,
}


def make_toy_model(kind: str = "toy", seed: int | None = 0) -> nn.Module:
    """A toy model by name (``toy``, ``tied``, ``frozen_buffer``), initialised from ``seed``
    (``None`` keeps the current RNG state, e.g. to get rank-dependent weights on purpose)."""
    try:
        cls = TOY_MODELS[kind]
    except KeyError:
        raise ValueError(f"unknown toy model {kind!r}; valid: {', '.join(TOY_MODELS)}") from None
    if seed is None:
        return cls()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls()


def make_toy_batch(batch_size: int = 20, seed: int = 0, out_features: int = TOY_OUT_FEATURES) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression batch ``(x, y)`` of shapes ``(batch, 10)`` and ``(batch, out_features)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, TOY_IN_FEATURES, generator=g)
    y = torch.randn(batch_size, out_features, generator=g)
    return x, y
