"""FlashAttention-2 (PyTorch tiled and Triton) against a float64 reference.

Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter: ``TRITON_INTERPRET`` is
set below before any kernel is decorated (``cs336_systems.attention`` decorates them lazily, on first
launch). Shapes stay tiny there because the interpreter executes every tile op in numpy. With a GPU the
same cases run on CUDA in float32 (TF32), float16 and bfloat16, plus a few larger shapes.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import random
import re

import pytest
from cs336_basics.model import BasicsTransformerLM, available_attention_impls

from cs336_systems.attention import (
    SUPPORTED_HEAD_DIMS,
    FlashAttentionPytorch,
    FlashAttentionTriton,
    causal_mask,
    naive_attention,
    options,
    reference_attention,
)
from cs336_systems.attention.flash_triton import head_dim_slabs, stored_head_dim
from tests.adapters import (
    get_flashattention_autograd_function_pytorch,
    get_flashattention_autograd_function_triton,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
IMPLS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}


@pytest.fixture(autouse=True)
def _untuned_on_gpus():
    """One config per kernel on a GPU: these tests check numerics, tuning would only add compile time."""
    with options.use(autotune=not HAS_CUDA):
        yield


@dataclasses.dataclass(frozen=True)
class Case:
    n_queries: int
    n_keys: int
    head_dim: int
    is_causal: bool
    heads: int | None  # None: 3-D inputs (batch, n, d)
    batch: int = 2

    def __str__(self) -> str:
        rank = "3d" if self.heads is None else f"4d{self.heads}h"
        mask = "causal" if self.is_causal else "full"
        return f"q{self.n_queries}-k{self.n_keys}-d{self.head_dim}-{mask}-{rank}"


def _cases() -> list[Case]:
    """Fixed edge cases plus seeded random ones: every head dim, causal or not, 3-D and 4-D, odd lengths."""
    cases = [
        Case(1, 1, 16, True, None),
        Case(1, 37, 32, True, 2),  # one query sees only key 0
        Case(45, 17, 16, True, None),  # more queries than keys: rows past the keys see everything
        Case(17, 45, 64, True, 1),  # more keys than queries: the last keys are seen by nobody
        Case(32, 32, 16, False, None),  # exact tile multiples
        Case(33, 50, 128, False, 2),
        # head dims that are not powers of two: two slabs (80 = 64 + 16, the 2.7B / 2026-xl models'; 96 =
        # 64 + 32; 40 = 32 + a 16-wide tail half past d), one padded slab (24 in 32, 112 in 128), and odd
        # sizes copied with zero columns (5, 33: rows not whole 16-byte units)
        Case(33, 41, 80, True, 2),
        Case(21, 19, 96, False, 1),
        Case(20, 20, 24, False, None),
        Case(17, 29, 40, True, None),
        Case(18, 18, 112, True, 1),
        Case(9, 13, 5, True, 2),
        Case(16, 16, 33, False, None),
    ]
    rng = random.Random(0)
    for d in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            n_q, n_k = rng.randint(2, 60), rng.randint(2, 60)
            cases.append(Case(n_q, n_k, d, causal, rng.choice([None, 3])))
    return cases


CASES = _cases()
_GPU_SHAPES = (
    [Case(128, 128, 64, c, None, batch=4) for c in (False, True)]
    + [Case(257, 1000, d, c, 3) for d in SUPPORTED_HEAD_DIMS for c in (False, True)]
    + [Case(1000, 257, 64, True, 2), Case(2048, 2048, 128, True, 4, batch=1)]
    + [Case(257, 1000, 80, c, 3) for c in (False, True)]
)
#: bf16 on every shape; fp16 and fp32 on head dim 64 only, which bounds the number of compiled variants.
GPU_MATRIX = [
    pytest.param(case, dtype, id=f"{case}-{str(dtype).removeprefix('torch.')}")
    for case in _GPU_SHAPES
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    if dtype == torch.bfloat16 or case.head_dim == 64
]


def _inputs(case: Case, dtype: torch.dtype, device: str = DEVICE, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lead = (case.batch,) if case.heads is None else (case.batch, case.heads)

    def make(n: int) -> torch.Tensor:
        return torch.randn(*lead, n, case.head_dim, generator=g).to(device=device, dtype=dtype)

    q, k, v = make(case.n_queries), make(case.n_keys), make(case.n_keys)
    do = make(case.n_queries)
    return q, k, v, do


def _run(fn, q, k, v, do, is_causal, *, read_lse: bool = True):
    """Forward + backward; returns O, L (from the saved tensors, or None) and the three gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, is_causal)
    lse = _saved_lse(o, q) if read_lse else None
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


def _saved_lse(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    lse_shape = q.shape[:-1]
    candidates = [t for t in o.grad_fn.saved_tensors if t.shape == lse_shape]
    assert len(candidates) == 1, "exactly one saved tensor must have the shape of L"
    return candidates[0]


def _reference(q, k, v, do, is_causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = reference_attention(q64, k64, v64, is_causal)
    o.backward(do.double())
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


NAMES = ("O", "L", "dQ", "dK", "dV")


def _fp32_tol(impl_name: str) -> float:
    """float32 tolerance: round-off on CPU; on a GPU the Triton kernels use 3xTF32 products (float32-level,
    at PyTorch's default matmul precision), given a little more room."""
    return 1e-3 if (HAS_CUDA and impl_name in ("triton", "flash_triton")) else 1e-4


def _assert_matches_reference(impl: type, case: Case, dtype: torch.dtype, atol: float, rtol: float) -> None:
    q, k, v, do = _inputs(case, dtype)
    got = _run(impl.apply, q, k, v, do, case.is_causal)
    want = _reference(q, k, v, do, case.is_causal)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_matches_float64_reference_fp32(impl_name: str, case: Case) -> None:
    tol = _fp32_tol(impl_name)
    _assert_matches_reference(IMPLS[impl_name], case, torch.float32, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_pytorch_float64_is_exact(case: Case) -> None:
    _assert_matches_reference(FlashAttentionPytorch, case, torch.float64, atol=1e-10, rtol=1e-10)


def test_polynomial_exp2_accuracy() -> None:
    """The FMA-pipe ``2**x`` (``options.poly_exp2``): relative error below 1e-4 over the range scores
    minus their max take, and masked scores (-inf) come out as a normal float far below 16-bit resolution."""
    import triton

    from cs336_systems.attention import flash_triton

    kernel = flash_triton.kernel_module().exp2_fma_kernel
    x = torch.cat([torch.linspace(-120, 0.25, 4093, device=DEVICE), torch.tensor([float("-inf"), -1e30, 0.0], device=DEVICE)])
    y = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    finite = x > -125
    rel = (y[finite].double() / torch.exp2(x[finite].double()) - 1).abs().max().item()
    assert rel < 1e-4, rel
    assert (y[~finite] > 0).all() and (y[~finite] < 1e-37).all()
    assert y[-1].item() == pytest.approx(1.0, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_polynomial_exp2_path_matches_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every phase on the polynomial exponential, 16-bit results stay as close to float64 as the
    hardware-``ex2`` path's (twice its error plus 16-bit round-off at most)."""
    from cs336_systems.attention import flash_triton

    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("the CPU interpreter has no bfloat16")
    case = Case(37, 45, 32, True, 2)
    q, k, v, do = _inputs(case, dtype)
    want = _reference(q, k, v, do, True)
    with options.use(poly_exp2="none") as opts:
        assert opts.poly_exp2 == frozenset()
        hw = _error(_run(FlashAttentionTriton.apply, q, k, v, do, True), want)
    with options.use(poly_exp2="all") as opts:
        assert opts.poly_exp2 == {"forward", "dkdv", "dq"}
        assert all(c.kwargs["POLY_EXP2"] for p in ("forward", "dkdv", "dq")
                   for c in flash_triton.kernel_module().tuned(p, opts).configs)
        poly = _error(_run(FlashAttentionTriton.apply, q, k, v, do, True), want)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for name, a, b in zip(NAMES, poly, hw):
        assert a <= 2 * b + floor, f"{name}: polynomial {a:.3g} vs hardware {b:.3g}"


def test_bad_kernel_options_are_one_line_errors() -> None:
    before = options.current()
    for changes, message in (({"poly_exp2": "forward,softmax"}, "poly_exp2 names unknown phases ['softmax']"),
                             ({"candidates": {"attention": []}}, "candidates for unknown phases ['attention']"),
                             ({"candidates": {"dq": []}}, "no candidate tiles for dq"),
                             ({"autotune": "no"}, "autotune must be True or False")):
        with pytest.raises(ValueError, match=re.escape(message)):
            options.set_options(**changes)
        assert options.current() is before  # a refused change leaves the options as they were
    assert options.FlashOptions().poly_for("dkdv", options.Tile(64, 64, 4, 3)) is True  # the default phase
    assert options.FlashOptions().poly_for("dkdv", options.Tile(64, 64, 4, 3, poly=False)) is False  # a pin
    assert options.FlashOptions(poly_exp2="none").poly_for("dkdv", options.Tile(64, 64, 4, 3, poly=True)) is False


@pytest.mark.parametrize(("batch", "heads", "n", "group", "heavy_last"),
                         [(2, 3, 40, 4, True), (2, 3, 40, 1, False), (1, 5, 33, 2, True), (3, 2, 16, 6, True)])
def test_programs_run_heads_in_l2_groups(batch: int, heads: int, n: int, group: int, heavy_last: bool) -> None:
    """Every (tile, batch, head) program runs once; programs come in groups of ``group`` heads (the last may be
    smaller), all tiles of a group first, heads fastest inside it, causal tiles longest first; one group of all
    heads is the plain heads-fastest order."""
    from cs336_systems.attention import flash_triton

    kernel = flash_triton.kernel_module().program_order_kernel
    block = 16
    n_tiles, n_bh = -(-n // block), batch * heads
    out = torch.full((n_tiles * n_bh, 3), -1, dtype=torch.int32, device=DEVICE)
    kernel[(n_tiles * n_bh,)](out, n, heads, group, BLOCK=block, HEAVY_LAST=heavy_last)
    order = [(t, b * heads + h) for t, b, h in out.tolist()]
    assert sorted(order) == [(t, bh) for t in range(n_tiles) for bh in range(n_bh)]
    pid = 0
    for first in range(0, n_bh, group):
        size = min(group, n_bh - first)
        for step in range(n_tiles):
            tile = n_tiles - 1 - step if heavy_last else step
            assert order[pid:pid + size] == [(tile, first + i) for i in range(size)], (first, step)
            pid += size
    if group >= n_bh:  # the order before grouping: heads fastest over the whole grid
        assert [bh for _, bh in order] == [i % n_bh for i in range(n_tiles * n_bh)]


@pytest.mark.parametrize(("batch", "heads", "n", "n_keys", "group", "causal"),
                         [(2, 3, 40, 40, 4, True), (1, 5, 70, 24, 2, True), (1, 5, 33, 50, 2, False)])
def test_item_key_tiles_follow_the_kernels_order(batch: int, heads: int, n: int, n_keys: int, group: int,
                                                 causal: bool) -> None:
    """The host's list of each item's key tiles (the persistent forward's plan weighs items by it) is in the
    order the kernels decode items (the decode kernel itself, whose order the Gluon forward's ``_item`` shares),
    with each causal tile's keys clamped at the sequence's end."""
    from cs336_systems.attention import flash_triton
    from cs336_systems.attention.scheduling import item_key_tiles

    block_m, block_n = 16, 8
    n_tiles, n_bh = -(-n // block_m), batch * heads
    out = torch.full((n_tiles * n_bh, 3), -1, dtype=torch.int32, device=DEVICE)
    flash_triton.kernel_module().program_order_kernel[(n_tiles * n_bh,)](out, n, heads, group, BLOCK=block_m,
                                                                         HEAVY_LAST=causal)
    expected = [-(-min((tile + 1) * block_m, n_keys) // block_n) if causal else -(-n_keys // block_n)
                for tile, _, _ in out.tolist()]
    assert item_key_tiles(n_bh, n_tiles, group, n_keys, block_m, block_n, causal) == expected


def test_list_schedule_deals_every_item_once_and_evens_the_load() -> None:
    """Each item goes to the program that frees first: every item once, each program's items in the one-item
    order, the busiest program within one item of the average; equal items reduce to dealing in turn. At a causal
    shape with head groups, dealing in turn leaves a long tail that the plan removes (persistent.md)."""
    from cs336_systems.attention.scheduling import ITEM_OVERHEAD_TILES, heads_per_l2_group, item_key_tiles, list_schedule

    weights = [5, 1, 4, 4, 2, 9, 1, 1, 3, 7]
    offsets, items = list_schedule(weights, 3)
    assert sorted(items) == list(range(len(weights))) and offsets[0] == 0 and offsets[-1] == len(weights)
    mine = [items[offsets[p]:offsets[p + 1]] for p in range(3)]
    assert all(m == sorted(m) for m in mine)
    loads = [sum(weights[i] for i in m) for m in mine]
    assert max(loads) <= sum(weights) / 3 + max(weights)
    offsets, items = list_schedule([2] * 7, 3)  # equal items: program p takes p, p + 3, ...
    assert [items[offsets[p]:offsets[p + 1]] for p in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="at least one program"):
        list_schedule([1], 0)

    # (8, 16, 2048, 128) causal on 132 SMs, head groups sized for the nominal 50 MiB L2, weights as planned
    programs, n, d, n_bh = 132, 2048, 128, 8 * 16
    group = heads_per_l2_group(n_bh, 2 * n * d * 2, torch.device("cpu"))
    weights = [t + ITEM_OVERHEAD_TILES for t in item_key_tiles(n_bh, n // 128, group, n, 128, 128, True)]
    in_turn = [sum(weights[p::programs]) for p in range(programs)]
    offsets, items = list_schedule(weights, programs)
    planned = [sum(weights[i] for i in items[offsets[p]:offsets[p + 1]]) for p in range(programs)]
    mean = sum(weights) / programs
    assert max(in_turn) / mean > 1.25 and max(planned) / mean < 1.1


def test_persistent_schedule_is_a_table_of_counts_and_items() -> None:
    """The persistent forward's plan as the kernel reads it: row ``p`` holds program ``p``'s count, then its items;
    one plan per shape, reused."""
    from cs336_systems.attention import flash_fwd_sm90

    from cs336_systems.attention.scheduling import ITEM_OVERHEAD_TILES, item_key_tiles, list_schedule

    cpu = torch.device("cpu")
    table = flash_fwd_sm90.persistent_schedule(6, 100, 100, 4, 32, 32, True, 5, cpu)
    assert table.dtype == torch.int32 and table.shape[0] == 5
    counts = table[:, 0].tolist()
    rows = [table[p, 1:1 + counts[p]].tolist() for p in range(5)]
    offsets, items = list_schedule([t + ITEM_OVERHEAD_TILES for t in item_key_tiles(6, 4, 4, 100, 32, 32, True)], 5)
    assert rows == [items[offsets[p]:offsets[p + 1]] for p in range(5)]  # the plan, row by row, in order
    assert table.shape[1] == 1 + max(counts)
    assert flash_fwd_sm90.persistent_schedule(6, 100, 100, 4, 32, 32, True, 5, cpu) is table


@pytest.mark.parametrize(("batch", "heads", "n", "n_keys", "group", "causal"),
                         [(2, 3, 40, 40, 4, True), (1, 5, 70, 24, 2, True), (1, 5, 33, 50, 2, False),
                          (1, 2, 20, 60, 2, True)])
def test_key_tile_query_steps_follow_the_kernels_order(batch: int, heads: int, n: int, n_keys: int, group: int,
                                                       causal: bool) -> None:
    """The host's list of each (key tile, head) item's query tiles (the persistent dK/dV kernel's plan weighs items
    by it) is in the order the dK/dV kernels decode items (the decode kernel, without ``HEAVY_LAST``), a causal key
    tile starting at the query tile of its first key; key tiles past the last query (more keys than queries) stream
    none."""
    from cs336_systems.attention import flash_triton
    from cs336_systems.attention.scheduling import key_tile_query_steps

    block_m, block_n = 8, 16
    n_tiles, n_bh = -(-n_keys // block_n), batch * heads
    out = torch.full((n_tiles * n_bh, 3), -1, dtype=torch.int32, device=DEVICE)
    flash_triton.kernel_module().program_order_kernel[(n_tiles * n_bh,)](out, n_keys, heads, group, BLOCK=block_n,
                                                                         HEAVY_LAST=False)
    firsts = [min(tile * block_n // block_m * block_m, n) if causal else 0 for tile, _, _ in out.tolist()]
    expected = [-(-(n - lo) // block_m) for lo in firsts]
    assert key_tile_query_steps(n_bh, n_tiles, group, n, block_m, block_n, causal) == expected
    assert (0 in expected) == (causal and n_keys > n)


def test_persistent_backward_schedule_is_a_table_of_counts_and_items() -> None:
    """The persistent dK/dV kernel's plan, as the kernel reads it: row ``p`` holds program ``p``'s count, then its
    items, dealt by their query tiles plus the per-item overhead; one plan per shape, reused."""
    from cs336_systems.attention import flash_bwd_sm90
    from cs336_systems.attention.scheduling import ITEM_OVERHEAD_TILES, key_tile_query_steps, list_schedule

    cpu = torch.device("cpu")
    table = flash_bwd_sm90.persistent_schedule(6, 100, 100, 4, 16, 32, True, 5, cpu)
    counts = table[:, 0].tolist()
    rows = [table[p, 1:1 + counts[p]].tolist() for p in range(5)]
    steps = key_tile_query_steps(6, 4, 4, 100, 16, 32, True)
    offsets, items = list_schedule([t + ITEM_OVERHEAD_TILES for t in steps], 5)
    assert rows == [items[offsets[p]:offsets[p + 1]] for p in range(5)] and sorted(items) == list(range(24))
    assert table.dtype == torch.int32 and table.shape == (5, 1 + max(counts))
    assert flash_bwd_sm90.persistent_schedule(6, 100, 100, 4, 16, 32, True, 5, cpu) is table


def test_head_groups_fill_the_l2_share() -> None:
    """As many heads per group as fit their streamed bytes in the share of L2 (an H100's 50 MiB is assumed for
    CPU tensors), at least one, at most all; no grouping without a share; a bad share is a one-line error."""
    from cs336_systems.attention.scheduling import heads_per_l2_group

    cpu, mib = torch.device("cpu"), 2**20
    with options.use(l2_share=0.5):
        assert heads_per_l2_group(128, 2 * mib, cpu) == 12  # (4, 32, 4096, 128): 2 MiB of K and V per head
        assert heads_per_l2_group(8, 2 * mib, cpu) == 8
        assert heads_per_l2_group(16, 64 * mib, cpu) == 1
    with options.use(l2_share=1.0):
        assert heads_per_l2_group(128, 2 * mib, cpu) == 25
    with options.use(l2_share=None):
        assert heads_per_l2_group(128, 2 * mib, cpu) == 128
    for bad in (0, -1, "half", True):
        with pytest.raises(ValueError, match="l2_share must be a positive number"):
            options.FlashOptions(l2_share=bad)


@pytest.mark.slow
def test_head_groups_change_the_order_not_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups that do not divide batch * heads (4 heads for the forward and dQ, 3 for dK/dV, of 6) give
    bit-identical outputs and gradients to the ungrouped order: only which program runs when changes."""
    from cs336_systems.attention import scheduling
    from cs336_systems.attention.scheduling import _NOMINAL_L2_BYTES, heads_per_l2_group

    monkeypatch.setattr(scheduling, "_l2_bytes", lambda index: _NOMINAL_L2_BYTES)  # a GPU's own L2 sizes other groups
    case, dtype = Case(40, 40, 16, True, 3), torch.float32
    q, k, v, do = _inputs(case, dtype)
    share = 4 * (2 * 40 * 16 * 4) / _NOMINAL_L2_BYTES  # 4 heads' K and V
    with options.use(l2_share=share):
        assert heads_per_l2_group(6, 2 * 40 * 16 * 4, q.device) == 4
        assert heads_per_l2_group(6, 40 * (2 * 16 * 4 + 8), q.device) == 3
        grouped = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    with options.use(l2_share=None):
        plain = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    for name, a, b in zip(NAMES, grouped, plain):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.parametrize("case", [Case(40, 40, 16, True, 3), Case(37, 53, 80, False, 2)], ids=str)
def test_persistent_grid_changes_the_order_not_the_numbers(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent grid (one program taking every item, or four programs taking them in turn, with a remainder)
    gives bit-identical outputs and gradients to one program per item, ragged and two-slab head dims included:
    each item is computed as before, only by another program."""
    from cs336_systems.attention import scheduling

    # A GPU reports its own SMs and L2; give it the interpreter's nominal one SM and L2 so that the grids
    # (one, four, three programs) and head groups are the same few-program cases on either device.
    monkeypatch.setattr(scheduling, "_sm_count", lambda index: scheduling._NOMINAL_SMS)
    monkeypatch.setattr(scheduling, "_l2_bytes", lambda index: scheduling._NOMINAL_L2_BYTES)
    q, k, v, do = _inputs(case, torch.float32)
    plain = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    n_bh = q.shape[0] * q.shape[1]
    four_heads = 4 * (2 * case.n_keys * case.head_dim * 4) / scheduling._NOMINAL_L2_BYTES  # K and V of four heads
    for per_sm, share in ((1, options.DEFAULT_L2_SHARE), (4, options.DEFAULT_L2_SHARE), (3, four_heads)):
        with options.use(persistent=per_sm, l2_share=share):
            assert scheduling.persistent_programs(q.device) == per_sm  # one nominal SM
            if share == four_heads:  # 6 heads: a group of 4, then a smaller one, the decode's edge case
                assert scheduling.heads_per_l2_group(n_bh, 2 * case.n_keys * case.head_dim * 4, q.device) == 4
            persistent = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
        for name, a, b in zip(NAMES, persistent, plain):
            assert torch.equal(a, b), (per_sm, share, name)


@pytest.mark.slow
@pytest.mark.parametrize("case", [Case(40, 40, 16, True, 3), Case(37, 53, 80, False, 2), Case(33, 33, 24, True, 2)],
                         ids=str)
def test_dq_accumulated_by_the_dkdv_kernel_matches_the_dq_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dq_atomic``: dK/dV adds every tile's ``dS K`` to a float32 dQ (the dQ kernel writes only the
    ``[L; D]`` rows, and the zeros of those sums). O, L, dK and dV are bit-identical to the two-kernel backward; dQ
    differs only by the order of its float32 sums, and also under a persistent grid. Buffers come from
    ``torch.empty`` filled with NaN here, so a sum the dQ kernel failed to zero would show."""
    q, k, v, do = _inputs(case, torch.float32)
    plain = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    real_empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    from cs336_systems.attention import flash_triton

    real_launch, sums = flash_triton._launch_backward, []

    def launch(*args: object) -> None:
        sums.append(args[10] is not None)  # dq_acc: the float32 sums the dK/dV kernel adds dQ to
        real_launch(*args)

    for extra in ({}, {"persistent": 2}):
        with options.use(dq_atomic=True, **extra), monkeypatch.context() as patched:
            patched.setattr(torch, "empty", nan_empty)
            patched.setattr(flash_triton, "_launch_backward", launch)
            fused = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
        assert sums.pop() and not sums, "the backward did not take the fused path"
        for name, a, b in zip(NAMES, fused, plain):
            if name == "dQ":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                assert not torch.equal(a, torch.zeros_like(a))
            else:
                assert torch.equal(a, b), (extra, name)
    with pytest.raises(ValueError, match="dq_atomic must be True, False or None"):
        options.FlashOptions(dq_atomic=1)


@pytest.mark.slow
def test_fused_dq_is_converted_into_strided_outputs() -> None:
    """With ``dq_atomic`` a kernel of its own scales the float32 sums into dQ. Given head views of one packed buffer
    to write into (``out``, as :mod:`.flash_qkvpacked` passes them), it writes dQ through their strides, at a head
    dim that is not a power of two, and leaves the buffer's other columns alone."""
    from cs336_systems.attention import flash_triton

    case = Case(37, 37, 24, True, 3)
    q, k, v, do = (t.unsqueeze(1) if t.dim() == 3 else t for t in _inputs(case, torch.float32))
    scale = 1.0 / math.sqrt(case.head_dim)
    o, lse = flash_triton._forward(q, k, v, True, scale)
    plain = flash_triton._backward(do, q, k, v, o, lse, True, scale)
    batch, heads, n, d = q.shape
    packed = torch.full((batch, n, 3, heads, d + 8), 7.0)  # (batch, seq, qkv, heads, d + 8): padded heads
    views = tuple(packed[:, :, i, :, :d].transpose(1, 2) for i in range(3))
    with options.use(dq_atomic=True):
        assert flash_triton._backward_route(flash_triton._backward_key(do, q, k, v, o, lse, True, scale, views),
                                            q, k, v, do, views[1], views[2])[1] == n  # the fused path: sums of n rows
        fused = flash_triton._backward(do, q, k, v, o, lse, True, scale, out=views)
    assert all(f is view for f, view in zip(fused, views))
    torch.testing.assert_close(views[0], plain[0], rtol=1e-5, atol=1e-6)
    for view, want in zip(views[1:], plain[1:]):
        assert torch.equal(view, want)
    assert bool((packed[..., d:] == 7.0).all())


def test_the_backward_route_is_decided_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which dK/dV kernel runs and whether it forms dQ (and how many rows its sums take) are remembered per backward
    key and 16-byte alignment: the eligibility check this saves costs more host time than a launch. A misaligned
    tensor decides again, and so do other options: they make another key."""
    from cs336_systems.attention import flash_triton

    q, k, v, do, o = (torch.randn(1, 2, 40, 16) for _ in range(5))
    lse = torch.randn(1, 2, 40)
    calls = []
    real = flash_triton._gluon_backward_module
    monkeypatch.setattr(flash_triton, "_gluon_backward_module", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(flash_triton, "_BACKWARD_ROUTES", {})

    def route(*tensors: torch.Tensor) -> tuple:
        key = flash_triton._backward_key(do, q, k, v, o, lse, True, 0.25)
        return flash_triton._backward_route(key, *tensors)

    assert route(q, k, v, do, k, v) == (None, None)  # by default dQ is fused only where Gluon runs: not on CPU
    with options.use(dq_atomic=True):
        assert route(q, k, v, do, k, v) == (None, 40)
        assert route(q, k, v, do, k, v) == (None, 40)
        assert len(calls) == 2
        shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)  # 4 bytes past a 16-byte boundary
        assert route(shifted, k, v, do, k, v) == (None, 40)
        assert len(calls) == 3
    assert route(q, k, v, do, k, v) == (None, None) and len(calls) == 4  # a new generation of the same options


def test_dq_accumulated_by_the_dkdv_kernel_is_zeroed_around_autotuning() -> None:
    """Every candidate the tuner times adds into the float32 dQ: its dK/dV tuner zeroes it before each and before
    the chosen config's run (a GPU-only path: the interpreter times nothing). The other kernels have no such buffer."""
    from cs336_systems.attention import flash_triton

    tuned = flash_triton.kernel_module().tuned
    assert tuned("dkdv", options.FlashOptions(dq_atomic=True)).reset_to_zero == ["DQ_ACC"]
    assert tuned("dkdv", options.FlashOptions()).reset_to_zero == []
    assert tuned("dq", options.FlashOptions(dq_atomic=True)).reset_to_zero == []


def test_persistent_grid_is_sized_to_the_gpu() -> None:
    """Off by default (one program per item); on, at most ``persistent`` programs per SM and never more
    programs than items; anything but a non-negative integer is a one-line error."""
    from cs336_systems.attention import scheduling

    cpu = torch.device("cpu")
    assert options.current().persistent == 0 and scheduling.persistent_programs(cpu) == 0
    assert scheduling.grid(1000, 0) == (1000,)
    with options.use(persistent=2):
        assert scheduling.persistent_programs(cpu) == 2 * scheduling._NOMINAL_SMS
    assert scheduling.grid(1000, 264) == (264,) and scheduling.grid(100, 264) == (100,)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="persistent must be a non-negative integer"):
            options.FlashOptions(persistent=bad)


@pytest.mark.slow
def test_triton_kernels_compile_for_hopper_one_program_per_item_or_persistent() -> None:
    """The three Triton kernels build for sm_90 both ways, and ``PERSISTENT`` builds another kernel (its loop
    over items), not the one-program-per-item kernel again; dK/dV with ``DQ_ACC`` builds with float32 atomic adds,
    and the dQ kernel that then only writes ``[L; D]`` and the sums' zeros builds without a product."""
    import json
    import subprocess
    import sys

    script = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cs336_systems.attention import flash_bwd, flash_fwd
desc = "tensordesc<bf16[1, 1, 64, 64]>"
kernels = {
    "forward": (flash_fwd.flash_forward_kernel, {"Q": "*bf16", "O": "*bf16", "L": "*fp32", "qk_scale": "fp32",
                                                 "K_DESC": desc, "V_DESC": desc}, ("KT_DESC", "VT_DESC")),
    "dq": (flash_bwd.flash_backward_dq_kernel, {"Q": "*bf16", "DO": "*bf16", "O": "*bf16", "L": "*fp32",
                                                "LD": "*fp32", "DQ": "*bf16", "qk_scale": "fp32", "sm_scale": "fp32",
                                                "K_DESC": desc, "V_DESC": desc}, ("KT_DESC", "VT_DESC")),
    "dkdv": (flash_bwd.flash_backward_dkdv_kernel, {"K": "*bf16", "V": "*bf16", "DK": "*bf16", "DV": "*bf16",
                                                    "qk_scale": "fp32", "sm_scale": "fp32", "Q_DESC": desc,
                                                    "DO_DESC": desc, "LD_DESC": "tensordesc<fp32[1, 2, 64]>"},
             ("QT_DESC", "DOT_DESC", "DQ_ACC")),
}
out = {}
for name, (fn, types, absent) in kernels.items():
    for persistent in (False, True):
        constexprs = {"HEAD_DIM": 64, "D_MAIN": 64, "D_TAIL": 0, "IS_CAUSAL": True, "DOT_PRECISION": "tf32",
                      "POLY_EXP2": False, "BLOCK_M": 64, "BLOCK_N": 64, "PERSISTENT": persistent,
                      "LD_ONLY": False, **dict.fromkeys(absent)}
        constexprs = {key: value for key, value in constexprs.items() if key in fn.arg_names}
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        out[f"{name} {persistent}"] = hash(ptx.split(".entry", 1)[1])
fn, types, _ = kernels["dkdv"]  # dq_atomic: dK/dV adds dS K to a float32 dQ with reductions
constexprs = {"HEAD_DIM": 64, "D_MAIN": 64, "D_TAIL": 0, "IS_CAUSAL": True, "DOT_PRECISION": "tf32",
              "POLY_EXP2": False, "BLOCK_M": 64, "BLOCK_N": 64, "PERSISTENT": False, "QT_DESC": None, "DOT_DESC": None}
sig = {n: "constexpr" if n in constexprs else {**types, "DQ_ACC": "*fp32"}.get(n, "i32") for n in fn.arg_names}
ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4}).asm["ptx"]
out["dkdv atomic"] = len(re.findall(r"\\b(?:atom|red)\\.global[.a-z]*\\.add\\.f32", ptx))
fn, types, absent = kernels["dq"]  # dq_atomic: the dQ kernel writes [L; D] and zeroes the float32 sums, no products
constexprs = {"HEAD_DIM": 64, "D_MAIN": 64, "D_TAIL": 0, "IS_CAUSAL": True, "DOT_PRECISION": "tf32",
              "POLY_EXP2": False, "BLOCK_M": 64, "BLOCK_N": 64, "PERSISTENT": False, "LD_ONLY": True,
              **dict.fromkeys(absent)}
sig = {n: "constexpr" if n in constexprs else {**types, "DQ": "*fp32"}.get(n, "i32") for n in fn.arg_names}
ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4}).asm["ptx"]
out["dq ld_only"] = [bool(re.search(r"\\b(?:wgmma|mma)\\.", ptx)),
                     len(re.findall(r"\\bst\\.global[.a-z0-9]*\\.[bf]32", ptx))]
print(json.dumps(out))
"""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(built) == 8 and built.pop("dkdv atomic") > 0
    has_products, stores = built.pop("dq ld_only")
    assert not has_products and stores > 0
    for name in ("forward", "dq", "dkdv"):
        assert built[f"{name} True"] != built[f"{name} False"], name


def test_gluon_forward_tile_per_length() -> None:
    """The Gluon forward takes 128-row query tiles where 192 rows would pad more than an eighth of them
    (256 tokens: 384 rows computed), its long tile elsewhere; ``gluon_tiles`` pins one tile per head dim."""
    from cs336_systems.attention import flash_fwd_sm90 as sm90

    assert sm90.tile_for(64, 256) == sm90.SHORT_TILES[64] == (128, 128, 3)
    assert sm90.tile_for(64, 1000) == (128, 128, 3)  # 1,152 rows: 15% padding
    assert sm90.tile_for(64, 2048) == sm90.TILES[64] == (192, 128, 3)  # 2,112 rows: 3%
    assert sm90.tile_for(64, 192) == (192, 128, 3)
    assert sm90.tile_for(128, 256) == sm90.TILES[128]
    assert sm90.tile_for(64, 16384, persistent=True) == sm90.PERSISTENT_TILES[64]  # two consumers: no spills
    assert sm90.tile_for(128, 16384, persistent=True) == sm90.TILES[128]
    with options.use(gluon_tiles={"64": [128, 64, 4]}):
        assert sm90.tile_for(64, 16384) == (128, 64, 4)
        assert sm90.tile_for(64, 16384, persistent=True) == (128, 64, 4)
        assert sm90.tile_for(128, 256) == sm90.TILES[128]
    for bad in ({64: (96, 128, 3)}, {32: (128, 128, 3)}, {64: (128, 128)}, {64: "wide"}, {64: (128, 128, 1)}):
        with pytest.raises(ValueError, match="gluon_tiles"):
            options.FlashOptions(gluon_tiles=bad)


def _error(got: tuple, want: tuple) -> list[float]:
    return [(a.double() - b).abs().max().item() for a, b in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("case", "dtype"), GPU_MATRIX)
def test_triton_gpu_low_precision(case: Case, dtype: torch.dtype) -> None:
    """Error no worse than a few times that of naive attention computed in the same precision.

    The yardstick keeps the tolerance honest across dtypes and sizes: naive attention in the same dtype
    is what the kernel replaces, and both are measured against float64.
    """
    q, k, v, do = _inputs(case, dtype)
    want = _reference(q, k, v, do, case.is_causal)
    got = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)

    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_naive = naive_attention(qn, kn, vn, case.is_causal)
    o_naive.backward(do)
    with torch.no_grad():
        s = qn @ kn.transpose(-2, -1) / case.head_dim**0.5
        if case.is_causal:
            s = s.masked_fill(~causal_mask(case.n_queries, case.n_keys, s.device), float("-inf"))
        lse_naive = torch.logsumexp(s.float(), dim=-1)
    naive = (o_naive.detach(), lse_naive, qn.grad, kn.grad, vn.grad)
    floor = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for name, ours, theirs in zip(NAMES, _error(got, want), _error(naive, want)):
        assert ours <= 3 * theirs + floor, f"{name}: error {ours:.3g} vs naive {theirs:.3g} ({dtype})"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_triton_fp32_precision_follows_torch_setting() -> None:
    """``highest`` (the default) gives float32-level accuracy via 3xTF32; ``high`` switches to plain TF32,
    visibly less accurate."""
    case = Case(128, 128, 64, True, 2)
    q, k, v, do = _inputs(case, torch.float32)
    want = _reference(q, k, v, do, True)
    errors = {}
    previous = torch.get_float32_matmul_precision()
    try:
        for setting in ("highest", "high"):
            torch.set_float32_matmul_precision(setting)
            errors[setting] = max(_error(_run(FlashAttentionTriton.apply, q, k, v, do, True), want))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert errors["highest"] < 1e-4, errors
    assert errors["high"] > 10 * errors["highest"], errors


# --------------------------------------------------------------------------------------------------
# Tile lists and the kernel breakdown
# --------------------------------------------------------------------------------------------------


def test_wide_tile_lists_contain_the_defaults() -> None:
    """The harness's wide lists are where the defaults are chosen from: tuning over them can only match or
    beat the defaults."""
    from cs336_systems.benchmarking.flash.kernels import WIDE_CANDIDATES

    for phase, default in options.DEFAULT_CANDIDATES.items():
        wide = set(WIDE_CANDIDATES[phase])
        assert set(default) <= wide, phase
        for m, n, warps, stages, maxnreg, poly in wide:
            assert m >= 16 and n >= 16 and m & (m - 1) == 0 and n & (n - 1) == 0, (phase, m, n)
            assert warps in (1, 2, 4, 8) and stages >= 1
            # A register cap is a multiple of 8 that Hopper can allocate (24-255 per thread).
            assert maxnreg is None or (24 <= maxnreg <= 255 and maxnreg % 8 == 0), (phase, maxnreg)
            assert poly in (None, True, False)


def test_exponential_is_tuned_with_the_tile_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates may pin ``ex2`` or the polynomial; unset, the pins hold (the tuner chooses among them),
    while an explicit ``poly_exp2`` overrides every pin."""
    from cs336_systems.attention import flash_triton

    kernels = flash_triton.kernel_module()
    Tile = options.Tile
    tiles = (Tile(64, 64, 4, 3, poly=False), Tile(64, 64, 4, 3), Tile(32, 64, 4, 3, poly=True))
    monkeypatch.setattr(kernels.tuning, "INTERPRETED", False)
    pinned = options.FlashOptions(candidates={"dkdv": tiles, "dq": tiles})
    assert [c.kwargs["POLY_EXP2"] for c in kernels.tuning._configs("dkdv", pinned)] == [False, True, True]
    assert [c.kwargs["POLY_EXP2"] for c in kernels.tuning._configs("dq", pinned)] == [False, False, True]
    forced = options.FlashOptions(candidates={"dkdv": tiles, "dq": tiles}, poly_exp2="dkdv")
    assert [c.kwargs["POLY_EXP2"] for c in kernels.tuning._configs("dkdv", forced)] == [True, True, True]
    assert [c.kwargs["POLY_EXP2"] for c in kernels.tuning._configs("dq", forced)] == [False, False, False]


def test_tuned_kernels_are_cached_per_option_set() -> None:
    from cs336_systems.attention import flash_triton

    kernels = flash_triton.kernel_module()
    a, b = options.FlashOptions(), options.FlashOptions(autotune=False)
    assert kernels.tuned("forward", a) is kernels.tuned("forward", options.FlashOptions())
    assert kernels.tuned("forward", a) is not kernels.tuned("forward", b)


@pytest.mark.slow
def test_kernel_breakdown_reports_times_and_kernels() -> None:
    """The lab-bench benchmark times our kernels and lists per-kernel time (tiny shape)."""
    from cs336_systems.benchmarking.flash.kernels import run_kernel_breakdown

    summary, kernels, tuning = run_kernel_breakdown(
        1, 24, 16, "float32", warmup_ms=1, rep_ms=1, profiled_steps=1, compile_ours=False
    )
    assert summary["fwd_bwd_sum_status"] == "ok" and summary["fwd_bwd_sum_ms"] > 0
    assert summary["forward_status"] == "ok" and summary["forward_ms"] > 0
    assert summary["poly_exp2"] == "dkdv+tuned"  # the default (applies to 16-bit inputs only)
    assert not kernels.empty and (kernels["total_ms"] >= 0).all() and (kernels["head_dim"] == 16).all()
    assert list(tuning.columns) == ["head_dim", "kernel", "config", "median_ms", "chosen"]


# --------------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_saves_q_k_v_o_l_and_is_causal(impl_name: str) -> None:
    case = Case(20, 24, 16, True, 2)
    q, k, v, _ = (t.requires_grad_() for t in _inputs(case, torch.float32))
    o = IMPLS[impl_name].apply(q, k, v, True)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5
    for t, expected in zip(saved[:4], (q, k, v, o)):
        assert t.shape == expected.shape and torch.equal(t, expected)
    assert saved[4].shape == (2, 2, 20) and saved[4].dtype == torch.float32
    assert o.grad_fn.is_causal is True


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [32, 80])
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_non_contiguous_inputs(impl_name: str, head_dim: int) -> None:
    """Inputs as the model produces them, (batch, seq, heads, d) transposed to (batch, heads, seq, d),
    and an expanded (stride 0) upstream gradient as ``o.sum().backward()`` produces. At d = 80 the
    tail slab of each head ends where the next head's columns begin: they must read as zeros."""
    case = Case(23, 23, head_dim, True, 2)
    base = [torch.randn(case.batch, n, case.heads, case.head_dim, device=DEVICE) for n in (23, 23, 23)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    do = torch.ones(1, device=DEVICE).expand(case.batch, case.heads, 23, case.head_dim)
    got = _run(IMPLS[impl_name].apply, q, k, v, do, True)
    want = _reference(q, k, v, do, True)
    tol = _fp32_tol(impl_name)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_under_torch_compile(impl_name: str) -> None:
    """``torch.compile(Fn.apply)`` over forward and backward, with no graph break (fullgraph). On CPU the
    aot_eager backend exercises Dynamo and AOTAutograd without paying for Inductor's C++ compile."""
    backend = "inductor" if HAS_CUDA else "aot_eager"
    # Every autograd Function shares the code object of ``Function.apply``, so an earlier compile of
    # another Function at another shape would make Dynamo recompile this one with dynamic shapes.
    torch._dynamo.reset()
    compiled = torch.compile(IMPLS[impl_name].apply, backend=backend, fullgraph=True)
    case = Case(40, 40, 32, True, 2)
    q, k, v, do = _inputs(case, torch.float32)
    got = _run(compiled, q, k, v, do, True, read_lse=False)  # a compiled graph saves what it needs
    want = _reference(q, k, v, do, True)
    tol = _fp32_tol(impl_name)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_under_torch_compile_with_dynamic_shapes() -> None:
    """A compiled call whose shapes are symbolic (``dynamic=True``, or Dynamo's automatic dynamic shapes
    after a second shape, as in the leaderboard's d=64-then-128 run) still compiles in one graph, for a
    kernel head dim and for one that is padded, and matches the reference."""
    backend = "inductor" if HAS_CUDA else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttentionTriton.apply, backend=backend, fullgraph=True, dynamic=True)
    for case in (Case(33, 33, 32, True, 2), Case(24, 24, 24, False, 1)):
        q, k, v, do = _inputs(case, torch.float32)
        got = _run(compiled, q, k, v, do, case.is_causal, read_lse=False)
        want = _reference(q, k, v, do, case.is_causal)
        tol = _fp32_tol("triton")
        for name, a, b in zip(("O", "dQ", "dK", "dV"), got[:1] + got[2:], want[:1] + want[2:]):
            torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol,
                                       msg=lambda m, n=name, d=case.head_dim: f"d={d} {n}: {m}")


def test_eager_calls_skip_the_custom_operators_and_tracers_see_them(monkeypatch) -> None:
    """Eager calls launch the kernels directly (the operators' Python dispatch costs more host time than
    the kernels at short sequences); under a dispatch mode, as when tracing, the operators are what runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cs336_systems.attention import flash_triton

    calls = []
    for name in ("flash_attention_forward", "flash_attention_backward"):
        op = getattr(flash_triton, name)
        monkeypatch.setattr(flash_triton, name, lambda *a, _op=op, _n=name: calls.append(_n) or _op(*a))
    case = Case(24, 24, 16, True, 2)
    q, k, v, do = _inputs(case, torch.float32)
    eager = _run(FlashAttentionTriton.apply, q, k, v, do, True, read_lse=False)
    assert calls == []

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder() as rec:
        traced = _run(FlashAttentionTriton.apply, q, k, v, do, True, read_lse=False)
    assert calls == ["flash_attention_forward", "flash_attention_backward"]
    assert "cs336_systems.flash_attention_forward.default" in rec.ops
    assert "cs336_systems.flash_attention_backward.default" in rec.ops
    for a, b in zip(eager, traced):
        if a is not None:
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_adapters_return_the_library_functions() -> None:
    assert get_flashattention_autograd_function_pytorch() is FlashAttentionPytorch
    assert get_flashattention_autograd_function_triton() is FlashAttentionTriton


@pytest.mark.parametrize("impl_name", ["flash_pytorch", "flash_triton"])
def test_model_uses_registered_flash_attention(impl_name: str) -> None:
    """The tiny LM gives the same logits and gradients with flash attention as with naive attention."""
    assert impl_name in available_attention_impls()
    torch.manual_seed(0)
    model = BasicsTransformerLM(64, 24, 32, 1, 2, 64, attention_impl="naive").to(DEVICE)
    tokens = torch.randint(0, 64, (2, 19), device=DEVICE)
    logits_naive = model(tokens)
    logits_naive.square().mean().backward()
    grads_naive = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_attention_impl(impl_name)
    logits = model(tokens)
    logits.square().mean().backward()
    tol = _fp32_tol(impl_name)
    torch.testing.assert_close(logits, logits_naive, atol=tol, rtol=tol)
    for g, g_naive in zip((p.grad for p in model.parameters()), grads_naive):
        torch.testing.assert_close(g, g_naive, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------


def _t(*shape: int, dtype: torch.dtype = torch.float32, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


BAD_INPUTS = {
    "rank 2": ((_t(8, 16), _t(8, 16), _t(8, 16)), "must be"),
    "rank 5": ((_t(1, 1, 1, 8, 16),) * 3, "must be"),
    "ranks differ": ((_t(2, 8, 16), _t(2, 1, 8, 16), _t(2, 1, 8, 16)), "same rank"),
    "batch differs": ((_t(2, 8, 16), _t(3, 8, 16), _t(3, 8, 16)), "leading"),
    "heads differ": ((_t(2, 2, 8, 16), _t(2, 3, 8, 16), _t(2, 3, 8, 16)), "leading"),
    "k and v lengths differ": ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 9, 16)), "number of keys"),
    "head dims differ": ((_t(2, 8, 16), _t(2, 8, 32), _t(2, 8, 32)), "head dimension"),
    "empty keys": ((_t(2, 8, 16), _t(2, 0, 16), _t(2, 0, 16)), "empty"),
    "dtypes differ": ((_t(2, 8, 16), _t(2, 8, 16, dtype=torch.float16), _t(2, 8, 16)), "dtype"),
    "integer dtype": ((torch.ones(2, 8, 16, dtype=torch.int32, device=DEVICE),) * 3, "dtype"),
}


@pytest.mark.parametrize("impl_name", list(IMPLS))
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_raise_value_error(impl_name: str, bad: str) -> None:
    (q, k, v), match = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=match):
        IMPLS[impl_name].apply(q, k, v, False)


@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_non_bool_is_causal_raises(impl_name: str) -> None:
    q = _t(2, 8, 16)
    with pytest.raises(ValueError, match="is_causal"):
        IMPLS[impl_name].apply(q, q, q, 1)


def test_devices_differ_raises() -> None:
    devices = ["cpu", "meta"]
    q, k = _t(2, 8, 16, device=devices[0]), _t(2, 8, 16, device=devices[1])
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="one device"):
            impl.apply(q, k, k, False)


def test_triton_rejects_head_dims_past_the_largest_kernel() -> None:
    q = _t(2, 8, 160)
    with pytest.raises(ValueError, match=r"head dimension 160 is not supported; supported: 1\.\.128"):
        FlashAttentionTriton.apply(q, q, q, False)
    FlashAttentionPytorch.apply(q, q, q, False)  # the PyTorch version takes any head dim


def test_head_dims_run_in_slabs_and_are_stored_in_16_byte_rows() -> None:
    """80 runs as 64 + 16 (no padded work), 96 as 64 + 32; where a tail would be as wide as the main slab
    one padded slab runs instead. Rows are copied wider only when they are not whole 16-byte units."""
    slabs = {d: head_dim_slabs(d) for d in (1, 8, 16, 24, 40, 48, 64, 72, 80, 96, 100, 112, 128)}
    assert slabs == {1: (16, 0), 8: (16, 0), 16: (16, 0), 24: (32, 0), 40: (32, 16), 48: (32, 16), 64: (64, 0),
                     72: (64, 16), 80: (64, 16), 96: (64, 32), 100: (128, 0), 112: (128, 0),
                     128: (128, 0)}
    for d, (main, tail) in slabs.items():
        assert main + tail >= d and tail < main and all(w == 0 or w >= 16 and w & (w - 1) == 0 for w in (main, tail))
    assert [stored_head_dim(d, 2) for d in (5, 8, 33, 80, 128)] == [8, 8, 40, 80, 128]
    assert [stored_head_dim(d, 4) for d in (5, 33, 80)] == [8, 36, 80]
    with pytest.raises(ValueError, match="head dimension 129 is not supported"):
        stored_head_dim(129, 2)


def _numpy_rejects_triton_interpreter_loops() -> bool:
    """Triton 3.6's interpreter turns a loop bound derived from ``tl.program_id`` (a one-element array there) into
    an ``int`` with ``int(array)``, which NumPy deprecated in 1.25 and rejects from 2.5 on (the GPU image's 2.5.2:
    "only 0-dimensional arrays can be converted to Python scalars"); the locked stack's NumPy only warns. Compiled
    kernels are unaffected, so only this test, which runs the interpreter on a GPU machine too, depends on it."""
    import numpy as np

    return tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 5)


@pytest.mark.slow
@pytest.mark.skipif(_numpy_rejects_triton_interpreter_loops(),
                    reason="Triton 3.6's interpreter needs NumPy < 2.5 (int() of a one-element array)")
def test_importing_the_package_leaves_triton_unimported() -> None:
    """``@triton.jit`` (Triton's own ``tl.cdiv`` included) picks compiled or interpreted when it decorates, so
    importing the package must not import Triton: a process that imports it and only then sets
    ``TRITON_INTERPRET=1`` must still run the kernels on CPU (a host helper once imported the kernels'
    module at package import, and every interpreted kernel then failed on ``tl.cdiv``)."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch\n"
        "import cs336_systems.attention as A\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules), 'triton imported'\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "o = A.FlashAttentionTriton.apply(q, q, q, True)\n"
        "torch.testing.assert_close(o, A.reference_attention(q, q, q, True)[0].float(), atol=1e-4, rtol=1e-4)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_triton_on_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = _t(2, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        FlashAttentionTriton.apply(q, q, q, False)


@pytest.mark.parametrize(
    ("dtype", "expected_stages"),
    [(torch.float32, 1), (torch.bfloat16, 3)],
)
def test_dq_tiles_are_pruned_to_fit_shared_memory(monkeypatch, dtype: torch.dtype, expected_stages: int) -> None:
    """The dQ kernel's K tile is used plain and transposed; at 32 bits that needs two shared-memory copies.

    At float32, head dim 128, a 64x64 tile with 2 stages needed 256 KiB on Hopper (limit 227 KiB): the
    pruner must count the second copy and drop to one stage; 16-bit tiles share one copy and keep 3.
    """
    import triton

    from cs336_systems.attention import flash_triton

    kernels = flash_triton.kernel_module()
    monkeypatch.setattr(kernels.tuning, "_shared_memory_bytes", lambda device_index: 232448)
    prune = kernels.tuning._fit_configs(*kernels.flash_bwd.DQ_SMEM)
    q = torch.empty(1, 1, 64, 128, dtype=dtype)
    configs = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)]
    kept = prune(configs, {"HEAD_DIM": 128, "D_MAIN": 128, "D_TAIL": 0, "Q": q, "SEQ_CLASS": 64})
    assert [c.num_stages for c in kept] == [expected_stages]


def test_pruning_keeps_the_register_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates differing only in ``maxnreg`` or the exponential stay apart and keep them through pruning."""
    import triton

    from cs336_systems.attention import flash_triton

    kernels = flash_triton.kernel_module()
    monkeypatch.setattr(kernels.tuning, "_shared_memory_bytes", lambda device_index: 232448)
    q = torch.empty(1, 1, 64, 64, dtype=torch.bfloat16)
    def config(poly: bool, maxnreg: int | None) -> triton.Config:
        meta = {"BLOCK_M": 32, "BLOCK_N": 64, "POLY_EXP2": poly}
        return triton.Config(meta, num_warps=4, num_stages=3, maxnreg=maxnreg)

    configs = [config(True, None), config(True, 168), config(False, 168)]
    want = [(None, True), (168, True), (168, False)]
    for autotune in (True, False):
        kept = kernels.tuning._fit_configs(*kernels.flash_bwd.DKDV_SMEM, autotune)(configs, {"HEAD_DIM": 64, "D_MAIN": 64, "D_TAIL": 0, "Q": q,
                                                                                  "SEQ_CLASS": 1024})
        assert [(c.maxnreg, c.kwargs["POLY_EXP2"]) for c in kept] == (want if autotune else want[:1])


def test_tma_ready_copies_only_misaligned_tensors() -> None:
    """Streamed tiles (K, V; Q, dO in dK/dV) come through tensor descriptors: 16-byte aligned heads and rows."""
    from cs336_systems.attention import flash_triton

    aligned = torch.randn(2, 3, 20, 16, dtype=torch.bfloat16)
    assert flash_triton._tma_ready(aligned) is aligned
    shifted = torch.randn(2 * 3 * 20 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 3, 20, 16)
    assert shifted.data_ptr() % 16 != 0
    ready = flash_triton._tma_ready(shifted)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, shifted)
    odd_rows = torch.randn(2, 3, 20, 24, dtype=torch.bfloat16)[..., :12]  # 48-byte rows: aligned
    assert flash_triton._tma_ready(odd_rows) is odd_rows
    narrow = torch.randn(2, 3, 20, 20, dtype=torch.bfloat16)[..., :16]  # 40-byte rows: not
    assert all(s * 2 % 16 == 0 for s in flash_triton._tma_ready(narrow).stride()[:-1])


def test_row_buffers_start_rows_on_16_bytes() -> None:
    """L and D rows are read through 1-D tensor descriptors, so each row must start 16-byte aligned."""
    from cs336_systems.attention import flash_triton

    buf = flash_triton._row_buffer((2, 3), 37, torch.device("cpu"))
    assert buf.shape == (2, 3, 37) and buf.dtype == torch.float32
    assert buf.data_ptr() % 16 == 0 and all(s * 4 % 16 == 0 for s in buf.stride()[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("d", [20, 80])  # one padded slab (32 columns, 12 masked); two slabs (64 + 16)
def test_dq_kernel_writes_base2_lse_and_delta_row_pairs(d: int) -> None:
    """The dQ kernel, which runs first, stores ``[L · log2(e); rowsum(dO ∘ O)]`` per head for dK/dV, for a
    length (37) that is neither a tile nor a 16-byte multiple (rows 16-byte aligned, padding untouched)."""
    from cs336_systems.attention import flash_triton

    batch, heads, n = 2, 3, 37
    q, k, v, o, do = (torch.randn(batch, heads, n, d, device=DEVICE) for _ in range(5))
    lse = torch.randn(batch, heads, n, device=DEVICE)
    ld = flash_triton._row_buffer((batch * heads, 2), n, o.device)
    padded = ld._base  # 37 floats pad to 40 per row: a view of the padded buffer
    assert padded is not None and padded.shape[-1] == 40
    padded.fill_(-7.0)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    flash_triton._launch_backward(do, q, k, v, o, lse, ld, *grads, None, True, d**-0.5, None)
    pairs = ld.view(batch, heads, 2, n)
    torch.testing.assert_close(pairs[:, :, 0], lse * 1.4426950408889634)
    torch.testing.assert_close(pairs[:, :, 1], (o * do).sum(-1))
    assert (padded[..., n:] == -7.0).all()  # nothing written past the sequence


def test_dkdv_pruning_drops_tiles_the_descriptors_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer than 32 query rows per tile make L and D boxes under 128 bytes, which faulted on an H100."""
    import triton

    from cs336_systems.attention import flash_triton

    kernels = flash_triton.kernel_module()
    monkeypatch.setattr(kernels.tuning, "_shared_memory_bytes", lambda device_index: 232448)
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": 64}, num_warps=4, num_stages=3) for m in (16, 32, 64)]
    args = {"HEAD_DIM": 64, "D_MAIN": 64, "D_TAIL": 0, "Q": torch.empty(1, 1, 64, 64, dtype=torch.bfloat16),
            "SEQ_CLASS": 1024}
    for autotune in (True, False):
        kept = kernels.tuning._fit_configs(lambda m, n: 2 * n, lambda m, n, t: 2 * t * m, 32, autotune)(configs, args)
        assert [c.kwargs["BLOCK_M"] for c in kept] == ([32, 64] if autotune else [32])


@pytest.mark.parametrize("impl_name", ["triton"])
def test_misaligned_inputs_match_reference(impl_name: str) -> None:
    """Inputs that start off a 16-byte boundary (a view at an odd offset) and a sequence length whose
    L and D rows would be misaligned unpadded (37) still give the reference gradients."""
    case = Case(37, 37, 16, True, 2)
    n = case.batch * case.heads * 37 * case.head_dim
    shape = (case.batch, case.heads, 37, case.head_dim)
    q, k, v = (torch.randn(n + 1, device=DEVICE)[1:].view(shape) for _ in range(3))
    do = torch.randn(case.batch, case.heads, 37, case.head_dim, device=DEVICE)
    got = _run(IMPLS[impl_name].apply, q, k, v, do, True)
    want = _reference(q, k, v, do, True)
    tol = _fp32_tol(impl_name)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------------
# The Gluon forward (Hopper): eligibility and an offline sm_90 compile on any machine, numerics on an H100
# --------------------------------------------------------------------------------------------------

IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def test_gluon_forward_eligibility(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon forward takes contiguous, 16-byte aligned 16-bit inputs at head dims 64 and 128 on
    compute capability 9.0, and says why it declines anything else."""
    from cs336_systems.attention import flash_triton, flash_fwd_sm90

    q, k, v = (torch.randn(2, 3, 40, 64, dtype=torch.bfloat16) for _ in range(3))
    assert "short rows: 40 keys x head dim 64 = 2560" in flash_fwd_sm90.ineligibility(q, k, v, (9, 0))
    monkeypatch.setattr(options, "_current", options.FlashOptions(gluon_min_key_work=0))  # any length from here
    assert flash_fwd_sm90.ineligibility(q, k, v, (9, 0)) is None
    assert "Hopper" in flash_fwd_sm90.ineligibility(q, k, v, (10, 0))
    assert "Hopper" in flash_fwd_sm90.ineligibility(q, k, v, None)
    assert "float16 or bfloat16" in flash_fwd_sm90.ineligibility(q.float(), k.float(), v.float(), (9, 0))
    narrow = [t[..., :32].contiguous() for t in (q, k, v)]
    assert "head dim 32" in flash_fwd_sm90.ineligibility(*narrow, (9, 0))
    assert "k is not contiguous" in flash_fwd_sm90.ineligibility(q, k.transpose(1, 2).contiguous().transpose(1, 2),
                                                                v, (9, 0))  # fmt: skip
    shifted = torch.randn(k.numel() + 1, dtype=torch.bfloat16)[1:].view(k.shape)
    assert "16-byte" in flash_fwd_sm90.ineligibility(q, k, shifted, (9, 0))
    with options.use(gluon=False):
        assert "disabled" in flash_fwd_sm90.ineligibility(q, k, v, (9, 0))
    if not IS_HOPPER:  # CPU tensors and other GPUs run the Triton forward
        assert flash_triton.forward_kernel_name(q, k, v) == "triton"


def test_short_rows_run_the_triton_forward() -> None:
    """Rows of fewer than ``gluon_min_key_work`` keys x head dim (halved when causal) go to the Triton
    forward; the threshold is an option, checked in one line."""
    from cs336_systems.attention import flash_fwd_sm90

    def inputs(n: int, d: int) -> list[torch.Tensor]:
        return [torch.randn(1, 2, n, d, dtype=torch.bfloat16) for _ in range(3)]

    assert options.current().gluon_min_key_work == 96 * 1024
    assert flash_fwd_sm90.ineligibility(*inputs(1024, 128), (9, 0)) is None  # 128 Ki
    assert "short rows" in flash_fwd_sm90.ineligibility(*inputs(1024, 128), (9, 0), True)  # 64 Ki when causal
    assert flash_fwd_sm90.ineligibility(*inputs(2048, 128), (9, 0), True) is None
    assert "short rows: 1000 keys x head dim 64 = 64000" in flash_fwd_sm90.ineligibility(*inputs(1000, 64), (9, 0))
    with options.use(gluon_min_key_work=64000):
        assert flash_fwd_sm90.ineligibility(*inputs(1000, 64), (9, 0)) is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gluon_min_key_work must be a non-negative integer"):
            options.FlashOptions(gluon_min_key_work=bad)


def test_gluon_forward_reads_head_views_when_asked() -> None:
    """With ``gluon_head_views`` the Gluon forward also takes the (batch, heads, seq, d) views of
    (batch, seq, heads, d) tensors that a Transformer block passes (and slices of a fused QKV projection),
    reading each head's rows from a 2-D (batch·seq, heads·d) view at column h·d; other strides still go
    to the Triton forward."""
    from cs336_systems.attention import flash_fwd_sm90 as sm90

    b, h, n, d = 2, 3, 40, 64
    contiguous = torch.randn(b, h, n, d, dtype=torch.bfloat16)
    assert sm90.placement(contiguous, True) == sm90._Placement((b * h * n, d), d, h * n, n, 0)
    views = [torch.randn(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    assert sm90.placement(views[0], True) == sm90._Placement((b * n, h * d), h * d, n, 0, d)
    assert sm90.placement(views[0], False) is None
    qkv = torch.randn(b, n, 3, h, d, dtype=torch.bfloat16)
    q_slice = qkv[:, :, 0].transpose(1, 2)  # tokens 3·h·d apart
    assert sm90.placement(q_slice, True) == sm90._Placement((b * n, h * d), 3 * h * d, n, 0, d)
    assert sm90.placement(torch.randn(b, h, d, n, dtype=torch.bfloat16).transpose(2, 3), True) is None

    with options.use(gluon_min_key_work=0):  # 40 keys: the Triton forward's length otherwise
        assert "q is not contiguous" in sm90.ineligibility(*views, (9, 0))  # off by default
    with options.use(gluon_head_views=True, gluon_min_key_work=0):
        assert sm90.ineligibility(*views, (9, 0)) is None
        assert sm90.ineligibility(contiguous, *views[1:], (9, 0)) is None  # q and k, v may differ
        assert "laid out differently" in sm90.ineligibility(views[0], contiguous, views[2], (9, 0))
        odd = torch.randn(b, h, d, n, dtype=torch.bfloat16).transpose(2, 3)
        assert "neither contiguous nor" in sm90.ineligibility(odd, *views[1:], (9, 0))
    with pytest.raises(ValueError, match="gluon_head_views must be True or False"):
        options.FlashOptions(gluon_head_views="yes")


def _compile_offline_in_subprocess(call: str) -> dict:
    """Run ``call`` (a ``compile_for_hopper`` of :mod:`cs336_systems.attention`'s Gluon modules) in a process
    without ``TRITON_INTERPRET`` and return its PTX, shared-memory bytes and, where this Triton ships ptxas, the
    bytes of register spills ptxas reports for it (``spill_bytes``; None without ptxas). Spills land in the stack
    frame, so cuobjdump's ``LOCAL`` column does not show them."""
    import json
    import subprocess
    import sys

    script = f"""
import glob, json, os, re, subprocess, tempfile, triton
from cs336_systems.attention import flash_bwd_sm90, flash_fwd_sm90
compiled = {call}
spills = None
tools = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))
if tools:
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as ptx:
        ptx.write(compiled.asm["ptx"]); ptx.flush()
        report = subprocess.run([tools[0], "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True).stderr
    spills = sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", report))
print(json.dumps({{"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared, "spill_bytes": spills}}))
"""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "tile"), [(64, None), (128, None), (64, (128, 128, 3))], ids=str)
def test_gluon_forward_compiles_for_hopper(head_dim: int, tile: tuple[int, int, int] | None) -> None:
    """The warp-specialized kernel builds for sm_90 with this Triton: partitions with rebalanced registers,
    asynchronous wgmma products, TMA copies, its buffers inside the 227 KiB of shared memory, and no
    register spills (where this Triton ships ptxas)."""
    result = _compile_offline_in_subprocess(f"flash_fwd_sm90.compile_for_hopper({head_dim}, True, {tile})")
    assert all(op in result["ptx"] for op in ("setmaxnreg", "wgmma.mma_async", "cp.async.bulk.tensor"))
    assert result["shared"] <= 227 * 1024
    assert result["spill_bytes"] in (None, 0), result["spill_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "causal", "q_buffers", "spill_bytes"),
                         [(64, True, 1, 0), (128, False, 1, 40), (128, True, 2, 24)], ids=str)
def test_gluon_persistent_forward_compiles_for_hopper(head_dim: int, causal: bool, q_buffers: int,
                                                      spill_bytes: int) -> None:
    """The persistent form (``options.gluon_persistent``) builds for sm_90 like the one-item form: warp roles,
    asynchronous products, TMA copies, its buffers plus the ``q_empty`` barriers inside shared memory, with one Q
    buffer or two (``gluon_q_buffers``, then two K/V stages at d = 128). Spills: none at d=64 (two consumers,
    ``PERSISTENT_TILES``); at d=128 at most the 24-40 bytes the item loop's state costs
    (docs/flash_attention/persistent.md), so that more would show."""
    from cs336_systems.attention import flash_fwd_sm90

    result = _compile_offline_in_subprocess(
        f"flash_fwd_sm90.compile_for_hopper({head_dim}, {causal}, None, persistent=True, q_buffers={q_buffers})")
    assert all(op in result["ptx"] for op in ("setmaxnreg", "wgmma.mma_async", "cp.async.bulk.tensor"))
    tile = flash_fwd_sm90.tile_for(head_dim, 4096, persistent=True, q_buffers=q_buffers)
    assert flash_fwd_sm90.shared_bytes(head_dim, tile, q_buffers) < result["shared"] <= 227 * 1024
    assert result["spill_bytes"] is None or result["spill_bytes"] <= spill_bytes, result["spill_bytes"]


def test_gluon_persistent_forward_takes_the_short_rows() -> None:
    """The persistent grid exists for short rows, so with it on everywhere (``True``) ``gluon_min_key_work`` no
    longer sends them to the Triton forward; everything else about eligibility stays. By default (``None``) it runs
    at head dim 128 only, and only the rows the Gluon forward takes anyway."""
    from cs336_systems.attention import flash_fwd_sm90

    q, k, v = (torch.randn(8, 4, 256, 64, dtype=torch.bfloat16) for _ in range(3))
    assert "short rows" in flash_fwd_sm90.ineligibility(q, k, v, (9, 0), True)
    with options.use(gluon_persistent=True):
        assert flash_fwd_sm90.ineligibility(q, k, v, (9, 0), True) is None
        assert "Hopper" in flash_fwd_sm90.ineligibility(q, k, v, (8, 0), True)
        assert options.current().persistent_forward(64) and options.current().persistent_forward(128)
    assert options.current().gluon_persistent is None
    assert options.current().persistent_forward(128) and not options.current().persistent_forward(64)
    short_128 = [torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3)]
    assert "short rows" in flash_fwd_sm90.ineligibility(*short_128, (9, 0), True)  # the default keeps them on Triton
    with options.use(gluon_persistent=False):
        assert not options.current().persistent_forward(128)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match=r"gluon_persistent must be True, False or None \(at the head dims"):
            options.FlashOptions(gluon_persistent=bad)


#: The Gluon kernels' GPU cases: both head dims, causal and full, ragged lengths, 3-D inputs.
GLUON_CASES = [Case(1000, 1000, 64, True, 3), Case(700, 1000, 64, False, 2), Case(77, 77, 64, True, 1),
               Case(1030, 1030, 128, False, 2), Case(2048, 2048, 128, True, 2), Case(300, 300, 64, True, None)]


def _gluon_inputs(case: Case, dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, ...]:
    """``_inputs``, as contiguous tensors (``bhsd``) or head views of ``(batch, seq, heads, d)`` ones (``bshd``)."""
    q, k, v, do = _inputs(case, dtype)
    if layout == "bshd":
        if case.heads is None:
            pytest.skip("3-D inputs have no heads to lay out")
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    return q, k, v, do


def _assert_gluon_matches(names, gluon, triton_, want, dtype: torch.dtype) -> None:
    """A Gluon kernel's outputs match the Triton kernel's (same arithmetic: a few 16-bit roundings) and are
    no further from float64 than the Triton kernel's, up to a quarter of the tolerance."""
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for name, a, b, ref in zip(names, gluon, triton_, want):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
        err_gluon, err_triton = (a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item()
        assert err_gluon <= 1.5 * err_triton + tol / 4, f"{name}: {err_gluon:.3g} vs Triton {err_triton:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", GLUON_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gluon_forward_matches_triton_forward(case: Case, dtype: torch.dtype, layout: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where it applies the Gluon forward runs, and its O and L match the Triton forward's (same
    arithmetic, so to a few bf16/fp16 roundings), and both match float64. ``bshd``: the inputs are head
    views of (batch, seq, heads, d) tensors, read with ``gluon_head_views``."""
    from cs336_systems.attention import flash_triton

    q, k, v, do = _gluon_inputs(case, dtype, layout)
    with options.use(gluon_head_views=layout == "bshd", gluon_min_key_work=0):  # short cases too
        grid = "gluon_persistent" if options.current().persistent_forward(case.head_dim) else "gluon"
        assert flash_triton.forward_kernel_name(q, k, v, case.is_causal) == grid
        gluon = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    with options.use(gluon=False):
        assert flash_triton.forward_kernel_name(q, k, v) == "triton"
        triton_ = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    _assert_gluon_matches(NAMES, gluon, triton_, _reference(q, k, v, do, case.is_causal), dtype)


#: Persistent-grid cases: more (query tile, head) items than SMs at short rows (each program takes several, the
#: ring carried from one to the next), ragged lengths, both head dims, causal and full.
PERSISTENT_CASES = [Case(256, 256, 64, True, 64), Case(1000, 1000, 64, False, 16), Case(300, 300, 128, True, 48),
                    Case(2048, 2048, 128, True, 8), Case(77, 77, 64, True, None)]


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("q_buffers", [1, 2], ids=["one_q", "two_q"])
def test_gluon_persistent_forward_gives_the_one_item_forwards_numbers(case: Case, dtype: torch.dtype,
                                                                      q_buffers: int) -> None:
    """A persistent program runs each item's arithmetic as a one-item program does, in the same order, so O and L
    (and the gradients, from the shared backward) are bit-identical; only the schedule differs, and with two Q
    buffers (``gluon_q_buffers``) which buffer each item's Q lands in and how deep the K/V ring is. The backward is the
    Triton one on both sides: the fused Gluon backward adds dQ's tiles in whatever order they finish, so its dQ is
    not bit-reproducible from one call to the next."""
    from cs336_systems.attention import flash_triton

    q, k, v, do = _gluon_inputs(case, dtype, "bhsd")
    with options.use(gluon_min_key_work=0, gluon_persistent=False, gluon_backward=False):
        assert flash_triton.forward_kernel_name(q, k, v, case.is_causal) == "gluon"
        one_item = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    with options.use(gluon_persistent=True, gluon_backward=False, gluon_q_buffers=q_buffers):
        assert flash_triton.forward_kernel_name(q, k, v, case.is_causal) == "gluon_persistent"
        persistent = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    for name, a, b in zip(NAMES, persistent, one_item, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


#: Persistent dK/dV cases: more (key tile, head) items than SMs, causal items of unequal length, ragged lengths, more
#: keys than queries (causal key tiles past the last query stream none), both head dims.
PERSISTENT_BACKWARD_CASES = [Case(2048, 2048, 128, True, 48), Case(1030, 1030, 128, False, 8),
                             Case(1000, 1000, 64, True, 40), Case(300, 700, 128, True, 16),
                             Case(77, 77, 64, True, None)]


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", PERSISTENT_BACKWARD_CASES, ids=str)
@pytest.mark.parametrize("fused_dq", [False, True], ids=["dq_kernel", "dq_atomic"])
def test_gluon_persistent_backward_gives_the_one_item_backwards_numbers(case: Case, fused_dq: bool) -> None:
    """A persistent dK/dV program runs each item's arithmetic as a one-item program does, so dK and dV are
    bit-identical, and so is dQ from the Triton dQ kernel; the fused dQ's float32 sums are added in whatever order
    the tiles finish, in both, so that dQ matches to its rounding."""
    from cs336_systems.attention import flash_triton

    q, k, v, do = _gluon_inputs(case, torch.bfloat16, "bhsd")
    runs = {}
    for persistent in (False, True):
        with options.use(gluon_backward_min_keys=0, dq_atomic=fused_dq, gluon_persistent_backward=persistent):
            assert flash_triton.backward_kernel_name(q, k, v) == ("gluon_persistent" if persistent else "gluon")
            runs[persistent] = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    for name, a, b in zip(NAMES, runs[True], runs[False], strict=True):
        if name == "dQ" and fused_dq:
            torch.testing.assert_close(a, b, msg=lambda m: f"dQ: {m}")  # bf16's tolerances: its last bit
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------------
# The Gluon dK/dV backward (Hopper): eligibility and an offline sm_90 compile anywhere, numerics on a Hopper GPU
# --------------------------------------------------------------------------------------------------


def test_persistent_kernels_launch_the_planned_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under their options the hosts launch the persistent Gluon kernels (the dK/dV kernel with
    ``gluon_persistent_backward``, the forward with ``gluon_persistent``) on at most one program per SM (one nominal
    SM on CPU), with the planned item table after the one-item kernel's arguments; otherwise the one-item kernels on
    one program per item. Checked on the launches' arguments, the launch itself stubbed (no Hopper here)."""
    from cs336_systems.attention import flash_bwd_sm90 as bwd
    from cs336_systems.attention import flash_fwd_sm90 as fwd
    from cs336_systems.attention.flash_triton import _row_buffer
    from cs336_systems.attention.launch_cache import FLASH_LAUNCHES

    launches = []
    monkeypatch.setattr(FLASH_LAUNCHES, "launch", lambda fn, grid, args, constexprs: launches.append((fn, grid, args)))
    q, k, v, do = (torch.randn(2, 3, 300, 128, dtype=torch.bfloat16) for _ in range(4))
    dk, dv, ld = torch.empty_like(k), torch.empty_like(v), _row_buffer((6, 2), 300, q.device)
    out = (torch.empty_like(q), torch.empty(2, 3, 300))
    with options.use(gluon_persistent=False):
        fwd.flash_forward(q, k, v, True, out=out)
    bwd.flash_backward_dkdv(q, k, v, do, ld, dk, dv, True, 0.1)
    with options.use(gluon_persistent=True, gluon_persistent_backward=True):
        fwd.flash_forward(q, k, v, True, out=out)
        bwd.flash_backward_dkdv(q, k, v, do, ld, dk, dv, True, 0.1)
    one_items, persistents = launches[:2], launches[2:]
    kernels = [(fwd.flash_forward_gluon_kernel, fwd.flash_forward_gluon_persistent_kernel, 3 * 6),
               (bwd.flash_backward_dkdv_gluon_kernel, bwd.flash_backward_dkdv_gluon_persistent_kernel, 3 * 6)]
    for (one_fn, one_grid, one_args), (fn, grid, args), (one_kernel, kernel, items) in zip(one_items, persistents,
                                                                                           kernels, strict=True):
        assert one_fn is one_kernel and one_grid == (items,)
        assert fn is kernel and grid == (1,) and args[:-3] == one_args
        n_bh, table, row = args[-3:]
        assert n_bh == 6 and row == table.shape[1] and table[0, 0] == items
        assert sorted(table[0, 1:].tolist()) == list(range(items))  # one program takes every item
    with pytest.raises(ValueError, match="gluon_persistent_backward must be True or False"):
        options.FlashOptions(gluon_persistent_backward=1)


def test_gluon_forward_second_q_buffer_gives_up_a_stage_where_shared_memory_is_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``gluon_q_buffers=2`` reaches the persistent forward's launch as ``Q_BUFFERS``, with as many K/V stages as
    fit beside the second buffer (at d = 128 two, at d = 64 all three); the one-item forward never refills Q, so it
    keeps one buffer. A pinned tile that does not fit, or another buffer count, is a one-line error."""
    from cs336_systems.attention import flash_fwd_sm90 as fwd
    from cs336_systems.attention.launch_cache import FLASH_LAUNCHES

    launches = []
    monkeypatch.setattr(FLASH_LAUNCHES, "launch", lambda fn, grid, args, constexprs: launches.append(constexprs))
    for d in (64, 128):
        q, k, v = (torch.randn(2, 3, 300, d, dtype=torch.bfloat16) for _ in range(3))
        out = (torch.empty_like(q), torch.empty(2, 3, 300))
        for persistent in (True, False):
            with options.use(gluon_persistent=persistent, gluon_q_buffers=2):
                fwd.flash_forward(q, k, v, True, out=out)
    (d64, d64_one), (d128, d128_one) = launches[:2], launches[2:]
    assert (d64["STAGES"], d64["Q_BUFFERS"]) == (fwd.PERSISTENT_TILES[64][2], 2)
    assert (d128["STAGES"], d128["Q_BUFFERS"]) == (2, 2) and fwd.TILES[128][2] == 3
    assert "Q_BUFFERS" not in d64_one and d128_one["STAGES"] == 3
    for d, tile in ((64, d64), (128, d128)):
        assert fwd.shared_bytes(d, (tile["BLOCK_M"], tile["BLOCK_N"], tile["STAGES"]), 2) < fwd.SHARED_MEMORY
    assert fwd.tile_for(128, 4096, persistent=True) == fwd.TILES[128]  # one buffer: the three stages stay
    with options.use(gluon_tiles={"128": [128, 128, 3]}), pytest.raises(ValueError, match="gluon_tiles: .* over"):
        fwd.tile_for(128, 4096, persistent=True, q_buffers=2)
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="gluon_q_buffers must be 1 or 2"):
            options.FlashOptions(gluon_q_buffers=bad)


def test_gluon_backward_eligibility() -> None:
    """The Gluon backward takes rows of at least ``gluon_backward_min_keys`` keys per head dim (where it measured
    faster) and what the Gluon forward takes (16-bit, head dims 64 and 128, contiguous or head views, 16-byte
    aligned) plus a placeable dO and unit-stride dK/dV, and says why it declines anything else; its tiles and
    thresholds are options checked in one line."""
    from cs336_systems.attention import flash_bwd_sm90 as sm90

    q, k, v, do = (torch.randn(2, 3, 40, 64, dtype=torch.bfloat16) for _ in range(4))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    assert "fewer than gluon_backward_min_keys = 16384 at head dim 64" in sm90.ineligibility(q, k, v, do, dk, dv,
                                                                                            (9, 0))  # fmt: skip
    with options.use(gluon_backward_min_keys={64: 40, "128": 4096}):
        assert sm90.ineligibility(q, k, v, do, dk, dv, (9, 0)) is None
        assert options.current().backward_min_keys(128) == 4096
    with options.use(gluon_backward_min_keys={64: 41}):
        assert "rows of 40 keys" in sm90.ineligibility(q, k, v, do, dk, dv, (9, 0))
    with options.use(gluon_backward=False, gluon_backward_min_keys=0):
        assert "disabled" in sm90.ineligibility(q, k, v, do, dk, dv, (9, 0))
    for bad in (-1, {32: 100}, {64: "many"}, {64: True}, "2048"):
        with pytest.raises(ValueError, match="gluon_backward_min_keys maps head dim 64 or 128"):
            options.FlashOptions(gluon_backward_min_keys=bad)
    with options.use(gluon_backward_min_keys=0):
        assert sm90.ineligibility(q, k, v, do, dk, dv, (9, 0)) is None
        assert "Hopper" in sm90.ineligibility(q, k, v, do, dk, dv, (8, 0))
        assert "float16 or bfloat16" in sm90.ineligibility(*(t.float() for t in (q, k, v, do)), dk, dv, (9, 0))
        narrow = [t[..., :32].contiguous() for t in (q, k, v, do)]
        assert "head dim 32" in sm90.ineligibility(*narrow, dk, dv, (9, 0))
        assert "do is not contiguous" in sm90.ineligibility(q, k, v, do.transpose(2, 3).contiguous().transpose(2, 3),
                                                              dk, dv, (9, 0))  # fmt: skip
        shifted = torch.randn(v.numel() + 1, dtype=torch.bfloat16)[1:].view(v.shape)
        assert "16-byte" in sm90.ineligibility(q, k, shifted, do, dk, dv, (9, 0))
        assert "unit stride" in sm90.ineligibility(q, k, v, do, dk.transpose(2, 3).contiguous().transpose(2, 3),
                                                    dv, (9, 0))  # fmt: skip
    with options.use(gluon_backward_min_keys=0, gluon_head_views=True):
        views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do)]
        assert sm90.ineligibility(*views, dk, dv, (9, 0)) is None
        assert "laid out differently" in sm90.ineligibility(views[0], k, views[2], views[3], dk, dv, (9, 0))
    with options.use(gluon_backward_tiles={64: (128, 128, 3)}):
        assert sm90.tile_for(64) == (128, 128, 3) and sm90.tile_for(128) == sm90.TILES[128]
    with pytest.raises(ValueError, match="gluon_backward_tiles: head dim 64 or 128 to"):
        options.FlashOptions(gluon_backward_tiles={64: (64, 192, 2)})  # 192 keys: three consumers, removed
    with pytest.raises(ValueError, match="gluon_backward must be True or False"):
        options.FlashOptions(gluon_backward=1)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_backward_with_dq_compiles_to_tma_reductions(head_dim: int) -> None:
    """With ``dq_atomic`` the Gluon kernel adds dQ's tiles by TMA bulk reductions, not per-element atomics, and
    its dSᵀ buffers and staging tiles still fit the H100's and H200's shared memory. ``L`` and ``D`` come through the
    TMA ring, and its spills stay small: at head dim 128 they stalled it while those rows came by global loads
    (docs/flash_attention/gluon_backward.md)."""
    call = f"flash_bwd_sm90.compile_for_hopper({head_dim}, True, None, False, True)"
    result = _compile_offline_in_subprocess(call)
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in result["ptx"]
    assert "atom.global" not in result["ptx"] and "red.global" not in result["ptx"]
    assert "ld.global" not in result["ptx"]  # L and D arrive with Q and dO, through the TMA ring
    assert result["shared"] <= 227 * 1024
    assert result["spill_bytes"] is None or result["spill_bytes"] <= 128, result["spill_bytes"]


def test_gluon_backward_dq_sums_cover_whole_query_tiles() -> None:
    """The float32 dQ sums the Gluon kernel reduces into are padded per head to whole query tiles (a tile's
    reduction must not reach the next head's rows); each consumer reduces at most 64 columns."""
    from cs336_systems.attention import flash_bwd_sm90 as sm90

    block_m = sm90.TILES[64][0]
    assert sm90.dq_rows(1, 64) == block_m and sm90.dq_rows(block_m, 64) == block_m
    assert sm90.dq_rows(block_m + 1, 128) == 2 * sm90.TILES[128][0]
    assert sm90._dq_cols(64) == 64 and sm90._dq_cols(128) == 64


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "poly"), [(64, True), (64, False), (128, True)], ids=str)
def test_gluon_backward_compiles_for_hopper(head_dim: int, poly: bool) -> None:
    """The warp-specialized dK/dV kernel builds for sm_90 with this Triton: rebalanced registers,
    asynchronous wgmma products, TMA copies, shared memory inside 227 KiB; the polynomial exponential
    replaces every ``ex2`` when asked for; ``L`` and ``D`` come through the TMA ring, not by global loads; at head
    dim 64 no register spills and at 128 a few (where ptxas ships; docs/flash_attention/gluon_backward.md)."""
    result = _compile_offline_in_subprocess(f"flash_bwd_sm90.compile_for_hopper({head_dim}, True, None, {poly})")
    assert all(op in result["ptx"] for op in ("setmaxnreg", "wgmma.mma_async", "cp.async.bulk.tensor"))
    assert ("ex2.approx" in result["ptx"]) != poly
    assert "ld.global" not in result["ptx"]  # L and D arrive with Q and dO, through the TMA ring
    assert result["shared"] <= 227 * 1024
    if head_dim == 64:
        assert result["spill_bytes"] in (None, 0), result["spill_bytes"]
    else:
        assert result["spill_bytes"] is None or result["spill_bytes"] <= 128, result["spill_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "causal", "dq_acc", "spill_bytes"),
                         [(64, True, True, 0), (128, True, True, 356), (128, False, False, 212)], ids=str)
def test_gluon_persistent_backward_compiles_for_hopper(head_dim: int, causal: bool, dq_acc: bool,
                                                       spill_bytes: int) -> None:
    """The persistent dK/dV kernel (``options.gluon_persistent_backward``) builds for sm_90 like the one-item
    kernel: warp roles, asynchronous products, TMA copies (and with the fused dQ its TMA reductions), its buffers
    plus the ``kv_empty`` barrier inside shared memory. Spills: none at d = 64; at d = 128 at most what this build
    spills, the item loop's state on top of the one-item kernel's (docs/flash_attention/persistent.md), so that more
    would show."""
    result = _compile_offline_in_subprocess(
        f"flash_bwd_sm90.compile_for_hopper({head_dim}, {causal}, dq_acc={dq_acc}, persistent=True)")
    ops = ("setmaxnreg", "wgmma.mma_async", "cp.async.bulk.tensor", *(("cp.reduce.async.bulk",) if dq_acc else ()))
    assert all(op in result["ptx"] for op in ops)
    assert result["shared"] <= 227 * 1024
    assert result["spill_bytes"] is None or result["spill_bytes"] <= spill_bytes, result["spill_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("case", GLUON_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("fused_dq", [False, True], ids=["dq_kernel", "dq_atomic"])
def test_gluon_backward_matches_triton_backward(case: Case, dtype: torch.dtype, layout: str,
                                               fused_dq: bool) -> None:
    """Where it applies the Gluon dK/dV kernel runs, and dK and dV match the Triton kernel's and float64. dQ is
    the Triton dQ kernel's, or with ``dq_atomic`` the Gluon kernel's own sums (FlashAttention-3's fifth
    product), which must match the dQ kernel's and float64 too."""
    from cs336_systems.attention import flash_triton

    q, k, v, do = _gluon_inputs(case, dtype, layout)
    four_d = [t if t.dim() == 4 else t.unsqueeze(1) for t in (q, k, v, do)]
    with options.use(gluon_backward_min_keys=0, gluon_head_views=layout == "bshd", dq_atomic=fused_dq):
        assert flash_triton._gluon_backward_module(*four_d, four_d[1], four_d[2]) is not None
        gluon = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    with options.use(gluon_backward=False):
        triton_ = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
    first = 2 if fused_dq else 3
    _assert_gluon_matches(NAMES[first:], gluon[first:], triton_[first:],
                          _reference(q, k, v, do, case.is_causal)[first:], dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
def test_default_backward_fuses_dq_into_the_gluon_kernel_at_long_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the backward is routed by row length: at head dim 128 from 1,000 keys the Gluon kernel runs and
    forms dQ itself (float32 sums handed to it), below that the Triton kernels run; the routed gradients match the
    Triton backward's and float64."""
    from cs336_systems.attention import flash_bwd_sm90, flash_triton, launch_plan

    calls = []
    real = flash_bwd_sm90.flash_backward_dkdv
    monkeypatch.setattr(flash_bwd_sm90, "flash_backward_dkdv",
                        lambda *a, **kw: calls.append(a[-1] if len(a) > 9 else kw.get("dq_acc")) or real(*a, **kw))
    keys = dict(options.DEFAULT_GLUON_BACKWARD_MIN_KEYS)[128]
    short, long_ = Case(keys - 1, keys - 1, 128, True, 2), Case(keys, keys, 128, True, 2)
    for case, kernel in ((short, "triton"), (long_, "gluon")):
        q, k, v, do = _gluon_inputs(case, torch.bfloat16, "bhsd")
        assert flash_triton.backward_kernel_name(q, k, v) == kernel
        with launch_plan.disabled():  # the full path, where the kernel is chosen, on every call
            routed = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
        assert len(calls) == (kernel == "gluon") and (not calls or calls[0] is not None)  # dQ sums given
        with options.use(gluon_backward=False):
            triton_ = _run(FlashAttentionTriton.apply, q, k, v, do, case.is_causal)
        _assert_gluon_matches(NAMES[2:], routed[2:], triton_[2:], _reference(q, k, v, do, case.is_causal)[2:],
                              torch.bfloat16)


def test_descriptors_filled_in_directly_equal_triton_s_validated_ones() -> None:
    """``_descriptor`` skips ``TensorDescriptor``'s checks (host time on every call) by filling in its fields;
    the result must be the very descriptor the constructor builds, and a Triton whose descriptor has other
    fields gets the constructor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from cs336_systems.attention import flash_triton

    t = torch.randn(2, 3, 40, 64)[:, :, :32]  # a strided view, as the kernels receive head views
    box = [1, 1, 16, 64]
    direct = flash_triton._descriptor(t, box)
    built = TensorDescriptor(t, list(t.shape), list(t.stride()), box)
    assert type(direct) is TensorDescriptor and direct == built and direct.base is t
    flash_triton._descriptor_class.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(flash_triton.dataclasses, "fields", lambda cls: ())  # "another Triton"
            with pytest.raises(ValueError, match="power of 2"):  # the constructor's own checks run again
                flash_triton._descriptor(t, [1, 1, 12, 64])
    finally:
        flash_triton._descriptor_class.cache_clear()
    assert flash_triton._descriptor_class()[1]
