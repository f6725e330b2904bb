"""The option-variant A/B of our attention: switching options once per variant, the summary against the spreads,
one-line errors, and a CPU smoke run (the Triton interpreter)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest

if "TRITON_INTERPRET" not in os.environ:  # the Triton kernels on CPU tensors (set before triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"

from cs336_systems.attention import options
from cs336_systems.benchmarking import flash_options_ab as ab
from cs336_systems.benchmarking.flash.sweep import IMPLEMENTATIONS


def test_a_variant_sets_its_options_once_per_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options change (a new generation, so new launch plans) only when another variant ran in between: calls of
    one variant in a row replay what the first recorded."""
    seen = []
    monkeypatch.setattr(ab.FlashAttentionTriton, "apply",
                        lambda q, k, v, c: seen.append((options.current().gluon_persistent, options.generation())))
    a, b = ab.VariantAttention({"gluon_persistent": True}), ab.VariantAttention({"gluon_persistent": False})
    with options.use():
        for fn in (a, a, b, b, a):
            fn(None, None, None, True)
    assert [p for p, _ in seen] == [True, True, False, False, True]
    generations = [g for _, g in seen]
    assert generations[0] == generations[1] != generations[2] == generations[3] != generations[4]
    with pytest.raises(ValueError, match="gluon_persistent must be True, False or None"):
        ab.VariantAttention({"gluon_persistent": 2})


def test_variants_are_registered_for_the_block_only() -> None:
    before = dict(IMPLEMENTATIONS)
    with options.use(gluon_backward=False):
        with ab.registered({"v1": {"gluon": False}}):
            assert isinstance(IMPLEMENTATIONS["v1"], ab.VariantAttention)
        assert IMPLEMENTATIONS == before and options.current().gluon_backward is False
    with pytest.raises(ValueError, match=r"variant names \['triton'\] are implementations already"):
        with ab.registered({"triton": {}}):
            pass


def test_the_summary_counts_only_what_moves_past_the_spreads() -> None:
    """A cell counts as slower or faster only where the ratio moves by more than the larger of the two spreads."""
    ratio = pd.DataFrame({
        "pass": ["forward"] * 4,
        "vs_b": [1.20, 0.80, 1.03, math.nan],
        "spread_a": [0.05, 0.05, 0.05, 0.05],
        "spread_b": [0.10, 0.30, 0.02, 0.05],
        "vs_best": [1.0] * 4,
    })
    row = ab.summarize(ratio, "a").iloc[0]
    assert (row["impl"], row["cells"], row["slower"], row["faster"], row["level"]) == ("b", 3, 1, 0, 2)
    assert row["geomean_over_a"] == pytest.approx((1.2 * 0.8 * 1.03) ** (1 / 3))


@pytest.mark.parametrize(("argv", "message"), [
    (["--variant", 'a={"gluon": false}', "--shape", "1,2"], "--shape takes three positive integers"),
    (["--variant", 'a={"gluon": false}', "--shape", "1,2,16"], "an A/B needs two implementations"),
    (["--variant", 'a={"gluon": false}', "--baseline", "sdpa_fast"], "unknown baseline 'sdpa_fast'"),
    (["--variant", 'a={"gluon": false}', "--variant", 'a={"gluon": true}'], "--variant names must differ"),
    (["--variant", 'a={"gluon": false}', "--dtypes", "int8"], "--dtypes takes bfloat16, float16 or float32"),
    (["--variant", 'a={"glue": false}', "--baseline", "sdpa_math"], r"variant a: unknown options \['glue'\]"),
])
def test_bad_arguments_fail_in_one_line(argv: list[str], message: str) -> None:
    from cs336_systems.benchmarking.__main__ import main

    with pytest.raises(ValueError, match=message):
        main(["flash_options_ab", *argv])


@pytest.mark.slow
def test_a_cpu_run_times_each_variant_and_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two variants and a baseline at one tiny shape through the command: a row per pass with each time and its
    ratio to the first variant, and the summary."""
    from cs336_systems.benchmarking.__main__ import main

    csv = tmp_path / "ab.csv"
    assert main(["flash_options_ab", "--variant", 'one_item={"gluon_persistent": false}',
                 "--variant", 'plain={"l2_share": null}', "--baseline", "sdpa_math", "--shape", "1,2,24",
                 "--head-dims", "16", "--causal", "true", "--rounds", "1", "--warmup-ms", "1", "--rep-ms", "1",
                 "--csv", str(csv)]) == 0
    table = pd.read_csv(csv)
    assert list(table["pass"]) == ["forward", "forward+backward"]
    assert (table["one_item_ms"] > 0).all() and (table["vs_plain"] > 0).all() and (table["vs_sdpa_math"] > 0).all()
    out = capsys.readouterr().out
    assert "over one_item's" in out and "geomean_over_one_item" in out
    assert set(IMPLEMENTATIONS) & {"one_item", "plain"} == set()
