# Lab record: the Python host path of one FlashAttentionTriton forward + backward on CPU, kernel launches stubbed
# out (TRITON_INTERPRET=1 only so that CPU tensors pass the device check). Usage: python host_path_cpu.py [prof]
import os, time, cProfile, pstats, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from cs336_systems.attention import FlashAttentionTriton, flash_triton
from cs336_systems.attention.launch_cache import FLASH_LAUNCHES
calls = []
FLASH_LAUNCHES.launch = lambda fn, grid, args, constexprs: calls.append(1)   # host path only: no kernel runs
b, h, n, d = 1, 2, 128, 64
q, k, v = (torch.randn(b, h, n, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(b, h, n, d, dtype=torch.bfloat16)
def step():
    o = FlashAttentionTriton.apply(q, k, v, True)
    torch.autograd.grad(o, (q, k, v), do)
for _ in range(20): step()
N = 300
best = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(N): step()
    best.append((time.perf_counter() - t) / N * 1e6)
us = min(best)
print(f"host µs per fwd+bwd (launches stubbed): {us:.1f}; launches stubbed {len(calls)}")
# baseline: what autograd + 3 empty_like cost with no work at all
class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v); return torch.empty_like(q)
    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors; return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
fl = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(N): torch.autograd.grad(Noop.apply(q, k, v), (q, k, v), do)
    fl.append((time.perf_counter() - t) / N * 1e6)
print(f"floor (autograd.Function + 4 empty_like): {min(fl):.1f} µs")
if len(sys.argv) > 1:
    cProfile.run("for _ in range(200): step()", "/tmp/host.prof")
    pstats.Stats("/tmp/host.prof").sort_stats("tottime").print_stats(25)
