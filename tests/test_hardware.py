"""Data-sheet peaks and MFU: the numbers the writeup's MFU columns divide by."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from cs336_systems.configs import step_flops
from cs336_systems.hardware import matmul_precision, mfu, peak_tflops
from cs336_systems.report.answers import mfu_note, model_tflops, with_mfu

H100 = "NVIDIA H100 80GB HBM3"


def test_peaks_by_device_and_precision() -> None:
    assert peak_tflops(H100, "bf16") == 989.4 and peak_tflops(H100, "bfloat16") == 989.4
    assert peak_tflops(H100, "fp32") == 66.9 and peak_tflops(H100, "tf32") == 494.7
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # matched before the generic H100 entry
    assert peak_tflops("NVIDIA H200", "fp16") == 989.4
    assert peak_tflops("CPU (x86_64)", "fp32") is None and peak_tflops(None, "bf16") is None
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        peak_tflops(H100, "int8")


def test_matmul_precision_follows_the_float32_setting() -> None:
    assert matmul_precision("fp32", "highest") == "fp32" and matmul_precision("float32", None) == "fp32"
    assert matmul_precision("fp32", "high") == "tf32" and matmul_precision("fp32", "medium") == "tf32"
    assert matmul_precision("bf16", "highest") == "bf16"
    with pytest.raises(ValueError, match="unknown precision"):
        matmul_precision("fp8")


def test_mfu_columns() -> None:
    assert mfu(494.7, H100, "bf16") == pytest.approx(0.5)
    assert math.isnan(mfu(10.0, "CPU (x86_64)", "fp32"))
    frame = pd.DataFrame({"TFLOP_per_s": [33.45, 494.7], "precision": ["fp32", "bf16"]})
    out = with_mfu(frame, {"device": H100, "float32_matmul_precision": "highest"})
    assert list(out["MFU_pct"].round(6)) == [50.0, 50.0] and "MFU_pct" not in frame
    high = with_mfu(frame, {"device": H100, "float32_matmul_precision": "high"})
    assert high["MFU_pct"].iloc[0] == pytest.approx(100 * 33.45 / 494.7)  # TF32 peak
    assert with_mfu(pd.DataFrame({"ms": [1.0]}), {"device": H100}) is not None  # no TFLOP/s column: unchanged
    assert "66.9" in mfu_note({"device": H100}) and mfu_note({"device": "CPU"}) == ""


def test_model_tflops_counts_like_the_calculator() -> None:
    flops = step_flops("small", 4, 512, "train")
    assert model_tflops("small", 1000.0, 512, "train") == pytest.approx(flops / 1e12)
    assert model_tflops("small", 500.0, 512, "forward", batch_size=8) == pytest.approx(
        step_flops("small", 8, 512, "forward") / 0.5 / 1e12)


def test_peak_bandwidth() -> None:
    from cs336_systems.hardware import peak_tbps

    assert peak_tbps(H100) == 3.35 and peak_tbps("NVIDIA H100 PCIe") == 2.0 and peak_tbps("NVIDIA H200") == 4.8
    assert peak_tbps("CPU (x86_64)") is None
