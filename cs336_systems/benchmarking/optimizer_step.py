"""Time of one AdamW step on a preset's parameters against its memory-traffic floor.

AdamW in float32 reads the parameter, its gradient and both moments and writes the parameter and both
moments: 28 bytes per parameter. At the device's peak bandwidth (:mod:`cs336_systems.hardware`) that is
the floor no implementation can beat; the report gives each optimizer's step time, its effective
bandwidth and its ratio to the floor. The optimizers alternate in rounds on identical copies of the
parameters (same shapes as the preset's model, random values and gradients):

- ``flat``: :class:`cs336_systems.flat_adamw.FlatAdamW`, one Triton kernel per group;
- ``basics``: ``cs336_basics.optimizer.AdamW``, per parameter;
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` (CUDA only), PyTorch's multi-tensor fused kernel.

    python -m cs336_systems.benchmarking.optimizer_step --preset xl
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

from cs336_systems.benchmarking.end_to_end import default_device
from cs336_systems.benchmarking.train_step import ms_per_call
from cs336_systems.configs import get_config
from cs336_systems.hardware import peak_tbps

OPTIMIZERS = ("flat", "basics", "torch_fused")
BYTES_PER_PARAM = 28  # float32: read p, g, m, v; write p, m, v


def _shapes(preset: str) -> list[torch.Size]:
    from cs336_basics.model import BasicsTransformerLM

    with torch.device("meta"):
        return [p.shape for p in BasicsTransformerLM(**get_config(preset).model_kwargs()).parameters()]


def _parameters(preset: str, device: torch.device) -> list[torch.nn.Parameter]:
    shapes = _shapes(preset)
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        params.append(p)
    return params


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "flat":
        from cs336_systems.flat_adamw import FlatAdamW

        return FlatAdamW(params, lr=1e-4)
    if name == "basics":
        from cs336_basics.optimizer import AdamW

        return AdamW(params, lr=1e-4)
    if name == "torch_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def measure(preset: str, optimizers: tuple[str, ...] = OPTIMIZERS, rounds: int = 5, steps: int = 5,
            device: torch.device | None = None) -> pd.DataFrame:
    """Median step time per optimizer over ``rounds`` (alternating), with bandwidth and the ratio to the floor."""
    device = device or default_device()
    if "torch_fused" in optimizers and device.type != "cuda":
        optimizers = tuple(o for o in optimizers if o != "torch_fused")
    for name in optimizers:
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")

    def timed(name: str) -> float:
        # Fresh parameters per measurement: three optimizers' states at once would not fit beside xl's
        # (2 B parameters: 32 GB of parameters, gradients and moments each).
        opt = _optimizer(name, _parameters(preset, device))
        ms_per_call(opt.step, 1, device)  # compile, allocate state
        ms = ms_per_call(opt.step, steps, device)
        del opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ms

    n = sum(shape.numel() for shape in _shapes(preset))
    rows = []
    for r in range(rounds):
        order = list(optimizers[r % len(optimizers):]) + list(optimizers[: r % len(optimizers)])
        rows += [{"round": r, "optimizer": o, "step_ms": timed(o)} for o in order]
    frame = pd.DataFrame(rows)
    g = frame.groupby("optimizer", sort=False)["step_ms"]
    out = pd.DataFrame({"step_ms": g.median(), "spread_ms": g.max() - g.min()}).reset_index()
    out["params"] = n
    out["GB_per_s"] = n * BYTES_PER_PARAM / (out["step_ms"] * 1e-3) / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_tbps(name)
    out["floor_ms"] = n * BYTES_PER_PARAM / (peak * 1e12) * 1e3 if peak else float("nan")
    out["vs_floor"] = out["step_ms"] / out["floor_ms"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking optimizer_step --help``."""
    parser.add_argument("--preset", "--size", dest="preset", default="xl")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)


def run_command(args: argparse.Namespace) -> int:
    get_config(args.preset)
    table = measure(args.preset, tuple(o for o in args.optimizers.split(",") if o), args.rounds, args.steps)
    print(f"AdamW step on the {args.preset} preset's parameters ({int(table['params'].iloc[0]):,}), "
          f"median of {args.rounds} rounds; floor = {BYTES_PER_PARAM} B/parameter at the data-sheet bandwidth")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking optimizer_step`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["optimizer_step", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.optimizer_step"))
