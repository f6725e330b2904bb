"""The FlashAttention-2 forward kernel in Triton: online softmax over streamed key tiles, O and L out."""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_common import _exp2, _jit, _key_ranges, _key_value_descriptors, _key_visible, _tile_and_head

# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


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


FORWARD_SMEM = (lambda m, n: m, lambda m, n, t: 2 * n, 16)  # resident Q | streamed K, V


@_jit
def flash_forward_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    n_heads, n_queries, n_keys, qk_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile_m, b, h = _tile_and_head(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
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
    # Unmasked key tiles first, then the ones the diagonal or the sequence end cuts (masked).
    acc, m_i, l_i = _forward_key_loop(acc, m_i, l_i, q, k_desc, v_desc, offs_m, 0, mid, n_keys, qk_scale,
                                      BLOCK_N, IS_CAUSAL, False, DOT_PRECISION, POLY_EXP2)
    acc, m_i, l_i = _forward_key_loop(acc, m_i, l_i, q, k_desc, v_desc, offs_m, mid, hi, n_keys, qk_scale,
                                      BLOCK_N, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2)

    o = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back to natural-log units
    tl.store(L + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=row_ok)
