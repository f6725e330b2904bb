"""The registration A/B of our attention's operators (custom_op, Library, direct): the three paths compute
the same thing, the twin operators trace like ours, and the benchmark alternates them. Host times are a
GPU machine's; here the kernels run under Triton's interpreter when there is no GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from cs336_systems.benchmarking import op_registration as reg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape=(1, 2, 24, 16), dtype=torch.float32):
    from cs336_systems.benchmarking.flash_host_overhead import make_inputs

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return tuple(t.detach() for t in make_inputs(shape, dtype, "bshd", gen, device=DEVICE))


def test_the_three_paths_compute_the_same_outputs_and_gradients() -> None:
    q, k, v, do = _inputs()
    results = {path: reg.make_pair(path, q, k, v, do, True)() for path in reg.PATHS}
    for path in ("library", "direct"):
        for ours, theirs in zip(results["custom_op"], results[path]):
            torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    assert [t.shape for t in results["library"]] == [q.shape] * 4


def test_the_twin_operators_trace_by_their_fake_kernels() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    twin = getattr(torch.ops, reg.NAMESPACE)
    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.empty(2, 3, 40, 64, dtype=torch.bfloat16))
        o, lse = twin.flash_attention_forward(q, q, q, True, 0.125)
        dq, dk, dv = twin.flash_attention_backward(q, q, q, q, o, lse, True, 0.125)
    assert o.shape == q.shape and lse.shape == (2, 3, 40) and lse.dtype == torch.float32
    assert dq.shape == dk.shape == dv.shape == q.shape


@pytest.mark.slow
def test_rounds_rotate_the_order_and_the_summary_subtracts_the_direct_call() -> None:
    rows = reg.measure((1, 2, 24, 16), torch.float32, rounds=3, calls=1, warmup=0, device=DEVICE)
    assert [tuple(g["path"]) for _, g in rows.groupby("round")] == [
        ("custom_op", "library", "direct"), ("library", "direct", "custom_op"), ("direct", "custom_op", "library")]
    assert (rows["host_us"] > 0).all() and set(rows["layout"]) == {"bshd"} and set(rows["seq_len"]) == {24}
    summary = reg.summarize(rows).set_index("path")
    direct = rows[rows["path"] == "direct"]["host_us"].median()
    for path in reg.PATHS:
        mine = rows[rows["path"] == path]["host_us"]
        assert summary.loc[path, "host_us"] == pytest.approx(mine.median())
        assert summary.loc[path, "over_direct_us"] == pytest.approx(mine.median() - direct)
    assert summary.loc["direct", "over_direct_us"] == 0


def test_bad_arguments_are_one_line_errors() -> None:
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="unknown path 'jit'"):
        reg.make_pair("jit", q, k, v, do, True)
    with pytest.raises(ValueError, match=r"\(batch, heads, seq, d\) with a head dim the kernels take unpadded"):
        reg.make_pair("direct", q[0], k[0], v[0], do[0], True)
    odd = torch.zeros(1, 2, 24, 17)  # 17 floats: rows of no whole 16-byte units, which the autograd function pads
    with pytest.raises(ValueError, match="unpadded"):
        reg.make_pair("direct", odd, odd, odd, odd, True)
    wide = torch.zeros(1, 2, 24, 80)  # 2.7B's head dim runs unpadded, as two slabs
    assert callable(reg.make_pair("library", wide, wide, wide, wide, True))
    with pytest.raises(ValueError, match="rounds >= 1"):
        reg.measure((1, 2, 24, 16), rounds=0, device=DEVICE)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            reg.main(["--shape", "1,2,24,16"])
