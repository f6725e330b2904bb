"""The C++ host entry (``options.host_entry``, on by default): recorded launch plans replayed from C++.

On CPU: a plan's export is checked against what Triton's own argument expansion hands its C launcher (every
parameter's type, order and value, tensors as their addresses, TMA maps as holes), and the compiled extension
against the export (keys, pointer holes). On a GPU, calls through the entry must give bit-identical outputs and
gradients to the Python replay, replay from C++ from the third call of a signature on, and capture in a CUDA
graph.
"""

from __future__ import annotations

import os
import struct
import types
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import FlashAttentionTriton, flash_triton, host_entry, options
from cs336_systems.attention.launch_plan import LaunchPlan

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


def _decode(record: tuple, kernel: Compiled) -> list:
    """The parameters a record's bytes hold, by the expanded signature's types (constexprs skipped)."""
    data, offsets = record[6], record[7]
    metas = kernel.metadata.tensordesc_meta
    tys = [t for t in host_entry.expanded_types(list(SIGNATURE.values()), metas) if t != "constexpr"]
    assert len(offsets) == len(tys) + 2  # and the two scratch pointers
    maps = {hole[0] for hole in record[9]}
    out = []
    for ty, at in zip(tys, offsets):
        if ty == "nvTmaDesc":
            assert at in maps and at % 128 == 0
            out.append("map")
        elif ty == "bf16":
            out.append(struct.unpack("<f", struct.pack("<I", struct.unpack_from("<H", data, at)[0] << 16))[0])
        else:
            fmt = "<Q" if ty.startswith("*") else "<" + host_entry._SCALAR[ty]
            assert at % struct.calcsize(fmt) == 0
            out.append(struct.unpack_from(fmt, data, at)[0])
    return out


@pytest.mark.parametrize("with_tma", [True, False], ids=["tma-maps", "no-metadata"])
def test_an_export_holds_what_tritons_expansion_hands_the_c_launcher(monkeypatch, with_tma: bool) -> None:
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_tma)
    kernel = Compiled([META, dict(META, block_size=[1, 1, 32, 64])] if with_tma else None)
    tensors, full = _call(0)
    plan = LaunchPlan.build([(kernel, (12, 2, 1), full)], tensors)
    assert plan is not None
    [record] = host_entry.launch_records(plan)
    assert record[:6] == (0xF00D, (12, 2, 1), 256, 1234, False, True)
    kernel.run.launch(12, 2, 1, 7, kernel.function, False, True, None, None, kernel.packed_metadata, None, None, None,
                      *full)
    launched = [a for a, ty in zip(kernel.calls[0][13:], host_entry.expanded_types(
        list(SIGNATURE.values()), kernel.metadata.tensordesc_meta)) if ty != "constexpr"]
    pointers = {at: role for at, role in record[8]}
    decoded = _decode(record, kernel)
    for value, got, at in zip(launched, decoded, record[7]):
        if isinstance(value, torch.Tensor):  # a pointer hole: the call's tensor goes there
            assert got == 0 and tensors[pointers[at]] is value
        elif isinstance(value, tuple):  # a TMA map: a hole encoded from the call's tensor
            assert got == "map"
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-2)
        else:
            assert got == value
    assert len(pointers) == (2 if with_tma else 4) and len(record[9]) == (2 if with_tma else 0)


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
    except RuntimeError as e:  # no compiler here: the Python path is what runs, and is tested elsewhere
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
        device = "cuda" if torch.cuda.is_available() else "cpu"
        q, k, v = (torch.randn(1, 2, 32, 16, device=device, requires_grad=True) for _ in range(3))
        with options.use(host_entry=True):
            o = FlashAttentionTriton.apply(q, k, v, True)
        o.sum().backward()
        with options.use(host_entry=False):
            torch.testing.assert_close(o, FlashAttentionTriton.apply(q, k, v, True), rtol=0, atol=0)
    finally:
        host_entry.module.cache_clear()
        flash_triton._host_entry.cache_clear()


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(shape: tuple, dtype: torch.dtype, layout: str, seed: int) -> list[torch.Tensor]:
    from cs336_systems.benchmarking.flash_host_overhead import make_inputs

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return list(make_inputs(shape, dtype, layout, gen))


def _run(shape: tuple, dtype: torch.dtype, layout: str, causal: bool, seed: int) -> list[torch.Tensor]:
    q, k, v, do = _inputs(shape, dtype, layout, seed)
    o = FlashAttentionTriton.apply(q, k, v, causal)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape,dtype,layout", [
    ((2, 4, 200, 64), torch.bfloat16, "bhsd"),
    ((2, 12, 1000, 64), torch.bfloat16, "bshd"),
    ((1, 4, 300, 80), torch.float16, "bhsd"),
    ((1, 16, 1024, 64), torch.bfloat16, "bhsd"),
    ((8, 32, 256, 128), torch.bfloat16, "bhsd"),
    ((1, 8, 4096, 128), torch.bfloat16, "bhsd"),
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
    q, k, v, do = _inputs((2, 8, 512, 64), torch.bfloat16, "bhsd", 0)

    def step() -> list[torch.Tensor]:
        o = FlashAttentionTriton.apply(q, k, v, True)
        return [o, *torch.autograd.grad(o, (q, k, v), do)]

    with options.use(host_entry=True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(4):
                step()
        torch.cuda.current_stream().wait_stream(side)
        before = entry.replays()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        assert entry.replays() == before + 2
        q2, k2, v2, do2 = _inputs((2, 8, 512, 64), torch.bfloat16, "bhsd", 5)
        with torch.no_grad():
            for dst, src in ((q, q2), (k, k2), (v, v2), (do, do2)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
    with options.use(host_entry=False):
        expected = step()
    for g, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
