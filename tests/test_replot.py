"""Figures drawn from measured tables, and ``python -m cs336_systems.writeup replot`` on committed-style results.

The fixtures are small hand-made tables in the measured tables' schemas, so these tests are fast and do
not depend on what is committed under ``figures/``.
"""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from cs336_systems.writeup import replot  # noqa: E402
from cs336_systems.experiments import fsdp as fsdp_benchmark  # noqa: E402
from cs336_systems.experiments import optimizer_state_sharding as sharding_benchmark  # noqa: E402
from cs336_systems.experiments import pytorch_attention, torch_compile  # noqa: E402
from cs336_systems.plotting import grouped_bars  # noqa: E402

DEVICE = "NVIDIA TestGPU"



def _replot(argv: list[str]) -> int:
    """``python -m cs336_systems.writeup replot ARGV``, in this process."""
    from cs336_systems.writeup.__main__ import main

    return main(["replot", *argv])

def _meta(params: dict) -> dict:
    return {"device": DEVICE, "device_type": "cuda", "num_gpus": 2, "gpu_memory_gib": 80.0, "torch": "2.11.0",
            "git_commit": "0123456789abcdef", "date": "2026-01-01T00:00:00+00:00", "smoke": False, "params": params}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------------------------------ fixtures


def fsdp_table() -> pd.DataFrame:
    rows = []
    for strategy, peak, pred, ms in (("ddp", 40.0, 38.0, 300.0), ("fsdp", 20.0, 21.0, 330.0), ("fsdp2", 21.0, 20.5, 320.0)):
        rows.append({"model": "xl", "dtype": "fp32", "world_size": 2, "strategy": strategy, "predicted_total": pred,
                     "before_step_peak": peak, "after_step_peak": peak - 5, "step_ms": ms, "step_ms_std": 3.0,
                     "status": "ok"})
    rows.append({**rows[0], "model": "2.7B", "status": "OOM", "before_step_peak": math.nan,
                 "after_step_peak": math.nan, "step_ms": math.nan})
    return pd.DataFrame(rows)


FSDP_PARAMS = {"global_batch": 4, "context_length": 512}


def sharding_tables() -> dict[str, pd.DataFrame]:
    memory, breakdown = [], []
    for opt, state in (("adamw", 2.0), ("sharded", 1.0), ("zero", 1.0)):
        for rank in (0, 1):
            memory.append({"optimizer": opt, "rank": rank, "after_init_allocated": 1.0, "after_init_peak": 1.0,
                           "before_step_allocated": 3.0 + state, "before_step_peak": 4.0 + state,
                           "after_step_allocated": 3.0 + state, "after_step_peak": 4.5 + state})
            for comp, gib in (("parameters", 1.0), ("gradients", 1.0), ("optimizer_state", state), ("activations", 2.0)):
                for source in ("measured", "predicted"):
                    breakdown.append({"optimizer": opt, "rank": rank, "component": comp, "source": source, "GiB": gib})
    timing = pd.DataFrame({"optimizer": ["adamw", "sharded", "zero"], "step_ms": [100.0, 102.0, 103.0],
                           "step_ms_std": [1.0, 1.0, 1.0], "world_size": [2, 2, 2],
                           "slowdown_vs_adamw": [1.0, 1.02, 1.03]})
    return {"memory": pd.DataFrame(memory), "memory_breakdown": pd.DataFrame(breakdown), "timing": timing}


SHARDING_PARAMS = {"model": "small", "global_batch": 4, "context_length": 128, "world_size": 2}


def attention_timings() -> pd.DataFrame:
    rows = []
    for d in (16, 32):
        for s in (256, 1024):
            oom = d == 32 and s == 1024
            rows.append({"d_model": d, "seq_len": s, "status": "OOM" if oom else "ok",
                         "forward_mean_ms": math.nan if oom else 0.1 * s / 256 * d / 16,
                         "backward_mean_ms": math.nan if oom else 0.3 * s / 256,
                         "memory_before_backward_MiB": math.nan if oom else 10.0 * s})
    return pd.DataFrame(rows)


def compile_tables() -> dict[str, pd.DataFrame]:
    speed = pd.DataFrame({
        "d_model": [16, 16, 32, 32], "seq_len": [256, 1024, 256, 1024],
        "status_eager": ["ok", "ok", "ok", "ok"], "status_compiled": ["ok", "ok", "ok", "skipped (time budget)"],
        "forward_speedup": [1.5, 3.0, 0.8, math.nan], "backward_speedup": [1.2, 2.5, 1.1, math.nan],
    })
    model = pd.DataFrame({"size": ["small", "small", "medium"], "mode": ["forward", "train", "forward"],
                          "eager_ms": [20.0, 60.0, 50.0], "compiled_ms": [15.0, 50.0, 40.0],
                          "speedup": [20 / 15, 1.2, 1.25]})
    return {"attention_speedup": speed, "model_speedup": model}


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


# ------------------------------------------------------------------------------------------ plots


def test_fsdp_plot_has_memory_and_time_panels_titled_with_the_device() -> None:
    fig = fsdp_benchmark.plot_results(fsdp_table(), _meta(FSDP_PARAMS))
    mem, time = fig.axes
    assert mem.get_ylabel() == "GiB per GPU"
    assert time.get_ylabel().startswith("ms per step")
    assert DEVICE in fig._suptitle.get_text()
    assert [t.get_text() for t in mem.get_legend().get_texts()] == ["predicted", "torch DDP", "our FSDP", "torch FSDP2"]
    assert [t.get_text() for t in mem.get_xticklabels()] == ["xl\n2 GPUs"]  # the OOM configuration has no bars


def test_fsdp_derived_tables() -> None:
    derived = fsdp_benchmark.derive({"fsdp_vs_ddp": fsdp_table()}, _meta(FSDP_PARAMS))
    rel = derived.table("relative_to_ddp").set_index("strategy")
    assert rel.loc["fsdp", "memory_vs_ddp"] == pytest.approx(0.5)
    assert rel.loc["fsdp", "step_time_vs_ddp"] == pytest.approx(1.1)
    cmp = derived.table("predicted_vs_measured").set_index("strategy")
    assert cmp.loc["ddp", "measured / predicted"] == pytest.approx(40 / 38)
    largest = derived.table("largest_model").set_index("strategy")
    assert largest.loc["ddp", "largest_trained"] == "xl"  # 2.7B ran out of memory
    assert set(largest.index) == {"ddp", "fsdp", "fsdp2", "sharded_optimizer"}


def test_sharding_figures() -> None:
    derived = sharding_benchmark.derive(sharding_tables(), _meta(SHARDING_PARAMS))
    assert set(derived.figures) == {"memory_points", "memory_components", "step_time"}
    ax = derived.figure("memory_components").axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["parameters", "gradients", "optimizer state", "activations"]
    assert ax.get_ylabel() == "GiB on rank 0" and DEVICE in ax.get_title()
    assert "predicted (accounting)" in [t.get_text() for t in ax.get_legend().get_texts()]
    step = derived.figure("step_time").axes[0]
    assert step.get_ylabel().startswith("ms per step") and "102.0 ms\n1.020x AdamW" in _texts(step)
    savings = derived.table("savings_vs_adamw").set_index("optimizer")
    assert savings.loc["sharded", "saved_vs_adamw_GiB"] == pytest.approx(1.0)
    assert set(derived.table("zero1_comparison")["strategy"]) == {"ddp", "sharded_optimizer", "zero1"}


def test_sharding_without_allocator_statistics_skips_the_memory_points() -> None:
    tables = sharding_tables()
    cols = [c for c in tables["memory"] if c not in ("optimizer", "rank")]
    tables["memory"][cols] = math.nan
    assert "memory_points" not in sharding_benchmark.derive(tables, _meta(SHARDING_PARAMS)).figures


def test_attention_heatmaps_mark_oom_cells() -> None:
    fig = pytorch_attention.plot_attention_grid(attention_timings(), _meta({"batch_size": 8}))
    heatmaps = [ax for ax in fig.axes if ax.get_xlabel()]
    assert len(heatmaps) == 3
    for ax in heatmaps:
        assert ax.get_xlabel() == "sequence length (tokens)" and ax.get_ylabel() == "d (head dimension)"
        assert "OOM" in _texts(ax)
    assert [t.get_text() for t in heatmaps[0].get_xticklabels()] == ["256", "1024"]
    assert DEVICE in fig._suptitle.get_text() and "batch 8" in fig._suptitle.get_text()


def test_compile_speedup_heatmaps_and_model_bars() -> None:
    t = compile_tables()
    fig = torch_compile.plot_compile_speedup(t["attention_speedup"], t["model_speedup"], _meta({}))
    forward, backward, model = [ax for ax in fig.axes if ax.get_title()]
    assert "3.00x" in _texts(forward) and "skipped" in _texts(forward)
    assert model.get_ylabel() == "speed-up (eager / compiled)"
    assert " not run" in _texts(model)  # medium has no training-step measurement
    without_model = torch_compile.plot_compile_speedup(t["attention_speedup"], pd.DataFrame(), _meta({}))
    assert len([ax for ax in without_model.axes if ax.get_title()]) == 2


def test_grouped_bars_places_markers_on_their_bars() -> None:
    fig, ax = plt.subplots()
    wide = pd.DataFrame({"a": [1.0, 2.0], "b": [3.0, math.nan]}, index=["x", "y"])
    grouped_bars(ax, wide, markers=wide * 1.1)
    lines = ax.collections  # one hlines collection per finite marker
    assert len(lines) == 3
    texts = [t.get_text() for t in ax.texts]
    assert texts.count(" not run") == 1 and "3.0" in texts


# ------------------------------------------------------------------------------------------ replot


def _commit(root, section: str, tables: dict, params: dict) -> None:
    """Lay out ``tables`` as a measuring run would have committed them."""
    folder = root / section
    folder.mkdir(parents=True)
    for name, df in tables.items():
        df.to_csv(folder / f"{name}.csv", index=False)
        meta = {**_meta(params), "section": section, "name": name, "files": [f"{name}.csv"]}
        (folder / f"{name}.meta.json").write_text(json.dumps(meta))


CASES = {
    "fsdp": ({"fsdp_vs_ddp": fsdp_table()}, FSDP_PARAMS, ["memory_and_time"]),
    "optimizer_state_sharding": (sharding_tables(), SHARDING_PARAMS,
                                 ["memory_points", "memory_components", "step_time"]),
    "pytorch_attention": ({"timings": attention_timings()}, {"batch_size": 8}, ["attention_grid"]),
    "torch_compile": (compile_tables(), {}, ["compile_speedup"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(CASES))
def test_replot_writes_figures_with_the_measuring_runs_provenance(section, tmp_path, monkeypatch) -> None:
    tables, params, figures = CASES[section]
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    _commit(tmp_path, section, tables, params)
    before = {p.name: p.read_bytes() for p in (tmp_path / section).iterdir()}
    written = _replot([section])
    assert written == 0
    folder = tmp_path / section
    for name in figures:
        assert (folder / f"{name}.png").stat().st_size > 10_000
        meta = json.loads((folder / f"{name}.meta.json").read_text())
        assert meta["device"] == DEVICE and meta["git_commit"] == "0123456789abcdef" and meta["smoke"] is False
        assert meta["rendered"]["device"] != DEVICE  # drawn here, measured there
        assert meta["files"] == [f"{name}.png"]
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name in before} == before  # inputs untouched


def test_replot_refuses_unknown_sections_and_missing_results(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="unknown section"):
        replot.replot("benchmarking_typo")
    with pytest.raises(FileNotFoundError, match="nothing to replot"):
        replot.replot("fsdp")


def test_derived_names_may_not_overwrite_measured_artefacts(tmp_path, monkeypatch) -> None:
    from cs336_systems.results import ResultWriter

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    fig, _ = plt.subplots()
    clash = replot.Derived(figures={"timing": (fig, "timing")})
    with pytest.raises(ValueError, match="equal measured inputs"):
        replot.write_derived(ResultWriter("optimizer_state_sharding", smoke=False), clash)


@pytest.mark.slow
def test_replot_draws_into_scratch_unless_asked_to_publish(tmp_path, monkeypatch) -> None:
    from cs336_systems import results

    monkeypatch.delenv("CS336_FIGURES_DIR", raising=False)
    monkeypatch.setattr(results, "FIGURES_DIR", tmp_path / "figures")
    monkeypatch.setattr(results, "SCRATCH_DIR", tmp_path / "scratch")
    section = "fsdp"
    tables, params, figures = CASES[section]
    _commit(tmp_path / "figures", section, tables, params)
    committed = {p.name: p.read_bytes() for p in (tmp_path / "figures" / section).iterdir()}

    assert _replot([section]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "figures" / section).iterdir()} == committed
    assert {f"{name}.png" for name in figures} <= {p.name for p in (tmp_path / "scratch" / "figures" / section).iterdir()}

    assert _replot([section, "--publish"]) == 0
    published = {p.name: p.read_bytes() for p in (tmp_path / "figures" / section).iterdir()}
    assert {f"{name}.png" for name in figures} <= set(published)
    assert _replot([section, "--publish"]) == 0  # again, from the same measurements: byte for byte the same
    assert {p.name: p.read_bytes() for p in (tmp_path / "figures" / section).iterdir()} == published


def test_replot_cli_rejects_unknown_sections_in_one_line(capsys) -> None:
    from cs336_systems.cli import EXIT_USAGE, run_main

    assert run_main(lambda: _replot(["benchmarking_typo"]), "python -m cs336_systems.writeup") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no replot for section(s) benchmarking_typo" in err and err.count("\n") == 1


def test_derived_artefacts_record_the_parameters_of_the_job_that_measured_their_input(tmp_path, monkeypatch) -> None:
    """A grid split over jobs derives its figures in the last job; they still describe the measuring job's
    parameters (inside the run), or the measuring run's whole provenance (replotted later)."""
    from cs336_systems.results import ResultWriter

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    ResultWriter("torch_compile", params={"parts": ["model"]}, smoke=False).table(pd.DataFrame({"x": [1]}), "timing")
    last_job = ResultWriter("torch_compile", params={"parts": ["attention"]}, smoke=False)
    derived = replot.Derived(tables={"summary": (pd.DataFrame({"y": [2]}), "timing")})
    replot.write_derived(last_job, derived)
    assert json.loads((tmp_path / "torch_compile/summary.meta.json").read_text())["params"]["parts"] == ["model"]
    replot.write_derived(last_job, replot.Derived(tables={"later": (pd.DataFrame({"y": [3]}), "timing")}),
                         {"timing": _meta({"parts": ["measured"]})})
    meta = json.loads((tmp_path / "torch_compile/later.meta.json").read_text())
    assert meta["params"]["parts"] == ["measured"] and meta["device"] == DEVICE


def test_a_job_that_did_not_remeasure_an_input_leaves_its_plot_with_the_input_s_provenance(tmp_path,
                                                                                           monkeypatch) -> None:
    """A job measuring one part re-derives every artefact; a plot of a table an earlier commit measured
    must keep that commit and date (so the writeup can mark it stale), not take the running job's."""
    from cs336_systems.results import ResultWriter

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("CS336_GIT_COMMIT", "f" * 40)
    _commit(tmp_path, "torch_compile", {"timing": pd.DataFrame({"x": [1]})}, {"parts": ["model"]})
    this_job = ResultWriter("torch_compile", params={"parts": ["attention"]}, smoke=False)
    this_job.table(pd.DataFrame({"x": [2]}), "fresh_timing")
    replot.write_derived(this_job, replot.Derived(tables={"old_plot": (pd.DataFrame({"y": [1]}), "timing"),
                                                          "new_plot": (pd.DataFrame({"y": [2]}), "fresh_timing")}))
    old = json.loads((tmp_path / "torch_compile/old_plot.meta.json").read_text())
    new = json.loads((tmp_path / "torch_compile/new_plot.meta.json").read_text())
    assert (old["git_commit"], old["date"], old["device"]) == ("0123456789abcdef", "2026-01-01T00:00:00+00:00", DEVICE)
    assert old["rendered"]["git_commit"] == "f" * 40 and old["params"]["parts"] == ["model"]
    assert new["git_commit"] == "f" * 40 and "rendered" not in new and new["params"]["parts"] == ["attention"]


def test_a_derived_table_combines_only_inputs_measured_on_the_current_code(tmp_path, monkeypatch) -> None:
    """§1.4 combines one table per preset, each from its own job. When some describe the current code and
    others older code, the combination (which carries one input's provenance) leaves the older ones out;
    when none is current, it combines them all (and the writeup marks the result stale)."""
    from cs336_systems import measured_code

    head = "a" * 40  # the current code: no dependency changed since it
    monkeypatch.setattr(measured_code, "changed_since", lambda commit, depends, repo, results=None, table=None: (
        () if commit == head else ("cs336_systems/attention/flash_fwd.py",)))
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    section = tmp_path / "training_step"
    section.mkdir()

    def measured(preset: str, commit: str) -> None:
        pd.DataFrame({"preset": [preset], "context_length": [1024], "status": ["skipped"]}).to_csv(
            section / f"steps_{preset}.csv", index=False)
        meta = {**_meta({"presets": [preset]}), "git_commit": commit, "section": "training_step",
                "name": f"steps_{preset}", "files": [f"steps_{preset}.csv"]}
        (section / f"steps_{preset}.meta.json").write_text(json.dumps(meta))

    measured("small", head)
    measured("2.7B", "0123456789abcdef")  # older code
    assert _replot(["training_step"]) == 0
    steps = section / "steps.csv"  # CS336_FIGURES_DIR: derived beside the measurements
    assert pd.read_csv(steps)["preset"].tolist() == ["small"]
    assert json.loads(steps.with_suffix(".meta.json").read_text())["git_commit"] == head
    measured("small", "fedcba9876543210")  # now neither is current: both combine
    assert _replot(["training_step"]) == 0
    assert sorted(pd.read_csv(steps)["preset"]) == ["2.7B", "small"]


@pytest.mark.slow
def test_replot_redraws_each_measured_edition_grid_in_its_own_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    tables, params, figures = CASES["optimizer_state_sharding"]
    _commit(tmp_path, "optimizer_state_sharding/2026", tables, {**params, "model": "xl@2026", "edition": "2026"})
    with pytest.raises(FileNotFoundError, match="nothing to replot"):  # the workbook's own grid is not measured
        replot.replot("optimizer_state_sharding")
    replot.replot("optimizer_state_sharding", edition="2026")
    folder = tmp_path / "optimizer_state_sharding" / "2026"
    assert {f"{name}.png" for name in figures} <= {p.name for p in folder.iterdir()}
    assert not (tmp_path / "optimizer_state_sharding" / "step_time.png").exists()
    meta = json.loads((folder / "step_time.meta.json").read_text())
    assert meta["section"] == "optimizer_state_sharding/2026" and meta["params"]["model"] == "xl@2026"
    with pytest.raises(ValueError, match="optimizer_state_sharding has no grid of its own for edition '2027'"):
        replot.replot("optimizer_state_sharding", edition="2027")


@pytest.mark.slow
def test_a_measuring_run_of_an_edition_grid_derives_its_figures_in_that_grid(tmp_path, monkeypatch) -> None:
    from cs336_systems.experiments import get
    from cs336_systems.results import ResultWriter

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    section = get("optimizer_state_sharding")
    tables, params, figures = CASES["optimizer_state_sharding"]
    out = ResultWriter(section.results_folder("2026"), params={**params, "model": "xl@2026"}, smoke=False)
    for name, frame in tables.items():
        out.table(frame, name)
    section.rederive(out)  # what a run does after measuring: the inputs are read from figures/<name>/2026/
    folder = tmp_path / "optimizer_state_sharding" / "2026"
    assert {f"{name}.png" for name in figures} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "step_time.meta.json").read_text())["params"]["model"] == "xl@2026"
    assert not (tmp_path / "optimizer_state_sharding" / "step_time.png").exists()
