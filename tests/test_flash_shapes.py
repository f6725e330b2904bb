"""The flash section's shapes benchmark: ratios, summary and a CPU smoke run of the part."""

from __future__ import annotations

import json
from pathlib import Path
import math

import numpy as np
import pandas as pd
import pytest

from cs336_systems.benchmarking.flash import shapes as flash_shapes
from cs336_systems.benchmarking.flash import sweep as flash_sweep
from cs336_systems.experiments import flash_benchmarking as fb
from cs336_systems.benchmarking.sweep import SKIPPED
from cs336_systems.experiments.__main__ import main


def _long() -> pd.DataFrame:
    rows = []
    times = {("triton", 1024): 2.0, ("sdpa_flash", 1024): 3.0, ("sdpa_cudnn", 1024): 1.0,
             ("triton", 4096): 4.0, ("sdpa_flash", 4096): 6.0, ("sdpa_cudnn", 4096): 4.4}
    for (impl, seq), ms in times.items():
        rows.append({"impl": impl, "dtype": "bfloat16", "batch": 1, "heads": 8, "seq_len": seq, "head_dim": 64,
                     "causal": True, "pass": "forward+backward", "status": "ok", "mean_ms": ms, "median_ms": ms})
    rows.append({**rows[-1], "impl": "sdpa_cudnn", "seq_len": 8192, "status": "OOM", "median_ms": math.nan})
    return pd.DataFrame(rows)


def test_ratios_are_baseline_time_over_ours() -> None:
    ratio = flash_shapes.shapes_ratio(_long())
    r = ratio.set_index("seq_len")
    assert r.loc[1024, "vs_sdpa_cudnn"] == 0.5 and r.loc[1024, "vs_sdpa_flash"] == 1.5
    assert r.loc[4096, "vs_sdpa_cudnn"] == pytest.approx(1.1) and r.loc[1024, "vs_best"] == 0.5
    assert 8192 not in r.index  # a cell that did not run has no ratio
    summary = flash_shapes.shapes_summary(ratio)
    fb_ = summary["forward+backward"]
    assert fb_["cells"] == 2 and fb_["min"] == 0.5 and fb_["below_0.9"] == 1 and fb_["below_1.0"] == 1
    assert fb_["geomean"] == pytest.approx(np.sqrt(0.5 * 1.1)) and fb_["worst"] == "bfloat16 1x8x1024x64 causal"
    fig = flash_shapes.plot_shapes(ratio)
    assert len(fig.axes) >= 1


def test_bad_shape_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"a shape is \[batch, heads, seq_len\] of positive sizes, got \[1, 0, 8\]"):
        flash_shapes.run_shapes([[1, 0, 8]], [16], ["float32"], [True], ["sdpa_math"])


def test_rounds_alternate_the_implementations_and_take_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round times every implementation on the same inputs, the order rotating; a time is the median of
    the rounds' medians and the spread their (max - min) / median."""
    order: list[str] = []
    medians = {"flash_pytorch": iter([1.0, 3.0, 2.0]), "sdpa_math": iter([4.0, 4.0, 4.0])}
    names = {id(flash_sweep.IMPLEMENTATIONS[name]): name for name in medians}

    def fake(fn, q, k, v, do, *, is_causal, passes, warmup_ms, rep_ms):
        name = names[id(fn)]
        order.append(name)
        ms = next(medians[name])
        return {f"{p}_{key}": value for p in passes
                for key, value in (("ms", ms + 0.5), ("median_ms", ms), ("status", "ok"))}

    monkeypatch.setattr(flash_shapes, "time_attention_passes", fake)
    long = flash_shapes.run_shapes([[1, 1, 8]], [16], ["float32"], [True], ["flash_pytorch", "sdpa_math"], rounds=3,
                         device="cpu")
    assert order == ["flash_pytorch", "sdpa_math", "sdpa_math", "flash_pytorch", "flash_pytorch", "sdpa_math"]
    ours = long[(long["impl"] == "flash_pytorch") & (long["pass"] == "forward")].iloc[0]
    assert ours["median_ms"] == 2.0 and ours["mean_ms"] == 2.5 and ours["spread"] == 1.0 and ours["rounds"] == 3
    ratio = flash_shapes.shapes_ratio(long, ours="flash_pytorch")
    assert (ratio["vs_sdpa_math"] == 2.0).all() and (ratio["spread_sdpa_math"] == 0.0).all()
    summary = flash_shapes.shapes_summary(ratio, "sdpa_math")
    assert summary["rounds"] == 3 and summary["forward"]["spread_median"] == 0.5
    with pytest.raises(ValueError, match="shapes: rounds must be at least 1, got 0"):
        flash_shapes.run_shapes([[1, 1, 8]], [16], ["float32"], [True], ["sdpa_math"], rounds=0)


def test_a_pass_that_fails_in_any_round_takes_its_status() -> None:
    ok = {"forward_status": "ok", "forward_ms": 1.0, "forward_median_ms": 1.0,
          "forward+backward_status": "ok", "forward+backward_ms": 2.0, "forward+backward_median_ms": 2.0}
    merged = flash_shapes._merge_rounds([ok, {**ok, "forward+backward_status": "OOM"}])
    assert merged["forward_status"] == "ok" and merged["forward_median_ms"] == 1.0
    assert merged["forward+backward_status"] == "OOM" and math.isnan(merged["forward+backward_median_ms"])


@pytest.mark.slow
def test_shapes_part_smoke_run(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=shapes"]) == 0
    out = capsys.readouterr().out
    assert "(shapes) Beyond the handout" in out and "geometric mean" in out
    long = pd.read_csv(tmp_path / "flash_benchmarking" / "shapes.csv")
    assert set(long["impl"]) == {"flash_pytorch", "sdpa_math"} and set(long["pass"]) == {"forward", "forward+backward"}
    assert len(long) == 2 * 2 * 2 * 2  # shapes × causal × impls × passes
    summary = json.loads((tmp_path / "flash_benchmarking" / "shapes_summary.json").read_text())
    assert summary["baseline"] == "sdpa_math" and summary["forward"]["cells"] == 4
    # The grid is split over GPU jobs by dtype: a later job of this code keeps the earlier job's cells, a cell
    # measured again replaces its rows, and other settings start the table over.
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=shapes", "--set", "shapes.dtypes=float64"]) == 0
    both = pd.read_csv(tmp_path / "flash_benchmarking" / "shapes.csv")
    assert len(both) == 2 * len(long) and list(both["dtype"].unique()) == ["float32", "float64"]
    pd.testing.assert_frame_equal(both[both["dtype"] == "float32"].reset_index(drop=True), long)
    summary = json.loads((tmp_path / "flash_benchmarking" / "shapes_summary.json").read_text())
    assert summary["forward"]["cells"] == 8
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=shapes", "--set", "shapes.dtypes=float64"]) == 0
    again = pd.read_csv(tmp_path / "flash_benchmarking" / "shapes.csv")
    assert len(again) == len(both) and list(again["dtype"].unique()) == ["float32", "float64"]
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=shapes", "--set", "shapes.causal=True"]) == 0
    other = pd.read_csv(tmp_path / "flash_benchmarking" / "shapes.csv")
    assert set(other["dtype"]) == {"float32"} and set(other["causal"]) == {True}
    capsys.readouterr()


def test_sweep_is_derived_from_whichever_dtype_tables_exist() -> None:
    def long(dtype: str) -> pd.DataFrame:
        return pd.DataFrame([{"impl": impl, "dtype": dtype, "head_dim": 64, "seq_len": 1024, "pass": "forward",
                              "status": "ok", "mean_ms": ms, "median_ms": ms}
                             for impl, ms in (("triton", 1.0), ("sdpa_flash", 2.0), ("naive", 4.0))])

    both = fb.derive({"sweep_bfloat16": long("bfloat16"), "sweep_float32": long("float32")}, {})
    table = both.table("sweep_speedup")
    assert sorted(table["dtype"]) == ["bfloat16", "float32"] and (table["speedup_vs_builtin"] == 2.0).all()
    assert both.tables["sweep_speedup"][1] == "sweep_bfloat16" and set(both.figures) == {"sweep_speedup", "sweep_latency_d64"}
    only_fp32 = fb.derive({"sweep_float32": long("float32")}, {})
    assert list(only_fp32.table("sweep_speedup")["dtype"]) == ["float32"]
    assert only_fp32.tables["sweep_speedup"][1] == "sweep_float32"  # provenance from the table that exists
    with pytest.raises(ValueError, match="no sweep table"):
        fb.derive({}, {})


def test_sdpa_is_pinned_once_around_a_timed_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned SDPA implementation enters ``sdpa_kernel`` on each call made on its own, and once for a whole
    block of calls under :func:`pinned`, as the timing loops run it, with the same outputs."""
    import torch
    from torch.nn.attention import SDPBackend

    entered = []
    real = flash_sweep.sdpa_kernel

    def counting(backend: SDPBackend):  # type: ignore[no-untyped-def]
        entered.append(backend)
        return real(backend)

    monkeypatch.setattr(flash_sweep, "sdpa_kernel", counting)
    fn = flash_sweep.PinnedSDPA(SDPBackend.MATH)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    alone = [fn(q, k, v, True) for _ in range(3)]
    assert entered == [SDPBackend.MATH] * 3
    with flash_sweep.pinned(fn):
        inside = [fn(q, k, v, True) for _ in range(3)]
    assert entered == [SDPBackend.MATH] * 4
    assert all(torch.equal(a, b) for a, b in zip(alone, inside))
    assert fn.__name__ == "sdpa_math"
    with flash_sweep.pinned(flash_sweep.IMPLEMENTATIONS["naive"]):  # nothing to pin
        pass
    assert len(entered) == 4


def test_a_cell_a_later_job_did_not_measure_keeps_the_earlier_measurement() -> None:
    """A re-run that runs out of its time budget must not wipe a cell an earlier job measured; a cell it
    measures again replaces the earlier rows."""
    cell = {"dtype": "bfloat16", "batch": 1, "heads": 8, "head_dim": 64, "causal": True, "pass": "forward",
            "impl": "triton"}
    earlier = pd.DataFrame([{**cell, "seq_len": 256, "status": "ok", "median_ms": 1.0},
                            {**cell, "seq_len": 512, "status": "ok", "median_ms": 2.0}])
    rows = pd.DataFrame([{**cell, "seq_len": 256, "status": "ok", "median_ms": 1.5},
                         {**cell, "seq_len": 512, "status": SKIPPED, "median_ms": math.nan},
                         {**cell, "seq_len": 1024, "status": SKIPPED, "median_ms": math.nan}])
    merged = flash_shapes.merge_shape_rows(rows, earlier).set_index("seq_len")
    assert merged.loc[256, "median_ms"] == 1.5 and merged.loc[512, "median_ms"] == 2.0
    assert merged.loc[1024, "status"] == SKIPPED and len(merged) == 3
    assert flash_shapes.merge_shape_rows(rows, None) is rows


def test_two_jobs_grids_combine_after_the_fact(tmp_path, monkeypatch, capsys) -> None:
    """Two jobs of the split grid on machines that did not pass the folder on: ``writeup combine`` adds the other
    job's grid to this folder's as the later job would have, keeping both jobs' calibrations and refusing grids
    of other devices, settings or code."""
    from cs336_systems import measured_code
    from cs336_systems.writeup.__main__ import main as writeup

    def job(root: Path, dtype: str, date: str, start: float) -> Path:
        monkeypatch.setenv("CS336_FIGURES_DIR", str(root))
        assert main(["flash_benchmarking", "--smoke", "--set", "parts=shapes", "--set", f"shapes.dtypes={dtype}"]) == 0
        folder = root / "flash_benchmarking"
        for meta_path in folder.glob("shapes*.meta.json"):  # as a GPU job records it
            meta = json.loads(meta_path.read_text())
            meta.update(smoke=False, device="NVIDIA H200", date=date,
                        calibration={"method": "sustained", "start": [{"bf16_tflops": start}]})
            meta_path.write_text(json.dumps(meta))
        return folder

    mine = job(tmp_path / "a", "float32", "2026-12-03T13:00:00", 660.0)
    theirs = job(tmp_path / "b", "float64", "2026-12-03T13:10:00", 670.0)
    before = pd.read_csv(theirs / "shapes.csv")
    stale = set()
    real = measured_code.freshness
    monkeypatch.setattr(measured_code, "freshness", lambda meta, depends, repo=measured_code.REPO_ROOT: (
        measured_code.Freshness("stale", "abc", ("x.py",), "measured at abc; changed since: x.py")
        if meta.get("date") in stale else measured_code.Freshness("fresh", "abc", (), "fresh")))
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path / "a"))
    capsys.readouterr()
    assert writeup(["combine", "flash_benchmarking", str(theirs)]) == 0
    both = pd.read_csv(mine / "shapes.csv")
    assert list(both["dtype"].unique()) == ["float32", "float64"] and len(both) == 2 * len(before)
    pd.testing.assert_frame_equal(both[both["dtype"] == "float64"].reset_index(drop=True), before)
    summary = json.loads((mine / "shapes_summary.json").read_text())
    assert summary["forward"]["cells"] == 8 and summary["baseline"] == "sdpa_math"
    meta = json.loads((mine / "shapes.meta.json").read_text())
    assert meta["date"] == "2026-12-03T13:10:00"  # the later job's record ...
    assert meta["calibration"]["start"] == [{"bf16_tflops": 670.0}]
    assert meta["calibration"]["merged"] == [{"method": "sustained", "start": [{"bf16_tflops": 660.0}]}]  # ... and the earlier's
    assert "rendered" in meta and not meta["smoke"]
    assert pd.read_csv(theirs / "shapes.csv").equals(before)  # the other folder is only read

    def refused(match: str) -> None:
        with pytest.raises(SystemExit):
            writeup(["combine", "flash_benchmarking", str(theirs)])
        assert match in capsys.readouterr().err

    stale.add("2026-12-03T13:10:00")
    refused("combine fresh grids only")
    stale.clear()
    with pytest.raises(SystemExit):
        writeup(["combine", "flash_benchmarking", str(mine)])
    assert "is the committed folder itself" in capsys.readouterr().err
    undated = json.loads((theirs / "shapes.meta.json").read_text())
    (theirs / "shapes.meta.json").write_text(json.dumps({**undated, "date": None}))
    refused("records no date")
    (theirs / "shapes.meta.json").write_text(json.dumps(undated))
    assert writeup(["combine", "flash_benchmarking", str(theirs)]) == 0  # the same job again: recorded once
    assert json.loads((mine / "shapes.meta.json").read_text())["calibration"]["merged"] == meta["calibration"]["merged"]
    assert len(pd.read_csv(mine / "shapes.csv")) == len(both)
    stale.clear()
    other = json.loads((theirs / "shapes.meta.json").read_text())
    (theirs / "shapes.meta.json").write_text(json.dumps({**other, "device": "NVIDIA H100 80GB HBM3"}))
    refused("the grids ran on")
    (theirs / "shapes.meta.json").write_text(json.dumps({**other, "params": {**other["params"], "rep_ms": 99.0}}))
    refused("settings differ in rep_ms")
    with pytest.raises(SystemExit):
        writeup(["combine", "leaderboard", str(theirs)])
    assert "sections that have: flash_benchmarking" in capsys.readouterr().err
    monkeypatch.setattr(measured_code, "freshness", real)
