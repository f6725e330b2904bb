"""Calibrated machines: a GPU job's results carry the machine's measurements at its start and end, and a
result from a machine that measured slow is called suspect by ``writeup status`` and in the writeup."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cs336_systems import calibration
from cs336_systems.calibration import JobCalibration, verdict
from cs336_systems.report.data import SUSPECT_MARK, UNCALIBRATED_NOTE, SectionData, provenance_line

H100 = {"NVIDIA H100 80GB HBM3": {"bf16_matmul_tflops": 780.0, "fp32_matmul_tflops": 51.0, "hbm_copy_tbps": 2.95}}
#: Both methods' references, the sustained one lower in bf16 (a sustained matmul runs at the power limit's clocks).
REFERENCES = {"burst": H100, "sustained": {"NVIDIA H100 80GB HBM3": {**H100["NVIDIA H100 80GB HBM3"],
                                                                    "bf16_matmul_tflops": 680.0}}}


def _gpu(bf16: float = 785.0, fp32: float = 51.5, copy: float = 2.96, index: int = 0) -> dict:
    return {"gpu": index, "device": "NVIDIA H100 80GB HBM3", "bf16_matmul_tflops": bf16, "fp32_matmul_tflops": fp32,
            "hbm_copy_tbps": copy}


def _meta(start: list | None, end: list | None = None, **kw) -> dict:
    meta = {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "smoke": False, **kw}
    if start is not None:
        meta["calibration"] = {"start": start, "end": end}
    return meta


def test_a_machine_more_than_ten_percent_slow_is_suspect_and_one_within_is_not() -> None:
    assert verdict(_meta([_gpu()], [_gpu()]), REFERENCES).state == "calibrated"
    assert verdict(_meta([_gpu(bf16=710.0)], [_gpu()]), REFERENCES).state == "calibrated"  # 91%: within
    slow = verdict(_meta([_gpu(), _gpu(index=1)], [_gpu(), _gpu(copy=2.5, index=1)]), REFERENCES)
    assert slow.suspect and slow.reason == "GPU 1 HBM copy at 85% of its reference at the job's end"
    assert verdict(_meta(None), REFERENCES).state == "uncalibrated"
    assert verdict(_meta([_gpu()], None), REFERENCES).state == "calibrated"  # the job died before its end
    assert verdict({"device": "CPU (x86_64)", "device_type": "cpu"}, REFERENCES).state == "n/a"
    assert verdict(_meta([_gpu()], smoke=True), REFERENCES).state == "n/a"
    other = _meta([{**_gpu(), "device": "NVIDIA B200"}], device="NVIDIA B200")
    assert verdict(other, REFERENCES).state == "unreferenced"


def test_a_calibration_is_judged_against_the_reference_of_its_own_method() -> None:
    """The same bf16 reading of 650 TFLOP/s is a slow burst (83%) and a normal sustained rate (96%); a method the
    references do not know has no reference."""
    burst = _meta([_gpu(bf16=650.0)], [_gpu()])  # no method recorded: burst, the records before methods
    assert verdict(burst, REFERENCES).suspect
    sustained = {**burst, "calibration": {**burst["calibration"], "method": "sustained"}}
    assert verdict(sustained, REFERENCES).state == "calibrated"
    assert verdict({**burst, "calibration": {**burst["calibration"], "method": "other"}},
                   REFERENCES).state == "unreferenced"


def test_the_committed_references_cover_the_gpus_results_were_measured_on() -> None:
    references = calibration.load_references()
    for method, devices in (("burst", ("NVIDIA H100 80GB HBM3", "NVIDIA H200")), (calibration.METHOD, ("NVIDIA H200",))):
        for device in devices:
            assert set(references[method][device]) == set(calibration.METRICS)
            assert all(value > 0 for value in references[method][device].values())


def test_a_gpu_job_records_its_calibration_at_start_and_end(tmp_path, monkeypatch) -> None:
    """The job's sidecars get the start when written and the end when the job finishes; a figure derived
    from an older measurement keeps that measurement's record, not this machine's."""
    from cs336_systems.results import ResultWriter

    readings = iter([[_gpu(bf16=790.0)], [_gpu(bf16=600.0)]])
    monkeypatch.setattr(calibration, "measure_in_subprocess", lambda: next(readings))
    monkeypatch.setattr(JobCalibration, "wanted", staticmethod(lambda smoke: not smoke))
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    job = JobCalibration()
    monkeypatch.setattr(calibration, "JOB", job)
    job.begin(smoke=False)  # what a GPU section's run and the benchmarking tools do first
    out = ResultWriter("sec", smoke=False, publish=True)
    assert job.active and job.start == [_gpu(bf16=790.0)]
    out.table(pd.DataFrame({"ms": [1.0]}), "timings")
    written = json.loads((tmp_path / "sec" / "timings.meta.json").read_text())
    assert written["calibration"] == {"method": calibration.METHOD, "start": [_gpu(bf16=790.0)]}
    older = {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "git_commit": "abc", "date": "2026-01-01",
             "calibration": {"start": [_gpu()], "end": [_gpu()]}}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    out.figure(fig, "replot", source=older)
    out.figure(fig, "derived", source=written)  # drawn in this job from what it measured
    plt.close(fig)
    job.finish()
    timings = json.loads((tmp_path / "sec" / "timings.meta.json").read_text())
    assert timings["calibration"] == {"method": calibration.METHOD, "start": [_gpu(bf16=790.0)],
                                      "end": [_gpu(bf16=600.0)]}
    assert json.loads((tmp_path / "sec" / "replot.meta.json").read_text())["calibration"] == older["calibration"]
    assert json.loads((tmp_path / "sec" / "derived.meta.json").read_text())["calibration"] == timings["calibration"]
    assert calibration.shortfalls(timings["calibration"]["end"], REFERENCES["burst"]) == \
        ["GPU 0 bf16 matmul at 77% of its reference"]
    assert not job.active


def test_a_smoke_run_is_not_calibrated(tmp_path, monkeypatch) -> None:
    from cs336_systems.results import ResultWriter

    monkeypatch.setattr(calibration, "measure_in_subprocess", lambda: pytest.fail("a smoke run measured the GPU"))
    monkeypatch.setattr(JobCalibration, "wanted", staticmethod(lambda smoke: not smoke))
    monkeypatch.setattr(calibration, "JOB", JobCalibration())
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    ResultWriter("sec", smoke=True).table(pd.DataFrame({"ms": [1.0]}), "timings")
    assert "calibration" not in json.loads((tmp_path / "sec" / "timings.meta.json").read_text())


def test_the_writeup_and_status_mark_suspect_and_uncalibrated_results(tmp_path) -> None:
    (tmp_path / calibration.REFERENCE_PATH.name).write_text(json.dumps({"methods": {"burst": {"devices": {
        name: {"reference": ref} for name, ref in H100.items()}}}}))
    folder = tmp_path / "sec"
    folder.mkdir()
    for name, meta in (("slow", _meta([_gpu(fp32=40.0)], [_gpu()])), ("old", _meta(None)),
                       ("good", _meta([_gpu()], [_gpu()]))):
        (folder / f"{name}.csv").write_text("ms\n1\n")
        (folder / f"{name}.meta.json").write_text(json.dumps({**meta, "git_commit": "unknown"}))
    data = SectionData(tmp_path, "sec", depends=("cs336_systems/calibration.py",))
    slow, old, good = (provenance_line(data.meta(n)) for n in ("slow", "old", "good"))
    assert f"{SUSPECT_MARK}: GPU 0 fp32 matmul at 78% of its reference at the job's start" in slow
    assert old.endswith(UNCALIBRATED_NOTE) and SUSPECT_MARK not in good and UNCALIBRATED_NOTE not in good

    from types import SimpleNamespace

    from cs336_systems.report.staleness import section_status

    spec = SimpleNamespace(number="9", title="T", depends=("cs336_systems/calibration.py",),
                           results_folder=lambda edition=None: "sec", command_for=lambda edition=None: "run it")
    status = section_status(tmp_path, spec)
    assert list(status.suspect) == ["slow"] and status.uncalibrated == 1
    assert "SUSPECT (1 measured on a machine that calibrated slow: GPU 0 fp32 matmul at 78%" in status.line()


def test_a_failing_calibration_never_fails_the_job(tmp_path, monkeypatch, capsys) -> None:
    """The subprocess printing garbage or the sidecar vanishing: the job ends as it would have, and says why."""
    import subprocess

    job = JobCalibration()
    monkeypatch.setattr(JobCalibration, "wanted", staticmethod(lambda smoke: True))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "not json\n", ""))
    job.begin(smoke=False)
    assert job.active and job.start is None
    job.note_written(tmp_path / "gone.meta.json")
    job.finish()
    assert not job.active and "calibration:" in capsys.readouterr().err


def test_a_table_merged_over_several_jobs_keeps_every_job_s_calibration(tmp_path, monkeypatch) -> None:
    """A grid measured in several jobs is one table; each job's machine stays on its record once, however often a
    job rewrites the table, and a summary the job derives from the merged rows carries them too. A slow earlier
    job makes the merged table suspect even when the job that wrote it last was fast."""
    from cs336_systems.results import ResultWriter, merge_rows, rows_of_this_run

    starts = [[_gpu(bf16=790.0)], [_gpu(bf16=791.0)], [_gpu(bf16=792.0)]]
    ends = [[_gpu(copy=2.5)], [_gpu()], [_gpu()]]
    readings = iter([x for pair in zip(starts, ends) for x in pair])
    monkeypatch.setattr(calibration, "measure_in_subprocess", lambda: next(readings))
    monkeypatch.setattr(JobCalibration, "wanted", staticmethod(lambda smoke: not smoke))
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    for job_index, contexts in enumerate(((1024, 1536), (2048, 3072), (4096, 6144))):  # three jobs of one grid
        job = JobCalibration()
        monkeypatch.setattr(calibration, "JOB", job)
        job.begin(smoke=False)
        out = ResultWriter("sec", params={"n": 1}, smoke=False, publish=True)
        mine: list[int] = []
        for context in contexts:  # the table rewritten after every row, as training_step and torch_compile do
            mine.append(context)
            table = merge_rows(pd.DataFrame({"context": mine, "ms": 1.0}),
                               rows_of_this_run(out, "grid", out.params, ("n",)), "context")
            out.table(table, "grid")
            out.table(table.assign(ms=2.0), "grid_summary")
        job.finish()
    meta = json.loads((tmp_path / "sec" / "grid.meta.json").read_text())
    record = meta["calibration"]
    assert list(pd.read_csv(tmp_path / "sec" / "grid.csv")["context"]) == [1024, 1536, 2048, 3072, 4096, 6144]
    assert record["start"] == starts[2] and record["end"] == ends[2]
    merged = record["merged"]
    assert [m["start"] for m in merged] == [starts[1], starts[0]] and [m["end"] for m in merged] == [ends[1], ends[0]]
    summary = json.loads((tmp_path / "sec" / "grid_summary.meta.json").read_text())["calibration"]
    assert summary == record
    meta = _meta(None, calibration=record)
    slow = verdict(meta, REFERENCES)
    assert slow.suspect and slow.reason == "GPU 0 HBM copy at 85% of its reference at a merged job's end"
    fast = [{**m, "end": [_gpu()]} for m in merged]
    assert verdict({**meta, "calibration": {**record, "merged": fast}}, REFERENCES).state == "calibrated"
    assert verdict({**meta, "calibration": {**record, "merged": [None, *fast]}}, REFERENCES).state == "uncalibrated"
    # a slow machine is said even where another job was not calibrated or has no reference
    slow_now = {**record, "end": [_gpu(fp32=40.0)]}
    assert verdict({**meta, "calibration": {**slow_now, "merged": [None]}}, REFERENCES).suspect
    other = {**merged[0], "start": [{**_gpu(), "device": "NVIDIA B200"}], "end": None}
    assert verdict({**meta, "calibration": {**slow_now, "merged": [other]}}, REFERENCES).suspect
    assert calibration.merged_records(record) == [calibration.without_merged(record), *merged]
    assert calibration.merged_records(record, calibration.without_merged(record)) == merged
    # adding a table's records keeps each job once: the same job again (its end read later) adds nothing
    kept = [calibration.without_merged(record)]
    calibration.add_merged(kept, {**record, "end": None})
    assert kept == [calibration.without_merged(record), *merged]
    calibration.add_merged(kept, record)
    assert kept == [calibration.without_merged(record), *merged]


def test_a_job_that_finishes_after_another_rewrote_its_table_leaves_that_record_on_top(tmp_path) -> None:
    """Jobs side by side: the one that finishes first gives its end to its own entry among the merged records of
    the table the other job rewrote, and touches nothing of a table the other job replaced."""
    first, second = {"method": "m", "start": [_gpu(bf16=700.0)]}, {"method": "m", "start": [_gpu(bf16=701.0)]}
    merged = tmp_path / "merged.meta.json"
    merged.write_text(json.dumps({"calibration": {**second, "merged": [first]}}))
    replaced = tmp_path / "replaced.meta.json"
    replaced.write_text(json.dumps({"calibration": second}))
    job = JobCalibration()
    job.active, job.start, job.written = True, first["start"], [merged, replaced]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "METHOD", "m")
        mp.setattr(calibration, "measure_in_subprocess", lambda: [_gpu()])
        job.finish()
    assert json.loads(merged.read_text())["calibration"] == {**second, "merged": [{**first, "end": [_gpu()]}]}
    assert json.loads(replaced.read_text())["calibration"] == second
