"""§1.1.7's measurements at a tiny shape on CPU: a block's residuals, eager and compiled, and checkpointed steps."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from cs336_systems.experiments import gradient_checkpointing as gc
from cs336_systems.profiling.residuals import FROM_OUTSIDE, UNNAMED, residuals_by_op

SMOKE = gc.PRESETS["smoke"]


@pytest.mark.slow
def test_a_blocks_residuals_eager_and_compiled() -> None:
    eager = gc.block_residuals(SMOKE, torch.device("cpu"), compiled=False)
    by_op = residuals_by_op(eager)
    assert by_op["bytes"].sum() > 0 and {"mm", "bmm"} & set(by_op["op"])  # the projections keep their inputs
    compiled = gc.block_residuals(SMOKE, torch.device("cpu"), compiled=True)
    assert set(compiled["op"]) <= {UNNAMED, FROM_OUTSIDE}
    assert (compiled["op"] == FROM_OUTSIDE).any()  # the block's input and weights are saved, and left out
    d = SMOKE.config().d_model
    inputs = compiled[compiled["op"] == FROM_OUTSIDE]
    assert (inputs["bytes"] == SMOKE.batch_size * SMOKE.context_length * d * 4).any()  # x itself, fp32


@pytest.mark.slow
def test_checkpointed_steps_count_what_they_hold() -> None:
    n = SMOKE.config().num_layers
    plain = gc.checkpointed_step(SMOKE, 0, torch.device("cpu"))
    segments = gc.checkpointed_step(SMOKE, 2, torch.device("cpu"))
    assert plain["levels"] == "[]" and plain["held_block_activations"] == n
    assert segments["levels"] == "[2]" and segments["held_block_activations"] == n // 2 + 2
    assert plain["step_ms"] > 0 and math.isnan(plain["peak_GiB"])  # peak memory is a CUDA measurement
    assert math.isnan(plain["backward_peak_GiB"])  # read as the optimizer step begins: the hook ran


def test_a_tie_on_the_step_peak_says_where_the_peak_came() -> None:
    tied = pd.DataFrame({"block_size": [gc.SUBLAYER, 1.0], "peak_GiB": [71.9, 71.9]})
    assert "equal to the MiB" in gc._where_the_peak_is(tied) and "cannot tell" in gc._where_the_peak_is(tied)
    later = tied.assign(backward_peak_GiB=[60.1, 63.4])
    assert "each comes in the optimizer step" in gc._where_the_peak_is(later)
    assert "60.1 GiB (checkpointing by sublayer) and 63.4 GiB (segments of 1 block)" in gc._where_the_peak_is(later)
    inside = tied.assign(backward_peak_GiB=[71.9, 71.9])  # the same moment of the backward: explained
    assert "first block's attention backward" in gc._where_the_peak_is(inside)
    assert "the measurement rejects the hypothesis" in gc._where_the_peak_is(inside)
    apart = tied.assign(peak_GiB=[71.9, 72.3], backward_peak_GiB=[71.9, 72.3])  # inside the backward, not tied
    assert "splitting a block does not lower the peak" in gc._where_the_peak_is(apart)
    assert "attention backward" not in gc._where_the_peak_is(apart)
    assert "does not lower" in gc._where_the_peak_is(tied.assign(peak_GiB=[71.9, 72.3]))


def test_bad_parameters_fail_in_one_line() -> None:
    section = gc.SECTION
    with pytest.raises(ValueError, match=r"whole blocks >= 0 \(0: no checkpointing\) or 0.5 \(by sublayer\), got -1"):
        section.params("smoke", {"block_sizes": [-1]})
    with pytest.raises(ValueError, match="the 2026 handout has no '2.7B' model"):
        section.params("smoke", {"preset": "2.7B@2026"})
    assert section.params("full").config().d_model == 2560  # 2026's xl, not 2025's


def test_the_sweep_gains_mfu_where_its_record_names_the_model(tmp_path) -> None:
    import json

    import pandas as pd

    from cs336_systems.configs import step_flops
    from cs336_systems.hardware import peak_tflops
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "gradient_checkpointing"
    folder.mkdir()
    pd.DataFrame({"block_size": [0, 4], "status": ["OOM", "ok"], "step_ms": [float("nan"), 500.0]}).to_csv(
        folder / "checkpointing.csv", index=False)
    meta = {"device": "NVIDIA H100 80GB HBM3", "float32_matmul_precision": "highest",
            "params": {"run_preset": "full", "preset": "small", "batch_size": 4, "context_length": 128}}
    (folder / "checkpointing.meta.json").write_text(json.dumps(meta))
    frame = gc._with_mfu(SectionData(tmp_path, "gradient_checkpointing"))
    expected = step_flops("small", 4, 128, "train") / 0.5 / 1e12 / peak_tflops(meta["device"], "fp32") * 100
    assert frame["MFU_pct"].iloc[1] == pytest.approx(expected) and pd.isna(frame["MFU_pct"].iloc[0])
    # an older record, whose "preset" is the run's: no model, no MFU
    meta["params"] = {"preset": "full", "batch_size": 4, "context_length": 128}
    (folder / "checkpointing.meta.json").write_text(json.dumps(meta))
    assert "MFU_pct" not in gc._with_mfu(SectionData(tmp_path, "gradient_checkpointing")).columns


def test_backward_by_block_reads_the_memory_at_each_block_and_the_answer_derives_the_gradients() -> None:
    """Every block's backward start and end are recorded, last block first; the answer turns the median drop
    into the gradients written (what the block saved, its input included, less the drop) and checks them against
    the weights' and the input's gradients."""
    table = gc.backward_by_block(SMOKE, torch.device("cpu"))
    assert list(table["block"]) == list(reversed(range(SMOKE.backward_layers)))
    assert {"start_MiB", "end_MiB", "drop_MiB"} <= set(table.columns)
    meta = {"params": {"preset": "xl@2026"}}
    saved, inputs = 7990 * 2**20, 80 * 2**20
    drops = pd.DataFrame({"block": [3, 2, 1, 0], "drop_MiB": [7590.0, 7590.0, 7589.0, 7591.0]})
    text = gc._measured_gradients(drops, meta, saved, inputs).markdown
    assert "drops by 7,590 MiB" in text and "so its backward left 480 MiB of gradients behind" in text
    assert "Expected: its weights' 400 MiB, plus its input's 80.0 MiB gradient" in text
    assert text.endswith("480 MiB, and the measurement is within 1% of it.")
    off = gc._measured_gradients(drops.assign(drop_MiB=7110.0), meta, saved, inputs).markdown
    assert "and the measurement is 2.00× of that, more than they account for" in off
    assert gc._measured_gradients(drops.assign(drop_MiB=float("nan")), meta, saved, inputs) is None


def test_the_per_block_backward_is_plotted_where_it_was_measured() -> None:
    table = pd.DataFrame({"block": [3, 2, 1, 0], "start_MiB": [41140.0, 33470.0, 25800.0, 18130.0],
                          "end_MiB": [33550.0, 25880.0, 18210.0, 10530.0]}).assign(
        drop_MiB=lambda f: f["start_MiB"] - f["end_MiB"])
    derived = gc.derive({"backward_by_block": table}, {"device": "NVIDIA H200", "torch": "2.11"})
    fig, source = derived.figures["backward_memory"]
    assert source == "backward_by_block"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["block 3", "block 2", "block 1", "block 0"]
    assert "−7.41 GiB" in [t.get_text() for t in fig.axes[0].texts]
    cpu = table.assign(start_MiB=float("nan"), end_MiB=float("nan"), drop_MiB=float("nan"))
    assert gc.derive({"backward_by_block": cpu}, {}).figures == {}


def test_each_further_block_per_segment_is_set_against_one_blocks_residuals() -> None:
    """(b) reads the peak's growth per block from the sweep (median over whole-block sizes), which says the
    peak is set while a segment is recomputed; fewer than three whole-block sizes say nothing."""
    sweep = pd.DataFrame({"block_size": [0.5, 1.0, 2.0, 4.0, 8.0], "peak_GiB": [65.28, 65.28, 72.76, 87.74, 117.7]})
    text = gc._per_block(sweep, 7990 * 2**20)
    assert text == " Each further block per segment adds 7.49 GiB to the peak (1 to 8 blocks), about one block's " \
        "residuals (7.80 GiB)."
    assert gc._per_block(sweep.iloc[:3], 7990 * 2**20) == ""


def test_the_sweep_table_drops_the_forward_backward_peak_where_it_is_the_steps_peak() -> None:
    """Rows that ran out of memory (no peaks) do not keep a column that equals the peak in every row that ran."""
    from cs336_systems.report.data import SectionData

    class Data(SectionData):
        def __init__(self, frame: pd.DataFrame) -> None:
            self._frame = frame

        def frame(self, name: str) -> pd.DataFrame:
            return self._frame

        def meta(self, name: str) -> dict:
            return {}

    sweep = pd.DataFrame({"block_size": [0.0, 1.0, 2.0], "status": ["OOM", "ok", "ok"],
                          "peak_GiB": [None, 65.28, 72.76], "activation_peak_GiB": [None, 27.1, 34.6],
                          "backward_peak_GiB": [None, 65.28, 72.76], "step_ms": [None, 6249.0, 6386.0]})
    assert "fwd_bwd_peak_GiB" not in gc._shown_sweep(Data(sweep)).columns
    apart = sweep.assign(backward_peak_GiB=[None, 60.0, 72.76])
    assert "fwd_bwd_peak_GiB" in gc._shown_sweep(Data(apart)).columns


def test_the_attention_residuals_are_named_beside_their_producing_ops() -> None:
    assert gc._SAVED_AS["div"] == " (the probabilities)" and "mm" not in gc._SAVED_AS  # named only where certain
    # a matmul's or a copy's outputs are named only where every one has the shape the name implies
    meta = {"extra": {"shape": [8, 32, 2, 2], "batch_size": 2, "context_length": 4}}
    table = pd.DataFrame({"op": ["mm", "mm", "clone", "silu"], "shape": ["(2, 4, 32)", "(2, 4, 32)", "(4, 2, 8)",
                                                                        "(2, 4, 32)"],
                          "bytes": [1024, 1024, 256, 1024]})
    assert gc._saved_as("mm", table, meta) == " (the feed-forward's $W_1x$ and $W_3x$)"
    assert gc._saved_as("clone", table, meta).startswith(" (contiguous copies of $Q$")
    assert gc._saved_as("mm", table.assign(shape=["(2, 4, 32)", "(2, 4, 8)", "(4, 2, 8)", "(2, 4, 32)"]), meta) == ""
    assert gc._saved_as("mm", table, {}) == "" and gc._saved_as("silu", table, meta) == ""
    top = table.groupby("op")["bytes"].sum().sort_values(ascending=False).reset_index().head(1)  # mm, 2048
    assert gc._tied_with_last(table.assign(bytes=[512, 512, 256, 1024]), top.assign(bytes=1024.0)) == \
        "; silu saves as much as mm"  # mm is shown: only the op the cut left out is named
