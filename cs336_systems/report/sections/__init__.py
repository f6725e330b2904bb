"""The writeup's sections, in the order of the course writeup: one entry per results folder.

Each builder receives the :class:`~cs336_systems.report.data.SectionData` of its folder and returns
blocks answering the problem's deliverables; the document builder then appends every artefact of
the folder the builder did not use, so nothing committed is left out.
"""

from __future__ import annotations

import dataclasses

from cs336_systems.report.sections import attention, distributed, evidence, sharding, single_gpu
from cs336_systems.report.sections.common import SectionSpec
from cs336_systems.report.staleness import LIBRARY, MODEL

_BENCH = "python -m cs336_systems.benchmarking "

# What each section's measurements run, beyond the model (MODEL): a change there makes its results stale.
_S = "cs336_systems/"
_TIMING = (_S + "benchmarking/end_to_end.py", _S + "benchmarking/timing.py", _S + "benchmarking/sweep.py",
           _S + "benchmarking/sections.py")
_DDP = (_S + "distributed/grad_sync.py", _S + "distributed/consistency.py", _S + "distributed/launch.py",
        _S + "distributed/runner.py", _S + "distributed/benchmark.py", _S + "cuda_graphs.py")
_DEPENDS = {
    "benchmarking": (*MODEL, *_TIMING),
    "nsys_profile": (*MODEL, *_TIMING, _S + "profiling/"),
    "mixed_precision": (*MODEL, *_TIMING, _S + "benchmarking/mixed_precision.py"),
    "memory_profiling": (*MODEL, *_TIMING, _S + "profiling/memory.py"),
    "pytorch_attention": (*MODEL, *_TIMING, _S + "benchmarking/attention.py"),
    "torch_compile": (*MODEL, *_TIMING, _S + "benchmarking/attention.py"),
    "flash_benchmarking": (*MODEL, _S + "attention/", _S + "benchmarking/flash.py", _S + "benchmarking/timing.py",
                           _S + "benchmarking/end_to_end.py"),
    "distributed_communication_single_node": (_S + "distributed/allreduce.py", _S + "distributed/launch.py",
                                              _S + "distributed/runner.py"),
    "naive_ddp": (*MODEL, *_DDP, _S + "distributed/ddp_naive.py", _S + "distributed/naive_ddp_benchmark.py",
                  _S + "distributed/toy_models.py", _S + "distributed/equivalence.py"),
    "ddp_flat": (*MODEL, *_DDP, _S + "distributed/ddp_flat.py"),
    "ddp_overlap_individual": (*MODEL, *_DDP, _S + "distributed/ddp_overlap.py"),
    "ddp_bucketed": (*MODEL, *_DDP, _S + "distributed/ddp_bucketed.py", _S + "distributed/overhead_model.py"),
    "communication_accounting": (_S + "accounting.py", _S + "configs.py"),
    "optimizer_state_sharding": (*MODEL, _S + "distributed/sharded_optimizer.py",
                                 _S + "distributed/sharding_benchmark.py", _S + "distributed/launch.py",
                                 _S + "distributed/runner.py", _S + "accounting.py"),
    "fsdp": (*MODEL, _S + "distributed/fsdp.py", _S + "distributed/fsdp_benchmark.py", _S + "distributed/grad_sync.py",
             _S + "distributed/consistency.py", _S + "distributed/launch.py", _S + "distributed/runner.py"),
    # What tests/adapters.py imports: the kernels and the training code, not the benchmarks beside them.
    "course_tests": ("tests/adapters.py", "cs336-basics/cs336_basics/", _S + "attention/",
                     *(_S + f"distributed/{m}.py" for m in ("grad_sync", "consistency", "launch", "ddp_naive",
                                                          "ddp_flat", "ddp_overlap", "ddp_bucketed", "strategies",
                                                          "sharded_optimizer", "fsdp"))),
}

SECTIONS: list[SectionSpec] = [
    SectionSpec("1.1.3", "End-to-end benchmarking", "benchmarking", ("benchmarking_script",), single_gpu.benchmarking,
                also=("model_sizes",), alternative=_BENCH + "benchmarking"),
    SectionSpec("1.1.4", "Profiling with Nsight Systems", "nsys_profile", ("nsys_profile",), single_gpu.nsys_profile,
                alternative=_BENCH + "nsys_profile"),
    SectionSpec("1.1.5", "Mixed precision", "mixed_precision",
                ("mixed_precision_accumulation", "benchmarking_mixed_precision"), single_gpu.mixed_precision,
                alternative=_BENCH + "mixed_precision"),
    SectionSpec("1.1.6", "Memory profiling", "memory_profiling", ("memory_profiling",), single_gpu.memory_profiling,
                alternative=_BENCH + "memory_profiling"),
    SectionSpec("1.2.1", "Benchmarking PyTorch attention", "pytorch_attention", ("pytorch_attention",),
                attention.pytorch_attention, alternative=_BENCH + "pytorch_attention"),
    SectionSpec("1.3.1", "torch.compile", "torch_compile", ("torch_compile",), attention.torch_compile,
                alternative=_BENCH + "torch_compile"),
    SectionSpec("1.3.2", "FlashAttention-2 in Triton", "flash_benchmarking",
                ("flash_forward", "flash_backward", "flash_benchmarking"), attention.flash_attention,
                alternative="python -m cs336_systems.benchmarking.flash all"),
    SectionSpec("2.1.3", "Single-node collective communication", "distributed_communication_single_node",
                ("distributed_communication_single_node",), distributed.communication_single_node, gpus=2,
                alternative="python -m cs336_systems.distributed.allreduce --nproc 2 4 6"),
    SectionSpec("2.2", "Naive distributed data parallel training", "naive_ddp",
                ("naive_ddp", "naive_ddp_benchmarking"), distributed.naive_ddp, gpus=2),
    SectionSpec("2.3.1", "DDP with one flat all-reduce", "ddp_flat", ("minimal_ddp_flat_benchmarking",),
                distributed.ddp_flat, gpus=2),
    SectionSpec("2.3.2", "DDP overlapping per-parameter all-reduces", "ddp_overlap_individual",
                ("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"),
                distributed.ddp_overlap_individual, gpus=2),
    SectionSpec("2.3.3", "Bucketed DDP", "ddp_bucketed", ("ddp_bucketed_benchmarking",), distributed.ddp_bucketed,
                gpus=2),
    SectionSpec("2.4", "Communication accounting", "communication_accounting", ("communication_accounting",),
                sharding.communication_accounting, gpus=0,
                command="uv run python -m cs336_systems.notebooks run communication_accounting -p publish=True"),
    SectionSpec("3", "Optimizer-state sharding", "optimizer_state_sharding", ("optimizer_state_sharding_accounting",),
                sharding.optimizer_state_sharding, gpus=2,
                alternative="python -m cs336_systems.distributed.sharding_benchmark --nproc 2"),
    SectionSpec("3.1", "Fully sharded data parallelism", "fsdp", ("fsdp",), sharding.fsdp, gpus=2,
                alternative="python -m cs336_systems.distributed.fsdp_benchmark --nproc 2 4"),
    SectionSpec("4", "Test evidence: the course's own test suites", "course_tests", ("tests/adapters.py",),
                evidence.course_tests,
                command="uv run python -m cs336_systems.course_tests PATH-TO-COURSE-CHECKOUT --edition 2026 --publish"),
]

SECTIONS = [dataclasses.replace(spec, depends=_DEPENDS[spec.folder]) for spec in SECTIONS]
#: Folders shown inside a section without being its own (model presets; DDP runs of the command line).
SHOWN_FOLDERS = {"model_sizes": (*MODEL,), "ddp_benchmark": (*MODEL, *_DDP, _S + "distributed/")}


__all__ = ["LIBRARY", "SECTIONS", "SHOWN_FOLDERS", "SectionSpec"]
