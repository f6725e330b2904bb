"""Model presets and the analytic parameter / FLOP / memory calculator every notebook reuses.

Presets follow the handouts' tables (vocab 10,000, batch 4). The two editions differ at the top: 2025's
``xl`` is 1600/6400/48 layers/25 heads and its largest is ``2.7B``; 2026's ``xl`` is 2560/10240/32/32 (2025's
``2.7B``) and its largest is ``10B``. So a name never means two models, a bare name is the 2025 table's and
``NAME@2026`` names the 2026 table's: ``xl@2026``, ``10B@2026``; ``small@2026`` is ``small`` (both tables
agree below xl) and ``xl@2025`` is ``xl``. :data:`HANDOUT_SIZES_BY_EDITION` lists each table.
``xxl`` exists for accounting only; ``tiny`` is for CPU smoke runs.

The calculator counts our own ``BasicsTransformerLM`` exactly (see ``tests/test_configs.py``, which
checks it against a built model): per block ``4 d²`` attention projections, ``3 d d_ff`` SwiGLU, two
RMSNorm gains; plus embedding, final norm and an untied LM head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from cs336_basics.model import BasicsTransformerLM

# Our kernels register themselves with the model by name (flash_pytorch, flash_triton) when imported: every
# model built here can name them, whichever Assignment-1 package provides cs336_basics.
import cs336_systems.attention  # noqa: E402,F401

VOCAB_SIZE = 10_000
BATCH_SIZE = 4


@dataclass(frozen=True)
class ModelConfig:
    name: str
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = VOCAB_SIZE
    context_length: int = 512
    rope_theta: float = 10_000.0
    batch_size: int = BATCH_SIZE

    def __post_init__(self) -> None:
        for field in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length", "batch_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"model {self.name!r}: d_model {self.d_model} is not divisible by num_heads "
                             f"{self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"model {self.name!r}: the head dimension d_model / num_heads = "
                             f"{self.d_model // self.num_heads} must be even (RoPE rotates pairs of features)")
        if not self.rope_theta > 0:
            raise ValueError(f"model {self.name!r}: rope_theta must be positive, got {self.rope_theta!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def model_kwargs(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            rope_theta=self.rope_theta,
        )


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("tiny", d_model=64, d_ff=256, num_layers=2, num_heads=4, vocab_size=512, context_length=64),
        ModelConfig("small", d_model=768, d_ff=3072, num_layers=12, num_heads=12),
        ModelConfig("medium", d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
        ModelConfig("large", d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
        ModelConfig("xl", d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
        ModelConfig("2.7B", d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
        # Accounting only (§2.4): far too large to build on one node.
        ModelConfig("xxl", d_model=16384, d_ff=53248, num_layers=126, num_heads=128),
        # The 2026 handout's table where it differs from 2025's.
        ModelConfig("xl@2026", d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
        ModelConfig("10B@2026", d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    ]
}

#: The five sizes each edition's handout benchmarks, in order.
HANDOUT_SIZES_BY_EDITION = {
    "2025": ["small", "medium", "large", "xl", "2.7B"],
    "2026": ["small", "medium", "large", "xl@2026", "10B@2026"],
    "cse599o": ["large"],  # CSE599-O's Table 1 (1280/5120/36/20), its only model
}
#: The 2025 handout's sizes (the default edition of every section).
HANDOUT_SIZES = HANDOUT_SIZES_BY_EDITION["2025"]


def _preset_key(name: str) -> str:
    """The :data:`PRESETS` key ``name`` means (case-insensitive; ``NAME@EDITION`` as the module docstring says)."""
    lower = {k.lower(): k for k in PRESETS}
    if name.lower() in lower:
        return lower[name.lower()]
    base, at, edition = name.partition("@")
    if at and edition in HANDOUT_SIZES_BY_EDITION:
        sizes = {n.partition("@")[0].lower(): n for n in HANDOUT_SIZES_BY_EDITION[edition]}
        if base.lower() in sizes:
            return sizes[base.lower()]
        raise ValueError(f"the {edition} handout has no {base!r} model; its sizes: "
                         f"{', '.join(HANDOUT_SIZES_BY_EDITION[edition])}")
    if at:
        raise ValueError(f"unknown edition {edition!r} in {name!r}; editions: {', '.join(HANDOUT_SIZES_BY_EDITION)}")
    raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")


def handout_size(name: str, edition: str) -> str:
    """The preset ``edition``'s handout means by the bare size ``name`` (``xl`` → ``xl@2026`` in 2026; CSE599-O's
    one model, ``large``, for any name), ``name`` itself where that handout's table has no size of that name or
    the tables agree (``small``, ``2.7B``)."""
    if edition not in HANDOUT_SIZES_BY_EDITION:
        raise ValueError(f"unknown edition {edition!r}; editions: {', '.join(HANDOUT_SIZES_BY_EDITION)}")
    if "@" in name:
        return name
    table = HANDOUT_SIZES_BY_EDITION[edition]
    if len(table) == 1:  # a handout with one model (CSE599-O's Table 1) means it whatever size is named
        return table[0]
    sizes = {n.partition("@")[0].lower(): n for n in table}
    return sizes.get(name.lower(), name)


def model_shape(name: str | ModelConfig) -> tuple[int, int, int, int]:
    """A preset's architecture as ``(d_model, d_ff, num_layers, num_heads)``: equal for the presets that are the
    same model under two editions' names (``2.7B`` and ``xl@2026``)."""
    c = get_config(name)
    return c.d_model, c.d_ff, c.num_layers, c.num_heads


def get_config(name: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """A preset by name (case-insensitive; ``xl@2026`` for the 2026 table, see the module docstring), with
    optional field overrides such as ``context_length``."""
    if isinstance(name, ModelConfig):
        return name.replace(**overrides) if overrides else name
    cfg = PRESETS[_preset_key(str(name))]
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}; valid: "
                         f"{', '.join(f.name for f in dataclasses.fields(ModelConfig) if f.name != 'name')}")
    return cfg.replace(**overrides) if overrides else cfg


def build_model(
    config: str | ModelConfig,
    *,
    context_length: int | None = None,
    attention_impl: str = "naive",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> BasicsTransformerLM:
    cfg = get_config(config)
    if context_length is not None:
        cfg = cfg.replace(context_length=context_length)
    return BasicsTransformerLM(**cfg.model_kwargs(), attention_impl=attention_impl, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# Calculator
# --------------------------------------------------------------------------------------------------

DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


def param_counts(cfg: str | ModelConfig) -> dict[str, int]:
    """Parameters by component; ``total`` matches ``sum(p.numel() for p in model.parameters())``."""
    c = get_config(cfg)
    d, f, L, V = c.d_model, c.d_ff, c.num_layers, c.vocab_size
    per_block = {"attention": 4 * d * d, "ffn": 3 * d * f, "norms": 2 * d}
    counts = {
        "embedding": V * d,
        "attention": L * per_block["attention"],
        "ffn": L * per_block["ffn"],
        "norms": L * per_block["norms"] + d,
        "lm_head": V * d,
    }
    counts["total"] = sum(counts.values())
    counts["non_embedding"] = counts["total"] - counts["embedding"]
    return counts


def matmul_params(cfg: str | ModelConfig) -> int:
    """Parameters that take part in matrix multiplies (everything but the embedding lookup and norms)."""
    p = param_counts(cfg)
    return p["attention"] + p["ffn"] + p["lm_head"]


def flops_per_token(cfg: str | ModelConfig, context_length: int | None = None) -> dict[str, float]:
    """Forward and training FLOPs per token.

    Forward: ``2 × matmul params`` plus attention's two ``seq × seq`` products, ``4 · L · seq · d``
    (counted without causal savings, as is customary). Backward costs twice the forward, so a training
    step is ``3 ×`` forward.
    """
    c = get_config(cfg)
    seq = context_length or c.context_length
    dense = 2 * matmul_params(c)
    attn = 4 * c.num_layers * seq * c.d_model
    fwd = dense + attn
    return {"forward": float(fwd), "dense_forward": float(dense), "attention_forward": float(attn), "train": 3.0 * fwd}


def attention_flops(
    batch_heads: int, n_queries: int, n_keys: int, head_dim: int, *, is_causal: bool = False,
    phase: str = "forward",
) -> float:
    """Matmul FLOPs of attention's core (``QKᵀ`` and ``PV``): ``4 · n_q · n_k · d`` per head in the forward
    pass, halved when causal (the masked half is not computed by a flash kernel); the backward does 2.5× the
    forward (five matmuls against two), the convention the FlashAttention papers use."""
    if phase not in _ATTENTION_PHASES:
        raise ValueError(f"phase must be one of {', '.join(_ATTENTION_PHASES)}, got {phase!r}")
    forward = 4.0 * batch_heads * n_queries * n_keys * head_dim * (0.5 if is_causal else 1.0)
    return forward * _ATTENTION_PHASES[phase]


_ATTENTION_PHASES = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def softmax_flops(batch_heads: int, n_queries: int, n_keys: int) -> float:
    """FLOPs of a row-wise softmax over the scores: about 5 per score (max, subtract, exp, sum, divide)."""
    return 5.0 * batch_heads * n_queries * n_keys


def step_flops(cfg: str | ModelConfig, batch_size: int, context_length: int, mode: str = "train") -> float:
    """FLOPs of one ``forward`` or ``train`` (forward + backward) step."""
    per_tok = flops_per_token(cfg, context_length)
    key = {"forward": "forward", "forward_backward": "train", "train": "train"}.get(mode)
    if key is None:
        raise ValueError(f"mode must be 'forward', 'forward_backward' or 'train', got {mode!r}")
    return per_tok[key] * batch_size * context_length


def activation_elements_per_layer(cfg: str | ModelConfig, batch_size: int, context_length: int) -> dict[str, int]:
    """Elements saved for backward by one block of our model with naive attention (eager autograd).

    Counted from the operations in ``cs336_basics.model``: RMSNorm inputs/outputs, q/k/v projections and
    their rotated copies, the ``seq × seq`` scores and probabilities per head, the attention output,
    and SwiGLU's three ``d_ff``-wide intermediates plus its product.
    """
    c = get_config(cfg)
    bt = batch_size * context_length
    d, f, h = c.d_model, c.d_ff, c.num_heads
    return {
        "norms": 4 * bt * d,  # ln1 in/out, ln2 in/out
        "qkv": 5 * bt * d,  # q, k, v + rotated q, k
        "attention_scores": 2 * batch_size * h * context_length * context_length,  # scores + probs
        "attention_out": 2 * bt * d,  # P·V output + output_proj input
        "ffn": 4 * bt * f,  # w1 out, silu out, w3 out, product
    }


def residual_stream_bytes(cfg: str | ModelConfig, batch_size: int, context_length: int, dtype: str = "fp32") -> int:
    """Size of one residual-stream activation ``(batch, seq, d_model)``."""
    c = get_config(cfg)
    return batch_size * context_length * c.d_model * dtype_bytes(dtype)


def memory_breakdown(
    cfg: str | ModelConfig,
    batch_size: int | None = None,
    context_length: int | None = None,
    *,
    param_dtype: str = "fp32",
    activation_dtype: str = "fp32",
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Bytes of weights, gradients, optimizer state and saved activations for one training step."""
    c = get_config(cfg)
    b = batch_size or c.batch_size
    s = context_length or c.context_length
    n = param_counts(c)["total"]
    pb = dtype_bytes(param_dtype)
    states = {"adamw": 2, "sgd": 0, "none": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer must be one of {sorted(states)}, got {optimizer!r}")
    act_layer = sum(activation_elements_per_layer(c, b, s).values())
    logits = 2 * b * s * c.vocab_size  # logits + fp32 log-softmax in the loss
    activations = (c.num_layers * act_layer + logits + 2 * b * s * c.d_model) * dtype_bytes(activation_dtype)
    out = {
        "parameters": float(n * pb),
        "gradients": float(n * pb),
        "optimizer_state": float(states[optimizer] * n * 4),
        "activations": float(activations),
    }
    out["total"] = sum(out.values())
    return out


def describe_presets(names: list[str] | None = None, context_length: int | None = None) -> list[dict[str, Any]]:
    """One row per preset: shape, parameter count, FLOPs per token and fp32 training-state bytes."""
    rows = []
    for name in names or list(PRESETS):
        c = get_config(name)
        s = context_length or c.context_length
        p = param_counts(c)
        fl = flops_per_token(c, s)
        mem = memory_breakdown(c, c.batch_size, s)
        rows.append(
            {
                "size": c.name,
                "d_model": c.d_model,
                "d_ff": c.d_ff,
                "num_layers": c.num_layers,
                "num_heads": c.num_heads,
                "params_M": p["total"] / 1e6,
                "non_embedding_params_M": p["non_embedding"] / 1e6,
                "fwd_GFLOP_per_token": fl["forward"] / 1e9,
                "train_GFLOP_per_token": fl["train"] / 1e9,
                "weights_grads_adam_GiB": (mem["parameters"] + mem["gradients"] + mem["optimizer_state"]) / 2**30,
            }
        )
    return rows


#: Both handouts' tables, each model once: the 2025 table, then the 2026 models it lacks (``10B@2026``; 2026's
#: xl is 2025's 2.7B, the same shape under another name).
BOTH_EDITIONS_SIZES = list(HANDOUT_SIZES) + [
    s for s in HANDOUT_SIZES_BY_EDITION["2026"]
    if get_config(s).replace(name="") not in {get_config(t).replace(name="") for t in HANDOUT_SIZES}]
