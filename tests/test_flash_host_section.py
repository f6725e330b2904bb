"""§1.3.2's host part (CPU µs per attention call beside GPU µs): summary, answer and parameters on CPU (the
timings need a GPU)."""

from __future__ import annotations

import pandas as pd
import pytest

from cs336_systems.benchmarking.flash import host as flash_host
from cs336_systems.experiments import flash_benchmarking as fb
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Table, Text


def _rows() -> pd.DataFrame:
    """Two rounds per implementation at two shapes: ours host-bound at the first, GPU-bound at the second."""
    rows = []
    for shape, host, gpu in (((1, 16, 1024, 64), {"ours": (900.0, 1100.0), "sdpa_cudnn": (300.0, 340.0)},
                              {"ours": 60.0, "sdpa_cudnn": 50.0}),
                             ((4, 32, 1024, 80), {"ours": (800.0, 820.0), "sdpa_cudnn": (310.0, 330.0)},
                              {"ours": 2000.0, "sdpa_cudnn": 1500.0})):
        for impl, hosts in host.items():
            for r, h in enumerate(hosts):
                rows.append({"round": r, "impl": impl, "host_us": h, "gpu_us": gpu[impl], "wall_us": max(h, gpu[impl]),
                             "batch": shape[0], "heads": shape[1], "seq_len": shape[2], "head_dim": shape[3],
                             "dtype": "bfloat16", "causal": True, "layout": "bshd"})
    return pd.DataFrame(rows)


def test_summary_takes_medians_and_names_what_bounds_a_call() -> None:
    s = flash_host.summarize_host_overhead(_rows()).set_index(["seq_len", "head_dim", "impl"])
    assert s.loc[(1024, 64, "ours"), "host_us"] == 1000.0 and s.loc[(1024, 64, "ours"), "host_spread_us"] == 200.0
    assert s.loc[(1024, 64, "ours"), "bound"] == "host" and s.loc[(1024, 80, "ours"), "bound"] == "GPU"
    assert s.loc[(1024, 80, "sdpa_cudnn"), "host_us"] == 320.0


def test_answer_reads_the_summary(tmp_path) -> None:
    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    flash_host.summarize_host_overhead(_rows()).to_csv(folder / "host_overhead_summary.csv", index=False)
    (question,) = fb.answers._host(SectionData(tmp_path, "flash_benchmarking"))
    assert question.label == "host"
    text = " ".join(b.plain() for b in question.blocks if isinstance(b, Text))
    assert "costs our attention 810–1,000 µs of CPU time over 2 shapes" in text
    assert "SDPA pinned to cuDNN costs 320 µs on the same host, so ours takes 2.53×–3.12× cuDNN's host" in text
    assert "host-bound" in text and "at 1 of 2: (1, 16, 1024, 64) bshd;" in text
    (table,) = [b for b in question.blocks if isinstance(b, Table)]
    assert list(table.frame.columns) == ["batch", "heads", "seq_len", "head_dim", "layout", "ours host µs",
                                         "sdpa_cudnn host µs", "ours gpu µs", "sdpa_cudnn gpu µs"]
    assert len(table.frame) == 2 and table.frame["ours host µs"].tolist() == [1000.0, 810.0]
    assert fb.answers._host(SectionData(tmp_path / "none", "flash_benchmarking")) == []


def test_bad_host_parameters_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"host.shapes takes \[batch, heads, seq_len, head_dim\].*got \[1, 16, 1024\]"):
        fb.Params(parts=["host"], host=fb.Host(shapes=[[1, 16, 1024]])).check()
    with pytest.raises(ValueError, match="host.layouts takes some of bhsd, bshd"):
        fb.Params(parts=["host"], host=fb.Host(layouts=["sbhd"])).check()
    with pytest.raises(ValueError, match="host.rounds"):
        fb.Params(parts=["host"], host=fb.Host(rounds=0)).check()
    fb.Params(parts=["host"]).check()


def test_host_part_says_it_needs_a_gpu_on_cpu(tmp_path, monkeypatch, capsys) -> None:
    from cs336_systems.experiments.__main__ import main

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=host"]) == 0
    assert "host skipped: it measures what CUDA launches cost the CPU, which needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "flash_benchmarking" / "host_overhead_summary.csv").exists()


def test_leaderboard_calls_a_gap_inside_the_runs_spread_a_tie() -> None:
    """do_bench keeps no deviation; each run's mean-to-median gap stands in for its spread, and never less than
    the spread of repeated runs (1%)."""
    from cs336_systems.experiments.flash_benchmarking.goals import _leaderboard_verdict

    summary = {"triton_fwd_bwd_ms": 4.24, "triton_fwd_bwd_median_ms": 4.07, "speedup_vs_sdpa_cudnn": 1.008,
               "sdpa_cudnn_fwd_bwd_ms": 4.276, "sdpa_cudnn_fwd_bwd_median_ms": 4.282,
               "sdpa_flash_fwd_bwd_ms": 6.86, "sdpa_flash_fwd_bwd_median_ms": 6.87, "speedup_vs_sdpa_flash": 1.62}
    assert _leaderboard_verdict(summary, "triton", "sdpa_cudnn") == (
        "level: within ±0.176 ms, the larger of the run's mean-to-median gaps and the 1% by which repeated runs differ")
    assert _leaderboard_verdict(summary, "triton", "sdpa_flash") == "faster"
    exact = {**summary, "triton_fwd_bwd_median_ms": 4.24, "sdpa_cudnn_fwd_bwd_median_ms": 4.276}
    assert _leaderboard_verdict(exact, "triton", "sdpa_cudnn").startswith("level")  # 0.8% apart: inside 1%
    slower_cudnn = {**exact, "sdpa_cudnn_fwd_bwd_ms": 4.33, "sdpa_cudnn_fwd_bwd_median_ms": 4.33}
    assert _leaderboard_verdict(slower_cudnn, "triton", "sdpa_cudnn") == "faster"  # 2.1% apart
    assert _leaderboard_verdict({"speedup_vs_x": 0.9}, "triton", "x") == "slower"


def test_leaderboard_speedups_near_one_read_as_level() -> None:
    """A 0.35% gap is inside the spread of repeated runs: 1.00× and level, never 1.00× (faster)."""
    from cs336_systems.experiments.flash_benchmarking.answers import _leaderboard_sentence

    summary = {"ours": "triton", "triton_fwd_bwd_ms": 4.2997, "triton_fwd_bwd_median_ms": 4.2994,
               "sdpa_cudnn_fwd_bwd_ms": 4.3146, "sdpa_cudnn_fwd_bwd_median_ms": 4.3009,
               "speedup_vs_sdpa_cudnn": 4.3146 / 4.2997}
    assert "sdpa_cudnn 1.00× (level: within ±0.0430 ms" in _leaderboard_sentence(summary).markdown
    assert "sdpa_cudnn 1.50×" in _leaderboard_sentence({**summary, "speedup_vs_sdpa_cudnn": 1.5}).markdown


def _goal_rows(tmp_path, leaderboard: dict, d128: dict, grid: dict, host: pd.DataFrame | None = None,
               losers: pd.DataFrame | None = None) -> dict[str, list[str]]:
    """The goals table written from a leaderboard summary, its d = 128 twin, a grid summary, host rows (by default
    ours costlier past the spread at both shapes), a model A/B with one cell lost, and optionally a losers profile."""
    import json

    from cs336_systems.experiments.flash_benchmarking.goals import goals

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "leaderboard_summary.json").write_text(json.dumps(leaderboard))
    (folder / "leaderboard_d128_summary.json").write_text(json.dumps(d128))
    (folder / "shapes_summary.json").write_text(json.dumps({"baseline": "sdpa_cudnn", "forward+backward": grid}))
    flash_host.summarize_host_overhead(_rows() if host is None else host).to_csv(
        folder / "host_overhead_summary.csv", index=False)
    pd.DataFrame([{"preset": "small", "context_length": c, "compile": False, "baseline_over_ours": r,
                   "verdict": v, "baseline": "sdpa", "ours": "flash_triton"}
                  for c, r, v in ((1024, 0.99, "tie"), (4096, 0.8, "sdpa"))]).to_csv(
        folder / "model_ab_summary.csv", index=False)
    if losers is not None:
        losers.to_csv(folder / "losers.csv", index=False)
    (question,) = goals(SectionData(tmp_path, "flash_benchmarking"))
    intro, table = (b.plain() for b in question.blocks)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {"intro": [intro], **{r[0]: r for r in rows}}


def _leaderboard(ours_ms: float, cudnn_ms: float, forward: float | None = None) -> dict:
    summary = {"ours": "triton", "triton_fwd_bwd_ms": ours_ms, "triton_fwd_bwd_median_ms": ours_ms,
               "sdpa_cudnn_fwd_bwd_ms": cudnn_ms, "sdpa_cudnn_fwd_bwd_median_ms": cudnn_ms,
               "speedup_vs_sdpa_cudnn": cudnn_ms / ours_ms}
    return summary if forward is None else {**summary, "forward_speedup_vs_sdpa_cudnn": forward,
                                            "triton_forward_ms": 1.0, "sdpa_cudnn_forward_ms": forward}


LEAD, D128 = "Leaderboard, d = 64: ≥ 1.10×", "Leaderboard shape at d = 128: ≥ 1.00×"
MEAN, FLOOR = "The grid's forward+backward, geometric mean: ≥ 1.00×", "No grid shape below 0.900×"
MODEL, HOST = ("The model's training step: no cell slower than SDPA",
               "Host µs per eager forward+backward (cuDNN's over ours): ≥ 1.00× at every shape")


def test_goals_table_says_met_or_missed_and_by_how_much(tmp_path) -> None:
    grid = {"cells": 80, "geomean": 0.95, "min": 0.5, "below_0.9": 15, "below_1.0": 39, "worst": "x"}
    rows = _goal_rows(tmp_path, _leaderboard(4.0, 4.2, forward=1.04), _leaderboard(6.0, 6.03), grid)
    assert rows[LEAD][1:3] == ["1.05×", "**no**"]
    # backward alone: (4.2 - 1.04) / (4.0 - 1.0) = 1.05
    assert rows[LEAD][3].startswith("needs 4.8% more speed; forward alone 1.04×, backward alone 1.05×: both fall short;")
    assert rows[D128][1:3] == ["1.01×", "level"]  # 0.5% apart: inside the 1% spread of repeated runs
    assert rows[D128][3].startswith("level: within ±0.0600 ms, the larger of the run's mean-to-median gaps")
    assert rows[MEAN][1:3] == ["0.950×", "**no**"] and "39 of 80 shapes below 1.0×" in rows[MEAN][3]
    assert rows[FLOOR][1:3] == ["lowest 0.500×", "**no**"] and rows[FLOOR][3].startswith("15 shapes below;")
    assert "no profile of the worst shapes yet" in rows[FLOOR][3]
    assert rows[HOST][1:3] == ["0.320×–0.395×", "**no**"]  # cuDNN's host µs over ours: 320/1,000 and 320/810
    assert rows[HOST][3].startswith("costlier than cuDNN past the rounds' spread at 2 of 2 shapes")
    assert rows[MODEL][1:3] == ["1 of 2 cells slower", "**no**"]
    assert rows[MODEL][3].startswith("slower beyond the rounds' spread in small at 4,096 eager (0.800×)")
    assert "rounds the full run takes" not in rows[MODEL][3]  # the summary records no round counts
    assert "Of 6 goals, 1 level and 5 missed." in rows["intro"][0]


def test_goals_say_when_a_lost_model_cell_was_judged_on_fewer_rounds_than_the_full_run_takes(tmp_path) -> None:
    from cs336_systems.experiments.flash_benchmarking import Params
    from cs336_systems.experiments.flash_benchmarking.goals import goals
    from cs336_systems.report.data import SectionData

    grid = {"cells": 80, "geomean": 0.95, "min": 0.5, "below_0.9": 15, "below_1.0": 39, "worst": "x"}
    _goal_rows(tmp_path, _leaderboard(4.0, 4.2), _leaderboard(6.0, 6.03), grid)
    rounds = Params().model_ab.rounds  # the small cells' jobs; xl compiled cells' jobs take 2
    pd.DataFrame([{"preset": p, "context_length": c, "compile": k, "baseline_over_ours": 0.8, "verdict": "sdpa",
                   "baseline_rounds": n, "ours_rounds": n, "baseline": "sdpa", "ours": "flash_triton"}
                  for p, c, k, n in (("small", 1024, False, 2), ("small", 2048, True, rounds), ("xl", 1024, True, 2))]
                 ).to_csv(tmp_path / "flash_benchmarking" / "model_ab_summary.csv", index=False)
    (question,) = goals(SectionData(tmp_path, "flash_benchmarking"))
    row = next(line for line in question.blocks[1].plain().splitlines() if line.startswith(f"| {MODEL}"))
    assert f"small at 1,024 eager (0.800×, on 2 of the {rounds} rounds the full run takes for it)" in row
    assert "small at 2,048 compiled (0.800×);" in row and "xl at 1,024 compiled (0.800×) (split" in row


def test_goals_met_leave_the_gap_column_without_a_shortfall(tmp_path) -> None:
    grid = {"cells": 4, "geomean": 1.2, "min": 0.95, "below_0.9": 0, "below_1.0": 1, "worst": "x"}
    rows = _goal_rows(tmp_path, _leaderboard(4.0, 4.8), _leaderboard(6.0, 6.6), grid)
    assert rows[LEAD][1:3] == ["1.20×", "yes"] and rows[LEAD][3] == "past the runs' spread of ±0.0400 ms"
    assert rows[D128][2] == "yes" and rows[MEAN][2] == "yes" and rows[FLOOR][2] == "yes"
    assert not any("needs" in r[3] for k, r in rows.items() if k != "intro" and r[2] == "yes")


def test_a_grid_missing_a_dtype_leaves_its_mean_open_and_a_shape_below_the_floor_still_misses(tmp_path) -> None:
    """The grid runs one dtype per job: until every dtype of the full run has rows, the mean is open, while a
    shape already below the floor misses that goal whatever the rest measure."""
    from cs336_systems.benchmarking.flash.shapes import SHAPES_BHN

    cells = [{"impl": "triton", "dtype": "bfloat16", "batch": b, "heads": h, "seq_len": n, "head_dim": d,
              "causal": c, "pass": "forward+backward"} for b, h, n in SHAPES_BHN for d in (64, 128)
             for c in (True, False)]
    grid = {"cells": 40, "geomean": 1.05, "min": 0.95, "below_0.9": 0, "below_1.0": 3, "worst": "x"}
    folder = tmp_path / "a" / "flash_benchmarking"
    folder.mkdir(parents=True)
    pd.DataFrame(cells).to_csv(folder / "shapes.csv", index=False)
    rows = _goal_rows(tmp_path / "a", _leaderboard(4.0, 4.8), _leaderboard(6.0, 6.6), grid)
    assert rows[MEAN][1:3] == ["1.05×", "open"]
    assert rows[MEAN][3] == "3 of 40 shapes below 1.0×; 40 float16 shapes not measured yet, which leaves it open"
    assert rows[FLOOR][2] == "open" and rows[FLOOR][3].endswith("40 float16 shapes not measured yet, which leaves it open")
    fp16 = pd.DataFrame(cells).assign(dtype="float16")
    (tmp_path / "b" / "flash_benchmarking").mkdir(parents=True)
    pd.concat([pd.DataFrame(cells), fp16]).to_csv(tmp_path / "b" / "flash_benchmarking" / "shapes.csv", index=False)
    whole = _goal_rows(tmp_path / "b", _leaderboard(4.0, 4.8), _leaderboard(6.0, 6.6), {**grid, "min": 0.5})
    assert whole[MEAN][2] == "yes" and whole[MEAN][3] == "3 of 40 shapes below 1.0×"
    assert whole[FLOOR][2] == "**no**" and "not measured" not in whole[FLOOR][3]
    fp16.iloc[:1].to_csv(tmp_path / "b" / "flash_benchmarking" / "shapes.csv", index=False)  # bf16 gone, fp16 short
    from cs336_systems.experiments.flash_benchmarking.goals import shapes_unmeasured

    assert shapes_unmeasured(SectionData(tmp_path / "b", "flash_benchmarking")) == {"bfloat16": 40, "float16": 39}
    skipped = pd.concat([pd.DataFrame(cells).assign(status="ok"), fp16.assign(status="skipped (time budget)")])
    skipped.iloc[-1, skipped.columns.get_loc("status")] = "OOM"  # an OOM cell was measured: it ran out of memory
    skipped.to_csv(tmp_path / "b" / "flash_benchmarking" / "shapes.csv", index=False)
    assert shapes_unmeasured(SectionData(tmp_path / "b", "flash_benchmarking")) == {"float16": 39}


def test_goals_mark_a_stale_result_and_give_the_mean_without_the_shortest_rows(tmp_path) -> None:
    """A row read from a result measured on older code says so; the grid's mean is also given without its
    shortest rows (the most host-bound and noisiest), with their widest spread."""
    import json

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    (folder / "model_ab_summary.meta.json").write_text(json.dumps({"git_commit": "0123456789-dirty"}))
    shape = {"dtype": "bfloat16", "batch": 1, "heads": 8, "head_dim": 64, "causal": True, "pass": "forward+backward"}
    pd.DataFrame([{**shape, "seq_len": n, "vs_sdpa_cudnn": r, "spread_triton": sp, "spread_sdpa_cudnn": 0.01}
                  for n, r, sp in ((256, 2.0, 0.6), (256, 1.5, 0.2), (4096, 0.9, 0.01), (8192, 1.0, 0.02))]).to_csv(
        folder / "shapes_ratio.csv", index=False)
    grid = {"cells": 4, "geomean": 1.2, "min": 0.9, "below_0.9": 0, "below_1.0": 1, "worst": "x"}
    rows = _goal_rows(tmp_path, _leaderboard(4.0, 4.8), _leaderboard(6.0, 6.6), grid)
    assert rows[MODEL][4] == "`model_ab_summary.csv` (STALE)" and rows[MEAN][4] == "`shapes_summary.json`"
    assert "1 of the rows reads a result measured on older code, marked STALE; its source line below says" in \
        rows["intro"][0]
    assert rows[MEAN][3] == ("1 of 4 shapes below 1.0×; 0.949× without the 2 shapes at 256 tokens, whose rounds "
                             "spread up to 60.0%")


def test_goals_count_a_gap_inside_the_spread_as_level_not_as_met_or_missed(tmp_path) -> None:
    """The host cells of the real runs: ours costlier in the medians, every one inside the rounds' spread; and
    parity at d = 128 a hair under 1.0 is level like a hair over it."""
    host = _rows()
    host.loc[host["impl"] == "sdpa_cudnn", "host_us"] = host.loc[host["impl"] == "sdpa_cudnn", "host_us"] * 2.5
    grid = {"cells": 4, "geomean": 1.2, "min": 0.95, "below_0.9": 0, "below_1.0": 1, "worst": "x"}
    rows = _goal_rows(tmp_path, _leaderboard(4.0, 4.8), _leaderboard(6.0, 5.98), grid, host=host)
    assert rows[D128][1:3] == ["0.997×", "level"]
    # ours 1,000 against 800 within ±200, and 810 against 800: costlier in the medians, level by the spread
    assert rows[HOST][2] == "level" and rows[HOST][3].startswith("costlier at 2 of 2 shapes, none past the rounds")


def test_goals_count_the_worst_shapes_by_where_they_lose(tmp_path) -> None:
    """Host-bound needs the grid's time per call; without that table only the kernels' verdict is given."""
    shape = {"dtype": "bfloat16", "batch": 8, "heads": 32, "head_dim": 64, "causal": True}
    losers = pd.DataFrame([{**shape, "seq_len": 256, "ours_total_us": 60.0, "cudnn_total_us": 75.0,
                            "loses_most_in": "forward"},
                           {**shape, "seq_len": 512, "ours_total_us": 160.0, "cudnn_total_us": 120.0,
                            "loses_most_in": "backward"}])
    grid = {"cells": 80, "geomean": 0.95, "min": 0.5, "below_0.9": 2, "below_1.0": 39, "worst": "x"}
    rows = _goal_rows(tmp_path, _leaderboard(4.0, 4.2), _leaderboard(6.0, 6.6), grid, losers=losers)
    assert rows[FLOOR][3] == ("2 shapes below; of the 2 worst, profiled, ours' kernels take more GPU "
                              "time than cuDNN's at 1, by 33% (the profile below)")
    ratio = pd.DataFrame([{**shape, "seq_len": n, "pass": "forward+backward", "triton_ms": ms}
                          for n, ms in ((256, 0.4), (512, 0.17))])
    ratio.to_csv(tmp_path / "flash_benchmarking" / "shapes_ratio.csv", index=False)
    from cs336_systems.experiments.flash_benchmarking.goals import goals

    (question,) = goals(SectionData(tmp_path, "flash_benchmarking"))
    assert ("of the 2 worst, profiled, 1 is host-bound (a call in the grid takes over 1.5× its kernels' GPU time); "
            "ours' kernels take more GPU time than cuDNN's at 1") in question.blocks[1].plain()
    # a profile of older code counts nothing: its shapes may not be the grid's worst any more
    import json

    (tmp_path / "flash_benchmarking" / "losers.meta.json").write_text(json.dumps({"git_commit": "0123456789-dirty"}))
    (question,) = goals(SectionData(tmp_path, "flash_benchmarking"))
    said = question.blocks[1].plain()
    assert "the profile of the worst shapes is STALE (older code), so not counted here" in said
    assert "host-bound (a call" not in said and "by 33%" not in said


def test_goals_skip_what_their_results_do_not_hold(tmp_path) -> None:
    from cs336_systems.experiments.flash_benchmarking.goals import goals

    assert goals(SectionData(tmp_path / "none", "flash_benchmarking")) == []
    rows = _goal_rows(tmp_path, {"ours": "triton"}, _leaderboard(6.0, 6.6), {"cells": 4, "geomean": 1.2})
    assert LEAD not in rows and MEAN not in rows and FLOOR not in rows  # no ratio, no grid counts: no row
    assert D128 in rows and HOST in rows
