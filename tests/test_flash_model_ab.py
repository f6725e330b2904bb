"""The model A/B of §1.3.2 (our attention against SDPA inside the training step): order, summary and the
section's answer, on CPU (the timings are a GPU's)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from cs336_systems.benchmarking.flash import model as flash_model
from cs336_systems.experiments import flash_benchmarking as fb


def test_rounds_alternate_and_rotate_the_order() -> None:
    configs = flash_model.model_ab_configs(["tiny"], [16, 32], [False], rounds=3)
    first = [(c["round"], c["attention_impl"]) for c in configs if c["context_length"] == 16]
    assert first == [(0, "sdpa"), (0, "flash_triton"), (1, "flash_triton"), (1, "sdpa"), (2, "sdpa"),
                     (2, "flash_triton")]
    assert len(configs) == 2 * 3 * 2  # contexts x rounds x implementations, each cell's rounds together
    with pytest.raises(ValueError, match="two implementations"):
        flash_model.model_ab_configs(["tiny"], [16], [False], rounds=2, impls=["sdpa"])


def test_a_job_replaces_whole_cells_unless_it_measures_only_some_rounds() -> None:
    from cs336_systems.results import merge_rows

    def rows(rounds: range, ms: float) -> pd.DataFrame:
        return pd.DataFrame(_rows({"preset": "small", "context_length": 1024, "compile": False},
                                  {"sdpa": [ms] * len(rounds)})).assign(round=list(rounds))

    earlier = rows(range(6), 1.0)
    # a job of fewer rounds leaves none of the earlier job's rounds in the cell
    merged = merge_rows(rows(range(2), 2.0), earlier, flash_model.model_ab_merge_keys([]))
    assert list(merged["round"]) == [0, 1] and set(merged["total_mean_ms"]) == {2.0}
    # a job of some rounds (an xl compiled cell split over jobs) replaces only those
    merged = merge_rows(rows(range(1, 2), 2.0), rows(range(2), 1.0), flash_model.model_ab_merge_keys([1]))
    assert sorted(zip(merged["round"], merged["total_mean_ms"])) == [(0, 1.0), (1, 2.0)]


def _rows(cell: dict, times: dict[str, list[float | None]]) -> list[dict]:
    return [{**cell, "round": r, "attention_impl": impl, "status": "ok" if t is not None else "OOM",
             "total_mean_ms": t if t is not None else math.nan}
            for impl, ts in times.items() for r, t in enumerate(ts)]


def test_summary_calls_a_tie_inside_the_spread_and_a_winner_outside_it() -> None:
    table = pd.DataFrame(
        _rows({"preset": "small", "context_length": 1024, "compile": False},
              {"sdpa": [10.0, 10.4], "flash_triton": [10.1, 10.2]})
        + _rows({"preset": "small", "context_length": 2048, "compile": True},
                {"sdpa": [10.0, 10.1], "flash_triton": [12.0, 12.2]})
        + _rows({"preset": "xl", "context_length": 4096, "compile": False},
                {"sdpa": [None, None], "flash_triton": [50.0, 51.0]})
    )
    s = flash_model.summarize_model_ab(table).set_index(["preset", "context_length"])
    assert s.loc[("small", 1024), "verdict"] == "tie"  # 0.05 ms apart, spreads 0.4 and 0.1
    assert s.loc[("small", 1024), "baseline_over_ours"] == pytest.approx(10.2 / 10.15)
    assert s.loc[("small", 2048), "verdict"] == "sdpa"
    assert s.loc[("small", 2048), "baseline_over_ours"] == pytest.approx(10.05 / 12.1)
    assert s.loc[("xl", 4096), "verdict"] == "OOM" and math.isnan(s.loc[("xl", 4096), "baseline_over_ours"])
    assert s.loc[("xl", 4096), "ours_rounds"] == 2 and s.loc[("xl", 4096), "baseline_rounds"] == 0


def test_bad_model_ab_parameters_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="model_ab.impls takes two"):
        fb.Params(parts=["model_ab"], model_ab=fb.ModelAB(impls=["sdpa"])).check()
    with pytest.raises(ValueError, match="not a multiple of context 3000"):
        fb.Params(parts=["model_ab"], model_ab=fb.ModelAB(contexts=[1024, 3000])).check()
    with pytest.raises(ValueError, match="preset"):
        fb.Params(parts=["model_ab"], model_ab=fb.ModelAB(presets=["huge"])).check()
    with pytest.raises(ValueError, match="names round 6, not one of model_ab.rounds=6"):
        fb.Params(parts=["model_ab"], model_ab=fb.ModelAB(only_rounds=[6])).check()
    with pytest.raises(ValueError, match="model_ab.rounds"):
        fb.Params(parts=["model_ab"], model_ab=fb.ModelAB(rounds=0)).check()
    with pytest.raises(ValueError, match="round -1 is not one of the 2 rounds"):
        flash_model.model_ab_configs(["tiny"], [16], [False], rounds=2, only_rounds=[-1])
    fb.Params(parts=["model_ab"]).check()


@pytest.mark.slow
def test_model_ab_part_smoke_run(tmp_path, monkeypatch, capsys) -> None:
    from cs336_systems.experiments.__main__ import main

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=model_ab", "--set", "model_ab.contexts=[16]",
                 "--set", "model_ab.compile=[False]"]) == 0
    out = capsys.readouterr().out
    assert "(model_ab) Beyond the handout: flash_pytorch against sdpa" in out and "Over 1 cell " in out
    long = pd.read_csv(tmp_path / "flash_benchmarking" / "model_ab.csv")
    assert list(long["attention_impl"]) == ["sdpa", "flash_pytorch", "flash_pytorch", "sdpa"]
    assert set(long["status"]) == {"ok"} and set(long["batch_size"]) == {4}  # 64 tokens / context 16
    summary = pd.read_csv(tmp_path / "flash_benchmarking" / "model_ab_summary.csv")
    assert len(summary) == 1 and summary["verdict"].iloc[0] in ("tie", "sdpa", "flash_pytorch")


@pytest.mark.slow
def test_model_ab_jobs_of_one_commit_combine_their_cells(tmp_path, monkeypatch, capsys) -> None:
    """The grid is split over GPU jobs (by preset, context or compile): a later job keeps the earlier job's
    cells, replaces the cells it measures again, and starts over when the step settings differ."""
    from cs336_systems.experiments.__main__ import main

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    table = tmp_path / "flash_benchmarking" / "model_ab.csv"

    def job(*sets: str) -> pd.DataFrame:
        args = ["flash_benchmarking", "--smoke", "--set", "parts=model_ab", "--set", "model_ab.compile=[False]"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
        capsys.readouterr()
        return pd.read_csv(table)

    first = job("model_ab.contexts=[16]")
    both = job("model_ab.contexts=[32]")
    assert sorted(both["context_length"].unique()) == [16, 32] and len(both) == 8
    pd.testing.assert_frame_equal(both[both["context_length"] == 16].reset_index(drop=True), first)
    again = job("model_ab.contexts=[16]")
    assert len(again) == 8 and list(again["context_length"]) == [32] * 4 + [16] * 4  # 16 measured anew
    summary = pd.read_csv(tmp_path / "flash_benchmarking" / "model_ab_summary.csv")
    assert sorted(summary["context_length"]) == [16, 32]
    other = job("model_ab.contexts=[32]", "model_ab.steps=2")  # other step settings: the earlier cells are not comparable
    assert list(other["context_length"].unique()) == [32] and len(other) == 4
    # an xl compiled cell's two rounds outlast one GPU job: one round per job, combined into one cell
    job("model_ab.contexts=[64]", "model_ab.only_rounds=[0]")
    split = job("model_ab.contexts=[64]", "model_ab.only_rounds=[1]")
    cell = split[split["context_length"] == 64]
    assert list(zip(cell["round"], cell["attention_impl"])) == [(0, "sdpa"), (0, "flash_pytorch"),
                                                                (1, "flash_pytorch"), (1, "sdpa")]
    summary = pd.read_csv(tmp_path / "flash_benchmarking" / "model_ab_summary.csv").set_index("context_length")
    assert summary.loc[64, "baseline_rounds"] == summary.loc[64, "ours_rounds"] == 2


def test_merge_rows_by_a_cell_of_several_columns() -> None:
    from cs336_systems.results import merge_rows

    earlier = pd.DataFrame({"preset": ["small", "small", "xl"], "compile": [False, True, False], "ms": [1.0, 2.0, 3.0]})
    rows = pd.DataFrame({"preset": ["small", "medium"], "compile": [True, True], "ms": [9.0, 8.0]})
    merged = merge_rows(rows, earlier, ["preset", "compile"])
    assert merged.to_dict("list") == {"preset": ["small", "xl", "small", "medium"],
                                      "compile": [False, False, True, True], "ms": [1.0, 3.0, 9.0, 8.0]}
    assert merge_rows(rows, None, ["preset", "compile"]) is rows and merge_rows(None, earlier, "preset") is earlier


def test_writeup_table_has_a_row_per_preset_and_context_eager_then_compiled() -> None:
    summary = pd.DataFrame([{"preset": "small", "context_length": 1024, "compile": c, "baseline_ms": b, "ours_ms": o,
                             "verdict": v} for c, b, o, v in ((True, 9.0, 9.5, "sdpa"), (False, 20.0, 19.0, "tie"))])
    table = fb.model_answers._model_ab_table(summary, "sdpa", "flash_triton")
    assert table.to_dict("records") == [{"preset": "small", "context_length": 1024, "eager sdpa ms": 20.0,
                                         "eager flash_triton ms": 19.0, "eager verdict": "tie",
                                         "compiled sdpa ms": 9.0, "compiled flash_triton ms": 9.5,
                                         "compiled verdict": "sdpa"}]


def test_cells_of_the_recorded_grid_without_a_row_are_named() -> None:
    summary = pd.DataFrame({"preset": ["xl", "xl"], "context_length": [1024, 1024], "compile": [False, True]})
    grid = {"presets": ["xl"], "contexts": [1024, 4096], "compile": [False, True]}
    params = {"model_ab": grid}
    assert fb.model_answers._model_ab_absent(summary, params) == [("xl", 4096, False), ("xl", 4096, True)]
    assert fb.model_answers._model_ab_absent(summary, {"model_ab": {**grid, "contexts": [1024]}}) == []
    # records from before the parameter groups name the grid flat
    flat = {f"ab_{k}": v for k, v in grid.items()}
    assert fb.model_answers._model_ab_absent(summary, flat) == [("xl", 4096, False), ("xl", 4096, True)]
    assert fb.model_answers._model_ab_absent(summary, {}) == []


def test_answer_says_what_compiled_means_only_when_a_compiled_cell_was_measured(tmp_path) -> None:
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Text

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()

    def answer(compiles: list[bool]) -> str:
        table = pd.DataFrame(sum((_rows({"preset": "small", "context_length": 1024, "compile": c},
                                        {"sdpa": [10.0, 10.4], "flash_triton": [10.1, 10.2]}) for c in compiles), []))
        flash_model.summarize_model_ab(table).to_csv(folder / "model_ab_summary.csv", index=False)
        (question,) = fb.model_answers._model_ab(SectionData(tmp_path, "flash_benchmarking"))
        return " ".join(b.plain() for b in question.blocks if isinstance(b, Text))

    assert "default mode" in answer([False, True]) and "no CUDA graphs" in answer([True])
    assert "Over 1 cell " in answer([False]) and "default mode" not in answer([False])


def test_cells_no_job_measured_are_named_even_when_the_last_job_covered_only_its_own() -> None:
    """Each model_ab job measures part of the grid: the absent cells come from all the jobs, not the last."""
    planned = fb.model_answers._model_ab_planned()
    assert len(planned) == len(set(planned)) == 18  # small, medium, xl × 1024, 2048, 4096 × eager, compiled
    summary = pd.DataFrame({"preset": ["medium"], "context_length": [4096], "compile": [True]})
    last_job = {"model_ab": {"presets": ["medium"], "contexts": [4096], "compile": [True]}}
    absent = fb.model_answers._model_ab_absent(summary, last_job, planned)
    assert len(absent) == 17 and ("medium", 4096, True) not in absent and ("xl", 2048, True) in absent


def test_answer_names_the_cells_each_implementation_won(tmp_path) -> None:
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Text

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    table = pd.DataFrame(
        _rows({"preset": "small", "context_length": 1024, "compile": False},
              {"sdpa": [10.0, 10.4], "flash_triton": [10.1, 10.2]})  # tie
        + _rows({"preset": "small", "context_length": 2048, "compile": True},
                {"sdpa": [10.0, 10.1], "flash_triton": [12.0, 12.2]})  # sdpa
    )
    flash_model.summarize_model_ab(table).to_csv(folder / "model_ab_summary.csv", index=False)
    (question,) = fb.model_answers._model_ab(SectionData(tmp_path, "flash_benchmarking"))
    text = " ".join(b.plain() for b in question.blocks if isinstance(b, Text))
    assert "1 tie (the medians differ by less than the larger spread of the rounds)" in text
    assert "flash_triton faster in 0, sdpa faster in 1 (small at 2,048, compiled)" in text


def test_a_lost_cells_gap_is_split_by_phase() -> None:
    """Where SDPA wins a cell, the answer says in which phase: the attention runs in the forward and backward,
    the AdamW step is the same code under both."""
    phases = ("forward", "backward", "optimizer")
    rows = pd.DataFrame([{"preset": "small", "context_length": 2048, "compile": True, "round": r,
                          "attention_impl": impl, "status": "ok", **dict(zip([f"{p}_mean_ms" for p in phases], t)),
                          "total_mean_ms": sum(t) + 1.0}
                         for r in (0, 1) for impl, t in (("sdpa", (8.0, 15.0, 7.0)), ("flash_triton", (10.0, 15.5, 9.5)))])
    lost = pd.DataFrame([{"preset": "small", "context_length": 2048, "compile": True}])
    text = fb.model_answers._model_ab_gaps(rows, lost, "sdpa", "flash_triton", lambda r: "small at 2,048, compiled")
    assert "small at 2,048, compiled, 5.00 ms slower: forward +2.00, backward +0.50, the AdamW step +2.50, the rest +0.00 ms" in text
    assert fb.model_answers._model_ab_gaps(rows.drop(columns="optimizer_mean_ms"), lost, "sdpa", "flash_triton", str) == ""


def test_a_cell_measured_in_one_round_gets_no_verdict_until_its_second(tmp_path) -> None:
    """A job that measured only a cell's first round leaves each side one time, whose spread is zero: any gap
    would read as a win. The summary says so instead, the answer names the cell and the goal stays open."""
    from cs336_systems.experiments.flash_benchmarking.goals import _model_row
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Text

    one = _rows({"preset": "xl", "context_length": 1024, "compile": True},
                {"sdpa": [260.3], "flash_triton": [259.0]})
    tie = _rows({"preset": "small", "context_length": 1024, "compile": False},
                {"sdpa": [10.0, 10.4], "flash_triton": [10.1, 10.2]})
    s = flash_model.summarize_model_ab(pd.DataFrame(one + tie)).set_index(["preset", "context_length"])
    assert s.loc[("xl", 1024), "verdict"] == flash_model.ONE_ROUND == "one round"
    assert s.loc[("xl", 1024), "baseline_over_ours"] == pytest.approx(260.3 / 259.0)  # measured, not judged
    assert s.loc[("small", 1024), "verdict"] == "tie"
    second = _rows({"preset": "xl", "context_length": 1024, "compile": True},
                   {"sdpa": [260.3, 260.9], "flash_triton": [259.0, 259.2]})
    assert flash_model.summarize_model_ab(pd.DataFrame(second))["verdict"].item() == "flash_triton"
    lopsided = _rows({"preset": "xl", "context_length": 1024, "compile": True},
                     {"sdpa": [260.3, 260.9], "flash_triton": [259.0, None]})  # ours' second round out of memory
    assert flash_model.summarize_model_ab(pd.DataFrame(lopsided))["verdict"].item() == "one round"

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    s.reset_index().to_csv(folder / "model_ab_summary.csv", index=False)
    data = SectionData(tmp_path, "flash_benchmarking")
    (question,) = fb.model_answers._model_ab(data)
    text = " ".join(b.plain() for b in question.blocks if isinstance(b, Text))
    assert "1 tie (" in text and "flash_triton faster in 0, sdpa faster in 0" in text
    assert ("1 measured in one round only, with no spread to judge a difference against, so no verdict "
            "(xl at 1,024, compiled)") in text
    row = _model_row(data)
    assert row[1:3] == ["0 of 1 cells slower", "open"]
    assert "1 cell measured in one round only, which leaves it open" in row[3]


def test_model_step_sentence_says_where_the_sequential_table_separates_the_two() -> None:
    """The model-step table is not an A/B: the answer gives SDPA's time over ours and the contexts where the
    steps' ranges do not overlap, and points to the alternating A/B for speed."""
    rows = [{"context_length": c, "attention_impl": impl, "status": "ok", "total_mean_ms": ms,
             "total_min_ms": ms - 1, "total_max_ms": ms + 1, "peak_memory_GiB": 1.0}
            for c, impl, ms in ((1024, "sdpa", 10.0), (1024, "flash_triton", 10.5), (2048, "sdpa", 10.0),
                                (2048, "flash_triton", 20.0))]
    text = fb.model_answers._model_step_sentence(pd.DataFrame(rows)).plain()
    assert text.startswith("At context 2,048 a training step takes: sdpa 10.0 ms, 1.00 GiB and flash_triton 20.0 ms")
    assert "sdpa's step time over ours runs from 0.500× to 0.952×; their steps' ranges do not overlap at 2,048." in text
    assert "the A/B below alternates them in rounds and is the speed comparison" in text
    naive_oom = pd.DataFrame(rows + [{"context_length": 2048, "attention_impl": "naive", "status": "OOM"}])
    assert "do not overlap at 2,048." in fb.model_answers._model_step_sentence(naive_oom).plain()  # naive's OOM drops nothing
    close = pd.DataFrame(rows[:2])
    assert "their steps' ranges overlap at every context" in fb.model_answers._model_step_sentence(close).plain()


def test_caption_gives_the_rounds_per_cell_or_their_range() -> None:
    def rows(eager: int, compiled: int) -> pd.DataFrame:
        table = pd.DataFrame(_rows({"preset": "small", "context_length": 1024, "compile": False},
                                   {"sdpa": [10.0] * eager, "flash_triton": [10.0] * eager})
                             + _rows({"preset": "small", "context_length": 1024, "compile": True},
                                     {"sdpa": [9.0] * compiled, "flash_triton": [9.0] * compiled}))
        return table.assign(precision="bf16", tokens_per_step=8192)

    setting = fb.model_answers._model_ab_setting
    assert setting(rows(6, 2)).endswith("; 2-6 rounds per cell, each cell's count in the CSV)")
    assert setting(rows(2, 2)).endswith("; 2 rounds per cell)")
    assert setting(rows(6, 2).drop(columns="compile")) == ""


def test_planned_rounds_follow_each_job() -> None:
    planned = fb.model_answers._model_ab_planned_rounds()
    assert planned[("small", 2048, False)] == planned[("medium", 4096, True)] == fb.Params().model_ab.rounds
    assert planned[("xl", 4096, True)] == 2 and planned[("xl", 4096, False)] == fb.Params().model_ab.rounds
