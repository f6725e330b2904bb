"""The FlashAttention-2 forward kernel in Triton: online softmax over streamed key tiles, O and L out."""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_common import (
    _exp2,
    _jit,
    _key_ranges,
    _key_visible,
    _load_cols,
    _store_cols,
    _item_tile_and_head,
    _persistent_items,
    _tile,
    _tile_and_head,
)

# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _forward_key_loop(
    acc,
    acc_t,
    m_i,
    l_i,
    q,
    q_t,
    k_desc,
    v_desc,
    kt_desc,
    vt_desc,
    b,
    h,
    offs_m,
    lo,
    hi,
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
    """Online softmax over key tiles ``[lo, hi)``: fold each tile into the running max ``m_i`` (log2
    units), denominator ``l_i`` and accumulator (``acc``, and ``acc_t`` for the tail slab of the head dim)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_desc, b, h, start_n, 0, BLOCK_N, D_MAIN)  # keys past the end read as zeros, masked below
        v = _tile(v_desc, b, h, start_n, 0, BLOCK_N, D_MAIN)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            s = tl.dot(q_t, tl.trans(_tile(kt_desc, b, h, start_n, D_MAIN, BLOCK_N, D_TAIL)), s,
                       input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(_key_visible(offs_m[:, None], offs_n[None, :], n_keys, IS_CAUSAL), s, float("-inf"))
        # The maximum of the raw scores is scaled once per row (qk_scale > 0), so the per-element
        # scale and subtraction fuse into one FMA.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = _exp2(s * qk_scale - m_new[:, None], POLY_EXP2, q.dtype)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if D_TAIL > 0:
            acc_t = tl.dot(p, _tile(vt_desc, b, h, start_n, D_MAIN, BLOCK_N, D_TAIL), acc_t * alpha[:, None],
                           input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, acc_t, m_i, l_i


FORWARD_SMEM = (lambda m, n: m, lambda m, n, t: 2 * n, 16)  # resident Q | streamed K, V
#: The forward's tensor descriptors and the tile side each streams along (see ``tuning.block_shape_hook``).
FORWARD_DESCRIPTORS = {"K_DESC": "BLOCK_N", "V_DESC": "BLOCK_N", "KT_DESC": "BLOCK_N", "VT_DESC": "BLOCK_N"}


@_jit
def flash_forward_kernel(
    Q, K_DESC, V_DESC, KT_DESC, VT_DESC, O, L,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    n_heads, head_group, n_queries, n_keys, qk_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    """One program per (query tile, head), or with ``PERSISTENT`` a grid sized to the GPU whose programs take
    the (query tile, head) items in turn (:func:`flash_common._persistent_items`)."""
    if PERSISTENT:
        first, end, step, n_tiles = _persistent_items(n_queries, K_DESC.shape[0] * n_heads, BLOCK_M)
        for item in range(first, end, step):
            tile_m, b, h = _item_tile_and_head(item, n_tiles, end // n_tiles, n_heads, head_group, IS_CAUSAL)
            _forward_tile(tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, O, L,
                          stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
                          stride_lb, stride_lh, stride_ln, n_queries, n_keys, qk_scale, HEAD_DIM, D_MAIN, D_TAIL,
                          IS_CAUSAL, DOT_PRECISION, POLY_EXP2, BLOCK_M, BLOCK_N)
    else:
        tile_m, b, h = _tile_and_head(n_queries, n_heads, head_group, BLOCK_M, IS_CAUSAL)
        _forward_tile(tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, O, L,
                      stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
                      stride_lb, stride_lh, stride_ln, n_queries, n_keys, qk_scale, HEAD_DIM, D_MAIN, D_TAIL,
                      IS_CAUSAL, DOT_PRECISION, POLY_EXP2, BLOCK_M, BLOCK_N)


@triton.jit
def _forward_tile(
    tile_m, b, h, Q, K_DESC, V_DESC, KT_DESC, VT_DESC, O, L,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln, n_queries, n_keys, qk_scale,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O and L of query tile ``tile_m`` of head ``h`` of batch ``b``."""
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_queries

    q_head = Q + b * stride_qb + h * stride_qh
    q = _load_cols(q_head, offs_m, stride_qn, stride_qd, row_ok, 0, D_MAIN, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    q_t = None
    acc_t = tl.zeros([1], dtype=tl.float32)  # a placeholder: loop helpers return tensors
    if D_TAIL > 0:
        q_t = _load_cols(q_head, offs_m, stride_qn, stride_qd, row_ok, D_MAIN, D_TAIL, HEAD_DIM)
        acc_t = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)
    b32, h32 = b.to(tl.int32), h.to(tl.int32)  # descriptor coordinates are 32-bit

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # Unmasked key tiles first, then the ones the diagonal or the sequence end cuts (masked).
    acc, acc_t, m_i, l_i = _forward_key_loop(acc, acc_t, m_i, l_i, q, q_t, K_DESC, V_DESC, KT_DESC, VT_DESC,
                                             b32, h32, offs_m, 0, mid, n_keys, qk_scale, D_MAIN, D_TAIL, BLOCK_N,
                                             IS_CAUSAL, False, DOT_PRECISION, POLY_EXP2)
    acc, acc_t, m_i, l_i = _forward_key_loop(acc, acc_t, m_i, l_i, q, q_t, K_DESC, V_DESC, KT_DESC, VT_DESC,
                                             b32, h32, offs_m, mid, hi, n_keys, qk_scale, D_MAIN, D_TAIL, BLOCK_N,
                                             IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2)

    o_head = O + b * stride_ob + h * stride_oh
    _store_cols(o_head, offs_m, stride_on, stride_od, row_ok, (acc / l_i[:, None]).to(O.dtype.element_ty),
                0, D_MAIN, HEAD_DIM)
    if D_TAIL > 0:
        _store_cols(o_head, offs_m, stride_on, stride_od, row_ok, (acc_t / l_i[:, None]).to(O.dtype.element_ty),
                    D_MAIN, D_TAIL, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back to natural-log units
    tl.store(L + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=row_ok)
