# Lab record: where the host time of one FlashAttentionTriton forward + backward goes, on the GPU host.
# Every row is host µs per call of one piece, issued while the GPU sleeps (so no piece waits on it), median
# and min of ROUNDS rounds. Usage (GPU): python host_breakdown.py [B,H,N,D] [--profile]
import cProfile, io, pstats, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.attention import launch_plan
from cs336_systems.attention.launch_cache import FLASH_LAUNCHES, _signature, _grid3
from cs336_systems.attention.launch_plan import LaunchPlan
from cs336_systems.benchmarking.flash_host_overhead import sleep_cycles

shape = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 and "," in sys.argv[1] else "1,16,1024,64").split(","))
ROUNDS, dev = 5, torch.device("cuda", 0)
q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(shape, device=dev, dtype=torch.bfloat16)


def timed(fn, n):
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles(0.3))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    el = time.perf_counter() - t
    awake = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return el / n * 1e6, awake


rows = {}


def row(name, fn, n=20):
    for _ in range(3):
        fn()
    got = [timed(fn, n) for _ in range(ROUNDS)]
    us = [g[0] for g in got]
    rows[name] = (statistics.median(us), min(us), max(us), any(g[1] for g in got))


def ours():
    torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do)


def sdpa(backend):
    def f():
        with sdpa_kernel(backend):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    return f


class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Record the launches one call makes (through the launch cache: plans off).
ours(); ours()
launch_plan.FLASH_PLANS.enabled = False
recorded, original = [], FLASH_LAUNCHES.launch
FLASH_LAUNCHES.launch = lambda fn, grid, args, cx: (recorded.append((fn, grid, args, cx)), original(fn, grid, args, cx))
ours()
FLASH_LAUNCHES.launch = original
print("launches per call:", len(recorded), [getattr(getattr(f, "fn", f), "__name__", "?") for f, *_ in recorded])

launch_plan.FLASH_PLANS.enabled = True
ours(); ours()
row("ours fwd+bwd", ours)
with launch_plan.disabled():
    row("ours fwd+bwd, plans off", ours)
run_plan = LaunchPlan.run
LaunchPlan.run = lambda self, tensors, stream: None
row("ours, plan replays stubbed", ours)
LaunchPlan.run = run_plan
launch_plan.FLASH_PLANS.enabled = False
row("sdpa cudnn fwd+bwd", sdpa(SDPBackend.CUDNN_ATTENTION))
row("sdpa flash fwd+bwd", sdpa(SDPBackend.FLASH_ATTENTION))
row("autograd no-op fn + 4 empty_like", lambda: torch.autograd.grad(Noop.apply(q, k, v), (q, k, v), do))
FLASH_LAUNCHES.launch = lambda *a: None
row("ours, plans off, launches stubbed", ours)
FLASH_LAUNCHES.launch = original
x = torch.zeros(16, device=dev)
row("torch x.add_(1)", lambda: x.add_(1), 200)
row("torch.empty(shape)", lambda: torch.empty(shape, device=dev, dtype=torch.bfloat16), 200)
row("torch.cuda.device(dev) enter+exit", lambda: torch.cuda.device(dev).__enter__() and None, 200)
cm = torch.cuda.device(dev)
def dev_ctx():
    with torch.cuda.device(dev):
        pass
row("with torch.cuda.device(dev)", dev_ctx, 200)
row("current raw stream", lambda: FLASH_LAUNCHES._stream(dev), 200)
for i, (fn, grid, args, cx) in enumerate(recorded):
    name = getattr(getattr(fn, "fn", fn), "__name__", "?")
    row(f"launch {i} {name}: LaunchCache.launch", lambda fn=fn, grid=grid, args=args, cx=cx: FLASH_LAUNCHES.launch(fn, grid, args, cx), 100)
    row(f"launch {i} {name}: _signature", lambda args=args: _signature(args), 200)
    key = (id(fn), dev.index, _signature(args), tuple(cx.items()))
    kernel, meta, tail, hook = FLASH_LAUNCHES._entries[key]
    gx, gy, gz = _grid3(grid(meta) if callable(grid) else grid)
    full = (*args, *tail)
    stream = FLASH_LAUNCHES._stream(dev)
    if hook is not None:
        hook(dict(zip(fn.arg_names, full)))
        row(f"launch {i} {name}: pre-hook", lambda hook=hook, fn=fn, full=full: hook(dict(zip(fn.arg_names, full))), 200)
    run = lambda kernel=kernel, full=full, g=(gx, gy, gz): kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
    row(f"launch {i} {name}: CompiledKernel.run", run, 100)
    ndesc = sum(1 for a in full if hasattr(a, "block_shape"))
    if ndesc:
        from triton.backends.nvidia import driver as nvd
        metas = getattr(kernel.metadata, "tensordesc_meta", None) or [None] * ndesc
        descs = [a for a in full if hasattr(a, "block_shape")]
        row(f"launch {i} {name}: make_tensordesc_arg x{ndesc}",
            lambda descs=descs, metas=metas: [nvd.make_tensordesc_arg(d, m) for d, m in zip(descs, metas)], 100)
    print("  args", len(full), "descriptors", ndesc, "grid", (gx, gy, gz), flush=True)

w = max(len(n) for n in rows)
print(f"\nshape {shape}, bf16 causal, host µs per call, {ROUNDS} rounds, GPU asleep ({torch.cuda.get_device_name()})")
print(f"{'piece':<{w}}  median    min    max  gpu-woke")
for n, (med, lo, hi, awake) in rows.items():
    print(f"{n:<{w}}  {med:7.1f} {lo:6.1f} {hi:6.1f}  {awake}")

launch_plan.FLASH_PLANS.enabled = True
if "--profile" in sys.argv:
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles(2.0))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        ours()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    print(buf.getvalue())
