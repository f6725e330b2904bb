"""CPU tests of the profiling library: kernel tables from a real (CPU) torch.profiler run, range filtering,
kernel classification, nsys command construction, and memory-snapshot analysis on a synthetic snapshot in
the format ``torch.cuda.memory._dump_snapshot`` writes."""

from __future__ import annotations

import json
import pickle

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
import torch

from cs336_basics import nvtx
from cs336_systems.benchmarking import BenchmarkSpec, ModelBenchmark
from cs336_systems.profiling import (
    active_memory_timeline,
    allocation_events,
    annotations,
    classify_kernel,
    export_chrome_trace,
    kernel_records,
    kernel_table,
    largest_allocations,
    load_snapshot,
    nsys_command,
    plot_active_memory_timeline,
    plot_memory_timelines,
    profile_steps,
    range_names,
    record_memory_snapshot,
    run_nsys,
)
from cs336_systems.profiling.memory import BEFORE_RECORDING, OTHER, allocator_rounded, is_user_frame

# --------------------------------------------------------------------------------------------------
# torch.profiler kernel tables
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_profile():
    bench = ModelBenchmark(BenchmarkSpec("tiny", mode="train", context_length=16, batch_size=2, device="cpu"))
    return profile_steps(bench.step, warmup=1, steps=2)


def test_profile_contains_annotated_ranges(train_profile):
    names = set(range_names(train_profile))
    assert {"step", "forward", "backward", "optimizer", "attention (naive)", "computing softmax"} <= names
    assert not nvtx.is_enabled()  # profile_steps restores the annotation switch


def test_kernel_table_by_range(train_profile):
    full = kernel_table(train_profile, "step", per=2)
    fwd = kernel_table(train_profile, "forward", per=2)
    bwd = kernel_table(train_profile, "backward", per=2)
    attn = kernel_table(train_profile, "attention.*", per=2)
    for table in (full, fwd, bwd, attn):
        assert list(table.columns) == ["name", "calls", "total_ms", "avg_us", "percent", "category"]
        assert not table.empty
        assert table["percent"].sum() == pytest.approx(100)
        assert table["total_ms"].is_monotonic_decreasing
    # the ranges partition the step: forward + backward (+ optimizer) add up to the whole
    opt = kernel_table(train_profile, "optimizer", per=2)["total_ms"].sum()
    assert fwd["total_ms"].sum() + bwd["total_ms"].sum() + opt == pytest.approx(full["total_ms"].sum(), rel=1e-6)
    assert attn["total_ms"].sum() < fwd["total_ms"].sum()
    assert set(attn["name"]) <= set(fwd["name"])
    # per-step normalisation: 2 profiled steps, tiny has 2 layers each launching one mm per projection
    assert kernel_table(train_profile, "forward", per=1)["calls"].sum() == pytest.approx(2 * fwd["calls"].sum())
    assert "aten::mm" in set(fwd["name"])
    assert kernel_table(train_profile, "no such range").empty


def test_kernel_table_from_records_aggregates_exactly():
    records = pd.DataFrame(
        {"name": ["gemm", "gemm", "softmax", "gemm"], "duration_us": [10.0, 30.0, 60.0, 0.0],
         "launch_us": [0, 1, 2, 3], "device": "cuda", "op": "x"}
    )
    table = kernel_table(records).set_index("name")
    assert table.loc["gemm", "calls"] == 3 and table.loc["gemm", "total_ms"] == pytest.approx(0.04)
    assert table.loc["softmax", "percent"] == pytest.approx(60.0)
    assert table.loc["gemm", "avg_us"] == pytest.approx(40 / 3)
    with pytest.raises(ValueError):
        kernel_table(records, "forward")
    assert len(kernel_records(_FakeProf())) == 0


class _FakeProf:
    def events(self):
        return []


@pytest.mark.parametrize(
    "name,category",
    [
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "matmul"),
        ("ampere_sgemm_128x64_tn", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4>(...)", "matmul"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>(...)", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MaxOps<float>>>(...)", "reduction"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(...)", "softmax"),
        ("triton_red_fused_amax_sub_exp_0", "reduction"),
        ("triton_poi_fused_mul_silu_1", "elementwise"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("aten::mm", "matmul"),
        ("aten::index", "other"),
    ],
)
def test_classify_kernel(name, category):
    assert classify_kernel(name) == category


def test_chrome_trace_export(train_profile, tmp_path):
    path = export_chrome_trace(train_profile, tmp_path / "sub" / "trace.json")
    trace = json.loads(path.read_text())
    assert any(e.get("name") == "forward" for e in trace["traceEvents"])


def test_annotations_context_restores_state():
    assert not nvtx.is_enabled()
    with annotations(True):
        assert nvtx.is_enabled()
    assert not nvtx.is_enabled()


def test_nsys_command_and_missing_binary(monkeypatch, tmp_path):
    cmd = nsys_command(["model", "--size", "small"], tmp_path / "rep")
    assert cmd[:2] == ["nsys", "profile"] and "--nvtx" in cmd
    assert cmd[cmd.index("-m") + 1] == "cs336_systems.benchmarking"
    assert any(c.startswith("--trace=") and "nvtx" in c for c in cmd)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="not on PATH"):
        run_nsys(["model"], tmp_path / "rep")


# --------------------------------------------------------------------------------------------------
# memory snapshots
# --------------------------------------------------------------------------------------------------

MiB = 2**20
USER = {"filename": "/work/repo/cs336-basics/cs336_basics/model.py", "line": 120, "name": "forward"}
SCRIPT = {"filename": "/home/me/train.py", "line": 7, "name": "main"}
TORCH = {"filename": torch.__file__.replace("__init__.py", "nn/modules/module.py"), "line": 1, "name": "_call_impl"}
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}


def _entry(action, addr, size, frames=(), t=0):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames), "time_us": t}


def synthetic_snapshot() -> dict:
    """A pre-recording block of 8 MiB (address 0, one of two still alive), then: weights-like 4 MiB alloc
    from the script, 16 MiB activation from model.py, 2 MiB temp freed, activation freed, pre-recording
    block 0 freed. Peak active = 8 + 4 + 16 + 2 = 30 MiB + the other pre-recording 8 MiB."""
    trace = [
        _entry("segment_alloc", 100, 64 * MiB),
        _entry("alloc", 100, 4 * MiB, [CPP, TORCH, SCRIPT], 1),
        _entry("alloc", 200, 16 * MiB, [CPP, TORCH, USER, SCRIPT], 2),
        _entry("alloc", 300, 2 * MiB, [CPP, SCRIPT], 3),
        _entry("free_requested", 300, 2 * MiB, [], 4),
        _entry("free_completed", 300, 2 * MiB, [], 4),
        _entry("free_completed", 200, 16 * MiB, [], 5),
        _entry("free_completed", 0, 8 * MiB, [], 6),  # a block allocated before recording
    ]
    segments = [
        {"address": 0, "total_size": 64 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": 100, "size": 4 * MiB, "state": "active_allocated", "frames": []},
                    {"address": 50 * MiB, "size": 8 * MiB, "state": "active_allocated", "frames": []},
                    {"address": 200, "size": 16 * MiB, "state": "inactive", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_user_frame_filter():
    assert is_user_frame(USER) and is_user_frame(SCRIPT)
    assert not is_user_frame(TORCH) and not is_user_frame(CPP)
    assert not is_user_frame({"filename": "<frozen runpy>", "line": 1, "name": "x"})


def test_allocation_events_pair_frees_with_allocs():
    ev = allocation_events(synthetic_snapshot())
    assert list(ev["action"]) == ["alloc"] * 3 + ["free_completed"] * 3  # free_requested/segment events dropped
    assert ev.iloc[1]["origin"] == "model.py:120 forward"  # innermost user frame, torch/C++ skipped
    assert ev.iloc[1]["stack"] == "model.py:120 forward <- train.py:7 main"
    assert ev.iloc[4]["origin"] == "model.py:120 forward" and ev.iloc[4]["alloc_event"] == 2
    assert ev.iloc[5]["origin"] == BEFORE_RECORDING
    assert ev["delta"].sum() == (4 + 16 + 2 - 2 - 16 - 8) * MiB


def test_active_memory_timeline_totals():
    snap = synthetic_snapshot()
    tl = active_memory_timeline(snap, top=1)
    assert list(tl.columns) == ["model.py:120 forward", OTHER, BEFORE_RECORDING]
    total = tl.sum(axis=1) / MiB
    # before recording: 12 MiB active at dump (4 + 8), minus the trace's net -4 MiB => 16 MiB
    assert list(total) == [20, 36, 38, 36, 20, 12]
    assert tl[BEFORE_RECORDING].iloc[0] == 16 * MiB and tl[BEFORE_RECORDING].iloc[-1] == 8 * MiB
    assert tl["model.py:120 forward"].max() == 16 * MiB
    assert tl[OTHER].iloc[2] == 6 * MiB  # the two train.py allocations, grouped beyond top=1
    thinned = active_memory_timeline(snap, max_points=2)
    assert len(thinned) <= 3 and thinned.sum(axis=1).max() == 38 * MiB  # the peak row survives thinning
    with pytest.raises(ValueError, match="device_traces"):
        active_memory_timeline({"segments": []})


def test_plot_and_largest_allocations(tmp_path):
    snap = synthetic_snapshot()
    fig = plot_active_memory_timeline(snap, title="synthetic")
    fig.savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    # A grid shares one legend (each origin once, same colour in every panel) instead of one per panel.
    grid = plot_memory_timelines({"a": snap, "b": snap, "c": None}, ncols=3, top=1)
    assert len(grid.legends) == 1 and not any(ax.get_legend() for ax in grid.axes)
    labels = [t.get_text() for t in grid.legends[0].get_texts()]
    # named by the allocating line of cs336_basics (model.py:120 here), not by its place
    from cs336_systems.profiling.memory import origin_label

    assert labels == [origin_label("model.py:120 forward"), OTHER, BEFORE_RECORDING]
    assert labels[0].endswith(" (forward)") and not labels[0].startswith("model.py")
    plain = plot_memory_timelines({"a": snap}, ncols=1, top=1, label=str)
    assert plain.legends[0].get_texts()[0].get_text() == "model.py:120 forward"
    assert grid.legends[0].get_texts()[0].get_fontsize() >= 10
    colours = [tuple(ax.collections[-1].get_facecolor()[0]) for ax in grid.axes[:2]]
    assert colours[0] == colours[1]
    with pytest.raises(ValueError, match="no snapshots"):
        plot_memory_timelines({"a": None}, ncols=1)
    big = largest_allocations(snap, n=2)
    assert list(big["size_MiB"]) == [16, 4]
    assert big.iloc[0]["origin"] == "model.py:120 forward" and big.iloc[0]["lifetime_events"] == 4
    assert pd.isna(big.iloc[1]["lifetime_events"])  # still alive at the end
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert load_snapshot(path)["device_traces"] == snap["device_traces"]
    assert allocator_rounded(1) == 512 and allocator_rounded(20 * MiB) == 20 * MiB


def test_record_memory_snapshot_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(RuntimeError, match="CUDA"):
        record_memory_snapshot(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_record_memory_snapshot_on_gpu(tmp_path):
    bench = ModelBenchmark(BenchmarkSpec("tiny", mode="train", context_length=32))
    snap = record_memory_snapshot(bench.step, tmp_path / "s.pickle")
    assert (tmp_path / "s.pickle").exists() and snap["summary"]["peak_allocated_bytes"] > 0
    tl = active_memory_timeline(snap)
    assert tl.sum(axis=1).max() <= snap["summary"]["peak_allocated_bytes"] * 1.01
    assert not largest_allocations(snap).empty


# --------------------------------------------------------------------------------------------------
# the CUDA path of kernel_records, on profiler-shaped fakes
# --------------------------------------------------------------------------------------------------


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Kernel:
    def __init__(self, name, duration):
        self.name, self.device, self.duration = name, 0, duration


class _Event:
    def __init__(self, name, start, end, kernels=(), annotation=False, thread=1, device_type="DeviceType.CPU"):
        self.name, self.time_range, self.kernels = name, _Range(start, end), list(kernels)
        self.is_user_annotation, self.device_type, self.is_async = annotation, device_type, False
        self.thread, self.self_cpu_time_total = thread, end - start


class _CudaProf:
    """Three ranges on the main thread; the backward's kernels are launched from autograd's thread, inside
    the backward range in time. An annotation's GPU-side span is linked like a kernel and must be ignored;
    a kernel launched with no operator around it but a range is linked to the range and must count."""

    def events(self):
        return [
            _Event("forward", 0, 100, kernels=[_Kernel("forward", 95.0)], annotation=True),
            _Event("aten::mm", 10, 20, kernels=[_Kernel("sm90_xmma_gemm_tn", 40.0)]),
            _Event("aten::exp", 30, 35, kernels=[_Kernel("vectorized_elementwise_kernel", 10.0)]),
            _Event("backward", 100, 200, annotation=True),
            _Event("aten::mm", 120, 130, kernels=[_Kernel("sm90_xmma_gemm_tn", 80.0)], thread=2),
            # a Triton kernel launched from Python inside a range: linked to the range itself
            _Event("optimizer", 210, 260, kernels=[_Kernel("optimizer", 55.0), _Kernel("adamw_kernel", 50.0)],
                   annotation=True),
        ]


def test_cuda_kernel_attribution_by_launch_time():
    prof = _CudaProf()
    records = kernel_records(prof)
    assert set(records["device"]) == {"cuda"} and "forward" not in set(records["name"])
    fwd = kernel_table(prof, "forward").set_index("name")
    assert fwd.loc["sm90_xmma_gemm_tn", "total_ms"] == pytest.approx(0.040)
    assert fwd.loc["sm90_xmma_gemm_tn", "percent"] == pytest.approx(80.0)
    bwd = kernel_table(prof, "backward")
    assert list(bwd["name"]) == ["sm90_xmma_gemm_tn"] and bwd["total_ms"].iloc[0] == pytest.approx(0.080)
    whole = kernel_table(prof)
    assert whole["total_ms"].sum() == pytest.approx(0.180)
    assert set(range_names(prof)) == {"forward", "backward", "optimizer"}
    adamw = records.set_index("name").loc["adamw_kernel"]
    assert adamw["op"] == "optimizer" and adamw["duration_us"] == 50.0


class _CudaProfWithDeviceRecords(_CudaProf):
    """As above, plus the GPU's own activity records: the GEMM's record appears once although two operators
    claim it, and a Triton kernel launched through the driver API is linked to no operator at all."""

    def events(self):
        cpu = super().events()
        cpu.append(_Event("aten::mm", 12, 14, kernels=[_Kernel("sm90_xmma_gemm_tn", 40.0)]))  # a duplicate link

        def gpu(name, start, us, annotation=False):
            return _Event(name, start, start + us, annotation=annotation, device_type="DeviceType.CUDA")

        return cpu + [gpu("forward", 500, 95.0, annotation=True), gpu("sm90_xmma_gemm_tn", 500, 40.0),
                      gpu("vectorized_elementwise_kernel", 540, 10.0), gpu("sm90_xmma_gemm_tn", 600, 80.0),
                      gpu("adamw_kernel", 700, 50.0), gpu("triton_adamw_flat_kernel", 760, 30.0)]


def test_cuda_kernel_records_agree_with_the_gpus_own_records():
    records = kernel_records(_CudaProfWithDeviceRecords())
    assert sorted(records["name"]) == sorted(["sm90_xmma_gemm_tn", "vectorized_elementwise_kernel",
                                              "sm90_xmma_gemm_tn", "adamw_kernel", "triton_adamw_flat_kernel"])
    assert records["duration_us"].sum() == pytest.approx(40 + 10 + 80 + 50 + 30)  # each kernel once
    unlinked = records[records["launch_us"].isna()]
    assert list(unlinked["name"]) == ["triton_adamw_flat_kernel"]
    from cs336_systems.profiling.step_split import step_time_split

    split = step_time_split(records, [(210.0, 260.0)], steps=1, step_ms=1.0).set_index("bucket")["ms_per_step"]
    assert split["optimizer"] == pytest.approx(0.080)  # by launch range and, unlinked, by name
    assert split["matmul"] == pytest.approx(0.120)


def test_step_time_split_buckets_kernels_and_leaves_the_rest_to_the_host() -> None:
    from cs336_systems.profiling.step_split import bucket, step_time_split

    assert bucket("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    assert bucket("flash_backward_dkdv_kernel") == "attention" and bucket("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert bucket("triton_poi_fused_mul_silu_0") == "norms & elementwise"
    records = pd.DataFrame({
        "name": ["ampere_sgemm_128x64_tn", "flash_forward_kernel", "vectorized_elementwise_kernel", "adamw_kernel",
                 "ampere_sgemm_128x64_tn"],
        "duration_us": [4000.0, 2000.0, 1000.0, 3000.0, 4000.0],
        "launch_us": [10.0, 20.0, 30.0, 105.0, 110.0],
    })
    table = step_time_split(records, [(100.0, 200.0)], steps=2, step_ms=10.0).set_index("bucket")["ms_per_step"]
    # the second GEMM was launched inside the optimizer range: it is optimizer time
    assert table.to_dict() == {"matmul": 2.0, "attention": 1.0, "norms & elementwise": 0.5, "optimizer": 3.5,
                               "host / idle": 3.0}
    with pytest.raises(ValueError, match="need steps >= 1"):
        step_time_split(records, [], steps=0, step_ms=1.0)


def _kernel(name: str, ts: float, dur: float, corr: int, stream: int = 7) -> list[dict]:
    """A GPU kernel and the runtime call that launched it (at host time ``corr``, for simplicity)."""
    return [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr,
                                                                                     "stream": stream}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": float(corr), "dur": 1.0,
             "args": {"correlation": corr}}]


def test_overlapped_split_counts_communication_only_where_it_ran_alone() -> None:
    """A hand-made trace (µs): a GEMM 0–10, flash 10–15, an elementwise kernel 15–16, a GEMM launched inside a
    ``recompute`` range 16–20, an NCCL kernel 18–26 on its own stream (2 µs beside compute, 6 exposed), the Adam
    kernel 26–28, nothing 28–30, a GEMM 30–32: one step."""
    from cs336_systems.profiling.step_split import OVERLAP_BUCKETS, overlapped_time_split, plot_time_split

    events = [*_kernel("sm90_xmma_gemm_bf16", 0, 10, 1), *_kernel("flash_fwd_kernel", 10, 5, 2),
              *_kernel("vectorized_elementwise_kernel", 15, 1, 3), *_kernel("nvjet_gemm", 16, 4, 25),
              *_kernel("ncclDevKernel_ReduceScatter", 18, 8, 26, stream=9),
              *_kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 26, 2, 27),
              *_kernel("cutlass_gemm", 30, 2, 28),
              {"ph": "X", "cat": "user_annotation", "name": "recompute", "ts": 24.0, "dur": 1.5}]
    split = overlapped_time_split({"traceEvents": events}, steps=1).set_index("bucket")
    assert list(split.index) == list(OVERLAP_BUCKETS)
    want = {"matmul": 12, "attention": 5, "norms & elementwise": 1, "recomputation": 4, "optimizer": 2,
            "communication (exposed)": 6, "idle": 2}
    assert split["ms_per_step"].to_dict() == pytest.approx({k: v / 1e3 for k, v in want.items()})
    assert split["share"].sum() == pytest.approx(1.0) and split.attrs["window_ms"] == pytest.approx(0.032)
    halves = overlapped_time_split({"traceEvents": events}, steps=2).set_index("bucket")
    assert halves.loc["matmul", "ms_per_step"] == pytest.approx(0.006)  # per step
    fig = plot_time_split({"ours": split.reset_index(), "reference": halves.reset_index()})
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["ours", "reference"]
    with pytest.raises(ValueError, match="the trace has no GPU kernels"):
        overlapped_time_split({"traceEvents": []}, steps=1)
    with pytest.raises(ValueError, match="need steps >= 1"):
        overlapped_time_split({"traceEvents": events}, steps=0)


def test_origin_label_shows_the_allocating_line_and_leaves_other_origins_alone() -> None:
    import inspect

    import cs336_basics.model
    from cs336_systems.profiling.memory import origin_label

    lines, start = inspect.getsourcelines(cs336_basics.model.scaled_dot_product_attention)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("scores ="))
    label = origin_label(f"model.py:{start + at} scaled_dot_product_attention", width=200)
    assert label == f"{' '.join(lines[at].split())} (scaled_dot_product_attention)"
    assert origin_label(f"model.py:{start + at} scaled_dot_product_attention", width=12).endswith(
        "… (scaled_dot_product_attention)")
    for origin in ("(no user frame)", "elsewhere.py:3 f", "model.py:999999 forward", "not an origin"):
        assert origin_label(origin) == origin
