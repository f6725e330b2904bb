"""The FlashAttention forward for Hopper (sm_90) in Gluon, Triton's lower-level dialect: warp-specialized.

Why a second forward kernel. At head dim 64 the forward is bound by the exponentials as much as by the
products (per score: 256 matmul FLOPs on the tensor cores against one ``ex2`` and half a conversion on a
16-per-clock unit), so it only gets fast if the two overlap. Triton's compiler waits for every product
before the arithmetic that reads it, and its automatic warp specialization (``tl.range(...,
warp_specialize=True)``) does not compile attention loops for sm_90 in Triton 3.6 (an assertion in its
Hopper pass; docs/flash_attention/NOTES.md). Gluon states warp roles, shared-memory buffers and barriers
explicitly, so the schedule below is written down rather than hoped for.

One program (CTA) owns ``BLOCK_M`` queries of one head, 64 per consumer warpgroup (``BLOCK_M`` = 192,
three consumers, at head dim 64; 128, two consumers, at 128, where three would not fit shared memory),
and runs these partitions:

- a **producer** warp issues the TMA copies: each consumer's 64 Q rows once, then K and V tiles into a
  ring of ``STAGES`` shared-memory buffers (``kv_ready[s]``: the copy landed, with the byte count
  expected; ``kv_empty[s]``: every consumer is done with buffer ``s``);
- the **consumer** warpgroups run the online softmax of their 64 queries. For key tile ``j`` each issues
  ``S_j = Q K_jᵀ`` and ``O += P_{j-1} V_{j-1}`` asynchronously and waits for ``S_j`` first
  (FlashAttention-3's order). ptxas then moves the wait for ``P_{j-1} V_{j-1}`` up to the start of the
  softmax, so that it can write each converted pair of P_j as soon as it is exponentiated; keeping that
  wait after the exponentials measured slower (docs/flash_attention/NOTES.md, "The Gluon forward").

The consumers never synchronize with each other (only through ``kv_empty``), so one's softmax runs
under the others' products: that is where the overlap of exponentials and products comes from, and why a
third consumer helps at head dim 64. Registers are rebalanced per partition (``setmaxnreg``): the producer
keeps few, the consumers take the rest.

Scope: 16-bit inputs, head dims 64 and 128, contiguous ``(batch, heads, n, d)`` tensors (Q, K and V are
read as 2-D ``(batch·heads·n, d)`` through host-side tensor descriptors; rows of a tile past a head's end
belong to the next head or lie outside the tensor, where TMA reads zeros, and are masked exactly like
the ragged tile of the Triton kernel). :func:`ineligibility` says why a call is not covered, and the
caller (``flash_triton``) then runs the Triton forward, which covers everything. Same outputs as that
kernel: O, and L in natural-log units as ``(batch, heads, n_queries)`` float32. The backward is shared.

``flash_triton`` imports this module only on a Hopper GPU. Gluon has no CPU interpreter, so CI checks the
kernel by compiling it for sm_90 offline (:func:`compile_for_hopper`); the GPU tests check its numerics.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import options
from .launch_cache import FLASH_LAUNCHES
from .launch_plan import plan_constant
from .scheduling import ITEM_OVERHEAD_TILES, grid, heads_per_l2_group, item_key_tiles, schedule_table, sm_count

_LOG2_E = 1.4426950408889634

#: TMA global -> shared copy: ``async_load`` since Triton 3.7, ``async_copy_global_to_shared`` before.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

#: Queries per consumer warpgroup: one ``wgmma`` row block.
ROWS = gl.constexpr(64)

#: ``(BLOCK_M, BLOCK_N, STAGES)`` per head dim, measured on an H100 (docs/flash_attention/NOTES.md): at d=64,
#: 192 queries (three consumers) by 128 keys with a three-deep K/V ring; at d=128, 128 x 128 (192 queries
#: would need 246 KB of shared memory). Four stages tied with three at d=64.
TILES: dict[int, tuple[int, int, int]] = {64: (192, 128, 3), 128: (128, 128, 3)}
#: The tile at short sequences where 192 query rows would pad more than :data:`MAX_PADDING` of the rows.
SHORT_TILES: dict[int, tuple[int, int, int]] = {64: (128, 128, 3)}
#: The persistent kernel's tile where it differs from :data:`TILES`: at d=64 three 160-register consumers spill
#: (244-280 bytes, some inside the key loop) once the item loop's state stays live; two consumers at 240 do not.
PERSISTENT_TILES: dict[int, tuple[int, int, int]] = {64: (128, 128, 3)}
#: The share of padded query rows (past the sequence's end) above which a shorter tile is taken.
MAX_PADDING = 0.125
#: Shared memory one program may take on an H100 or H200 (227 KiB), and what the barriers and alignment add to
#: the tiles' bytes (288-344 bytes in the builds checked; ``compile_for_hopper(...).metadata.shared``).
SHARED_MEMORY = 227 * 1024
_SHARED_SLACK = 1024
#: Warps per consumer partition (one warpgroup: a ``wgmma`` is issued by four warps together).
_CONSUMER_WARPS = gl.constexpr(4)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, q_row0, q_col,
              k_row0, kv_col, n_tiles, t0, q_round, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, PERSISTENT: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """TMA copies of one item: each consumer's Q rows into Q buffer ``q_round % Q_BUFFERS``, then K/V tile ``j`` into
    buffer ``(t0 + j) % STAGES`` once it is free. ``t0``: K/V tiles this program streamed before this item;
    ``q_round``: items before it (a persistent program refills a Q buffer once every consumer has issued its last
    product with it, ``q_empty``: with two buffers, the item before the current one)."""
    slot = q_round % Q_BUFFERS
    if PERSISTENT:  # the first round of each buffer passes at once, as for kv_empty below
        mbarrier.wait(q_empty.index(slot), ((q_round // Q_BUFFERS) & 1) ^ 1)
    mbarrier.expect(q_bar.index(slot), CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        _tma_load(q_desc, [q_row0 + c * ROWS, q_col], q_bar.index(slot), q_smem.index(slot * CONSUMERS + c))
    for j in range(n_tiles):
        t = t0 + j
        stage = t % STAGES
        # Round r of a buffer waits for phase r - 1 of its "empty" barrier; round 0 passes at once
        # (parity 1 names the phase before the first).
        mbarrier.wait(kv_empty.index(stage), ((t // STAGES) & 1) ^ 1)
        ready = kv_ready.index(stage)
        mbarrier.expect(ready, 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row0 + j * BLOCK_N, kv_col], ready, k_smem.index(stage))
        _tma_load(v_desc, [k_row0 + j * BLOCK_N, kv_col], ready, v_smem.index(stage))


@gluon.jit
def _producer_loop(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, schedule,
                   row, n_tiles_m, n_bh, head_group, n_heads, n_keys, q_rows_b, q_rows_h, q_col_h, kv_rows_b, kv_rows_h,
                   kv_col_h, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """A persistent program's copies: its items of ``schedule`` in turn, the ring carried from one to the next,
    so the next item's Q, K and V load while the consumers finish the current one (with two Q buffers, while
    they still compute its scores)."""
    t0 = 0
    for q_round in range(_my_count(schedule, row)):
        bh, start_m = _item(_my_item(schedule, row, q_round), n_tiles_m, n_bh, head_group, BLOCK_M, IS_CAUSAL)
        n_tiles = _key_tiles(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
        b = bh // n_heads
        h = bh % n_heads
        _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                  b * q_rows_b + h * q_rows_h + start_m, h * q_col_h, b * kv_rows_b + h * kv_rows_h, h * kv_col_h,
                  n_tiles, t0, q_round, CONSUMERS, BLOCK_N, STAGES, True, Q_BUFFERS)
        t0 += n_tiles


@gluon.jit
def _mask_scores(s, offs_m, start_n, n_keys, s_cols: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """-inf where the key lies past the sequence or (causal) after the query."""
    offs_n = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=s_cols), 0)
    visible = offs_n < n_keys
    if IS_CAUSAL:
        visible = visible & (offs_n <= gl.expand_dims(offs_m, 1))
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _consumer(part, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on, start_m,
              n_queries, n_keys, n_tiles, qk_scale, t0, q_round, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """Online softmax of queries ``[start_m + part·ROWS, +ROWS)`` over ``n_tiles`` key tiles, which the ring holds
    from its ``t0``-th tile on; ``q_round``: items this program finished before (see :func:`_producer`)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    first = start_m + part * ROWS
    # Key tiles [0, unmasked) need no mask: inside the sequence and (causal) before every query here.
    unmasked = (n_keys // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        unmasked = gl.minimum(((first + 1) // BLOCK_N) * BLOCK_N, unmasked)
    slot = q_round % Q_BUFFERS
    q_tile = q_smem.index(slot * (q_smem.shape[0] // Q_BUFFERS) + part)
    offs_m = first + gl.arange(0, ROWS, layout=s_rows)
    no_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Tile 0 on its own: there is no previous P·V to overlap with yet.
    mbarrier.wait(q_bar.index(slot), (q_round // Q_BUFFERS) & 1)
    mbarrier.wait(kv_ready.index(t0 % STAGES), (t0 // STAGES) & 1)
    s = warpgroup_mma(q_tile, k_smem.index(t0 % STAGES).permute((1, 0)), no_acc, use_acc=False)
    if unmasked <= 0:
        s = _mask_scores(s, offs_m, 0, n_keys, s_cols, BLOCK_N, IS_CAUSAL)
    m_i = gl.max(s, 1) * qk_scale  # running max of the scaled scores (base 2); qk_scale > 0
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_tiles):
        t = t0 + j
        stage = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(kv_ready.index(stage), (t // STAGES) & 1)
        s_token = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), no_acc, use_acc=False, is_async=True)
        o_token = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_token])  # S_j is done; P_{j-1} V_{j-1} may still run
        if j * BLOCK_N >= unmasked:
            s = _mask_scores(s, offs_m, j * BLOCK_N, n_keys, s_cols, BLOCK_N, IS_CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc, p_op = warpgroup_mma_wait(0, deps=[o_token, p_op])
        mbarrier.arrive(kv_empty.index(prev))  # this warpgroup has read K_{j-1} and V_{j-1}
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    if PERSISTENT:
        mbarrier.arrive(q_empty.index(slot))  # every S of this item is done: the producer may refill its Q buffer
    last = (t0 + n_tiles - 1) % STAGES
    acc = warpgroup_mma(p_op, v_smem.index(last), acc)
    if PERSISTENT:
        mbarrier.arrive(kv_empty.index(last))  # a one-item program ends here and never needs it back
    o = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    rows = first + gl.arange(0, ROWS, layout=o_rows)
    cols = gl.arange(0, HEAD_DIM, layout=o_cols)
    o_ptrs = O + o_head + gl.expand_dims(rows, 1).to(gl.int64) * stride_on + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, o.to(dtype), mask=gl.expand_dims(rows < n_queries, 1))
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634  # natural-log units, as the interface requires
    gl.store(L + bh * n_queries + offs_m, lse, mask=offs_m < n_queries)


@gluon.jit
def _consumer_loop(part, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                   n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh, stride_on,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """A persistent program's consumer: :func:`_consumer` over its items of ``schedule``, following the producer
    through the ring."""
    t0 = 0
    for q_round in range(_my_count(schedule, row)):
        bh, start_m = _item(_my_item(schedule, row, q_round), n_tiles_m, n_bh, head_group, BLOCK_M, IS_CAUSAL)
        n_tiles = _key_tiles(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
        o_head = (bh // n_heads).to(gl.int64) * stride_ob + (bh % n_heads).to(gl.int64) * stride_oh
        _consumer(part, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                  start_m, n_queries, n_keys, n_tiles, qk_scale, t0, q_round, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                  True, Q_BUFFERS)
        t0 += n_tiles


@gluon.jit
def _my_count(schedule, row):
    """How many items this program takes: the first entry of its row of ``schedule`` (int32, ``programs`` rows of
    ``row`` entries: the count, then the items; :func:`persistent_schedule`)."""
    return gl.load(schedule + gl.program_id(0) * row)


@gluon.jit
def _my_item(schedule, row, r):
    """This program's item number ``r`` (its row's start recomputed per item, not kept: registers are scarce)."""
    return gl.load(schedule + gl.program_id(0) * row + 1 + r)


@gluon.jit
def _item(item, n_tiles_m, n_bh, head_group, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(batch * head, first query)`` of (query tile, head) item ``item``, in the order the Triton
    kernels decode programs (``flash_common._tile_and_head``): groups of ``head_group`` heads whose K and V fit in
    L2, every tile of a group before the next; inside a group heads fastest, and causal: the longest tiles first."""
    first_bh = (item // (head_group * n_tiles_m)) * head_group
    size = gl.minimum(head_group, n_bh - first_bh)
    in_group = item - first_bh * n_tiles_m
    tile_m = in_group // size
    if IS_CAUSAL:
        tile_m = n_tiles_m - 1 - tile_m
    bh = first_bh + in_group % size
    return bh, tile_m * BLOCK_M


@gluon.jit
def _key_tiles(start_m, n_keys, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Key tiles the queries ``[start_m, start_m + BLOCK_M)`` attend to (causal: none past the last query)."""
    if IS_CAUSAL:
        return gl.cdiv(gl.minimum(start_m + BLOCK_M, n_keys), BLOCK_N)
    return gl.cdiv(n_keys, BLOCK_N)


@gluon.jit
def flash_forward_gluon_kernel(q_desc, k_desc, v_desc, O, L, n_queries, n_keys, qk_scale, n_heads, head_group,
                               q_rows_b, q_rows_h, q_col_h, kv_rows_b, kv_rows_h, kv_col_h,
                               stride_ob, stride_oh, stride_on,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """One program per (query tile, head) item."""
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS
    gl.static_assert(BLOCK_M == 128 or BLOCK_M == 192, "BLOCK_M: two or three consumer warpgroups of 64 queries")
    pid = gl.program_id(0)
    n_tiles_m = gl.cdiv(n_queries, BLOCK_M)
    bh, start_m = _item(pid, n_tiles_m, gl.num_programs(0) // n_tiles_m, head_group, BLOCK_M, IS_CAUSAL)
    # Where this head's rows lie in the 2-D views the descriptors read (see ``_Placement``), and its O.
    b = bh // n_heads
    h = bh % n_heads
    q_row0 = b * q_rows_b + h * q_rows_h + start_m
    k_row0 = b * kv_rows_b + h * kv_rows_h
    o_head = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    n_tiles = _key_tiles(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # One item per program: Q is never refilled, so no q_empty barrier (q_bar stands in, never waited on as one).
    q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty = _buffers(q_desc, k_desc, v_desc, CONSUMERS, STAGES,
                                                                          False, 1)

    # Registers per thread after ``setmaxnreg`` (the first consumer, the default partition, keeps what is
    # left): the producer warp needs few; a consumer holds S (64 x 128 float32), P and O. Three consumer
    # warpgroups and the producer's warpgroup must share 64K registers: 160 per consumer thread.
    # The lists are spelled out because ``warp_specialize`` takes a literal list of (function, arguments)
    # pairs: with Triton 3.9 an argument tuple built once and extended per consumer (``(0,) + args``) turns
    # its constexprs into tuple elements, and a pair held in a variable does not compile.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                         start_m, n_queries, n_keys, n_tiles, qk_scale, 0, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                         False, 1)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                         start_m, n_queries, n_keys, n_tiles, qk_scale, 0, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                         False, 1)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                         q_row0, h * q_col_h, k_row0, h * kv_col_h, n_tiles, 0, 0, CONSUMERS, BLOCK_N, STAGES, False,
                         1)),
        ], [_CONSUMER_WARPS, 1], [232, 40])  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                         start_m, n_queries, n_keys, n_tiles, qk_scale, 0, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                         False, 1)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                         start_m, n_queries, n_keys, n_tiles, qk_scale, 0, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                         False, 1)),
            (_consumer, (2, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, bh, o_head, stride_on,
                         start_m, n_queries, n_keys, n_tiles, qk_scale, 0, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL,
                         False, 1)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                         q_row0, h * q_col_h, k_row0, h * kv_col_h, n_tiles, 0, 0, CONSUMERS, BLOCK_N, STAGES, False,
                         1)),
        ], [_CONSUMER_WARPS, _CONSUMER_WARPS, 1], [160, 160, 24])  # fmt: skip


@gluon.jit
def flash_forward_gluon_persistent_kernel(q_desc, k_desc, v_desc, O, L, n_queries, n_keys, qk_scale, n_heads,
                                          head_group, q_rows_b, q_rows_h, q_col_h, kv_rows_b, kv_rows_h, kv_col_h,
                                          stride_ob, stride_oh, stride_on, n_bh, schedule, row,
                                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                          STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """A grid of at most one program per SM, each taking the (query tile, head) items in turn (FlashAttention-3's
    persistent schedule). Why: at short rows an item is a few key tiles, and a program per item pays its start,
    its first loads and its epilogue in full each time; here the producer loads the next item's Q, K and V while
    the consumers still finish the current one (``q_empty``, and the K/V ring carried across items). Which items a
    program takes is planned on the host (``schedule``, :func:`persistent_schedule`): dealt in turn, causal items
    of unequal length would leave a tail."""
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS
    gl.static_assert(BLOCK_M == 128 or BLOCK_M == 192, "BLOCK_M: two or three consumer warpgroups of 64 queries")
    n_tiles_m = gl.cdiv(n_queries, BLOCK_M)
    q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty = _buffers(q_desc, k_desc, v_desc, CONSUMERS, STAGES,
                                                                          True, Q_BUFFERS)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer_loop, (0, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                              n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh,
                              stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, Q_BUFFERS)),
            (_consumer_loop, (1, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                              n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh,
                              stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, Q_BUFFERS)),
            (_producer_loop, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                              schedule, row, n_tiles_m, n_bh, head_group, n_heads, n_keys, q_rows_b, q_rows_h, q_col_h,
                              kv_rows_b, kv_rows_h, kv_col_h, CONSUMERS, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL,
                              Q_BUFFERS)),
        ], [_CONSUMER_WARPS, 1], [240, 24])  # 240, not 232: the item loop's state spills less (ptxas -v)  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer_loop, (0, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                              n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh,
                              stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, Q_BUFFERS)),
            (_consumer_loop, (1, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                              n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh,
                              stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, Q_BUFFERS)),
            (_consumer_loop, (2, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty, O, L, schedule, row,
                              n_tiles_m, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, stride_ob, stride_oh,
                              stride_on, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, Q_BUFFERS)),
            (_producer_loop, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty,
                              schedule, row, n_tiles_m, n_bh, head_group, n_heads, n_keys, q_rows_b, q_rows_h, q_col_h,
                              kv_rows_b, kv_rows_h, kv_col_h, CONSUMERS, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL,
                              Q_BUFFERS)),
        ], [_CONSUMER_WARPS, _CONSUMER_WARPS, 1], [160, 160, 24])  # fmt: skip


@gluon.jit
def _buffers(q_desc, k_desc, v_desc, CONSUMERS: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
             Q_BUFFERS: gl.constexpr):
    """Shared memory of a program: ``Q_BUFFERS`` sets of each consumer's Q rows (set ``b`` at ``b·CONSUMERS +
    consumer``), the K/V ring, and their barriers (``q_bar[b]``: Q set ``b`` landed; ``q_empty[b]``: every consumer
    is done with it, persistent programs only; ``kv_ready[s]``, ``kv_empty[s]``: buffer ``s`` landed, is free)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_bar.index(b), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    if PERSISTENT:
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(Q_BUFFERS):
            mbarrier.init(q_empty.index(b), count=CONSUMERS)
    else:
        q_empty = q_bar
    fence_async_shared()
    return q_smem, k_smem, v_smem, q_bar, q_empty, kv_ready, kv_empty


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
#: TMA box coordinates are 32-bit: every row of the 2-D views must be addressable.
_MAX_ROWS = 2**31 - 1


class _Placement(NamedTuple):
    """Where a ``(batch, heads, n, d)`` tensor's rows lie in the 2-D view its tensor descriptor reads: head
    ``h`` of batch ``b`` starts at row ``b·rows_per_batch + h·rows_per_head`` and column ``h·cols_per_head``,
    its ``n`` rows one after another. Rows of a tile past a head's end belong to the next head (or batch) or
    lie outside the view, where TMA reads zeros; the kernel masks them like the Triton forward's ragged tile."""

    shape: tuple[int, int]
    row_stride: int
    rows_per_batch: int
    rows_per_head: int
    cols_per_head: int


def placement(t: Tensor, head_views: bool) -> _Placement | None:
    """``t``'s :class:`_Placement`, or None when one 2-D view cannot hold it: contiguous ``(batch, heads, n, d)``
    (one row per query of each head in turn), or with ``head_views`` the ``(batch, heads, n, d)`` view of a
    ``(batch, n, heads, d)`` tensor (one row per token, the heads side by side in it; the token stride may be
    wider, as in a slice of a fused QKV projection)."""
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    if t.is_contiguous():
        return _Placement((b * h * n, d), d, h * n, n, 0)
    if head_views and sd == 1 and n > 1 and sn >= h * d and (h == 1 or sh == d) and (b == 1 or sb == n * sn):
        return _Placement((b * n, h * d), sn, n, 0, d)
    return None


def ineligibility(q: Tensor, k: Tensor, v: Tensor, capability: tuple[int, int] | None,
                  is_causal: bool = False) -> str | None:
    """Why this kernel does not run these ``(batch, heads, n, d)`` inputs, or None when it does.

    ``capability`` is the GPU's compute capability (None: not a CUDA tensor). ``options.use(gluon=False)``
    turns the kernel off (the Triton forward then runs everywhere), e.g. for A/B comparisons; rows shorter
    than ``options.gluon_min_key_work`` go to the Triton forward because it is faster there.
    """
    opts = options.current()
    if not opts.gluon:
        return "disabled by the options (gluon=False)"
    if capability != (9, 0):
        return f"needs a Hopper GPU (compute capability 9.0), got {capability}"
    if q.dtype not in _GLUON_DTYPES:
        return f"needs float16 or bfloat16, got {q.dtype}"
    d = q.shape[-1]
    if d not in TILES:
        return f"head dim {d} not in {sorted(TILES)}"
    work = k.shape[-2] * d // (2 if is_causal else 1)
    if work < opts.gluon_min_key_work and opts.gluon_persistent is not True:
        return (f"short rows: {k.shape[-2]} keys x head dim {d}{' / 2 (causal)' if is_causal else ''} = {work} < "
                f"gluon_min_key_work = {opts.gluon_min_key_work}, where the Triton forward is faster")
    return layout_problem({"q": q, "k": k, "v": v}, opts.gluon_head_views)


def layout_problem(tensors: dict[str, Tensor], head_views: bool) -> str | None:
    """Why the Gluon kernels cannot read ``tensors`` (named ``(batch, heads, n, d)`` tensors, K and V among
    them) through 2-D tensor descriptors, or None: each must have a :func:`placement`, start on a 16-byte
    boundary with rows of whole 16-byte units and at most 2**31 - 1 rows, and K and V must be laid out alike."""
    places = {}
    for name, t in tensors.items():
        where = places[name] = placement(t, head_views)
        if where is None:
            return (f"{name} is neither contiguous nor a (batch, seq, heads, d) head view" if head_views
                    else f"{name} is not contiguous")
        if t.data_ptr() % 16 or where.row_stride * t.element_size() % 16:
            return f"{name} does not start on a 16-byte boundary or its rows are not whole 16-byte units"
        if where.shape[0] > _MAX_ROWS:
            return f"{name} has more than 2**31 - 1 rows"
    if places["k"][2:] != places["v"][2:]:
        return "k and v are laid out differently"
    return None


def shared_bytes(d: int, tile: tuple[int, int, int], q_buffers: int = 1) -> int:
    """Bytes of shared memory the forward's 16-bit tiles take: ``q_buffers`` sets of BLOCK_M Q rows and ``STAGES`` K
    and V tiles of BLOCK_N rows, each row ``d`` wide (the barriers' few bytes left out)."""
    block_m, block_n, stages = tile
    return (q_buffers * block_m + 2 * stages * block_n) * d * 2


def tile_for(d: int, n_queries: int, persistent: bool = False, q_buffers: int = 1) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, STAGES)`` for head dim ``d`` and ``n_queries`` queries: ``options.gluon_tiles`` if
    it names ``d``; else for the ``persistent`` kernel :data:`PERSISTENT_TILES` where it names ``d``; else
    :data:`TILES`, or :data:`SHORT_TILES` where the longer query tile would leave more than :data:`MAX_PADDING`
    of its rows past the sequence's end (at 256 tokens 192-row tiles compute 384 rows). With ``q_buffers`` = 2 (a
    persistent kernel's second Q buffer, ``options.gluon_q_buffers``) a chosen tile gives up K/V stages until it fits
    :data:`SHARED_MEMORY` (at d = 128 three stages become two); a pinned tile that does not fit is an error."""
    override = dict(options.current().gluon_tiles or ())
    if d in override:
        tile = override[d]
        if shared_bytes(d, tile, q_buffers) + _SHARED_SLACK > SHARED_MEMORY:
            raise ValueError(f"gluon_tiles: {tile} at head dim {d} with {q_buffers} Q buffers needs "
                             f"{shared_bytes(d, tile, q_buffers)} bytes of shared memory, over {SHARED_MEMORY}")
        return tile
    return _fitted(d, _default_tile(d, n_queries, persistent), q_buffers)


def _fitted(d: int, tile: tuple[int, int, int], q_buffers: int) -> tuple[int, int, int]:
    """``tile`` with as many of its K/V stages (at least two) as fit beside ``q_buffers`` Q buffers."""
    while shared_bytes(d, tile, q_buffers) + _SHARED_SLACK > SHARED_MEMORY and tile[2] > 2:
        tile = (tile[0], tile[1], tile[2] - 1)
    return tile


def _default_tile(d: int, n_queries: int, persistent: bool) -> tuple[int, int, int]:
    if persistent and d in PERSISTENT_TILES:
        return PERSISTENT_TILES[d]
    tile = TILES[d]
    short = SHORT_TILES.get(d)
    if short is not None and -(-n_queries // tile[0]) * tile[0] - n_queries > MAX_PADDING * n_queries:
        return short
    return tile


@functools.cache
def _layouts(dtype: torch.dtype, d: int, block_n: int) -> tuple[Any, Any]:
    """Shared-memory layouts of the Q and K/V tiles (computed once per dtype, head dim and key tile: host time)."""
    gl_dtype = _GLUON_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([ROWS.value, d], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, d], gl_dtype))


def flash_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None = None,
                  out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(O, L)`` for inputs that :func:`ineligibility` accepts; L is float32 ``(batch, heads, n_queries)``.
    ``scale`` multiplies the scores (default ``1/sqrt(d)``). ``out``: the ``(O, L)`` to write, O laid out as
    ``torch.empty_like(q)`` and L contiguous (default: new tensors)."""
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    opts = options.current()
    persistent, head_views = opts.persistent_forward(d), opts.gluon_head_views
    q_buffers = opts.gluon_q_buffers if persistent else 1  # a one-item program never refills Q
    block_m, block_n, stages = tile_for(d, n_queries, persistent, q_buffers)
    q_layout, kv_layout = _layouts(q.dtype, d, block_n)
    q_at, kv_at = placement(q, head_views), placement(k, head_views)
    assert q_at is not None and kv_at is not None, "flash_forward needs inputs that ineligibility() accepts"

    def descriptor(t: Tensor, at: _Placement, rows: int, layout: Any) -> Any:
        return TensorDescriptor(t, list(at.shape), [at.row_stride, 1], [rows, d], layout)

    q_desc = descriptor(q, q_at, ROWS.value, q_layout)
    k_desc, v_desc = descriptor(k, kv_at, block_n, kv_layout), descriptor(v, kv_at, block_n, kv_layout)
    if out is None:
        o = torch.empty_like(q)  # the layout of q (a head view stays one)
        lse = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q.device)
    else:
        o, lse = out
    items = -(-n_queries // block_m) * batch * heads
    if items == 0:  # no query rows or no heads: nothing to launch (a plan needs at least one program)
        return o, lse
    group = heads_per_l2_group(batch * heads, 2 * n_keys * d * k.element_size(), q.device)
    args = (q_desc, k_desc, v_desc, o, lse, n_queries, n_keys, _LOG2_E * (scale or 1.0 / math.sqrt(d)), heads, group,
            *q_at[2:], *kv_at[2:], *o.stride()[:3])
    constexprs = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, IS_CAUSAL=is_causal,
                      num_warps=_CONSUMER_WARPS.value)
    if persistent:
        launch_persistent(flash_forward_gluon_persistent_kernel, items, args, {**constexprs, "Q_BUFFERS": q_buffers},
                          batch * heads,
                          lambda programs: persistent_schedule(batch * heads, n_queries, n_keys, group, block_m,
                                                               block_n, is_causal, programs, q.device), q.device)
    else:
        FLASH_LAUNCHES.launch(flash_forward_gluon_kernel, (items,), args, constexprs)
    return o, lse


def launch_persistent(kernel: Any, items: int, args: tuple, constexprs: dict[str, Any], n_bh: int,
                      plan: Callable[[int], Tensor], device: torch.device) -> None:
    """Launch a persistent Gluon ``kernel`` over ``items`` items on ``device``: at most one program per SM (one fits:
    its buffers take the SM's shared memory), given ``args``, then ``n_bh`` and the item table ``plan(programs)`` with
    its row length (the tail of arguments the forward's and the dK/dV kernel's persistent forms share)."""
    programs = grid(items, sm_count(device))
    schedule = plan(programs[0])
    FLASH_LAUNCHES.launch(kernel, programs, (*args, n_bh, schedule, schedule.shape[1]), constexprs)


@functools.cache  # never evicted: a launch plan or a captured CUDA graph may hold a table's address
def persistent_schedule(n_bh: int, n_queries: int, n_keys: int, head_group: int, block_m: int, block_n: int,
                        causal: bool, programs: int, device: torch.device) -> Tensor:
    """The persistent forward's item plan on ``device``: an int32 ``(programs, row)`` table whose row ``p`` holds
    program ``p``'s item count, then its items in turn (:func:`scheduling.list_schedule`, each item weighted by
    its key tiles plus the per-item overhead). Planned once per shape and kept for good, as a launch plan's
    constant: a call that hits the cache copies nothing, so a CUDA graph can capture the launch after a first
    call (a first call inside a capture would copy to the device and fail)."""
    tiles = item_key_tiles(n_bh, -(-n_queries // block_m), head_group, n_keys, block_m, block_n, causal)
    return plan_constant(schedule_table([t + ITEM_OVERHEAD_TILES for t in tiles], programs).to(device))


def compile_for_hopper(head_dim: int, is_causal: bool = True, tile: tuple[int, int, int] | None = None,
                       persistent: bool = False, q_buffers: int = 1):
    """Compile the kernel (``persistent``: its persistent-grid form, with ``q_buffers`` Q buffers) for sm_90 without
    a GPU (``triton.compile`` with an explicit target), as the GPU would on first use, at ``tile`` (default: the
    head dim's long-sequence tile, as :func:`tile_for` fits it); returns Triton's compiled
    kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``). Run it in a process without
    ``TRITON_INTERPRET=1``: Gluon's reductions are Triton functions, and the interpreter replaces those at import."""
    block_m, block_n, stages = tile or _fitted(head_dim, _default_tile(head_dim, 1 << 20, persistent), q_buffers)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "IS_CAUSAL": is_causal, **({"Q_BUFFERS": q_buffers} if persistent else {})}  # fmt: skip
    types = {"q_desc": tensor_descriptor_type(ROWS.value, head_dim), "k_desc": tensor_descriptor_type(block_n, head_dim),
             "v_desc": tensor_descriptor_type(block_n, head_dim), "O": "*bf16", "L": "*fp32", "qk_scale": "fp32"}
    if persistent:
        types["schedule"] = "*i32"
    kernel = flash_forward_gluon_persistent_kernel if persistent else flash_forward_gluon_kernel
    return compile_offline(kernel, types, constexprs, ("O", "L", "schedule") if persistent else ("O", "L"),
                           _CONSUMER_WARPS.value)


def tensor_descriptor_type(rows: int, head_dim: int) -> str:
    """The signature type of a bf16 ``rows x head_dim`` tensor-descriptor argument, for :func:`compile_offline`."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"


def compile_offline(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], pointers: tuple[str, ...],
                    num_warps: int) -> Any:
    """Compile a Gluon ``kernel`` for sm_90 without a GPU: ``types`` gives its non-``i32`` arguments' types
    (every other argument is a 32-bit integer), ``constexprs`` their values, ``pointers`` the arguments aligned to
    16 bytes, as the launcher would specialize them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    types = {**types, **dict.fromkeys(constexprs, "constexpr")}
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
