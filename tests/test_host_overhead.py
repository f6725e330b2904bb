"""The CPU host-overhead benchmark: XL's structure at a tiny width, one gloo process."""

from __future__ import annotations

import pytest

from cs336_systems.configs import build_model
from cs336_systems.benchmarking import ddp_host_overhead as host_overhead
from cs336_systems.distributed.grad_sync import size_capped_buckets


def test_scaled_model_keeps_xl_bucket_layout() -> None:
    tiny, cap = host_overhead.scaled_model("xl")
    xl = build_model("xl", context_length=512, device="meta")
    tiny_buckets = size_capped_buckets(list(tiny.parameters()), cap)
    xl_buckets = size_capped_buckets(list(xl.parameters()), 25.0)
    assert len(list(tiny.parameters())) == len(list(xl.parameters()))
    # the same grouping, parameter by parameter, not only the same count
    assert [len(b) for b in tiny_buckets] == [len(b) for b in xl_buckets] and len(xl_buckets) == 243


@pytest.mark.slow
def test_measure_times_every_variant_in_alternating_order() -> None:
    frame = host_overhead.measure(repeats=2, steps=1, warmup=0)
    assert list(frame[frame["repeat"] == 0]["variant"]) == list(host_overhead.VARIANTS)
    assert list(frame[frame["repeat"] == 1]["variant"]) == list(reversed(host_overhead.VARIANTS))
    assert (frame["step_ms_median"] > 0).all()
    assert (frame.loc[frame["variant"] == "single", "overhead_ms"] == 0).all()
    summary = host_overhead.summarize(frame).set_index("variant")
    assert summary.loc["bucketed", "num_buckets"] == 243 and summary.loc["torch", "num_params"] == 435
    with pytest.raises(ValueError):
        host_overhead.measure(repeats=0)
