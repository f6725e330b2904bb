"""The matmul throughput this GPU actually reaches: the ceiling a model's MFU is also compared with.

A data-sheet peak (989 TFLOP/s bf16 dense on an H100 SXM) is not reachable by a real GEMM: clocks drop under
load, so even the largest cuBLAS GEMMs stay well below it. So MFU is reported twice, against the data sheet
(:mod:`cs336_systems.hardware`) and against this measured ceiling: the best TFLOP/s of square
``torch.matmul`` calls over a few sizes, timed with ``triton.testing.do_bench`` (median) on a GPU and with
``perf_counter`` on a CPU (smoke runs only).

    python -m cs336_systems.benchmarking.matmul_ceiling --dtype bf16 --sizes 4096,8192,16384
"""

from __future__ import annotations

import argparse
import sys
import time

import pandas as pd
import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure(dtype: str = "bf16", sizes: tuple[int, ...] = (4096, 8192, 16384),
            device: torch.device | None = None) -> pd.DataFrame:
    """TFLOP/s of an ``n × n × n`` matmul per size (``2 n³`` FLOPs per call); the ceiling is the column's max."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive integers, got {sizes}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=DTYPES[dtype]) for _ in range(2))
        if device.type == "cuda":
            import triton.testing

            ms = float(triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500,
                                               return_mode="median"))
        else:
            torch.matmul(a, b)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            ms = (time.perf_counter() - t0) * 1e3
        rows.append({"dtype": dtype, "n": n, "ms": ms, "TFLOP_per_s": 2 * n**3 / (ms * 1e-3) / 1e12})
    return pd.DataFrame(rows)


def ceiling_tflops(table: pd.DataFrame) -> float:
    """The measured ceiling: the best TFLOP/s of :func:`measure`'s table."""
    return float(table["TFLOP_per_s"].max())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking matmul_ceiling --help``."""
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--sizes", default="4096,8192,16384", help="comma-separated square sizes")


def run_command(args: argparse.Namespace) -> int:
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    table = measure(args.dtype, sizes)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"ceiling: {ceiling_tflops(table):.1f} TFLOP/s ({args.dtype})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking matmul_ceiling`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["matmul_ceiling", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.matmul_ceiling"))
