"""Lab A/B: the packed RoPE kernel (``rope_qk_kernel``) against a token-row variant and the copy floor.

At small 1024 (batch 8) the profiled step spent 64 µs per ``rope_qk_kernel`` launch (24 a step), where moving
Q and K once (25 MB each way) takes about 17 µs at the H100's bandwidth. Suspects: programs of one head
(128-byte rows, 8 KiB each), and cos/sin tables read with a pair stride of 2 (the model passes a column of
``RotaryEmbedding``'s per-pair table) once per head. The variant ``rows`` tiles a token's Q and K columns
(2·heads·d contiguous values) and reads cos/sin for pair ``p % (d/2)``, so a program covers many heads.

    python docs/training_step/ab/rope/rope_bench.py            # on a GPU; prints µs per launch (CUDA graph)
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from cs336_systems.attention.flash_qkvpacked import _rotate


@triton.jit(do_not_specialize=["seq"])
def rope_rows_kernel(
    X, Y, COS, SIN, stride_xb, stride_xt, stride_yb, stride_yt,
    stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, seq, width,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    pid_t, b, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_c * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P)
    p = pid_c * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = (t < seq)[:, None]
    x = X + b.to(tl.int64) * stride_xb + t[:, None].to(tl.int64) * stride_xt + cols[None, :]
    a, c = tl.split(tl.reshape(tl.load(x, mask=rows & (cols < width)[None, :], other=0.0).to(tl.float32),
                               (BLOCK_T, BLOCK_P, 2)))
    i = p % HALF
    pairs = rows & (2 * p < width)[None, :]
    cos = tl.load(COS + b * stride_cb + t[:, None] * stride_ct + i[None, :] * stride_cd, mask=pairs, other=0.0)
    sin = tl.load(SIN + b * stride_sb + t[:, None] * stride_st + i[None, :] * stride_sd, mask=pairs, other=0.0)
    if INVERSE:
        sin = -sin
    out = tl.reshape(tl.join(a * cos - c * sin, c * cos + a * sin), (BLOCK_T, 2 * BLOCK_P))
    y = Y + b.to(tl.int64) * stride_yb + t[:, None].to(tl.int64) * stride_yt + cols[None, :]
    tl.store(y, out.to(Y.dtype.element_ty), mask=rows & (cols < width)[None, :])


def rotate_rows(x, y, cos, sin, inverse, block_t, block_p, warps):
    batch, seq, _, heads, d = x.shape
    cos, sin = (t.expand(batch, seq, d // 2) for t in (cos, sin))
    width = 2 * heads * d
    grid = (triton.cdiv(seq, block_t), batch, triton.cdiv(width, 2 * block_p))
    rope_rows_kernel[grid](x, y, cos, sin, x.stride(0), x.stride(1), y.stride(0), y.stride(1), *cos.stride(),
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
            _rotate(qkv, ref, cos, sin, inverse=False)
            cur = do_bench_cudagraph(lambda: _rotate(qkv, qk, cos, sin, inverse=False)) * 1e3
            grad = qkv.clone()  # the in-place inverse runs on a copy: qkv stays the forward's input
            inv = do_bench_cudagraph(lambda: _rotate(grad, grad, cos, sin, inverse=True)) * 1e3
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
    print("shape (b,t,h,d) | cos | MB moved | copy µs | rope_qk fwd | rope_qk inv | rows fwd | rows inv | rows tile")
    for r in rows_out:
        print(" | ".join(str(v) for v in ((r[:4],) + r[4:])))


if __name__ == "__main__":
    main()
