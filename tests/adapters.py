"""The course's adapter interface, so its official test suite runs unmodified against this repository.

Each adapter is a thin call into ``cs336_systems``; the logic and its documentation live there.
"""

from __future__ import annotations

from typing import Any

import torch


def get_flashattention_autograd_function_pytorch() -> type:
    """A ``torch.autograd.Function`` subclass implementing FlashAttention-2 in plain PyTorch."""
    raise NotImplementedError("FlashAttention-2 (PyTorch tiled version) is not implemented yet")


def get_flashattention_autograd_function_triton() -> type:
    """A ``torch.autograd.Function`` subclass implementing FlashAttention-2 with Triton kernels."""
    raise NotImplementedError("FlashAttention-2 (Triton kernels) is not implemented yet")


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    raise NotImplementedError("DDP with overlapped per-parameter all-reduce is not implemented yet")


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError("DDP with overlapped per-parameter all-reduce is not implemented yet")


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    raise NotImplementedError("bucketed DDP is not implemented yet")


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError("bucketed DDP is not implemented yet")


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError("bucketed DDP is not implemented yet")


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    raise NotImplementedError("DDP is not implemented yet")


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError("DDP is not implemented yet")


def get_sharded_optimizer(params: Any, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
    from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    raise NotImplementedError("FSDP is not implemented yet")


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError("FSDP is not implemented yet")


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    raise NotImplementedError("FSDP is not implemented yet")
