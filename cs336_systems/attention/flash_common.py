"""Device functions every FlashAttention-2 kernel shares: the base-2 exponentials, loop bounds, masks and
tensor descriptors, plus the decoration mode (compiled, or interpreted on CPU tensors)."""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634

#: Whether these kernels were decorated for the CPU interpreter (``TRITON_INTERPRET=1``).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Sequence lengths and head counts vary from call to call: specializing on their divisibility would
#: compile a new variant for each; the masks handle ragged ends anyway.
_jit = functools.partial(triton.jit,
                         do_not_specialize=["n_heads", "head_group", "n_queries", "n_keys", "SEQ_CLASS"])


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
def _tile_and_head(n, n_heads, head_group, BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Decode a 1-D program id into (tile index along the sequence, batch index, head index), the last two
    as int64 so that offsets computed from them cannot overflow: :func:`_item_tile_and_head` of this program,
    one program per item. A 1-D grid has no 65,535 limit on batch * heads."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n, BLOCK)
    return _item_tile_and_head(pid, n_tiles, tl.num_programs(0) // n_tiles, n_heads, head_group, HEAVY_LAST)


@triton.jit
def _item_tile_and_head(item, n_tiles, n_bh, n_heads, head_group, HEAVY_LAST: tl.constexpr):
    """(tile, batch, head) of work item ``item`` of ``n_tiles * n_bh``: a program's id, or in a persistent grid
    (:func:`_persistent_items`) each item a program takes in turn.

    Items come in groups of ``head_group`` (batch, head) pairs, every tile of a group before the next group
    starts: the operands the group's programs stream (K and V, or Q and dO) then fit in L2 and are read from
    memory about once, not once per tile (``scheduling.heads_per_l2_group`` sizes the group). Inside a group
    heads vary fastest, so a wave runs the same tile of each of its heads; with ``HEAVY_LAST`` (causal query
    tiles, whose work grows with the index) the order of tiles is reversed so that the longest items start
    first and the tail stays short. ``head_group`` = batch * heads is one group: heads fastest over the grid.
    """
    first_bh = (item // (head_group * n_tiles)) * head_group
    size = tl.minimum(head_group, n_bh - first_bh)  # the last group may be smaller
    in_group = item - first_bh * n_tiles  # every earlier group is full
    tile = in_group // size
    if HEAVY_LAST:
        tile = n_tiles - 1 - tile
    pid_bh = first_bh + in_group % size
    return tile, (pid_bh // n_heads).to(tl.int64), (pid_bh % n_heads).to(tl.int64)


@triton.jit
def _persistent_items(n, n_bh, BLOCK: tl.constexpr):
    """``(first, end, step, n_tiles)`` of a persistent program's loop over items: this program takes items
    ``first, first + step, ...`` below ``end``, in the order :func:`_item_tile_and_head` decodes. The grid is
    sized to the GPU (``scheduling.persistent_programs``, ``scheduling.grid``), so a short sequence's many small
    items pay one program's start-up per SM slot, not one per item, and the last wave's tail is at most one item
    per program."""
    n_tiles = tl.cdiv(n, BLOCK)
    return tl.program_id(0), n_tiles * n_bh, tl.num_programs(0), n_tiles


@triton.jit
def program_order_kernel(OUT, n, n_heads, head_group, BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """``OUT[pid] = (tile, batch, head)`` as :func:`_tile_and_head` decodes program ``pid``: the order check."""
    tile, b, h = _tile_and_head(n, n_heads, head_group, BLOCK, HEAVY_LAST)
    pid = tl.program_id(0)
    tl.store(OUT + 3 * pid, tile)
    tl.store(OUT + 3 * pid + 1, b.to(tl.int32))
    tl.store(OUT + 3 * pid + 2, h.to(tl.int32))


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
# The head dimension in slabs. A head dim that is not a power of two runs as a main slab of D_MAIN columns
# plus a tail slab of D_TAIL (0: none), each a power of two of at least 16 (tl.dot's smallest side): 80 as
# 64 + 16, 96 as 64 + 32 (``flash_triton.head_dim_slabs`` chooses them). Every product over the head dim is
# two dots accumulated into one; every tile indexed by it is two tiles. Columns past HEAD_DIM (the true d)
# read as zeros and are never written.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _load_cols(base, rows, stride_row, stride_col, rows_ok, COL0: tl.constexpr, WIDTH: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Rows ``rows`` by columns ``[COL0, COL0 + WIDTH)`` of one head at ``base``; zeros past the sequence
    (``rows_ok``) and past ``HEAD_DIM``."""
    cols = COL0 + tl.arange(0, WIDTH)
    mask = rows_ok[:, None]
    if COL0 + WIDTH > HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    return tl.load(base + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def _store_cols(base, rows, stride_row, stride_col, rows_ok, value, COL0: tl.constexpr, WIDTH: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Store ``value`` (``len(rows) x WIDTH``) at columns ``[COL0, COL0 + WIDTH)``, inside the sequence and
    ``HEAD_DIM`` only."""
    cols = COL0 + tl.arange(0, WIDTH)
    mask = rows_ok[:, None]
    if COL0 + WIDTH > HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    tl.store(base + rows[:, None] * stride_row + cols[None, :] * stride_col, value, mask=mask)


@triton.jit
def _tile(desc, b, h, row, col, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Rows ``[row, row + ROWS)`` by columns ``[col, col + WIDTH)`` of head ``h`` of batch ``b``, through a host-built
    tensor descriptor (TMA on Hopper) over the whole ``(batch, heads, n, HEAD_DIM)`` tensor, read in
    ``1 x 1 x ROWS x WIDTH`` boxes (``flash_triton._head_tiles``). Rows past the head's ``n`` and columns past
    ``HEAD_DIM`` read as zeros. A descriptor built on the host reaches the kernel as a parameter; one built in
    the kernel (``tl.make_tensor_descriptor``) is written to global scratch and fenced by every program, which
    cost the forward 10-16% at about 1,000 tokens (docs/flash_attention/host_descriptors.md)."""
    return desc.load([b, h, row, col]).reshape(ROWS, WIDTH)
