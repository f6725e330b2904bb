"""The writeup's sections, in the order of the course writeup: one entry per results folder.

Each builder receives the :class:`~cs336_systems.report.data.SectionData` of its folder and returns
blocks answering the problem's deliverables; the document builder then appends every artefact of
the folder the builder did not use, so nothing committed is left out.
"""

from __future__ import annotations

from cs336_systems.report.sections import attention, distributed, evidence, sharding, single_gpu
from cs336_systems.report.sections.common import SectionSpec

_BENCH = "python -m cs336_systems.benchmarking "

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
                sharding.communication_accounting, gpus=0),
    SectionSpec("3", "Optimizer-state sharding", "optimizer_state_sharding", ("optimizer_state_sharding_accounting",),
                sharding.optimizer_state_sharding, gpus=2,
                alternative="python -m cs336_systems.distributed.sharding_benchmark --nproc 2"),
    SectionSpec("3.1", "Fully sharded data parallelism", "fsdp", ("fsdp",), sharding.fsdp, gpus=2,
                alternative="python -m cs336_systems.distributed.fsdp_benchmark --nproc 2 4"),
    SectionSpec("4", "Test evidence: the course's own test suites", "course_tests", ("tests/adapters.py",),
                evidence.course_tests,
                command="uv run python -m cs336_systems.course_tests PATH-TO-COURSE-CHECKOUT --edition 2026 --publish"),
]


__all__ = ["SECTIONS", "SectionSpec"]
