"""§1.1.7's measurements at a tiny shape on CPU: a block's residuals, eager and compiled, and checkpointed steps."""

from __future__ import annotations

import math

import pytest
import torch

from cs336_systems.experiments import gradient_checkpointing as gc
from cs336_systems.profiling.residuals import FROM_OUTSIDE, UNNAMED, residuals_by_op

SMOKE = gc.PRESETS["smoke"]


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


def test_checkpointed_steps_count_what_they_hold() -> None:
    n = SMOKE.config().num_layers
    plain = gc.checkpointed_step(SMOKE, 0, torch.device("cpu"))
    segments = gc.checkpointed_step(SMOKE, 2, torch.device("cpu"))
    assert plain["levels"] == "[]" and plain["held_block_activations"] == n
    assert segments["levels"] == "[2]" and segments["held_block_activations"] == n // 2 + 2
    assert plain["step_ms"] > 0 and math.isnan(plain["peak_GiB"])  # peak memory is a CUDA measurement


def test_bad_parameters_fail_in_one_line() -> None:
    section = gc.SECTION
    with pytest.raises(ValueError, match="block sizes are >= 0"):
        section.params("smoke", {"block_sizes": [-1]})
    with pytest.raises(ValueError, match="the 2026 handout has no '2.7B' model"):
        section.params("smoke", {"preset": "2.7B@2026"})
    assert section.params("full").config().d_model == 2560  # 2026's xl, not 2025's
