"""The writeup per edition of the handout: which sections answer which problems, under which numbers.

The 2025 writeup (``writeup.pdf``) is every section in the workbook's own order. The 2026 handout renumbers
the assignment, drops and adds problems, and asks some of the same questions of other models; its writeup
(``writeup-2026.pdf``) shows the same sections' answers under the 2026 numbers and problem names, with a
note wherever the committed results answer the 2025 wording rather than the 2026 one, and an entry for
every 2026 problem no section measures yet. Nothing is answered twice: both documents read the same results.
"""

from __future__ import annotations

from dataclasses import dataclass

EDITIONS = ("2025", "2026", "cse599o")

#: How each edition's writeup names its handout.
HANDOUT_NAMES = {"2025": "CS336 2025", "2026": "CS336 2026", "cse599o": "CSE599-O"}
#: The assignment each edition answers, where it is not CS336's (the writeup's title).
ASSIGNMENT_TITLES = {"cse599o": "CSE599-O Assignment 2 (Scaling with Data Parallelism)"}


@dataclass(frozen=True)
class Entry:
    """One section of an edition's writeup."""

    number: str
    """The handout's section number."""
    problems: tuple[str, ...]
    """The handout's problem names the section answers (empty: context, such as the model table)."""
    section: str | None
    """The workbook section (``cs336_systems.experiments``) whose answers it shows; None: not built yet."""
    title: str | None = None
    """The title, when the workbook section's own does not fit this edition."""
    note: str = ""
    """How the committed results differ from what this edition asks, and how to close the gap (not shown
    once the section's own grid for this edition is measured)."""
    borrow: tuple[tuple[str, str, str], ...] = ()
    """``(section, label, label here)``: a question another workbook section answers, shown here under this
    handout's part label and left out of the lending section (a part the handout asks in another place)."""
    remark: str = ""
    """What this edition's readers should know either way (shown after the note)."""
    labels: tuple[tuple[str, str], ...] = ()
    """``(workbook label, label here)``: the section's parts under this handout's problem names, where the two
    handouts name one problem differently."""
    console: tuple[tuple[str, str], ...] = ()
    """``(record, command)`` pairs: the printed output the handout asks to show ("a screenshot"), each kept by
    ``command --record record`` in ``figures/<CONSOLE_FOLDER>/`` and shown as a console block."""


#: Where the course scripts keep the printed output they were asked to record (``--record NAME``).
CONSOLE_FOLDER = "cse599o"


def _xl_note(section: str) -> str:
    """Until a section sized by the handout's xl has measured 2026's xl, what its results are instead."""
    return (f"2026's xl is 2560/10240/32/32 (2025's 2.7B); until that grid is measured (`python -m "
            f"cs336_systems.experiments {section} --full --edition 2026`) the results below are 2025's xl "
            "(1600/6400/48/25).")

#: The 2026 handout (26.1.x) in its own order.
EDITION_2026: tuple[Entry, ...] = (
    Entry("2.1.2", (), "model_sizes"),
    Entry("2.1.3", ("benchmarking_script",), "benchmarking"),
    Entry("2.1.4", ("nsys_profile",), "nsys_profile",
          note="2026 asks for two sizes at three power-of-two contexts above 128 each, up to the longest that "
               "fits; until that grid is measured (`python -m cs336_systems.experiments nsys_profile --full "
               "--edition 2026`: small and large at 256 to 4096) the results below are the 2025 grid (every "
               "size at contexts 128 to 1024)."),
    Entry("2.1.5", ("mixed_precision_accumulation", "benchmarking_mixed_precision"), "mixed_precision"),
    Entry("2.1.6", ("memory_profiling",), "memory_profiling",
          note="2026 profiles its xl, the same model as 2025's 2.7B (2560/10240/32/32), at contexts 128 and "
               "2048; until that grid is measured (`python -m cs336_systems.experiments memory_profiling --full "
               "--edition 2026`) the results below are 2025's contexts 128, 256 and 512.",
          borrow=(("gradient_checkpointing", "residuals", "f"),)),  # (f): one block's residuals, measured in §3
    Entry("3", ("gradient_checkpointing",), "gradient_checkpointing",
          title="Single-GPU memory: autograd residuals and gradient checkpointing"),
    Entry("4.1.1", ("pytorch_attention",), "pytorch_attention"),
    Entry("4.2", ("torch_compile",), "torch_compile"),
    Entry("4.2.2", ("flash_forward", "flash_backward", "flash_benchmarking"), "flash_benchmarking"),
    Entry("4.2.4", ("beyond the handout",), "flash_accuracy"),
    Entry("5.1", ("distributed_communication_single_node",), "distributed_communication_single_node",
          note="This handout asks for NCCL all-reduces on 2, 4 or 6 GPUs; the results below add gloo and stop at "
               "4 GPUs, the most any machine they ran on had."),
    Entry("5.2", ("naive_ddp", "naive_ddp_benchmarking"), "naive_ddp", note=_xl_note("naive_ddp")),
    Entry("5.3.1", ("minimal_ddp_flat_benchmarking",), "ddp_flat", note=_xl_note("ddp_flat")),
    Entry("5.3.2", ("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"),
          "ddp_overlap_individual", note=_xl_note("ddp_overlap_individual")),
    Entry("5.3.3", ("beyond the 2026 handout",), "ddp_bucketed",
          note="The 2026 handout dropped bucketed DDP; it is kept here beyond the handout (2026's "
               "`get_ddp` is §5.3.2's per-parameter overlap)."),
    Entry("6", ("optimizer_state_sharding", "optimizer_state_sharding_accounting"), "optimizer_state_sharding",
          note=_xl_note("optimizer_state_sharding")),
    Entry("7", ("fsdp", "fsdp_accounting"), "fsdp",
          note="The comparison below runs this handout's xl (2025's 2.7B, the same model) and CS336 2025's smaller "
               "xl; fsdp_accounting (b) profiles this handout's xl on two GPUs."),
    Entry("8", ("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs"),
          "parallelism_strategies"),
    Entry("9", ("leaderboard",), "leaderboard", title="Leaderboard: a full training step of an 8B model on two GPUs",
          note="Below is this handout's step at its full shape on two GPUs under our FSDP, with the torch-native "
               "reference beside it; the memory plan that chose which blocks to checkpoint is in the appendix."),
    Entry("10", ("beyond the handout",), "training_step"),
    Entry("11", ("the course's tests",), "course_tests"),
)


#: Workbook sections the 2025 handout does not ask for (the 2026 handout's problems, the workbook's own studies,
#: the course's tests): the 2025 writeup shows them after its answers, in the appendix.
APPENDIX_2025 = ("gradient_checkpointing", "flash_accuracy", "training_step", "leaderboard", "parallelism_strategies",
                 "fsdp", "course_tests")


def _table1_note(section: str) -> str:
    """Until a DDP section has measured CSE599-O's Table 1 model, what its results are instead."""
    return (f"CSE599-O's Table 1 model is 1280/5120/36/20 (CS336's large); until that grid is measured (`python -m "
            f"cs336_systems.experiments {section} --full --edition cse599o`, 2 GPUs) the results below are "
            "CS336 2025's xl (1600/6400/48/25).")



#: The CSE599-O handout ("Scaling with Data Parallelism"): its ten problems in its order, under its section numbers.
EDITION_CSE599O: tuple[Entry, ...] = (
    Entry("1.5", (), "model_sizes", title="The model (the handout's Table 1)"),
    Entry("2.2", ("distributed_communication_single_node",), "distributed_communication_single_node",
          title="Benchmarking distributed applications",
          note="CSE599-O measures NCCL on 2, 4 and 8 GPUs (`python -m cs336_systems.experiments "
               "distributed_communication_single_node --full --edition cse599o` on 8 GPUs); the results below stop "
               "where the machine did."),
    Entry("2.3", ("toymodel_naive_ddp", "transformer_naive_ddp_benchmarking"), "naive_ddp",
          title="A naive implementation of distributed data parallel training", note=_table1_note("naive_ddp"),
          labels=(("naive_ddp", "toymodel_naive_ddp"), ("naive_ddp_benchmarking", "transformer_naive_ddp_benchmarking")),
          console=(("naive_toy", "benchmark_naive_ddp.py --model toy"),
                   ("naive_transformer", "benchmark_naive_ddp.py --model transformer"))),
    Entry("2.4.1", ("minimal_ddp_flat_benchmarking",), "ddp_flat", title="Reducing the number of communication calls",
          note=_table1_note("ddp_flat"), console=(("flat", "benchmark_optimized_ddp.py --mode flat"),)),
    Entry("2.4.2", ("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"),
          "ddp_overlap_individual", title="Overlapping computation with communication of individual gradients",
          note=_table1_note("ddp_overlap_individual"),
          console=(("individual", "benchmark_optimized_ddp.py --mode individual"),)),
    Entry("2.4.3", ("ddp_overlap_bucketed", "ddp_bucketed_benchmarking"), "ddp_bucketed",
          title="Overlapping computation with communication of bucketed gradients", note=_table1_note("ddp_bucketed"),
          console=(("bucketed", "benchmark_optimized_ddp.py --mode bucketed --bucket-size-mb 1 10 100 1000"),)),
    Entry("3.1", ("optimizer_state_sharding", "optimizer_state_sharding_accounting"), "optimizer_state_sharding",
          note=_table1_note("optimizer_state_sharding")),
    Entry("4", ("the course's tests",), "course_tests"),
)


def console_records() -> tuple[tuple[str, str], ...]:
    """Every ``(record, command)`` an edition shows as printed output (kept in ``figures/<CONSOLE_FOLDER>/``)."""
    return tuple(pair for edition in EDITIONS for e in (entries(edition) or ()) for pair in e.console)


@dataclass(frozen=True)
class ConsoleStatus:
    """The recorded printed outputs as one entry of ``writeup status``, beside the sections (they are results
    like any other: measured code, device and calibration in their sidecars)."""

    depends: tuple[str, ...]
    number: str = ""
    title: str = "Printed outputs of the CSE599-O scripts"
    name: str = CONSOLE_FOLDER
    grids: tuple[str, ...] = ()
    jobs: tuple = ()

    def results_folder(self, edition: str | None = None) -> str:
        return CONSOLE_FOLDER

    def command_for(self, edition: str | None = None) -> str:
        return ("on a node with 2 GPUs, in cs336_systems/cse599o/: "
                + "; ".join(f"uv run {command} --record {record}" for record, command in console_records()))


def asks(edition: str, section: str) -> bool:
    """Whether ``edition``'s handout asks one of its own problems of workbook ``section`` (2025: the workbook's
    own grid answers it; an entry beyond that handout does not count)."""
    found = entries(edition)
    if found is None:
        return False
    return any(e.section == section and e.problems and not in_appendix(edition, section, e.problems) for e in found)


#: Handouts that number their problems, by problem name: CSE599-O heads each "Problem-N (name)".
PROBLEM_NUMBERS: dict[str, dict[str, int]] = {"cse599o": {name: n for n, name in enumerate((
    "distributed_communication_single_node", "toymodel_naive_ddp", "transformer_naive_ddp_benchmarking",
    "minimal_ddp_flat_benchmarking", "ddp_overlap_individual_parameters",
    "ddp_overlap_individual_parameters_benchmarking", "ddp_overlap_bucketed", "ddp_bucketed_benchmarking",
    "optimizer_state_sharding", "optimizer_state_sharding_accounting"), start=1)}}


def numbered(edition: str, problem: str) -> str:
    """``problem`` as ``edition``'s handout heads it: ``"Problem-6 (name)"`` where it numbers its problems, else
    the name itself."""
    n = PROBLEM_NUMBERS.get(edition, {}).get(problem)
    return f"Problem-{n} ({problem})" if n else problem


def handout_name(edition: str) -> str:
    """``"the CSE599-O handout"``, ``"the CS336 2026 handout"``."""
    if edition not in EDITIONS:
        raise ValueError(f"unknown edition {edition!r}; editions: {', '.join(EDITIONS)}")
    return f"the {HANDOUT_NAMES[edition]} handout"


def in_appendix(edition: str, section: str, problems: tuple[str, ...] = ()) -> bool:
    """Whether ``section`` goes to ``edition``'s appendix: beyond that handout (for 2026, the entries whose
    problems say so)."""
    if any(p.startswith(("beyond", "the course")) for p in problems):
        return True
    return edition == "2025" and section in APPENDIX_2025


def borrowed_as(edition: str, section: str, lender: str, label: str) -> str | None:
    """The part label under which ``edition``'s ``section`` shows ``lender``'s question ``label`` (an entry's
    ``borrow``), or None where it does not: an answer cites the part the reader finds, not the section that lent it."""
    for entry in entries(edition) or ():
        if entry.section == section:
            return next((here for name, lent, here in entry.borrow if (name, lent) == (lender, label)), None)
    return None


def entries(edition: str) -> tuple[Entry, ...] | None:
    """The edition's sections in order, or None for the workbook's own order (2025)."""
    if edition not in EDITIONS:
        raise ValueError(f"unknown edition {edition!r}; editions: {', '.join(EDITIONS)}")
    return {"2026": EDITION_2026, "cse599o": EDITION_CSE599O}.get(edition)

