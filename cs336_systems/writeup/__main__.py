"""``python -m cs336_systems.writeup {build,check,html,status,replot,history,combine}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cs336_systems.report import manifest as _manifest
from cs336_systems.results import FIGURES_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.writeup", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="render writeup.pdf, writeup.html beside it and figures/index.html from "
                                         "the results, and update the manifest")
    build.add_argument("--figures", type=Path, default=FIGURES_DIR, help="results root (default: figures/)")
    build.add_argument("--output", type=Path, default=_manifest.DEFAULT_PDF, help="PDF path (default: writeup.pdf)")
    build.add_argument("--strict", action="store_true", help="fail when a section cannot format its answers")
    build.add_argument("--no-manifest", action="store_true",
                       help="preview only: do not update the manifest (use with --figures .scratch/figures)")
    html = sub.add_parser("html", help="write only the HTML writeup (no browser needed, no manifest)")
    html.add_argument("--figures", type=Path, default=FIGURES_DIR)
    # Not the committed writeup.html: that one changes only with the PDF and the manifest, through `build`.
    html.add_argument("--output", type=Path, default=Path("executed/writeup.html"),
                      help="where to write it (default: executed/writeup.html, an ignored folder)")
    status = sub.add_parser("status", help="every section: fresh / stale (files changed since) / missing, with the "
                                           "command that refreshes it; exit 1 while any result shown is stale")
    status.add_argument("--figures", type=Path, default=FIGURES_DIR)
    status.add_argument("-v", "--verbose", action="store_true", help="list every stale result with its reason")
    status.add_argument("--jobs", action="store_true",
                        help="for each stale or missing section split into GPU jobs, the command of every job")
    history = sub.add_parser("history", help="pack the git history a copy of the tree needs to extend tables "
                                             "measured since a commit (untar it at the copy's root)")
    history.add_argument("since", help="the oldest commit whose tables the copy's jobs extend")
    history.add_argument("output", type=Path, help="the tar file to write")
    combine = sub.add_parser("combine", help="add a table that another job wrote to its own copy of a section's "
                                             "folder to the committed one, as one job extending the other would")
    combine.add_argument("section", help="a section whose split jobs can be combined (flash_benchmarking)")
    combine.add_argument("folder", type=Path, help="the other job's copy of figures/SECTION/")
    from cs336_systems.writeup import replot

    redraw = sub.add_parser("replot", help="redraw figures and derived tables from committed measurements")
    replot.add_arguments(redraw)
    check = sub.add_parser("check", help="exit 1 when writeup.pdf is older than its inputs")
    check.add_argument("--figures", type=Path, default=FIGURES_DIR)
    check.add_argument("--pdf", type=Path, default=_manifest.DEFAULT_PDF)
    check.add_argument("--manifest", type=Path, default=_manifest.DEFAULT_MANIFEST)
    args = parser.parse_args(argv)

    if args.command == "history":
        import cs336_systems.experiments  # noqa: F401  (the sections register the paths they depend on)
        from cs336_systems.measured_code import pack_history

        out = pack_history(args.since, args.output)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): untar it at the copy's root, "
              "beside cs336_systems/")
        return 0
    if args.command == "replot":
        return replot.run_command(args)
    if args.command == "combine":
        from cs336_systems.experiments import SECTIONS

        can = sorted(name for name, s in SECTIONS.items() if s.combine is not None)
        spec = SECTIONS.get(args.section)
        if spec is None or spec.combine is None:
            parser.error(f"combine: {args.section!r} has no combine; sections that have: {', '.join(can)}")
        try:
            names = spec.combine(args.folder)
        except (ValueError, OSError) as e:  # refused, or a file of the other folder unreadable
            parser.error(str(e))
        print(f"combined {args.folder} into figures/{args.section}/: {', '.join(names)}")
        return 0
    if args.command == "build":
        from cs336_systems.writeup.build import build as build_pdf

        default_root = args.figures.resolve() == FIGURES_DIR.resolve()
        if not default_root and not args.no_manifest and args.output.resolve() == _manifest.DEFAULT_PDF.resolve():
            parser.error("building writeup.pdf from another results root would desynchronize the manifest; "
                         "pass --output elsewhere and --no-manifest for a preview")
        manifest = None if args.no_manifest else (_manifest.DEFAULT_MANIFEST if default_root
                                                  else args.figures / _manifest.MANIFEST_NAME)
        written = build_pdf(args.output, args.figures, manifest, strict=args.strict)
        print("wrote", *written, sep="\n  ")
        pending = _manifest.uncommitted_inputs(args.figures) if manifest else []
        if pending:
            print("note: built from inputs that are not committed; commit them with the PDF and manifest, or a "
                  "clean checkout's `check` will fail:", *pending, sep="\n  ", file=sys.stderr)
        return 0
    if args.command == "html":
        from cs336_systems.writeup.build import build_document, write_html

        print(f"wrote {write_html(build_document(args.figures), args.output)}")
        return 0
    if args.command == "status":
        from cs336_systems.experiments import SECTIONS
        from cs336_systems.measured_code import depends_of
        from cs336_systems.report.editions import CONSOLE_FOLDER, ConsoleStatus
        from cs336_systems.report.staleness import section_status

        statuses = [section_status(args.figures, spec, edition=edition) for spec in SECTIONS.values()
                    for edition in (None, *spec.grids)]
        statuses.append(section_status(args.figures, ConsoleStatus(depends_of(CONSOLE_FOLDER))))
        for st in statuses:
            print(st.line())
            if args.verbose:
                for name, verdict in sorted(st.stale.items()):
                    print(f"    {name}: {verdict.reason}")
            spec = SECTIONS.get(st.folder.split("/")[0])
            if args.jobs and st.state != "fresh" and spec is not None and spec.jobs and st.folder == spec.name:
                print("\n".join(f"    {line}" for line in spec.job_commands()))
        counts = {state: sum(st.state == state for st in statuses) for state in ("fresh", "stale", "missing")}
        suspect = sum(bool(st.suspect) for st in statuses)
        uncalibrated = sum(st.uncalibrated for st in statuses)
        from cs336_systems.report.agreement import TOLERANCE, disagreements, shared_keys

        found = disagreements(args.figures)
        keys = shared_keys(args.figures)
        print(f"Across sections: {len(keys)} configurations measured by more than one table are checked; "
              f"{len(found)} lie more than {TOLERANCE:.0%} apart and beyond their runs' spread" + (":" if found else ""))
        for d in found[: None if args.verbose else 8]:
            print(f"    {d.line()}")
        if len(found) > 8 and not args.verbose:
            print(f"    ... and {len(found) - 8} more (-v lists them)")
        print(f"{counts['fresh']} fresh, {counts['stale']} stale, {counts['missing']} missing "
              f"(of {len(SECTIONS)} sections, {len(statuses) - len(SECTIONS) - 1} edition grids and the printed "
              "outputs)"
              + f"; {suspect} suspect (a slow machine); {uncalibrated} results from an uncalibrated machine")
        return 1 if counts["stale"] or suspect or found else 0
    problems = _manifest.check_manifest(args.pdf, args.figures, args.manifest)
    if problems:
        print(f"{args.pdf} is stale:", *problems, f"rebuild with: {_manifest.REBUILD_COMMAND}", sep="\n  ",
              file=sys.stderr)
        return 1
    print(f"{args.pdf} is up to date with {args.figures}")
    return 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.writeup"))
