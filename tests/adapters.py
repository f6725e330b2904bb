"""The course's adapter interface, so its official test suite runs unmodified against this repository.

Each adapter is a thin call into ``cs336_systems``; the logic and its documentation live there.
"""

from __future__ import annotations

from typing import Any

import torch


def get_flashattention_autograd_function_pytorch() -> type:
    """A ``torch.autograd.Function`` subclass implementing FlashAttention-2 in plain PyTorch."""
    from cs336_systems.attention import get_flashattention_autograd_function_pytorch

    return get_flashattention_autograd_function_pytorch()


def get_flashattention_autograd_function_triton() -> type:
    """A ``torch.autograd.Function`` subclass implementing FlashAttention-2 with Triton kernels."""
    from cs336_systems.attention import get_flashattention_autograd_function_triton

    return get_flashattention_autograd_function_triton()


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    from cs336_systems.distributed.ddp_overlap import DDPIndividualParameters

    return DDPIndividualParameters(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    from cs336_systems.distributed.ddp_bucketed import DDPBucketed

    return DDPBucketed(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.on_train_batch_start()


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    # 2026's single DDP hook asks for each parameter's gradient communicated on its own as soon as it is ready.
    from cs336_systems.distributed.ddp_overlap import DDPIndividualParameters

    return DDPIndividualParameters(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_sharded_optimizer(params: Any, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
    from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    from cs336_systems.distributed.fsdp import FSDP

    return FSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
