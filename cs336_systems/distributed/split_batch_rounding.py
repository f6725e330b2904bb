"""Why no data-parallel run matches full-batch training bit for bit: a reproduction without FSDP.

A weight gradient is a product over the batch's tokens, ``dW = gᵀ x`` with K = tokens as the inner
dimension. Data parallelism computes it per rank over that rank's tokens and adds the ranks' products
(all-reduce); full-batch training computes one product over all tokens. The two sum the same terms in a
different order, so in float32 they differ by rounding, whatever the reduction does. The 2026 course test
``test_fsdp_correctness[fp32]`` compares FSDP with full-batch training by ``torch.equal``; its toy model's
first linear layer sees 20 × 8 = 160 tokens, 80 per rank on two ranks. This module measures, at that shape
and without any wrapper:

- ``gemm``: ``Σ_r x_rᵀ g_r`` against ``xᵀ g`` (the products alone);
- ``data_parallel``: an ``nn.Linear`` + mean cross-entropy, each rank's mean-loss gradient averaged over
  ranks (what an all-reduce of the sum divided by the world size gives), against the full batch's;

each in float32 and, as the control that the gap is rounding and not arithmetic, float64.

    python -m cs336_systems.benchmarking split_batch_rounding            # CPU
    python -m cs336_systems.benchmarking split_batch_rounding --device cuda --tokens 160 --world-size 2
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _linear_ce_grad(weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The weight gradient of mean cross-entropy over ``x @ weight.T`` (autograd, as training computes it)."""
    w = weight.detach().clone().requires_grad_(True)
    F.cross_entropy(x @ w.T, y).backward()
    return w.grad


def _gap(a: torch.Tensor, b: torch.Tensor) -> dict[str, float | bool]:
    diff = (a - b).abs()
    return {"bitwise_equal": bool(torch.equal(a, b)), "max_abs_diff": diff.max().item(),
            "max_rel_diff": (diff / b.abs().clamp_min(torch.finfo(b.dtype).tiny)).max().item(),
            "ulps_of_max": (diff.max() / (torch.finfo(b.dtype).eps * b.abs().max())).item()}


def split_batch_gaps(tokens: int = 160, d_in: int = 64, d_out: int = 128, world_size: int = 2,
                     device: torch.device | str = "cpu", seed: int = 0) -> pd.DataFrame:
    """One row per (computation, dtype): how far the per-rank result summed over ranks is from the
    full-batch one (``max_abs_diff``, ``max_rel_diff``, ``ulps_of_max``: the largest difference in units of
    the dtype's epsilon times the largest gradient entry; ``bitwise_equal``)."""
    if min(tokens, d_in, d_out, world_size) < 1:
        raise ValueError(f"tokens, d_in, d_out and world_size must be positive, got {tokens}, {d_in}, {d_out}, "
                         f"{world_size}")
    if tokens % world_size:
        raise ValueError(f"tokens={tokens} does not split evenly over world_size={world_size}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64)
    g64 = torch.randn(tokens, d_out, generator=gen, dtype=torch.float64)
    w64 = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) / d_in**0.5
    y = torch.randint(0, d_out, (tokens,), generator=gen).to(device)
    shards = [slice(r * tokens // world_size, (r + 1) * tokens // world_size) for r in range(world_size)]
    rows = []
    for name, dtype in DTYPES.items():
        x, g, w = (t.to(device=device, dtype=dtype) for t in (x64, g64, w64))
        per_rank = sum(g[s].T @ x[s] for s in shards)
        rows.append({"computation": "gemm", "dtype": name, **_gap(per_rank, g.T @ x)})
        averaged = sum(_linear_ce_grad(w, x[s], y[s]) for s in shards) / world_size
        rows.append({"computation": "data_parallel", "dtype": name, **_gap(averaged, _linear_ce_grad(w, x, y))})
    return pd.DataFrame(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking split_batch_rounding --help``."""
    parser.add_argument("--tokens", type=int, default=160, help="tokens of the full batch (the GEMMs' K)")
    parser.add_argument("--d-in", type=int, default=64)
    parser.add_argument("--d-out", type=int, default=128)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)


def run_command(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    table = split_batch_gaps(args.tokens, args.d_in, args.d_out, args.world_size, args.device, args.seed)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"{args.tokens} tokens over {args.world_size} ranks, ({args.d_out}, {args.d_in}) weight, on {name} "
          f"(torch {torch.__version__}): per-rank gradients summed vs the full batch's")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0

