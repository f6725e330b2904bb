"""Lab A/B: the packed RoPE kernel's first design (one head per program) against the token-row design the
library now has (``cs336_systems.attention.rope_qk``, swept over tiles) and the copy floor.

At small 1024 (batch 8) the profiled step spent 64 µs per ``rope_qk_kernel`` launch (24 a step), where moving
Q and K once (25 MB each way) takes about 17 µs at the H100's bandwidth. Suspects: programs of one head
(128-byte rows, 8 KiB each), and cos/sin tables read with a pair stride of 2 (the model passes a column of
``RotaryEmbedding``'s per-pair table) once per head. The token-row design tiles a token's Q and K columns
(2·heads·d contiguous values) and reads cos/sin for pair ``p % (d/2)``, so a program covers many heads.

    python docs/training_step/ab/rope/rope_bench.py            # on a GPU; prints µs per launch (CUDA graph)
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from cs336_systems.attention.rope_qk import rope_qk_kernel


@triton.jit(do_not_specialize=["seq", "n_heads"])
def rope_per_head_kernel(
    X, Y, COS, SIN,
    stride_xb, stride_xt, stride_xp, stride_xh,
    stride_yb, stride_yt, stride_yp, stride_yh,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd,
    seq, n_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """The first design (``51f1749``): grid ``(cdiv(seq, BLOCK_T), batch * heads, 2)``, one head of one part
    per program, so the tables are read once per head."""
    pid_t, bh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // n_heads, bh % n_heads
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF_PAD)
    cols = tl.arange(0, 2 * HALF_PAD)
    rows = (t < seq)[:, None]
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


def rotate_per_head(x, y, cos, sin, inverse, block_t=64):
    batch, seq, _, heads, d = x.shape
    cos, sin = (t.expand(batch, seq, d // 2) for t in (cos, sin))
    half_pad = max(1, 1 << (d // 2 - 1).bit_length())
    rope_per_head_kernel[(triton.cdiv(seq, block_t), batch * heads, 2)](
        x, y, cos, sin, *x.stride()[:4], *y.stride()[:4], *cos.stride(), *sin.stride(), seq, heads,
        HALF=d // 2, HALF_PAD=half_pad, BLOCK_T=block_t, INVERSE=inverse)


def rotate_rows(x, y, cos, sin, inverse, block_t, block_p, warps):
    """The library's kernel (token rows, ``cs336_systems.attention.rope_qk``) at a given tile."""
    batch, seq, _, heads, d = x.shape
    cos, sin = (t.expand(batch, seq, d // 2) for t in (cos, sin))
    width = 2 * heads * d
    grid = (triton.cdiv(seq, block_t), batch, triton.cdiv(width, 2 * block_p))
    rope_qk_kernel[grid](x, y, cos, sin, x.stride(0), x.stride(1), y.stride(0), y.stride(1), *cos.stride(),
                         *sin.stride(), seq, width, HALF=d // 2, BLOCK_T=block_t, BLOCK_P=block_p,
                         INVERSE=inverse, num_warps=warps)


def tables(seq, d, strided):
    theta = torch.arange(seq, device="cuda")[:, None] / 10000 ** (torch.arange(0, d, 2, device="cuda") / d)
    if strided:  # as the model passes them: one column of a (seq, d/2, 2) table
        return (torch.stack([theta.cos(), theta.cos()], -1)[..., 0], torch.stack([theta.sin(), theta.sin()], -1)[..., 1])
    return theta.cos(), theta.sin()


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows_out = []
    for batch, seq, heads, d in ((8, 1024, 12, 64), (2, 4096, 12, 64), (8, 1024, 25, 64), (4, 1024, 32, 80)):
        qkv = torch.randn(batch, seq, 3, heads, d, device="cuda", dtype=torch.bfloat16)
        qk = torch.empty(batch, seq, 2, heads, d, device="cuda", dtype=torch.bfloat16)
        mb = 2 * qk.numel() * qk.element_size() / 1e6
        copy_us = do_bench_cudagraph(lambda: qk.copy_(qkv[:, :, :2])) * 1e3
        for strided in (True, False):
            cos, sin = tables(seq, d, strided)
            ref = torch.empty_like(qk)
            rotate_per_head(qkv, ref, cos, sin, inverse=False)
            cur = do_bench_cudagraph(lambda: rotate_per_head(qkv, qk, cos, sin, inverse=False)) * 1e3
            grad = qkv.clone()  # the in-place inverse runs on a copy: qkv stays the forward's input
            inv = do_bench_cudagraph(lambda: rotate_per_head(grad, grad, cos, sin, inverse=True)) * 1e3
            best = None
            for bt, bp, w in itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8)):
                out = torch.empty_like(qk)
                rotate_rows(qkv, out, cos, sin, False, bt, bp, w)
                torch.testing.assert_close(out, ref, atol=0, rtol=0)
                us = do_bench_cudagraph(lambda: rotate_rows(qkv, qk, cos, sin, False, bt, bp, w)) * 1e3
                if best is None or us < best[0]:
                    best = (us, bt, bp, w)
            us, bt, bp, w = best
            inv_rows = do_bench_cudagraph(lambda: rotate_rows(grad, grad, cos, sin, True, bt, bp, w)) * 1e3
            rows_out.append((batch, seq, heads, d, "strided" if strided else "contig", round(mb, 1), round(copy_us, 1),
                             round(cur, 1), round(inv, 1), round(us, 1), round(inv_rows, 1), f"{bt}x{bp} w{w}"))
    print("shape (b,t,h,d) | cos | MB moved | copy µs | per-head fwd | per-head inv | rows fwd | rows inv | rows tile")
    for r in rows_out:
        print(" | ".join(str(v) for v in ((r[:4],) + r[4:])))


if __name__ == "__main__":
    main()
