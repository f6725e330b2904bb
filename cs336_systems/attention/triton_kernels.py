"""Triton kernels of FlashAttention-2: forward, the ``D = rowsum(dO ∘ O)`` preprocess, dK/dV and dQ.

Layout: every tensor is addressed as ``(batch, heads, n, d)`` through its four strides (3-D inputs arrive
with a unit head dimension). The grid is one-dimensional, ``tiles along the sequence x batch * heads``
(see ``_tile_and_head``).

Loads. Tiles that stay resident for a whole program use pointer arithmetic (no ``tl.make_block_ptr``,
which newer Triton removed). Tiles that stream past in a loop (K and V in the forward and dQ kernels; Q,
dO, L and D in dK/dV) come through tensor descriptors (``tl.make_tensor_descriptor``: TMA bulk copies on
Hopper and later, plain loads elsewhere), which need a unit stride along the head dimension and 16-byte
aligned heads and rows; ``flash_triton`` copies the rare input that is not. Both forms run on the GPU
nodes' Triton and under ``TRITON_INTERPRET=1`` on CPU tensors.

Causal structure. With top-left alignment query ``i`` sees key ``j`` iff ``j <= i``. Each loop over tiles is
split into an unmasked part (tiles every row of which sees every column) and a masked part (tiles that
straddle the diagonal, plus the ragged tile at the end of a sequence whose length is not a multiple of the
tile). Tiles entirely above the diagonal are never visited. The masked part is a separate instantiation of
the same inner loop (``MASKED`` is a compile-time flag), so the unmasked tiles pay for no masking at all.

Matmul precision (``DOT_PRECISION``) only matters for float32 inputs: ``tf32`` (tensor cores, ~1e-3
relative error) or ``tf32x3`` (three TF32 products, float32-level accuracy); ``flash_triton`` picks it from
``torch.get_float32_matmul_precision()`` like any PyTorch matmul.

Softmax arithmetic is in base 2: scores are scaled by ``log2(e) / √d`` and exponentiated with ``exp2``,
which maps to one hardware instruction; with 16-bit inputs the dK/dV kernel may use a polynomial on the
FMA pipe instead (:func:`_exp2_fma`): its candidate tiles come both ways and the autotuner picks
(:class:`Tile`, ``CS336_FLASH_POLY_EXP2``). ``L`` is stored in natural-log units, as the interface requires.

This module is imported lazily (by ``flash_triton.py``, on first launch) because ``@triton.jit`` decides
at decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import NamedTuple

import triton
import triton.language as tl
import triton.testing

LOG2_E = 1.4426950408889634

#: Whether these kernels were decorated for the CPU interpreter (``TRITON_INTERPRET=1``).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``CS336_FLASH_AUTOTUNE=0`` runs the first config of each list that fits the GPU, untuned: one compile
#: per specialization. Tests use it to bound compile time; benchmarks leave tuning on.
AUTOTUNE = os.environ.get("CS336_FLASH_AUTOTUNE", "1") != "0"
#: Which candidate tiles the autotuner tries: ``default`` (a short list per phase, a few seconds of
#: first-use tuning per shape class) or ``wide`` (every tile shape, warp count and stage count worth
#: trying on Hopper; a minute or more per class). ``wide`` is how the default lists were chosen: run the
#: kernel breakdown with ``CS336_FLASH_CONFIGS=wide`` and read the winners off its ``best_config`` column.
CONFIG_SET = os.environ.get("CS336_FLASH_CONFIGS", "default")
#: Phases whose score tiles are exponentiated by :func:`_exp2_fma` instead of the hardware ``ex2``
#: (``CS336_FLASH_POLY_EXP2=forward,dkdv,dq``, ``all`` or ``none``; default ``dkdv``): 16-bit inputs
#: only, where its 8e-5 relative error is below the rounding of P to bf16/fp16. Why it pays where it
#: does: on Hopper ``ex2`` and the float32→16-bit conversions issue on the same 16-per-clock-per-SM unit,
#: while the polynomial runs on the 128-per-clock FMA pipe (the lever FlashAttention-4 uses on
#: Blackwell). dK/dV converts two tiles (P and dS) per exponentiated tile and got 7.5% faster on an H100
#: at its 32 x 64 tiles of the time; forward and dQ convert one, keep their FMA pipe busy otherwise, and
#: got 30% slower. With the 64 x 64 tiles capped at 168 registers ``ex2`` is faster again, so the default
#: dK/dV candidates pin the method per tile and the tuner chooses (docs/flash_attention/NOTES.md).
DEFAULT_POLY_EXP2 = "dkdv"
_POLY_SETTING = os.environ.get("CS336_FLASH_POLY_EXP2", DEFAULT_POLY_EXP2)
#: Whether the setting was given: then it also overrides the candidates that pin a method (see :class:`Tile`).
POLY_EXP2_EXPLICIT = "CS336_FLASH_POLY_EXP2" in os.environ
POLY_EXP2_PHASES = frozenset(
    ("forward", "dkdv", "dq") if _POLY_SETTING == "all"
    else () if _POLY_SETTING == "none"
    else filter(None, _POLY_SETTING.split(","))
)  # fmt: skip
#: What the decorators above were built for; ``flash_triton`` re-imports this module when it changes
#: (set before the checks below, so that a failed import is retried once the setting is fixed).
BUILD_MODE = (INTERPRETED, AUTOTUNE, CONFIG_SET, os.environ.get("CS336_FLASH_POLY_EXP2"))
if not POLY_EXP2_PHASES <= {"forward", "dkdv", "dq"}:
    raise ValueError(f"CS336_FLASH_POLY_EXP2 names unknown phases: {sorted(POLY_EXP2_PHASES)}; "
                     "valid: forward, dkdv, dq (comma-separated), all, none")


# --------------------------------------------------------------------------------------------------
# Tile configurations. The interpreter gets one small config (tl.dot needs every side >= 16; numpy is
# fastest with few, small tiles and there is nothing to tune). On GPUs a short list per phase is
# autotuned once per shape class, so first-call tuning stays at a few seconds per class.
# --------------------------------------------------------------------------------------------------

class Tile(NamedTuple):
    """One autotuning candidate of a kernel.

    ``maxnreg`` caps the registers per thread. On Hopper an SM sub-partition holds 16,384 registers, so a
    4-warp program at 169-255 registers leaves room for 2 programs per SM and one at <= 168 for 3: a cap
    just under such a cliff buys a third (or fourth) resident program for latency hiding at the price of a
    few spilled registers. ``poly`` pins how the tile exponentiates 16-bit scores (``True``: the FMA-pipe
    polynomial, ``False``: ``ex2``) so that the tuner chooses it together with the tile: which is faster
    depends on the tile's register budget (docs/flash_attention/NOTES.md). ``None`` follows
    ``CS336_FLASH_POLY_EXP2``, and an explicit ``CS336_FLASH_POLY_EXP2`` overrides every pin.
    """

    block_m: int
    block_n: int
    warps: int
    stages: int
    maxnreg: int | None = None
    poly: bool | None = None


def _configs(phase: str, candidates: list[tuple[int, int, int, int] | Tile]) -> list[triton.Config]:
    """``triton.Config`` per candidate (a plain tuple is a :class:`Tile` without cap or pin); the first is
    the untuned default. ``POLY_EXP2`` is a meta-parameter of every config, so the launch never passes it."""
    setting = phase in POLY_EXP2_PHASES
    if INTERPRETED:
        meta = {"BLOCK_M": 16, "BLOCK_N": 16, "POLY_EXP2": setting}
        return [triton.Config(meta, num_warps=1, num_stages=1)]
    configs = []
    for candidate in candidates:
        tile = Tile(*candidate)
        poly = setting if (POLY_EXP2_EXPLICIT or tile.poly is None) else tile.poly
        configs.append(triton.Config({"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "POLY_EXP2": poly},
                                     num_warps=tile.warps, num_stages=tile.stages, maxnreg=tile.maxnreg))
    return configs


#: Candidate tiles per phase and config set. Forward and dQ keep BLOCK_M queries resident while
#: BLOCK_N-key tiles stream past; dK/dV keeps BLOCK_N keys resident while BLOCK_M-query tiles stream past.
#: The ``default`` lists hold the winners on an H100 for head dims 64 and 128 plus a neighbour or two (see
#: docs/flash_attention/NOTES.md); each candidate costs about 0.8 s of compile per shape class on first use.
_CANDIDATES: dict[str, dict[str, list[tuple[int, int, int, int] | Tile]]] = {
    "default": {
        "forward": [(128, 64, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
        "dkdv": [Tile(64, 64, 4, 3, maxnreg=168, poly=False), (64, 64, 4, 3),
                 Tile(32, 64, 4, 3, maxnreg=168), (64, 128, 8, 3), Tile(64, 128, 8, 3, poly=False)],
        "dq": [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    },
    "wide": {
        "forward": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
                    (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
        "dkdv": [(32, 64, 4, 3), (32, 64, 4, 5), (32, 128, 4, 3), (32, 128, 4, 5),
                 (32, 128, 8, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 4),
                 (64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2),
                 Tile(32, 64, 4, 3, maxnreg=168),
                 Tile(32, 64, 4, 4, maxnreg=168), Tile(64, 64, 4, 3, maxnreg=168),
                 Tile(32, 128, 8, 3, maxnreg=128), Tile(64, 64, 4, 3, maxnreg=168, poly=False),
                 Tile(64, 64, 4, 3, poly=False), Tile(32, 64, 4, 3, maxnreg=168, poly=False),
                 Tile(32, 128, 8, 3, maxnreg=128, poly=False), Tile(64, 128, 8, 3, poly=False),
                 Tile(64, 64, 4, 2, maxnreg=168, poly=False), Tile(64, 64, 4, 4, maxnreg=168, poly=False)],
        "dq": [(64, 32, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5), (64, 128, 4, 3), (128, 32, 4, 3),
               (128, 32, 4, 5), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
               Tile(64, 64, 4, 3, maxnreg=128), Tile(128, 64, 8, 3, maxnreg=128), (128, 64, 4, 4),
               Tile(128, 64, 4, 3, maxnreg=168), (128, 128, 8, 3)],
    },
}  # fmt: skip
if CONFIG_SET not in _CANDIDATES:
    raise ValueError(f"CS336_FLASH_CONFIGS={CONFIG_SET!r}; valid: {', '.join(_CANDIDATES)}")
FORWARD_CONFIGS = _configs("forward", _CANDIDATES[CONFIG_SET]["forward"])
DKDV_CONFIGS = _configs("dkdv", _CANDIDATES[CONFIG_SET]["dkdv"])
DQ_CONFIGS = _configs("dq", _CANDIDATES[CONFIG_SET]["dq"])
#: Tuning key: the shape class. SEQ_CLASS is the longer sequence length rounded up to a power of two
#: (capped; see ``flash_triton._seq_class``); dtypes are added to the key by Triton itself.
AUTOTUNE_KEY = ["SEQ_CLASS", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
#: Rows per program of the small preprocess kernel.
PREPROCESS_BLOCK = 16 if INTERPRETED else 128


#: Share of the per-block shared memory the operand buffers may take; the rest is left for the scratch
#: Triton allocates for layout conversions and reductions.
_SHARED_MEMORY_SHARE = 0.85


@functools.cache
def _shared_memory_bytes(device_index: int) -> int:
    """Opt-in shared memory per block: the limit Triton checks a compiled kernel against."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver without the query: ask PyTorch instead
        import torch

        props = torch.cuda.get_device_properties(device_index)
        for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
            if getattr(props, name, 0):
                return int(getattr(props, name))
        return 99 * 1024  # the smallest opt-in limit of current NVIDIA GPUs


def _fit_configs(resident_rows: Callable[[int, int], int], streamed_rows: Callable[[int, int, int], int],
                 min_block_m: int = 16):
    """An ``early_config_prune`` for one kernel: drop tiles much longer than the sequences (work wasted
    on padding), and lower ``num_stages`` until the operand tiles fit in shared memory.

    ``resident_rows(BLOCK_M, BLOCK_N)`` rows of ``HEAD_DIM`` elements stay loaded for the whole program;
    ``streamed_rows(BLOCK_M, BLOCK_N, layouts)`` more are buffered once per pipeline stage, where
    ``layouts`` is how many shared-memory copies a tile used both plain and transposed needs: 16-bit
    tiles are read transposed from one copy (``ldmatrix.trans``), 32-bit tiles get a second copy. (The dQ
    kernel at float32, head dim 128 measured 256 KiB with the second copy of K, against the 227 KiB limit.)
    float32 at head dim 128 is where the default stage counts would overflow (and fail to launch).
    Tiles with fewer than ``min_block_m`` rows along BLOCK_M are dropped (a kernel's hardware limit).
    Without tuning the first survivor runs.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**kwargs, **named_args}
        row_bytes = args["HEAD_DIM"] * args["Q"].element_size()
        layouts = 2 if args["Q"].element_size() == 4 else 1
        budget = _SHARED_MEMORY_SHARE * _shared_memory_bytes(args["Q"].device.index or 0)
        longest = max(args.get("SEQ_CLASS", 1 << 30), 64)
        fitted: dict[tuple[int, ...], triton.Config] = {}
        for config in configs:
            m, n, maxnreg = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.maxnreg
            meta = tuple(sorted(config.kwargs.items()))
            if max(m, n) > longest or m < min_block_m:
                continue
            stages = config.num_stages
            while stages > 1 and row_bytes * (resident_rows(m, n) + stages * streamed_rows(m, n, layouts)) > budget:
                stages -= 1
            if row_bytes * (resident_rows(m, n) + stages * streamed_rows(m, n, layouts)) > budget:
                continue
            fitted.setdefault(
                (meta, config.num_warps, stages, maxnreg),
                triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=stages,
                              maxnreg=maxnreg),
            )
        if not fitted:  # nothing fits the estimate: try the smallest tiles, unpipelined
            allowed = [c for c in configs if c.kwargs["BLOCK_M"] >= min_block_m] or configs
            smallest = min(allowed, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
            return [triton.Config(dict(smallest.kwargs), num_warps=smallest.num_warps, num_stages=1)]
        survivors = list(fitted.values())
        return survivors if AUTOTUNE else survivors[:1]

    return prune


def _autotune(configs: list[triton.Config], prune: Callable):
    """``triton.autotune`` keyed on the shape class, with a shorter benchmark per config than Triton's
    (10 ms warm-up, 50 ms of timed runs instead of 25/100) where this Triton lets us pass one: at the
    leaderboard size 20 ms held about 8 runs of the dK/dV kernel, too few to separate candidates 5%
    apart, and compilation, not timing, is most of the tuning time."""
    kwargs: dict = dict(configs=configs, key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": prune})
    if "do_bench" in inspect.signature(triton.autotune).parameters and not INTERPRETED:
        kwargs["do_bench"] = functools.partial(triton.testing.do_bench, warmup=10, rep=50)
    return triton.autotune(**kwargs)


#: Sequence lengths and head counts vary from call to call: specializing on their divisibility would
#: compile a new variant for each; the masks handle ragged ends anyway.
_jit = functools.partial(triton.jit, do_not_specialize=["n_heads", "n_queries", "n_keys", "SEQ_CLASS"])


# --------------------------------------------------------------------------------------------------
# Exponentials
# --------------------------------------------------------------------------------------------------


@triton.jit
def _exp2_fma(x):
    """``2**x`` on the FMA and integer pipes, for x <= ~0 (scores minus a running max or L).

    Cody-Waite: adding 1.5 * 2**23 rounds x to the nearest integer n (held in the low mantissa bits of
    ``j``), 2**f for f = x - n in [-1/2, 1/2] is a degree-3 polynomial (coefficients fitted for minimum
    relative error, max 7.7e-5), and 2**n is applied by adding n to the exponent field. x is clamped at
    -125 so the result stays a normal float: masked scores (-inf) give 2**-125 ~ 2e-38, not 0, which no
    16-bit P can tell apart from 0 and which the backward masks to 0 anyway.
    """
    x = tl.maximum(x, -125.0)
    j = x + 12582912.0
    f = x - (j - 12582912.0)
    p = 0.05508868380751114 * f + 0.24260405145947936
    p = p * f + 0.6932762416819607
    p = p * f + 0.9999289403695112
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_fma_kernel(X, Y, n, BLOCK: tl.constexpr):
    """Elementwise ``Y = _exp2_fma(X)`` over ``n`` float32 values: the accuracy check of the polynomial."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, _exp2_fma(tl.load(X + offs, mask=offs < n)), mask=offs < n)


@triton.jit
def _exp2(x, POLY: tl.constexpr, INPUT_DTYPE: tl.constexpr):
    """Hardware ``ex2`` (MUFU), or :func:`_exp2_fma` when ``POLY`` and the attention inputs are 16-bit:
    float32 attention keeps float32-level accuracy."""
    if POLY and INPUT_DTYPE != tl.float32:
        y = _exp2_fma(x)
    else:
        y = tl.math.exp2(x)
    return y


# --------------------------------------------------------------------------------------------------
# Loop bounds. All in element units, multiples of the tile along the loop.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _key_ranges(start_m, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the query tile starting at ``start_m``: keys ``[0, mid)`` are unmasked, ``[mid, hi)`` masked.

    A key tile is unmasked when it lies entirely inside the sequence and (causal) its last key is at or
    before the tile's first query. ``hi`` is ``n_keys``, or for causal tiles one past the last visible key.
    """
    full = (n_keys // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, n_keys)
        mid = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, full)
    else:
        hi = n_keys
        mid = full
    return mid, hi


@triton.jit
def _query_ranges(start_n, n_queries, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the key tile starting at ``start_n``: queries ``[lo, diag)`` straddle the diagonal (masked),
    ``[diag, full)`` see all of the tile (unmasked), ``[max(diag, full), n_queries)`` is the ragged end
    (masked). Queries before ``lo`` see none of it."""
    padded = tl.cdiv(n_queries, BLOCK_M) * BLOCK_M
    full = (n_queries // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        lo = tl.minimum((start_n // BLOCK_M) * BLOCK_M, padded)
        diag = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, padded)
    else:
        lo = 0
        diag = 0
    return lo, diag, tl.maximum(diag, full)


@triton.jit
def _tile_and_head(n, n_heads, BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Decode a 1-D program id into (tile index along the sequence, batch * head index).

    A 1-D grid has no 65,535 limit on batch * heads. Heads vary fastest so that the first wave runs the
    same tile of every head; with ``HEAVY_LAST`` (causal query tiles, whose work grows with the index)
    the order of tiles is reversed so that the longest programs start first and the tail stays short.
    """
    pid = tl.program_id(0)
    n_bh = tl.num_programs(0) // tl.cdiv(n, BLOCK)
    tile = pid // n_bh
    if HEAVY_LAST:
        tile = tl.cdiv(n, BLOCK) - 1 - tile
    return tile, pid % n_bh


@triton.jit
def _key_visible(rows, cols, n_keys, IS_CAUSAL: tl.constexpr):
    """Mask of score entries whose key exists and that causality allows, for query indices ``rows`` and
    key indices ``cols`` already shaped to broadcast (``[:, None]`` / ``[None, :]``, or the transpose).

    Padding rows past ``n_queries`` are left visible in the forward pass: each still sees key 0, so its
    running maximum stays finite (no ``-inf - -inf``), and it is never stored."""
    valid = cols < n_keys
    if IS_CAUSAL:
        valid = valid & (cols <= rows)
    return valid


@triton.jit
def _visible(rows, cols, n_queries, n_keys, IS_CAUSAL: tl.constexpr):
    """:func:`_key_visible` restricted to existing queries (backward: padding rows contribute nothing)."""
    return _key_visible(rows, cols, n_keys, IS_CAUSAL) & (rows < n_queries)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _key_value_descriptors(K, V, b, h, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, n_keys,
                           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tensor descriptors (TMA on Hopper) over one head's K and V, ``BLOCK_N x HEAD_DIM`` boxes: the
    streamed key tiles of the forward and dQ kernels arrive as one bulk copy each instead of per-thread
    asynchronous copies, with rows past ``n_keys`` read as zeros. Needs unit stride along the head dim and
    16-byte aligned heads and rows (``flash_triton._tma_ready``)."""
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[n_keys, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[n_keys, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    return k_desc, v_desc


@triton.jit
def _forward_key_loop(
    acc,
    m_i,
    l_i,
    q,
    k_desc,
    v_desc,
    offs_m,
    lo,
    hi,
    n_keys,
    qk_scale,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
):
    """Online softmax over key tiles ``[lo, hi)``: fold each tile into the running max ``m_i`` (log2
    units), denominator ``l_i`` and accumulator ``acc``."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([start_n, 0])  # keys past the end read as zeros and are masked below
        v = v_desc.load([start_n, 0])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(_key_visible(offs_m[:, None], offs_n[None, :], n_keys, IS_CAUSAL), s, float("-inf"))
        # The maximum of the raw scores is scaled once per row (qk_scale > 0), so the per-element
        # scale and subtraction fuse into one FMA.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = _exp2(s * qk_scale - m_new[:, None], POLY_EXP2, q.dtype)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


FORWARD_PRUNE = _fit_configs(lambda m, n: m, lambda m, n, t: 2 * n)  # Q | K, V


@_autotune(FORWARD_CONFIGS, FORWARD_PRUNE)
@_jit
def flash_forward_kernel(
    Q,
    K,
    V,
    O,
    L,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ln,
    n_heads,
    n_queries,
    n_keys,
    qk_scale,
    SEQ_CLASS,
    HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile_m, pid_bh = _tile_and_head(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_queries

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_desc, v_desc = _key_value_descriptors(K, V, b, h, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                            stride_vn, n_keys, HEAD_DIM, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m_i, l_i = _forward_key_loop(
        acc,
        m_i,
        l_i,
        q,
        k_desc,
        v_desc,
        offs_m,
        0,
        mid,
        n_keys,
        qk_scale,
        BLOCK_N,
        IS_CAUSAL,
        False,
        DOT_PRECISION,
        POLY_EXP2,
    )
    acc, m_i, l_i = _forward_key_loop(
        acc,
        m_i,
        l_i,
        q,
        k_desc,
        v_desc,
        offs_m,
        mid,
        hi,
        n_keys,
        qk_scale,
        BLOCK_N,
        IS_CAUSAL,
        True,
        DOT_PRECISION,
        POLY_EXP2,
    )

    o = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back to natural-log units
    tl.store(L + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@functools.partial(triton.jit, do_not_specialize=["n_heads", "n_queries"])
def flash_backward_preprocess_kernel(
    O,
    DO,
    L,
    LD,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_ln,
    stride_ldbh,
    stride_ldrow,
    n_heads,
    n_queries,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The backward's per-query row pair, float32 ``LD[b * heads + h] = [L · log2(e); D]`` with
    ``D_i = Σ_d dO_id O_id``: both are read per query tile by dK/dV, which loads them as one
    ``2 x BLOCK_M`` tensor-descriptor box (one bulk copy and one barrier wait per tile instead of two),
    and L arrives already in the base-2 units of the kernels' ``exp2``."""
    tile_m, pid_bh = _tile_and_head(n_queries, n_heads, BLOCK_M, False)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < n_queries
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        mask=row_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
        mask=row_ok,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    in_seq = offs_m < n_queries
    lse = tl.load(L + b * stride_lb + h * stride_lh + offs_m * stride_ln, mask=in_seq, other=0.0)
    ld_row = LD + pid_bh.to(tl.int64) * stride_ldbh + offs_m
    tl.store(ld_row, lse * 1.4426950408889634, mask=in_seq)
    tl.store(ld_row + stride_ldrow, delta, mask=in_seq)


@triton.jit
def _dkdv_query_loop(
    dk,
    dv,
    k,
    v,
    q_desc,
    do_desc,
    ld_desc,
    offs_n,
    lo,
    hi,
    n_queries,
    n_keys,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
):
    """Accumulate ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` (unscaled) over query tiles ``[lo, hi)``, working
    on transposed tiles ``Sᵀ = K Qᵀ`` so that no large tile is ever transposed."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([start_m, 0])
        do = do_desc.load([start_m, 0])
        qt = tl.trans(q)
        lse2, delta = tl.split(tl.trans(ld_desc.load([0, start_m])))  # L (base 2), D
        st = tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale - lse2[None, :]
        pt = _exp2(st, POLY_EXP2, k.dtype)
        if MASKED:
            pt = tl.where(_visible(offs_m[None, :], offs_n[:, None], n_queries, n_keys, IS_CAUSAL), pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


# K, V | Q, dO; Q and dO each feed one product plain and one transposed. The descriptor boxes of L and D
# have rows of BLOCK_M floats: with separate 1-D boxes of 16 (64 bytes, under TMA's 128-byte shared-memory
# alignment) the pipeline stages packed misaligned and the kernel faulted (H100, Triton 3.6: "misaligned
# address" at 16 x 64); tiles under 32 query rows stay excluded.
DKDV_PRUNE = _fit_configs(lambda m, n: 2 * n, lambda m, n, t: 2 * t * m,
                          min_block_m=16 if INTERPRETED else 32)


@_autotune(DKDV_CONFIGS, DKDV_PRUNE)
@_jit
def flash_backward_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LD,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_ldbh,
    stride_ldrow,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    n_heads,
    n_queries,
    n_keys,
    qk_scale,
    sm_scale,
    SEQ_CLASS,
    HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (key tile, head): K and V stay in registers while query tiles stream past."""
    # Causal: early key tiles see the most queries, so they go first (no reversal).
    tile_n, pid_bh = _tile_and_head(n_keys, n_heads, BLOCK_N, False)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < n_keys

    k = tl.load(
        K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=key_ok,
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=key_ok,
        other=0.0,
    )
    # The streamed tiles come in through tensor descriptors (TMA on Hopper): one bulk copy per tile
    # instead of per-thread asynchronous copies, rows past the end read as zeros, and no address
    # arithmetic per element. See docs/flash_attention/NOTES.md ("TMA loads in dK/dV"): -20% on this kernel.
    q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[n_queries, HEAD_DIM],
                                       strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[n_queries, HEAD_DIM],
                                        strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM])
    ld_desc = tl.make_tensor_descriptor(LD + pid_bh.to(tl.int64) * stride_ldbh, shape=[2, n_queries],
                                        strides=[stride_ldrow, 1], block_shape=[2, BLOCK_M])

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, diag, tail = _query_ranges(start_n, n_queries, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dk, dv = _dkdv_query_loop(
        dk,
        dv,
        k,
        v,
        q_desc,
        do_desc,
        ld_desc,
        offs_n,
        lo,
        diag,
        n_queries,
        n_keys,
        qk_scale,
        HEAD_DIM,
        BLOCK_M,
        IS_CAUSAL,
        True,
        DOT_PRECISION,
        POLY_EXP2,
    )
    dk, dv = _dkdv_query_loop(
        dk,
        dv,
        k,
        v,
        q_desc,
        do_desc,
        ld_desc,
        offs_n,
        diag,
        tail,
        n_queries,
        n_keys,
        qk_scale,
        HEAD_DIM,
        BLOCK_M,
        IS_CAUSAL,
        False,
        DOT_PRECISION,
        POLY_EXP2,
    )
    dk, dv = _dkdv_query_loop(
        dk,
        dv,
        k,
        v,
        q_desc,
        do_desc,
        ld_desc,
        offs_n,
        tail,
        n_queries,
        n_queries,
        n_keys,
        qk_scale,
        HEAD_DIM,
        BLOCK_M,
        IS_CAUSAL,
        True,
        DOT_PRECISION,
        POLY_EXP2,
    )

    dk_ptrs = (
        DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    )
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_key_loop(
    dq,
    q,
    do,
    lse2,
    delta,
    k_desc,
    v_desc,
    offs_m,
    lo,
    hi,
    n_queries,
    n_keys,
    qk_scale,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
):
    """Accumulate ``dQ += dS K`` (unscaled) over key tiles ``[lo, hi)``."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([start_n, 0])  # keys past the end read as zeros and are masked below
        v = v_desc.load([start_n, 0])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None]
        p = _exp2(s, POLY_EXP2, q.dtype)
        if MASKED:
            p = tl.where(_visible(offs_m[:, None], offs_n[None, :], n_queries, n_keys, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# Q, dO | K, V; K feeds S = Q Kᵀ transposed and dQ = dS K plain, V only dP = dO Vᵀ.
DQ_PRUNE = _fit_configs(lambda m, n: 2 * m, lambda m, n, t: (1 + t) * n)


@_autotune(DQ_CONFIGS, DQ_PRUNE)
@_jit
def flash_backward_dq_kernel(
    Q,
    K,
    V,
    DO,
    LD,
    DQ,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_ldbh,
    stride_ldrow,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    n_heads,
    n_queries,
    n_keys,
    qk_scale,
    sm_scale,
    SEQ_CLASS,
    HEAD_DIM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (query tile, head): Q, dO, L and D stay in registers while key tiles stream past."""
    tile_m, pid_bh = _tile_and_head(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_queries

    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
        mask=row_ok[:, None],
        other=0.0,
    )
    ld_row = LD + pid_bh.to(tl.int64) * stride_ldbh + offs_m
    lse2 = tl.load(ld_row, mask=row_ok, other=0.0)  # L in base-2 units
    delta = tl.load(ld_row + stride_ldrow, mask=row_ok, other=0.0)
    k_desc, v_desc = _key_value_descriptors(K, V, b, h, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                            stride_vn, n_keys, HEAD_DIM, BLOCK_N)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _dq_key_loop(
        dq,
        q,
        do,
        lse2,
        delta,
        k_desc,
        v_desc,
        offs_m,
        0,
        mid,
        n_queries,
        n_keys,
        qk_scale,
        BLOCK_N,
        IS_CAUSAL,
        False,
        DOT_PRECISION,
        POLY_EXP2,
    )
    dq = _dq_key_loop(
        dq,
        q,
        do,
        lse2,
        delta,
        k_desc,
        v_desc,
        offs_m,
        mid,
        hi,
        n_queries,
        n_keys,
        qk_scale,
        BLOCK_N,
        IS_CAUSAL,
        True,
        DOT_PRECISION,
        POLY_EXP2,
    )
    dq_ptrs = (
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
