"""The DDP overhead model, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from cs336_systems.benchmarking import ddp_overhead_model as om

# A 1B-parameter fp32 model (s = 4 GB), 100 GB/s algorithm bandwidth, 100 µs per call:
S, W, O = 4e9, 1e11, 1e-4


def test_overhead_formula_by_hand() -> None:
    # 10 buckets of 400 MB: last bucket 4e9 / (10 * 1e11) = 4 ms, plus 10 calls * 0.1 ms = 1 ms.
    assert om.ddp_overhead_s(S, W, O, 10) == pytest.approx(5e-3)
    # One bucket: nothing overlaps, 40 ms + 0.1 ms.
    assert om.ddp_overhead_s(S, W, O, 1) == pytest.approx(40.1e-3)


def test_optimum_by_hand() -> None:
    assert om.optimal_num_buckets(S, W, O) == pytest.approx(20.0)  # sqrt(4e9 / 1e7)
    assert om.optimal_bucket_size_bytes(S, W, O) == pytest.approx(2e8)  # sqrt(4e9 * 1e11 * 1e-4)
    assert om.minimal_overhead_s(S, W, O) == pytest.approx(4e-3)  # 2 ms last bucket + 2 ms of calls
    assert om.ddp_overhead_s(S, W, O, 20) == pytest.approx(om.minimal_overhead_s(S, W, O))
    for n in (19, 21, 5, 80):
        assert om.ddp_overhead_s(S, W, O, n) > om.minimal_overhead_s(S, W, O)


def test_simulation_agrees_with_closed_form_for_equal_buckets() -> None:
    for n in (1, 7, 20, 64):
        assert om.simulate_overhead([S / n] * n, W, O) == pytest.approx(om.ddp_overhead_s(S, W, O, n))


def test_simulation_with_faster_compute_has_more_left_over() -> None:
    # If backward produces gradients twice as fast as the wire moves them, more communication is exposed.
    assert om.simulate_overhead([S / 20] * 20, W, O, compute_s_per_byte=0.5 / W) > om.ddp_overhead_s(S, W, O, 20)


def test_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [1e6, 1e7, 1e8, 1e9]
    o, w = om.fit_latency_bandwidth(sizes, [5e-5 + x / 2e11 for x in sizes])
    assert o == pytest.approx(5e-5, rel=1e-6)
    assert w == pytest.approx(2e11, rel=1e-9)


def test_bad_inputs_are_errors() -> None:
    with pytest.raises(ValueError):
        om.ddp_overhead_s(S, 0, O, 10)
    with pytest.raises(ValueError):
        om.optimal_num_buckets(S, W, 0)
    with pytest.raises(ValueError):
        om.fit_latency_bandwidth([1e6], [1e-3])
    with pytest.raises(ValueError):
        om.simulate_overhead([], W, O)
    assert math.isclose(om.optimal_bucket_size_bytes(1e3, W, 1.0), 1e3)  # capped at one bucket


def test_compare_with_sweep_uses_measured_bucket_counts() -> None:
    import pandas as pd

    steps = pd.DataFrame({
        "variant": ["single", "bucketed (1MB)", "bucketed (100MB)"], "mode": ["single", "bucketed", "bucketed"],
        "bucket_size_mb": [None, 1.0, 100.0], "comm_dtype": [None, "fp32", "fp32"], "num_buckets": [None, 40, 1],
        "grad_bytes": [S, S, S], "step_ms": [100.0, 110.0, 140.0], "overhead_ms": [0.0, 10.0, 40.0],
    })
    sizes = [1e6, 1e8, 1e9]
    allreduce = pd.DataFrame({"size_bytes": sizes, "time_ms": [(O + x / W) * 1e3 for x in sizes]})
    table, summary = om.compare_with_sweep(steps, allreduce)
    assert table["predicted_overhead_ms"].tolist() == pytest.approx([om.ddp_overhead_s(S, W, O, 40) * 1e3, 40.1])
    assert summary["optimal_num_buckets"] == pytest.approx(20.0)
    assert summary["optimal_bucket_size_mb"] == pytest.approx(2e8 / 2**20)
    assert summary["o_us"] == pytest.approx(100.0) and summary["w_GBps"] == pytest.approx(100.0)
