"""The C++ host entry (``options.host_entry``, on by default): recorded launch plans replayed from C++.

On CPU: a plan's export is checked against what Triton's own argument expansion hands its C launcher (every
parameter's type, order and value, tensors as their addresses, TMA maps as holes), and the compiled extension
against the export (keys, pointer holes). On a GPU, calls through the entry must give bit-identical outputs and
gradients to the Python replay, replay from C++ from the third call of a signature on, and capture in a CUDA
graph.
"""

from __future__ import annotations

import os
import re
import struct
import types
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import FlashAttentionTriton, flash_triton, host_entry, options
from cs336_systems.attention.launch_plan import LaunchPlan

from .test_launch_plan import REPLAY_CELLS, _inputs, check_graph_capture

nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")

SIGNATURE = {"X": "*bf16", "Kd": "tensordesc<bf16[1, 1, 64, 64]>", "O": "*fp32", "n": "i32", "scale": "fp32",
             "Vd": "tensordesc<bf16[1, 1, 32, 64]>", "flag": "i1", "big": "i64", "half": "bf16", "BLOCK": "constexpr"}
META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64], "fp4_padded": False}


class Compiled:
    """A compiled kernel's surface as Triton 3.6 lays it out; its C launcher records what it is handed."""

    function = 0xF00D

    def __init__(self, metas: list | None) -> None:
        self.calls: list[tuple] = []
        self.src = types.SimpleNamespace(signature=SIGNATURE)
        self.metadata = types.SimpleNamespace(tensordesc_meta=metas, num_warps=8, num_ctas=1, shared=1234)
        self.packed_metadata = (8, 1, 1234)
        launch = nvidia_driver.wrap_handle_tensordesc(lambda *a: self.calls.append(a), SIGNATURE, metas)
        self.run = types.SimpleNamespace(launch=launch, global_scratch_size=0, profile_scratch_size=0,
                                         launch_cooperative_grid=False, launch_pdl=True)


def _fake_tma(arg, meta):  # noqa: ANN001
    if meta is None:
        return [arg.base, *arg.shape, *arg.strides, arg.padding == "nan", *arg.shape, *arg.strides]
    return [("map", arg.base.data_ptr()), *arg.shape, *arg.strides]


def _call(seed: int) -> tuple[list[torch.Tensor], tuple]:
    g = torch.Generator().manual_seed(seed)
    x, k, v = (torch.randn(2, 3, 64, 64, generator=g).bfloat16() for _ in range(3))
    o = torch.empty(2, 3, 64)

    def desc(t: torch.Tensor, block: list[int]) -> object:
        return types.SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block,
                                     padding="zero")

    return [x, k, v, o], (x, desc(k, [1, 1, 64, 64]), o, 64, 0.125, desc(v, [1, 1, 32, 64]), True, -(2**40), 1.5, 64)


#: struct formats of the C types in Triton's generated ``_launch`` (floats travel as their storage's bits).
_C_FORMATS = {"CUdeviceptr": "Q", "int8_t": "b", "int16_t": "h", "int32_t": "i", "int64_t": "q", "uint8_t": "B",
              "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q"}


def _launch_parameters(metas: list | None) -> list[tuple[str, int]]:
    """(C type, index into the expanded arguments) of each parameter of the ``_launch`` function that Triton
    generates for SIGNATURE: what it passes cuLaunchKernelEx, in order, constexprs left out."""
    source = nvidia_driver.make_launcher({}, SIGNATURE, metas)
    declared = re.search(r"static void _launch\((.*?)\) \{", source, re.S).group(1).split(",")
    fixed = 12  # grid, warps, CTAs, cooperative, PDL, shared memory, stream, function, the two scratch pointers
    return [(ty, int(name.removeprefix("arg"))) for ty, name in (p.strip().rsplit(" ", 1) for p in declared[fixed:])]


def _decode(data: bytes, ty: str, at: int, like: object) -> object:
    if ty == "CUtensorMap":
        assert at % 128 == 0
        return "map"
    fmt = "<" + _C_FORMATS[ty]
    assert at % struct.calcsize(fmt) == 0
    raw = struct.unpack_from(fmt, data, at)[0]
    if not isinstance(like, float):
        return raw
    if ty == "uint16_t":  # bf16: the float32's top half
        raw <<= 16
    return struct.unpack("<f", struct.pack("<I", raw))[0]


@pytest.mark.parametrize("with_tma", [True, False], ids=["tma-maps", "no-metadata"])
def test_an_export_holds_what_tritons_launcher_passes_the_driver(monkeypatch, with_tma: bool) -> None:
    """Every parameter at its offset, in the C type of Triton's own generated launcher, with the value its Python
    expansion hands that launcher; tensors and TMA maps as holes for the call's tensors."""
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    metas = [META, dict(META, block_size=[1, 1, 32, 64])] if with_tma else None
    kernel = Compiled(metas)
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (12, 2, 1), full)], tensors)
    assert plan is not None
    [record] = host_entry.launch_records(plan)
    assert record[:6] == (0xF00D, (12, 2, 1), 256, 1234, False, True)
    kernel.run.launch(12, 2, 1, 7, kernel.function, False, True, None, None, kernel.packed_metadata, None, None, None,
                      *full)
    expanded = kernel.calls[0][13:]
    data, offsets, pointers, maps = record[6], record[7], dict(record[8]), {hole[0]: hole[1] for hole in record[9]}
    parameters = _launch_parameters(metas)
    for (ty, i), at in zip(parameters, offsets[:-2], strict=True):  # then the two scratch pointers
        value, got = expanded[i], _decode(data, ty, at, expanded[i])
        if isinstance(value, torch.Tensor):  # a pointer hole: the call's tensor goes there
            assert got == 0 and tensors[pointers[at]] is value
        elif isinstance(value, tuple):  # a TMA map, encoded per call from the tensor at its base
            assert got == "map" and tensors[maps[at]].data_ptr() == value[1]
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-2)
        else:
            assert got == value
    assert [_decode(data, "CUdeviceptr", at, 0) for at in offsets[-2:]] == [0, 0]
    assert len(pointers) == (2 if with_tma else 4) and len(maps) == (2 if with_tma else 0)


def test_a_map_hole_is_what_tritons_encoder_derives() -> None:
    stand_in = types.SimpleNamespace(shape=[2, 3, 100, 64], strides=[19200, 6400, 64, 1], padding="zero")
    hole = host_entry._map_hole(128, 2, stand_in, META)
    # fill_tma_descriptor: innermost first, strides in bytes (rank - 1 of them), the dtype through the host map
    assert hole == (128, 2, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST[10], [64, 100, 3, 2], [128, 12800, 38400],
                    [64, 64, 1, 1], 3, 0)


def test_unknown_layouts_are_not_exported() -> None:
    assert host_entry.expanded_types(["*bf16", ("i32", "i32")], None) is None


@pytest.fixture(scope="module")
def entry():  # noqa: ANN201
    try:
        return host_entry.load(host_entry.build())
    except (RuntimeError, OSError, ImportError) as e:  # no compiler here: the Python path runs, tested elsewhere
        pytest.skip(f"the host entry does not build here: {e}")


@pytest.mark.slow
def test_the_compiled_entry_keys_plans_and_fills_pointer_holes(monkeypatch, entry) -> None:  # noqa: ANN001
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    kernel = Compiled([META, dict(META, block_size=[1, 1, 32, 64])])
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (1, 1, 1), full)], tensors)
    q, k, v = (torch.empty(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    entry.clear()
    assert host_entry.export(entry, host_entry.FORWARD, (q, k, v), True, 5, plan)
    assert tuple(entry.lookup(host_entry.FORWARD, [q, k, v], True, 5)) == (True, True)
    for other in ([q, k, v.transpose(2, 3)], [q, k, v.half()], [q, k, torch.empty(1, 2, 9, 16).bfloat16()]):
        assert tuple(entry.lookup(host_entry.FORWARD, other, True, 5)) == (False, False)
    assert tuple(entry.lookup(host_entry.FORWARD, [q, k, v], False, 5)) == (False, False)  # the mask
    assert tuple(entry.lookup(host_entry.FORWARD, [q, k, v], True, 6)) == (False, False)  # the options
    shifted = torch.empty(1 + 1 * 2 * 8 * 16, dtype=torch.bfloat16)[1:].view(1, 2, 8, 16)  # 2 bytes off
    assert tuple(entry.lookup(host_entry.FORWARD, [q, k, shifted], True, 5)) == (False, False)
    [record] = host_entry.launch_records(plan)
    others, _ = _call(1)
    packed = entry.packed(host_entry.FORWARD, [q, k, v], True, 5, 0, others)
    assert len(packed) == record[7][-1] + 8
    for at, role in record[8]:
        assert struct.unpack_from("<Q", packed, at)[0] == others[role].data_ptr()
    holes = {at for at, _ in record[8]}
    for start, end in ((0, min(holes)), (record[7][-3], len(packed))):  # bytes outside the holes as exported
        assert packed[start:end] == record[6][start:end]
    host_entry.export(entry, host_entry.FORWARD, (q, k, v), True, 5, None)  # no plan: known, nothing to replay
    assert tuple(entry.lookup(host_entry.FORWARD, [q, k, v], True, 5)) == (True, False)
    with pytest.raises(ValueError, match="a forward key takes"):
        entry.lookup(host_entry.FORWARD, [q, k], True, 5)
    entry.clear()
    assert entry.size() == 0


class _Entry:
    """An entry without plans, as the Python path finds it before the hand-over."""

    def forward(self, *_: object) -> None:
        return None


@pytest.mark.slow
def test_the_python_path_hands_its_plans_to_the_entry(monkeypatch) -> None:  # noqa: ANN001
    """The forward's plan goes to the entry only for inputs launched as they are (validated, 4-D, 16-bit), under
    the key of (q, k, v); the backward's only under its forward's options, with the route's dQ rows."""
    from cs336_systems.attention.launch_plan import FLASH_PLANS, planned_key

    handed = []
    monkeypatch.setattr(flash_triton, "_host_entry", lambda: _Entry())
    monkeypatch.setattr(host_entry, "export", lambda *args: handed.append(args))
    # The hand-over's look-ups find "a plan" (none is recorded on CPU); the launches' own find none, as ever.
    monkeypatch.setattr(flash_triton, "planned_key", lambda key, tensors: ("hand-over", planned_key(key, tensors)))
    lookup = FLASH_PLANS.lookup
    monkeypatch.setattr(FLASH_PLANS, "lookup", lambda key: (True, "a plan") if key[0] == "hand-over" else lookup(key))
    g = torch.Generator().manual_seed(0)
    for dtype, shape, hands_over in ((torch.float16, (1, 2, 32, 16), True), (torch.float32, (1, 2, 32, 16), False),
                                     (torch.float16, (2, 32, 16), False)):  # float32 and 3-D: never the entry's
        q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
        handed.clear()
        o = flash_triton._host_entry_apply(FlashAttentionTriton.apply, q, k, v, True)
        assert bool(handed) == hands_over
        if hands_over:
            [(_, kind, key_tensors, causal, generation, plan)] = handed
            assert (kind, causal, generation, plan) == (host_entry.FORWARD, True, options.generation(), "a plan")
            assert all(a is b for a, b in zip(key_tensors, (q, k, v), strict=True))
    o, lse = flash_triton.eager_forward(q.unsqueeze(1).detach(), k.unsqueeze(1).detach(), v.unsqueeze(1).detach(),
                                        True, 0.25)
    q4, k4, v4 = (t.unsqueeze(1).detach() for t in (q, k, v))
    do = torch.randn_like(o)
    handed.clear()
    grads = flash_triton._host_entry_backward(do, q4, k4, v4, o, lse, True, 0.25, options.generation())
    [(_, kind, key_tensors, causal, generation, plan, dq_rows)] = handed
    assert (kind, causal, plan) == (host_entry.BACKWARD, True, "a plan") and len(grads) == 3
    assert all(a is b for a, b in zip(key_tensors, (do, q4, k4, v4, o, lse), strict=True))
    assert dq_rows is None  # the Triton kernels on CPU: no float32 dQ sums
    handed.clear()
    flash_triton._host_entry_backward(do, q4, k4, v4, o, lse, True, 0.25, options.generation() - 1)
    assert not handed  # recorded under other options than the forward's: not the forward's plan


def test_without_a_compiler_calls_take_the_python_path(monkeypatch, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        host_entry.build(tmp_path, compiler="no-such-c++")

    def unbuildable(*_: object, **__: object) -> None:
        raise RuntimeError("no C++ compiler 'no-such-c++' on PATH")

    monkeypatch.setattr(host_entry, "build", unbuildable)
    host_entry.module.cache_clear()
    flash_triton._host_entry.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert host_entry.module() is None
            assert flash_triton._host_entry() is None
            assert flash_triton._host_entry_apply(lambda *args: "python path", *[torch.empty(1, 1, 1, 16)] * 3,
                                                  True) == "python path"
        assert len(caught) == 1 and "host entry is unavailable" in str(caught[0].message)
    finally:
        host_entry.module.cache_clear()
        flash_triton._host_entry.cache_clear()


def test_non_strict_export_traces_the_python_path() -> None:
    """``torch.export`` without Dynamo runs Python with ``is_compiling()`` true: ``apply`` must take the Python
    path there, not hand the call back to itself as it does for Dynamo."""

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return FlashAttentionTriton.apply(q, k, v, True)

    q, k, v = (torch.randn(1, 32, 16) for _ in range(3))
    exported = torch.export.export(Attention(), (q, k, v), strict=False)
    torch.testing.assert_close(exported.module()(q, k, v), FlashAttentionTriton.apply(q, k, v, True))


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(shape: tuple, dtype: torch.dtype, layout: str, causal: bool, seed: int) -> list[torch.Tensor]:
    q, k, v, do = _inputs(shape, dtype, layout, seed)
    o = FlashAttentionTriton.apply(q, k, v, causal)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape,dtype,layout", [
    *(cell for cell in REPLAY_CELLS if cell[1] != torch.float32),  # float32 never reaches the entry
    ((8, 32, 256, 128), torch.bfloat16, "bhsd"),  # a short row at d = 128
    ((1, 8, 4096, 128), torch.bfloat16, "bhsd"),  # the persistent Gluon forward, the fused Gluon backward
])  # fmt: skip
def test_calls_through_the_host_entry_match_the_python_replay(shape, dtype, layout, causal) -> None:  # noqa: ANN001
    entry = flash_triton._host_entry()
    assert entry is not None, "the host entry did not build on this GPU machine"
    with options.use(host_entry=True):
        for _ in range(3):  # compile and tune; record and export the forward; export the backward
            _run(shape, dtype, layout, causal, 0)
        before = entry.replays()
        got = [_run(shape, dtype, layout, causal, seed) for seed in (1, 2)]
        assert entry.replays() == before + 4  # forward and backward, twice, from C++
    with options.use(host_entry=False):
        expected = [_run(shape, dtype, layout, causal, seed) for seed in (1, 2)]  # the Python replay
    q = _inputs(shape, dtype, layout, 0)[0]
    fused = flash_triton.backward_kernel_name(q, q, q) != "triton"  # its float32 dQ adds land in any order
    for g_call, e_call in zip(got, expected, strict=True):
        for i, (g, e) in enumerate(zip(g_call, e_call, strict=True)):
            assert g.stride() == e.stride()
            exact = not (fused and i == 1)
            torch.testing.assert_close(g, e, rtol=0 if exact else 1e-2, atol=0 if exact else 1e-2)


@pytest.mark.gpu
@gpu
def test_inputs_the_entry_does_not_take_run_the_python_path() -> None:
    entry = flash_triton._host_entry()
    assert entry is not None
    with options.use(host_entry=True):
        before = entry.replays()
        for dtype, shape in ((torch.float32, (1, 2, 128, 64)), (torch.bfloat16, (2, 128, 64))):  # float32, 3-D
            for _ in range(3):
                q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                o = FlashAttentionTriton.apply(q, k, v, True)
                o.sum().backward()
                ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
                torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)
        assert entry.replays() == before


@pytest.mark.gpu
@gpu
def test_host_entry_calls_capture_in_a_cuda_graph() -> None:
    entry = flash_triton._host_entry()
    assert entry is not None
    with options.use(host_entry=True):
        check_graph_capture(entry.replays, 4, lambda: options.use(host_entry=False))  # the Python replay
