"""The FlashAttention-2 backward kernels in Triton: dQ over query tiles, which also writes the ``[L; D]`` row
pairs, then dK/dV over key tiles, which reads them (no atomics, no separate preprocess)."""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_common import (
    INTERPRETED,
    _exp2,
    _item_tile_and_head,
    _jit,
    _key_ranges,
    _load_cols,
    _persistent_items,
    _query_ranges,
    _store_cols,
    _tile,
    _tile_and_head,
    _visible,
)

# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_query_loop(
    dk,
    dv,
    dk_t,
    dv_t,
    k,
    v,
    k_t,
    v_t,
    q_desc,
    do_desc,
    qt_desc,
    dot_desc,
    ld_desc,
    b,
    h,
    bh,
    offs_n,
    lo,
    hi,
    n_queries,
    n_keys,
    qk_scale,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
    DQ_ACC,
    HEAD_DIM: tl.constexpr,
):
    """Accumulate ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` (unscaled; ``dk_t``, ``dv_t``: the tail slab) over
    query tiles ``[lo, hi)``, working on transposed tiles ``Sᵀ = K Qᵀ`` so that no large tile is ever
    transposed. With ``DQ_ACC`` (float32, ``(batch * heads, n_queries, HEAD_DIM)`` contiguous) also add each
    query tile's ``dS K`` to it atomically: the fifth product, which makes the dQ kernel's three unneeded."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _tile(q_desc, b, h, start_m, 0, BLOCK_M, D_MAIN)
        do = _tile(do_desc, b, h, start_m, 0, BLOCK_M, D_MAIN)
        lse2, delta = tl.split(tl.trans(ld_desc.load([bh, 0, start_m]).reshape(2, BLOCK_M)))  # L (base 2), D
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            q_t = _tile(qt_desc, b, h, start_m, D_MAIN, BLOCK_M, D_TAIL)
            do_t = _tile(dot_desc, b, h, start_m, D_MAIN, BLOCK_M, D_TAIL)
            st = tl.dot(k_t, tl.trans(q_t), st, input_precision=DOT_PRECISION)
        pt = _exp2(st * qk_scale - lse2[None, :], POLY_EXP2, k.dtype)
        if MASKED:
            pt = tl.where(_visible(offs_m[None, :], offs_n[:, None], n_queries, n_keys, IS_CAUSAL), pt, 0.0)
        pt_in = pt.to(do.dtype)
        dv = tl.dot(pt_in, do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            dv_t = tl.dot(pt_in, do_t, dv_t, input_precision=DOT_PRECISION)
            dpt = tl.dot(v_t, tl.trans(do_t), dpt, input_precision=DOT_PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            dk_t = tl.dot(dst, q_t, dk_t, input_precision=DOT_PRECISION)
        if DQ_ACC is not None:
            ds = tl.trans(dst)
            rows = DQ_ACC + (bh.to(tl.int64) * n_queries + offs_m[:, None]) * HEAD_DIM
            row_ok = offs_m[:, None] < n_queries
            cols = tl.arange(0, D_MAIN)[None, :]
            main_ok = row_ok & (cols < HEAD_DIM) if D_MAIN > HEAD_DIM else row_ok  # a padded slab: not past d
            tl.atomic_add(rows + cols, tl.dot(ds, k, input_precision=DOT_PRECISION), mask=main_ok, sem="relaxed")
            if D_TAIL > 0:
                cols = D_MAIN + tl.arange(0, D_TAIL)[None, :]
                tl.atomic_add(rows + cols, tl.dot(ds, k_t, input_precision=DOT_PRECISION),
                              mask=row_ok & (cols < HEAD_DIM), sem="relaxed")
    return dk, dv, dk_t, dv_t


# K, V | Q, dO; Q and dO each feed one product plain and one transposed. The descriptor boxes of L and D
# have rows of BLOCK_M floats: with separate 1-D boxes of 16 (64 bytes, under TMA's 128-byte shared-memory
# alignment) the pipeline stages packed misaligned and the kernel faulted (H100, Triton 3.6: "misaligned
# address" at 16 x 64); tiles under 32 query rows stay excluded.
DKDV_SMEM = (lambda m, n: 2 * n, lambda m, n, t: 2 * t * m, 16 if INTERPRETED else 32)
#: dK/dV's tensor descriptors and the tile side each streams along (``LD_DESC``: ``1 x 2 x BLOCK_M`` boxes).
DKDV_DESCRIPTORS = {"Q_DESC": "BLOCK_M", "DO_DESC": "BLOCK_M", "QT_DESC": "BLOCK_M", "DOT_DESC": "BLOCK_M",
                    "LD_DESC": "BLOCK_M"}


@_jit
def flash_backward_dkdv_kernel(
    K, V, Q_DESC, DO_DESC, QT_DESC, DOT_DESC, LD_DESC, DK, DV, DQ_ACC,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, head_group, n_queries, n_keys, qk_scale, sm_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    """One program per (key tile, head), or with ``PERSISTENT`` a grid sized to the GPU whose programs take the
    items in turn (:func:`flash_common._persistent_items`): K and V stay in registers while query tiles stream
    past."""
    # Causal: early key tiles see the most queries, so they go first (no reversal).
    if PERSISTENT:
        first, end, step, n_tiles = _persistent_items(n_keys, Q_DESC.shape[0] * n_heads, BLOCK_N)
        for item in range(first, end, step):
            tile_n, b, h = _item_tile_and_head(item, n_tiles, end // n_tiles, n_heads, head_group, False)
            _dkdv_tile(tile_n, b, h, K, V, Q_DESC, DO_DESC, QT_DESC, DOT_DESC, LD_DESC, DK, DV, stride_kb,
                       stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dkb,
                       stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, n_heads,
                       n_queries, n_keys, qk_scale, sm_scale, HEAD_DIM, D_MAIN, D_TAIL, IS_CAUSAL, DOT_PRECISION,
                       POLY_EXP2, BLOCK_M, BLOCK_N, DQ_ACC)
    else:
        tile_n, b, h = _tile_and_head(n_keys, n_heads, head_group, BLOCK_N, False)
        _dkdv_tile(tile_n, b, h, K, V, Q_DESC, DO_DESC, QT_DESC, DOT_DESC, LD_DESC, DK, DV, stride_kb, stride_kh,
                   stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dkb, stride_dkh,
                   stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, n_heads, n_queries,
                   n_keys, qk_scale, sm_scale, HEAD_DIM, D_MAIN, D_TAIL, IS_CAUSAL, DOT_PRECISION, POLY_EXP2,
                   BLOCK_M, BLOCK_N, DQ_ACC)


@triton.jit
def _dkdv_tile(
    tile_n, b, h, K, V, Q_DESC, DO_DESC, QT_DESC, DOT_DESC, LD_DESC, DK, DV,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, n_queries, n_keys, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_ACC,
):
    """dK and dV of key tile ``tile_n`` of head ``h`` of batch ``b``."""
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < n_keys

    k_head, v_head = K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh
    k = _load_cols(k_head, offs_n, stride_kn, stride_kd, key_ok, 0, D_MAIN, HEAD_DIM)
    v = _load_cols(v_head, offs_n, stride_vn, stride_vd, key_ok, 0, D_MAIN, HEAD_DIM)
    # The streamed tiles (Q, dO, and the [L; D] row pair) come in through tensor descriptors (TMA on Hopper):
    # one bulk copy per tile instead of per-thread asynchronous copies, rows past the end read as zeros, and
    # no address arithmetic per element. See docs/flash_attention/NOTES.md ("TMA loads in dK/dV"): -20% here.
    dk = tl.zeros([BLOCK_N, D_MAIN], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_MAIN], dtype=tl.float32)
    # Tail-slab tiles, when the head dim has a tail; otherwise the accumulators are placeholders, because
    # the loop helpers must return tensors.
    k_t, v_t = None, None
    dk_t, dv_t = tl.zeros([1], dtype=tl.float32), tl.zeros([1], dtype=tl.float32)  # placeholders (see above)
    if D_TAIL > 0:
        k_t = _load_cols(k_head, offs_n, stride_kn, stride_kd, key_ok, D_MAIN, D_TAIL, HEAD_DIM)
        v_t = _load_cols(v_head, offs_n, stride_vn, stride_vd, key_ok, D_MAIN, D_TAIL, HEAD_DIM)
        dk_t = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.float32)
        dv_t = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.float32)
    b32, h32 = b.to(tl.int32), h.to(tl.int32)  # descriptor coordinates are 32-bit
    bh = b32 * n_heads + h32

    lo, diag, tail = _query_ranges(start_n, n_queries, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # Query tiles across the diagonal (masked), then those that see the whole key tile, then the ragged end.
    dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, Q_DESC, DO_DESC, QT_DESC, DOT_DESC,
                                          LD_DESC, b32, h32, bh, offs_n, lo, diag, n_queries, n_keys, qk_scale, D_MAIN,
                                          D_TAIL, BLOCK_M, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2,
                                          DQ_ACC, HEAD_DIM)
    dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, Q_DESC, DO_DESC, QT_DESC, DOT_DESC,
                                          LD_DESC, b32, h32, bh, offs_n, diag, tail, n_queries, n_keys, qk_scale,
                                          D_MAIN, D_TAIL, BLOCK_M, IS_CAUSAL, False, DOT_PRECISION, POLY_EXP2,
                                          DQ_ACC, HEAD_DIM)
    dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, Q_DESC, DO_DESC, QT_DESC, DOT_DESC,
                                          LD_DESC, b32, h32, bh, offs_n, tail, n_queries, n_queries, n_keys, qk_scale,
                                          D_MAIN, D_TAIL, BLOCK_M, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2,
                                          DQ_ACC, HEAD_DIM)

    dk_head, dv_head = DK + b * stride_dkb + h * stride_dkh, DV + b * stride_dvb + h * stride_dvh
    _store_cols(dk_head, offs_n, stride_dkn, stride_dkd, key_ok, (dk * sm_scale).to(DK.dtype.element_ty),
                0, D_MAIN, HEAD_DIM)
    _store_cols(dv_head, offs_n, stride_dvn, stride_dvd, key_ok, dv.to(DV.dtype.element_ty), 0, D_MAIN, HEAD_DIM)
    if D_TAIL > 0:
        _store_cols(dk_head, offs_n, stride_dkn, stride_dkd, key_ok, (dk_t * sm_scale).to(DK.dtype.element_ty),
                    D_MAIN, D_TAIL, HEAD_DIM)
        _store_cols(dv_head, offs_n, stride_dvn, stride_dvd, key_ok, dv_t.to(DV.dtype.element_ty),
                    D_MAIN, D_TAIL, HEAD_DIM)


@triton.jit
def _dq_key_loop(
    dq,
    dq_t,
    q,
    do,
    q_t,
    do_t,
    lse2,
    delta,
    k_desc,
    v_desc,
    kt_desc,
    vt_desc,
    b,
    h,
    offs_m,
    lo,
    hi,
    n_queries,
    n_keys,
    qk_scale,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2: tl.constexpr,
):
    """Accumulate ``dQ += dS K`` (unscaled; ``dq_t``: the tail slab) over key tiles ``[lo, hi)``."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_desc, b, h, start_n, 0, BLOCK_N, D_MAIN)  # keys past the end read as zeros, masked below
        v = _tile(v_desc, b, h, start_n, 0, BLOCK_N, D_MAIN)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            k_t = _tile(kt_desc, b, h, start_n, D_MAIN, BLOCK_N, D_TAIL)
            s = tl.dot(q_t, tl.trans(k_t), s, input_precision=DOT_PRECISION)
        p = _exp2(s * qk_scale - lse2[:, None], POLY_EXP2, q.dtype)
        if MASKED:
            p = tl.where(_visible(offs_m[:, None], offs_n[None, :], n_queries, n_keys, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            dp = tl.dot(do_t, tl.trans(_tile(vt_desc, b, h, start_n, D_MAIN, BLOCK_N, D_TAIL)), dp,
                        input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            dq_t = tl.dot(ds, k_t, dq_t, input_precision=DOT_PRECISION)
    return dq, dq_t


# Q, dO | K, V; K feeds S = Q Kᵀ transposed and dQ = dS K plain, V only dP = dO Vᵀ.
DQ_SMEM = (lambda m, n: 2 * m, lambda m, n, t: (1 + t) * n, 16)
#: dQ's tensor descriptors and the tile side each streams along.
DQ_DESCRIPTORS = {"K_DESC": "BLOCK_N", "V_DESC": "BLOCK_N", "KT_DESC": "BLOCK_N", "VT_DESC": "BLOCK_N"}


@_jit
def flash_backward_dq_kernel(
    Q, K_DESC, V_DESC, KT_DESC, VT_DESC, DO, O, L, LD, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od, stride_lb, stride_lh, stride_ln, stride_ldbh, stride_ldrow,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_heads, head_group, n_queries, n_keys, qk_scale, sm_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr = False, LD_ONLY: tl.constexpr = False,
):
    """One program per (query tile, head): Q, dO, L and D stay in registers while key tiles stream past.

    It runs first and also writes the tile's ``LD[b * heads + h] = [L · log2(e); D]`` rows, float32, with
    ``D_i = Σ_d dO_id O_id``, for the dK/dV kernel after it: that kernel reads both per query tile as one
    ``2 x BLOCK_M`` descriptor box, L already in the base-2 units of the kernels' ``exp2``. Computing D here,
    where dO is loaded anyway, replaces a separate preprocess kernel: one launch and one pass over O and dO
    fewer per backward."""
    if PERSISTENT:
        first, end, step, n_tiles = _persistent_items(n_queries, K_DESC.shape[0] * n_heads, BLOCK_M)
        for item in range(first, end, step):
            tile_m, b, h = _item_tile_and_head(item, n_tiles, end // n_tiles, n_heads, head_group, IS_CAUSAL)
            _dq_tile(tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, DO, O, L, LD, DQ, stride_qb, stride_qh,
                     stride_qn, stride_qd, stride_dob, stride_doh, stride_don, stride_dod, stride_ob, stride_oh,
                     stride_on, stride_od, stride_lb, stride_lh, stride_ln, stride_ldbh, stride_ldrow, stride_dqb,
                     stride_dqh, stride_dqn, stride_dqd, n_heads, n_queries, n_keys, qk_scale, sm_scale, HEAD_DIM,
                     D_MAIN, D_TAIL, IS_CAUSAL, DOT_PRECISION, POLY_EXP2, BLOCK_M, BLOCK_N, LD_ONLY)
    else:
        tile_m, b, h = _tile_and_head(n_queries, n_heads, head_group, BLOCK_M, IS_CAUSAL)
        _dq_tile(tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, DO, O, L, LD, DQ, stride_qb, stride_qh,
                 stride_qn, stride_qd, stride_dob, stride_doh, stride_don, stride_dod, stride_ob, stride_oh,
                 stride_on, stride_od, stride_lb, stride_lh, stride_ln, stride_ldbh, stride_ldrow, stride_dqb,
                 stride_dqh, stride_dqn, stride_dqd, n_heads, n_queries, n_keys, qk_scale, sm_scale, HEAD_DIM,
                 D_MAIN, D_TAIL, IS_CAUSAL, DOT_PRECISION, POLY_EXP2, BLOCK_M, BLOCK_N, LD_ONLY)


@triton.jit
def _dq_tile(
    tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, DO, O, L, LD, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od, stride_lb, stride_lh, stride_ln, stride_ldbh, stride_ldrow,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd, n_heads, n_queries, n_keys, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LD_ONLY: tl.constexpr,
):
    """dQ and the ``[L; D]`` rows of query tile ``tile_m`` of head ``h`` of batch ``b``."""
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_queries

    q_head, do_head = Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh
    o_head = O + b * stride_ob + h * stride_oh
    q = _load_cols(q_head, offs_m, stride_qn, stride_qd, row_ok, 0, D_MAIN, HEAD_DIM)
    do = _load_cols(do_head, offs_m, stride_don, stride_dod, row_ok, 0, D_MAIN, HEAD_DIM)
    o = _load_cols(o_head, offs_m, stride_on, stride_od, row_ok, 0, D_MAIN, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    dq = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    q_t, do_t = None, None
    dq_t = tl.zeros([1], dtype=tl.float32)  # a placeholder: loop helpers return tensors
    if D_TAIL > 0:
        q_t = _load_cols(q_head, offs_m, stride_qn, stride_qd, row_ok, D_MAIN, D_TAIL, HEAD_DIM)
        do_t = _load_cols(do_head, offs_m, stride_don, stride_dod, row_ok, D_MAIN, D_TAIL, HEAD_DIM)
        o_t = _load_cols(o_head, offs_m, stride_on, stride_od, row_ok, D_MAIN, D_TAIL, HEAD_DIM)
        delta += tl.sum(o_t.to(tl.float32) * do_t.to(tl.float32), axis=1)
        dq_t = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)
    lse = tl.load(L + b * stride_lb + h * stride_lh + offs_m * stride_ln, mask=row_ok, other=0.0)
    lse2 = lse * 1.4426950408889634  # L in base-2 units: log2(e) * L
    ld_row = LD + (b * n_heads + h) * stride_ldbh + offs_m
    tl.store(ld_row, lse2, mask=row_ok)
    tl.store(ld_row + stride_ldrow, delta, mask=row_ok)
    if not LD_ONLY:  # LD_ONLY: the rows alone, for a dK/dV kernel that also accumulates dQ (its DQ_ACC)
        b32, h32 = b.to(tl.int32), h.to(tl.int32)  # descriptor coordinates are 32-bit

        mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
        dq, dq_t = _dq_key_loop(dq, dq_t, q, do, q_t, do_t, lse2, delta, K_DESC, V_DESC, KT_DESC, VT_DESC, b32, h32,
                                offs_m, 0, mid, n_queries, n_keys, qk_scale, D_MAIN, D_TAIL, BLOCK_N, IS_CAUSAL, False,
                                DOT_PRECISION, POLY_EXP2)
        dq, dq_t = _dq_key_loop(dq, dq_t, q, do, q_t, do_t, lse2, delta, K_DESC, V_DESC, KT_DESC, VT_DESC, b32, h32,
                                offs_m, mid, hi, n_queries, n_keys, qk_scale, D_MAIN, D_TAIL, BLOCK_N, IS_CAUSAL, True,
                                DOT_PRECISION, POLY_EXP2)
    # LD_ONLY: DQ is the float32 sums the dK/dV kernel adds to, and these are their zeros (no memset of its own).
    dq_head = DQ + b * stride_dqb + h * stride_dqh
    _store_cols(dq_head, offs_m, stride_dqn, stride_dqd, row_ok, (dq * sm_scale).to(DQ.dtype.element_ty),
                0, D_MAIN, HEAD_DIM)
    if D_TAIL > 0:
        _store_cols(dq_head, offs_m, stride_dqn, stride_dqd, row_ok, (dq_t * sm_scale).to(DQ.dtype.element_ty),
                    D_MAIN, D_TAIL, HEAD_DIM)


#: Elements per program of :func:`flash_backward_dq_convert_kernel`: 32 KiB of float32 sums in, 16 KiB out.
DQ_CONVERT_ELEMENTS = 8192


@triton.jit(do_not_specialize=["n_heads", "n_queries"])
def flash_backward_dq_convert_kernel(
    DQ_ACC, DQ, stride_ab, stride_ah, stride_an, stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_heads, n_queries, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ from the float32 sums a dK/dV kernel added ``dS K`` to (``options.dq_atomic``): times the softmax scale, in
    dQ's dtype and strides. Grid ``(batch * heads, cdiv(n_queries, BLOCK_N))``; a program converts ``BLOCK_N`` rows.

    Why a kernel of our own: PyTorch's ``torch.mul(sums, scale, out=dq)`` casts element by element in its unrolled
    (not vectorized) loop, which an Nsight Compute profile found a third slower than cuDNN's own conversion pass
    (docs/flash_attention/dq_atomic.md); here a row tile is one wide load and one wide store."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_queries)[:, None] & (cols < HEAD_DIM)[None, :]
    acc = DQ_ACC + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    sums = tl.load(acc + rows[:, None].to(tl.int64) * stride_an + cols[None, :], mask=ok, other=0.0)
    dq = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    tl.store(dq + rows[:, None].to(tl.int64) * stride_dqn + cols[None, :] * stride_dqd,
             (sums * sm_scale).to(DQ.dtype.element_ty), mask=ok)
