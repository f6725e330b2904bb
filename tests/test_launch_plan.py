"""Launch plans: a call's recorded launches replayed straight through Triton's C launcher.

On CPU the replay is checked against Triton's own argument expansion (``wrap_handle_tensordesc``, the code
between ``CompiledKernel.run`` and the C launcher) around a recording stand-in for the C launcher: a replay
must hand it the same arguments, with tensors as their addresses. On a GPU the attention calls replayed
through plans must give bit-identical outputs and gradients to the full launch path, and capture in a
CUDA graph.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import launch_plan
from cs336_systems.attention.launch_cache import LaunchCache
from cs336_systems.attention.launch_plan import LaunchPlan, PlanCache

nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")


@pytest.fixture(autouse=True)
def _python_replay():  # noqa: ANN202
    """These tests check the replay from Python; the C++ host entry, on by default, has its own
    (test_host_entry.py)."""
    from cs336_systems.attention import options

    with options.use(host_entry=False):
        yield


def _fake_tma(arg, meta):  # noqa: ANN001
    """``make_tensordesc_arg`` without a driver: the 'map' names the address and box it would encode."""
    if meta is None:
        return [arg.base, *arg.shape, *arg.strides, arg.padding == "nan", *arg.shape, *arg.strides]
    return [("map", arg.base.data_ptr(), tuple(meta["block_size"])), *arg.shape, *arg.strides]


class Compiled:
    """A compiled kernel's surface as Triton 3.6 lays it out; its C launcher records what it is handed."""

    function = "fn-handle"
    packed_metadata = (4, 1, 0)

    def __init__(self, signature: dict, metas: list | None, scratch: int = 0) -> None:
        self.calls: list[tuple] = []
        self.src = types.SimpleNamespace(signature=signature)
        self.metadata = types.SimpleNamespace(tensordesc_meta=metas)
        launch = nvidia_driver.wrap_handle_tensordesc(lambda *a: self.calls.append(a), signature, metas)
        self.run = types.SimpleNamespace(launch=launch, global_scratch_size=scratch, profile_scratch_size=0,
                                         launch_cooperative_grid=False, launch_pdl=False)

    def triton_launch(self, grid: tuple, stream: int, full: tuple) -> None:
        """What ``CudaLauncher.__call__`` does with no scratch and no launch hooks."""
        self.run.launch(*grid, stream, self.function, False, False, None, None, self.packed_metadata, None, None,
                        None, *full)


def _descriptor(t: torch.Tensor, block: list[int]) -> object:
    return types.SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block,
                                 padding="zero")


SIGNATURE = {"X": "*bf16", "Kd": "tensordesc<bf16[1, 1, 64, 64]>", "O": "*fp32", "n": "i32", "scale": "fp32",
             "Vd": "tensordesc<bf16[1, 1, 64, 64]>", "BLOCK": "constexpr"}


def _call(seed: int) -> tuple[list[torch.Tensor], tuple]:
    """The tensors of one call (x, k, v, o) and the kernel's full argument list for them."""
    g = torch.Generator().manual_seed(seed)
    x, k, v = (torch.randn(2, 3, 64, 64, generator=g).bfloat16() for _ in range(3))
    o = torch.empty(2, 3, 64)
    return [x, k, v, o], (x, _descriptor(k, [1, 1, 64, 64]), o, 64, 0.125, _descriptor(v, [1, 1, 64, 64]), 64)


@pytest.mark.parametrize("with_tma", [True, False], ids=["tma-maps", "no-metadata"])
def test_a_replay_hands_the_c_launcher_what_tritons_own_expansion_does(monkeypatch, with_tma: bool) -> None:
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    metas = [{"block_size": [1, 1, 64, 64]}, {"block_size": [1, 1, 32, 64]}] if with_tma else None
    kernel = Compiled(SIGNATURE, metas)
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (12, 1, 1), full)], tensors)
    assert plan is not None
    # A second call: other tensors (other addresses), same signature.
    tensors2, full2 = _call(1)
    kernel.triton_launch((12, 1, 1), 99, full2)
    plan.run(tensors2, 99)
    expected, got = kernel.calls
    by_address = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expected]
    assert got == tuple(by_address)
    assert any(isinstance(a, tuple) and a[0] == "map" and a[1] == tensors2[1].data_ptr() for a in got) == with_tma
    assert tensors2[0].data_ptr() in got and tensors[0].data_ptr() not in got  # the new call's addresses


def test_a_plan_keeps_no_tensor_alive(monkeypatch) -> None:
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    kernel = Compiled(SIGNATURE, [{"block_size": [1, 1, 64, 64]}] * 2)
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (1, 1, 1), full)], tensors)
    replay = plan.replays[0]
    assert not any(isinstance(a, torch.Tensor) for a in replay.template)
    assert all(stand_in.base is None for _, _, stand_in, _, _ in replay.descriptor_slots)


def test_tma_maps_are_encoded_once_per_address(monkeypatch) -> None:
    encoded = []

    def counting(arg, meta):  # noqa: ANN001, ANN202
        encoded.append(arg.base.data_ptr())
        return _fake_tma(arg, meta)

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", counting)
    kernel = Compiled(SIGNATURE, [{"block_size": [1, 1, 64, 64]}] * 2)
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (1, 1, 1), full)], tensors)
    encoded.clear()
    other, _ = _call(1)
    for call in (tensors, other, tensors, other):
        plan.run(call, 0)
    assert sorted(encoded) == sorted([tensors[1].data_ptr(), tensors[2].data_ptr(), other[1].data_ptr(),
                                      other[2].data_ptr()])  # two calls' worth: the repeats reuse them
    maps = [a for call in kernel.calls for a in call if isinstance(a, tuple) and a and a[0] == "map"]
    assert [m[1] for m in maps] == [t[i].data_ptr() for t in (tensors, other, tensors, other) for i in (1, 2)]


def test_no_plan_where_a_replay_would_be_wrong(monkeypatch) -> None:
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    metas = [{"block_size": [1, 1, 64, 64]}] * 2
    tensors, full = _call(0)
    ok = Compiled(SIGNATURE, metas)
    assert LaunchPlan.build([(ok, (1, 1, 1), full)], tensors) is not None
    # A launch that went through Triton's own path (a miss) leaves nothing to replay.
    assert LaunchPlan.build([(ok, (1, 1, 1), full), None], tensors) is None
    assert LaunchPlan.build([], tensors) is None
    # A tensor argument that is none of the call's tensors (an alignment copy made inside the call).
    copy = (full[0].clone(), *full[1:])
    assert LaunchPlan.build([(ok, (1, 1, 1), copy)], tensors) is None
    # A kernel that needs per-launch scratch memory.
    assert LaunchPlan.build([(Compiled(SIGNATURE, metas, scratch=128), (1, 1, 1), full)], tensors) is None
    # A launcher laid out otherwise than Triton 3.6's (the argument count does not match the signature).
    assert LaunchPlan.build([(ok, (1, 1, 1), full[:-1])], tensors) is None


def test_a_plan_constant_is_baked_in_by_address(monkeypatch) -> None:
    """A tensor argument outside the call's tensors replays only when marked a plan constant (the persistent
    forward's per-shape item table): its address goes into the template, the same for every call."""
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    signature = {**{k: v for k, v in SIGNATURE.items() if k != "BLOCK"}, "S": "*i32", "row": "i32", "BLOCK": "constexpr"}
    kernel = Compiled(signature, [{"block_size": [1, 1, 64, 64]}] * 2)
    tensors, full = _call(0)
    table = torch.arange(12, dtype=torch.int32)
    with_table = (*full[:-1], table, 4, full[-1])
    assert LaunchPlan.build([(kernel, (1, 1, 1), with_table)], tensors) is None  # unmarked: no plan
    assert launch_plan.plan_constant(table) is table
    plan = LaunchPlan.build([(kernel, (1, 1, 1), with_table)], tensors)
    assert plan is not None
    tensors2, full2 = _call(1)
    kernel.triton_launch((1, 1, 1), 7, (*full2[:-1], table, 4, full2[-1]))
    plan.run(tensors2, 7)
    expected, got = kernel.calls
    assert got == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expected)
    assert table.data_ptr() in got and tensors2[0].data_ptr() in got
    assert LaunchPlan.build([(kernel, (1, 1, 1), (*full[:-1], table.clone(), 4, full[-1]))], tensors) is None


def test_a_misaligned_address_keys_its_own_plan(monkeypatch) -> None:
    """Triton specializes pointers on 16-byte alignment and a descriptor's base must be aligned: a plan recorded
    for aligned tensors must not replay a call whose tensor sits 2 bytes off (it takes the full path)."""
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    launches = LaunchCache()
    plans = MetaPlans(launches)
    kernel = Compiled(SIGNATURE, [{"block_size": [1, 1, 64, 64]}] * 2)
    full_path_calls = []

    def full_path(full: tuple):  # noqa: ANN202
        def launch() -> None:
            full_path_calls.append(full)
            if launches._records is not None:
                launches._records.append((kernel, (1, 1, 1), full))
        return launch

    tensors, full = _call(0)
    plans.run("a", tensors, full_path(full))  # recorded
    plans.run("a", tensors, full_path(full))  # replayed
    assert plans.replays == 1 and len(full_path_calls) == 1
    x = torch.empty(tensors[0].numel() + 1, dtype=tensors[0].dtype)[1:].view_as(tensors[0])  # 2 bytes off
    assert x.data_ptr() % 16 != 0
    shifted = [x, *tensors[1:]]
    plans.run("a", shifted, full_path((x, *full[1:])))
    assert plans.replays == 1 and len(full_path_calls) == 2  # not the aligned call's plan
    assert launch_plan._alignment([16, 32, 48]) is True
    assert launch_plan._alignment([16, 34, 48]) == (True, False, True)


class MetaPlans(PlanCache):
    @staticmethod
    def _stream(device: torch.device) -> int:
        return 7


def test_plan_cache_records_once_then_replays_and_remembers_failures(monkeypatch) -> None:
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    launches = LaunchCache()
    plans = MetaPlans(launches, max_entries=2)
    kernel = Compiled(SIGNATURE, [{"block_size": [1, 1, 64, 64]}] * 2)
    full_path_calls = []

    def full_path(full: tuple, hit: bool = True):  # noqa: ANN202
        def launch() -> None:
            full_path_calls.append(full)
            if launches._records is not None:
                launches._records.append((kernel, (1, 1, 1), full) if hit else None)
        return launch

    tensors, full = _call(0)
    plans.run("a", tensors, full_path(full, hit=False))  # a miss (compiling): nothing recorded
    assert len(plans) == 0 and len(full_path_calls) == 1
    plans.run("a", tensors, full_path(full))  # every launch ready: recorded into a plan
    assert len(plans) == 1 and len(full_path_calls) == 2 and plans.replays == 0
    tensors2, full2 = _call(1)
    plans.run("a", tensors2, full_path(full2))  # replayed: the full path does not run
    assert len(full_path_calls) == 2 and plans.replays == 1 and len(kernel.calls) == 1
    assert kernel.calls[0][3] == 7  # on the current stream

    # A signature whose recording gave no plan takes the full path from then on, without re-recording.
    copy_full = (full[0].clone(), *full[1:])
    plans.run("b", tensors, full_path(copy_full))
    assert plans.lookup(("b", True)) == (True, None)  # the key as stored: with the alignment
    plans.run("b", tensors, full_path(copy_full))
    assert len(full_path_calls) == 4 and plans.replays == 1

    plans.run("c", tensors, full_path(full))  # LRU: "a" (least recently used) is dropped
    assert plans.lookup(("a", True)) == (False, None) and len(plans) == 2

    with launch_plan.disabled(plans):
        plans.run("c", tensors, full_path(full))
    launches.enabled = False  # the launch cache off turns plans off too
    plans.run("c", tensors, full_path(full))
    launches.enabled = True
    from triton import knobs

    def hook(metadata: object) -> None:
        pass

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler's hook: calls take the full path, which runs it
    try:
        plans.run("c", tensors, full_path(full))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(full_path_calls) == 8 and plans.replays == 1
    plans.run("c", tensors, full_path(full))
    assert plans.replays == 2
    with pytest.raises(ValueError, match="max_entries"):
        PlanCache(launches, max_entries=0)


# --------------------------------------------------------------------------------------------------
# GPU: attention through plans
# --------------------------------------------------------------------------------------------------

def _inputs(shape: tuple, dtype: torch.dtype, layout: str, seed: int) -> list[torch.Tensor]:
    from cs336_systems.benchmarking.flash_host_overhead import make_inputs

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return list(make_inputs(shape, dtype, layout, gen))


#: (shape, dtype, layout) cells of the replay checks: bf16 and fp16, float32 at d = 128, d = 80 in two slabs, head views.
REPLAY_CELLS = [
    ((2, 4, 200, 64), torch.bfloat16, "bhsd"),
    ((1, 2, 1024, 128), torch.float32, "bhsd"),
    ((2, 12, 1000, 64), torch.bfloat16, "bshd"),
    ((1, 4, 300, 80), torch.float16, "bhsd"),
    ((1, 16, 1024, 64), torch.bfloat16, "bhsd"),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape,dtype,layout", REPLAY_CELLS)
def test_attention_replayed_through_plans_matches_the_full_path(shape, dtype, layout, causal) -> None:  # noqa: ANN001
    from cs336_systems.attention import FlashAttentionTriton
    from cs336_systems.attention.flash_triton import validated_calls_off
    from cs336_systems.attention.launch_plan import FLASH_PLANS

    def run(seed: int) -> list[torch.Tensor]:
        q, k, v, do = _inputs(shape, dtype, layout, seed)
        o = FlashAttentionTriton.apply(q, k, v, causal)
        return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    run(0), run(0)  # compile and tune, then record
    replays = FLASH_PLANS.replays
    got = [run(seed) for seed in (1, 2)]  # new tensors (new addresses) through the plans
    assert FLASH_PLANS.replays == replays + 4  # forward and backward, twice
    with launch_plan.disabled(), validated_calls_off():  # the full path: input checks and Triton's launches
        expected = [run(seed) for seed in (1, 2)]
    for g_call, e_call in zip(got, expected, strict=True):
        for g, e in zip(g_call, e_call, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


#: The persistent Gluon kernels, each under the options that run it: the forward, and the dK/dV kernel beside the
#: Triton dQ kernel (the fused dQ's float32 adds finish in any order, so its dQ is not bit-reproducible).
PERSISTENT_KERNELS = {"forward": {"gluon_persistent": True},
                      "backward": {"gluon_persistent_backward": True, "gluon_backward_min_keys": 0, "dq_atomic": False}}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("shape", [(8, 32, 256, 128), (2, 4, 1000, 64)], ids=str)
@pytest.mark.parametrize("kernel", list(PERSISTENT_KERNELS))
def test_the_persistent_kernels_replay_through_plans(shape: tuple, kernel: str) -> None:
    """A persistent Gluon kernel's item table is a plan constant: its calls replay (no fall-back to the full path on
    every call) and give what the full path gives."""
    from cs336_systems.attention import FlashAttentionTriton, options
    from cs336_systems.attention.flash_triton import backward_kernel_name, forward_kernel_name, validated_calls_off
    from cs336_systems.attention.launch_plan import FLASH_PLANS

    def run(seed: int) -> list[torch.Tensor]:
        q, k, v, do = _inputs(shape, torch.bfloat16, "bhsd", seed)
        o = FlashAttentionTriton.apply(q, k, v, True)
        return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    with options.use(**PERSISTENT_KERNELS[kernel]):
        q, k, v = _inputs(shape, torch.bfloat16, "bhsd", 0)[:3]
        named = forward_kernel_name(q, k, v, True) if kernel == "forward" else backward_kernel_name(q, k, v)
        assert named == "gluon_persistent"
        run(0), run(0)
        replays = FLASH_PLANS.replays
        got = [run(seed) for seed in (1, 2)]
        assert FLASH_PLANS.replays == replays + 4
        with launch_plan.disabled(), validated_calls_off():
            expected = [run(seed) for seed in (1, 2)]
    for g_call, e_call in zip(got, expected, strict=True):
        for g, e in zip(g_call, e_call, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_saved_tensors_in_other_layouts_do_not_replay_the_plain_backwards_plan() -> None:
    """``save_on_cpu`` hands the backward contiguous copies of head views: its plan must be its own."""
    from cs336_systems.attention import FlashAttentionTriton
    from cs336_systems.attention.flash_triton import validated_calls_off

    def run(seed: int) -> list[torch.Tensor]:
        q, k, v, do = _inputs((2, 4, 256, 64), torch.bfloat16, "bshd", seed)
        o = FlashAttentionTriton.apply(q, k, v, True)
        return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    run(0), run(0)  # compile and tune, then record the plain call's plans
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        got = [run(1), run(1)]  # recorded, then replayed, with contiguous saved tensors
    with launch_plan.disabled(), validated_calls_off():
        expected = run(1)
    for call in got:
        for g, e in zip(call, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def check_graph_capture(replays: Callable[[], int], warmups: int,
                        reference: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Capture one causal forward + backward in a CUDA graph after ``warmups`` calls off the capture; the captured
    launches must be two replays (``replays()`` counts them), and the graph replayed on new inputs must match a
    call inside ``reference()``."""
    from cs336_systems.attention import FlashAttentionTriton

    q, k, v, do = _inputs((2, 8, 512, 64), torch.bfloat16, "bhsd", 0)

    def step() -> list[torch.Tensor]:
        o = FlashAttentionTriton.apply(q, k, v, True)
        return [o, *torch.autograd.grad(o, (q, k, v), do)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()  # compile, tune and record off the capture
    torch.cuda.current_stream().wait_stream(side)
    before = replays()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert replays() == before + 2  # the captured launches are the replays
    q2, k2, v2, do2 = _inputs((2, 8, 512, 64), torch.bfloat16, "bhsd", 5)
    with torch.no_grad():
        for dst, src in ((q, q2), (k, k2), (v, v2), (do, do2)):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    with reference():
        expected = step()
    for g, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_calls_capture_in_a_cuda_graph() -> None:
    from cs336_systems.attention.launch_plan import FLASH_PLANS

    check_graph_capture(lambda: FLASH_PLANS.replays, 3, launch_plan.disabled)
