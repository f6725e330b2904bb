"""Sections that measure the same configuration are compared: a pair more than 10% apart is flagged in
``writeup status`` and in the writeup; a pair within 10% is not."""

from __future__ import annotations

import json

import pandas as pd

from cs336_systems.report import agreement
from cs336_systems.report.data import DISAGREES_MARK, SectionData, provenance_line


def _write(root, folder: str, table: str, frame: pd.DataFrame, params: dict) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    frame.to_csv(root / folder / f"{table}.csv", index=False)
    (root / folder / f"{table}.meta.json").write_text(json.dumps({"params": params, "smoke": False,
                                                                  "device": "NVIDIA H100 80GB HBM3"}))


def _two_sections(root, xl_mixed_precision_ms: float, smoke: bool = False) -> None:
    _write(root, "benchmarking", "timings", pd.DataFrame(
        {"size": ["small", "xl"], "status": ["ok", "ok"], "forward_mean_ms": [20.0, 246.0]}), {"context_length": 512})
    _write(root, "mixed_precision", "precision_timings", pd.DataFrame(
        {"size": ["small", "xl", "xl"], "precision": ["fp32", "fp32", "bf16"], "status": ["ok"] * 3,
         "forward_mean_ms": [21.0, xl_mixed_precision_ms, 90.0]}), {"context_length": 512})
    if smoke:
        meta = root / "mixed_precision" / "precision_timings.meta.json"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "smoke": True}))


def test_a_shared_cell_more_than_ten_percent_apart_is_flagged(tmp_path) -> None:
    _two_sections(tmp_path, 446.0)
    found = agreement.disagreements(tmp_path)
    h100 = ("NVIDIA H100 80GB HBM3", None)  # the device and matmul precision end every key
    assert [d.key for d in found] == [("model forward ms", "xl", "fp32", 512, 4, *h100)]
    assert found[0].line() == ("model forward ms (xl · fp32 · 512 · 4): benchmarking/timings: 246, "
                               "mixed_precision/precision_timings: 446 (81% apart)")
    assert agreement.shared_keys(tmp_path) == {("model forward ms", s, "fp32", 512, 4, *h100) for s in ("small", "xl")}
    line = provenance_line(SectionData(tmp_path, "mixed_precision", depends=()).meta("precision_timings"))
    assert (f"{DISAGREES_MARK}: 1 cell(s) disagree with benchmarking/timings by more than 10%, up to 81% "
            "(xl fp32 context 512)") in line
    # the speed-up table the writeup shows repeats those times, so it carries the same mark
    _write(tmp_path, "mixed_precision", "bf16_speedup", pd.DataFrame({"size": ["xl"], "forward_speedup": [4.9]}), {})
    shown = provenance_line(SectionData(tmp_path, "mixed_precision", depends=()).meta("bf16_speedup"))
    assert f"{DISAGREES_MARK}: 1 cell(s) disagree with benchmarking/timings" in shown
    assert DISAGREES_MARK not in provenance_line(SectionData(tmp_path, "benchmarking", depends=()).meta("other"))


def test_shared_cells_within_ten_percent_or_the_runs_spread_and_smoke_runs_are_not_flagged(tmp_path) -> None:
    _two_sections(tmp_path, 260.0)  # 5.7% apart; small is 5% apart
    assert agreement.disagreements(tmp_path) == []
    noisy = tmp_path / "noisy"  # 81% apart, but each run's own spread is wider
    _two_sections(noisy, 446.0)
    for folder, table in (("benchmarking", "timings"), ("mixed_precision", "precision_timings")):
        frame = pd.read_csv(noisy / folder / f"{table}.csv")
        frame.assign(forward_std_ms=120.0).to_csv(noisy / folder / f"{table}.csv", index=False)
    assert agreement.disagreements(noisy) == [] and len(agreement.shared_keys(noisy)) == 2
    assert DISAGREES_MARK not in provenance_line(SectionData(tmp_path, "benchmarking", depends=()).meta("timings"))
    smoke = tmp_path / "smoke"
    _two_sections(smoke, 446.0, smoke=True)
    assert agreement.disagreements(smoke) == [] and agreement.shared_keys(smoke) == set()


def test_every_shared_table_names_a_table_its_section_writes() -> None:
    """The extractors point at real tables: each one's folder has that committed CSV and its cells parse."""
    from cs336_systems.results import FIGURES_DIR

    cells = agreement.shared_cells(FIGURES_DIR)
    for spec in agreement.SHARED:
        tables = spec.tables(FIGURES_DIR)
        assert tables, spec
        assert all(any((c.folder, c.table) == (folder, table) for c in cells) for folder, table, _ in tables), spec
    assert len(agreement.shared_keys(FIGURES_DIR)) >= 20
    # the data-parallel sections' steps are compared in every edition grid too
    assert {c.folder for c in cells} >= {"naive_ddp", "ddp_flat/cse599o", "ddp_overlap_individual/2026"}


def test_an_answer_reconciles_its_shared_cells_with_the_other_sections(tmp_path) -> None:
    _two_sections(tmp_path, 446.0)
    differ = agreement.reconcile(tmp_path, "mixed_precision", "precision_timings", "The fp32 forwards")
    assert differ.startswith("The fp32 forwards differ from the same configurations measured elsewhere "
                             "(benchmarking) by up to 81% (xl fp32 context 512: 1.81× theirs)")
    agree = tmp_path / "agree"
    _two_sections(agree, 250.0)
    assert agreement.reconcile(agree, "benchmarking", "timings", "They") == \
        "They agree with the median of the same configurations measured elsewhere (mixed_precision) within 5%."
    named = agreement.reconcile(agree, "benchmarking", "timings", "They", lambda folder: f"§{len(folder)}")
    assert named == "They agree with the median of the same configurations measured elsewhere (§15) within 5%."
    assert agreement.reconcile(agree, "nsys_profile", "summary", "They") is None


def test_the_same_configuration_on_another_gpu_is_not_compared(tmp_path) -> None:
    _two_sections(tmp_path, 446.0)
    meta = tmp_path / "mixed_precision" / "precision_timings.meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "device": "NVIDIA H200"}))
    assert agreement.disagreements(tmp_path) == [] and agreement.shared_keys(tmp_path) == set()


def _ddp_steps(root, folder: str, naive_ms: float, std: float = 1.0) -> None:
    rows = [("single", None, None, 200.0), ("naive", None, "fp32", naive_ms)]
    _write(root, folder, "steps_large_fp32", pd.DataFrame(
        [{"variant": v, "bucket_size_mb": b, "comm_dtype": c, "grad_views": False, "cuda_graph": False,
          "step_ms": ms, "step_ms_std": std, "preset": "large", "autocast": "fp32", "context_length": 512,
          "batch_per_rank": 2, "world_size": 1 if v == "single" else 2} for v, b, c, ms in rows]), {})


def test_data_parallel_steps_are_compared_across_sections_and_edition_grids(tmp_path) -> None:
    """The naive DDP step of one model, precision and world size, in two sections' edition grids: 20% apart
    beyond both runs' spread is flagged; within the spread, or measured by one section only, it is not."""
    _ddp_steps(tmp_path, "naive_ddp/cse599o", 220.0)
    _ddp_steps(tmp_path, "ddp_flat/cse599o", 264.0)
    found = agreement.disagreements(tmp_path)
    assert [(d.key[0], d.key[1], d.key[6]) for d in found] == [("DDP step ms", "naive", "large")]
    assert "naive_ddp/cse599o/steps_large_fp32: 220, ddp_flat/cse599o/steps_large_fp32: 264 (20% apart)" in \
        found[0].line()
    assert len(agreement.shared_keys(tmp_path)) == 2  # the single-GPU row is shared too, and agrees
    noisy = tmp_path / "noisy"
    _ddp_steps(noisy, "naive_ddp/cse599o", 220.0, std=25.0)
    _ddp_steps(noisy, "ddp_flat/cse599o", 264.0, std=25.0)
    assert agreement.disagreements(noisy) == []
    spread = tmp_path / "spread"  # 44 ms apart against 2 x 20 ms of step-to-step spread: beyond it, so flagged
    _ddp_steps(spread, "naive_ddp/cse599o", 220.0, std=20.0)
    _ddp_steps(spread, "ddp_flat/cse599o", 264.0, std=20.0)
    assert len(agreement.disagreements(spread)) == 1
    alone = tmp_path / "alone"
    _ddp_steps(alone, "naive_ddp/cse599o", 220.0)
    assert agreement.shared_keys(alone) == set()


def _step_launches(root, naive_ms: list[float]) -> None:
    """§2.2's steps timed again in fresh launches: one steps table per launch, as rows with their round."""
    frames = []
    for r, ms in enumerate(naive_ms):
        _ddp_steps(root / "launch", "x", ms)
        frames.append(pd.read_csv(root / "launch" / "x" / "steps_large_fp32.csv").assign(round=r))
    _write(root, "naive_ddp", "step_processes", pd.concat(frames), {})


def test_a_host_bound_step_is_compared_against_its_spread_between_launches(tmp_path) -> None:
    """Two sections' eager naive steps 44 ms apart with 1 ms of step-to-step spread disagree; timed again in fresh
    launches, a standard deviation of 15 ms between them covers the gap (3 standard errors of the difference of
    two draws: 64 ms), one of 5 ms does not (21 ms); the single-GPU step, the same in every launch, keeps none."""
    _ddp_steps(tmp_path, "naive_ddp/cse599o", 220.0)
    _ddp_steps(tmp_path, "ddp_flat/cse599o", 264.0)
    assert len(agreement.disagreements(tmp_path)) == 1
    _step_launches(tmp_path, [225.0, 250.0, 230.0, 262.0, 240.0])  # std 14.7 ms
    assert agreement.disagreements(tmp_path) == []
    naive = next(c for c in agreement.shared_cells(tmp_path) if c.key[1] == "naive" and c.folder == "ddp_flat/cse599o")
    assert abs(naive.between - pd.Series([225.0, 250.0, 230.0, 262.0, 240.0]).std()) < 1e-9
    single = next(c for c in agreement.shared_cells(tmp_path) if c.key[1] == "single")
    assert single.between == 0.0
    _step_launches(tmp_path, [240.0, 245.0, 250.0, 236.0, 248.0])  # std 5.8 ms
    assert len(agreement.disagreements(tmp_path)) == 1


def test_the_eager_training_step_of_the_benchmark_and_of_the_compile_comparison_are_compared(tmp_path) -> None:
    """§1.1.3's whole step (when its run timed training steps) and §1.3's eager one share a key."""
    _write(tmp_path, "benchmarking", "timings", pd.DataFrame(
        {"size": ["small"], "status": ["ok"], "forward_mean_ms": [19.0], "total_mean_ms": [66.0],
         "total_std_ms": [0.5]}), {"context_length": 512, "mode": "train"})
    _write(tmp_path, "torch_compile", "model_timings", pd.DataFrame(
        {"size": ["small"] * 4, "mode": ["forward", "forward", "train", "train"], "compiled": [False, True] * 2,
         "status": ["ok"] * 4, "total_mean_ms": [19.5, 16.0, 81.0, 60.0], "total_std_ms": [0.1, 0.1, 1.0, 1.0]}),
        {"context_length": 512})
    (found,) = agreement.disagreements(tmp_path)
    assert found.key[:5] == ("model train step ms", "small", "fp32", 512, 4)
    assert sorted(c.value for c in found.cells) == [66.0, 81.0]  # the compiled step is not a shared cell
    forward_backward = tmp_path / "fb"  # a run of forward + backward only has no whole training step
    _write(forward_backward, "benchmarking", "timings", pd.read_csv(tmp_path / "benchmarking" / "timings.csv"),
           {"context_length": 512, "mode": "forward_backward"})
    _write(forward_backward, "torch_compile", "model_timings",
           pd.read_csv(tmp_path / "torch_compile" / "model_timings.csv"), {"context_length": 512})
    assert agreement.disagreements(forward_backward) == []


def _eager_attention(root, folder: str, table: str, forward_ms: float) -> None:
    _write(root, folder, table, pd.DataFrame([{"d_model": 128, "seq_len": 256, "status": "ok", "compiled": False,
                                               "forward_mean_ms": forward_ms, "forward_std_ms": 0.005,
                                               "backward_mean_ms": 0.7, "backward_std_ms": 0.01}]),
           {"batch_size": 8})


def test_a_launch_bound_cell_is_compared_against_its_spread_between_processes(tmp_path) -> None:
    """One process's step-to-step spread of a sub-millisecond cell is tiny, so two sections 30% apart disagree;
    once the cell has been timed in fresh processes whose standard deviation covers the gap, they do not."""
    _eager_attention(tmp_path, "pytorch_attention", "timings", 0.21)
    _eager_attention(tmp_path, "torch_compile", "attention_timings", 0.16)
    assert [d.key[0] for d in agreement.disagreements(tmp_path)] == ["eager attention forward ms"]
    rounds = [0.15, 0.19, 0.24, 0.17]  # std 0.039 for one section; the other's is smaller and does not count
    _write(tmp_path, "torch_compile", "attention_processes", pd.DataFrame(
        [{"round": r, "section": section, "d_model": 128, "seq_len": 256, "phase": phase, "ms": ms}
         for r, ms in enumerate(rounds) for section, scale in (("pytorch_attention", 1.0), ("torch_compile", 0.0))
         for phase in ("forward", "backward") for ms in [0.16 + scale * (ms - 0.16)]]), {"batch_size": 8})
    assert agreement.disagreements(tmp_path) == []
    cell = next(c for c in agreement.shared_cells(tmp_path) if c.key[0] == "eager attention forward ms")
    assert abs(cell.between - pd.Series(rounds).std()) < 1e-9
    # another batch size is another cell: its spread between processes says nothing of this one
    meta = tmp_path / "torch_compile" / "attention_processes.meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "params": {"batch_size": 4}}))
    assert len(agreement.disagreements(tmp_path)) == 1


def test_a_size_timed_in_a_lighter_mode_shares_only_the_passes_it_timed(tmp_path) -> None:
    """§1.1.3 times a size too large to train in a lighter mode: its whole "step" is then a forward pass and is
    no training step, and a forward without autograd is not the forward the other sections time."""
    _write(tmp_path, "benchmarking", "timings", pd.DataFrame(
        {"size": ["small", "xl"], "status": ["ok", "ok"], "timed_mode": ["forward", "inference"],
         "out_of_memory": ["train", "train"], "forward_mean_ms": [19.0, 240.0], "total_mean_ms": [19.5, 241.0]}),
        {"context_length": 512, "mode": "train"})
    _write(tmp_path, "torch_compile", "model_timings", pd.DataFrame(
        {"size": ["small", "small", "xl"], "mode": ["forward", "train", "forward"], "compiled": [False] * 3,
         "status": ["ok"] * 3, "total_mean_ms": [30.0, 81.0, 400.0]}), {"context_length": 512})
    (found,) = agreement.disagreements(tmp_path)  # the forward with autograd is compared ...
    assert found.key[:2] == ("model forward ms", "small")
    keys = {cell.key[:2] for cell in agreement.shared_cells(tmp_path) if cell.folder == "benchmarking"}
    assert keys == {("model forward ms", "small")}  # ... neither the lighter "step" nor the no-grad forward


def test_reconcile_compares_with_the_other_sections_median_and_names_a_wider_single_pair(tmp_path) -> None:
    _two_sections(tmp_path, 250.0)  # small: benchmarking 20.0, mixed precision 21.0
    _write(tmp_path, "nsys_profile", "summary", pd.DataFrame(
        {"size": ["small"], "context_length": [512], "status": ["ok"], "python_forward_ms": [19.0]}), {})
    text = agreement.reconcile(tmp_path, "nsys_profile", "summary", "They")
    # 19.0 against the median 20.5 is 7.3% off, so within 8% (rounded up); against mixed precision's 21.0 alone, 10%
    assert text == ("They agree with the median of the same configurations measured elsewhere (benchmarking and "
                    "mixed_precision) within 8%; against each other measurement alone, the widest gap is small fp32 "
                    "context 512, 10% from mixed_precision's.")


def test_the_2026_profiling_grid_is_compared_with_the_2025_one(tmp_path) -> None:
    """§1.1.4's 2026 grid times some of 2025's configurations again (small at 256 and 512): a pair of them 19%
    apart beyond both runs' spread is flagged, as any two sections' would be."""
    for folder, ms in (("nsys_profile", 18.93), ("nsys_profile/2026", 15.91)):
        _write(tmp_path, folder, "summary", pd.DataFrame(
            {"size": ["small"], "context_length": [256], "status": ["ok"], "python_forward_ms": [ms],
             "python_forward_std_ms": [0.4]}), {})
    (found,) = agreement.disagreements(tmp_path)
    assert found.key[:4] == ("model forward ms", "small", "fp32", 256)
    assert {c.folder for c in found.cells} == {"nsys_profile", "nsys_profile/2026"}
