"""``python -m cs336_systems.experiments [SECTION ...] [--smoke | --quick | --full] [--set KEY=VALUE ...]``

Without a section: the list of sections. ``SECTION --help``: its parameters, their types and each preset's
values. A run measures, writes its results (``figures/SECTION/`` for a measured run on a GPU, or an
analytic section run with ``--publish``; ``.scratch/figures/SECTION/`` otherwise) and prints the answers
formatted from them. The preset defaults to ``full`` where the section's hardware is present and ``smoke``
(a tiny CPU run of the same pipeline) where it is not; ``--quick`` and ``--full`` refuse to start without it.

Under ``torchrun`` / ``srun`` every rank runs the section; rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cs336_systems.cli import RunFailed
from cs336_systems.experiments.section import PRESETS, CommandLineText, Section

PROG = "python -m cs336_systems.experiments"


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_preset(section: Section, preset: str | None) -> str:
    """``preset``, or the default for this machine; refuses a GPU preset where the GPUs are missing."""
    gpus = _gpus_here()
    if preset is None:
        return "full" if gpus >= section.gpus else "smoke"
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if preset != "smoke" and section.gpus > gpus:
        need = "a CUDA GPU" if section.gpus == 1 else f"{section.gpus} CUDA GPUs"
        raise ValueError(f"{section.name} --{preset} needs {need} and this machine has {gpus}: run --smoke here "
                         "(a tiny CPU run of the same pipeline) or run on a GPU node")
    return preset


def writer(section: Section, params: Any, preset: str, publish: bool | None = None,
           edition: str | None = None) -> Any:
    """The section's ResultWriter: a measured GPU run publishes unless told not to, an analytic one only
    when asked, a smoke run never. An ``edition`` grid writes to its own subfolder."""
    from cs336_systems.results import ResultWriter

    if publish is None:
        publish = section.gpus > 0
    # The run's preset is "run_preset"; "preset" too where the section has no parameter of that name (a model
    # preset, which the run's preset used to overwrite in the record).
    recorded = {**(asdict(params) if params is not None else {}), "run_preset": preset}
    recorded.setdefault("preset", preset)
    if edition is not None:
        recorded["edition"] = edition
    return ResultWriter(section.results_folder(edition), params=recorded, smoke=preset == "smoke", publish=publish)


def run_section(name: str, preset: str | None, overrides: dict[str, Any], *, publish: bool | None = None,
                argv: list[str] | None = None, quiet: bool = False, edition: str | None = None) -> int:
    """Run one section end to end: parameters, measurement, derived figures, and (on rank 0) the answers.
    ``argv`` (the torchrun form of a section module) is parsed like this command's own options;
    ``edition``: measure the grid that edition of the handout asks for (:attr:`Section.grids`)."""
    from cs336_systems.distributed import runner
    from cs336_systems.experiments import get

    if argv is not None:
        args = build_parser().parse_args([name, *argv])
        preset, overrides, publish, edition = args.preset, dict(args.set), args.publish, args.edition
    section = get(name)
    preset = resolve_preset(section, preset)
    params = section.params(preset, overrides, edition)
    out = writer(section, params, preset, publish, edition)
    main = runner.is_main_process()
    if main:
        print(f"§{section.number} {section.title} [{preset}] — {out.banner()}", flush=True)
    started = time.monotonic()
    if section.gpus > 0:  # a GPU measurement: the machine is calibrated before it and after it (run_main)
        from cs336_systems.calibration import JOB

        JOB.begin(out.smoke)
    section.execute(params, out) if main or section.gpus < 2 else section.run(params, out)
    if main and not quiet:
        print(summary(section, out.root, edition))
        print(f"§{section.number} {section.name}: done in {time.monotonic() - started:.0f} s; results in {out.dir}")
    return 0


def summary(section: Section, root: Path, edition: str | None = None) -> str:
    """The section's answers (from its ``edition`` grid's results, if given) as plain text, tables shown
    by caption only (the CSVs hold them)."""
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Figure, Missing, Question, Table, Text

    def lines(blocks: list[Any], indent: str = "") -> list[str]:
        out: list[str] = []
        for b in blocks:
            if isinstance(b, Question):
                out.append(f"{indent}({b.label}) {b.prompt}")
                out += lines(b.blocks, indent + "    ")
            elif isinstance(b, (Table, Figure)):
                out.append(f"{indent}[{b.source}] {b.caption}")
            elif isinstance(b, (Text, Missing)):
                out += textwrap.wrap(b.plain(), 110, initial_indent=indent, subsequent_indent=indent) or [""]
        return out

    return "\n".join(lines(section.answer(SectionData(root, section.results_folder(edition)))))


def describe(section: Section) -> str:
    rows = section.describe_params()
    if not rows:
        return "This section has no parameters."
    width = max(len(name) for name, *_ in rows)
    lines = ["parameters (--set KEY=VALUE; lists as a,b,c or [a, b]):"]
    for name, type_, values, help_ in rows:
        full = values["full"]
        others = ", ".join(f"{p} {values[p]!r}" for p in PRESETS if p != "full" and values[p] != full)
        lines.append(f"  {name:<{width}}  {type_}: {full!r}" + (f" ({others})" if others else ""))
        if help_:
            lines.append(f"  {'':<{width}}    {help_}")
    if section.jobs:
        lines.append("--full split into jobs of about ten minutes (H100), in order:")
        lines += [f"  {line}" for line in section.job_commands()]
    for edition, grid in section.grids.items():
        values = ", ".join(f"{k}={v!r}" for k, v in grid.items())
        lines.append(f"--edition {edition}: the {edition} handout's grid ({values}), written to "
                     f"figures/{section.results_folder(edition)}/")
    return "\n".join(lines)


def listing() -> str:
    from cs336_systems.experiments import SECTIONS

    lines = ["sections (python -m cs336_systems.experiments SECTION --help for its parameters):"]
    for s in SECTIONS.values():
        hw = {0: "any machine", 1: "1 GPU"}.get(s.gpus, f"{s.gpus}+ GPUs")
        lines.append(f"  §{s.number:<6} {s.name:<40} {s.title} ({hw})")
    return "\n".join(lines)


def assignment(text: str) -> tuple[str, CommandLineText]:
    """``KEY=VALUE`` for ``--set`` (``GROUP.KEY=VALUE`` inside a group of parameters); VALUE is read later, by
    the parameter's type."""
    key, sep, value = text.partition("=")
    if not sep or not all(part.isidentifier() for part in key.split(".")):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a parameter name as KEY, got {text!r}")
    return key, CommandLineText(value)


def build_parser(section: Section | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0] if section is None else f"§{section.number} {section.title}",
        epilog=listing() if section is None else describe(section), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", metavar="SECTION", help="sections to run, in order")
    preset = parser.add_mutually_exclusive_group()
    for name, text in (("smoke", "tiny CPU-sized run of the same pipeline"), ("quick", "a few minutes of the hardware"),
                       ("full", "the handout's grid (default where the hardware is present)")):
        preset.add_argument(f"--{name}", dest="preset", action="store_const", const=name, help=text)
    parser.add_argument("--set", action="append", default=[], type=assignment, metavar="KEY=VALUE",
                        help="override a parameter (repeatable): --set sizes=small,xl --set budget_s=300")
    parser.add_argument("--job", type=int, metavar="N",
                        help="run job N of the section's full run split into jobs of about ten minutes (listed by "
                             "--help and by `python -m cs336_systems.writeup status --jobs`); --set values apply over it")
    parser.add_argument("--edition", metavar="EDITION",
                        help="measure the grid this edition of the handout asks for, where it differs from the "
                             "workbook's (e.g. nsys_profile --edition 2026); results go to figures/SECTION/EDITION/")
    publish = parser.add_mutually_exclusive_group()
    publish.add_argument("--publish", dest="publish", action="store_const", const=True,
                         help="write figures/SECTION/ (default for measured GPU sections, not for analytic ones)")
    publish.add_argument("--no-publish", dest="publish", action="store_const", const=False,
                         help="write .scratch/figures/SECTION/ instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.experiments import SECTIONS, get

    argv = list(sys.argv[1:] if argv is None else argv)
    names = [a for a in argv if not a.startswith("-") and a in SECTIONS]
    if ("-h" in argv or "--help" in argv) and len(names) == 1:
        build_parser(get(names[0])).print_help()
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.sections:
        print(listing())
        return 0
    unknown = [n for n in args.sections if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; sections: {', '.join(SECTIONS)}")
    overrides = dict(args.set)
    if args.job is not None:  # one part of a split full run: its values, then any --set over them
        if len(args.sections) != 1 or args.preset not in (None, "full"):
            parser.error("--job runs a part of one section's --full run: name one section, without --smoke or --quick")
        overrides = {**get(args.sections[0]).job(args.job).sets, **overrides}
        args.preset = "full"
    # With several sections, each takes the overrides it has a parameter for; a key none has is a typo.
    # Every section's parameters are checked before the first one starts measuring.
    fields = {name: {f for f, *_ in get(name).describe_params()} for name in args.sections}
    stray = sorted(set(overrides) - set().union(*fields.values())) if len(args.sections) > 1 else []
    if stray:
        raise ValueError(f"no section of {', '.join(args.sections)} has a parameter {stray[0]!r}")
    plans = []
    for name in args.sections:
        mine = overrides if len(args.sections) == 1 else {k: v for k, v in overrides.items() if k in fields[name]}
        preset = resolve_preset(get(name), args.preset)
        get(name).params(preset, mine, args.edition)
        plans.append((name, preset, mine))
    for name, preset, mine in plans:
        try:
            run_section(name, preset, mine, publish=args.publish, edition=args.edition)
        except ValueError as exc:
            if raised_by_the_project(exc):  # our own checks raise ValueError for bad input only (e.g. a checkout)
                raise
            raise RunFailed(f"{name} [{preset}]") from exc  # pandas', torch's, ...: the run failed
    return 0


def raised_by_the_project(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a ``raise`` statement of this project's code (``cs336_systems`` or
    ``cs336_basics``): its checks of input. One raised inside a library it called, or by Python itself in our
    code (``max([])``, an unpacking, ``float("x")``), is a failure."""
    import linecache

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    ours = any(part in ("cs336_systems", "cs336_basics") for part in path.parts) and "site-packages" not in path.parts
    return ours and linecache.getline(str(path), tb.tb_lineno).lstrip().startswith("raise")


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, PROG))
