"""Staleness on synthetic git histories: a result is fresh until a file its section depends on changes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cs336_systems.report import staleness
from cs336_systems.experiments.section import Section


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "lib").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "lib" / "kernel.py").write_text("x = 1\n")
    (repo / "lib" / "other.py").write_text("y = 1\n")
    (repo / "lib" / "NOTES.md").write_text("notes\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "a")
    staleness.changed_since.cache_clear()
    return repo


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).write_text(text)
    _git(repo, "commit", "-q", "-am", path)
    staleness.changed_since.cache_clear()
    return _git(repo, "rev-parse", "HEAD")


def test_fresh_until_a_dependency_changes(repo: Path) -> None:
    measured = _git(repo, "rev-parse", "HEAD")
    meta = {"git_commit": measured}
    assert staleness.freshness(meta, ["lib/kernel.py"], repo).state == "fresh"
    _commit(repo, "lib/other.py", "y = 2\n")  # not a dependency
    _commit(repo, "lib/NOTES.md", "more notes\n")  # notes beside the code
    assert staleness.freshness(meta, ["lib/kernel.py", "lib/NOTES.md"], repo).state == "fresh"
    _commit(repo, "lib/kernel.py", "x = 2\n")
    verdict = staleness.freshness(meta, ["lib/"], repo)
    assert verdict.stale and verdict.changed == ("lib/kernel.py", "lib/other.py")
    assert f"measured at {measured[:9]}; changed since: lib/kernel.py, lib/other.py" == verdict.reason
    (repo / "lib" / "kernel.py").write_text("x = 3\n")  # uncommitted edits count too
    staleness.changed_since.cache_clear()
    later = {"git_commit": _git(repo, "rev-parse", "HEAD")}
    assert staleness.freshness(later, ["lib/kernel.py"], repo).stale


def test_unknown_dirty_or_missing_commits_are_stale(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    assert "uncommitted library changes" in staleness.freshness({"git_commit": head + "-dirty"}, ["lib/"], repo).reason
    assert "does not have" in staleness.freshness({"git_commit": "0123456789abcdef"}, ["lib/"], repo).reason
    assert "no commit recorded" in staleness.freshness({}, ["lib/"], repo).reason


def test_section_status_lists_stale_results_and_the_refresh_command(repo: Path, tmp_path: Path) -> None:
    root = tmp_path / "figures"
    (root / "sec").mkdir(parents=True)
    first = _git(repo, "rev-parse", "HEAD")
    spec = Section("sec", "9", "A section", ("p",), lambda d: [], depends=("lib/kernel.py",), command="run sec")
    assert staleness.section_status(root, spec, repo).state == "missing"
    (root / "sec" / "a.meta.json").write_text(json.dumps({"git_commit": first}))
    second = _commit(repo, "lib/kernel.py", "x = 5\n")
    (root / "sec" / "b.meta.json").write_text(json.dumps({"git_commit": second}))
    status = staleness.section_status(root, spec, repo)
    assert status.state == "stale" and list(status.stale) == ["a"] and status.fresh == ("b",)
    assert status.line().startswith("§9 A section: STALE (1 of 2 results)") and status.line().endswith("refresh: run sec")
    (root / "sec" / "a.meta.json").write_text(json.dumps({"git_commit": second}))
    assert staleness.section_status(root, spec, repo).state == "fresh"


def test_the_writeup_marks_stale_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cs336_systems.report.data import STALE_MARK, SectionData, provenance_line

    (tmp_path / "sec").mkdir()
    (tmp_path / "sec" / "t.meta.json").write_text(json.dumps({"git_commit": "0123456789abcdef", "device": "X"}))
    meta = SectionData(tmp_path, "sec", depends=("cs336_systems/",)).meta("t")
    assert provenance_line(meta).startswith(f"{STALE_MARK}: measured at 012345678, a commit this repository")


def test_a_result_going_stale_stales_the_pdf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cs336_systems.report import manifest

    pdf, root, notebooks = tmp_path / "w.pdf", tmp_path / "figures", tmp_path / "nb"
    pdf.write_bytes(b"%PDF")
    (root / "sec").mkdir(parents=True)
    notebooks.mkdir()
    marks = {"sec/a": "measured at 012345678; changed since: x.py"}
    monkeypatch.setattr(manifest, "stale_results", lambda root: dict(marks))
    manifest.write_manifest(pdf, root, tmp_path / "m.json", notebooks)
    assert manifest.check_manifest(pdf, root, tmp_path / "m.json", notebooks) == []
    marks["sec/a"] = "measured at 012345678; changed since: x.py, y.py"  # more files: same marks shown
    assert manifest.check_manifest(pdf, root, tmp_path / "m.json", notebooks) == []
    marks["sec/b"] = "measured at 012345678; changed since: z.py"
    problems = manifest.check_manifest(pdf, root, tmp_path / "m.json", notebooks)
    assert len(problems) == 1 and "newly stale ['sec/b']" in problems[0]


def test_answer_text_below_the_marker_does_not_stale_results(repo: Path) -> None:
    """A section module measures above ANSWERS_MARKER and only formats sentences below it."""
    marker = staleness.ANSWERS_MARKER
    (repo / "lib" / "section.py").write_text("")
    _git(repo, "add", "lib/section.py")
    first = _commit(repo, "lib/section.py", f"STEPS = 10\n\n{marker}\n\nTEXT = 'old wording'\n")
    _commit(repo, "lib/section.py", f"STEPS = 10\n\n{marker}\n\nTEXT = 'new wording'\n")
    assert staleness.freshness({"git_commit": first}, ["lib/section.py"], repo).state == "fresh"
    _commit(repo, "lib/section.py", f"STEPS = 20\n\n{marker}\n\nTEXT = 'new wording'\n")
    verdict = staleness.freshness({"git_commit": first}, ["lib/section.py"], repo)
    assert verdict.state == "stale" and verdict.changed == ("lib/section.py",)
    assert staleness.measuring_part("a\n" + marker + "\nb") == "a\n" and staleness.measuring_part("a") == "a"


def test_an_edition_grid_has_its_own_status_and_stale_marks(repo: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """figures/<name>/<edition>/ is judged by its section's dependencies, listed on a line of its own."""
    root = tmp_path / "figures"
    (root / "sec" / "2026").mkdir(parents=True)
    first = _git(repo, "rev-parse", "HEAD")
    spec = Section("sec", "9", "A section", ("p",), lambda d: [], depends=("lib/kernel.py",),
                   editions={"2026": {}})
    (root / "sec" / "a.meta.json").write_text(json.dumps({"git_commit": first}))
    assert staleness.section_status(root, spec, repo, edition="2026").line().startswith(
        "§9 A section [2026 grid]: missing (no results in sec/2026/)")
    (root / "sec" / "2026" / "g.meta.json").write_text(json.dumps({"git_commit": first}))
    assert staleness.section_status(root, spec, repo, edition="2026").state == "fresh"
    _commit(repo, "lib/kernel.py", "x = 6\n")
    status = staleness.section_status(root, spec, repo, edition="2026")
    assert status.state == "stale" and list(status.stale) == ["g"]
    assert status.line().endswith("--edition 2026")
    with pytest.raises(ValueError, match="sec has no grid of its own for edition '2027'"):
        staleness.section_status(root, spec, repo, edition="2027")
    # The writeup's marks reach into the subfolder, with the section's dependencies (not the whole library).
    from cs336_systems import measured_code

    monkeypatch.setitem(measured_code.DEPENDS, "sec", ("lib/kernel.py",))  # what a section registers when it loads
    monkeypatch.setattr(staleness, "REPO_ROOT", repo)
    assert set(staleness.stale_results(root, repo)) == {"sec/a", "sec/2026/g"}
    assert staleness.depends_of("sec/2026") == ("lib/kernel.py",)


def test_definitions_are_compared_by_content_wherever_they_live(repo: Path) -> None:
    """Comments, docstrings, imports and a definition moved to another file of the dependencies change no
    result; a changed body, or a definition moved out of the dependencies, does."""
    (repo / "lib" / "kernel.py").write_text("import math\n\n\ndef area(r):\n    return math.pi * r * r\n\n\nN = 3\n")
    (repo / "lib" / "grid.py").write_text("")
    _git(repo, "add", ".")
    first = _commit(repo, "lib/other.py", "y = 1\n")
    meta = {"git_commit": first}
    assert staleness.freshness(meta, ["lib/"], repo).state == "fresh"
    _commit(repo, "lib/kernel.py", '"""Circles."""\nimport math  # the constant\n\n\ndef area(r):\n'
            '    """A circle\'s area."""\n    return math.pi * r * r  # pi r squared\n\n\nN = 3\n')
    assert staleness.freshness(meta, ["lib/"], repo).state == "fresh"  # comments and docstrings only
    _commit(repo, "lib/kernel.py", "N = 3\n")
    assert staleness.freshness(meta, ["lib/"], repo).stale  # area is gone from lib/
    _commit(repo, "lib/grid.py", "import math\n\n\ndef area(r):\n    return math.pi * r * r\n")
    assert staleness.freshness(meta, ["lib/"], repo).state == "fresh"  # ... moved to grid.py: the same code
    verdict = staleness.freshness(meta, ["lib/kernel.py"], repo)
    assert verdict.stale and verdict.changed == ("lib/kernel.py",)  # moved out of what the result depends on
    _commit(repo, "lib/grid.py", "import math\n\n\ndef area(r):\n    return 3.14 * r * r\n")
    verdict = staleness.freshness(meta, ["lib/"], repo)
    assert verdict.stale and verdict.changed == ("lib/kernel.py",)  # where it lived when it was measured


def test_a_declared_neutral_commit_is_carried_across_and_a_later_change_still_counts(repo: Path) -> None:
    """figures/neutral_commits.txt lists commits that changed measuring code without changing a measurement:
    a result measured before one stays fresh across it, until a later commit changes the same definition."""
    first = _git(repo, "rev-parse", "HEAD")
    meta = {"git_commit": first}
    (repo / "figures").mkdir()
    neutral = _commit(repo, "lib/kernel.py", "x = 1\n\n\ndef plugins():\n    return []\n")
    assert staleness.freshness(meta, ["lib/"], repo).state == "fresh"  # only added a definition
    neutral = _commit(repo, "lib/kernel.py", "x = 1\n\n\ndef plugins():\n    return ['entry points']\n")
    assert staleness.freshness({"git_commit": first}, ["lib/"], repo).state == "fresh"  # plugins did not exist
    second = {"git_commit": _git(repo, "rev-parse", "HEAD~1")}
    assert staleness.freshness(second, ["lib/"], repo).stale  # measured with the old plugins(): changed
    (repo / "figures" / "neutral_commits.txt").write_text(f"# reviewed\n{neutral[:12]}  plugins found otherwise\n")
    _git(repo, "add", "figures")
    _commit(repo, "lib/other.py", "y = 1  # unchanged\n")
    assert staleness.freshness(second, ["lib/"], repo).state == "fresh"  # carried across the neutral commit
    _commit(repo, "lib/kernel.py", "x = 1\n\n\ndef plugins():\n    return ['changed again']\n")
    verdict = staleness.freshness(second, ["lib/"], repo)
    assert verdict.stale and verdict.changed == ("lib/kernel.py",)  # a later change to it still counts
    _commit(repo, "lib/other.py", "y = 2\n")  # a change of another file does not hide the carried one's
    assert staleness.freshness(second, ["lib/"], repo).changed == ("lib/kernel.py", "lib/other.py")


def _measured_then_scoped_neutral(repo: Path, name: str, before: str, after: str, scope: str) -> tuple[str, str]:
    """A result measured with ``name`` returning ``before``, then a commit changing it to ``after`` that the ledger
    declares neutral for ``scope``, then an unrelated commit: (the measured commit, the neutral one)."""
    from cs336_systems import measured_code

    (repo / "figures").mkdir()
    _commit(repo, "lib/kernel.py", f"x = 1\n\n\ndef {name}(n=0):\n    return {before}\n")
    measured = _git(repo, "rev-parse", "HEAD")
    neutral = _commit(repo, "lib/kernel.py", f"x = 1\n\n\ndef {name}(n=0):\n    return {after}\n")
    (repo / "figures" / "neutral_commits.txt").write_text(f"{neutral[:12]}  [results: {scope}]  no run of theirs differs\n")
    _git(repo, "add", "figures")
    _commit(repo, "lib/other.py", "y = 1\n")
    measured_code.changed_since.cache_clear()
    return measured, neutral


def test_a_neutral_commit_scoped_to_results_folders_carries_only_their_results(repo: Path) -> None:
    """``HASH  [results: a, b/2026]  reason``: neutral for those results folders (a fix whose changed path their
    runs never took), while every other folder measured before it goes stale; a bad scope is one line."""
    from cs336_systems import measured_code

    first = _git(repo, "rev-parse", "HEAD")
    measured, fix = _measured_then_scoped_neutral(repo, "sweep", "'before'", "'after'", "a, b/2026")
    for folder, state in (("a", "fresh"), ("b/2026", "fresh"), ("b", "stale"), (None, "stale")):
        meta = {"git_commit": measured, **({"section": folder} if folder else {})}
        assert staleness.freshness(meta, ["lib/"], repo).state == state, folder
    assert staleness.freshness({"git_commit": first, "section": "b"}, ["lib/"], repo).state == "fresh"  # no sweep then
    (repo / "figures" / "neutral_commits.txt").write_text(f"{fix[:12]}  [results: a  reason\n")
    measured_code.changed_since.cache_clear()
    with pytest.raises(ValueError, match=r"unclosed \[results: \.\.\.\]"):
        staleness.freshness({"git_commit": measured, "section": "a"}, ["lib/"], repo)
    measured_code.changed_since.cache_clear()


def test_a_neutral_commit_scoped_to_tables_carries_only_those_tables(repo: Path) -> None:
    """``HASH  [results: a/grid]  reason``: neutral for the table ``grid`` of folder ``a`` (a routing change that
    none of its rows takes), while the folder's other tables, and a table of that name elsewhere, go stale."""
    from cs336_systems import measured_code

    measured, _ = _measured_then_scoped_neutral(repo, "route", "n >= 2048", "n >= 1000", "a/grid, b")
    for folder, name, state in (("a", "grid", "fresh"), ("a", "sweep", "stale"), ("a", None, "stale"),
                                ("c", "grid", "stale"), ("b", "sweep", "fresh")):
        meta = {"git_commit": measured, "section": folder, **({"name": name} if name else {})}
        assert staleness.freshness(meta, ["lib/"], repo).state == state, (folder, name)
    assert measured_code.names_table(repo, "a", "grid") and not measured_code.names_table(repo, "a", "sweep")
    head = _git(repo, "rev-parse", "HEAD")  # a job extending the table judges its rows alike
    assert measured_code.same_measuring_code(measured, head, ["lib/"], repo, "a", "grid")
    assert not measured_code.same_measuring_code(measured, head, ["lib/"], repo, "a", "sweep")
    measured_code.changed_since.cache_clear()


def test_a_neutral_commit_rewriting_two_definitions_of_one_name(repo: Path) -> None:
    """Two files each with a ``main``, both rewritten by one declared commit: carried across once each."""
    (repo / "figures").mkdir()
    _commit(repo, "lib/kernel.py", "def main():\n    return 1\n")
    measured = {"git_commit": _commit(repo, "lib/other.py", "def main():\n    return 2\n")}
    (repo / "lib" / "kernel.py").write_text("def main():\n    return 10\n")
    neutral = _commit(repo, "lib/other.py", "def main():\n    return 20\n")
    assert staleness.freshness(measured, ["lib/"], repo).stale
    (repo / "figures" / "neutral_commits.txt").write_text(f"{neutral}  both entry points rewritten\n")
    _git(repo, "add", "figures")
    _git(repo, "commit", "-q", "-m", "ledger")
    staleness.changed_since.cache_clear()
    assert staleness.freshness(measured, ["lib/"], repo).state == "fresh"


def test_renames_duplicates_aliases_and_splits_are_judged_by_what_runs(repo: Path) -> None:
    """A renamed file is read from git, not the working tree; a change is seen though an identical copy lives in
    another file; an import alias swapped inside a function counts; a definition a neutral commit split off
    is still tracked afterwards."""
    (repo / "figures").mkdir()
    _commit(repo, "lib/kernel.py", "WARMUP = 5\n\n\ndef main():\n    from x import fast as impl\n    return impl(WARMUP)\n")
    measured = {"git_commit": _commit(repo, "lib/other.py", "WARMUP = 5\n")}
    _git(repo, "mv", "lib/other.py", "lib/renamed.py")
    _git(repo, "commit", "-q", "-m", "rename")
    staleness.changed_since.cache_clear()
    assert staleness.freshness(measured, ["lib/"], repo).state == "fresh"  # moved whole: no crash, same code
    _commit(repo, "lib/kernel.py", "WARMUP = 1\n\n\ndef main():\n    from x import fast as impl\n    return impl(WARMUP)\n")
    verdict = staleness.freshness(measured, ["lib/"], repo)
    assert verdict.stale and "lib/kernel.py" in verdict.changed  # though renamed.py still holds WARMUP = 5
    _commit(repo, "lib/kernel.py", "WARMUP = 5\n\n\ndef main():\n    from y import slow as impl\n    return impl(WARMUP)\n")
    assert staleness.freshness(measured, ["lib/"], repo).stale  # what impl is changed
    _commit(repo, "lib/kernel.py", "WARMUP = 5\n\n\ndef main():\n    from x import fast as impl\n    return impl(WARMUP)\n")
    assert staleness.freshness(measured, ["lib/"], repo).state == "fresh"  # back to the measured code
    neutral = _commit(repo, "lib/kernel.py", "WARMUP = 5\n\n\ndef main():\n    return run()\n\n\n"
                      "def run():\n    from x import fast as impl\n    return impl(WARMUP)\n")
    (repo / "figures" / "neutral_commits.txt").write_text(f"{neutral}  main split into main and run\n")
    _git(repo, "add", "figures")
    _git(repo, "commit", "-q", "-m", "ledger")
    staleness.changed_since.cache_clear()
    assert staleness.freshness(measured, ["lib/"], repo).state == "fresh"
    _commit(repo, "lib/kernel.py", "WARMUP = 5\n\n\ndef main():\n    return run()\n\n\n"
            "def run():\n    from x import fast as impl\n    return impl(WARMUP + 1)\n")
    assert staleness.freshness(measured, ["lib/"], repo).stale  # the split-off part changed: still tracked


def test_stale_results_refuses_to_judge_without_the_sections_registry(monkeypatch, tmp_path) -> None:
    """Without the sections' registry every folder would be compared with the whole library (and marked stale
    too often): say what is missing instead."""
    from cs336_systems import measured_code

    monkeypatch.setattr(measured_code, "DEPENDS", {})
    with pytest.raises(RuntimeError, match="needs the sections loaded"):
        staleness.stale_results(tmp_path)


def test_the_printed_outputs_are_judged_like_results_against_the_scripts_they_ran() -> None:
    """The CSE599-O console records depend on the course scripts and the DDP benchmark, not on the whole
    library (every unrelated edit would mark them stale), and `writeup status` lists them with the commands
    that refresh each."""
    import cs336_systems.experiments  # noqa: F401  (the sections register their dependencies)
    from cs336_systems.measured_code import LIBRARY, depends_of
    from cs336_systems.report.editions import CONSOLE_FOLDER, ConsoleStatus, console_records

    depends = depends_of(CONSOLE_FOLDER)
    assert depends != LIBRARY and "cs336_systems/cse599o/" in depends
    assert "cs336_systems/benchmarking/ddp_steps.py" in depends and "cs336_systems/report/" not in depends
    records = dict(console_records())
    assert {"naive_toy", "flat", "bucketed"} <= set(records)
    command = ConsoleStatus(depends).command_for()
    assert all(f"uv run {cmd} --record {name}" in command for name, cmd in records.items())


def test_a_stale_source_line_names_the_first_changed_file_and_counts_the_rest() -> None:
    """The writeup's source line keeps the reason short (the full list is ``writeup status -v``'s): the first
    changed file's name and how many more; reasons without files stay whole."""
    from cs336_systems.measured_code import Freshness
    from cs336_systems.report.data import _stale_note

    three = Freshness("stale", "c", ("lib/a.py", "b.py", "c.py"), "measured at c; changed since: lib/a.py, b.py, c.py")
    assert _stale_note(three) == "a.py and 2 more changed since"
    assert _stale_note(Freshness("stale", "c", ("a.py",), "measured at c; changed since: a.py")) == "a.py changed since"
    assert _stale_note(Freshness("stale", None, (), "no commit recorded")) == "no commit recorded"


def test_a_packed_history_lets_a_copy_without_git_judge_its_code(repo: Path, tmp_path: Path) -> None:
    """A copy of the tree sent to a GPU node has no .git; the packed history (commits since the measured one,
    blobs of the library only) lets it tell that its code is the measured code, and that an edit is not. A commit
    before the packed one, whose files it lacks, is never taken for the same code."""
    import tarfile

    from cs336_systems.measured_code import pack_history

    older = _commit(repo, "lib/kernel.py", "x = 0\n")  # code that differs from what was measured
    (repo / "lib" / "kernel.py").write_text("x = 1\n")
    (repo / "figures").mkdir()
    (repo / "figures" / "plot.png").write_bytes(b"\x89PNG" + bytes(range(256)) * 64)
    _git(repo, "add", "lib", "figures")
    _git(repo, "commit", "-q", "-m", "the measured code, and a figure")
    measured = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "notes")  # a merge after the measured commit reaches the clone deeper
    _commit(repo, "lib/NOTES.md", "notes of the run\n")
    _git(repo, "checkout", "-q", "-")
    _commit(repo, "lib/other.py", "y = 1  # a comment changes no code\n")
    _git(repo, "merge", "-q", "--no-edit", "notes")
    pack = pack_history(measured[:10], tmp_path / "history.tar", repo, paths=("lib/",))
    head = _git(repo, "rev-parse", "HEAD")
    plot = _git(repo, "rev-parse", "HEAD:figures/plot.png")
    copy = tmp_path / "copy"
    copy.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=repo, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
    repo.rename(tmp_path / "gone")  # on the node the clone is out of reach: nothing may be fetched from it
    with tarfile.open(pack) as tar:
        tar.extractall(copy, filter="tar")
    staleness.changed_since.cache_clear()
    assert _git(copy, "rev-parse", "HEAD") == head
    assert _git(copy, "status", "--porcelain", "--untracked-files=no") == ""  # its files, hashed as they are
    assert "sparse" not in _git(copy, "status")
    missing = _git(copy, "rev-list", "--objects", "--missing=print", "HEAD").split()
    assert f"?{plot}" in missing  # the figures stay out of the pack, the library's files at each commit are in it
    assert not {f"?{_git(copy, 'rev-parse', f'{rev}:lib/kernel.py')}" for rev in (measured, head)} & set(missing)
    assert staleness.freshness({"git_commit": measured}, ["lib/"], copy).state == "fresh"
    _git(copy, "cat-file", "-e", f"{older}^{{commit}}")  # the merge took the clone one commit past the measured
    before = staleness.freshness({"git_commit": older}, ["lib/"], copy)
    assert before.stale and "cannot read" in before.reason  # its files are not in the pack: never "the same"
    (copy / "lib" / "kernel.py").write_text("x = 2\n")  # an edit on the node is seen there
    staleness.changed_since.cache_clear()
    assert staleness.freshness({"git_commit": measured}, ["lib/"], copy).changed == ("lib/kernel.py",)

    repo = (tmp_path / "gone").rename(tmp_path / "repo")
    with pytest.raises(ValueError, match="is not a commit of"):
        pack_history("nonesuch", tmp_path / "x.tar", repo, paths=("lib/",))
    _git(repo, "checkout", "-q", "-b", "side", older)
    side = _commit(repo, "lib/other.py", "y = 3\n")
    _git(repo, "checkout", "-q", "-")
    with pytest.raises(ValueError, match="not HEAD or an ancestor of it"):
        pack_history(side, tmp_path / "x.tar", repo, paths=("lib/",))
