"""What a writeup section is: typed parameters with three presets, a measurement, derived figures and
the answer text, in one place.

Every module of :mod:`cs336_systems.experiments` defines one :class:`Section`. Its three callers share
everything it holds:

- the command line (``python -m cs336_systems.experiments SECTION --quick --set sizes=small,xl``);
- the section's notebook (parameters cell → :meth:`Section.execute` → answers), executed by papermill;
- the writeup builder, which calls :attr:`Section.answer` on the committed results.

So a default, an answer sentence or a derived figure exists once. Presets: ``full`` is the handout's
grid, ``quick`` the same questions in a few minutes of one GPU, ``smoke`` a tiny CPU run that exercises
the pipeline (tests, notebook smoke runs).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cs336_systems.results import REPO_ROOT, flat_params

PRESETS = ("smoke", "quick", "full")


@dataclass(frozen=True)
class Job:
    """One part of a section's full run, short enough for a GPU job of about ten minutes: parameter values set
    over the ``full`` preset. The jobs of a section write into the same tables, which combine their rows
    (:func:`cs336_systems.results.rows_of_this_run`) when the earlier jobs' results folder is on the machine."""

    sets: dict[str, Any]
    minutes: float | None = None
    """Wall minutes on an H100 when last measured, a fresh machine's start excluded (None: not timed yet)."""
    note: str = ""


def command_text(value: Any) -> str:
    """A parameter value as ``--set`` reads it: lists comma-separated (``[]`` when empty), booleans as words."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(command_text(v) for v in value) if value else "[]"
    return str(value)


@dataclass(frozen=True)
class Section:
    """One writeup section (a handout problem group) and everything that produces and explains it."""

    name: str
    """Results folder (``figures/<name>/``), notebook stem and command-line name."""
    number: str
    title: str
    problems: tuple[str, ...]
    """The handout's problem names this section answers."""
    answer: Callable[[Any], list[Any]]
    """``answer(SectionData) -> list[Block]``: the deliverables' answers, formatted from the results."""
    presets: dict[str, Any] = field(default_factory=dict)
    """``smoke`` / ``quick`` / ``full`` → a parameters dataclass instance (empty: nothing to run)."""
    run: Callable[[Any, Any], Any] | None = None
    """``run(params, out: ResultWriter)``: measure and write the measured tables."""
    derive: Callable[[dict[str, Any], dict[str, Any]], Any] | None = None
    """``derive(tables, meta) -> Derived``: figures and tables computed from measured results only, so
    ``python -m cs336_systems.writeup replot`` can redraw them on any machine."""
    derive_inputs: tuple[str, ...] = ()
    """The measured artefacts ``derive`` reads (at least one must exist; the first present gives the derived
    artefacts their provenance)."""
    combine: Callable[[Path], list[str]] | None = None
    """``combine(folder)``: add the tables that another job of a split run wrote to its own copy of this section's
    folder to the committed ones (``python -m cs336_systems.writeup combine``); None where jobs cannot combine so."""
    gpus: int = 1
    """GPUs a real (non-smoke) run needs; 0: analytic, runs anywhere."""
    depends: tuple[str, ...] = ()
    """Library paths whose change makes this section's results stale (see report.staleness)."""
    also: tuple[str, ...] = ()
    """Further results folders the writeup shows at the end of this section."""
    command: str | None = None
    """How to refresh the committed results, when it is not the default experiments command."""
    measured_elsewhere: str = ""
    """For sections whose measurement is not a preset run (e.g. an external checkout): what to do."""
    editions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Other editions of the handout that ask this section's questions of another grid, as stated here: edition →
    the parameter values of that grid, applied over the ``quick`` and ``full`` presets (``smoke`` stays tiny).
    :attr:`grids` adds those :attr:`sized_by` implies. A grid's results go to ``figures/<name>/<edition>/`` beside
    the workbook's own, so measuring one edition's grid never replaces the other's; that edition's writeup reads
    them."""
    sized_by: tuple[str, ...] = ()
    """Parameters whose value names a handout model (``"xl"``) or a list of them. Each edition that asks this
    section's problems (:func:`cs336_systems.report.editions.asks`) and whose table gives such a name another
    shape (:func:`cs336_systems.configs.handout_size`: 2026's xl, CSE599-O's Table 1) gets a grid of its own with
    the names translated, merged under any values :attr:`editions` states for it."""
    jobs: tuple[Job, ...] = ()
    """The full run split into jobs of about ten minutes, in the order to run them (empty: it is one job);
    ``python -m cs336_systems.experiments NAME --job N`` runs the N-th."""

    def __post_init__(self) -> None:
        # The section's own module measures too (above its answers marker): a change there stales results. A
        # section grown into a package (its answers in a module of their own) measures in the whole package.
        module = getattr(sys.modules.get((self.run or self.answer).__module__), "__file__", None)
        resolved = Path(module).resolve() if module else None
        if resolved is not None and resolved.name == "__init__.py":
            resolved = resolved.parent
        path = resolved.relative_to(REPO_ROOT).as_posix() if resolved and resolved.is_relative_to(REPO_ROOT) else None
        if path and resolved is not None and resolved.is_dir():
            path += "/"
        if path and path not in self.depends:
            object.__setattr__(self, "depends", (*self.depends, path))

    # -- parameters -----------------------------------------------------------------------------------

    @property
    def grids(self) -> dict[str, dict[str, Any]]:
        """Every edition with a grid of its own → its parameter values: those :attr:`sized_by` translates, with
        the values :attr:`editions` states merged over them."""
        sized = self.sized_editions() if self.sized_by else {}
        return {e: {**sized.get(e, {}), **self.editions.get(e, {})} for e in {**sized, **self.editions}}

    def sized_editions(self) -> dict[str, dict[str, Any]]:
        """Edition → the :attr:`sized_by` parameters whose handout model names mean another model there."""
        from cs336_systems.configs import HANDOUT_SIZES_BY_EDITION, handout_size

        full = self.presets.get("full")
        if full is None:
            raise ValueError(f"{self.name}: sized_by needs a full preset")
        grids: dict[str, dict[str, Any]] = {}
        from cs336_systems.report.editions import asks

        for edition in HANDOUT_SIZES_BY_EDITION:
            if not asks(edition, self.name):  # a grid only where that handout asks this section's problems
                continue
            grid = {}
            for name in self.sized_by:
                value = getattr(full, name)
                mapped = (list(dict.fromkeys(handout_size(v, edition) for v in value))  # one-model handouts
                          if isinstance(value, (list, tuple)) else handout_size(value, edition))
                if mapped != (list(value) if isinstance(value, (list, tuple)) else value):
                    grid[name] = mapped
            if grid:
                grids[edition] = grid
        return grids

    @property
    def params_type(self) -> type | None:
        return type(self.presets["full"]) if self.presets else None

    def check_edition(self, edition: str | None) -> None:
        """``edition`` None or one with a grid of its own here (``ValueError`` naming the valid ones)."""
        if edition is not None and edition not in self.grids:
            have = ", ".join(self.grids) or "none"
            raise ValueError(f"{self.name} has no grid of its own for edition {edition!r} "
                             f"(editions with one: {have}); its results answer every edition")

    def results_folder(self, edition: str | None = None) -> str:
        """The results folder under ``figures/``: the section's, or its edition grid's subfolder."""
        self.check_edition(edition)
        return self.name if edition is None else f"{self.name}/{edition}"

    def params(self, preset: str = "full", overrides: dict[str, Any] | None = None,
               edition: str | None = None) -> Any:
        """The ``preset``'s parameters with ``edition``'s grid (unless smoke) and then ``overrides``
        applied, each checked against the field's type; unknown names and wrong types raise ``ValueError``
        naming the parameter."""
        self.check_edition(edition)
        if edition is not None and preset != "smoke":
            overrides = {**self.grids[edition], **(overrides or {})}
        if not self.presets:
            if overrides:
                raise ValueError(f"{self.name} takes no parameters")
            return None
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for {self.name}; presets: {', '.join(self.presets)}")
        params = _replaced(self.presets[preset], flat_params(overrides or {}), self.name)  # nested dicts as GROUP.NAME
        check = getattr(params, "check", None)
        if check is not None:
            check()
        return params

    def describe_params(self) -> list[tuple[str, str, dict[str, Any], str]]:
        """``(name, type, {preset: value}, help)`` per parameter, for ``--help`` and the README."""
        if not self.presets:
            return []
        rows = []

        def walk(params: dict[str, Any], prefix: str) -> None:  # preset -> that preset's (group's) values
            first = next(iter(params.values()))
            hints = typing.get_type_hints(type(first))
            for f in dataclasses.fields(first):
                if f.metadata.get("group"):  # a group's parameters, named group.parameter
                    walk({p: getattr(v, f.name) for p, v in params.items()}, f"{prefix}{f.name}.")
                    continue
                values = {p: getattr(v, f.name) for p, v in params.items()}
                rows.append((prefix + f.name, type_name(hints[f.name]), values, f.metadata.get("help", "")))

        walk(dict(self.presets), "")
        return rows

    # -- what the writeup says about it ---------------------------------------------------------------

    @property
    def refresh_command(self) -> str:
        return self.command_for(None)

    def command_for(self, edition: str | None) -> str:
        """How to refresh the results of the section, or of its ``edition`` grid."""
        self.check_edition(edition)
        if self.command:  # a command of its own carries what the section needs (an edition grid adds its flag)
            return self.command + (f" --edition {edition}" if edition else "")
        return (f"uv run python -m cs336_systems.experiments {self.name}"
                + (" --publish" if self.gpus == 0 else " --full") + (f" --edition {edition}" if edition else ""))

    def job(self, number: int) -> Job:
        """Job ``number`` (1-based) of :attr:`jobs`, or a ``ValueError`` saying how many there are."""
        if not 1 <= number <= len(self.jobs):
            have = f"jobs 1..{len(self.jobs)}" if self.jobs else "no jobs (its full run is one job)"
            raise ValueError(f"{self.name} has {have}; got --job {number}")
        return self.jobs[number - 1]

    def job_commands(self) -> list[str]:
        """One command line per job, with its wall time when known."""
        lines = []
        for n, job in enumerate(self.jobs, 1):
            sets = " ".join("--set " + shlex.quote(f"{k}={command_text(v)}") for k, v in job.sets.items())
            time = f"{job.minutes:g} min" if job.minutes is not None else "not timed"
            lines.append(f"uv run python -m cs336_systems.experiments {self.name} --job {n}   # {sets} ({time}"
                         + (f"; {job.note}" if job.note else "") + ")")
        return lines

    @property
    def where(self) -> str:
        machine = {0: "", 1: "on a GPU machine; "}.get(self.gpus, f"on a machine with {self.gpus}+ GPUs; ")
        return f"({machine}writes `figures/{self.name}/`)"

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.name}.ipynb"

    # -- running --------------------------------------------------------------------------------------

    def execute(self, params: Any, out: Any) -> Any:
        """Measure, then derive: what the command line and the notebook run."""
        if self.run is None:
            raise ValueError(f"{self.name} is not measured by a preset run: {self.measured_elsewhere}")
        results = self.run(params, out)
        if self.derive is not None:
            self.rederive(out)
        return results

    def rederive(self, out: Any, sources: dict[str, dict[str, Any]] | None = None) -> list[Any]:
        """Run :attr:`derive` on the measured artefacts in ``out.dir`` and write what it returns there."""
        from cs336_systems.derived import load_inputs, primary_meta, write_derived

        if self.derive is None:
            return []
        try:
            tables, metas = load_inputs(self, out.root, out.section)
        except FileNotFoundError:  # this run measured none of derive's inputs (e.g. other parts only)
            return []
        return write_derived(out, self.derive(tables, primary_meta(self, metas)), sources)


def param(default: Any, help: str = "") -> Any:  # noqa: A002 - mirrors dataclasses.field
    """A parameter field with a help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def group(default: Any, help: str = "") -> Any:  # noqa: A002 - mirrors dataclasses.field
    """A group of parameters: a field whose value is a frozen dataclass of :func:`param` fields (one part of a
    section's run, e.g. its shapes grid), set as ``--set GROUP.NAME=VALUE`` (or ``{"GROUP": {"NAME": VALUE}}``
    from a notebook) and recorded nested (``{"GROUP": {"NAME": VALUE}}``)."""
    if not dataclasses.is_dataclass(default) or isinstance(default, type):
        raise TypeError(f"group() needs a dataclass instance, got {default!r}")
    return field(default_factory=lambda: default, metadata={"help": help, "group": True})


def _replaced(base: Any, overrides: dict[str, Any], where: str) -> Any:
    """``base`` (a parameters dataclass) with ``overrides`` (dotted keys reach into groups), each value read
    and checked against its field's type; an unknown name raises ``ValueError`` listing the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(base)}
    hints = typing.get_type_hints(type(base))
    changes: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        name, dot, rest = key.partition(".")
        if name not in fields:
            raise ValueError(f"{where} has no parameter {name!r}; parameters: {', '.join(fields)}")
        is_group = bool(fields[name].metadata.get("group"))
        if is_group != bool(dot):
            raise ValueError(f"{where}.{name} is a group of parameters: set {where}.{name}.NAME" if is_group else
                             f"{where}.{name} is a parameter, not a group: got {key!r}")
        if is_group:
            inner.setdefault(name, {})[rest] = value
            continue
        what = f"{where}.{key}"
        if isinstance(value, CommandLineText):
            value = from_text(str(value), hints[key], what)
        changes[key] = coerce(value, hints[key], what)
    for name, values in inner.items():
        changes[name] = _replaced(getattr(base, name), values, f"{where}.{name}")
    return dataclasses.replace(base, **changes)


def check_presets(*names: str) -> None:
    """Every name a model preset (``ValueError`` naming the valid ones otherwise)."""
    from cs336_systems.configs import get_config

    for name in names:
        get_config(name)


def check_parts(section: str, parts: list[str], allowed: tuple[str, ...]) -> None:
    """Every part one of ``allowed`` (``ValueError`` naming the first that is not, and the valid ones)."""
    unknown = [x for x in parts if x not in allowed]
    if unknown:
        raise ValueError(f"{section}: unknown part {unknown[0]!r}; parts: {', '.join(allowed)}")


def check_positive(**values: float) -> None:
    """Every value > 0 (``ValueError`` naming the first that is not)."""
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be positive, got {value!r}")


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


class CommandLineText(str):
    """A parameter value as typed on the command line: read according to the parameter's type."""


def from_text(text: str, hint: Any, what: str) -> Any:
    """Command-line text as the type ``hint`` wants it: a path or a word stays text where text is wanted;
    ``a,b,c`` or ``[a, b]`` is a list; ``None`` is None where allowed; numbers and booleans are literals."""
    import ast

    from cs336_systems.cli import parse_value

    text = text.strip()
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if text == "None" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return from_text(text, inner[0], what) if len(inner) == 1 else parse_value(text)
    if origin in (list, tuple):
        if text.startswith("["):
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"{what}: cannot read {text!r} as a list") from exc
        return [from_text(item, args[0] if args else Any, what) for item in text.split(",") if item.strip()]
    if hint is str:
        if text[:1] in ("'", '"'):
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"{what}: cannot read {text!r}") from exc
        return text
    try:
        return parse_value(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def coerce(value: Any, hint: Any, what: str) -> Any:
    """``value`` (from the command line, papermill or Python) as the type ``hint`` names: a single value
    becomes a one-element list where a list is wanted, ints pass as floats; anything else that does not
    fit raises ``ValueError`` naming ``what``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, what)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{what}: bad value {value!r}")
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1] or (Any,)
        items = value if isinstance(value, (list, tuple)) else [value]
        return [coerce(v, item, what) for v in items]
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a preset named 2.7B arrives as text, but "1024" as a number
    if hint is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{what} must be {type_name(hint)}, got {value!r}")
    return value
