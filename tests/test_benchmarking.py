"""CPU tests of the benchmarking library: timing statistics, the model benchmark loop, OOM-tolerant
sweeps, attention memory accounting, mixed-precision experiments and the CLI."""

from __future__ import annotations

import json
import math
import statistics

import pandas as pd
import pytest
import torch

from cs336_systems.benchmarking import (
    BenchmarkSpec,
    ModelBenchmark,
    TimingStats,
    autocast_context,
    benchmark_attention,
    benchmark_model,
    do_bench,
    grid,
    is_oom,
    naive_attention_memory,
    run_sweep,
    saved_tensor_bytes,
    status_grid,
    time_calls,
)
from cs336_systems.benchmarking.__main__ import build_parser, main, spec_from_args
from cs336_systems.benchmarking.attention import attention_callable
from cs336_systems.checks.toy_models import ToyModel
from cs336_systems.configs import residual_stream_bytes
from cs336_systems.experiments.memory_profiling import residual_stream_check
from cs336_systems.experiments.mixed_precision import accumulation_experiments, autocast_dtypes

# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def test_timing_stats_match_statistics_module():
    samples = [0.010, 0.012, 0.011, 0.020]
    st = TimingStats.from_seconds(samples)
    assert st.n == 4
    assert st.mean == pytest.approx(statistics.fmean(samples))
    assert st.std == pytest.approx(statistics.stdev(samples))
    assert (st.min, st.max) == (0.010, 0.020)
    summary = st.summary("forward_", unit="ms")
    assert summary["forward_mean_ms"] == pytest.approx(1e3 * statistics.fmean(samples))
    assert set(summary) == {"forward_mean_ms", "forward_std_ms", "forward_min_ms", "forward_max_ms"}
    assert TimingStats.from_milliseconds([5.0]).std == 0.0
    assert math.isnan(TimingStats().mean)
    with pytest.raises(ValueError, match="unit"):
        st.summary(unit="hours")


def test_time_calls_runs_warmup_then_timed_steps():
    calls = []
    ticks = iter(range(100))
    st = time_calls(lambda: calls.append(1), warmup=3, steps=4, timer=lambda: float(next(ticks)))
    assert len(calls) == 7
    assert st.n == 4 and st.times_s == (1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        time_calls(lambda: None, warmup=0, steps=0)


def test_do_bench_falls_back_to_wall_clock_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("fallback path is CPU-only")
    st = do_bench(lambda: torch.ones(4).sum())
    assert st.n == 10 and st.min >= 0


# --------------------------------------------------------------------------------------------------
# end-to-end model benchmark
# --------------------------------------------------------------------------------------------------


def tiny_spec(**kw) -> BenchmarkSpec:
    return BenchmarkSpec("tiny", context_length=16, batch_size=2, warmup=1, steps=2, device="cpu", **kw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,phases",
    [
        ("inference", {"forward", "total"}),
        ("forward", {"forward", "total"}),
        ("forward_backward", {"forward", "backward", "total"}),
        ("train", {"forward", "backward", "optimizer", "total"}),
    ],
)
def test_model_benchmark_phases(mode, phases):
    bench = ModelBenchmark(tiny_spec(mode=mode))
    stats = bench.run()
    assert set(stats) == phases
    assert all(s.n == 2 and s.min > 0 for s in stats.values())
    assert stats["total"].mean >= stats["forward"].mean


def test_train_step_updates_parameters_and_clears_grads():
    bench = ModelBenchmark(tiny_spec(mode="train"))
    before = bench.model.lm_head.weight.detach().clone()
    bench.step()
    assert not torch.equal(before, bench.model.lm_head.weight)
    assert all(p.grad is None for p in bench.model.parameters())


def test_benchmark_model_row_and_bf16_autocast():
    row = benchmark_model(tiny_spec(mode="forward_backward", precision="bf16"))
    for key in ("forward_mean_ms", "forward_std_ms", "backward_max_ms", "total_min_ms", "tokens_per_s", "TFLOP_per_s"):
        assert key in row and row[key] > 0
    assert isinstance(autocast_context("fp32", "cpu"), type(autocast_context("fp32", "cpu")))
    with autocast_context("bf16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_explicit_hyperparameters_and_validation():
    from cs336_systems.configs import get_config

    cfg = get_config("tiny").replace(name="custom", d_model=32, num_heads=2)
    bench = ModelBenchmark(BenchmarkSpec(cfg, mode="inference", context_length=8, batch_size=1, device="cpu"))
    assert bench.model.d_model == 32 and bench.inputs.shape == (1, 8)
    with pytest.raises(ValueError, match="mode"):
        BenchmarkSpec("tiny", mode="sideways")
    with pytest.raises(ValueError, match="precision"):
        BenchmarkSpec("tiny", precision="fp8")
    with pytest.raises(ValueError, match="attention"):
        BenchmarkSpec("tiny", attention_impl="nope")
    with pytest.raises(ValueError, match="context_length"):
        BenchmarkSpec("tiny", context_length=-1)
    with pytest.raises(ValueError, match="unknown model preset"):
        BenchmarkSpec("gigantic").config
    with pytest.raises(ValueError, match="unit|warmup"):
        BenchmarkSpec("tiny", steps=0)


# --------------------------------------------------------------------------------------------------
# sweeps
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sweep_records_oom_and_continues():
    def fake_step(size: str, context_length: int) -> dict:
        if size == "big" and context_length >= 1024:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"time_ms": float(context_length)}

    seen: list[list[str]] = []
    df = run_sweep(fake_step, grid(size=["small", "big"], context_length=[128, 1024]), progress=False,
                   on_row=lambda rows: seen.append(list(rows["status"])))
    assert list(df["status"]) == ["ok", "ok", "ok", "OOM"]
    assert seen == [["ok"], ["ok", "ok"], ["ok", "ok", "ok"], ["ok", "ok", "ok", "OOM"]]  # the table as it grows
    assert math.isnan(df["time_ms"].iloc[3]) and df["time_ms"].iloc[2] == 128.0
    table = status_grid(df, "time_ms", "size", "context_length", "{:.0f}")
    assert list(table.index) == ["small", "big"]  # sweep order, not sorted
    assert table.loc["big", 1024] == "OOM" and table.loc["big", 128] == "128"


def test_sweep_frees_what_an_out_of_memory_step_left_before_the_next_runs():
    """A step that runs out of memory leaves its objects in its traceback's frames, often in reference cycles
    that only the collector frees; the sweep must collect after the except block has dropped the traceback,
    so the next configuration does not start with the failed one's tensors still allocated."""
    import gc
    import sys
    import weakref

    class Held:  # stands in for the failed step's model, optimizer state and activations
        pass

    refs: list[weakref.ref] = []

    def step(i: int) -> dict:
        if i == 0:
            held = Held()
            refs.append(weakref.ref(held))
            cycle = [held]
            cycle.append(sys._getframe())  # frame -> its locals -> cycle -> frame: only the collector frees it
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 38.00 GiB")
        return {"failed_step_freed": refs[0]() is None}

    enabled = gc.isenabled()
    gc.disable()  # deterministic: nothing but the sweep's own collection may free the cycle
    try:
        df = run_sweep(step, grid(i=[0, 1]), progress=False)
    finally:
        if enabled:
            gc.enable()
    assert list(df["status"]) == ["OOM", "ok"]
    assert bool(df["failed_step_freed"].iloc[1])


def test_sweep_propagates_real_errors_and_honours_budget():
    def broken(x: int) -> dict:
        raise ValueError("a bug, not a result")

    with pytest.raises(ValueError, match="a bug"):
        run_sweep(broken, grid(x=[1]), progress=False)
    df = run_sweep(lambda x: {"y": x}, grid(x=[1, 2]), budget_s=-1.0, progress=False)
    assert (df["status"] == "skipped (time budget)").all()
    with pytest.raises(ValueError, match="no values"):
        grid(x=[])


def test_is_oom_sees_wrapped_and_plain_errors():
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        except torch.cuda.OutOfMemoryError as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch"))


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_attention_memory_prediction_matches_what_autograd_saves(causal):
    b, s, d = 2, 48, 8
    q, k, v = (torch.randn(b, 1, s, d, requires_grad=True) for _ in range(3))
    measured = saved_tensor_bytes(attention_callable("naive", is_causal=causal), q, k, v)
    predicted = naive_attention_memory(b, s, d, is_causal=causal)
    assert measured["saved_total"] == predicted["total"] - predicted["output"]
    assert measured["output"] == predicted["output"]
    # the quadratic terms dominate and do not depend on d
    big = naive_attention_memory(8, 16384, 16)
    assert big["probabilities"] == 8 * 16384**2 * 4 == naive_attention_memory(8, 16384, 128)["probabilities"]
    assert naive_attention_memory(1, 4, 2, grad_output=True)["grad_output"] == 32


def test_attention_step_memory_needs_a_gpu_and_positive_sizes():
    from cs336_systems.benchmarking.attention import attention_step_memory

    with pytest.raises(ValueError, match="reads the CUDA caching allocator; got device cpu"):
        attention_step_memory(16, 64, device="cpu")


@pytest.mark.gpu
def test_attention_step_memory_reads_the_backward_peak_and_reports_oom_as_a_row():
    from cs336_systems.benchmarking.attention import attention_step_memory

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    row = attention_step_memory(16, 2048, batch_size=4)
    predicted = naive_attention_memory(4, 2048, 16, grad_output=True)["total"] / 2**20
    assert row["status"] == "ok" and row["oom_in"] is None
    assert row["memory_before_backward_MiB"] >= predicted  # what the formula counts, and the allocator's rounding
    assert row["peak_MiB"] > row["memory_before_backward_MiB"]  # the backward's gradients of the T x T tensors
    too_big = attention_step_memory(16, 2**20, batch_size=64)  # 64 · 2^40 fp32 scores: petabytes
    assert too_big["status"] == "OOM" and too_big["oom_in"] == "forward"
    assert torch.cuda.memory_allocated() < 2**30  # nothing of the failed step is left behind


def test_benchmark_attention_row():
    row = benchmark_attention(8, 16, batch_size=2, n_forward=2, n_backward=2, warmup=1, device="cpu")
    assert row["forward_mean_ms"] > 0 and row["backward_mean_ms"] > 0
    assert math.isnan(row["memory_before_backward_MiB"])  # CUDA-only measurement
    with pytest.raises(ValueError):
        benchmark_attention(0, 16)


# --------------------------------------------------------------------------------------------------
# mixed precision and activation sizes
# --------------------------------------------------------------------------------------------------


def test_accumulation_loops():
    df = accumulation_experiments().set_index("loop")
    assert df.loc["fp32 += fp32", "abs_error"] < 1e-3
    assert df.loc["fp16 += fp16", "abs_error"] > 10 * df.loc["fp32 += fp16", "abs_error"]
    assert df.loc["fp32 += fp16", "result"] == df.loc["fp32 += fp16.to(fp32)", "result"]
    assert df.loc["fp32 += fp16", "abs_error"] > df.loc["fp32 += fp32", "abs_error"]


def test_toy_model_dtypes_under_autocast():
    assert [type(m).__name__ for m in ToyModel(4, 2).children()] == ["Linear", "LayerNorm", "Linear", "ReLU"]
    table, info = autocast_dtypes(torch.float16, device="cpu")
    dt = dict(zip(table["quantity"], table["dtype"], strict=True))
    low = info["autocast_dtype"].removeprefix("torch.")
    assert low in ("float16", "bfloat16")
    assert dt["parameter fc1.weight"] == "float32" and dt["gradient fc2.weight"] == "float32"
    assert dt["fc1 output"] == low and dt["logits"] == low
    assert dt["loss"] == "float32"


def test_residual_stream_derivation_matches_measured_tensor():
    check = residual_stream_check("tiny", batch_size=3, context_length=8, device=torch.device("cpu"))
    assert check["shape"] == [3, 8, 64]
    assert check["measured_bytes"] == check["predicted_bytes"] == residual_stream_bytes("tiny", 3, 8, "fp32")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_parsing_and_overrides():
    parser = build_parser()
    args = parser.parse_args(["model", "--preset", "tiny", "--d-model", "32", "--num-heads", "2", "-w", "0", "-n", "1",
                              "--mode", "train", "--precision", "bf16", "--context-length", "8"])
    spec = spec_from_args(args)
    assert spec.config.d_model == 32 and spec.config.name == "custom" and spec.mode == "train"
    assert spec.warmup == 0 and spec.precision == "bf16" and spec.config.context_length == 8
    assert parser.parse_args(["model", "--size", "tiny"]).size == "tiny"  # the course's spelling, same option
    assert parser.parse_args(["sweep", "--presets", "tiny,small"]).sizes == ["tiny", "small"]
    with pytest.raises(SystemExit):
        parser.parse_args(["model", "--mode", "sideways"])
    with pytest.raises(SystemExit):
        parser.parse_args(["benchmarking"])  # sections run through python -m cs336_systems.experiments


def test_cli_model_run_prints_json(capsys):
    main(["model", "--size", "tiny", "--mode", "forward", "-w", "0", "-n", "1", "--context-length", "8", "--json"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["size"] == "tiny" and row["mode"] == "forward" and row["forward_mean_ms"] > 0


def test_cli_model_profile_counts_kernels_per_phase(capsys):
    main(["model", "--size", "tiny", "--mode", "forward_backward", "-w", "0", "-n", "1", "--context-length", "8",
          "--profile", "--json"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Backward replays every forward operation's derivative, so it launches more than forward does.
    assert row["backward_kernels"] > row["forward_kernels"] > 0
    assert row["forward_kernel_ms"] > 0 and row["optimizer_kernels"] == 0
    assert len(row["model_source"]) == 12


@pytest.mark.slow
def test_cli_sweep_profile_adds_kernel_columns(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    main(["sweep", "--size", "tiny", "--modes", "forward,forward_backward", "--context-lengths", "8", "-w", "0",
          "-n", "1", "--profile", "--name", "kernels"])
    df = pd.read_csv(tmp_path / "cli_sweep" / "kernels.csv").set_index("mode")
    assert df.loc["forward", "backward_kernels"] == 0 < df.loc["forward_backward", "backward_kernels"]
    assert df["forward_kernels"].gt(0).all() and df["model_source"].nunique() == 1


def test_cli_sweep_writes_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    main(["sweep", "--size", "tiny", "--modes", "inference,forward", "--context-lengths", "8", "-w", "0", "-n", "1"])
    df = pd.read_csv(tmp_path / "cli_sweep" / "sweep.csv")
    assert list(df["mode"]) == ["inference", "forward"] and (df["status"] == "ok").all()
    assert (tmp_path / "cli_sweep" / "sweep.meta.json").exists()


def test_section_jobs_run_one_part_and_the_study_jobs_add_their_rows(tmp_path, monkeypatch) -> None:
    """§1.1.3's full run is split into GPU jobs: a job of the warm-up study writes no timings, and a second job
    of other sizes adds its rows to the first job's study instead of replacing it."""
    from cs336_systems.experiments.__main__ import main as experiments
    from cs336_systems.experiments.benchmarking import Params

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    study = ["benchmarking", "--smoke", "--set", "parts=warmup_study", "--set", "warmup_study=0"]
    assert experiments([*study, "--set", "warmup_study_sizes=tiny"]) == 0
    folder = tmp_path / "benchmarking"
    assert not (folder / "timings.csv").exists()
    assert experiments([*study, "--set", "warmup_study_sizes=small"]) == 0
    rows = pd.read_csv(folder / "warmup_study.csv")
    assert list(rows["size"]) == ["tiny", "small"]
    meta = json.loads((folder / "warmup_study.meta.json").read_text())
    assert meta["params"]["warmup_study_sizes"] == ["tiny", "small"]
    with pytest.raises(ValueError, match="unknown part 'timing'"):
        Params(parts=["timing"]).check()


def test_phase_times_times_each_phase_on_both_clocks() -> None:
    """One row per timed step, each phase's host and GPU time (the host's on CPU), in order; a fake clock makes
    the phases' durations exact: 1 ms for ``a``, 2 ms for ``b``, and the step their sum plus the clock's reads."""
    from cs336_systems.benchmarking.timing import phase_times

    now = [0.0]
    calls: list[str] = []

    def timer() -> float:
        return now[0]

    def phase(name: str, ms: float):
        def run() -> None:
            calls.append(name)
            now[0] += ms / 1e3
        return run

    rows = phase_times([("a", phase("a", 1.0)), ("b", phase("b", 2.0))], "cpu", warmup=1, steps=3, timer=timer)
    assert calls == ["a", "b"] * 4  # one untimed step, then three
    assert len(rows) == 3
    for row in rows:
        assert row["a_host_ms"] == pytest.approx(1.0) and row["b_host_ms"] == pytest.approx(2.0)
        assert row["a_gpu_ms"] == row["a_host_ms"] and row["step_ms"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="distinct names"):
        phase_times([("a", phase("a", 1.0)), ("a", phase("a", 1.0))], "cpu")
    with pytest.raises(ValueError, match="steps >= 1"):
        phase_times([("a", phase("a", 1.0))], "cpu", steps=0)


def test_round_summary_gives_medians_and_the_rounds_range() -> None:
    """Per variant: the median over every step of every round, and the lowest and highest round median."""
    from cs336_systems.benchmarking.timing import round_summary

    rows = [{"variant": v, "round": r, "step": i, "ms": base + 10 * r + i, "other": 1.0}
            for v, base in (("a", 100.0), ("b", 200.0)) for r in range(3) for i in range(3)]
    table = round_summary(pd.DataFrame(rows), ["variant"], ["ms"])
    a = table[table["variant"] == "a"].iloc[0]
    assert list(table["variant"]) == ["a", "b"]  # first-seen order
    assert a["ms"] == 111.0 and a["other"] == 1.0  # median of 100..122
    assert (a["ms_round_lo"], a["ms_round_hi"]) == (101.0, 121.0)
    assert "round" not in table.columns and "step" not in table.columns
