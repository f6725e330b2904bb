"""CPU emulation of the dQ kernel's rounding at (16384, 128), float16, not causal, one head (accuracy.md).

Scores, probabilities and every accumulation in float32; O stored in float16 as the forward stores it, from
float16 P; D from that O; P = 2^(S·scale·log2(e) − L·log2(e)) with the hardware-like exp2 or the kernels'
degree-3 polynomial (`flash_common._exp2_fma`); dS rounded to float16 before the dS K product, optionally
scaled by 2^shift first and unscaled in float32 after. Prints dQ's largest error against float64 per variant
and that of the float64 reference itself stored in float16.

    python docs/flash_attention/ab/accuracy/emulate_dq_fp16.py      # about a minute
"""

import math

import torch

N, D_HEAD, BLOCK = 16384, 128, 1024
LOG2E = 1.4426950408889634
dt = torch.float16
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(N, D_HEAD, generator=g).to(dt) for _ in range(4))
k64, v64, kf, vf = k.double(), v.double(), k.float(), v.float()
sc = 1 / math.sqrt(D_HEAD)


def exp2_fma(x: torch.Tensor) -> torch.Tensor:
    """The kernels' Cody-Waite + degree-3 polynomial 2**x, bit for bit in float32."""
    x = torch.clamp(x, min=-125.0)
    j = x + 12582912.0
    f = x - (j - 12582912.0)
    p = ((0.05508868380751114 * f + 0.24260405145947936) * f + 0.6932762416819607) * f + 0.9999289403695112
    return (p.view(torch.int32) + (j.view(torch.int32) << 23)).view(torch.float32)


VARIANTS = {"hardware exp2": (torch.exp2, 0), "polynomial exp2": (exp2_fma, 0),
            "hardware exp2, dS scaled by 2^4": (torch.exp2, 4), "hardware exp2, dS scaled by 2^8": (torch.exp2, 8)}
worst = dict.fromkeys(VARIANTS, 0.0)
rounding = largest = subnormal = 0.0
for start in range(0, N, BLOCK):
    rows = slice(start, start + BLOCK)
    q64, do64 = q[rows].double(), do[rows].double()
    p = torch.softmax(q64 @ k64.T * sc, -1)
    dq_ref = (p * (do64 @ v64.T - (do64 * (p @ v64)).sum(-1, keepdim=True))) @ k64 * sc
    s32 = q[rows].float() @ kf.T
    lse2 = torch.logsumexp(s32 * sc, -1, keepdim=True) * LOG2E
    o16 = (torch.exp2(s32 * (sc * LOG2E) - lse2).to(dt).float() @ vf).to(dt)
    delta = (do[rows].float() * o16.float()).sum(-1, keepdim=True)
    dp = do[rows].float() @ vf.T
    for name, (exp2, shift) in VARIANTS.items():
        ds = exp2(s32 * (sc * LOG2E) - lse2) * (dp - delta)
        if name == "hardware exp2":
            subnormal += (ds.abs() < 6.1e-5).float().mean().item() / (N // BLOCK)
        dq = ((ds * 2.0**shift).to(dt).float() @ kf) / 2.0**shift * sc
        worst[name] = max(worst[name], (dq.to(dt).double() - dq_ref).abs().max().item())
    rounding = max(rounding, (dq_ref.to(dt).double() - dq_ref).abs().max().item())
    largest = max(largest, dq_ref.abs().max().item())
print(f"dS entries below float16's smallest normal: {subnormal:.1%}")
for name, err in worst.items():
    print(f"{name}: dQ largest error {err:.3g}")
print(f"the float64 reference stored in float16: {rounding:.3g}; largest |dQ| {largest:.3g}")
