"""§1.1.5: what mixed precision does to sums, and which dtypes autocast produces inside a model.

:func:`accumulation_experiments` runs the handout's four loops that add 0.01 a thousand times, with the
accumulator and the summand in fp32 or fp16: an fp16 accumulator loses the small increments once the
sum is large (fp16 has 10 mantissa bits), while fp16 summands accumulated in fp32 only carry 0.01's
fp16 representation error.

:class:`ToyModel` (fc1 → ReLU → LayerNorm → fc2) and :func:`autocast_dtypes` show the dtype of every
intermediate under autocast: parameters stay fp32, matmul outputs are low precision, LayerNorm and the
loss are computed in fp32, and gradients match their (fp32) parameters.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from torch import nn

from cs336_systems.distributed.toy_models import ToyModel  # the course's toy, shared with the DDP tests

from .end_to_end import default_device

ACCUMULATION_STEPS = 1000
INCREMENT = 0.01


def accumulation_experiments(steps: int = ACCUMULATION_STEPS, increment: float = INCREMENT) -> pd.DataFrame:
    """The four loops: (accumulator, summand) in (fp32, fp32), (fp16, fp16), (fp32, fp16 added as is),
    (fp32, fp16 cast to fp32 explicitly). Reports the sum, the exact answer and the error."""
    cases = [
        ("fp32 += fp32", torch.float32, torch.float32, False),
        ("fp16 += fp16", torch.float16, torch.float16, False),
        ("fp32 += fp16", torch.float32, torch.float16, False),
        ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True),
    ]
    rows = []
    for label, acc_dtype, x_dtype, cast in cases:
        s = torch.tensor(0, dtype=acc_dtype)
        for _ in range(steps):
            x = torch.tensor(increment, dtype=x_dtype)
            s += x.type(torch.float32) if cast else x
        rows.append(
            {
                "loop": label,
                "accumulator": str(acc_dtype).removeprefix("torch."),
                "summand": str(x_dtype).removeprefix("torch."),
                "result": s.item(),
                "exact": steps * increment,
                "abs_error": abs(s.item() - steps * increment),
            }
        )
    return pd.DataFrame(rows)


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast to ``dtype`` runs a Linear on ``device_type`` in this build."""
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = nn.Linear(2, 2).to(device_type)(torch.ones(1, 2, device=device_type))
        return out.dtype == dtype
    except (RuntimeError, AssertionError):
        return False


def autocast_dtypes(
    dtype: torch.dtype = torch.float16, device: str | torch.device | None = None, batch_size: int = 8
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run one forward/backward of :class:`ToyModel` under ``torch.autocast(dtype)`` and record the dtype of
    the parameters, fc1's output, the LayerNorm output, the logits, the loss and the gradients.

    Returns the table and ``{"device", "requested", "autocast_dtype", "note"}``; on a device whose autocast
    does not support ``dtype`` (fp16 on some CPU builds) it falls back to bfloat16 and says so in
    ``note``.
    """
    device = torch.device(device) if device else default_device()
    used, note = dtype, ""
    if not autocast_supported(device.type, dtype):
        used = torch.bfloat16
        note = f"{dtype} autocast is not supported on {device.type} here; used {used} instead"
    torch.manual_seed(0)
    model = ToyModel(16, 4).to(device)
    seen: dict[str, torch.dtype] = {}
    hooks = [
        model.fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1 output", o.dtype)),
        model.ln.register_forward_hook(lambda m, i, o: seen.__setitem__("LayerNorm output", o.dtype)),
    ]
    x = torch.randn(batch_size, 16, device=device)
    y = torch.randint(0, 4, (batch_size,), device=device)
    try:
        with torch.autocast(device_type=device.type, dtype=used):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    rows = [{"quantity": f"parameter {n}", "dtype": p.dtype} for n, p in model.named_parameters()]
    rows += [{"quantity": k, "dtype": v} for k, v in seen.items()]
    rows += [{"quantity": "logits", "dtype": logits.dtype}, {"quantity": "loss", "dtype": loss.dtype}]
    rows += [{"quantity": f"gradient {n}", "dtype": p.grad.dtype} for n, p in model.named_parameters()]
    table = pd.DataFrame(rows)
    table["dtype"] = table["dtype"].map(lambda d: str(d).removeprefix("torch."))
    info = {"device": str(device), "requested": str(dtype), "autocast_dtype": str(used), "note": note}
    return table, info
