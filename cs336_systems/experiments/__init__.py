"""The writeup's sections as units: one module per section, each with its parameters (``smoke`` /
``quick`` / ``full`` presets), ``run`` (measure and write results), ``derive`` (figures computed from
results) and ``answer`` (the deliverables' text, formatted from results).

``python -m cs336_systems.experiments`` lists them; ``python -m cs336_systems.experiments SECTION --help``
shows one section's parameters. The notebooks in ``notebooks/`` and the writeup builder call the same
objects (:data:`SECTIONS`).
"""

from __future__ import annotations

import importlib

from cs336_systems.experiments.section import PRESETS, Section

#: Section modules in the writeup's order (the handout's).
MODULES = (
    "model_sizes",
    "benchmarking",
    "nsys_profile",
    "mixed_precision",
    "memory_profiling",
    "gradient_checkpointing",
    "pytorch_attention",
    "torch_compile",
    "flash_benchmarking",
    "flash_accuracy",
    "training_step",
    "leaderboard",
    "distributed_communication_single_node",
    "naive_ddp",
    "ddp_flat",
    "ddp_overlap_individual",
    "ddp_bucketed",
    "communication_accounting",
    "parallelism_strategies",
    "optimizer_state_sharding",
    "fsdp",
    "course_tests",
)


def _load() -> dict[str, Section]:
    from cs336_systems.experiments.ddp_common import DEPENDS
    from cs336_systems.measured_code import register_depends
    from cs336_systems.report.data import register_section
    from cs336_systems.report.editions import CONSOLE_FOLDER

    sections = {}
    for name in MODULES:
        section = importlib.import_module(f"cs336_systems.experiments.{name}").SECTION
        if section.name != name:
            raise RuntimeError(f"experiments/{name}.py defines section {section.name!r}")
        sections[name] = section
        register_depends(name, section.depends)  # what the library's result writer compares commits by
        register_section(section)  # what the answers' provenance lines read a preset's values from
    register_depends("ddp_benchmark", DEPENDS)  # the DDP step benchmark's own runs, shown by §2.3.3
    # the CSE599-O scripts' printed outputs: the DDP step benchmark run by the course's script names
    register_depends(CONSOLE_FOLDER, (*DEPENDS, "cs336_systems/cse599o/"))
    return sections


SECTIONS: dict[str, Section] = _load()


def get(name: str) -> Section:
    """The section called ``name``; ``ValueError`` listing the sections otherwise."""
    if name not in SECTIONS:
        raise ValueError(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
    return SECTIONS[name]


__all__ = ["MODULES", "PRESETS", "SECTIONS", "Section", "get"]
