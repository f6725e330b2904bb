"""Activation checkpointing (flat and nested) and the saved-residuals accounting, on CPU."""

from __future__ import annotations

import pytest
import torch
from cs336_basics.model import BasicsTransformerLM, TransformerBlock

from cs336_systems.checkpointing import SegmentedLayers, checkpoint_layers, stored_block_activations
from cs336_systems.profiling.residuals import FROM_OUTSIDE, residuals_by_op, saved_residuals



def _best_segment(table, block_bytes=None, input_bytes=None, preset=None):
    """(b) in one text, as the answer joins its parts: the measured answer, its neighbours, the reasoning and
    what the sweep showed."""
    from cs336_systems.experiments.gradient_checkpointing import _best_segment_parts
    from cs336_systems.report.document import Text

    parts = _best_segment_parts(table, block_bytes, input_bytes, preset)
    if parts is None:
        return None
    return Text(parts["measured"] + parts["neighbours"] + (" " + parts["heads"] + parts["reasoning"]).rstrip()
                + parts["shown"])

def _model(seed: int = 0) -> BasicsTransformerLM:
    torch.manual_seed(seed)
    return BasicsTransformerLM(vocab_size=64, context_length=16, d_model=32, num_layers=8, num_heads=4, d_ff=64,
                               attention_impl="sdpa")


def _grads(model: BasicsTransformerLM, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(tokens).logsumexp(-1).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _saved_bytes(model: BasicsTransformerLM, tokens: torch.Tensor) -> int:
    return int(saved_residuals(lambda: model(tokens))["bytes"].sum())


@pytest.mark.slow
@pytest.mark.parametrize("levels", [[1], [3], [4, 2], [8, 4, 2]])
def test_checkpointed_model_has_the_same_gradients_and_saves_less(levels: list[int]) -> None:
    tokens = torch.randint(0, 64, (2, 16))
    plain, ckpt = _model(), _model()
    want = _grads(plain, tokens)
    before = _saved_bytes(ckpt, tokens)
    keys = list(ckpt.state_dict())
    checkpoint_layers(ckpt, levels)
    assert isinstance(ckpt.layers, SegmentedLayers) and list(ckpt.state_dict()) == keys  # same names
    assert isinstance(ckpt.layers[0], TransformerBlock) and len(ckpt.layers) == 8
    for a, b in zip(_grads(ckpt, tokens), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _saved_bytes(ckpt, tokens) < before / 2  # only segment inputs (and the head's) stay saved
    with torch.no_grad():
        torch.testing.assert_close(ckpt(tokens), plain(tokens))
    checkpoint_layers(ckpt, [])  # off again
    assert _saved_bytes(ckpt, tokens) == before


@pytest.mark.parametrize("levels", [[], [4]])
def test_checkpointing_by_sublayer_has_the_same_gradients_and_keeps_two_inputs_per_block(levels: list[int]) -> None:
    tokens = torch.randint(0, 64, (2, 16))
    plain, ckpt = _model(), _model()
    want = _grads(plain, tokens)
    before = _saved_bytes(ckpt, tokens)
    checkpoint_layers(ckpt, levels, sublayers=True)
    assert "by sublayer" in repr(ckpt.layers)
    for a, b in zip(_grads(ckpt, tokens), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    saved = saved_residuals(lambda: ckpt(tokens))
    if not levels:  # 8 blocks x 2 branch inputs of (2, 16, 32) fp32 stay saved, beside the head's tensors
        stream = saved[saved["shape"].astype(str) == str((2, 16, 32))]
        assert len(stream) >= 16 and _saved_bytes(ckpt, tokens) < before / 2
    with torch.no_grad():
        torch.testing.assert_close(ckpt(tokens), plain(tokens))


def test_checkpointing_by_sublayer_needs_pre_norm_blocks() -> None:
    model = _model()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
    with pytest.raises(ValueError, match="needs pre-norm blocks with ln1, attn, ln2, ffn; Linear lacks ln1"):
        checkpoint_layers(model, [], sublayers=True)


def test_peak_block_activations_of_a_schedule() -> None:
    assert stored_block_activations(48, []) == 48
    assert stored_block_activations(48, [1]) == 48 + 1
    assert stored_block_activations(48, [6]) == 8 + 6  # N/k + k, least near k = sqrt(N)
    assert min(range(1, 49), key=lambda k: stored_block_activations(48, [k])) in (6, 7, 8)
    assert stored_block_activations(48, [12, 3]) == 4 + 4 + 3


def test_bad_checkpoint_arguments() -> None:
    with pytest.raises(ValueError, match="segment sizes must be positive"):
        checkpoint_layers(_model(), [0])
    with pytest.raises(ValueError, match="must not grow inward"):
        checkpoint_layers(_model(), [2, 4])
    with pytest.raises(ValueError, match="exceed the model's 8 blocks"):
        checkpoint_layers(_model(), [9])
    with pytest.raises(ValueError, match="ModuleList `layers`"):
        checkpoint_layers(torch.nn.Linear(2, 2), [1])


def test_saved_residuals_of_a_linear_and_a_block() -> None:
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8, requires_grad=True)
    table = saved_residuals(lambda: torch.relu(lin(x)))
    # relu saves its output (made by relu); addmm saves x (and the weight): both from outside
    assert set(table["op"]) == {"relu", FROM_OUTSIDE}
    assert table.loc[table["op"] == "relu", "bytes"].item() == 5 * 4 * 4
    block = _model().layers[0]
    h = torch.randn(2, 16, 32, requires_grad=True)
    by_op = residuals_by_op(saved_residuals(lambda: block(h)), top=5)
    assert len(by_op) <= 5 and by_op["share"].sum() <= 1.0 + 1e-9 and by_op["bytes"].is_monotonic_decreasing
    assert FROM_OUTSIDE not in set(by_op["op"])


def test_checkpointing_answer_names_the_sublayer_split_and_its_neighbours() -> None:
    import pandas as pd

    from cs336_systems.experiments.gradient_checkpointing import Params

    table = pd.DataFrame({"block_size": [0, 0.5, 1, 2], "status": ["OOM", "ok", "ok", "OOM"],
                          "peak_GiB": [None, 66.0, 74.7, None], "activation_peak_GiB": [None, 8.5, 17.2, None],
                          "step_ms": [None, 7000.0, 6600.0, None]})
    text = _best_segment(table, block_bytes=17 * 2**30, input_bytes=80 * 2**20, preset="xl@2026").markdown
    assert ("Best, measured: each block by sublayer (its attention and feed-forward branches checkpointed "
            "separately), a peak of 66.0 GiB, 8.50 GiB of it allocated during the step above the 57.5 GiB held "
            "between steps (the fp32 weights and AdamW state are 38.1 GiB of it, the other 19.4 GiB are neither the "
            "model's nor the optimizer's;") in text
    # neighbours by the memory a segment size holds: the next coarser is 1 block; no checkpointing is the coarsest
    assert "Its neighbours: segments of 1 block: a peak of 74.7 GiB (17.2 GiB above what it held before the step)." in text
    assert "= 0.38, below one block, so the finest split should give the lowest peak" in text  # sqrt(32 * 80 MiB / 17 GiB)
    with pytest.raises(ValueError, match=r"whole blocks >= 0 \(0: no checkpointing\) or 0.5 \(by sublayer\), got 1.5"):
        Params(block_sizes=[0, 1.5]).check()


def test_checkpointing_only_the_first_blocks_keeps_gradients_and_saves_in_between() -> None:
    tokens = torch.randint(0, 64, (2, 16))
    plain, part, every = _model(), _model(), _model()
    want = _grads(plain, tokens)
    before = _saved_bytes(plain, tokens)
    checkpoint_layers(part, [1], first=4)
    checkpoint_layers(every, [1])
    assert "first 4 of 8 blocks" in repr(part.layers) and len(list(iter(part.layers))) == 8
    for a, b in zip(_grads(part, tokens), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _saved_bytes(every, tokens) < _saved_bytes(part, tokens) < before  # half the blocks: half the saving
    checkpoint_layers(part, [1], first=0)
    assert _saved_bytes(part, tokens) == before
    with pytest.raises(ValueError, match="first must be between 0 and the model's 8 blocks, got 9"):
        checkpoint_layers(_model(), [1], first=9)


def test_checkpointing_answer_reports_a_whole_block_win_when_the_model_predicted_the_split() -> None:
    import pandas as pd

    table = pd.DataFrame({"block_size": [0.5, 1, 2], "status": ["ok", "ok", "OOM"], "peak_GiB": [80.0, 74.7, None],
                          "activation_peak_GiB": [23.0, 17.2, None], "step_ms": [7000.0, 6600.0, None]})
    table["peak_GiB"] = [80.7, 74.7, None]  # the same memory resident between steps in both rows
    text = _best_segment(table, block_bytes=17 * 2**30, input_bytes=80 * 2**20, preset="xl@2026").markdown
    assert text.startswith("Best, measured: segments of 1 block, a peak of 74.7 GiB, 17.2 GiB of it allocated")
    assert "below one block, so the finest split should give the lowest peak" in text
    assert "checkpointing by sublayer: a peak of 80.7 GiB (23.0 GiB above what it held before the step)" in text

    unswept = _best_segment(table[table["block_size"] != 0.5], block_bytes=17 * 2**30, input_bytes=80 * 2**20,
                            preset="xl@2026").markdown
    assert unswept.endswith(" The sweep did not try the split below one block (block size 0.5).")


def test_checkpointing_answer_compares_on_the_steps_memory_and_names_a_row_with_leftovers() -> None:
    """A configuration run after an out-of-memory one may still hold its tensors between steps: its total peak is
    inflated, so configurations are compared on what the step itself allocates, and a tie is called a tie."""
    import pandas as pd

    table = pd.DataFrame({"block_size": [0, 0.5, 1, 2], "status": ["OOM", "ok", "ok", "ok"],
                          "peak_GiB": [None, 109.9, 71.9, 79.4], "activation_peak_GiB": [None, 27.0, 27.1, 34.6],
                          "step_ms": [None, 6174.0, 6242.0, 6378.0]})
    text = _best_segment(table, block_bytes=7990 * 2**20, input_bytes=80 * 2**20, preset="xl@2026").markdown
    assert ("Best, measured: checkpointing by sublayer and segments of 1 block, within 1% of each other; segments of 1 "
            "block, a peak of 71.9 GiB, 27.1 GiB of it allocated during the step above the 44.8 GiB held between steps") in text
    assert ("Their neighbours: segments of 2 blocks: a peak of 79.4 GiB (34.6 GiB above what it held before the step); checkpointing "
            "by sublayer's own peak of 110 GiB is not comparable: it held 38.1 GiB more between steps, left from the "
            "out-of-memory run before it.") in text
    assert text.endswith("So at this shape splitting a block does not lower the step's peak.")
    clean = table.assign(peak_GiB=[None, 71.8, 71.9, 79.4])  # no leftovers: the lower one leads the tie
    assert _best_segment(clean, preset="xl@2026").markdown.startswith(
        "Best, measured: checkpointing by sublayer and segments of 1 block, within 1% of each other; checkpointing by "
        "sublayer, a peak of 71.8 GiB")


def test_checkpointing_answer_names_memory_left_by_the_jobs_earlier_parts() -> None:
    """Memory allocated before a configuration's model was built is the job's, not the configuration's: the
    answer attributes what is held between steps beyond weights and AdamW state to it when the two agree."""
    import pandas as pd

    table = pd.DataFrame({"block_size": [0.5, 1], "status": ["ok", "ok"], "peak_GiB": [80.0, 71.9],
                          "activation_peak_GiB": [35.2, 27.1], "step_ms": [6174.0, 6242.0]})
    unknown = _best_segment(table, preset="xl@2026").markdown
    assert "the other 6.73 GiB are neither the model's nor the optimizer's" in unknown
    left = _best_segment(table.assign(leftover_GiB=[6.7, 6.7]), preset="xl@2026").markdown
    assert ("and 6.70 GiB were allocated before this configuration's model was built, by the measurement of one "
            "block's residuals that ran first in the same process; without them the peak is 65.2 GiB") in left
    assert "neither the model's" not in left
    clean = _best_segment(table.assign(leftover_GiB=[0.0, 0.0]), preset="xl@2026").markdown
    assert "the other 6.73 GiB are neither the model's nor the optimizer's" in clean


def test_checkpointing_answer_leads_with_identical_peaks_then_neighbours_then_reasoning() -> None:
    import pandas as pd

    table = pd.DataFrame({"block_size": [0, 0.5, 1, 2], "status": ["OOM", "ok", "ok", "ok"],
                          "peak_GiB": [None, 65.28, 65.28, 72.76], "activation_peak_GiB": [None, 27.1, 27.1, 34.6],
                          "step_ms": [None, 6178.0, 6249.0, 6386.0]})
    text = _best_segment(table, block_bytes=7990 * 2**20, input_bytes=80 * 2**20, preset="xl@2026").markdown
    assert text.startswith("Best, measured: checkpointing by sublayer and segments of 1 block, which peak "
                           "identically; checkpointing by sublayer, a peak of 65.3 GiB")
    neighbours, reasoning = text.index("Their neighbours: segments of 2 blocks"), text.index("Segments of $k$ blocks")
    assert neighbours < reasoning and "This is the model table's xl, with 32 heads" in text


def test_checkpointing_answer_in_the_handouts_form_reasons_measures_and_concludes() -> None:
    """(b)'s main text: the reasoning and hypothesis, the best strategy's peak and its neighbour, the verdict; the
    accounting of the peak goes to the appendix."""
    import pandas as pd

    from cs336_systems.experiments.gradient_checkpointing import _best_segment_parts

    table = pd.DataFrame({"block_size": [0, 0.5, 1, 2], "status": ["OOM", "ok", "ok", "ok"],
                          "peak_GiB": [None, 65.28, 65.28, 72.76], "activation_peak_GiB": [None, 27.1, 27.1, 34.6],
                          "step_ms": [None, 6180.0, 6249.0, 6386.0], "leftover_GiB": [None, 0.03, 0.03, 0.03],
                          "backward_peak_GiB": [None, 65.28, 65.28, 72.76]})
    parts = _best_segment_parts(table, block_bytes=7990 * 2**20, input_bytes=80 * 2**20, preset="xl@2026")
    assert parts["reasoning"].startswith("Segments of $k$ blocks hold $N/k$ block inputs")
    assert parts["peak_only"] == ("Best, measured: checkpointing by sublayer and segments of 1 block, which peak "
                                  "identically at 65.3 GiB (one step 6.18 s and 6.25 s).")  # each its own
    assert parts["verdict"].startswith(" The measurement rejects the hypothesis")
    assert "held between steps" in parts["measured"] and "held between steps" not in parts["peak_only"]
    apart = _best_segment_parts(table.assign(peak_GiB=[None, 65.0, 65.28, 72.76]), block_bytes=7990 * 2**20,
                                input_bytes=80 * 2**20, preset="xl@2026")
    assert apart["verdict"] == ""  # not identical: no claim that both hold the same tensors
    # no hypothesis stated (the residuals were not measured), or the peak set after the backward: no verdict
    assert _best_segment_parts(table, preset="xl@2026")["verdict"] == ""
    later = table.assign(backward_peak_GiB=[None, 60.0, 61.0, 70.0])
    assert _best_segment_parts(later, block_bytes=7990 * 2**20, input_bytes=80 * 2**20,
                               preset="xl@2026")["verdict"] == ""
