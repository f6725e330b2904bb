"""Run a benchmark under Nsight Systems (``nsys profile``) with the same NVTX ranges.

torch.profiler (:mod:`.torch_profiler`) is the primary profiler here because it needs nothing outside
PyTorch. Where Nsight Systems is installed, :func:`run_nsys` profiles the very same CLI run
(``python -m cs336_systems.benchmarking model ... --nvtx``) so the ``warmup`` / ``measured`` /
``forward`` / ``backward`` / ``optimizer`` and attention ranges show up on the nsys timeline; open the
resulting ``.nsys-rep`` in the Nsight Systems GUI or summarise it with ``nsys stats``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

NSYS_MISSING = (
    "Nsight Systems ('nsys') is not on PATH. Install it from https://developer.nvidia.com/nsight-systems "
    "(it ships with the CUDA toolkit under <cuda>/bin or as a separate package), or use the torch.profiler "
    "path in cs336_systems.profiling.torch_profiler, which records the same ranges and kernels."
)


def nsys_available() -> bool:
    return shutil.which("nsys") is not None


def nsys_command(benchmark_args: Sequence[str], output: str | Path, *, python: str | None = None) -> list[str]:
    """The ``nsys profile`` command line that runs ``python -m cs336_systems.benchmarking <benchmark_args>``
    with NVTX annotation on, tracing CUDA, NVTX, cuBLAS and cuDNN, and Python backtraces at CUDA calls."""
    args = list(benchmark_args)
    if "--nvtx" not in args:
        args.append("--nvtx")
    return [
        "nsys", "profile",
        "--trace=cuda,nvtx,cublas,cudnn,osrt",
        "--python-backtrace=cuda",
        "--force-overwrite=true",
        "--output", str(output),
        python or sys.executable, "-m", "cs336_systems.benchmarking", *args,
    ]


def run_nsys(benchmark_args: Sequence[str], output: str | Path, *, check: bool = True) -> Path:
    """Profile a benchmark CLI run under nsys; returns the ``.nsys-rep`` path. Raises ``RuntimeError``
    with installation advice when nsys is missing."""
    if not nsys_available():
        raise RuntimeError(NSYS_MISSING)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(nsys_command(benchmark_args, output), check=check)
    return Path(f"{output}.nsys-rep")

