"""LaunchCache: the first launch per signature goes through Triton, repeats replay its compiled kernel.

On CPU the mechanism runs against stand-ins for Triton's objects (a JIT function, an autotuner's chosen
config, a compiled kernel that records its launches) and meta tensors; on a GPU the attention kernels run
through it and must give exactly what Triton's own launch path gives.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import launch_cache, launch_plan
from cs336_systems.attention.launch_cache import LaunchCache


class RecordingKernel:
    """A compiled kernel's launch surface; records ``run``'s arguments."""

    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def launch_metadata(self, grid, stream, *args):  # noqa: ANN001, ANN002
        return None

    def run(self, *args) -> None:  # noqa: ANN002
        self.launches.append(args)


class Config:
    def __init__(self, kwargs: dict, pre_hook=None) -> None:  # noqa: ANN001
        self.kwargs, self.pre_hook = kwargs, pre_hook

    def all_kwargs(self) -> dict:
        return {**self.kwargs, "num_warps": 4, "num_stages": 3}


class FakeJit:
    """``fn[grid](*args, **kw)`` as Triton spells it; ``best_config`` makes it look like an autotuner."""

    arg_names = ["X", "n", "stride", "scale", "HEAD_DIM", "BLOCK_M"]

    def __init__(self, config: Config | None = None, compiled: bool = True) -> None:
        self.best_config = config
        self.kernel = RecordingKernel() if compiled else None
        self.slow_calls: list[tuple] = []

    def __getitem__(self, grid):  # noqa: ANN001
        def call(*args, **kwargs):  # noqa: ANN002, ANN003
            self.slow_calls.append((grid, args, kwargs))
            return self.kernel

        return call


class MetaLaunchCache(LaunchCache):
    device_type = "meta"

    @staticmethod
    def _stream(device: torch.device) -> int:
        return 7


def _args(n: int = 128, stride: int = 64, dtype: torch.dtype = torch.float16) -> tuple:
    return (torch.empty(n, stride, device="meta", dtype=dtype), n, stride, 0.125)


def _grid(meta: dict) -> tuple[int]:
    return (-(-meta["n"] // meta["BLOCK_M"]),)


def test_repeat_launch_replays_the_compiled_kernel_with_the_autotuned_config() -> None:
    fn = FakeJit(Config({"BLOCK_M": 32}))
    cache = MetaLaunchCache()
    args = _args()
    cache.launch(fn, _grid, args, {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 1 and fn.kernel.launches == []
    cache.launch(fn, _grid, args, {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    (launch,) = fn.kernel.launches
    # grid (128 / 32 = 4, padded to 3-D), stream, handle, metadata, hooks, then every parameter in order
    assert launch[:4] == (4, 1, 1, 7)
    assert launch[4:7] == ("fn-handle", "packed", None)
    assert launch[9:] == (*args, 64, 32)


def test_anything_triton_specializes_on_is_part_of_the_signature() -> None:
    fn = FakeJit(Config({"BLOCK_M": 32}))
    cache = MetaLaunchCache()
    cache.launch(fn, _grid, _args(), {"HEAD_DIM": 64})
    for args, constexprs in [(_args(n=256), {"HEAD_DIM": 64}),       # a size (and the grid)
                             (_args(stride=65), {"HEAD_DIM": 64}),   # a stride (divisibility by 16)
                             (_args(dtype=torch.bfloat16), {"HEAD_DIM": 64}),  # a dtype
                             (_args(), {"HEAD_DIM": 128})]:          # a constexpr
        cache.launch(fn, _grid, args, constexprs)
    assert len(fn.slow_calls) == 5 and fn.kernel.launches == [] and len(cache) == 5
    cache.launch(fn, _grid, _args(n=256), {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 5 and len(fn.kernel.launches) == 1
    assert fn.kernel.launches[0][:3] == (8, 1, 1)


def test_the_grid_is_the_callers_on_every_launch() -> None:
    """A grid may depend on sizes no argument carries (the attention kernels fold the batch into the grid
    only): a repeat launch with equal arguments but another batch runs the caller's grid, not the first
    call's, whether the grid is a tuple or a function of the config. The cache keeps no tensor alive."""
    fn = FakeJit(Config({"BLOCK_M": 32}))
    cache = MetaLaunchCache()
    args = _args()
    for batch in (16, 16, 1, 4):
        cache.launch(fn, lambda meta, b=batch: (-(-meta["n"] // meta["BLOCK_M"]) * b,), args, {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 1 and [g[:3] for g in fn.kernel.launches] == [(64, 1, 1), (4, 1, 1), (16, 1, 1)]
    plain = FakeJit(config=None)
    for grid in ((3, 2), (5,)):
        cache.launch(plain, grid, args, {"HEAD_DIM": 64, "BLOCK_M": 16})
    assert plain.kernel.launches[0][:3] == (5, 1, 1)
    assert not any(isinstance(v, torch.Tensor) for entry in cache._entries.values() for v in entry[1].values())


def test_plain_jit_function_takes_its_constexprs_from_the_call() -> None:
    fn = FakeJit(config=None)
    cache = MetaLaunchCache()
    for _ in range(2):
        cache.launch(fn, (3, 2), _args(), {"HEAD_DIM": 64, "BLOCK_M": 16, "num_warps": 8})
    assert fn.kernel.launches[0][:3] == (3, 2, 1)
    assert fn.kernel.launches[0][-2:] == (64, 16)  # num_warps is a compile option, not a parameter


def test_nothing_is_replayed_where_replay_would_be_wrong() -> None:
    interpreted = FakeJit(Config({"BLOCK_M": 32}), compiled=False)  # Triton returned no compiled kernel
    missing = FakeJit(Config({}))  # BLOCK_M comes from nowhere: cannot rebuild the parameter list
    cache = MetaLaunchCache()
    for fn in (interpreted, missing):
        for _ in range(3):
            cache.launch(fn, (1,), _args(), {"HEAD_DIM": 64})
        assert len(fn.slow_calls) == 3
    assert len(cache) == 0
    cpu = FakeJit(Config({"BLOCK_M": 32}))  # CPU tensors (the interpreter's) are never cached
    for _ in range(2):
        cache.launch(cpu, _grid, (torch.empty(4, 4), 128, 64, 0.1), {"HEAD_DIM": 64})
    assert len(cpu.slow_calls) == 2


def test_a_configs_pre_hook_runs_before_every_replay_with_this_calls_arguments() -> None:
    """The attention kernels' configs size their host-built tensor descriptors in a pre-hook, which Triton runs
    before each launch: a replay must run it too, on the arguments of the call being replayed."""
    seen: list[dict] = []
    fn = FakeJit(Config({"BLOCK_M": 32}, pre_hook=lambda nargs: seen.append(dict(nargs))))
    cache = MetaLaunchCache()
    first, second = _args(), _args()
    cache.launch(fn, _grid, first, {"HEAD_DIM": 64})  # Triton's path: Triton runs the hook itself
    cache.launch(fn, _grid, second, {"HEAD_DIM": 64})
    cache.launch(fn, _grid, second, {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 1 and len(fn.kernel.launches) == 2 and len(seen) == 2
    assert seen[0]["X"] is second[0] and seen[0]["BLOCK_M"] == 32 and seen[0]["HEAD_DIM"] == 64
    assert seen[0]["n"] == 128 and seen[0]["scale"] == 0.125


def test_parameters_left_at_their_defaults_are_replayed_with_them() -> None:
    """An opt-in path adds constexprs with defaults that the default call does not pass (Triton binds them):
    the cache must replay them too, not give up on the kernel and send every call down Triton's slow path."""

    def kernel(X, n, stride, scale, HEAD_DIM, BLOCK_M, PERSISTENT=False, LD_ONLY=False):  # noqa: ANN001, N803
        pass

    class Wrapped(FakeJit):  # an autotuner around a JIT function around the function written
        arg_names = [*FakeJit.arg_names, "PERSISTENT", "LD_ONLY"]

        def __init__(self) -> None:
            super().__init__(Config({"BLOCK_M": 32}))
            self.fn = type("Jit", (), {"fn": staticmethod(kernel)})()

    fn = Wrapped()
    cache = MetaLaunchCache()
    for _ in range(2):
        cache.launch(fn, _grid, _args(), {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 1 and cache.hits == 1
    assert fn.kernel.launches[0][-4:] == (64, 32, False, False)
    for _ in range(2):  # a value the caller passes beats the default
        cache.launch(fn, _grid, _args(), {"HEAD_DIM": 64, "PERSISTENT": True})
    assert len(fn.slow_calls) == 2 and fn.kernel.launches[1][-4:] == (64, 32, True, False)

    class AroundHeuristics(Wrapped):  # triton.heuristics computes values per launch: never replayed
        def __init__(self) -> None:
            super().__init__()
            self.fn = type("Heuristics", (), {"fn": staticmethod(kernel)})()

    wrapped = AroundHeuristics()
    for _ in range(2):
        cache.launch(wrapped, _grid, _args(), {"HEAD_DIM": 64})
    assert len(wrapped.slow_calls) == 2 and wrapped.kernel.launches == []


def test_every_attention_launch_can_be_replayed() -> None:
    """The real kernels, run once forward and backward (under the interpreter on CPU): for each launch the
    cache must be able to rebuild the full parameter list, or every call pays Triton's launch path."""
    from cs336_systems.attention import FlashAttentionTriton
    from cs336_systems.attention.launch_cache import FLASH_LAUNCHES

    if torch.cuda.is_available():
        pytest.skip("the GPU tests above check the replays themselves")
    remembered: list = []
    original = LaunchCache._remember

    def remember(fn, args, constexprs, kernel):  # noqa: ANN001, ANN202
        entry = original(fn, args, constexprs, RecordingKernel())  # the interpreter returns no compiled kernel
        remembered.append((getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", fn), entry))
        return None  # nothing is replayed on CPU: only whether it could be

    shape = (1, 2, 32, 16)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    mp = pytest.MonkeyPatch()
    mp.setattr(FLASH_LAUNCHES, "device_type", "cpu")
    mp.setattr(LaunchCache, "_remember", staticmethod(remember))
    try:
        with launch_plan.disabled():
            o = FlashAttentionTriton.apply(q, k, v, True)
            torch.autograd.grad(o, (q, k, v), torch.randn(shape))
    finally:
        mp.undo()
    assert len(remembered) >= 3, remembered  # forward, dQ and dK/dV at least
    assert all(entry is not None for _, entry in remembered), [name for name, entry in remembered if entry is None]


def test_disabled_cache_and_lru_bound() -> None:
    fn = FakeJit(Config({"BLOCK_M": 32}))
    cache = MetaLaunchCache(max_entries=2)
    with launch_cache.disabled(cache):
        for _ in range(2):
            cache.launch(fn, _grid, _args(), {"HEAD_DIM": 64})
    assert len(fn.slow_calls) == 2 and len(cache) == 0 and cache.enabled
    for n in (64, 128, 256):
        cache.launch(fn, _grid, _args(n=n), {"HEAD_DIM": 64})
    assert len(cache) == 2
    cache.launch(fn, _grid, _args(n=64), {"HEAD_DIM": 64})  # the oldest was dropped: Triton's path again
    assert len(fn.slow_calls) == 6
    with pytest.raises(ValueError, match="max_entries"):
        LaunchCache(max_entries=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 4, 200, 64), (1, 2, 1024, 128)])
def test_attention_through_the_cache_matches_tritons_own_launches(shape: tuple, dtype: torch.dtype) -> None:
    from cs336_systems.attention import FlashAttentionTriton
    from cs336_systems.attention.launch_cache import FLASH_LAUNCHES

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    def run() -> list[torch.Tensor]:
        o = FlashAttentionTriton.apply(q, k, v, True)
        return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    with launch_cache.disabled():
        expected = run()
    hits = FLASH_LAUNCHES.hits
    with launch_plan.disabled():  # plans replay past the cache; this checks the cache itself
        run()  # first time through the cache for these shapes (may be a miss)
        got = run()
    assert FLASH_LAUNCHES.hits >= hits + 3  # forward, dQ and dK/dV replayed
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_after_a_larger_batch_of_the_same_shape() -> None:
    """Batch only sizes the grid, so a batch-1 call after a batch-8 one has equal kernel arguments: through
    the cache it must still run its own grid (a replayed batch-8 grid ran past the tensors: CUDA's 'illegal
    instruction' in the dK/dV kernel after the leaderboard's batch-16 run)."""
    from cs336_systems.attention import FlashAttentionTriton

    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (8, 1, 3):
        q, k, v = (torch.randn(batch, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        do = torch.randn_like(q)

        def run() -> list[torch.Tensor]:
            o = FlashAttentionTriton.apply(q, k, v, True)
            return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

        got = run()
        torch.cuda.synchronize()
        with launch_cache.disabled():
            expected = run()
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_signature_keeps_apart_what_triton_compiles_differently() -> None:
    sig = launch_cache._signature
    assert sig((True,)) != sig((1,))  # i1 and i32 parameters
    assert sig((1.0,)) == sig((2.0,))  # float values are runtime arguments, not specialized
    base = torch.empty(64, device="meta", dtype=torch.float16)
    assert sig((base, 16)) != sig((base.float(), 16)) and sig((base, 16)) != sig((base, 17))
