"""The FlashAttention dK/dV backward for Hopper (sm_90) in Gluon: warp-specialized, like the forward.

Why a second dK/dV kernel. The Triton dK/dV kernel holds one 64-key tile per program and lets Triton
pipeline the Q and dO tiles it streams; the four products per step (``Sᵀ = K Qᵀ``, ``dPᵀ = V dOᵀ``,
``dV += Pᵀ dO``, ``dK += dSᵀ Q``) then wait on each other and on the exponentials between them. Here a
producer warp streams Q and dO, with their ``[L·log2 e; D]`` rows, through a ring of shared-memory buffers
with TMA, and two consumer warpgroups, each owning 64 keys of the program's key tile, share every streamed
tile: one copy of Q and dO feeds ``BLOCK_N`` keys, and one consumer's exponentials run under another's
products (the forward's reason for several consumers, :mod:`.flash_fwd_sm90`). Three consumers spilled at
the registers three warpgroups leave each, and were removed (docs/flash_attention/gluon_backward.md).

Per query tile a consumer issues ``Sᵀ`` and ``dPᵀ`` asynchronously, waits for ``Sᵀ`` only, exponentiates
(``Pᵀ = 2^(Sᵀ·scale·log2 e − L·log2 e)``), issues ``dV += Pᵀ dO`` from registers, then waits for ``dPᵀ``,
forms ``dSᵀ = Pᵀ ∘ (dPᵀ − D)`` and issues ``dK += dSᵀ Q``. Working on transposed score tiles keeps Pᵀ and
dSᵀ in the registers that feed the next products: nothing is transposed through shared memory. A
software-pipelined variant (waiting for a step's dV and dK products only after issuing the next step's
scores) measured slower and was dropped.

``L`` and ``D`` come through the ring rather than by global loads because a profile showed the loads' latency,
and the register spills of holding their results, stalling the consumers at head dim 128
(docs/flash_attention/gluon_backward.md has the profiles, the numbers and what to try next).

Where this kernel runs, by default it also forms dQ (``options.dq_atomic``): the Triton dQ kernel then writes only
the ``[L·log2 e; D]`` row pairs this kernel reads, and this kernel forms dQ's product too, FlashAttention-3's
five-product backward: each consumer puts its ``dSᵀ`` in shared memory, where its dK product reads it, and once
both halves are in, each consumer multiplies its share of ``dS K`` over the program's 128 keys and has the copy
engine add the float32 tile to the dQ sums (a TMA bulk reduction, :func:`_add_dq`). With ``dq_atomic=False`` the
Triton dQ kernel computes dQ as in the Triton backward, for A/B.

It runs on Hopper for rows of at least ``options.gluon_backward_min_keys`` (1,000 keys at head dim 128, 16,384 at
64): there the five-product backward measured faster than the Triton kernels' seven products on an H200, and
slower on shorter rows (256 and 512 keys at head dim 128; docs/flash_attention/dq_atomic.md).

``flash_backward_dkdv_gluon_persistent_kernel`` is the same work on a persistent grid (``options.
gluon_persistent_backward``, off by default until measured): at most one program per SM, each taking the (key tile,
head) items a host plan gives it. The producer issues the next item's first query tiles while the consumers still
work on the current one, and its K and V once both consumers are done with the current ones (``kv_empty``), under
the slower consumer's last step and the dK/dV stores.

Scope: as the Gluon forward (16-bit inputs, head dims 64 and 128, Q, K, V and dO each contiguous or, with
``gluon_head_views``, a head view); :func:`ineligibility` says why a call is not covered, and the Triton dK/dV
kernel then runs.

Gluon has no CPU interpreter: CI compiles the kernel for sm_90 offline (:func:`compile_for_hopper`); the GPU
tests check its numerics against the float64 reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import options
from .flash_fwd_sm90 import (
    _GLUON_DTYPES,
    _my_count,
    _my_item,
    _Placement,
    _tma_load,
    compile_offline,
    launch_persistent,
    layout_problem,
    placement,
    tensor_descriptor_type,
)
from .flash_common import _exp2_fma, _item_tile_and_head, _tile_and_head
from .launch_cache import FLASH_LAUNCHES
from .launch_plan import plan_constant
from .scheduling import ITEM_OVERHEAD_TILES, heads_per_l2_group, key_tile_query_steps, schedule_table

#: Keys per consumer warpgroup: one ``wgmma`` row block of ``Sᵀ``.
ROWS = gl.constexpr(64)
#: ``(BLOCK_M, BLOCK_N, STAGES)`` per head dim: queries per streamed tile, keys per program (64 per consumer),
#: depth of the Q/dO ring. At head dim 128 a consumer holds dK and dV (64 x 128 float32 each) besides Sᵀ and
#: dPᵀ, so the query tile stays at 64.
TILES: dict[int, tuple[int, int, int]] = {64: (64, 128, 3), 128: (64, 128, 2)}
#: Registers per thread of a consumer and of the producer warp (``setmaxnreg``): at head dim 128 a consumer's
#: dK, dV, Sᵀ and dPᵀ nearly fill 240, and 232 spilled more.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
#: How a consumer reads a query tile's ``[L; D]`` rows: the same bytes as the unswizzled layout TMA writes them in
#: (:func:`_ld_layout`), seen as one flat row of ``2 · BLOCK_M`` floats that slices into ``L`` and ``D``.
_LD_ROWS = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
#: Warps per consumer partition (one warpgroup).
_CONSUMER_WARPS = gl.constexpr(4)


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, ld_desc, k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty,
              ready, empty, k_row0, kv_col, q_row0, q_col, do_row0, do_col, ld_row, lo, n_steps, t0, r,
              CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """TMA copies of one item: each consumer's K and V rows once, then query tile ``i`` of Q and dO, with its
    ``[L; D]`` rows, into buffer ``(t0 + i) % STAGES`` once every consumer is done with it. ``t0``: query tiles this
    program streamed before this item; ``r``: items before it. A persistent program refills K and V once every
    consumer is done with them (``kv_empty``), and issues the item's first ``STAGES`` query tiles before that wait:
    they need only their ring buffers, which the consumers free during the previous item."""
    first = 0
    if PERSISTENT:
        first = gl.minimum(n_steps, STAGES)
        for i in range(first):
            _load_query_tile(q_desc, do_desc, ld_desc, q_smem, do_smem, ld_smem, ready, empty, q_row0, q_col, do_row0,
                             do_col, ld_row, lo, i, t0 + i, BLOCK_M, STAGES)
        mbarrier.wait(kv_empty, (r & 1) ^ 1)  # the first item passes at once, as for "empty" below
    mbarrier.expect(kv_bar, 2 * CONSUMERS * k_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        _tma_load(k_desc, [k_row0 + c * ROWS, kv_col], kv_bar, k_smem.index(c))
        _tma_load(v_desc, [k_row0 + c * ROWS, kv_col], kv_bar, v_smem.index(c))
    for i in range(first, n_steps):
        _load_query_tile(q_desc, do_desc, ld_desc, q_smem, do_smem, ld_smem, ready, empty, q_row0, q_col, do_row0,
                         do_col, ld_row, lo, i, t0 + i, BLOCK_M, STAGES)


@gluon.jit
def _load_query_tile(q_desc, do_desc, ld_desc, q_smem, do_smem, ld_smem, ready, empty, q_row0, q_col, do_row0, do_col,
                     ld_row, lo, i, t, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Query tile ``i`` of the item, the ring's tile ``t``: Q, dO and the ``[L; D]`` rows into buffer ``t % STAGES``."""
    stage = t % STAGES
    # Round r of a buffer waits for phase r - 1 of its "empty" barrier; round 0 passes at once.
    mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
    bar = ready.index(stage)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + ld_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row0 + i * BLOCK_M, q_col], bar, q_smem.index(stage))
    _tma_load(do_desc, [do_row0 + i * BLOCK_M, do_col], bar, do_smem.index(stage))
    _tma_load(ld_desc, [ld_row, lo + i * BLOCK_M], bar, ld_smem.index(stage))


@gluon.jit
def _consumer(part: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty,
              ready, empty, ds_bar, DK, DV, dk_head, dv_head, stride_dkn, stride_dvn, dq_desc, dq_row0, start_n, lo,
              n_queries, n_keys, n_steps, qk_scale, sm_scale, t0, r, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, POLY_EXP2: gl.constexpr, CONSUMERS: gl.constexpr,
              PERSISTENT: gl.constexpr):
    """dK and dV of keys ``[start_n + part·ROWS, +ROWS)`` over ``n_steps`` query tiles from ``lo``, which the ring
    holds from its ``t0``-th tile on; with ``dq_desc``, also this consumer's share of each query tile's
    ``dQ = dS K`` (:func:`_add_dq`). ``r``: items this program finished before (see :func:`_producer`)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    first = start_n + part * ROWS
    keys = first + gl.arange(0, ROWS, layout=s_rows)
    key_ok = gl.expand_dims(keys < n_keys, 1)
    k_tile = k_smem.index(part)
    v_tile = v_smem.index(part)
    no_acc = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    # Query tiles that lie inside the sequence and (causal) wholly at or after this warpgroup's last key
    # see every score unmasked.
    clean_from = first + ROWS if IS_CAUSAL else 0
    clean_to = (n_queries // BLOCK_M) * BLOCK_M
    all_keys = first + ROWS <= n_keys

    mbarrier.wait(kv_bar, r & 1)
    for i in range(n_steps):
        t = t0 + i  # the ring's tile count, carried across a persistent program's items
        stage = t % STAGES
        start_m = lo + i * BLOCK_M
        queries = start_m + gl.arange(0, BLOCK_M, layout=s_cols)
        query_ok = queries < n_queries
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        # [L·log2 e; D] of these queries (zero past the sequence), as two plain rows: TMA writes them unswizzled
        ld_rows = ld_smem.index(stage)._reinterpret(gl.float32, [2 * BLOCK_M], _LD_ROWS)
        lse2 = ld_rows.slice(0, BLOCK_M).load(s_cols)  # read while Sᵀ's product runs
        st_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), no_acc, use_acc=False, is_async=True)
        dpt_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), no_acc, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st_token])  # Sᵀ is done; dPᵀ may still run
        x = st * qk_scale - gl.expand_dims(lse2, 0)
        if POLY_EXP2:  # on the FMA pipe (flash_common._exp2_fma) instead of MUFU
            pt = _exp2_fma(x)
        else:
            pt = gl.exp2(x)
        if (start_m < clean_from) or (start_m + BLOCK_M > clean_to) or (not all_keys):
            visible = key_ok & gl.expand_dims(query_ok, 0)
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(queries, 0) >= gl.expand_dims(keys, 1))
            pt = gl.where(visible, pt, 0.0)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_token = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        delta = ld_rows.slice(BLOCK_M, BLOCK_M).load(s_cols)  # read while dPᵀ's product finishes
        dpt = warpgroup_mma_wait(1, deps=[dpt_token])  # dPᵀ is done; dV's product may still run
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        if dq_desc is None:
            dst_op = gl.convert_layout(dst.to(dtype), op_layout)
            dk_token = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, pt_op, dst_op])
        else:
            # dSᵀ goes through shared memory: dK's product reads it there, and so do both consumers' dQ
            # products, which need the program's whole key tile (this consumer's 64 keys and the other's).
            ds_tile = ds_smem.index((t % 2) * CONSUMERS + part)
            ds_tile.store(dst.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_bar.index(t % 2))
            dk_token = warpgroup_mma(ds_tile, q_tile, dk, is_async=True)
            dv, dk, pt_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, pt_op])  # frees Pᵀ's registers
            _add_dq(ds_smem, k_smem, dq_smem, ds_bar, dq_desc, dq_row0, t, start_m, part, HEAD_DIM, BLOCK_M,
                    CONSUMERS)
        mbarrier.arrive(empty.index(stage))  # this warpgroup has read Q_i and dO_i
    if PERSISTENT:
        mbarrier.arrive(kv_empty)  # every product with this item's K and V is done: the next item's may load

    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    acc_cols: gl.constexpr = gl.SliceLayout(0, acc_layout)
    rows = gl.expand_dims(first + gl.arange(0, ROWS, layout=acc_rows), 1)
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=acc_cols), 0)
    rows_ok = rows < n_keys
    gl.store(DK + dk_head + rows.to(gl.int64) * stride_dkn + cols, (dk * sm_scale).to(dtype), mask=rows_ok)
    gl.store(DV + dv_head + rows.to(gl.int64) * stride_dvn + cols, dv.to(dtype), mask=rows_ok)
    if not PERSISTENT and dq_desc is not None:
        tma.store_wait(0)  # the last reduction has read its staging tile before the program ends


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduction: add the shared-memory tile ``src`` to the tensor at ``coord`` (float32 adds done by the
    copy engine, ``cp.reduce.async.bulk.tensor``), asynchronously like a TMA store; ``tma.store_wait`` covers it.
    Triton 3.6's Gluon builds this operation but wraps it in no public function."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


@gluon.jit
def _add_dq(ds_smem, k_smem, dq_smem, ds_bar, dq_desc, dq_row0, i, start_m, part: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr):
    """Add ``dS K`` over the program's key tile for ring step ``i`` (query rows from ``start_m``) to the float32 dQ
    sums behind ``dq_desc``, unscaled: FlashAttention-3's fifth product. The tile goes to shared memory and the
    copy engine adds it (:func:`_tma_reduce_add`) while the consumer goes on to the next step. The work is split
    so that no consumer holds more than a 64-column float32 tile: at head dim 128 each consumer takes 64 of the
    columns, at 64 the consumers take whole query tiles in turn. Buffer ``i % 2`` of ``ds_smem`` holds every
    consumer's ``dSᵀ`` rows, ``[keys, queries]``, read here transposed once all are in."""
    COLS: gl.constexpr = dq_desc.block_type.shape[1]
    SPLIT: gl.constexpr = COLS < HEAD_DIM
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
    mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)  # every consumer's dSᵀ rows are in
    if SPLIT or (i % CONSUMERS == part):
        col0: gl.constexpr = part * COLS if SPLIT else 0
        dq = gl.zeros([BLOCK_M, COLS], gl.float32, dq_layout)
        for c in gl.static_range(CONSUMERS):
            ds_t = ds_smem.index((i % 2) * CONSUMERS + c).permute((1, 0))  # dS: [queries, keys c]
            dq = warpgroup_mma(ds_t, k_smem.index(c).slice(col0, COLS, dim=1), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq])
        staging = dq_smem.index(part)
        tma.store_wait(0)  # this consumer's previous reduction has read the staging tile
        staging.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [dq_row0 + start_m, col0], staging)


@gluon.jit
def flash_backward_dkdv_gluon_kernel(k_desc, v_desc, q_desc, do_desc, ld_desc, DK, DV, dq_desc, n_queries, n_keys,
                                     qk_scale, sm_scale, n_heads, head_group, kv_rows_b, kv_rows_h, kv_col_h, q_rows_b,
                                     q_rows_h, q_col_h, do_rows_b, do_rows_h, do_col_h, stride_dkb, stride_dkh,
                                     stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                     STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, POLY_EXP2: gl.constexpr):
    CONSUMERS: gl.constexpr = BLOCK_N // ROWS
    gl.static_assert(BLOCK_N == 128, "BLOCK_N: two consumer warpgroups of 64 keys")
    # Program -> (key tile, batch, head) as the Triton dK/dV kernel decodes it: groups of ``head_group`` heads
    # whose Q, dO and [L; D] fit in L2, heads fastest inside a group; causal key tiles in order, since the first
    # see the most queries.
    tile_n, b64, h64 = _tile_and_head(n_keys, n_heads, head_group, BLOCK_N, False)
    b = b64.to(gl.int32)  # descriptor coordinates are 32-bit
    h = h64.to(gl.int32)
    bh = b * n_heads + h
    start_n = tile_n * BLOCK_N
    lo, n_steps = _query_range(start_n, n_queries, BLOCK_M, IS_CAUSAL)
    k_row0 = b * kv_rows_b + h * kv_rows_h + start_n
    q_row0 = b * q_rows_b + h * q_rows_h + lo
    do_row0 = b * do_rows_b + h * do_rows_h + lo
    dk_head = b.to(gl.int64) * stride_dkb + h.to(gl.int64) * stride_dkh
    dv_head = b.to(gl.int64) * stride_dvb + h.to(gl.int64) * stride_dvh

    if dq_desc is not None:
        dq_row0 = bh * gl.cdiv(n_queries, BLOCK_M) * BLOCK_M  # each head's sums padded to whole query tiles
    else:
        dq_row0 = 0
    k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty, ready, empty, ds_smem, dq_smem, ds_bar = _buffers(
        k_desc, v_desc, q_desc, do_desc, ld_desc, dq_desc, CONSUMERS, BLOCK_M, STAGES, False)

    # Register budgets as in the forward: the producer warp keeps few, the consumers share the rest.
    # ``warp_specialize`` takes a literal list of (function, arguments) pairs (see flash_fwd_sm90).
    gl.warp_specialize([
        (_consumer, (0, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready, empty,
                     ds_bar, DK, DV, dk_head, dv_head, stride_dkn, stride_dvn, dq_desc, dq_row0, start_n, lo,
                     n_queries, n_keys, n_steps, qk_scale, sm_scale, 0, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL,
                     POLY_EXP2, CONSUMERS, False)),
        (_consumer, (1, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready, empty,
                     ds_bar, DK, DV, dk_head, dv_head, stride_dkn, stride_dvn, dq_desc, dq_row0, start_n, lo,
                     n_queries, n_keys, n_steps, qk_scale, sm_scale, 0, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL,
                     POLY_EXP2, CONSUMERS, False)),
        (_producer, (k_desc, v_desc, q_desc, do_desc, ld_desc, k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar,
                     kv_empty, ready, empty, k_row0, h * kv_col_h, q_row0, h * q_col_h, do_row0, h * do_col_h, 2 * bh,
                     lo, n_steps, 0, 0, CONSUMERS, BLOCK_M, STAGES, False)),
    ], [_CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


@gluon.jit
def _query_range(start_n, n_queries, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(lo, n_steps)``: the first query and the count of query tiles keys from ``start_n`` on see (causal: none
    before the query tile holding ``start_n``)."""
    if IS_CAUSAL:
        lo = gl.minimum((start_n // BLOCK_M) * BLOCK_M, n_queries)
    else:
        lo = 0
    return lo, gl.cdiv(n_queries - lo, BLOCK_M)


@gluon.jit
def _producer_loop(k_desc, v_desc, q_desc, do_desc, ld_desc, k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty,
                   ready, empty, schedule, row, n_tiles_n, n_bh, head_group, n_heads, n_queries, kv_rows_b, kv_rows_h,
                   kv_col_h, q_rows_b, q_rows_h, q_col_h, do_rows_b, do_rows_h, do_col_h, CONSUMERS: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """A persistent program's copies: its items of ``schedule`` in turn, the Q/dO ring carried from one to the next,
    so the next item's first query tiles, then its K and V, load while the consumers finish the current one."""
    t0 = 0
    for r in range(_my_count(schedule, row)):
        tile_n, b64, h64 = _item_tile_and_head(_my_item(schedule, row, r), n_tiles_n, n_bh, n_heads, head_group, False)
        b = b64.to(gl.int32)  # descriptor coordinates are 32-bit
        h = h64.to(gl.int32)
        start_n = tile_n * BLOCK_N
        lo, n_steps = _query_range(start_n, n_queries, BLOCK_M, IS_CAUSAL)
        _producer(k_desc, v_desc, q_desc, do_desc, ld_desc, k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty,
                  ready, empty, b * kv_rows_b + h * kv_rows_h + start_n, h * kv_col_h, b * q_rows_b + h * q_rows_h + lo,
                  h * q_col_h, b * do_rows_b + h * do_rows_h + lo, h * do_col_h, 2 * (b * n_heads + h), lo, n_steps, t0,
                  r, CONSUMERS, BLOCK_M, STAGES, True)
        t0 += n_steps


@gluon.jit
def _consumer_loop(part: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty,
                   ready, empty, ds_bar, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                   dq_desc, schedule, row, n_tiles_n, n_bh, head_group, n_heads, n_queries, n_keys, qk_scale, sm_scale,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, POLY_EXP2: gl.constexpr, CONSUMERS: gl.constexpr):
    """A persistent program's consumer: :func:`_consumer` over its items of ``schedule``, following the producer
    through the ring."""
    t0 = 0
    for r in range(_my_count(schedule, row)):
        tile_n, b, h = _item_tile_and_head(_my_item(schedule, row, r), n_tiles_n, n_bh, n_heads, head_group, False)
        start_n = tile_n * BLOCK_N
        lo, n_steps = _query_range(start_n, n_queries, BLOCK_M, IS_CAUSAL)
        dq_row0 = (b * n_heads + h).to(gl.int32) * gl.cdiv(n_queries, BLOCK_M) * BLOCK_M  # see the one-item kernel
        _consumer(part, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready, empty,
                  ds_bar, DK, DV, b * stride_dkb + h * stride_dkh, b * stride_dvb + h * stride_dvh, stride_dkn,
                  stride_dvn, dq_desc, dq_row0, start_n, lo, n_queries, n_keys, n_steps, qk_scale, sm_scale, t0, r,
                  HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, POLY_EXP2, CONSUMERS, True)
        t0 += n_steps
    if dq_desc is not None:
        tma.store_wait(0)  # the last reduction has read its staging tile before the program ends


@gluon.jit
def flash_backward_dkdv_gluon_persistent_kernel(k_desc, v_desc, q_desc, do_desc, ld_desc, DK, DV, dq_desc, n_queries,
                                                n_keys, qk_scale, sm_scale, n_heads, head_group, kv_rows_b, kv_rows_h,
                                                kv_col_h, q_rows_b, q_rows_h, q_col_h, do_rows_b, do_rows_h, do_col_h,
                                                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                                                n_bh, schedule, row, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                                POLY_EXP2: gl.constexpr):
    """A grid of at most one program per SM, each taking the (key tile, head) items of ``schedule`` in turn
    (:func:`persistent_schedule`), as the persistent forward does (:mod:`.flash_fwd_sm90`) and cuDNN's backward
    runs. Why: a one-item program waits for its K and V before its first product and stores dK and dV after its
    last, and only one fits on an SM; here the producer loads the next item's first query tiles during the current
    item, and its K and V (``kv_empty``: both consumers are done with the current ones) while the consumers store.
    Same outputs, item for item, as :func:`flash_backward_dkdv_gluon_kernel`."""
    CONSUMERS: gl.constexpr = BLOCK_N // ROWS
    gl.static_assert(BLOCK_N == 128, "BLOCK_N: two consumer warpgroups of 64 keys")
    n_tiles_n = gl.cdiv(n_keys, BLOCK_N)
    k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty, ready, empty, ds_smem, dq_smem, ds_bar = _buffers(
        k_desc, v_desc, q_desc, do_desc, ld_desc, dq_desc, CONSUMERS, BLOCK_M, STAGES, True)
    gl.warp_specialize([
        (_consumer_loop, (0, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready,
                          empty, ds_bar, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                          stride_dvn, dq_desc, schedule, row, n_tiles_n, n_bh, head_group, n_heads, n_queries, n_keys,
                          qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, POLY_EXP2, CONSUMERS)),
        (_consumer_loop, (1, k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready,
                          empty, ds_bar, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                          stride_dvn, dq_desc, schedule, row, n_tiles_n, n_bh, head_group, n_heads, n_queries, n_keys,
                          qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, POLY_EXP2, CONSUMERS)),
        (_producer_loop, (k_desc, v_desc, q_desc, do_desc, ld_desc, k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar,
                          kv_empty, ready, empty, schedule, row, n_tiles_n, n_bh, head_group, n_heads, n_queries,
                          kv_rows_b, kv_rows_h, kv_col_h, q_rows_b, q_rows_h, q_col_h, do_rows_b, do_rows_h, do_col_h,
                          CONSUMERS, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
    ], [_CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


@gluon.jit
def _buffers(k_desc, v_desc, q_desc, do_desc, ld_desc, dq_desc, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
             STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """Shared memory of a program and its barriers: each consumer's K and V rows (``kv_bar``: landed;
    ``kv_empty``: every consumer is done with them, persistent programs only), the Q/dO/[L; D] ring (``ready[s]``,
    ``empty[s]``), and with ``dq_desc`` the dSᵀ buffers and dQ staging tiles of :func:`_add_dq` (``ds_bar``)."""
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ld_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 2, BLOCK_M], ld_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    if dq_desc is not None:
        # Two buffers of every consumer's dSᵀ rows: a consumer writes step i + 2's only after both have passed
        # step i + 1's barrier, so after both have finished step i's dQ products (which read buffer i % 2).
        ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, ROWS, BLOCK_M], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2))
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_bar.index(i), count=CONSUMERS)
    else:  # unused without dq_desc; warp_specialize takes no None arguments
        ds_smem = kv_bar
        dq_smem = kv_bar
        ds_bar = kv_bar
    if PERSISTENT:
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=CONSUMERS)
    else:  # a one-item program loads K and V once: no refill to wait for (kv_bar stands in, never waited on as one)
        kv_empty = kv_bar
    fence_async_shared()
    return k_smem, v_smem, q_smem, do_smem, ld_smem, kv_bar, kv_empty, ready, empty, ds_smem, dq_smem, ds_bar


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def ineligibility(q: Tensor, k: Tensor, v: Tensor, do: Tensor, dk: Tensor, dv: Tensor,
                  capability: tuple[int, int] | None) -> str | None:
    """Why this kernel does not run these ``(batch, heads, n, d)`` tensors, or None when it does. Rows shorter than
    ``options.gluon_backward_min_keys`` go to the Triton kernels because they are faster there;
    ``options.use(gluon_backward=False)`` sends everything there."""
    opts = options.current()
    if not opts.gluon_backward:
        return "disabled by the options (gluon_backward=False)"
    if capability != (9, 0):
        return f"needs a Hopper GPU (compute capability 9.0), got {capability}"
    if q.dtype not in _GLUON_DTYPES:
        return f"needs float16 or bfloat16, got {q.dtype}"
    d = q.shape[-1]
    if d not in TILES:
        return f"head dim {d} not in {sorted(TILES)}"
    if k.shape[-2] < opts.backward_min_keys(d):
        return (f"rows of {k.shape[-2]} keys, fewer than gluon_backward_min_keys = {opts.backward_min_keys(d)} at "
                f"head dim {d}, where the Triton kernels are faster")
    problem = layout_problem({"q": q, "k": k, "v": v, "do": do}, opts.gluon_head_views)
    if problem is not None:
        return problem
    if dk.stride(-1) != 1 or dv.stride(-1) != 1:
        return "dk and dv need unit stride along the head dim"
    return None


def _polynomial_exp2() -> bool:
    """Whether to exponentiate on the FMA pipe: only where ``options.poly_exp2`` names ``dkdv`` explicitly.
    Unlike the Triton dK/dV kernel (whose tiles default to the polynomial) this one runs ``ex2`` by default:
    with a second consumer's products to overlap, the polynomial's extra FMA work measured slower at both
    head dims (docs/flash_attention/gluon_backward.md)."""
    phases = options.current().poly_exp2
    return phases is not None and "dkdv" in phases


def tile_for(d: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, STAGES)`` for head dim ``d``: ``options.gluon_backward_tiles`` if it names ``d``,
    else :data:`TILES`."""
    for head_dim, tile in options.current().gluon_backward_tiles or ():
        if head_dim == d:
            return tile
    return TILES[d]


def dq_rows(n_queries: int, d: int) -> int:
    """Rows per head of the float32 dQ sums the kernel adds to: whole query tiles, so that a tile's reduction never
    reaches into the next head's rows."""
    block_m = tile_for(d)[0]
    return -(-n_queries // block_m) * block_m


def _dq_cols(d: int) -> int:
    """Columns of dQ per consumer and reduction: half the head dim where that is 64 or more, else all of it."""
    return d // 2 if d // 2 >= 64 else d


@functools.cache
def _ld_layout() -> Any:
    """The shared-memory layout of a query tile's ``[L·log2 e; D]`` rows: unswizzled, since the consumers read
    them as rows, not as a matrix operand."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def _dq_layout(block_m: int, cols: int) -> Any:
    """The shared-memory layout of a consumer's float32 dQ staging tile, as the reduction's descriptor names it."""
    return gl.NVMMASharedLayout.get_default_for([block_m, cols], gl.float32)


@functools.cache
def _layouts(dtype: torch.dtype, d: int, block_m: int) -> tuple[Any, Any]:
    """Shared-memory layouts of the K/V tiles (64 keys) and the streamed Q/dO tiles (``block_m`` queries)."""
    gl_dtype = _GLUON_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([ROWS.value, d], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_m, d], gl_dtype))


def flash_backward_dkdv(q: Tensor, k: Tensor, v: Tensor, do: Tensor, ld: Tensor, dk: Tensor, dv: Tensor,
                        is_causal: bool, scale: float, dq_acc: Tensor | None = None) -> None:
    """Write dK and dV for inputs that :func:`ineligibility` accepts. ``ld``: the float32
    ``(batch * heads, 2, n_queries)`` ``[L·log2 e; D]`` row pairs the Triton dQ kernel wrote, each row on a
    16-byte boundary and the pairs evenly spaced (``flash_triton._row_buffer``). ``dq_acc``: a
    zeroed, contiguous float32 ``(batch, heads, dq_rows(n_queries), d)`` buffer to which the kernel also adds the
    unscaled ``dS K`` (``options.dq_atomic``); the rows past ``n_queries`` receive padding sums."""
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    block_m, block_n, stages = tile_for(d)
    kv_layout, q_layout = _layouts(q.dtype, d, block_m)
    head_views = options.current().gluon_head_views
    q_at, do_at, kv_at = placement(q, head_views), placement(do, head_views), placement(k, head_views)
    assert q_at is not None and do_at is not None and kv_at is not None, "inputs that ineligibility() rejects"

    def descriptor(t: Tensor, at: _Placement, rows: int, layout: Any) -> Any:
        return TensorDescriptor(t, list(at.shape), [at.row_stride, 1], [rows, d], layout)

    k_desc, v_desc = descriptor(k, kv_at, ROWS.value, kv_layout), descriptor(v, kv_at, ROWS.value, kv_layout)
    q_desc, do_desc = descriptor(q, q_at, block_m, q_layout), descriptor(do, do_at, block_m, q_layout)
    assert ld.stride(0) == 2 * ld.stride(1), "[L; D] pairs evenly spaced, as flash_triton._row_buffer makes them"
    ld_desc = TensorDescriptor(ld, [2 * ld.shape[0], n_queries], [ld.stride(1), 1], [2, block_m], _ld_layout())
    dq_desc = None
    if dq_acc is not None:
        cols = _dq_cols(d)
        dq_desc = TensorDescriptor(dq_acc, [dq_acc.numel() // d, d], [d, 1], [block_m, cols],
                                   _dq_layout(block_m, cols))
    items = -(-n_keys // block_n) * batch * heads
    group = heads_per_l2_group(batch * heads, n_queries * (2 * d * q.element_size() + 8), q.device)
    args = (k_desc, v_desc, q_desc, do_desc, ld_desc, dk, dv, dq_desc, n_queries, n_keys, scale * 1.4426950408889634,
            scale, heads, group, *kv_at[2:], *q_at[2:], *do_at[2:], *dk.stride()[:3], *dv.stride()[:3])
    constexprs = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, IS_CAUSAL=is_causal,
                      POLY_EXP2=_polynomial_exp2(), num_warps=_CONSUMER_WARPS.value)
    if not options.current().gluon_persistent_backward:
        FLASH_LAUNCHES.launch(flash_backward_dkdv_gluon_kernel, (items,), args, constexprs)
    elif items:
        launch_persistent(flash_backward_dkdv_gluon_persistent_kernel, items, args, constexprs, batch * heads,
                          lambda programs: persistent_schedule(batch * heads, n_queries, n_keys, group, block_m,
                                                               block_n, is_causal, programs, q.device), q.device)


@functools.cache  # never evicted: a launch plan or a captured CUDA graph may hold a table's address
def persistent_schedule(n_bh: int, n_queries: int, n_keys: int, head_group: int, block_m: int, block_n: int,
                        causal: bool, programs: int, device: torch.device) -> Tensor:
    """The persistent dK/dV kernel's item plan on ``device``, as :func:`.flash_fwd_sm90.persistent_schedule` makes
    the forward's: each (key tile, head) item weighted by the query tiles it streams plus the per-item overhead, and
    kept for good as a launch plan's constant."""
    steps = key_tile_query_steps(n_bh, -(-n_keys // block_n), head_group, n_queries, block_m, block_n, causal)
    return plan_constant(schedule_table([s + ITEM_OVERHEAD_TILES for s in steps], programs).to(device))


def compile_for_hopper(head_dim: int, is_causal: bool = True, tile: tuple[int, int, int] | None = None,
                       poly: bool = False, dq_acc: bool = False, persistent: bool = False):
    """Compile the kernel (``persistent``: its persistent-grid form) for sm_90 without a GPU, as
    :func:`.flash_fwd_sm90.compile_for_hopper` does for the forward (same caveat: not under ``TRITON_INTERPRET=1``);
    returns Triton's compiled kernel."""
    block_m, block_n, stages = tile or TILES[head_dim]
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                  "IS_CAUSAL": is_causal, "POLY_EXP2": poly}
    types = {"k_desc": tensor_descriptor_type(ROWS.value, head_dim), "v_desc": tensor_descriptor_type(ROWS.value, head_dim),
             "q_desc": tensor_descriptor_type(block_m, head_dim), "do_desc": tensor_descriptor_type(block_m, head_dim),
             "ld_desc": f"tensordesc<fp32[2, {block_m}],{_ld_layout()!r}>",
             "DK": "*bf16", "DV": "*bf16", "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
    if dq_acc:
        cols = _dq_cols(head_dim)
        types["dq_desc"] = f"tensordesc<fp32[{block_m}, {cols}],{_dq_layout(block_m, cols)!r}>"
    else:
        constexprs["dq_desc"] = None
    if persistent:
        types["schedule"] = "*i32"
        return compile_offline(flash_backward_dkdv_gluon_persistent_kernel, types, constexprs,
                               ("DK", "DV", "schedule"), _CONSUMER_WARPS.value)
    return compile_offline(flash_backward_dkdv_gluon_kernel, types, constexprs, ("DK", "DV"),
                           _CONSUMER_WARPS.value)
