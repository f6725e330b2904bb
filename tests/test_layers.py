"""The house's one-way walls, read from the code's own imports (at any depth, function-local ones included).

- The library (attention/, distributed/, benchmarking/, profiling/, checks/ and the root modules) never imports
  the workbook: the answers' building blocks and renderers (report/), the sections (experiments/), the writeup
  builder (writeup/, replotting included), the notebooks' runner (notebooks.py) and the CSE599-O scripts
  (cse599o/). What a library function needs of a section is passed in.
- Inside the workbook the arrows point down too: report/ never imports the sections, and nothing but the
  writeup's own command line and the notebooks' runner sits above the builder.
- cs336_basics, the Assignment-1 model, imports nothing of cs336_systems: a user can swap in their own.
- No module imports itself back through others (no import circles).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"cs336_systems": REPO / "cs336_systems", "cs336_basics": REPO / "cs336-basics" / "cs336_basics"}
WORKBOOK = ("cs336_systems.experiments", "cs336_systems.report", "cs336_systems.writeup", "cs336_systems.notebooks",
            "cs336_systems.cse599o")


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, each resolved to the module (or package) that defines it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_library_never_imports_the_workbook() -> None:
    graph = _graph()
    crossings = sorted(f"{a} -> {b}" for a, targets in graph.items() if not _in(a, WORKBOOK)
                       for b in targets if _in(b, WORKBOOK))
    assert not crossings, "library modules importing the workbook: " + "; ".join(crossings)


def test_the_model_package_imports_nothing_of_ours() -> None:
    graph = _graph()
    crossings = sorted(f"{a} -> {b}" for a, targets in graph.items() if _in(a, ("cs336_basics",))
                       for b in targets if _in(b, ("cs336_systems",)))
    assert not crossings, "cs336_basics importing cs336_systems: " + "; ".join(crossings)


def test_no_import_circles() -> None:
    """Tarjan's strongly connected components over the import graph: each must be one module. A package's
    ``__init__`` that imports its own submodules is the package, not a circle."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def edges(a: str) -> list[str]:
        # a submodule importing its own package's __init__ (to reach a sibling) is not a way back
        return [b for b in graph[a] if not a.startswith(b + ".") and not b.startswith(a + ".")]

    def visit(v: str) -> None:
        work = [(v, iter(edges(v)))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges(w))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + " | ".join(", ".join(c) for c in circles)


def test_the_workbook_runs_on_a_stand_in_assignment_1_package(tmp_path: Path) -> None:
    """A user's own Assignment-1 package in place of ours: it knows nothing of cs336_systems (no plugin hook
    at all), yet a model built from a preset names our attention kernels and trains a step."""
    stand_in = tmp_path / "site" / "cs336_basics"
    shutil.copytree(ROOTS["cs336_basics"], stand_in, ignore=shutil.ignore_patterns("__pycache__"))
    model = stand_in / "model.py"
    source = model.read_text()
    start = source.index("def _load_plugins() -> None:")
    end = source.index("\ndef ", start + 1)
    model.write_text(source[:start] + "def _load_plugins() -> None:\n    pass  # a package of its own: no plugins\n\n"
                     + source[end:])
    script = (
        "import cs336_basics, torch\n"
        f"assert cs336_basics.__file__.startswith({str(tmp_path)!r}), cs336_basics.__file__\n"
        "from cs336_systems.configs import build_model, get_config\n"
        "model = build_model('tiny', attention_impl='flash_pytorch')\n"
        "x = torch.randint(0, get_config('tiny').vocab_size, (2, 16))\n"
        "model(x).float().mean().backward()\n"
        "print('trained a step with', type(model.layers[0].attn).__name__ if hasattr(model, 'layers') else 'ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained a step" in done.stdout


def test_no_module_over_700_lines() -> None:
    """A module a reader can hold in mind: a longer one is two things (a harness and its section, say)."""
    long = sorted(f"{path.relative_to(REPO)} ({n})" for path in _modules().values()
                  if (n := len(path.read_text(encoding="utf-8").splitlines())) > 700)
    assert not long, "modules over 700 lines: " + ", ".join(long)


def test_the_workbook_is_layered_report_sections_builder() -> None:
    """report/ (blocks, formatting, renderers) < experiments/ (the sections) < writeup/ (the builder): no module
    imports one of a layer above its own, so the builder reads the sections and the sections never read it."""
    graph = _graph()
    order = ["cs336_systems.report", "cs336_systems.experiments", "cs336_systems.writeup"]

    def layer(module: str) -> int | None:
        return next((i for i, p in enumerate(order) if module == p or module.startswith(p + ".")), None)

    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() if (mine := layer(name)) is not None
                    for target in targets if (theirs := layer(target)) is not None and theirs > mine)
    assert not upward, "imports of a layer above: " + "; ".join(upward)


def test_one_command_line_per_layer() -> None:
    """Sections (experiments), tools (benchmarking), the writeup (report, replot included), notebooks, and the
    course-style scripts the handouts ask for (naive DDP's, and CSE599-O's under the staff's flags): every other
    module adds its options to one of these (``add_arguments(parser)``) instead of building a parser of its own."""
    builders = sorted(name for name, path in _modules().items()
                      if any(s in path.read_text(encoding="utf-8") for s in ("ArgumentParser(", "(argparse.ArgumentParser)")))
    assert builders == ["cs336_systems.benchmarking.__main__", "cs336_systems.cse599o.ddp_commands",
                        "cs336_systems.experiments.__main__", "cs336_systems.experiments.naive_ddp",
                        "cs336_systems.notebooks", "cs336_systems.writeup.__main__"], builders
