"""The rotary embedding of packed Q and K as one Triton kernel, for :mod:`.flash_qkvpacked`.

Rotates interleaved pairs ``(x[2i], x[2i+1])`` of every head of the first two parts (Q, K) of a
``(batch, seq, parts, heads, d)`` tensor, the layout of a fused QKV projection's output:

    forward:  (a, b) -> (a cos θ - b sin θ, b cos θ + a sin θ)
    inverse:  (a, b) -> (a cos θ + b sin θ, b cos θ - a sin θ)   (the transpose: RoPE's backward)

``cos θ`` and ``sin θ`` come from ``(batch, seq, d/2)`` float32 tables (batch stride 0 when every
sequence uses positions ``0 .. seq-1``). The arithmetic is float32; the result has the output's dtype.
The inverse runs in place on the gradient buffer, so a packed backward needs no concatenation.

A token's Q and K are ``2·heads·d`` contiguous values, so a program takes ``BLOCK_T`` tokens by
``2·BLOCK_P`` of those columns, whatever the head count, and reads the angle of pair ``p`` at
``p mod d/2``. Programs of one head each (128-byte rows) ran the forward at 19 µs at small 1024 where
this runs at 17, and at 65 µs with the model's stride-2 tables where this runs at 21 (H100,
``docs/training_step/ab/rope.tar.gz``).

Imported lazily with the attention kernels (``@triton.jit`` decides at decoration whether to compile).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Tokens and pairs per program: 8 x 256 16-bit values, 4 KiB in and out (the best, or level with it, at the
#: shapes measured in docs/training_step/NOTES.md: d 64 and 80, 12 to 32 heads).
ROPE_BLOCK_T = 8
ROPE_BLOCK_P = 128


@triton.jit(do_not_specialize=["seq"])
def rope_qk_kernel(
    X, Y, COS, SIN,
    stride_xb, stride_xt, stride_yb, stride_yt,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd,
    seq, width,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(seq, BLOCK_T), batch, cdiv(width, 2 * BLOCK_P))`` over tokens, sequences and the
    ``width = 2·heads·d`` Q and K columns of a token (contiguous in ``X`` and ``Y``)."""
    pid_t, b, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_c * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P)
    p = pid_c * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = (t < seq)[:, None]
    values = rows & (cols < width)[None, :]
    # Rows load and store whole (coalesced); the pairs come apart in registers: (rows, pairs, 2) -> a, c.
    x = X + b.to(tl.int64) * stride_xb + t[:, None].to(tl.int64) * stride_xt + cols[None, :]
    a, c = tl.split(tl.reshape(tl.load(x, mask=values, other=0.0).to(tl.float32), (BLOCK_T, BLOCK_P, 2)))
    i = p % HALF  # the pair's index within its head
    pairs = rows & (2 * p < width)[None, :]
    cos = tl.load(COS + b * stride_cb + t[:, None] * stride_ct + i[None, :] * stride_cd, mask=pairs, other=0.0)
    sin = tl.load(SIN + b * stride_sb + t[:, None] * stride_st + i[None, :] * stride_sd, mask=pairs, other=0.0)
    if INVERSE:
        sin = -sin
    out = tl.reshape(tl.join(a * cos - c * sin, c * cos + a * sin), (BLOCK_T, 2 * BLOCK_P))
    y = Y + b.to(tl.int64) * stride_yb + t[:, None].to(tl.int64) * stride_yt + cols[None, :]
    tl.store(y, out.to(Y.dtype.element_ty), mask=values)
