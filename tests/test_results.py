import json

import pandas as pd
import pytest

from cs336_systems import results


def test_smoke_detection_precedence(monkeypatch) -> None:
    monkeypatch.setenv("CS336_SMOKE", "0")
    assert results.is_smoke_run() is False
    assert results.is_smoke_run(True) is True
    monkeypatch.setenv("CS336_SMOKE", "1")
    assert results.is_smoke_run() is True


def test_smoke_runs_never_write_to_committed_figures(monkeypatch) -> None:
    monkeypatch.delenv("CS336_FIGURES_DIR", raising=False)
    assert results.results_root(smoke=True) != results.FIGURES_DIR
    assert results.results_root(smoke=False) == results.FIGURES_DIR


def test_table_and_figure_carry_provenance(tmp_path, monkeypatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    out = results.ResultWriter("sec", params={"steps": 3}, smoke=True)
    df = pd.DataFrame({"size": ["a", "b"], "ms": [1.25, 2.5]})
    out.table(df, "timing", params={"extra": 1})
    meta = json.loads((tmp_path / "sec" / "timing.meta.json").read_text())
    assert meta["params"] == {"steps": 3, "extra": 1}
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    out.figure(fig, "timing")
    meta = json.loads((tmp_path / "sec" / "timing.meta.json").read_text())
    assert meta["params"] == {"steps": 3}  # the latest artefact's parameters
    assert set(meta["files"]) == {"timing.csv", "timing.md", "timing.png"}
    for key in ("device", "torch", "triton", "git_commit", "date", "smoke"):
        assert key in meta
    back = results.load_table("sec", "timing", root=tmp_path)
    assert back["ms"].tolist() == [1.25, 2.5]
    assert "| a" in (tmp_path / "sec" / "timing.md").read_text()
    assert results.has_result("sec", "timing", root=tmp_path)


def test_json_roundtrip_handles_torch_types(tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    out = results.ResultWriter("sec", smoke=True)
    out.json({"dtype": torch.bfloat16, "value": torch.tensor(2.5)}, "thing")
    assert results.load_json("sec", "thing", root=tmp_path) == {"dtype": "bfloat16", "value": 2.5}


def test_missing_result_is_reported(tmp_path) -> None:
    assert not results.has_result("nope", "nothing", root=tmp_path)
    with pytest.raises(FileNotFoundError):
        results.load_table("nope", "nothing", root=tmp_path)


def test_derived_artefacts_keep_the_measuring_runs_provenance(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    measured = {"device": "NVIDIA H200", "num_gpus": 4, "torch": "2.11.0", "triton": "3.6.0",
                "git_commit": "abc123", "date": "2026-01-01T00:00:00+00:00", "smoke": False}
    out = results.ResultWriter("sec", smoke=False)
    out.json({"fit": 1.0}, "derived", source=measured)
    meta = results.load_meta("sec", "derived", root=tmp_path)
    assert meta["device"] == "NVIDIA H200" and meta["git_commit"] == "abc123" and meta["num_gpus"] == 4
    assert meta["date"] == measured["date"] and meta["smoke"] is False
    assert meta["rendered"]["device"] == results.device_description()["device"]


def test_a_measured_run_on_uncommitted_library_code_warns_at_its_start(tmp_path, monkeypatch) -> None:
    """Results of a dirty tree read as stale at once, so a measured run says so in its first line, naming the files,
    instead of spending a GPU job on them silently; a clean commit, a smoke run or a pinned commit warn as they
    should."""
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.delenv("CS336_GIT_COMMIT", raising=False)
    changed = ["cs336_systems/a.py", "cs336_systems/b.py", "cs336_systems/c.py", "cs336-basics/d.py"]
    monkeypatch.setattr(results, "uncommitted_library_files", lambda: changed)
    monkeypatch.setattr(results, "git_commit", lambda: "0123456789" + "a" * 30 + "-dirty")
    banner = results.ResultWriter("sec", smoke=False).banner()
    first, warning = banner.split("\n")
    assert first.startswith("Measured run on ")
    assert warning.startswith("WARNING: the library differs from commit 012345678 (cs336_systems/a.py, "
                              "cs336_systems/b.py, cs336_systems/c.py and 1 more): these results will record "
                              "012345678-dirty and read as stale at once.")
    assert "\n" not in results.ResultWriter("sec", smoke=True).banner()  # a smoke run records nothing to go stale
    monkeypatch.setattr(results, "git_commit", lambda: "0123456789" + "a" * 30)
    assert "WARNING" not in results.ResultWriter("sec", smoke=False).banner()
    monkeypatch.setenv("CS336_GIT_COMMIT", "f" * 40 + "-dirty")  # pinned by hand: no git to name the files
    assert results.dirty_warning("f" * 40 + "-dirty").startswith("WARNING: the library differs from commit fffffffff:")


def test_unpublished_full_runs_stay_out_of_committed_figures(monkeypatch) -> None:
    monkeypatch.delenv("CS336_FIGURES_DIR", raising=False)
    assert results.results_root(smoke=False, publish=False) == results.SCRATCH_DIR / "figures"
    assert results.results_root(smoke=True, publish=True) == results.SCRATCH_DIR / "figures"  # smoke never publishes
    assert results.results_root(smoke=False, publish=True) == results.FIGURES_DIR


def test_rewriting_an_unchanged_result_leaves_its_bytes(tmp_path, monkeypatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))

    def write(value: float, commit: str) -> dict[str, bytes]:
        monkeypatch.setenv("CS336_GIT_COMMIT", commit)
        out = results.ResultWriter("sec", params={"n": 1}, smoke=False)
        out.table(pd.DataFrame({"x": [1, 2], "y": [value, 4.0]}), "t")
        fig, ax = plt.subplots()
        ax.plot([1, 2], [value, 4.0])
        out.figure(fig, "f")
        plt.close(fig)
        out.json({"v": value}, "j")
        return {p.name: p.read_bytes() for p in sorted((tmp_path / "sec").iterdir())}

    first = write(3.0, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert write(3.0, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa") == first  # the same result from the same code: nothing rewritten
    later = write(3.0, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb")  # the same result from newer code: only the sidecars' commit moves
    for name, data in first.items():
        if name.endswith(".meta.json"):
            old, new = json.loads(data), json.loads(later[name])
            assert new["git_commit"] == "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb" and list(new) == list(old)  # in place: same key order
            assert {k: v for k, v in new.items() if k not in ("git_commit", "date", "argv")} == \
                {k: v for k, v in old.items() if k not in ("git_commit", "date", "argv")}
        else:
            assert later[name] == data, name
    changed = write(5.0, "cccccccccccccccccccccccccccccccccccccccc")
    for name in ("t.csv", "t.meta.json", "f.png", "f.meta.json", "j.json", "j.meta.json"):
        assert changed[name] != first[name], name
    assert json.loads(changed["t.meta.json"])["git_commit"] == "cccccccccccccccccccccccccccccccccccccccc"
    monkeypatch.setenv("CS336_GIT_COMMIT", "cccccccccccccccccccccccccccccccccccccccc")
    results.ResultWriter("sec", params={"n": 2}, smoke=False).json({"v": 5.0}, "j")  # new parameters: new record
    assert json.loads((tmp_path / "sec" / "j.meta.json").read_text())["params"] == {"n": 2}


def test_a_rerun_on_unchanged_measuring_code_leaves_every_byte(tmp_path, monkeypatch) -> None:
    """A later commit whose changes do not touch the section's dependencies (notes, answer text) measures the
    same code: re-running an unchanged result there leaves its sidecar as it was, and a figure written beside
    its table keeps the table's extra record (it used to drop it, so every re-run rewrote the sidecar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))

    def write(commit: str) -> dict[str, bytes]:
        monkeypatch.setenv("CS336_GIT_COMMIT", commit)
        out = results.ResultWriter("sec", params={"n": 1}, smoke=False)
        out.table(pd.DataFrame({"x": [1, 2]}), "t", extra={"C": 4.0})
        fig, ax = plt.subplots()
        ax.plot([1, 2], [3.0, 4.0])
        out.figure(fig, "t")
        plt.close(fig)
        return {p.name: p.read_bytes() for p in sorted((tmp_path / "sec").iterdir())}

    first = write("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert json.loads(first["t.meta.json"])["extra"] == {"C": 4.0}
    assert sorted(json.loads(first["t.meta.json"])["files"]) == ["t.csv", "t.md", "t.png"]
    assert write("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa") == first
    monkeypatch.setattr(results, "_same_measuring_code", lambda meta, section: meta["git_commit"] == "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert write("bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb") == first  # newer commit, same measuring code: byte-identical
    monkeypatch.setattr(results, "_same_measuring_code", lambda meta, section: False)
    assert json.loads(write("cccccccccccccccccccccccccccccccccccccccc")["t.meta.json"])["git_commit"] == "cccccccccccccccccccccccccccccccccccccccc"  # the code changed: it says so


def test_a_pinned_commit_must_be_a_full_hash(monkeypatch) -> None:
    """``CS336_GIT_COMMIT`` names the code of a tree copied without ``.git``; a short or mistyped hash would match
    no commit, so the result would read as stale and a later job of its grid would drop its rows."""
    for bad in ("64cecce5", "g" * 40, "a" * 41, "A" * 40):
        monkeypatch.setenv("CS336_GIT_COMMIT", bad)
        with pytest.raises(ValueError, match="full 40-hex commit hash"):
            results.git_commit()
    for good in ("a" * 40, "0" * 40 + "-dirty"):
        monkeypatch.setenv("CS336_GIT_COMMIT", good)
        assert results.git_commit() == good


def test_committed_sidecars_are_in_the_current_format() -> None:
    """Every committed result of a section records the run's preset as ``run_preset`` (older records kept it
    under ``preset``, which a section's own model preset shares), so re-measuring an unchanged result leaves
    its sidecar byte-identical."""
    from cs336_systems.experiments import SECTIONS

    old = []
    for path in sorted(results.FIGURES_DIR.rglob("*.meta.json")):
        section = path.relative_to(results.FIGURES_DIR).parts[0]
        params = json.loads(path.read_text()).get("params") or {}
        if section in SECTIONS and "run_preset" not in params and "preset" in params:
            old.append(str(path.relative_to(results.FIGURES_DIR)))
    assert not old, f"{len(old)} sidecars in the old format, e.g. {old[:3]}"


def test_jobs_combine_across_commits_only_where_the_sections_code_is_unchanged(tmp_path, monkeypatch, capsys) -> None:
    import cs336_systems.experiments  # noqa: F401  (the sections register their dependencies)
    from cs336_systems import measured_code

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    commit = {"now": "a" * 40}
    monkeypatch.setattr(results, "git_commit", lambda: commit["now"])
    asked: list[tuple[str, tuple[str, ...]]] = []
    unchanged = {"flag": True}

    def changed_since(then, depends, repo=None, results=None, table=None):
        asked.append((then, tuple(depends)))
        return () if unchanged["flag"] else ("cs336_systems/benchmarking/train_step.py",)

    monkeypatch.setattr(measured_code, "changed_since", changed_since)
    out = results.ResultWriter("training_step", params={"steps": 3}, smoke=True)
    out.table(pd.DataFrame({"context_length": [1024], "ms": [1.0]}), "steps_xl")

    def earlier(**params):
        return results.rows_of_this_run(out, "steps_xl", {"steps": 3, **params}, ("steps",))

    def why() -> str:  # the one line a job prints where it starts the table over
        lines = [line for line in capsys.readouterr().out.splitlines() if "is replaced, not extended" in line]
        return lines[-1] if lines else ""

    assert earlier() is not None and asked == []  # the same commit: no question asked
    commit["now"] = "b" * 40  # a later commit, the section's code unchanged: the rows combine
    assert earlier()["ms"].tolist() == [1.0] and why() == ""
    assert asked[-1][0] == "a" * 40 and "cs336_systems/benchmarking/train_step.py" in asked[-1][1]
    unchanged["flag"] = False  # ... or changed: the table starts over, and says so
    assert earlier() is None
    assert why() == ("training_step/steps_xl: the existing table is replaced, not extended: it was measured at "
                     "aaaaaaaaaaaa, and the section's code changed since, or git here lacks that commit (a copy "
                     "without .git cannot compare commits)")
    unchanged["flag"] = True
    assert earlier(steps=5) is None  # other settings: never
    assert why().endswith("its settings differ in steps")
    commit["now"] = "b" * 40 + "-dirty"  # uncommitted library changes: nobody can say which code ran
    assert earlier() is None
    assert why().endswith("this job runs uncommitted library changes")
    out.table(pd.DataFrame({"context_length": [1024], "ms": [1.0]}), "steps_xl")  # a table measured dirty ...
    commit["now"] = "b" * 40  # ... cannot be extended by the commit it sat on
    assert earlier() is None and why().endswith("it was measured with uncommitted changes on top of bbbbbbbbbbbb")
    commit["now"] = "unknown"  # a copy of the tree without .git and without CS336_GIT_COMMIT
    assert earlier() is None and "this job runs outside git" in why()
    out.table(pd.DataFrame({"context_length": [1024], "ms": [1.0]}), "steps_xl")  # ... and a table written there
    assert earlier() is None and "this job runs outside git" in why()  # two copies outside git may differ
    commit["now"] = "a" * 40
    assert earlier() is None and why().endswith("it was measured outside git (no .git, no CS336_GIT_COMMIT), so "
                                                "nothing shows the code is the same")
    out.table(pd.DataFrame({"context_length": [1024], "ms": [1.0]}), "steps_xl")
    monkeypatch.setattr(results, "device_description", lambda: {"device": "NVIDIA H200"})
    assert earlier() is None and why().endswith("this job runs on NVIDIA H200")
    monkeypatch.undo()
