"""The two sections' eager attention timed in fresh processes, alternating (the disagreement diagnostic)."""

from __future__ import annotations

import argparse

import pandas as pd
import pytest

from cs336_systems.benchmarking import attention_process_ab as ab


def test_each_round_starts_one_process_per_section_in_alternating_order(monkeypatch) -> None:
    calls: list[str] = []

    def fake(section, cells, n, batch, device):
        calls.append(section)
        return [{"d_model": d, "seq_len": s, "forward_ms": 1.0 if section == "torch_compile" else 2.0,
                 "backward_ms": 3.0} for d, s in cells]

    monkeypatch.setattr(ab, "one_process", fake)
    df = ab.measure(cells=[(16, 256)], rounds=3)
    assert calls == ["pytorch_attention", "torch_compile", "torch_compile", "pytorch_attention",
                     "pytorch_attention", "torch_compile"]
    table = ab.summarize(df).set_index("phase")
    assert table.loc["forward", "pytorch_attention_over_torch_compile"] == 2.0
    assert table.loc["backward", "pytorch_attention_over_torch_compile"] == 1.0
    assert table.loc["forward", "torch_compile_spread_ms"] == 0.0


def test_a_real_process_times_the_cells_and_bad_input_is_one_line() -> None:
    rows = ab.one_process("pytorch_attention", [(16, 16)], n=2, batch=1, device="cpu")
    assert [(r["d_model"], r["seq_len"]) for r in rows] == [(16, 16)] and rows[0]["forward_ms"] > 0
    with pytest.raises(ValueError, match="section must be one of"):
        ab.one_process("nsys_profile", [(16, 16)], 2, 1, "cpu")
    with pytest.raises(ValueError, match="must be positive"):
        ab.measure(rounds=0)
    with pytest.raises(ValueError, match="--cell is D,SEQ"):
        ab.run_command(argparse.Namespace(cell=["16"], rounds=1, n=1, batch=1, device="cpu"))
    assert isinstance(ab.summarize(pd.DataFrame([
        {"round": 0, "section": s, "d_model": 16, "seq_len": 16, "phase": "forward", "ms": 1.0}
        for s in ab.SECTIONS])), pd.DataFrame)
