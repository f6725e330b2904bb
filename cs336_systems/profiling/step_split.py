"""Where a training step's time goes: matmul, attention, norms and elementwise, optimizer, and host/idle.

From a torch.profiler trace of ``steps`` training steps whose optimizer calls run inside a
``record_function("optimizer")`` range: every device kernel is put in one bucket (kernels launched inside an
optimizer range, or named like an Adam kernel, are ``optimizer``; otherwise attention kernels by name, GEMMs
as ``matmul``, the rest as ``norms & elementwise``), summed and divided by the steps. The name rule covers
kernels whose launch the profiler cannot tie to the range (a Triton kernel launched through the driver API
has no launch time in the records: see
:func:`~cs336_systems.profiling.torch_profiler.kernel_records`). What remains of the measured step time is
``host / idle``: time the GPU waited for the host (launch-bound steps) or for synchronisation. Kernels of one
stream run one after another, so the buckets add up to the GPU's busy time.
"""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.profiling.torch_profiler import classify_kernel

BUCKETS = ("matmul", "attention", "norms & elementwise", "optimizer", "host / idle")
#: Attention kernels: our FlashAttention-2 (Triton and Gluon), SDPA's flash / cuDNN / efficient backends.
_ATTENTION = re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*(mha|sdp)", re.IGNORECASE)
#: Optimizer kernels by name: FlatAdamW's ``adamw_kernel``, torch's ``FusedAdamMathFunctor`` (AdamW fused).
_OPTIMIZER = re.compile(r"adam", re.IGNORECASE)


def bucket(name: str) -> str:
    """The bucket of a kernel launched outside the optimizer."""
    if _ATTENTION.search(name):
        return "attention"
    return "matmul" if classify_kernel(name) == "matmul" else "norms & elementwise"


def step_time_split(records: pd.DataFrame, optimizer_intervals: list[tuple[float, float]], steps: int,
                    step_ms: float) -> pd.DataFrame:
    """Milliseconds per step in each of :data:`BUCKETS` (and their share of ``step_ms``) from kernel records
    (``name``, ``duration_us``, ``launch_us``: :func:`~cs336_systems.profiling.torch_profiler.kernel_records`)."""
    if steps < 1 or step_ms <= 0:
        raise ValueError(f"need steps >= 1 and step_ms > 0, got {steps}, {step_ms}")
    if records.empty:
        ms = dict.fromkeys(BUCKETS[:-1], 0.0)
    else:
        in_optimizer = pd.Series(False, index=records.index)
        for start, end in optimizer_intervals:
            in_optimizer |= records["launch_us"].between(start, end)
        in_optimizer |= records["name"].str.contains(_OPTIMIZER)
        kind = records["name"].map(bucket).where(~in_optimizer, "optimizer")
        ms = (records.groupby(kind)["duration_us"].sum() / 1e3 / steps).to_dict()
    row = {b: float(ms.get(b, 0.0)) for b in BUCKETS[:-1]}
    row["host / idle"] = max(step_ms - sum(row.values()), 0.0)
    table = pd.DataFrame({"bucket": list(row), "ms_per_step": list(row.values())})
    table["share"] = table["ms_per_step"] / step_ms
    return table


__all__ = ["BUCKETS", "bucket", "step_time_split"]
