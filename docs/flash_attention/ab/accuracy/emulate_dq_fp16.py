"""CPU emulation of the dQ kernel's rounding at (16384, 128), float16, not causal, one head (accuracy.md).

Scores, probabilities and every accumulation in float32, O stored in float16 as the forward stores it, D from
that O, dS rounded to float16 before the dS K product (optionally scaled by 2^shift first and unscaled in
float32 after). Prints dQ's largest error against float64 and that of the float64 reference stored in float16.

    python docs/flash_attention/ab/accuracy/emulate_dq_fp16.py      # about 40 s
"""

import math

import torch

N, D_HEAD, BLOCK, SHIFTS = 16384, 128, 1024, (0, 4, 8, 10)
dt = torch.float16
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(N, D_HEAD, generator=g).to(dt) for _ in range(4))
k64, v64, kf, vf = k.double(), v.double(), k.float(), v.float()
sc = 1 / math.sqrt(D_HEAD)
worst = {shift: 0.0 for shift in SHIFTS}
rounding = largest = subnormal = 0.0
for start in range(0, N, BLOCK):
    rows = slice(start, start + BLOCK)
    q64, do64 = q[rows].double(), do[rows].double()
    p = torch.softmax(q64 @ k64.T * sc, -1)
    o = p @ v64
    dq_ref = (p * (do64 @ v64.T - (do64 * o).sum(-1, keepdim=True))) @ k64 * sc
    p32 = torch.softmax(q[rows].float() @ kf.T * sc, -1)
    o16 = (p32.to(dt).float() @ vf).to(dt)
    ds32 = p32 * (do[rows].float() @ vf.T - (do[rows].float() * o16.float()).sum(-1, keepdim=True))
    subnormal += (ds32.abs() < 6.1e-5).float().mean().item() / (N // BLOCK)
    for shift in SHIFTS:
        dq = ((ds32 * 2.0**shift).to(dt).float() @ kf) / 2.0**shift * sc
        worst[shift] = max(worst[shift], (dq.to(dt).double() - dq_ref).abs().max().item())
    rounding = max(rounding, (dq_ref.to(dt).double() - dq_ref).abs().max().item())
    largest = max(largest, dq_ref.abs().max().item())
print(f"dS entries below float16's smallest normal: {subnormal:.1%}")
for shift, err in worst.items():
    print(f"dS scaled by 2^{shift}: dQ largest error {err:.3g}")
print(f"the float64 reference stored in float16: {rounding:.3g}; largest |dQ| {largest:.3g}")
