"""Analytic memory and communication models for sharded training.

Two groups of closed-form models, each a small function with hand-checked unit tests
(``tests/test_accounting.py``):

1. **Communication accounting for the XXL model** (the FFN-only model of the CS336 handout §2.4):
   ``num_blocks`` blocks of two linears ``d_model → d_ff → d_model``, fp32 master weights, gradients and
   AdamW state, bf16 activations saved for backward. :func:`ffn_model_memory` (whole-model bytes),
   :func:`fsdp_memory_per_device` / :func:`min_fsdp_devices` (sharding to fit a device), and
   :func:`fsdp_tp_forward_times` / :func:`compute_bound_batch` — the roofline of a forward pass under
   FSDP × tensor parallelism on a TPU mesh, in the notation of *How to Scale Your Model* (Austin et al.,
   2025, "Training" chapter, section on combining FSDP and tensor parallelism).
2. **Per-rank training memory and per-step traffic of the strategies in this package** — DDP, the
   optimizer-state sharding of :class:`~cs336_systems.distributed.sharded_optimizer.ShardedOptimizer`,
   ZeRO stages 1-3 and our :class:`~cs336_systems.distributed.fsdp.FSDP` — built on
   :func:`cs336_systems.configs.memory_breakdown`; used as the "predicted" columns next to measured
   peaks, and to predict the largest preset each strategy can train on one node.

Units: bytes; "GB" means 10⁹ bytes (device capacities are quoted that way: an "80 GB" H100, a 95 GB
TPU v5p); FLOP/s and bytes/s for rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .configs import (
    PRESETS,
    ModelConfig,
    dtype_bytes,
    get_config,
    memory_breakdown,
    param_counts,
)

GB = 1e9

#: Device capacities used by the accounting problems, in bytes.
H100_BYTES = 80 * GB
TPU_V5P_BYTES = 95 * GB

#: TPU v5p numbers given by the handout (after the Scaling Book): bidirectional ICI bandwidth per axis
#: and peak bf16 FLOP/s per chip.
TPU_V5P_W_ICI = 2 * 9e10
TPU_V5P_FLOPS = 4.6e14

#: fp32 master weights, fp32 gradients, two fp32 AdamW moments.
MASTER_BYTES, GRAD_BYTES, ADAM_STATE_BYTES = 4, 4, 8


# --------------------------------------------------------------------------------------------------
# 1. The FFN-only XXL model (§2.4)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FFNModel:
    """``num_blocks`` × (``Linear(d_model→d_ff)``, ``Linear(d_ff→d_model)``); attention, embeddings, the
    LM head and the nonlinearity are left out because at this size nearly all FLOPs and bytes are here."""

    d_model: int
    d_ff: int
    num_blocks: int

    @classmethod
    def from_preset(cls, name: str | ModelConfig = "xxl") -> FFNModel:
        c = get_config(name)
        return cls(c.d_model, c.d_ff, c.num_layers)

    @property
    def num_params(self) -> int:
        return 2 * self.d_model * self.d_ff * self.num_blocks

    def activation_bytes_per_token(self, activation_bytes: int = 2) -> int:
        """Saved for backward per token: each linear keeps its input (``d_model`` for the first,
        ``d_ff`` for the second) to form its weight gradient."""
        return activation_bytes * (self.d_model + self.d_ff) * self.num_blocks


def ffn_model_memory(model: FFNModel, tokens: int = 0, *, activation_bytes: int = 2) -> dict[str, float]:
    """Bytes on one device with no sharding: fp32 master weights, gradients and AdamW moments, plus the
    activations saved for backward for ``tokens`` tokens (bf16 by default)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    n = model.num_params
    out = {
        "master_weights": float(MASTER_BYTES * n),
        "gradients": float(GRAD_BYTES * n),
        "optimizer_state": float(ADAM_STATE_BYTES * n),
    }
    out["weights_grads_optimizer"] = out["master_weights"] + out["gradients"] + out["optimizer_state"]
    out["activations_per_token"] = float(model.activation_bytes_per_token(activation_bytes))
    out["activations"] = out["activations_per_token"] * tokens
    out["total"] = out["weights_grads_optimizer"] + out["activations"]
    return out


def device_equivalents(nbytes: float, device_bytes: float = H100_BYTES) -> float:
    """How many devices' worth of memory ``nbytes`` is (fractional; take ``ceil`` for a count)."""
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be positive, got {device_bytes}")
    return nbytes / device_bytes


def fsdp_memory_per_device(
    model: FFNModel, n_fsdp: int, tokens: int = 0, *, sharded_activation_fraction: float = 0.5
) -> float:
    """Bytes per device when weights, gradients, optimizer state and a fraction of the activations (the
    handout: half, in practice every second layer) are sharded ``n_fsdp`` ways; the rest of the
    activations stays whole on every device: ``(16Ψ + f·A)/N + (1-f)·A``."""
    if n_fsdp < 1:
        raise ValueError(f"n_fsdp must be >= 1, got {n_fsdp}")
    if not 0 <= sharded_activation_fraction <= 1:
        raise ValueError(f"sharded_activation_fraction must be in [0, 1], got {sharded_activation_fraction}")
    mem = ffn_model_memory(model, tokens)
    f = sharded_activation_fraction
    return (mem["weights_grads_optimizer"] + f * mem["activations"]) / n_fsdp + (1 - f) * mem["activations"]


def min_fsdp_devices(
    model: FFNModel, device_bytes: float = TPU_V5P_BYTES, tokens: int = 0, *, sharded_activation_fraction: float = 0.5
) -> int:
    """Smallest ``N`` with :func:`fsdp_memory_per_device` strictly below ``device_bytes``.

    Raises ``ValueError`` when the unsharded part of the activations alone does not fit, since then no
    degree of sharding helps.
    """
    mem = ffn_model_memory(model, tokens)
    unsharded = (1 - sharded_activation_fraction) * mem["activations"]
    if unsharded >= device_bytes:
        raise ValueError(
            f"the unsharded activations ({unsharded / GB:.1f} GB for {tokens} tokens) alone exceed the device "
            f"({device_bytes / GB:.1f} GB); reduce tokens per device or checkpoint activations"
        )
    sharded = mem["weights_grads_optimizer"] + sharded_activation_fraction * mem["activations"]
    n = max(1, math.floor(sharded / (device_bytes - unsharded)) + 1)  # strict inequality
    assert fsdp_memory_per_device(model, n, tokens, sharded_activation_fraction=sharded_activation_fraction) < device_bytes
    return n


@dataclass(frozen=True)
class Mesh:
    """A 2-D FSDP × TP layout on a TPU-style torus: ``X``-way FSDP over ``M_X`` ICI axes and ``Y``-way
    tensor parallelism over ``M_Y`` axes; ``W_ici`` is the bidirectional bandwidth of one axis (bytes/s),
    ``C`` the peak FLOP/s of one chip."""

    X: int = 16
    Y: int = 4
    M_X: int = 2
    M_Y: int = 1
    W_ici: float = TPU_V5P_W_ICI
    C: float = TPU_V5P_FLOPS

    def __post_init__(self) -> None:
        for name in ("X", "Y", "M_X", "M_Y"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.W_ici <= 0 or self.C <= 0:
            raise ValueError("W_ici and C must be positive")

    @property
    def N(self) -> int:
        return self.X * self.Y

    @property
    def alpha(self) -> float:
        """ICI arithmetic intensity ``C / W_ici``: FLOPs a chip can do per byte it can move."""
        return self.C / self.W_ici


def fsdp_tp_forward_times(
    model: FFNModel, batch_tokens: float, mesh: Mesh, *, comm_bytes: int = 2
) -> dict[str, float]:
    """Per-block forward-pass times (seconds) under FSDP × TP, Scaling-Book style.

    - ``T_math = 2 matmuls · 2·B·D·F / (N·C)``;
    - ``T_fsdp``: all-gather both weight matrices over the ``X`` axis; each chip receives its TP slice,
      ``2 · comm_bytes · D·F / Y`` bytes, at ``W_ici · M_X``;
    - ``T_tp``: all-gather the block input and reduce-scatter its output over the ``Y`` axis,
      ``2 · comm_bytes · B·D / X`` bytes at ``W_ici · M_Y``.

    ``comm_bytes`` is the wire size of one element (2 for bf16, 1 for fp8/int8).
    """
    if batch_tokens <= 0:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    D, F, B = model.d_model, model.d_ff, batch_tokens
    return {
        "T_math": 4 * B * D * F / (mesh.N * mesh.C),
        "T_fsdp": 2 * comm_bytes * D * F / (mesh.Y * mesh.W_ici * mesh.M_X),
        "T_tp": 2 * comm_bytes * B * D / (mesh.X * mesh.W_ici * mesh.M_Y),
    }


def compute_bound_batch(model: FFNModel, mesh: Mesh, *, comm_bytes: int = 2) -> dict[str, Any]:
    """The smallest batch (in tokens) at which the forward pass is compute bound, i.e. with communication
    overlapped, ``T_math ≥ max(T_fsdp, T_tp)``.

    ``T_math ≥ T_fsdp`` ⇔ ``B/N ≥ comm_bytes · α / (2 · Y · M_X)`` (per chip), which for bf16 is the
    Scaling Book's ``α / (Y·M_X)``. ``T_math ≥ T_tp`` does not depend on ``B``: it holds iff
    ``F ≥ comm_bytes · α · Y / (2 · M_Y)``; if it fails the layout is communication bound at any batch.
    """
    per_chip = comm_bytes * mesh.alpha / (2 * mesh.Y * mesh.M_X)
    tp_needs_d_ff = comm_bytes * mesh.alpha * mesh.Y / (2 * mesh.M_Y)
    return {
        "alpha": mesh.alpha,
        "per_device_tokens": per_chip,
        "per_fsdp_shard_tokens": per_chip * mesh.Y,  # each FSDP shard's batch is split over Y TP chips
        "global_tokens": per_chip * mesh.N,
        "tp_compute_bound": model.d_ff >= tp_needs_d_ff,
        "tp_min_d_ff": tp_needs_d_ff,
        "num_devices": mesh.N,
    }


# --------------------------------------------------------------------------------------------------
# 2. Per-rank memory and traffic of the strategies in this package
# --------------------------------------------------------------------------------------------------

STRATEGIES = ("single", "ddp", "sharded_optimizer", "zero1", "zero2", "zero3", "fsdp")


def shardable_params(cfg: str | ModelConfig) -> int:
    """Parameters our FSDP shards: every ``Linear`` and ``Embedding`` weight (everything but norms)."""
    p = param_counts(cfg)
    return p["total"] - p["norms"]


def largest_layer_params(cfg: str | ModelConfig) -> int:
    """The biggest single ``Linear``/``Embedding`` weight (what one all-gather materialises)."""
    c = get_config(cfg)
    return max(c.vocab_size * c.d_model, c.d_model * c.d_ff, c.d_model * c.d_model)


def training_memory_per_rank(
    cfg: str | ModelConfig,
    strategy: str,
    world_size: int,
    batch_size: int | None = None,
    context_length: int | None = None,
    *,
    compute_dtype: str | None = None,
    prefetch_layers: int = 1,
) -> dict[str, float]:
    """Predicted bytes on one rank for a training step with AdamW and fp32 master weights.

    ``batch_size`` is the *per-rank* batch. Parameters/gradients/optimizer state follow the strategy:

    - ``single``/``ddp``: everything replicated (``4Ψ + 4Ψ + 8Ψ``);
    - ``sharded_optimizer``/``zero1``: optimizer state ``/N``;
    - ``zero2``: also gradients ``/N``; ``zero3``: also parameters ``/N``;
    - ``fsdp`` (ours): ``Linear``/``Embedding`` weights, their gradients and state ``/N``, norms
      replicated, plus a working set of all-gathered weights (the current layer and ``prefetch_layers``
      prefetched ones, in ``compute_dtype``) and, during backward, one full-size gradient before its
      reduce-scatter.

    Activations come from :func:`~cs336_systems.configs.memory_breakdown` (eager, naive attention),
    in ``compute_dtype`` when given (autocast-style) else fp32.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if strategy == "single" and world_size != 1:
        raise ValueError("strategy 'single' means world_size 1")
    c = get_config(cfg)
    act_dtype = compute_dtype or "fp32"
    base = memory_breakdown(c, batch_size, context_length, activation_dtype=act_dtype)
    n = param_counts(c)["total"]
    params, grads, opt = MASTER_BYTES * n, GRAD_BYTES * n, ADAM_STATE_BYTES * n
    working = 0.0
    N = world_size
    if strategy in ("sharded_optimizer", "zero1", "zero2", "zero3"):
        opt /= N
    if strategy in ("zero2", "zero3"):
        grads /= N
    if strategy == "zero3":
        params /= N
    if strategy == "fsdp":
        sharded, replicated = shardable_params(c), n - shardable_params(c)
        params = MASTER_BYTES * (math.ceil(sharded / N) + replicated)
        grads = GRAD_BYTES * (math.ceil(sharded / N) + replicated)
        opt = ADAM_STATE_BYTES * (math.ceil(sharded / N) + replicated)
        gathered = largest_layer_params(c) * dtype_bytes(compute_dtype or "fp32")
        working = (1 + prefetch_layers) * gathered + largest_layer_params(c) * GRAD_BYTES
    out = {
        "parameters": float(params),
        "gradients": float(grads),
        "optimizer_state": float(opt),
        "activations": base["activations"],
        "fsdp_working_set": float(working),
    }
    out["total"] = sum(out.values())
    return out


def communication_per_step(
    cfg: str | ModelConfig, strategy: str, world_size: int, *, compute_dtype: str | None = None
) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, with bandwidth-optimal (ring) collectives, where an
    all-reduce of ``S`` bytes costs ``2(N-1)/N·S`` per rank and a reduce-scatter, all-gather or
    broadcast ``(N-1)/N·S``.

    - ``ddp``: all-reduce fp32 gradients (``2Ψ``);
    - ``sharded_optimizer`` (ours): DDP's all-reduce plus broadcasting updated parameters (``3Ψ``);
    - ``zero1``/``zero2``: reduce-scatter gradients + all-gather parameters (``2Ψ``, as DDP);
    - ``zero3``/``fsdp``: all-gather parameters for forward and again for backward + reduce-scatter
      gradients (``3Ψ``); our FSDP gathers in ``compute_dtype`` (halving those two terms for bf16)
      and all-reduces the replicated norm gradients.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    N = world_size
    f = (N - 1) / N
    n = param_counts(cfg)["total"]
    psi = GRAD_BYTES * n  # fp32 bytes of all parameters
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0, "broadcast": 0.0}
    if strategy == "ddp":
        out["all_reduce"] = 2 * f * psi
    elif strategy == "sharded_optimizer":
        out["all_reduce"] = 2 * f * psi
        out["broadcast"] = f * psi
    elif strategy in ("zero1", "zero2"):
        out["reduce_scatter"] = f * psi
        out["all_gather"] = f * psi
    elif strategy == "zero3":
        out["reduce_scatter"] = f * psi
        out["all_gather"] = 2 * f * psi
    elif strategy == "fsdp":
        sharded, replicated = shardable_params(cfg), n - shardable_params(cfg)
        gather_bytes = dtype_bytes(compute_dtype or "fp32")
        out["all_gather"] = 2 * f * sharded * gather_bytes
        out["reduce_scatter"] = f * sharded * GRAD_BYTES
        out["all_reduce"] = 2 * f * replicated * GRAD_BYTES
    out["total"] = sum(out.values())
    return out


#: Sizes beyond the handout's presets for "what is the largest model that fits" questions: the
#: GPT-3 family shapes (Brown et al., 2020, Table 2.1) with SwiGLU width 4·d_model like our presets.
SCALE_LADDER: list[ModelConfig] = [
    *(PRESETS[n] for n in ("small", "medium", "large", "xl", "2.7B")),
    ModelConfig("6.7B", d_model=4096, d_ff=16384, num_layers=32, num_heads=32),
    ModelConfig("13B", d_model=5120, d_ff=20480, num_layers=40, num_heads=40),
    ModelConfig("20B", d_model=6144, d_ff=24576, num_layers=44, num_heads=48),
    ModelConfig("30B", d_model=7168, d_ff=28672, num_layers=48, num_heads=56),
    ModelConfig("65B", d_model=8192, d_ff=32768, num_layers=80, num_heads=64),
]


def ladder_config(name: str) -> ModelConfig:
    """A preset or a :data:`SCALE_LADDER` size by name."""
    for c in SCALE_LADDER:
        if c.name.lower() == name.lower():
            return c
    return get_config(name)


def largest_trainable_preset(
    strategy: str,
    world_size: int,
    device_bytes: float,
    *,
    batch_size: int | None = None,
    context_length: int | None = None,
    compute_dtype: str | None = None,
    candidates: list[ModelConfig] | None = None,
    headroom: float = 0.9,
) -> str | None:
    """The largest size (by parameter count) of ``candidates`` (default :data:`SCALE_LADDER`) whose
    predicted per-rank memory fits in ``headroom · device_bytes`` (the rest is left for allocator
    fragmentation, the CUDA context and communication buffers). ``None`` if none fits."""
    fitting = [
        c
        for c in candidates or SCALE_LADDER
        if training_memory_per_rank(c, strategy, world_size, batch_size, context_length, compute_dtype=compute_dtype)[
            "total"
        ]
        <= headroom * device_bytes
    ]
    return max(fitting, key=lambda c: param_counts(c)["total"]).name if fitting else None

