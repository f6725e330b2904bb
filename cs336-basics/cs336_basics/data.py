"""Random language-modelling batches from a 1-D token array."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


def get_batch(
    dataset: npt.NDArray, batch_size: int, context_length: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` windows of ``context_length`` tokens; targets are the inputs shifted by one."""
    if dataset.ndim != 1:
        raise ValueError(f"get_batch expects a 1-D token array, got shape {dataset.shape}")
    if len(dataset) <= context_length:
        raise ValueError(f"dataset of {len(dataset)} tokens is too short for context_length={context_length}")
    starts = np.random.randint(0, len(dataset) - context_length, size=batch_size)
    idx = starts[:, None] + np.arange(context_length + 1)[None, :]
    windows = torch.from_numpy(np.asarray(dataset)[idx].astype(np.int64))
    x, y = windows[:, :-1], windows[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
