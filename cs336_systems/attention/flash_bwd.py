"""The FlashAttention-2 backward kernels in Triton: the ``[L; D]`` preprocess, dK/dV over key tiles and dQ
over query tiles (no atomics)."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .flash_common import (
    INTERPRETED,
    _exp2,
    _jit,
    _key_ranges,
    _key_value_descriptors,
    _query_ranges,
    _tile_and_head,
    _visible,
)

#: Rows per program of the small preprocess kernel.
PREPROCESS_BLOCK = 16 if INTERPRETED else 128

# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@functools.partial(triton.jit, do_not_specialize=["n_heads", "n_queries"])
def flash_backward_preprocess_kernel(
    O, DO, L, LD,
    stride_ob, stride_oh, stride_on, stride_od, stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln, stride_ldbh, stride_ldrow,
    n_heads, n_queries,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The backward's per-query row pair, float32 ``LD[b * heads + h] = [L · log2(e); D]`` with
    ``D_i = Σ_d dO_id O_id``: both are read per query tile by dK/dV, which loads them as one
    ``2 x BLOCK_M`` tensor-descriptor box (one bulk copy and one barrier wait per tile instead of two),
    and L arrives already in the base-2 units of the kernels' ``exp2``."""
    tile_m, b, h = _tile_and_head(n_queries, n_heads, BLOCK_M, False)
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
    ld_row = LD + (b * n_heads + h) * stride_ldbh + offs_m
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
DKDV_SMEM = (lambda m, n: 2 * n, lambda m, n, t: 2 * t * m, 16 if INTERPRETED else 32)


@_jit
def flash_backward_dkdv_kernel(
    Q, K, V, DO, LD, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
    stride_ldbh, stride_ldrow,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, n_queries, n_keys, qk_scale, sm_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key tile, head): K and V stay in registers while query tiles stream past."""
    # Causal: early key tiles see the most queries, so they go first (no reversal).
    tile_n, b, h = _tile_and_head(n_keys, n_heads, BLOCK_N, False)
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
    ld_desc = tl.make_tensor_descriptor(LD + (b * n_heads + h) * stride_ldbh, shape=[2, n_queries],
                                        strides=[stride_ldrow, 1], block_shape=[2, BLOCK_M])

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, diag, tail = _query_ranges(start_n, n_queries, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # Query tiles across the diagonal (masked), then those that see the whole key tile, then the ragged end.
    dk, dv = _dkdv_query_loop(dk, dv, k, v, q_desc, do_desc, ld_desc, offs_n, lo, diag, n_queries, n_keys,
                              qk_scale, HEAD_DIM, BLOCK_M, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2)
    dk, dv = _dkdv_query_loop(dk, dv, k, v, q_desc, do_desc, ld_desc, offs_n, diag, tail, n_queries, n_keys,
                              qk_scale, HEAD_DIM, BLOCK_M, IS_CAUSAL, False, DOT_PRECISION, POLY_EXP2)
    dk, dv = _dkdv_query_loop(dk, dv, k, v, q_desc, do_desc, ld_desc, offs_n, tail, n_queries, n_queries,
                              n_keys, qk_scale, HEAD_DIM, BLOCK_M, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2)

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
DQ_SMEM = (lambda m, n: 2 * m, lambda m, n, t: (1 + t) * n, 16)


@_jit
def flash_backward_dq_kernel(
    Q, K, V, DO, LD, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
    stride_ldbh, stride_ldrow,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    n_heads, n_queries, n_keys, qk_scale, sm_scale, SEQ_CLASS,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query tile, head): Q, dO, L and D stay in registers while key tiles stream past."""
    tile_m, b, h = _tile_and_head(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
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
    ld_row = LD + (b * n_heads + h) * stride_ldbh + offs_m
    lse2 = tl.load(ld_row, mask=row_ok, other=0.0)  # L in base-2 units
    delta = tl.load(ld_row + stride_ldrow, mask=row_ok, other=0.0)
    k_desc, v_desc = _key_value_descriptors(K, V, b, h, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                            stride_vn, n_keys, HEAD_DIM, BLOCK_N)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _dq_key_loop(dq, q, do, lse2, delta, k_desc, v_desc, offs_m, 0, mid, n_queries, n_keys, qk_scale,
                      BLOCK_N, IS_CAUSAL, False, DOT_PRECISION, POLY_EXP2)
    dq = _dq_key_loop(dq, q, do, lse2, delta, k_desc, v_desc, offs_m, mid, hi, n_queries, n_keys, qk_scale,
                      BLOCK_N, IS_CAUSAL, True, DOT_PRECISION, POLY_EXP2)
    dq_ptrs = (
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
