"""Which code a result measured, compared by content rather than by path.

Every result records the commit it was measured at; every section names the library paths its measurements
depend on. A result still describes the current code when every top-level definition of those paths at its
commit (function, class, assignment, or other statement) still exists, unchanged, somewhere in those paths
now. "Unchanged" compares syntax trees: comments, docstrings, formatting and imports do not count, and a
definition moved to another file of the section's dependencies is the same definition. Code below a section
module's :data:`ANSWERS_MARKER` only formats sentences and never counts.

The registry :data:`DEPENDS` maps a results folder to its dependencies; the sections register theirs when
they load (:mod:`cs336_systems.experiments`), so this library module looks nothing up in the workbook.
"""

from __future__ import annotations

import ast
import functools
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

#: In a section module (``cs336_systems/experiments/*.py``), the line after which only answer text follows:
#: code that formats results into sentences, which can change without changing any result.
ANSWERS_MARKER = "# === Answers: formatting only; changes below this line do not make results stale ==="

#: For results of a folder no section registered: any change to the library.
LIBRARY = ("cs336-basics/cs336_basics/", "cs336_systems/")

#: What every measured section depends on beyond its own paths: the model and the model presets.
MODEL = ("cs336-basics/cs336_basics/", "cs336_systems/configs.py")
#: The timing and sweep machinery every single-GPU measurement runs through.
TIMING = ("cs336_systems/benchmarking/end_to_end.py", "cs336_systems/benchmarking/timing.py",
          "cs336_systems/benchmarking/sweep.py")

#: Results folder (``figures/<folder>/``) -> the library paths its measurements depend on.
DEPENDS: dict[str, tuple[str, ...]] = {}


def register_depends(folder: str, depends: Sequence[str]) -> None:
    """Record what the results of ``folder`` depend on (a section does this for its own folder)."""
    DEPENDS[folder] = tuple(depends)


def depends_of(folder: str) -> tuple[str, ...]:
    """The dependencies of a results folder (``name`` or an edition grid's ``name/edition``)."""
    return DEPENDS.get(folder.split("/")[0], LIBRARY)


def git(args: Sequence[str], repo: Path) -> str | None:
    """``git ARGS`` in ``repo``: its output, or None where git fails or is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode == 0:
        return done.stdout.decode("utf-8", errors="replace")
    return None


def measuring_part(source: str | None) -> str | None:
    """The part of a file's text that can change results: all of it, or what precedes ANSWERS_MARKER."""
    if source is None:
        return None
    for start in _line_starts(source, ANSWERS_MARKER):
        end = start + len(ANSWERS_MARKER)
        if end == len(source) or source[end] in "\r\n":
            return source[:start]
    return source


def _line_starts(text: str, line: str) -> list[int]:
    """Where ``line`` begins a line of ``text`` (not inside a string or a comment further right)."""
    found, at = [], text.find(line)
    while at != -1:
        if at == 0 or text[at - 1] == "\n":
            found.append(at)
        at = text.find(line, at + 1)
    return found


def _normalized_import(node: ast.Import | ast.ImportFrom) -> ast.stmt:
    """An import as the names it binds and the objects it names, without the module they come from: moving a
    definition to another file changes where a name is imported from, not what the code runs."""
    names = [ast.alias(name=a.name.rsplit(".", 1)[-1], asname=a.asname) for a in node.names]
    return ast.ImportFrom(module=None, names=names, level=0)


def _strip_docstrings_and_imports(tree: ast.AST) -> ast.AST:
    """Docstrings removed at any depth, and imports inside functions and classes reduced to the names they
    bind and import (:func:`_normalized_import`). A module's own top-level imports are not definitions
    (:func:`definitions` keeps only aliased ones, ``import a as b``)."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list) or not body or not isinstance(body[0], ast.stmt):
                continue
            if (field == "body" and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]
            if not isinstance(node, ast.Module):
                body = [_normalized_import(b) if isinstance(b, (ast.Import, ast.ImportFrom)) else b for b in body]
            setattr(node, field, body or ([ast.Pass()] if field == "body" else []))
    return tree


def definitions(source: str) -> Counter[tuple[str, str]]:
    """The measuring part of a module as a multiset of ``(name, syntax tree)``, one per top-level statement
    other than imports: a function or class by its name, an assignment by its targets, anything else by
    itself. Text that does not parse counts as one opaque definition."""
    text = measuring_part(source) or ""
    try:
        tree = _strip_docstrings_and_imports(ast.parse(text))
    except SyntaxError:
        return Counter({("<unparsed>", text): 1})
    found: Counter[tuple[str, str]] = Counter()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # a module-level name bound to another object counts
            for alias in node.names:
                if alias.asname and alias.asname != alias.name.rsplit(".", 1)[-1]:
                    found[(alias.asname, f"import {alias.name.rsplit('.', 1)[-1]}")] += 1
            continue
        if isinstance(node, ast.Pass):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name = ",".join(ast.unparse(t) for t in targets)
        else:
            name = "<statement>"
        found[(name, ast.dump(node))] += 1
    return found


def _python_files_then(commit: str, depends: tuple[str, ...], repo: Path) -> list[str] | None:
    out = git(["ls-tree", "-r", "--name-only", commit, "--", *depends], repo)
    return None if out is None else [f for f in out.splitlines() if f.endswith(".py")]


def _python_files_now(depends: tuple[str, ...], repo: Path) -> list[str]:
    """The tracked Python files under ``depends`` that exist in the working tree (an untracked copy of old code
    must not pass for the code that runs)."""
    out = git(["ls-files", "--", *depends], repo) or ""
    return sorted(f for f in out.splitlines() if f.endswith(".py") and (repo / f).is_file())


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _file_definitions_now(path: Path) -> Counter[tuple[str, str]]:
    """The definitions of a working-tree file, cached by its size and modification time."""
    stat = path.stat()
    return _file_definitions_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _file_definitions_cached(path: str, size: int, mtime_ns: int) -> Counter[tuple[str, str]]:
    return definitions(_read(Path(path)))


class _UnreadableFile(LookupError):
    """git has the commit but not the file's text: a packed history (:func:`pack_history`) that holds no blobs
    before the commit it was packed since. What it cannot read it must not call unchanged."""


@functools.lru_cache(maxsize=8192)
def _file_definitions_at(commit: str, path: str, repo: Path) -> Counter[tuple[str, str]]:
    """The definitions of one file at one commit (shared by every section that depends on it)."""
    text = git(["show", f"{commit}:{path}"], repo)
    if text is None:
        raise _UnreadableFile(f"{commit}:{path}")
    return definitions(text)


@functools.lru_cache(maxsize=256)
def _definitions_at(commit: str, depends: tuple[str, ...], repo: Path) -> Counter[tuple[str, str]]:
    found: Counter[tuple[str, str]] = Counter()
    for path in _python_files_then(commit, depends, repo) or []:
        found += _file_definitions_at(commit, path, repo)
    return found


#: Commits declared not to change what any measurement measures (``HASH  reason`` per line; ``#`` comments), or
#: not what some results measure (``HASH  [results: FOLDER, FOLDER/TABLE]  reason``: neutral for those results
#: folders, or for those tables of a folder, only, e.g. a fix whose changed path none of their runs took).
NEUTRAL_COMMITS = REPO_ROOT / "figures" / "neutral_commits.txt"


def _neutral_ledger(repo: Path) -> tuple[tuple[str, frozenset[str] | None], ...]:
    """``(commit, results folders or None for all)`` per line of the ledger in ``repo``."""
    ledger = Path(repo) / NEUTRAL_COMMITS.relative_to(REPO_ROOT)
    if not ledger.exists():
        return ()
    return _parsed_ledger(ledger.read_text())


@functools.lru_cache(maxsize=8)
def _parsed_ledger(text: str) -> tuple[tuple[str, frozenset[str] | None], ...]:
    """The ledger's lines parsed, once per version of its text."""
    entries = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        commit, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        scope = None
        if rest.startswith("[results:"):
            inside, closed, _ = rest[len("[results:"):].partition("]")
            if not closed:
                raise ValueError(f"{NEUTRAL_COMMITS.name}: unclosed [results: ...] on the line of {commit}")
            scope = frozenset(x.strip() for x in inside.split(",") if x.strip())
        entries.append((commit, scope))
    return tuple(entries)


def neutral_commits(repo: Path, results: str | None = None, table: str | None = None) -> list[str]:
    """The commits of ``figures/neutral_commits.txt`` in ``repo`` that apply to the results folder ``results``, or
    to its table ``table`` (every unscoped one; with ``results`` None, only those): each changed measuring code in
    a way that changes no measurement (the model's attention plugins found through an entry point rather than by
    name, say). Staleness carries a result's definitions across such a commit instead of calling them changed;
    the reason on each line is what a reviewer checks."""
    keys = {results, f"{results}/{table}" if table else None} - {None}
    return [commit for commit, scope in _neutral_ledger(repo) if scope is None or keys & scope]


def names_table(repo: Path, results: str | None, table: str | None) -> bool:
    """Whether some line of the ledger is scoped to the table ``table`` of the results folder ``results``."""
    key = f"{results}/{table}"
    return bool(results and table) and any(scope and key in scope for _, scope in _neutral_ledger(repo))


def _carried_across_neutral_commits(commit: str, then: Counter[tuple[str, str]], depends: tuple[str, ...],
                                    repo: Path, results: str | None = None, table: str | None = None,
                                    ) -> Counter[tuple[str, str]]:
    """``then`` (the definitions at ``commit``) as each neutral commit after ``commit`` (for the results folder
    ``results``) rewrote them: a definition such a commit replaced gives way to everything that commit added (a
    rename or a split keeps being tracked), so a later change to what it wrote still counts."""
    listed = neutral_commits(repo, results, table)
    if not listed:
        return then
    later = (git(["rev-list", "--reverse", "--topo-order", f"{commit}..HEAD"], repo) or "").split()
    wanted = {full for full in later if any(full.startswith(short) for short in listed)}
    carried = Counter(then)
    for rev in (r for r in later if r in wanted):
        before, after = _definitions_at(f"{rev}^", depends, repo), _definitions_at(rev, depends, repo)
        removed, added = before - after, after - before
        replaced = Counter({key: min(carried[key], n) for key, n in removed.items() if carried[key]})
        if replaced:  # what it wrote instead may be split, renamed or merged: all it added must stay as written
            carried = carried - replaced + added
    return carried


@functools.lru_cache(maxsize=1024)
def changed_since(commit: str, depends: tuple[str, ...], repo: Path = REPO_ROOT,
                  results: str | None = None, table: str | None = None) -> tuple[str, ...] | None:
    """The files (as they were at ``commit``) under ``depends`` with a definition that no longer exists
    unchanged anywhere under ``depends`` in the working tree (committed or not), after the rewrites of the
    neutral commits that apply to the results folder ``results`` (or to its table ``table``); ``None`` when ``commit`` is not a commit of
    this repository, or git here cannot read its files."""
    repo = Path(repo)
    if git(["cat-file", "-e", f"{commit}^{{commit}}"], repo) is None:
        return None
    diff = git(["diff", "--no-renames", "--name-only", commit, "--", *depends], repo)
    then_files = _python_files_then(commit, depends, repo)
    if diff is None or then_files is None:
        return None
    touched = {f for f in diff.splitlines() if f.endswith(".py")}
    if not touched:
        return ()
    now: Counter[tuple[str, str]] = Counter()
    for path in _python_files_now(depends, repo):
        now += _file_definitions_now(repo / path)
    try:
        then = {path: (_file_definitions_at(commit, path, repo) if path in touched or not (repo / path).is_file()
                       else _file_definitions_now(repo / path))
                for path in then_files}
        lost = _carried_across_neutral_commits(commit, sum(then.values(), Counter()), depends, repo, results,
                                               table) - now
    except _UnreadableFile:
        return None
    if not lost:
        return ()
    # at the commit (as carried), and not as often now: blame their files; a definition a neutral commit rewrote
    # is in no file as it was at the commit, so the files that then held its name take the blame
    direct = {path for path, defs in then.items() if any(key in lost for key in defs)}
    unplaced = {name for name, shape in lost if not any((name, shape) in defs for defs in then.values())}
    by_name = {path for path, defs in then.items() if any(n in unplaced for n, _ in defs)}
    return tuple(sorted(direct | by_name) or [f"{depends[0]} (a definition rewritten by a neutral commit)"])


def same_measuring_code(commit: str, now: str, depends: Sequence[str], repo: Path = REPO_ROOT,
                        results: str | None = None, table: str | None = None) -> bool:
    """Whether a result measured at ``commit`` (the table ``table`` of the results folder ``results``) and the
    running code at ``now`` agree on every dependency: both committed (no ``-dirty``), and no definition under
    ``depends`` changed between them (the neutral commits applying as :func:`freshness` applies them)."""
    if not commit or commit.endswith("-dirty") or now.endswith("-dirty") or now == "unknown":
        return False
    return commit == now or changed_since(commit, tuple(depends), Path(repo), results,
                                          _table_key(Path(repo), results, table)) == ()


def _table_key(repo: Path, results: str | None, table: str | None) -> str | None:
    """``table`` where the ledger names it, else None: the cache of :func:`changed_since` then holds one entry per
    folder for the tables no line names."""
    return table if names_table(repo, results, table) else None


@dataclass(frozen=True)
class Freshness:
    """``state``: ``fresh`` or ``stale``; ``commit``: the measured commit; ``changed``: library files
    changed since (in ``depends``); ``reason``: one line for people."""

    state: str
    commit: str | None
    changed: tuple[str, ...]
    reason: str

    @property
    def stale(self) -> bool:
        return self.state == "stale"


def freshness(meta: dict[str, Any], depends: Sequence[str], repo: Path = REPO_ROOT) -> Freshness:
    """How current the result described by ``meta`` is, given the paths its section depends on."""
    raw = str(meta.get("git_commit") or "")
    commit = raw.removesuffix("-dirty")
    if not commit or commit == "unknown":
        return Freshness("stale", None, (), "no commit recorded: the code it measured is unknown")
    if raw.endswith("-dirty"):
        return Freshness("stale", commit, (), f"measured with uncommitted library changes on top of {commit[:9]}")
    results = str(meta["section"]) if meta.get("section") else None
    table = _table_key(Path(repo), results, str(meta["name"]) if meta.get("name") else None)
    changed = changed_since(commit, tuple(depends), Path(repo), results, table)
    if changed is None:
        return Freshness("stale", commit, (), f"measured at {commit[:9]}, a commit this repository does not have "
                                          "(or whose files it cannot read)")
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        return Freshness("stale", commit, changed, f"measured at {commit[:9]}; changed since: {shown}")
    return Freshness("fresh", commit, (), f"measured at {commit[:9]} on the current code")


def history_paths() -> tuple[str, ...]:
    """What staleness and the merging of a grid's jobs read from git: the library and every path a section
    registered (some lie outside it, such as the course tests' adapters). The neutral ledger is read from the
    working tree."""
    every = {*LIBRARY, *(p for depends in DEPENDS.values() for p in depends)}
    inside = {p for p in every for q in every if p != q and q.endswith("/") and p.startswith(q)}
    return tuple(sorted(every - inside))


def pack_history(since: str, out: Path, repo: Path = REPO_ROOT, paths: Sequence[str] | None = None) -> Path:
    """``out``, a tar of a small ``.git`` for a copy of the tree that has none (a cluster node, a rented GPU):
    the commits from ``since`` to HEAD, holding the blobs of ``paths`` only (:func:`history_paths` by default,
    once the sections have registered theirs). Untarred at the copy's root, it lets a job there tell whether a
    table measured at any of those commits ran the code it runs, and so extend that table
    (:func:`cs336_systems.results.rows_of_this_run`) and record HEAD as its commit, as on a full clone. Without it a copy can only name its commit (``CS336_GIT_COMMIT``) and never prove it equal
    to another. The whole history would not do: it carries every committed figure and PDF."""
    import tarfile
    import tempfile

    repo, out = Path(repo), Path(out)
    paths = tuple(paths) if paths is not None else history_paths()
    full = (git(["rev-parse", "--verify", "--quiet", f"{since}^{{commit}}"], repo) or "").strip()
    if not full:
        raise ValueError(f"{since!r} is not a commit of {repo}")
    if git(["merge-base", "--is-ancestor", full, "HEAD"], repo) is None:
        raise ValueError(f"{since!r} is not HEAD or an ancestor of it")
    head = (git(["rev-parse", "HEAD"], repo) or "").strip()
    revs = [*(git(["rev-list", f"{full}..{head}"], repo) or "").split(), full]
    # the local upload-pack serves a blob-less clone and later the blobs asked for, whatever the repo's config
    upload_pack = "git -c uploadpack.allowFilter=true -c uploadpack.allowAnySHA1InWant=true upload-pack"
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "history"
        if git(["clone", "--quiet", "--no-checkout", "--filter=blob:none", f"--depth={len(revs)}",
                f"--upload-pack={upload_pack}", repo.resolve().as_uri(), str(clone)], Path(tmp)) is None:
            raise RuntimeError(f"git could not clone {repo}")
        if (git(["rev-parse", "HEAD"], clone) or "").strip() != head:
            raise ValueError(f"{repo}'s HEAD is not the tip of the branch a clone checks out; check one out")
        git(["config", "remote.origin.uploadpack", upload_pack], clone)
        # a sparse checkout of each commit fetches its library blobs in one batch each
        git(["sparse-checkout", "set", "--no-cone", *(f"/{p}" for p in paths)], clone)
        branch = (git(["symbolic-ref", "--quiet", "--short", "HEAD"], clone) or "").strip()
        for rev in revs:
            if git(["checkout", "--quiet", "--detach", rev], clone) is None:
                raise RuntimeError(f"git could not read {rev[:12]}'s library files")
        git(["checkout", "--quiet", branch or head], clone)
        # The copy holds every file: an index with no sparse bits, rebuilt from the trees (no blobs needed),
        # lets git there hash its files as they are, and nothing there can delete the files this clone lacks.
        # sparse-checkout keeps its switch in a per-worktree config: drop that file and the extension it needs.
        (clone / ".git" / "config.worktree").unlink(missing_ok=True)
        git(["config", "--unset", "extensions.worktreeConfig"], clone)
        (clone / ".git" / "info" / "sparse-checkout").unlink(missing_ok=True)
        git(["read-tree", "HEAD"], clone)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w") as tar:
            tar.add(clone / ".git", arcname=".git")
    return out
