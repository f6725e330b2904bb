"""§1.3.2's losers part (ours' kernels against cuDNN's at the worst shapes of the grid): selection, kernel
phases, summary and answer on CPU (the profile needs a GPU)."""

from __future__ import annotations

import pandas as pd
import pytest

from cs336_systems.benchmarking.flash import kernels as flash_kernels
from cs336_systems.experiments import flash_benchmarking as fb
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Table, Text

# Kernel names as torch.profiler reports them on an H100 (kernel_table cuts them at 60 characters).
OURS = {"flash_forward_kernel": 119.5, "flash_backward_dkdv_kernel": 174.7, "flash_backward_dq_kernel": 134.1,
        "flash_backward_preprocess_kernel": 22.0}
CUDNN = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_": 85.4,
         "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_": 233.5,
         "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(v": 37.8,
         "void cudnn::fusion::convert_dq_to_16bits<true>(void const*,": 31.9, "Memset (Device)": 1.5}


def test_kernels_are_sorted_into_phases() -> None:
    phases = {name: flash_kernels.kernel_phase(name) for name in (*OURS, *CUDNN)}
    assert [phases[n] for n in OURS] == ["forward", "backward", "backward", "backward"]
    assert [phases[n] for n in CUDNN] == ["forward", "backward", "backward", "backward", "other"]


def test_worst_shapes_are_the_lowest_ratios_of_the_pass() -> None:
    keys = {"dtype": "bfloat16", "batch": 8, "heads": 25, "head_dim": 64, "causal": True}
    ratio = pd.DataFrame([{**keys, "seq_len": n, "pass": p, "vs_sdpa_cudnn": r}
                          for n, p, r in ((256, "forward+backward", 0.4), (1024, "forward+backward", 0.9),
                                          (4096, "forward+backward", 1.1), (256, "forward", 0.1),
                                          (2048, "forward+backward", float("nan")))])
    worst = flash_kernels.worst_shapes(ratio, count=2)
    assert list(worst["seq_len"]) == [256, 1024] and "pass" not in worst
    with pytest.raises(ValueError, match="no 'vs_sdpa_flash' column"):
        flash_kernels.worst_shapes(ratio, "vs_sdpa_flash")


def _kernels() -> pd.DataFrame:
    keys = {"dtype": "bfloat16", "batch": 8, "heads": 25, "seq_len": 1024, "head_dim": 64, "causal": True}
    rows = [{**keys, "impl": impl, "kernel": k, "phase": flash_kernels.kernel_phase(k), "gpu_us": us}
            for impl, kernels in (("ours", OURS), ("sdpa_cudnn", CUDNN)) for k, us in kernels.items()]
    other = {**keys, "seq_len": 256}  # a shape that loses in the forward
    rows += [{**other, "impl": "ours", "kernel": "flash_forward_kernel", "phase": "forward", "gpu_us": 50.0},
             {**other, "impl": "ours", "kernel": "flash_backward_dkdv_kernel", "phase": "backward", "gpu_us": 30.0},
             {**other, "impl": "sdpa_cudnn", "kernel": "x_fprop_y", "phase": "forward", "gpu_us": 10.0},
             {**other, "impl": "sdpa_cudnn", "kernel": "x_bprop_y", "phase": "backward", "gpu_us": 25.0}]
    return pd.DataFrame(rows)


def test_summary_finds_the_phase_that_loses_most() -> None:
    s = flash_kernels.summarize_losers(_kernels()).set_index("seq_len")
    assert s.loc[1024, "ours_forward_us"] == pytest.approx(119.5)
    assert s.loc[1024, "ours_backward_us"] == pytest.approx(174.7 + 134.1 + 22.0)
    assert s.loc[1024, "cudnn_backward_us"] == pytest.approx(233.5 + 37.8 + 31.9)
    assert s.loc[1024, "cudnn_other_us"] == pytest.approx(1.5)
    assert s.loc[1024, "forward_gap_us"] == pytest.approx(34.1)
    assert s.loc[1024, "loses_most_in"] == "forward"  # 34.1 against 27.6 µs
    assert s.loc[1024, "ours_slowest_kernel"] == "flash_backward_dkdv_kernel"
    assert s.loc[256, "loses_most_in"] == "forward" and s.loc[256, "backward_gap_us"] == pytest.approx(5.0)


def test_answer_reads_the_summary(tmp_path) -> None:
    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    flash_kernels.summarize_losers(_kernels()).to_csv(folder / "losers.csv", index=False)
    (question,) = fb.answers._losers(SectionData(tmp_path, "flash_benchmarking"))
    text = " ".join(b.plain() for b in question.blocks if isinstance(b, Text))
    assert "at the 2 shapes where ours loses most to cuDNN" in text
    # ours 450.3 µs against cuDNN's 390.1 at 1,024 tokens, 80 against 35 at 256
    assert ("At 2 the kernels lose (ours' GPU time 15%–129% over cuDNN's): the larger part of the GPU gap lies in "
            "the forward at all of them") in text
    assert "no more GPU time than cuDNN" not in text  # both shapes lose on the GPU
    assert ("our slowest kernel is `flash_backward_dkdv_kernel` at 1 of them and `flash_forward_kernel` at 1 of them."
            in text)
    assert "bfloat16 (8, 25, 1024, 64) causal 120/85.4 and 331/303" in text  # ours/cuDNN forward, backward
    assert not any(isinstance(b, Table) for b in question.blocks)  # the tables are in the results index
    # the lever for each phase that loses, and only for those
    assert fb.answers.LOSER_LEVERS["forward"] in text and fb.answers.LOSER_LEVERS["backward"] not in text
    # the forward's lever names the profiled lengths' tile arithmetic (d = 64: 192-row tiles, 128-key blocks)
    assert "at 1,024 tokens and d = 64, 192-row query tiles compute 1,152 rows (11% padding)" in text
    assert "at most 8 128-key blocks" in text


def test_a_loser_whose_grid_call_far_exceeds_its_gpu_time_is_host_bound_and_gets_no_lever(tmp_path) -> None:
    """The grid's back-to-back time against the profile's GPU time: 256 tokens took 1 ms a call in the grid for
    80 µs of kernels (host-bound), 1,024 tokens about its GPU time (the kernels lose)."""
    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    flash_kernels.summarize_losers(_kernels()).to_csv(folder / "losers.csv", index=False)
    keys = {"dtype": "bfloat16", "batch": 8, "heads": 25, "head_dim": 64, "causal": True, "pass": "forward+backward"}
    pd.DataFrame([{**keys, "seq_len": 256, "triton_ms": 1.0}, {**keys, "seq_len": 1024, "triton_ms": 0.46},
                  {**keys, "seq_len": 256, "pass": "forward", "triton_ms": 0.01}]).to_csv(
        folder / "shapes_ratio.csv", index=False)
    (question,) = fb.answers._losers(SectionData(tmp_path, "flash_benchmarking"))
    text = " ".join(b.plain() for b in question.blocks if isinstance(b, Text))
    assert ("At 1 of them a call in the grid took well over its kernels' GPU time (ours, grid µs against GPU µs: "
            "bfloat16 (8, 25, 256, 64) causal 1,000 against 80.0)" in text)
    assert ("At the other one the kernels lose (ours' GPU time 15% over cuDNN's): the larger part of the GPU gap "
            "lies in the forward, and") in text
    assert "at 1,024 tokens and d = 64" in text and "at 256 tokens" not in text  # the lever names GPU losers only


def test_a_gap_inside_the_grids_spread_is_counted_and_the_hopper_backward_gets_its_own_ratio() -> None:
    """Where the five-product Hopper backward already runs, the seven-product lever does not explain the loss:
    the answer gives that backward's own ratio to cuDNN's; gaps under the grid's median spread are counted."""
    shapes = pd.DataFrame([
        {"ours_total_us": 101.0, "cudnn_total_us": 100.0, "ours_backward_us": 80.0, "cudnn_backward_us": 78.0,
         "ours_slowest_kernel": "flash_backward_dkdv_gluon_kernel"},
        {"ours_total_us": 125.0, "cudnn_total_us": 100.0, "ours_backward_us": 90.0, "cudnn_backward_us": 70.0,
         "ours_slowest_kernel": "flash_backward_dkdv_kernel"}])
    assert fb.answers._gpu_gaps(shapes, {"forward+backward": {"spread_median": 0.03}}) == (
        " (ours' GPU time 1.0%–25% over cuDNN's; at 1 by less than the grid's median round-to-round spread, 3.0%)")
    faster = pd.concat([shapes, shapes.iloc[:1].assign(ours_total_us=90.0)], ignore_index=True)
    assert fb.answers._gpu_gaps(faster, None) == " (ours' GPU time 1.0%–25% over cuDNN's at 2; no more than cuDNN's at 1)"
    lever = fb.answers._backward_lever(shapes)
    assert lever.startswith(fb.answers.LOSER_LEVERS["backward"])
    assert "at the 1 backward-bound shape where the Hopper backward runs, it issues cuDNN's five products and takes " \
           "1.03× its backward GPU time" in lever
    assert fb.answers._backward_lever(shapes.iloc[1:]) == fb.answers.LOSER_LEVERS["backward"]
    # every backward-bound shape already on the Hopper backward: the seven-product lever is not the reason
    assert fb.answers._backward_lever(shapes.iloc[:1]).startswith("in the backward; at the 1 backward-bound shape")


def test_losers_part_on_cpu_says_what_it_needs(tmp_path, monkeypatch, capsys) -> None:
    from cs336_systems.experiments.__main__ import main

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["flash_benchmarking", "--smoke", "--set", "parts=losers"]) == 0
    assert "losers skipped: it profiles GPU kernels, which needs a GPU" in capsys.readouterr().out
    with pytest.raises(ValueError, match="losers.count must be positive"):
        fb.Params(parts=["losers"], losers=fb.Losers(count=0)).check()


def test_naive_sentence_says_which_pass_ran_out_of_memory_and_checks_ours_did_not() -> None:
    import pandas as pd

    from cs336_systems.experiments.flash_benchmarking.answers import _naive_sentence

    sp = pd.DataFrame({"pass": ["forward+backward"] * 2, "dtype": ["bf16"] * 2, "seq_len": [1024, 65536],
                       "speedup_vs_naive": [2.0, 5.0]})
    sweep = pd.DataFrame({"impl": ["naive", "triton", "triton", "sdpa_cudnn"], "status": ["OOM", "ok", "OOM", "unsupported"],
                          "pass": ["forward+backward"] * 4, "dtype": ["bf16"] * 4,
                          "seq_len": [65536, 65536, 131072, 65536]})  # another backend's failure is not ours
    text = _naive_sentence(sp, sweep).markdown
    assert "at 65,536 tokens 0.200×;" in text  # one cell: no range of one value
    assert "PyTorch's forward + backward runs out of memory at 65,536 tokens (its forward alone not measured " \
           "there), ours from 131,072." in text
    assert text.endswith("ours does not.") is False
    assert _naive_sentence(sp, sweep.iloc[[0, 1, 3]]).markdown.endswith("ours does not.")
    forward = pd.DataFrame({"impl": ["naive"], "status": ["ok"], "pass": ["forward"], "dtype": ["bf16"],
                            "seq_len": [65536]})
    assert "(its forward alone runs there)" in _naive_sentence(sp, pd.concat([sweep, forward])).markdown
    # cells where ours is slower: named by head size, with the pass that loses
    sp2 = pd.DataFrame({"pass": ["forward+backward", "forward", "backward"] * 2, "dtype": ["fp32"] * 6,
                        "head_dim": [128] * 3 + [64] * 3, "seq_len": [2048] * 3 + [4096] * 3,
                        "speedup_vs_naive": [0.8, 1.2, 0.7, 2.0, 2.0, 2.0]})
    said = _naive_sentence(sp2, None).markdown
    assert ("ours is slower in 1 of 2 cells (d = 128 at 2,048 tokens): in every one of them our backward is the "
            "slower pass and our forward is faster") in said
