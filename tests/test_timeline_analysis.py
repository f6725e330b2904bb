"""Timeline analysis (``distributed.timeline_analysis``) on synthetic timelines and paired runs."""

from __future__ import annotations

import pandas as pd
import pytest

from cs336_systems.profiling import timeline as ta

# ---------------------------------------------------------------------------------------------------
# Timeline analysis on a synthetic timeline
# ---------------------------------------------------------------------------------------------------


def _timeline() -> pd.DataFrame:
    """Backward from 0 to 10 ms: compute busy 1 ms in every 2 ms (host-bound), three NCCL kernels of
    different lengths, each starting 0.25 ms after a compute kernel ended; compute resumes 0.75 ms after
    each comm start regardless of the comm kernel's length (a host-side stall)."""
    rows = [("v", "phase", "phase", "backward", 0.0, 10.0)]
    for k in range(5):
        rows.append(("v", "cuda:7", "compute", "nvjet_sm90_gemm", 2.0 * k, 1.0))
    for k, dur in zip(range(3), (0.1, 0.3, 0.5)):
        rows.append(("v", "cuda:19", "comm", "ncclDevKernel_AllReduce", 2.0 * k + 1.25, dur))
    # a reference variant with no communication and the same GEMMs
    rows.append(("ref", "phase", "phase", "backward", 0.0, 10.0))
    rows += [("ref", "cuda:7", "compute", "nvjet_sm90_gemm", 2.0 * k, 1.0) for k in range(5)]
    return pd.DataFrame(rows, columns=["variant", "lane", "kind", "name", "start_ms", "dur_ms"])


def test_stream_summary_measures_idle_fraction() -> None:
    s = ta.stream_summary(_timeline()).set_index("variant")
    assert s.loc["v", "span_ms"] == 10.0
    assert s.loc["v", "compute_busy_ms"] == pytest.approx(5.0)
    assert s.loc["v", "idle_fraction"] == pytest.approx(0.5)
    assert s.loc["v", "comm_kernels"] == 3 and s.loc["v", "comm_kernel_ms"] == pytest.approx(0.9)
    assert s.loc["ref", "comm_kernels"] == 0


def test_launch_stalls_separate_host_from_gpu_serialisation() -> None:
    st = ta.launch_stalls(_timeline()).set_index("variant")
    assert list(st.index) == ["v"]  # no communication in "ref"
    assert st.loc["v", "idle_before_us_median"] == pytest.approx(250.0)
    assert st.loc["v", "resume_after_us_median"] == pytest.approx(750.0)
    assert st.loc["v", "compute_gap_ms_total"] == pytest.approx(3.0)
    assert pd.isna(st.loc["v", "corr_resume_vs_comm_duration"])  # constant resume delay: undefined, not 1
    tl = _timeline()  # now make compute wait for each comm kernel's end: correlation 1
    comm = tl[tl["kind"] == "comm"].sort_values("start_ms")
    for (_, c), k in zip(comm.iterrows(), (1, 2, 3)):
        tl.loc[(tl["variant"] == "v") & (tl["kind"] == "compute") & (tl["start_ms"] == 2.0 * k), "start_ms"] = c["start_ms"] + c["dur_ms"]
    assert ta.launch_stalls(tl).iloc[0]["corr_resume_vs_comm_duration"] == pytest.approx(1.0)


def test_gaps_around_matching_kernels() -> None:
    tl = _timeline()
    tl.loc[(tl["variant"] == "v") & (tl["start_ms"] == 4.0), "name"] = "Memcpy DtoD (Device -> Device)"
    g = ta.gaps_around(tl).set_index("variant")
    assert g.loc["v", "kernels"] == 1 and g.loc["ref", "kernels"] == 0
    assert g.loc["v", "gap_before_us_median"] == pytest.approx(1000.0)  # 3 → 4 ms
    assert g.loc["v", "gaps_ms_total"] == pytest.approx(2.0)


def test_kernel_contention_and_backward_stretch() -> None:
    tl = _timeline()
    tl.loc[(tl["variant"] == "v") & (tl["kind"] == "compute") & (tl["start_ms"] == 2.0), ["start_ms", "dur_ms"]] = [1.2, 2.0]
    c = ta.kernel_contention(tl).set_index(["variant", "with_comm"])
    assert c.loc[("v", True), "kernels"] == 1 and c.loc[("v", True), "median_us"] == pytest.approx(2000.0)
    assert c.loc[("v", False), "kernels"] == 4 and c.loc[("ref", False), "median_us"] == pytest.approx(1000.0)

    steps = pd.DataFrame({"variant": ["flat", "bucketed (25MB)", "torch"], "num_buckets": [1, 100, None],
                          "step_ms": [10.0, 30.0, 20.0], "step_ms_std": [0.0, 0.0, 0.0], "fwd_bwd_ms": [8.0, 28.0, 18.0]})
    st = ta.backward_stretch(steps).set_index("variant")
    assert st.loc["bucketed (25MB)", "fwd_bwd_excess_ms"] == 20.0
    assert st.loc["bucketed (25MB)", "excess_per_collective_us"] == pytest.approx(200.0)
    assert pd.isna(st.loc["torch", "excess_per_collective_us"])
    with pytest.raises(ValueError, match="reference"):
        ta.backward_stretch(steps, reference="naive")
    with pytest.raises(ValueError, match="timeline"):
        ta.stream_summary(steps)


def test_paired_ratios_compare_within_each_run_and_record_the_order(tmp_path, monkeypatch) -> None:
    def run(order: list[tuple[str, str, float]]) -> pd.DataFrame:
        return pd.DataFrame([{"variant": v, "mode": m, "num_buckets": 3 if m == "bucketed" else None,
                              "step_ms": ms, "step_ms_median": ms - 1} for v, m, ms in order])

    runs = {"a": run([("single", "single", 100.0), ("torch", "torch", 150.0), ("bucketed (25MB)", "bucketed", 165.0)]),
            "b": run([("bucketed (25MB)", "bucketed", 120.0), ("torch", "torch", 160.0), ("single", "single", 90.0)]),
            "no_reference": run([("single", "single", 100.0), ("flat", "flat", 120.0)])}
    out = ta.paired_ratios(runs).set_index("run")
    assert list(out.index) == ["a", "b"]  # a run without torch DDP has nothing to compare with
    assert out.loc["a", "ratio_mean"] == pytest.approx(1.1) and not out.loc["a", "ours_first"]
    assert out.loc["b", "ratio_mean"] == pytest.approx(0.75) and out.loc["b", "ours_first"]
    assert out.loc["b", "ratio_median"] == pytest.approx(119 / 159) and out.loc["b", "single_ms"] == 90.0

    # Captured variants pair with the captured reference and single rows, bf16 wires with torch's bf16 hook.
    graphed = pd.DataFrame([
        {"variant": "single", "mode": "single", "cuda_graph": False, "comm_dtype": None, "step_ms": 100.0},
        {"variant": "torch", "mode": "torch", "cuda_graph": False, "comm_dtype": "fp32", "step_ms": 150.0},
        {"variant": "torch (bf16 comm)", "mode": "torch", "cuda_graph": False, "comm_dtype": "bf16", "step_ms": 140.0},
        {"variant": "bucketed (25MB)", "mode": "bucketed", "cuda_graph": False, "comm_dtype": "fp32", "step_ms": 165.0},
        {"variant": "bucketed (25MB, bf16 comm)", "mode": "bucketed", "cuda_graph": False, "comm_dtype": "bf16", "step_ms": 126.0},
        {"variant": "single (CUDA graph)", "mode": "single", "cuda_graph": True, "comm_dtype": None, "step_ms": 60.0},
        {"variant": "torch (CUDA graph)", "mode": "torch", "cuda_graph": True, "comm_dtype": "fp32", "step_ms": 80.0},
        {"variant": "bucketed (25MB, CUDA graph)", "mode": "bucketed", "cuda_graph": True, "comm_dtype": "fp32", "step_ms": 72.0},
    ]).assign(step_ms_median=lambda d: d.step_ms)
    out = ta.paired_ratios({"g": graphed}).set_index("variant")
    assert out["ratio_mean"].to_dict() == pytest.approx({"bucketed (25MB)": 1.1, "bucketed (25MB, bf16 comm)": 0.9,
                                                        "bucketed (25MB, CUDA graph)": 0.9})
    assert out.loc["bucketed (25MB, CUDA graph)", "single_ms"] == 60.0 and out.loc["bucketed (25MB, CUDA graph)", "cuda_graph"]

    # load_runs picks the step tables of one prefix, preset and precision, not timelines or other runs
    monkeypatch.setattr("cs336_systems.results.FIGURES_DIR", tmp_path)
    (tmp_path / "ddp_benchmark").mkdir()
    for name in ("hb_a_xl_bf16", "hb_a_xl_fp32", "other_xl_bf16"):
        runs["a"].to_csv(tmp_path / "ddp_benchmark" / f"{name}.csv", index=False)
    pd.DataFrame([{"variant": "torch", "lane": "cuda:7", "kind": "compute", "name": "k", "start_ms": 0.0, "dur_ms": 1.0}]).to_csv(
        tmp_path / "ddp_benchmark" / "hb_a_timeline_xl_bf16.csv", index=False)
    pd.DataFrame([{"bucket_size_mb": 25, "overhead_ms": 3.0}]).to_csv(
        tmp_path / "ddp_benchmark" / "hb_a_overhead_model_xl_bf16.csv", index=False)
    assert list(ta.load_runs("hb")) == ["hb_a"]


def test_busy_by_kind_reads_a_step_without_host_phases() -> None:
    def row(variant: str, lane: str, kind: str, start: float, dur: float) -> dict:
        return {"variant": variant, "lane": lane, "kind": kind, "name": "k", "start_ms": start, "dur_ms": dur}

    tl = pd.DataFrame([
        # compute on two streams, overlapping each other at 2..3; a gap 5..6 where nothing runs
        row("g", "cuda:7", "compute", 0.0, 3.0), row("g", "cuda:9", "compute", 2.0, 3.0), row("g", "cuda:7", "compute", 6.0, 4.0),
        # communication 4..7 (1 ms of it alone during the gap... and 4..5 / 6..7 beside compute)
        row("g", "cuda:20", "comm", 4.0, 3.0),
        row("single", "cuda:7", "compute", 0.0, 2.0),
    ])
    out = ta.busy_by_kind(tl).set_index("variant")
    assert out.loc["g"].to_dict() == pytest.approx({"span_ms": 10.0, "compute_ms": 9.0, "comm_ms": 3.0, "both_ms": 2.0,
                                                    "idle_ms": 0.0, "comm_kernels": 1})
    assert out.loc["single", "compute_ms"] == 2.0 and out.loc["single", "comm_ms"] == 0.0
    gap = pd.concat([tl, pd.DataFrame([row("h", "cuda:7", "compute", 0.0, 1.0), row("h", "cuda:7", "compute", 3.0, 1.0)])])
    assert ta.busy_by_kind(gap).set_index("variant").loc["h", "idle_ms"] == 2.0


# ---------------------------------------------------------------------------------------------------
# Writing: a Chrome trace reduced to interval rows
# ---------------------------------------------------------------------------------------------------


def _kernel(name: str, ts: float, dur: float, corr: int, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}


def _launch(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0, "args": {"correlation": corr}}


def test_trace_reduction_merges_compute_and_keeps_communication() -> None:
    trace = {"traceEvents": [
        # The host's backward range ends at 1040 µs, long before the GPU finishes its kernels.
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 1000.0, "dur": 40.0},
        _launch(1001.0, 1), _launch(1002.0, 2), _launch(1003.0, 3), _launch(1004.0, 4), _launch(1050.0, 5),
        _kernel("sm90_gemm", 1000.0, 10.0, 1),
        _kernel("elementwise", 1012.0, 10.0, 2),  # 2 µs gap: merged with the gemm
        _kernel("softmax_bwd", 1050.0, 50.0, 3),  # 28 µs gap: a new bar; ends at 1100 µs
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1030.0, 80.0, 4, stream=20),  # launched in backward
        _kernel("adam", 1120.0, 5.0, 5),  # launched after backward
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 990.0, "dur": 5.0},  # ignored when kernels exist
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0.0},  # not a duration event
    ]}
    rows = pd.DataFrame(ta.trace_to_intervals(trace, "flat"))
    compute = rows[rows["kind"] == "compute"].sort_values("start_ms")
    assert compute["name"].tolist() == ["2 kernels", "softmax_bwd", "adam"]
    assert compute["dur_ms"].tolist() == pytest.approx([0.022, 0.050, 0.005])
    comm = rows[rows["kind"] == "comm"]
    assert comm["lane"].tolist() == ["cuda:20"] and comm["start_ms"].tolist() == pytest.approx([0.030])
    phase = rows[rows["kind"] == "phase"].iloc[0]
    # GPU span of backward: its compute kernels only (1000..1100 µs), not the all-reduce nor the optimizer.
    assert (phase["name"], phase["start_ms"], phase["dur_ms"]) == ("backward", pytest.approx(0.0), pytest.approx(0.100))
    summary = ta.overlap_summary(rows).iloc[0]
    assert summary["comm_ms"] == pytest.approx(0.080)
    assert summary["comm_during_backward_ms"] == pytest.approx(0.070)  # backward ends at 1100 µs, comm at 1110 µs


def test_timeline_lanes_are_named_by_what_ran_on_them() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from cs336_systems.profiling.timeline import plot_timeline

    rows = [("phase", "phase", "backward", 0.0, 5.0), ("cuda:7", "compute", "3 kernels", 0.0, 4.0),
            ("cuda:20", "comm", "ncclDevKernel_AllReduce", 1.0, 2.0), ("cuda:9", "compute", "copy", 0.0, 1.0),
            ("cuda:9", "comm", "ncclDevKernel_AllReduce", 2.0, 1.0)]
    df = pd.DataFrame([{"variant": "overlap", "lane": lane, "kind": kind, "name": name, "start_ms": t, "dur_ms": d}
                       for lane, kind, name, t, d in rows])
    fig = plot_timeline(df)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["phase", "NCCL (stream 20)", "compute (stream 7)", "compute + NCCL (stream 9)"]
