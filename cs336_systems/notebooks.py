"""Execute the workbook's notebooks headlessly with papermill.

``python -m cs336_systems.notebooks run`` executes every notebook in ``notebooks/`` (or the ones named)
into the git-ignored ``executed/`` folder. Each notebook runs its section of
:mod:`cs336_systems.experiments`: on a machine without the section's GPUs (or with ``--smoke``) with the
``smoke`` preset, writing to ``.scratch/figures``; where they are present with the ``full`` preset (or
``-p preset=quick``), writing to ``figures/``. Analytic sections run in full anywhere and write to
``figures/`` only with ``-p publish=True``. Committed notebooks carry no outputs;
``python -m cs336_systems.notebooks strip`` removes outputs before a commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .cli import parse_assignment
from .results import REPO_ROOT, is_smoke_run

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
EXECUTED_DIR = REPO_ROOT / "executed"


def list_notebooks() -> list[str]:
    """Notebook stems in ``notebooks/``, sorted."""
    return sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))


def notebook_path(name: str) -> Path:
    path = NOTEBOOK_DIR / f"{Path(name).stem}.ipynb"
    if not path.exists():
        raise ValueError(f"no notebook {name!r}; available: {', '.join(list_notebooks())}")
    return path


def parameter_names(name: str) -> list[str]:
    """The names the notebook's ``parameters``-tagged cell assigns, in order (what ``-p`` may set): papermill
    itself only warns about any other name and runs the defaults."""
    import ast

    import nbformat

    nb = nbformat.read(notebook_path(name), as_version=4)
    names: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            for node in ast.parse(cell.source).body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                names += [t.id for t in targets if isinstance(t, ast.Name) and t.id not in names]
    return names


def check_parameters(names: list[str], parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` for the notebooks ``names`` as the kernel will read them (``publish='false'`` is False,
    ``preset='none'`` None; :func:`~cs336_systems.experiments.notebook.notebook_parameters`), only the names
    given. ``ValueError`` in one line for a name some notebook's ``parameters`` cell does not define (a typo
    would otherwise run the defaults) or a value the notebook would refuse."""
    from cs336_systems.experiments.notebook import notebook_parameters

    for name in names:
        known = parameter_names(name)
        unknown = [key for key in parameters if key not in known]
        if unknown:
            raise ValueError(f"notebook {Path(name).stem} has no parameter {', '.join(map(repr, unknown))}; "
                             f"its parameters: {', '.join(known)}")
    given = {key: value for key, value in parameters.items()
             if key in ("preset", "overrides", "publish", "edition")}
    values = notebook_parameters(**given)._asdict()
    return {**parameters, **{key: values[key] for key in given}}


def _local_kernel_manager() -> type:
    from jupyter_client.manager import AsyncKernelManager

    class LocalKernelManager(AsyncKernelManager):
        """The kernel on local IPC sockets in a private temporary folder rather than TCP on loopback:
        nothing listens on a port, and ipykernel has no reason to warn about unencrypted TCP."""

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", os.path.join(tempfile.mkdtemp(prefix="cs336-kernel-"), "kernel"))
            super().__init__(**kwargs)

        async def _async_interrupt_kernel(self) -> None:
            # jupyter_client sends SIGINT before every shutdown request; an idle kernel then logs
            # "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel" after a run that succeeded. The shutdown
            # request that follows (then SIGTERM, SIGKILL) stops it either way.
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return LocalKernelManager


def execute(
    name: str,
    parameters: dict[str, Any] | None = None,
    *,
    smoke: bool | None = None,
    output_dir: Path | None = None,
    timeout_s: int | None = None,
    log_output: bool = False,
) -> Path:
    """Run one notebook with papermill and return the executed copy's path.

    ``smoke`` (default: no CUDA GPU here) runs a measured section's ``smoke`` preset unless ``parameters``
    name a preset; it is also exported to the kernel as ``CS336_SMOKE`` for code that asks
    :func:`~cs336_systems.results.is_smoke_run`.
    """
    import papermill as pm

    src = notebook_path(name)
    smoke = is_smoke_run(smoke)
    parameters = dict(parameters or {})
    if smoke and parameters.get("preset") is None and _section_gpus(src.stem) > 0:  # -p preset=None: the default
        parameters["preset"] = "smoke"
    out_dir = output_dir or EXECUTED_DIR / ("smoke" if smoke else "gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    old = os.environ.get("CS336_SMOKE")
    os.environ["CS336_SMOKE"] = "1" if smoke else "0"
    try:
        pm.execute_notebook(
            str(src),
            str(dst),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(NOTEBOOK_DIR),
            execution_timeout=timeout_s,
            log_output=log_output,
            progress_bar=False,
            kernel_manager_class=_local_kernel_manager(),
        )
    finally:
        if old is None:
            os.environ.pop("CS336_SMOKE", None)
        else:
            os.environ["CS336_SMOKE"] = old
    return dst


def failure_summary(exc: BaseException) -> str:
    """One line naming what failed: for an error inside a notebook, the notebook's own exception type and
    message (papermill's wrapper carries them as ``ename`` / ``evalue``), else the exception itself."""
    kind = getattr(exc, "ename", None) or type(exc).__name__
    message = getattr(exc, "evalue", None) if getattr(exc, "ename", None) else str(exc)
    first = next((line.strip() for line in str(message or "").splitlines() if line.strip()), "")
    return f"{kind}: {first}" if first else f"{kind} (no message)"


def _section_gpus(name: str) -> int:
    """GPUs the notebook's section needs (notebooks without a section count as measured)."""
    from cs336_systems.experiments import SECTIONS

    return SECTIONS[name].gpus if name in SECTIONS else 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def strip_outputs(paths: list[Path]) -> list[Path]:
    """Clear outputs and execution counts in place; returns the notebooks that changed."""
    import nbformat

    changed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        dirty = False
        for cell in nb.cells:
            if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
                cell.outputs, cell.execution_count = [], None
                dirty = True
            if cell.metadata.pop("execution", None) is not None:
                dirty = True
        if dirty:
            nbformat.write(nb, path)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.notebooks", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks with papermill")
    run.add_argument("names", nargs="*", help="notebook stems (default: all)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="force smoke parameters (CPU-sized)")
    mode.add_argument("--real", action="store_true", help="force real parameters even without a GPU")
    run.add_argument("--keep-going", action="store_true", help="run the remaining notebooks after a failure")
    run.add_argument("--log-output", action="store_true", help="stream cell output to the terminal")
    run.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE", type=parse_assignment,
                     help="set a notebook parameter in every notebook run: -p preset=quick, -p publish=True, "
                          "-p \"overrides={'budget_s': 120}\"")  # fmt: skip
    sub.add_parser("list", help="list notebooks")
    strip = sub.add_parser("strip", help="remove outputs from notebooks before committing")
    strip.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(list_notebooks()))
        return 0
    if args.command == "strip":
        changed = strip_outputs(args.paths or sorted(NOTEBOOK_DIR.glob("*.ipynb")))
        print("\n".join(f"stripped {p}" for p in changed) or "nothing to strip")
        return 0

    smoke = True if args.smoke else False if args.real else None
    if args.real and not _cuda_available():
        parser.error("--real runs the GPU parameters and needs a CUDA GPU; here use --smoke (the default without "
                     "one), or run on a GPU node")
    unknown = [n for n in args.names if Path(n).stem not in list_notebooks()]
    if unknown:
        parser.error(f"no notebook {', '.join(map(repr, unknown))}; available: {', '.join(list_notebooks())}")
    names = args.names or list_notebooks()
    try:  # here, not in each kernel: a misspelt name or a bad value fails before anything runs
        params = check_parameters(names, dict(args.param))
    except ValueError as exc:
        parser.error(f"-p: {exc}")
    preset = params.get("preset")
    if preset is not None and (args.smoke or args.real):
        parser.error(f"-p preset={preset} names the preset itself: drop --{'smoke' if args.smoke else 'real'}")
    if preset not in (None, "smoke"):
        measured = [n for n in names if _section_gpus(n) > 0]
        if measured and not _cuda_available():
            parser.error(f"-p preset={preset} runs the GPU parameters of {', '.join(measured[:3])}"
                         + (" and others" if len(measured) > 3 else "") + " and needs a CUDA GPU; here run "
                         "without it (smoke parameters), or run on a GPU node")
    resolved = True if preset == "smoke" else is_smoke_run(smoke) if preset is None else False
    if preset not in (None, "smoke"):
        print(f"Running notebooks with preset={preset}; results go to figures/ (analytic sections: with -p publish=True).")
    elif resolved:
        print("No CUDA GPU (or --smoke): running notebooks with SMOKE parameters; results go to .scratch/figures, "
              "committed GPU results in figures/ are left untouched.")
    else:
        print("Running notebooks with REAL parameters; results go to figures/.")
    failures = []
    for name in names:
        t0 = time.perf_counter()
        try:
            dst = execute(name, params, smoke=resolved, log_output=args.log_output)
        except Exception as exc:  # report and optionally continue: one broken section should not hide the rest
            failures.append(name)
            print(f"FAILED {name}: {failure_summary(exc)}", flush=True)
            if not args.keep_going:
                break
        else:
            print(f"ok     {name:40s} {time.perf_counter() - t0:6.1f} s -> {dst.relative_to(REPO_ROOT)}")
    return 1 if failures else 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.notebooks"))
