"""The accuracy benchmark: its blocked float64 reference, its per-shape errors and its verdicts.

On CPU, ours runs through Triton's interpreter (as in ``test_flash_attention``), SDPA's flash backend has a
CPU kernel and its cuDNN backend declines, which exercises the ``unsupported`` path."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.attention import reference_attention
from cs336_systems.benchmarking import flash_accuracy as fa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n_queries", "n_keys", "causal", "block_rows"),
                         [(19, 19, True, 4), (19, 19, False, 7), (13, 29, True, 5), (29, 13, True, 3),
                          (8, 8, True, None)])
def test_blocked_reference_equals_autograd_through_full_attention(n_queries, n_keys, causal, block_rows) -> None:
    """Blocks of query rows (including a last, shorter block) give what autograd through the whole score
    matrix gives, to float64 round-off; with more queries than keys the rows past the keys see every key."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(n_queries, 24, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(n_keys, 24, generator=g, dtype=torch.float64) for _ in range(2))
    got = fa.reference_head(q, k, v, do, causal, block_rows=block_rows)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, _ = reference_attention(*leaves, is_causal=causal)
    o.backward(do)
    want = {"o": o.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    for name in fa.OUTPUTS:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_reference_rejects_what_is_not_one_head() -> None:
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one head"):
        fa.reference_head(q[None], q, q, q, True)
    with pytest.raises(ValueError, match="one head"):
        fa.reference_head(q, torch.randn(4, 16), torch.randn(4, 16), q, True)
    with pytest.raises(ValueError, match="block_rows must be at least 1"):
        fa.reference_head(q, q, q, q, True, block_rows=0)


def test_checked_heads_are_the_first_and_the_last() -> None:
    assert fa.checked_heads(4, 8) == [(0, 0), (3, 7)]
    assert fa.checked_heads(1, 1) == [(0, 0)]


def test_errors_per_implementation_and_output() -> None:
    """Ours and SDPA's flash backend are measured against float64 on the same inputs; their float32 errors are
    round-off sized; a backend that declines the inputs is ``unsupported`` for every output, not an error."""
    impls = ("ours", "sdpa_flash", "sdpa_cudnn") if DEVICE == "cpu" else ("ours", "sdpa_flash")
    rows = pd.DataFrame(fa.measure_shape((2, 2, 33, 16), torch.float32, True, impls, device=DEVICE))
    assert len(rows) == len(impls) * len(fa.OUTPUTS)
    assert set(rows["heads_checked"]) == {2}
    ran = rows[rows["status"] == fa.OK]
    assert set(ran["impl"]) == {"ours", "sdpa_flash"}
    assert (ran["error"] > 0).all() and (ran["error"] < 1e-3 * ran["reference_max"].clip(lower=1)).all()
    if DEVICE == "cpu":
        declined = rows[rows["impl"] == "sdpa_cudnn"]
        assert (declined["status"] == fa.UNSUPPORTED).all() and declined["error"].isna().all()
        assert declined["note"].str.len().gt(0).all()
    with pytest.raises(ValueError, match="batch,heads,seq,head_dim"):
        fa.measure_shape((2, 33, 16), torch.float32, True, impls, device=DEVICE)


def _row(impl: str, output: str, error: float, status: str = fa.OK, seq: int = 64) -> dict:
    return {"dtype": "bfloat16", "batch": 1, "heads": 2, "seq_len": seq, "head_dim": 64, "causal": True,
            "heads_checked": 2, "impl": impl, "output": output, "status": status, "error": error,
            "reference_max": 4.0, "note": ""}


def test_verdict_is_against_the_better_sdpa_backend() -> None:
    rows = [_row("ours", "o", 3e-3), _row("sdpa_flash", "o", 2e-3), _row("sdpa_cudnn", "o", 1e-3),  # 3x best
            _row("ours", "dq", 3e-3), _row("sdpa_flash", "dq", 2e-3), _row("sdpa_cudnn", "dq", 4e-3),  # 1.5x
            _row("ours", "dk", 1e-3), _row("sdpa_flash", "dk", 1e-3),
            _row("sdpa_cudnn", "dk", math.nan, fa.UNSUPPORTED),  # judged against flash alone
            _row("ours", "dv", 1e-3), _row("sdpa_flash", "dv", math.nan, fa.UNSUPPORTED),
            _row("sdpa_cudnn", "dv", math.nan, fa.UNSUPPORTED)]  # nothing to judge against
    table = fa.accuracy_table(rows).set_index("output")
    assert table.loc["o", "ratio_best"] == pytest.approx(3.0) and table.loc["o", "within"] is False
    assert table.loc["o", "ratio_sdpa_flash"] == pytest.approx(1.5)
    assert table.loc["dq", "ratio_best"] == pytest.approx(1.5) and table.loc["dq", "within"] is True
    assert table.loc["dk", "ratio_best"] == pytest.approx(1.0) and table.loc["dk", "within"] is True
    assert table.loc["dv", "within"] is None and math.isnan(table.loc["dv", "ratio_best"])
    assert table.loc["o", "relative_ours"] == pytest.approx(3e-3 / 4.0)
    summary = fa.accuracy_summary(table.reset_index())
    assert summary["cells"] == 4 and summary["judged"] == 3 and summary["within"] == 2
    assert summary["worst_ratio"] == pytest.approx(3.0)
    assert summary["worst"] == "o at bfloat16 (1, 2, 64, 64) causal"
    assert summary["geomean_ratio"] == pytest.approx((3.0 * 1.5 * 1.0) ** (1 / 3))
    assert summary["max_ratio_by_output"] == pytest.approx({"o": 3.0, "dq": 1.5, "dk": 1.0})


def test_budget_stops_before_the_next_shape() -> None:
    rows = fa.run([(1, 1, 17, 16), (1, 1, 18, 16)], [torch.float32], [True], ("sdpa_flash",), device=DEVICE,
                  budget_s=0.0)
    assert set(rows["seq_len"]) == {17}  # the first shape always runs
    with pytest.raises(ValueError, match="unknown implementation"):
        fa.run([(1, 1, 17, 16)], [torch.float32], [True], ("ourz",), device=DEVICE)


def test_command_line(tmp_path, capsys) -> None:
    csv, summary = tmp_path / "rows.csv", tmp_path / "summary.json"
    assert fa.main(["--shape", "1,2,21,16", "--dtype", "float32", "--causal", "--impls", "ours,sdpa_flash",
                    "--device", DEVICE, "--csv", str(csv), "--json", str(summary)]) == 0
    assert len(pd.read_csv(csv)) == 2 * len(fa.OUTPUTS)
    record = json.loads(summary.read_text())
    assert record["summary"]["judged"] == len(fa.OUTPUTS)
    assert record["provenance"]["params"]["shapes"] == [[1, 2, 21, 16]] and "git_commit" in record["provenance"]
    assert "ratio_best" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--impls", "ours,flashy"], "unknown"),
    (["--dtype", "float64"], "dtype must be"),
])
def test_bad_arguments_are_one_line_errors(argv, message) -> None:
    with pytest.raises(ValueError, match=message):
        fa.main([*argv, "--shape", "1,1,8,16"])


def test_grid_is_the_shapes_grid_at_both_head_dims() -> None:
    from cs336_systems.benchmarking.flash.shapes import SHAPES_BHN

    shapes = fa.grid_shapes()
    assert len(shapes) == 2 * len(SHAPES_BHN)
    assert (8, 32, 256, 64) in shapes and (1, 8, 65536, 128) in shapes


def test_variants_of_ours_are_measured_and_compared_beside_it(tmp_path) -> None:
    """A ``--variant`` runs ours with other options on the same inputs and gets its own error and ratio columns;
    ``--all-heads`` compares every head."""
    csv = tmp_path / "rows.csv"
    assert fa.main(["--shape", "1,3,17,16", "--dtype", "float32", "--causal", "--impls", "ours,sdpa_flash",
                    "--variant", 'blocks={"autotune": false}', "--all-heads", "--device", DEVICE,
                    "--csv", str(csv)]) == 0
    rows = pd.read_csv(csv)
    assert set(rows["impl"]) == {"ours", "sdpa_flash", "blocks"} and set(rows["heads_checked"]) == {3}
    table = fa.accuracy_table(rows)
    assert {"error_blocks", "ratio_best_blocks"} <= set(table.columns)
    assert (table["ratio_best_blocks"] == table["error_blocks"] / table["error_sdpa_flash"]).all()
    with pytest.raises(ValueError, match="variant"):
        fa.main(["--variant", 'bad={"no_such_option": 1}', "--shape", "1,1,8,16"])


def test_out_of_memory_is_recorded_as_such(monkeypatch) -> None:
    real = fa.attention_fn

    def fake(impl, variants=None):
        if impl == "sdpa_flash":
            def fail(*_):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
            return fail
        return real(impl, variants)

    monkeypatch.setattr(fa, "attention_fn", fake)
    rows = pd.DataFrame(fa.measure_shape((1, 1, 9, 16), torch.float32, False, ("sdpa_flash",), device=DEVICE))
    assert (rows["status"] == fa.OOM).all() and rows["note"].str.startswith("CUDA out of memory").all()


# --- §1.3.5, the writeup section over the grid ------------------------------------------------------------------


def _cell_rows(dtype: str, seq: int, errors: dict[str, float], ours: str = "ours") -> list[dict]:
    """Rows of one cell whose every output has the same ``errors`` per implementation."""
    rows = []
    for impl, error in errors.items():
        for output in fa.OUTPUTS:
            row = _row(ours if impl == "ours" else impl, output, error, seq=seq)
            rows.append({**row, "dtype": dtype, "status": fa.OK if not math.isnan(error) else fa.UNSUPPORTED})
    return rows


def test_section_verdicts_combine_the_dtypes_and_keep_skipped_cells() -> None:
    """The derived ``accuracy`` table holds every measured (cell, output) of both dtypes' tables, names which
    implementation was ours, and keeps a cell the budget skipped as one row per output saying so; the summary
    counts cells, pairs within the bar and the worst pair, per dtype and over all."""
    from cs336_systems.experiments import flash_accuracy as section

    bf16 = pd.DataFrame(_cell_rows("bfloat16", 64, {"ours": 1e-3, "sdpa_flash": 1e-3, "sdpa_cudnn": 2e-3})
                        + [{"dtype": "bfloat16", "batch": 1, "heads": 2, "seq_len": 128, "head_dim": 64,
                            "causal": True, "status": section.SKIPPED}])
    fp16 = pd.DataFrame(_cell_rows("float16", 64, {"ours": 3e-4, "sdpa_flash": 1e-4, "sdpa_cudnn": 2e-4}))
    table = section.verdicts([bf16, fp16])
    assert set(table["ours"]) == {"ours"}
    measured = table[table["status"] == fa.OK]
    assert len(measured) == 2 * len(fa.OUTPUTS)
    assert measured[measured["dtype"] == "float16"]["ratio_best"].tolist() == pytest.approx([3.0] * 4)
    assert not measured[measured["dtype"] == "float16"]["within"].any()
    skipped = table[table["status"] == section.SKIPPED]
    assert len(skipped) == len(fa.OUTPUTS) and set(skipped["seq_len"]) == {128}
    totals = section.summary(table).set_index("dtype")
    assert totals.loc["bfloat16", ["cells", "cells_skipped", "pairs", "within"]].tolist() == [1, 1, 4, 4]
    assert totals.loc["float16", ["cells", "pairs", "within"]].tolist() == [1, 4, 0]
    assert totals.loc["all", "max_ratio"] == pytest.approx(3.0)
    assert totals.loc["all", "worst"].endswith("float16 (1, 2, 64, 64) causal")


def test_section_answer_names_the_misses_and_what_ours_was(tmp_path) -> None:
    """The answer's verdict sentence comes from the derived tables: pairs outside the bar by name, the skipped
    cells, how many pairs are no worse than the worse backend, and which implementation of ours ran."""
    from cs336_systems.experiments import flash_accuracy as section

    rows = _cell_rows("float16", 64, {"ours": 3e-4, "sdpa_flash": 1e-4, "sdpa_cudnn": 4e-4}, ours=fa.OURS_PYTORCH)
    table = section.verdicts([pd.DataFrame(rows)])
    text = section._verdict_text(table, section.summary(table)).markdown
    assert text.startswith("Ours here is the PyTorch-tiled FlashAttention-2")
    assert "float16: 1 cells, 0 of 4 (cell, output) pairs within the bar" in text
    assert "Outside it: dk, float16 (1, 2, 64, 64) causal (3.00×), dq, " in text
    assert "and o, float16 (1, 2, 64, 64) causal (3.00×)." in text
    assert "In 4 of 4 pairs our error is at most the worse of the two backends' errors." in text
    assert section._verdict_text(None, None) is None


def test_section_parameters_refuse_bad_grids_in_one_line() -> None:
    from cs336_systems.experiments import get

    spec = get("flash_accuracy")
    assert spec.params("full").all_heads is True and len(spec.jobs) == 2
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        spec.params("full", {"dtypes": ["float64"]})
    with pytest.raises(ValueError, match=r"a shape is \[batch, heads, seq_len\]"):
        spec.params("full", {"shapes": [[1, 2]]})
    with pytest.raises(ValueError, match="head dims up to 128"):
        spec.params("full", {"head_dims": [256]})
