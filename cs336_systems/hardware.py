"""Peak arithmetic throughput of the GPUs results are measured on, from the vendors' data sheets, and
model FLOPs utilization (MFU) against it.

MFU is the model's FLOPs per second (``configs.step_flops``: 6 × matmul parameters × tokens for a training
step, 2 × for a forward pass, plus attention's two ``seq × seq`` products, without causal savings) over
the peak of the precision the matmuls ran in. Peaks are dense (no 2:4 sparsity). float32 matmuls at
``torch.get_float32_matmul_precision() == "highest"`` (PyTorch's default) run on the FP32 units, not on
tensor cores, so their peak is the FP32 one; at ``"high"`` or ``"medium"`` they use TF32.
"""

from __future__ import annotations

import math

#: Dense peak TFLOP/s by precision. Matched against the device name in order, first hit wins.
#: Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5 and PCIe columns); the H200 has the H100 SXM's
#: GH100 compute (its data sheet lists the same peaks) with more and faster memory.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
)

#: Peak memory bandwidth, TB/s (data sheets, as above): the floor of memory-bound kernels such as an optimizer step.
PEAK_TBPS: tuple[tuple[str, float], ...] = (("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8))

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def matmul_precision(precision: str, float32_matmul_precision: str | None = "highest") -> str:
    """The precision the matmuls of a run ran in: ``bf16``/``fp16`` under autocast, else ``fp32`` at
    ``"highest"`` and ``tf32`` otherwise."""
    p = _ALIASES.get(precision, precision)
    if p in ("bf16", "fp16", "tf32"):
        return p
    if p != "fp32":
        raise ValueError(f"unknown precision {precision!r}; expected fp32, tf32, bf16 or fp16")
    return "fp32" if (float32_matmul_precision or "highest") == "highest" else "tf32"


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Dense peak TFLOP/s of ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) in ``precision`` (fp32,
    tf32, bf16, fp16); None for a device without a known data sheet (a CPU, say)."""
    p = _ALIASES.get(precision, precision)
    for pattern, peaks in PEAK_TFLOPS:
        if device_name and pattern in device_name:
            if p not in peaks:
                raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(peaks)}")
            return peaks[p]
    return None


def peak_tbps(device_name: str | None) -> float | None:
    """Peak memory bandwidth of ``device_name`` in TB/s; None when unknown."""
    for pattern, tbps in PEAK_TBPS:
        if device_name and pattern in device_name:
            return tbps
    return None


def mfu(tflop_per_s: float, device_name: str | None, precision: str) -> float:
    """Model FLOPs utilization: achieved TFLOP/s over the device's peak (NaN when the peak is unknown)."""
    peak = peak_tflops(device_name, precision)
    return tflop_per_s / peak if peak and not math.isnan(tflop_per_s) else math.nan


__all__ = ["PEAK_TBPS", "PEAK_TFLOPS", "matmul_precision", "mfu", "peak_tbps", "peak_tflops"]
