"""The parallelism closed forms against simulations: ring collectives on real arrays (results and bytes
sent per step), the DP / FSDP / TP strategies run device by device (FLOPs from torch's flop counter,
gradients against the unsharded FFN), and every device-count bound re-derived by sympy."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
import torch

from cs336_systems import parallelism_calcs as pc


def _numbers(**extra: float) -> dict:
    return {pc.S: 4096.0, pc.W: 1.0, **extra}


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_collectives_compute_the_right_thing_in_the_stated_time(n: int) -> None:
    rng = np.random.default_rng(n)
    size = 24 * n  # elements; float64 on the wire in the simulation: bytes = 8 * size
    xs = [rng.standard_normal(size) for _ in range(n)]
    total = sum(xs)
    nbytes = 8.0 * size

    reduced, t = pc.simulate_ring("reduce_scatter", xs)
    for i, chunk in enumerate(reduced):
        np.testing.assert_allclose(chunk, np.array_split(total, n)[i])
    assert t == pytest.approx(float(pc.ring_gather(n, nbytes).subs(pc.W, 1)))

    gathered, t = pc.simulate_ring("all_gather", np.array_split(total, n))
    assert all(np.allclose(g, total) for g in gathered)
    assert t == pytest.approx(float(pc.ring_gather(n, nbytes).subs(pc.W, 1)))

    out, t = pc.simulate_ring("all_reduce", xs)
    assert all(np.allclose(o, total) for o in out)
    assert t == pytest.approx(float(pc.ring_all_reduce(n, nbytes).subs(pc.W, 1)))

    out, t = pc.simulate_ring("alternate_all_reduce", xs)
    assert all(np.allclose(o, total) for o in out)
    assert t == pytest.approx(float(pc.ALTERNATE_ALL_REDUCE.subs({pc.N: n, pc.S: nbytes, pc.W: 1})))
    # N/2 times the ring all-reduce: equal at two devices, slower beyond
    ratio = pc.ALTERNATE_ALL_REDUCE / pc.ring_all_reduce(pc.N, pc.S)
    assert sp.simplify(ratio - pc.N / 2) == 0


def test_simulation_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        pc.simulate_ring("all_reduce", [np.zeros(4)])
    with pytest.raises(ValueError, match="unknown collective"):
        pc.simulate_ring("broadcast", [np.zeros(4)] * 2)


def _ffn(batch: int = 12, d: int = 8, d_ff: int = 24):
    gen = torch.Generator().manual_seed(0)
    shapes = [(batch, d), (d, d_ff), (d, d_ff), (d_ff, d), (batch, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("name,n", [("dp", 2), ("dp", 3), ("fsdp", 4), ("tp", 2), ("tp", 3)])
def test_strategies_run_device_by_device_match_the_formulas_and_the_unsharded_ffn(name: str, n: int) -> None:
    x, w1, w2, w3, dy = _ffn()
    batch, d = x.shape
    d_ff = w1.shape[1]
    step = pc.sharded_ffn_step(name, n, x, w1, w2, w3, dy)
    y, dx, grads = pc.ffn_step(x, w1, w2, w3, dy)
    torch.testing.assert_close(step.y, y)
    torch.testing.assert_close(step.dx, dx)
    for got, want in zip(step.grads, grads, strict=True):
        torch.testing.assert_close(got, want)

    at = {pc.B: batch, pc.D: d, pc.F: d_ff, pc.W: 1}
    for pass_, counted in (("forward", step.forward_flops), ("backward", step.backward_flops)):
        formula = pc.strategy(name, pass_).flops if name != "dp" or pass_ == "backward" else (
            pc.strategy("fsdp", "forward").flops.subs(pc.N_FSDP, pc.N_DP))
        per_device = float(formula.subs({**at, pc.strategy(name, "backward").devices: n}))
        assert counted == [per_device] * n, (pass_, counted, per_device)
    # the collectives' bytes, fed to the ring formulas, give each pass's communication time
    for pass_ in ("forward", "backward") if name != "dp" else ("backward",):
        s = pc.strategy(name, pass_)
        moved = {k: v for k, v in step.collective_bytes.items() if k.startswith(pass_)}
        time = sum((pc.ring_all_reduce(n, v) if "all_reduce" in k else pc.ring_gather(n, v)) for k, v in moved.items())
        assert float(time.subs(pc.W, 1)) == pytest.approx(float(s.comm_time.subs({**at, s.devices: n})))


def test_every_bound_is_where_communication_time_meets_compute_time() -> None:
    for s in pc.STRATEGIES:
        assert sp.simplify(pc.bound_from_times(s.comm_time, s.compute_time, s.devices) - s.bound) == 0, s
    # 2D, overlapped: each axis's own bound, independent of the other axis's size
    compute = pc.FSDP_TP["flops"] / pc.C
    f_bound = pc.bound_from_times(pc.FSDP_TP["fsdp_axis"], compute, pc.N_FSDP)
    t_bound = pc.bound_from_times(pc.FSDP_TP["tp_axis"], compute, pc.N_TP)
    assert sp.simplify(f_bound * t_bound - pc.FSDP_TP["bound_overlapped"]) == 0
    # 2D, shared network: sympy's constrained optimum is the closed form, a quarter of the overlapped one
    best, split = pc.shared_network_bound()
    assert sp.simplify(best - pc.FSDP_TP["bound_shared_large_n"]) == 0
    assert all(sp.simplify(split[k] - v) == 0 for k, v in pc.FSDP_TP["best_split_shared"].items())
    assert sp.simplify(pc.FSDP_TP["bound_shared_large_n"] / pc.FSDP_TP["bound_overlapped_large_n"]) == sp.Rational(1, 4)


def test_bounds_at_numbers_and_one_line_errors() -> None:
    # an H100-like device (989 TFLOP/s, 450 GB/s egress): DP stays compute-bound to B*W/C + 1 devices
    dp = pc.strategy("dp", "backward")
    n = pc.max_devices(dp.bound, batch=4e6, d_model=8192, d_ff=28672, flops=989e12, egress=450e9)
    assert n == pytest.approx(1 + 4e6 * 450e9 / 989e12)
    with pytest.raises(ValueError, match="no strategy 'pp'"):
        pc.strategy("pp", "forward")
    x, w1, w2, w3, dy = _ffn(batch=10)
    with pytest.raises(ValueError, match="does not split over 3"):
        pc.sharded_ffn_step("dp", 3, x, w1, w2, w3, dy)
    with pytest.raises(ValueError, match="unknown strategy"):
        pc.sharded_ffn_step("ep", 2, x, w1, w2, w3, dy)
