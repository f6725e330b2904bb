"""DDP step benchmark plumbing: variants, and the course-style command-line entry points on 2 gloo ranks."""

from __future__ import annotations

import pandas as pd
import pytest

from cs336_systems.benchmarking import ddp_steps as benchmark
from cs336_systems.experiments import naive_ddp as naive_ddp_benchmark


def test_variants_expand_and_validate() -> None:
    cfg = benchmark.DDPBenchConfig(modes=["single", "torch", "flat", "bucketed"], bucket_sizes_mb=[1, 10],
                                   comm_dtypes=["fp32", "bf16"])
    labels = [v.label for v in benchmark.expand_variants(cfg)]
    assert labels == ["single", "torch", "torch (bf16 comm)", "flat", "flat (bf16 comm)", "bucketed (1MB)",
                      "bucketed (10MB)", "bucketed (1MB, bf16 comm)", "bucketed (10MB, bf16 comm)"]
    for bad in (dict(modes=["ring"]), dict(autocast="fp8"), dict(comm_dtypes=["int8"]), dict(bucket_sizes_mb=[0]),
                dict(preset="enormous"), dict(attention_impl="flashy")):
        with pytest.raises(ValueError):
            benchmark.DDPBenchConfig(**bad).validate()


def test_naive_toy_cli_prints_match(capsys: pytest.CaptureFixture[str]) -> None:
    assert naive_ddp_benchmark.main(["--model", "toy", "--nproc", "2", "--toy-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "Naive DDP matches baseline!" in out and "communication" in out


@pytest.mark.slow
def test_ddp_benchmark_cli_smoke(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("CS336_SMOKE", "1")
    argv = ["--mode", "flat", "bucketed", "--bucket-size-mb", "0.05", "1", "--nproc", "2", "--warmup", "0",
            "--steps", "1", "--preset", "tiny", "--context-length", "16", "--profile", "flat", "--check-toy",
            "--allreduce-sizes", "1KB", "8MB"]
    assert benchmark.main(argv) == 0
    section = tmp_path / benchmark.SECTION
    df = pd.read_csv(section / "steps_tiny_fp32.csv")
    assert df["variant"].tolist() == ["single", "torch", "flat", "bucketed (0.05MB)", "bucketed (1MB)"]
    assert (df["step_ms"] > 0).all()
    assert df.loc[df["mode"] == "bucketed", "num_buckets"].tolist()[1] == 1  # the tiny model fits one 1 MiB bucket
    assert df.loc[df["mode"] == "bucketed", "num_buckets"].tolist()[0] > 1
    timeline = pd.read_csv(section / "timeline_tiny_fp32.csv")
    assert set(timeline["variant"]) == {"flat"} and {"compute", "phase"} <= set(timeline["kind"])
    equivalence = pd.read_csv(section / "toy_equivalence_tiny_fp32.csv")
    assert equivalence["variant"].tolist() == ["flat", "bucketed (0.05MB)", "bucketed (1MB)"] and equivalence["ok"].all()
    assert pd.read_csv(section / "allreduce_tiny_fp32.csv")["size_bytes"].tolist() == [1000, 8_000_000]
    for f in ("steps_tiny_fp32.png", "bucket_sweep_tiny_fp32.png", "timeline_tiny_fp32.png", "overhead_model_tiny_fp32.json"):
        assert (section / f).exists(), f
    # Published to the notebook sections the modes cover: flat (single + flat) and bucketed (single + bucketed).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp_benchmark", "ddp_bucketed", "ddp_flat"]
    flat = pd.read_csv(tmp_path / "ddp_flat" / "steps_tiny_fp32.csv")
    assert flat["mode"].tolist() == ["single", "torch", "flat"]
    assert (tmp_path / "ddp_flat" / "timeline_tiny_fp32.csv").exists()
    assert not (tmp_path / "ddp_bucketed" / "timeline_tiny_fp32.csv").exists()
    assert (tmp_path / "ddp_bucketed" / "overhead_model_tiny_fp32.json").exists()
