"""Scratch A/B: the forward's K/V loads at ~1k tokens: in-kernel descriptors (ours) vs pointer loads vs host descriptors."""
import math, statistics, torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from cs336_systems.attention import flash_triton, options
from cs336_systems.attention.flash_common import _exp2, _key_ranges, _key_visible, _load_cols, _store_cols, _tile_and_head, _head_descriptor

@triton.jit
def _loop(acc, m_i, l_i, q, K, V, k_desc, v_desc, b, h, stride_kn, stride_vn, offs_m, lo, hi, n_keys, qk_scale,
          D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MODE == 0:
            k = k_desc.load([start_n, 0]); v = v_desc.load([start_n, 0])
        elif MODE == 1:
            cols = tl.arange(0, D)
            ok = offs_n[:, None] < n_keys
            k = tl.load(K + offs_n[:, None] * stride_kn + cols[None, :], mask=ok, other=0.0)
            v = tl.load(V + offs_n[:, None] * stride_vn + cols[None, :], mask=ok, other=0.0)
        else:
            k = k_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, D)
            v = v_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, D)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where(_key_visible(offs_m[:, None], offs_n[None, :], n_keys, True), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = _exp2(s * qk_scale - m_new[:, None], False, q.dtype)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i

@triton.jit(do_not_specialize=["n_heads", "n_queries", "n_keys"])
def fwd(Q, K, V, O, L, k_hd, v_hd, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
        n_heads, n_queries, n_keys, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MODE: tl.constexpr):
    tile_m, b, h = _tile_and_head(n_queries, n_heads, BLOCK_M, True)
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_queries
    q = _load_cols(Q + b * sqb + h * sqh, offs_m, sqn, 1, row_ok, 0, D, D)
    k_head, v_head = K + b * skb + h * skh, V + b * svb + h * svh
    if MODE == 0:
        k_desc = _head_descriptor(k_head, skn, n_keys, D, BLOCK_N, D)
        v_desc = _head_descriptor(v_head, svn, n_keys, D, BLOCK_N, D)
    elif MODE == 1:
        k_desc, v_desc = k_hd, v_hd
    else:
        k_desc, v_desc = k_hd, v_hd
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mid, hi = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, True)
    bi, hi32 = b.to(tl.int32), h.to(tl.int32)
    acc, m_i, l_i = _loop(acc, m_i, l_i, q, k_head, v_head, k_desc, v_desc, bi, hi32, skn, svn, offs_m, 0, mid, n_keys,
                          qk_scale, D, BLOCK_N, False, MODE)
    acc, m_i, l_i = _loop(acc, m_i, l_i, q, k_head, v_head, k_desc, v_desc, bi, hi32, skn, svn, offs_m, mid, hi, n_keys,
                          qk_scale, D, BLOCK_N, True, MODE)
    _store_cols(O + b * sob + h * soh, offs_m, son, 1, row_ok, (acc / l_i[:, None]).to(O.dtype.element_ty), 0, D, D)
    tl.store(L + (b * n_heads + h) * n_queries + offs_m, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=row_ok)

def launch(q, k, v, mode, bm, bn, warps, stages):
    B, H, N, D = q.shape
    o = torch.empty_like(q); lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    if mode == 2:
        kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, bn, D])
        vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, D])
    else:
        kd = vd = None
    grid = (triton.cdiv(N, bm) * B * H,)
    fwd[grid](q, k, v, o, lse, kd, vd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
              H, N, N, 1.4426950408889634 / math.sqrt(D), D=D, BLOCK_M=bm, BLOCK_N=bn, MODE=mode,
              num_warps=warps, num_stages=stages)
    return o, lse

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


if not torch.cuda.is_available():
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    for (B, H, N) in [(2, 3, 40), (1, 2, 64)]:
        x = [torch.randn(B, N, H, 64, dtype=torch.bfloat16) for _ in range(3)]
        q, k, v = (t.transpose(1, 2) for t in x)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        for mode in (0, 1, 2):
            o, _ = launch(q, k, v, mode, 16, 16, 4, 1)
            print("cpu", B, H, N, mode, (o.float() - ref).abs().max().item())
    raise SystemExit
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
if True:
    for (B, H, N, D) in [(8, 12, 1024, 64), (8, 25, 1024, 64), (8, 16, 1000, 64), (4, 16, 2048, 64), (2, 25, 4096, 64)]:
        x = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        q, k, v = (t.transpose(1, 2) for t in x)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        impls = {}
        def ours():
            with options.use(gluon=False):
                return flash_triton._forward(q, k, v, True, 1 / math.sqrt(D))
        impls["ours"] = ours
        for (bm, bn, w, st) in [(128, 64, 8, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3)]:
            for mode in (0, 1, 2):
                impls[f"m{mode}_{bm}x{bn}w{w}s{st}"] = (lambda mode=mode, bm=bm, bn=bn, w=w, st=st: launch(q, k, v, mode, bm, bn, w, st))
        impls["cudnn"] = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=1 / math.sqrt(D))
        graphs, errs = {}, {}
        for name, fn in impls.items():
            try:
                out = fn()[0]; errs[name] = (out.float() - ref).abs().max().item(); graphs[name] = graph_of(fn)
            except Exception as e:
                print(f"{(B,H,N,D)} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        times = {n: [] for n in graphs}; order = list(graphs)
        for r in range(ROUNDS):
            for n in order[r % len(order):] + order[: r % len(order)]:
                times[n].append(time_graph(graphs[n]))
        for n in order:
            ts = times[n]
            print(f"{B},{H},{N},{D} {n:20s} {statistics.median(ts):8.1f} us spread {max(ts)-min(ts):5.1f} err {errs[n]:.1e}", flush=True)
