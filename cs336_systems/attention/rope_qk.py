"""The rotary embedding of packed Q and K as one Triton kernel, for :mod:`.flash_qkvpacked`.

Rotates interleaved pairs ``(x[2i], x[2i+1])`` of every head of the first two parts (Q, K) of a
``(batch, seq, parts, heads, d)`` tensor, the layout of a fused QKV projection's output:

    forward:  (a, b) -> (a cos θ - b sin θ, b cos θ + a sin θ)
    inverse:  (a, b) -> (a cos θ + b sin θ, b cos θ - a sin θ)   (the transpose: RoPE's backward)

``cos θ`` and ``sin θ`` come from ``(batch, seq, d/2)`` float32 tables (batch stride 0 when every
sequence uses positions ``0 .. seq-1``). The arithmetic is float32; the result has the output's dtype.
One program rotates ``BLOCK_T`` tokens of one head of one part; the inverse runs in place on the
gradient buffer, so a packed backward needs no concatenation.

Imported lazily with the attention kernels (``@triton.jit`` decides at decoration whether to compile).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Tokens per program: a 64 x 128 tile of 16-bit values is 16 KiB in flight per program.
ROPE_BLOCK_T = 64


@triton.jit(do_not_specialize=["seq", "n_heads"])
def rope_qk_kernel(
    X, Y, COS, SIN,
    stride_xb, stride_xt, stride_xp, stride_xh,
    stride_yb, stride_yt, stride_yp, stride_yh,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd,
    seq, n_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(seq, BLOCK_T), batch * heads, 2)``: token tile, (batch, head), part (0: Q, 1: K)."""
    pid_t, bh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // n_heads, bh % n_heads
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF_PAD)
    cols = tl.arange(0, 2 * HALF_PAD)
    rows = (t < seq)[:, None]
    # Rows load and store whole (coalesced); the pairs come apart in registers: (rows, pairs, 2) -> a, c.
    x = X + b.to(tl.int64) * stride_xb + part * stride_xp + h * stride_xh + t[:, None].to(tl.int64) * stride_xt
    a, c = tl.split(tl.reshape(tl.load(x + cols[None, :], mask=rows & (cols < 2 * HALF)[None, :], other=0.0)
                               .to(tl.float32), (BLOCK_T, HALF_PAD, 2)))
    pairs = rows & (i < HALF)[None, :]
    cos = tl.load(COS + b * stride_cb + t[:, None] * stride_ct + i[None, :] * stride_cd, mask=pairs, other=0.0)
    sin = tl.load(SIN + b * stride_sb + t[:, None] * stride_st + i[None, :] * stride_sd, mask=pairs, other=0.0)
    if INVERSE:
        sin = -sin
    out = tl.reshape(tl.join(a * cos - c * sin, c * cos + a * sin), (BLOCK_T, 2 * HALF_PAD))
    y = Y + b.to(tl.int64) * stride_yb + part * stride_yp + h * stride_yh + t[:, None].to(tl.int64) * stride_yt
    tl.store(y + cols[None, :], out.to(Y.dtype.element_ty), mask=rows & (cols < 2 * HALF)[None, :])
