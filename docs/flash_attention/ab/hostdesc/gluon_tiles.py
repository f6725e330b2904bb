"""Scratch A/B: Gluon forward tiles vs the Triton forward vs cuDNN on head views, GPU time from CUDA-graph replays."""
import math, statistics, sys, torch, torch.nn.functional as F
from cs336_systems.attention import flash_triton, options
from cs336_systems.attention import flash_fwd_sm90 as g

SHAPES = [(8, 12, 1024, 64), (8, 25, 1024, 64), (4, 16, 2048, 64), (2, 25, 4096, 64), (8, 16, 1000, 64)]
TILES = [(192, 128, 3), (128, 128, 3), (128, 64, 3), (128, 64, 4), (192, 64, 3), (128, 128, 2)]
CALLS, ROUNDS = 10, 7

def graph_of(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(CALLS):
            fn()
    return gr

def time_graph(gr):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); gr.replay(); b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / CALLS

rows = []
for (B, H, N, D) in SHAPES:
    x = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in x)  # head views
    scale = 1 / math.sqrt(D)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    impls = {}
    def tri():
        with options.use(gluon=False):
            return flash_triton._forward(q, k, v, True, scale)
    impls["triton"] = tri
    for t in TILES:
        def glu(t=t):
            g.TILES[64] = t; g._layouts.cache_clear()
            with options.use(gluon=True, gluon_head_views=True):
                return flash_triton._forward(q, k, v, True, scale)
        impls[f"gluon{t[0]}x{t[1]}s{t[2]}"] = glu
    def cud():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    impls["cudnn"] = cud
    graphs, errs = {}, {}
    for name, fn in impls.items():
        try:
            out = fn()[0]
            errs[name] = (out.float() - ref).abs().max().item()
            graphs[name] = (graph_of(fn), fn)
        except Exception as e:
            print(f"{(B,H,N,D)} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    times = {n: [] for n in graphs}
    order = list(graphs)
    for r in range(ROUNDS):
        for n in order[r % len(order):] + order[: r % len(order)]:
            gr, fn = graphs[n]
            if n.startswith("gluon"):  # the graph holds the launch it captured; nothing to set
                pass
            times[n].append(time_graph(gr))
    for n in order:
        ts = times[n]
        rows.append((f"{B},{H},{N},{D}", n, statistics.median(ts), max(ts) - min(ts), errs[n]))
        print(f"{B},{H},{N},{D:<4} {n:18s} {statistics.median(ts):8.1f} us  spread {max(ts)-min(ts):6.1f}  maxerr {errs[n]:.2e}", flush=True)
