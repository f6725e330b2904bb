"""Sections as units: typed parameters with presets, one command line, and what it refuses in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pandas as pd
import pytest
import torch

from cs336_systems.experiments import SECTIONS, get
from cs336_systems.experiments.__main__ import main, resolve_preset
from cs336_systems.experiments.section import PRESETS, CommandLineText, coerce, from_text


def test_every_section_is_a_complete_unit() -> None:
    assert len(SECTIONS) == 22 and list(SECTIONS)[0] == "model_sizes" and list(SECTIONS)[-1] == "course_tests"
    numbers = [s.number for s in SECTIONS.values()]
    assert len(set(numbers)) == len(numbers)
    for name, section in SECTIONS.items():
        assert set(section.presets) == set(PRESETS), name
        assert section.run is not None and callable(section.answer), name
        own = {f"cs336_systems/experiments/{name}.py", f"cs336_systems/experiments/{name}/"}  # a module or a package
        assert own & set(section.depends), "its own module measures too"
        for preset in PRESETS:  # every preset is a valid parameter set of one typed dataclass
            assert type(section.presets[preset]) is section.params_type
        if section.derive is not None:
            assert section.derive_inputs, name


def test_parameters_are_typed_and_checked_by_name() -> None:
    bench = get("benchmarking")
    p = bench.params("smoke", {"sizes": "small", "budget_s": 30, "fresh_process": "false"})
    assert p.sizes == ["small"] and p.budget_s == 30.0 and p.fresh_process is False
    # both handouts' tables, each model once: 2026's xl is 2025's 2.7B, so 2026 adds only its 10B
    assert bench.params("full").sizes == ["small", "medium", "large", "xl", "2.7B", "10B@2026"]
    with pytest.raises(ValueError, match="mode must be one of inference, forward, forward_backward, train, got 'step'"):
        bench.params("full", {"mode": "step"})
    with pytest.raises(ValueError, match="benchmarking has no parameter 'size'; parameters: sizes, "):
        bench.params("full", {"size": "xl"})
    with pytest.raises(ValueError, match="benchmarking.steps must be int, got 'ten'"):
        bench.params("full", {"steps": "ten"})
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        bench.params("huge")
    with pytest.raises(ValueError, match="unknown part 'everything'"):
        get("flash_benchmarking").params("full", {"parts": ["everything"]})
    # the presets themselves are not changed by overrides
    assert bench.presets["smoke"].sizes == ["tiny"]


def test_command_line_text_is_read_by_the_parameters_type() -> None:
    assert from_text("/tmp/a b/course", str, "x") == "/tmp/a b/course"
    assert from_text("small,2.7B", list[str], "x") == ["small", "2.7B"]
    assert from_text("[128, 256]", list[int], "x") == [128, 256]
    assert from_text("None", int | None, "x") is None and from_text("3", int | None, "x") == 3
    assert coerce(from_text("1,10", list[float], "x"), list[float], "x") == [1.0, 10.0]
    flash = get("flash_benchmarking").params("full", {"poly_exp2": CommandLineText("None"),
                                                      "leaderboard.head_dims": CommandLineText("64")})
    assert flash.poly_exp2 is None and flash.leaderboard.head_dims == [64]


def test_gpu_presets_are_refused_without_gpus(monkeypatch) -> None:
    from cs336_systems.experiments import __main__ as cli

    monkeypatch.setattr(cli, "_gpus_here", lambda: 0)
    assert resolve_preset(get("benchmarking"), None) == "smoke"
    assert resolve_preset(get("communication_accounting"), None) == "full"  # analytic: runs anywhere
    with pytest.raises(ValueError, match="benchmarking --quick needs a CUDA GPU and this machine has 0: run --smoke"):
        resolve_preset(get("benchmarking"), "quick")
    monkeypatch.setattr(cli, "_gpus_here", lambda: 1)
    with pytest.raises(ValueError, match="fsdp --full needs 2 CUDA GPUs and this machine has 1"):
        resolve_preset(get("fsdp"), "full")
    assert resolve_preset(get("fsdp"), None) == "smoke"


def test_cli_lists_sections_and_describes_parameters(capsys) -> None:
    assert main([]) == 0
    listing = capsys.readouterr().out
    assert "§2.3.3  ddp_bucketed" in listing and "(2+ GPUs)" in listing and "(any machine)" in listing
    assert main(["torch_compile", "--help"]) == 0
    described = capsys.readouterr().out
    assert "list[str]: ['small', 'medium', 'large', 'xl', '2.7B'] (smoke ['tiny'], quick ['small', 'medium', 'large'])" in described
    assert "budget_s" in described and "time budget" in described


def test_cli_rejects_bad_input_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no_such_section"])
    assert exc.value.code == 2 and "unknown section 'no_such_section'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["benchmarking", "--set", "not-an-assignment"])
    assert "expected KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no parameter 'sizez'"):
        main(["benchmarking", "--smoke", "--set", "sizez=tiny"])
    with pytest.raises(ValueError, match="no section of benchmarking, mixed_precision has a parameter 'sizez'"):
        main(["benchmarking", "mixed_precision", "--smoke", "--set", "sizez=tiny"])


@pytest.mark.slow
def test_cli_smoke_run_writes_results_and_prints_answers(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["model_sizes", "mixed_precision", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "(c) Forward and backward timings" in out and "done in" in out
    meta = json.loads((tmp_path / "mixed_precision" / "precision_timings.meta.json").read_text())
    assert meta["smoke"] is True and meta["params"]["preset"] == "smoke" and meta["params"]["sizes"] == ["tiny"]
    presets = json.loads((tmp_path / "model_sizes" / "presets.meta.json").read_text())
    assert presets["params"]["preset"] == "smoke"


def test_params_record_every_field() -> None:
    """What a result's meta records is the whole typed parameter set, so a rerun can reproduce it."""
    p = get("pytorch_attention").params("quick")
    assert set(dataclasses.asdict(p)) == {"d_models", "seq_lens", "batch_size", "n_forward", "n_backward", "budget_s",
                                          "probe_doublings"}


@pytest.mark.slow
def test_torchrun_form_of_a_section_reads_its_own_arguments(tmp_path, monkeypatch) -> None:
    """``torchrun -m cs336_systems.experiments.fsdp --set ...``: the module's main parses the command line like
    the experiments command (here without torchrun, so it spawns two gloo ranks)."""
    from cs336_systems.experiments import fsdp

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"^fsdp_graph needs warmup >= 1"):
        get("fsdp").params("smoke", {"warmup": 0})
    with pytest.raises(ValueError, match=r"^gathers_against \['fsdp3'\]: choose of fsdp_block, fsdp2, ddp"):
        get("fsdp").params("smoke", {"gathers_against": ["fsdp3"]})
    monkeypatch.setattr("sys.argv", ["fsdp", "--smoke", "--set", "strategies=ddp,fsdp", "--set", "steps=1",
                                     "--set", "warmup=0", "--set", "gathers_against=fsdp_block,fsdp2,ddp,fsdp_fused"])
    assert fsdp.main() == 0
    meta = json.loads((tmp_path / "fsdp" / "fsdp_vs_ddp.meta.json").read_text())
    assert meta["params"]["strategies"] == ["ddp", "fsdp"] and meta["params"]["steps"] == 1
    import pandas as pd

    unprofiled = pd.read_csv(tmp_path / "fsdp" / "gathers_unprofiled.csv")  # fsdp_accounting (b), both ranks
    assert sorted(zip(unprofiled["strategy"], unprofiled["rank"])) == [
        ("ddp", 0), ("ddp", 1), ("fsdp", 0), ("fsdp", 1), ("fsdp2", 0), ("fsdp2", 1), ("fsdp_block", 0),
        ("fsdp_block", 1), ("fsdp_fused", 0), ("fsdp_fused", 1)]
    assert (unprofiled["forward_gpu_ms"] > 0).all()
    assert (unprofiled["forward_gpu_ms_round_lo"] <= unprofiled["forward_gpu_ms_round_hi"]).all()


@pytest.mark.slow
def test_ddp_sections_take_several_world_sizes_and_report_scaling(tmp_path, monkeypatch, capsys) -> None:
    flat = get("ddp_flat")
    with pytest.raises(ValueError, match=r"world sizes >= 2, got nproc=\[1, 2\]"):
        flat.params("smoke", {"nproc": [1, 2]})
    with pytest.raises(ValueError, match="nproc lists a world size twice"):
        flat.params("smoke", {"nproc": [2, 2]})
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["ddp_flat", "--smoke", "--set", "nproc=2,3"]) == 0
    out = capsys.readouterr().out
    assert "world size 3, fp32:" in out and "Weak scaling over 2 and 3 GPUs" in out
    import pandas as pd

    scaling = pd.read_csv(tmp_path / "ddp_flat" / "scaling.csv")
    assert sorted(scaling["world_size"].unique()) == [2, 3]
    assert set(scaling["variant"]) == {"torch", "naive", "flat"}  # the single-process row is the reference
    assert (scaling["sequences_per_s"] > 0).all() and (scaling["scaling_efficiency"] > 0).all()
    # The first world size writes the tables the answers read; the others carry theirs in the name.
    assert (tmp_path / "ddp_flat" / "steps_tiny_fp32.csv").exists()
    assert (tmp_path / "ddp_flat" / "np3_tiny_fp32.csv").exists()


@pytest.mark.slow
def test_torch_compile_model_sizes_measured_in_two_jobs_make_one_table(tmp_path, monkeypatch) -> None:
    """The whole model at every size takes longer than one GPU job, so jobs of other sizes add their rows
    (in preset order) at one commit and settings; other settings start the table over."""
    from cs336_systems import results
    from cs336_systems.experiments import get, torch_compile
    from cs336_systems.experiments.__main__ import writer

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setattr(results, "git_commit", lambda: "a" * 40)
    monkeypatch.setattr(torch_compile, "eager_and_compiled", lambda spec, rounds, compile: {
        side: {"total_mean_ms": 1.0 if side else 2.0, "tokens_per_s": 1.0} for side in (False, True)})
    section = get("torch_compile")
    base: dict = {"parts": ["model"], "compile": True}

    def measure(sizes: list[str]) -> tuple[list[str], list[str]]:
        p = section.params("smoke", {**base, "sizes": sizes})
        section.run(p, writer(section, p, "smoke", publish=True))
        timings = results.load_table("torch_compile", "model_timings", root=tmp_path)
        speed = results.load_table("torch_compile", "model_speedup", root=tmp_path)
        return list(dict.fromkeys(timings["size"])), list(dict.fromkeys(speed["size"]))

    assert measure(["small"]) == (["small"], ["small"])
    assert measure(["tiny"]) == (["tiny", "small"], ["tiny", "small"])
    assert not (tmp_path / "torch_compile" / "attention_timings.csv").exists()  # the attention part did not run
    base["steps"] = 3
    assert measure(["tiny"]) == (["tiny"], ["tiny"])
    sweep = torch_compile.run_sweep

    def job_beside(*args, **kwargs):  # another job of these settings writes its size while this one measures
        monkeypatch.setattr(torch_compile, "run_sweep", sweep)
        measure(["small"])
        return sweep(*args, **kwargs)

    monkeypatch.setattr(torch_compile, "run_sweep", job_beside)
    assert measure(["tiny"]) == (["tiny", "small"], ["tiny", "small"])  # jobs side by side keep both
    calls = []

    def cut_after_one_pair(spec, rounds, compile):  # a job killed at its time limit during its second pair
        calls.append(spec.mode)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return {side: {"total_mean_ms": 1.0, "tokens_per_s": 1.0} for side in (False, True)}

    monkeypatch.setattr(torch_compile, "eager_and_compiled", cut_after_one_pair)
    base["steps"] = 4
    with pytest.raises(KeyboardInterrupt):
        measure(["small"])
    timings = results.load_table("torch_compile", "model_timings", root=tmp_path)
    assert list(zip(timings["mode"], timings["compiled"])) == [("forward", False), ("forward", True)]
    with pytest.raises(ValueError, match="unknown part 'graphs'"):
        section.params("smoke", {"parts": ["graphs"]})


def test_torch_compile_times_the_short_cells_in_fresh_processes_of_both_sections(tmp_path, monkeypatch) -> None:
    """The ``processes`` part records every round's process of each section (the check across sections reads
    its spread between processes); it measures the grid's head dimensions at its own sequence lengths."""
    from cs336_systems import results
    from cs336_systems.benchmarking import attention_process_ab
    from cs336_systems.experiments import get
    from cs336_systems.experiments.__main__ import writer

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    seen = []

    def one_process(section, cells, n, batch, device):
        seen.append((section, tuple(cells), n, batch))
        return [{"d_model": d, "seq_len": s, "forward_ms": 0.2, "backward_ms": 0.7} for d, s in cells]

    monkeypatch.setattr(attention_process_ab, "one_process", one_process)
    section = get("torch_compile")
    p = section.params("smoke", {"parts": ["processes"], "d_models": [16, 32], "process_seq_lens": [64],
                                 "process_rounds": 2})
    section.run(p, writer(section, p, "smoke", publish=True))
    table = results.load_table("torch_compile", "attention_processes", root=tmp_path)
    assert [s for s, *_ in seen] == ["pytorch_attention", "torch_compile", "torch_compile", "pytorch_attention"]
    assert seen[0][1:] == (((16, 64), (32, 64)), p.n_forward, p.batch_size)
    assert len(table) == 2 * 2 * 2 * 2 and set(table["phase"]) == {"forward", "backward"}
    assert not (tmp_path / "torch_compile" / "attention_timings.csv").exists()
    with pytest.raises(ValueError, match="process_rounds must be positive"):
        section.params("smoke", {"process_rounds": 0})


def test_attention_probes_beyond_a_grid_that_fits_and_accounts_for_the_first_oom(monkeypatch) -> None:
    """Where every grid cell fits, the smallest d is doubled past the grid until one step runs out of memory; the
    accounting is that configuration's, and the answer sets what the backward adds against the GPU's memory."""
    from cs336_systems.experiments import pytorch_attention as pa

    grid = pd.DataFrame({"d_model": [16, 32], "seq_len": [1024, 1024], "status": ["ok", "ok"],
                         "memory_before_backward_MiB": [80.0, 90.0]})
    steps = []

    def step(d, seq, batch_size, device=None):
        steps.append((d, seq))
        fits = seq <= 2048
        return {"d_model": d, "seq_len": seq, "status": "ok" if fits else "OOM", "oom_in": None if fits else "backward",
                "memory_before_backward_MiB": 4.0 * seq if fits else float("nan"),
                "peak_MiB": 6.0 * seq if fits else float("nan")}

    monkeypatch.setattr(pa, "attention_step_memory", step)
    monkeypatch.setattr(pa.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pa.torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 2**40}))
    p = pa.Params(d_models=[16, 32], seq_lens=[1024], batch_size=8, probe_doublings=3)
    probe = pa.oom_probe(p, grid)
    assert steps == [(16, 1024), (16, 2048), (16, 4096)] and list(probe["status"]) == ["ok", "ok", "OOM"]
    _, acc = pa.attention_memory_accounting(grid, 8, probe)
    assert (acc["d_model"], acc["seq_len"]) == (16, 4096) and "the first that ran out of memory, in its backward" \
        in acc["source"]
    text = pa._backward_peak(acc).markdown
    assert "at $T = 2\\,048$ the step peaked at 12,288 MiB against 8,192 MiB before the backward, 1.50×" in text
    assert "adds about 32 more $B \\times T \\times T$ fp32 tensors" in text  # 4,096 MiB of 128 MiB tensors
    assert "Measured before its backward" not in text  # the failed step read nothing before its backward
    # at the configuration that did not fit: 1,562 MiB saved + 32 score-sized tensors of 512 MiB
    assert text.endswith("At $T = 4\\,096$ that is about 17,946 MiB, so the step ran out of memory in its backward.")
    measured = {**acc, "probe": [*acc["probe"][:-1], {**acc["probe"][-1], "memory_before_backward_MiB": 1600.0}]}
    assert "Measured before its backward: 1,600 MiB, which fits the GPU's" in pa._backward_peak(measured).markdown
    assert "the first that runs out of memory is $d = 16$, $T = 4\\,096$ (batch 8), in its backward." in \
        pa._which_size(acc, "NVIDIA H200").markdown
    assert pa.oom_probe(p, grid.assign(status=["ok", "OOM"])) is None  # the grid has its own smallest OOM
    monkeypatch.setattr(pa.torch.cuda, "is_available", lambda: False)
    assert pa.oom_probe(p, grid) is None


def test_torch_compile_alternates_eager_and_compiled_on_one_model(monkeypatch) -> None:
    """The compiled side compiles first (its own warm-up), then each round runs eager then compiled, on the same
    weights and one optimizer, so neither side is timed right after the other's idle compile."""
    from cs336_systems.benchmarking.end_to_end import BenchmarkSpec, ModelBenchmark
    from cs336_systems.experiments import torch_compile

    order: list[str] = []
    benches: list[ModelBenchmark] = []
    real_step = ModelBenchmark.step

    def step(self: ModelBenchmark) -> dict[str, float]:
        order.append("c" if self.spec.compile else "e")
        benches.append(self)
        return real_step(self)

    monkeypatch.setattr(ModelBenchmark, "step", step)
    monkeypatch.setattr(torch, "compile", lambda model: model)  # Inductor takes minutes on a small CPU
    spec = BenchmarkSpec("tiny", mode="train", context_length=16, warmup=1, steps=2, device="cpu")
    rows = torch_compile.eager_and_compiled(spec, rounds=2)
    assert "".join(order) == "c" + "eee" + "ccc" + "eee" + "ccc"
    eager, compiled = benches[1], benches[0]
    assert compiled.model is eager.model and compiled.optimizer is eager.optimizer
    assert rows[True]["wall_incl_compile_s"] > 0 and math.isnan(rows[False]["wall_incl_compile_s"])
    assert all(row["total_mean_ms"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())


@pytest.mark.slow
def test_benchmarking_times_each_phase_of_a_full_step_and_says_why_a_size_does_not_fit(tmp_path, monkeypatch) -> None:
    """The 2026 handout asks for the optimizer step as well: the default mode times forward, backward and
    AdamW separately, and a size that runs out of memory is explained by what its state alone needs."""
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _timing_sentence

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["benchmarking", "--smoke", "--set", "warmup_study=[0]"]) == 0
    meta = json.loads((tmp_path / "benchmarking" / "timings.meta.json").read_text())
    assert meta["params"]["mode"] == "train"
    timings = pd.read_csv(tmp_path / "benchmarking" / "timings.csv")
    row = timings.iloc[0]
    for phase in ("forward", "backward", "optimizer"):
        assert row[f"{phase}_mean_ms"] > 0
    assert row["total_mean_ms"] >= row["forward_mean_ms"] + row["backward_mean_ms"] + row["optimizer_mean_ms"] - 1e-6
    oom = pd.concat([timings, pd.DataFrame([{"size": "10B@2026", "status": "OOM"}])], ignore_index=True)
    text = _timing_sentence(oom, meta).markdown
    assert "Forward / backward / optimizer time per step: tiny " in text
    assert ("10B@2026 (OOM: 12.8 B parameters need 191 GiB for fp32 weights, gradients and AdamW moments alone, "
            "where a forward pass holds only the 47.8 GiB of weights)") in text
    # a run of the earlier forward + backward grid says what it lacks
    old = _timing_sentence(timings.drop(columns=[c for c in timings if c.startswith("optimizer_")]), {"params": {}})
    assert "timed forward_backward steps, without the optimizer" in old.markdown


def test_a_size_too_large_to_train_is_timed_in_the_lightest_mode_that_fits(monkeypatch) -> None:
    """Out of memory in a training step falls through to forward + backward, then forward, then a forward
    without autograd; the row says what it timed and what did not fit, and the answer and table say so."""
    import pandas as pd
    import torch

    from cs336_systems.experiments import benchmarking as bm

    fits = {"forward"}
    asked = []

    def fake(spec):
        asked.append(spec.mode)
        if spec.mode not in fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"forward_mean_ms": 250.0, "forward_std_ms": 1.0, "total_mean_ms": 251.0}

    monkeypatch.setattr(bm, "benchmark_model", fake)
    row = bm.time_what_fits("10B@2026", bm.Params())
    assert asked == ["train", "forward_backward", "forward"]
    assert (row["timed_mode"], row["out_of_memory"], row["forward_mean_ms"]) == ("forward", "train", 250.0)
    fits.clear()
    with pytest.raises(torch.cuda.OutOfMemoryError):  # nothing fits: the sweep records the size as OOM
        bm.time_what_fits("10B@2026", bm.Params())
    monkeypatch.setattr(bm, "benchmark_model", lambda spec: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # only out-of-memory falls through
        bm.time_what_fits("small", bm.Params())

    table = pd.DataFrame([
        {"size": "small", "status": "ok", "timed_mode": "train", "out_of_memory": None, "forward_mean_ms": 20.0,
         "forward_std_ms": 0.1, "backward_mean_ms": 40.0, "backward_std_ms": 0.1, "optimizer_mean_ms": 10.0,
         "optimizer_std_ms": 0.1},
        {"size": "10B@2026", **row, "status": "ok"}])
    text = bm._timing_sentence(table, {"params": {"mode": "train"}}).markdown
    assert "Forward / backward / optimizer time per step: small 20" in text and "10B@2026 250" not in text
    assert "10B@2026's training step ran out of memory: 12.8 B parameters need 191 GiB" in text
    assert "timed forward only: its forward 250 ms" in text
    inference = table.assign(timed_mode=["train", "inference"])
    assert "under `torch.no_grad`" in bm._timing_sentence(inference, {"params": {"mode": "train"}}).markdown
    assert list(bm._lighter_shown(table)["status"]) == ["ok", "forward only"]
    assert "not comparable with the other rows' training steps." in bm._lighter_caption(table, {"params": {"mode": "train"}})
    assert bm._lighter_caption(table.iloc[:1].assign(out_of_memory=None)) == ""


@pytest.mark.slow
def test_leaderboard_step_on_two_ranks_writes_its_own_table(tmp_path, monkeypatch, capsys) -> None:
    """§1.5 with ``nproc=2``: the FSDP step (gloo ranks here) lands in ``step_2ranks`` beside the one-GPU
    ``step``, and the answer reports it; a batch that does not split is refused before anything runs."""
    with pytest.raises(ValueError, match="does not split over nproc=2"):
        get("leaderboard").params("smoke", {"nproc": 2, "batch_size": 3})
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["leaderboard", "--smoke", "--set", "nproc=2"]) == 0
    assert (tmp_path / "leaderboard" / "step_2ranks.csv").exists()
    assert not (tmp_path / "leaderboard" / "step.csv").exists()
    said = " ".join(capsys.readouterr().out.split())  # the console wraps the answer's lines
    assert "**Our step: " in said and "(2 layers, context 16, batch 2, " in said and "under our FSDP" in said
    assert "The torch-native reference in the same job" in said  # run beside ours (FSDP2, compiled blocks)


def test_an_edition_grid_is_a_parameter_set_and_a_folder_of_its_own(tmp_path, monkeypatch, capsys) -> None:
    nsys, memory = get("nsys_profile"), get("memory_profiling")
    assert nsys.params("full", edition="2026").sizes == ["small", "large"]
    assert nsys.params("full", {"sizes": "small"}, edition="2026").sizes == ["small"]  # --set wins
    assert nsys.params("smoke", edition="2026") == nsys.params("smoke")  # smoke stays tiny
    assert memory.params("quick", edition="2026").size == "xl@2026"
    assert memory.params("full", edition="2026").context_lengths == [128, 2048]
    assert memory.results_folder("2026") == "memory_profiling/2026" and memory.results_folder() == "memory_profiling"
    assert memory.command_for("2026").endswith("memory_profiling --full --edition 2026")
    # a section's own command carries its required settings into its grids' commands too
    assert get("course_tests").command_for("cse599o").endswith(
        "--set checkout=PATH-TO-COURSE-CHECKOUT --set edition=LABEL --publish --edition cse599o")
    with pytest.raises(ValueError, match="benchmarking has no grid of its own for edition '2026' "
                                         r"\(editions with one: none\); its results answer every edition"):
        main(["benchmarking", "--smoke", "--edition", "2026"])
    assert main(["nsys_profile", "--help"]) == 0
    assert "--edition 2026: the 2026 handout's grid (sizes=['small', 'large']" in capsys.readouterr().out

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["memory_profiling", "--smoke", "--edition", "2026"]) == 0
    assert "(d) Size of one residual-stream activation of the tiny model" in capsys.readouterr().out
    meta = json.loads((tmp_path / "memory_profiling" / "2026" / "residual_stream.meta.json").read_text())
    assert meta["params"]["edition"] == "2026" and meta["section"] == "memory_profiling/2026"
    assert not (tmp_path / "memory_profiling" / "residual_stream.json").exists()  # the workbook's grid untouched


def test_a_section_sized_by_a_handout_model_name_measures_each_editions_model() -> None:
    # The DDP benchmarks and optimizer-state sharding ask for "xl": 2025's is 1600/6400/48/25, 2026's the 2.7B shape.
    for name, key in (("naive_ddp", "preset"), ("ddp_flat", "preset"), ("ddp_overlap_individual", "preset"),
                      ("optimizer_state_sharding", "model")):
        section = get(name)
        assert section.grids == {"2026": {key: "xl@2026"}, "cse599o": {key: "large"}}, name
        assert getattr(section.params("full", edition="2026"), key) == "xl@2026"
        assert getattr(section.params("full"), key) == "xl"
        assert getattr(section.params("smoke", edition="2026"), key) == "tiny"  # smoke stays tiny
    # 2026 dropped bucketed DDP (its writeup shows it beyond the handout): no 2026 grid; CSE599-O asks it of Table 1.
    # Its full run measures 2 and 4 GPUs; CSE599-O's handout states one node of 2.
    assert get("ddp_bucketed").grids == {"cse599o": {"preset": "large", "nproc": [2]}}
    assert get("ddp_bucketed").params("full").nproc == [2, 4]
    assert get("ddp_bucketed").params("full", edition="cse599o").nproc == [2]
    # Stated values merge over the translated names; a name both tables share gives no grid.
    base = get("naive_ddp")
    merged = dataclasses.replace(base, editions={"2026": {"context_length": 256}})
    assert merged.grids == {"2026": {"preset": "xl@2026", "context_length": 256}, "cse599o": {"preset": "large"}}
    small = dataclasses.replace(base, presets={**base.presets, "full": dataclasses.replace(  # translated afresh
        base.presets["full"], preset="small")})
    assert small.grids == {"cse599o": {"preset": "large"}}  # both CS336 tables agree on small: no 2026 grid


def test_warmup_answer_names_an_out_of_memory_timing_before_a_failed_first_cell() -> None:
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _warmup_sentence

    study = pd.DataFrame({"size": ["small", "small"], "warmup": [0, 1], "status": ["OOM", "ok"],
                          "forward_mean_ms": [None, 20.0], "forward_std_ms": [None, 0.1]})
    timings = pd.DataFrame({"size": ["small", "10B@2026"], "status": ["ok", "OOM"]})
    text = _warmup_sentence(study, timings).markdown
    assert "the first to run after 10B@2026 ran out of memory in the measuring process" in text
    assert "after the handler" in text
    assert "ran out of memory in the measuring" not in _warmup_sentence(study, timings.iloc[:1]).markdown
    assert "ran out of memory in the measuring" not in _warmup_sentence(study.iloc[::-1], timings).markdown


def test_warmup_answer_compares_cold_and_warm_cells_of_the_sizes_measured_both_ways() -> None:
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _cold_against_warm

    study = pd.DataFrame({"size": ["small", "small", "xl", "xl", "large"], "warmup": [0, 5, 0, 5, 5],
                          "status": ["ok"] * 5, "forward_mean_ms": [30.0, 20.0, 250.0, 240.0, 100.0],
                          "forward_std_ms": [40.0, 0.1, 80.0, 0.3, 9.0]})
    text = _cold_against_warm(study)
    assert text.startswith("In a separate warm-up study (each setting in a fresh process), without warm-up the "
                           "forward's mean is 1.04×–1.50× its mean after 5 warm-up steps")
    assert "standard deviation 40.0 ms–80.0 ms, against at most 0.300 ms after 5" in text  # large has no cold cell
    assert "worst" not in text  # (c) asks for 2-3 sentences: each cell is in the appendix's table
    assert _cold_against_warm(study[study["warmup"] == 5]) == ""


def test_timing_answer_says_whether_the_spread_is_small_and_which_cells_are_noisy() -> None:
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _timing_sentence

    ok = {"status": "ok", "forward_mean_ms": 10.0, "forward_std_ms": 0.1, "backward_mean_ms": 20.0,
          "backward_std_ms": 0.2}
    df = pd.DataFrame([{**ok, "size": "small"}, {**ok, "size": "xl", "backward_std_ms": 4.0}])
    text = _timing_sentence(df).markdown
    assert "the standard deviation is small: a median of 1.0% of the mean, and the backward pass's 20% for xl (a " \
           "few slow steps)." in text
    quiet = _timing_sentence(df.assign(backward_std_ms=0.2)).markdown
    assert "a median of 1.0% of the mean, at most 1.0% (small forward). " in quiet and "slow steps" not in quiet


def test_split_full_runs_are_jobs_of_valid_parameters_run_by_number(monkeypatch, capsys, tmp_path) -> None:
    """A section too long for one GPU job lists its parts: each part's values are parameters of the section,
    ``--job N`` runs part N (any --set applying over it), and ``writeup status --jobs`` prints the commands of
    the sections that need a run."""
    from cs336_systems.experiments import __main__ as cli
    from cs336_systems.experiments.section import command_text
    from cs336_systems.writeup.__main__ import main as report_main

    split = [s for s in SECTIONS.values() if s.jobs]
    assert {"benchmarking", "flash_benchmarking", "training_step"} <= {s.name for s in split}
    for section in split:
        for job in section.jobs:
            section.params("full", job.sets)  # unknown names or bad values would raise here
        commands = section.job_commands()
        assert len(commands) == len(section.jobs) and f"{section.name} --job {len(section.jobs)}" in commands[-1]
    training = get("training_step")
    assert "--set presets=xl --set contexts=4096" in training.job_commands()[3]
    assert "--set 'longest.presets=[]'" in training.job_commands()[0] and "(5.8 min)" in training.job_commands()[0]
    assert command_text([]) == "[]" and command_text([True, False]) == "true,false" and command_text(4.0) == "4.0"

    ran = []
    monkeypatch.setattr(cli, "run_section", lambda name, preset, overrides, **kw: ran.append((name, preset, overrides)))
    monkeypatch.setattr(cli, "_gpus_here", lambda: 8)  # what --full needs; nothing runs (run_section is a stand-in)
    cli.main(["training_step", "--job", "4", "--set", "rounds=3"])
    name, preset, overrides = ran[-1]
    assert (name, preset) == ("training_step", "full") and overrides["presets"] == ["xl"]
    assert overrides["contexts"] == [4096] and overrides["rounds"] == "3"  # --set over the job's value
    with pytest.raises(ValueError, match=r"training_step has jobs 1\.\.9; got --job 10"):
        cli.main(["training_step", "--job", "10"])
    with pytest.raises(ValueError, match="its full run is one job"):
        cli.main(["mixed_precision", "--job", "1"])
    with pytest.raises(SystemExit):
        cli.main(["training_step", "--smoke", "--job", "1"])
    assert "--job runs a part of one section's --full run" in capsys.readouterr().err

    empty = tmp_path / "figures"
    empty.mkdir()
    report_main(["status", "--figures", str(empty), "--jobs"])
    out = capsys.readouterr().out
    assert "    uv run python -m cs336_systems.experiments flash_benchmarking --job 11" in out
    assert "training_step --job 9" in out and "experiments mixed_precision --job" not in out


def test_the_longest_context_answer_names_the_presets_no_job_searched_at_this_commit():
    """A search split into jobs can end with some presets unsearched; the answer says which instead of
    silently leaving them out (and says nothing when all of the full run's presets are there)."""
    import pandas as pd

    from cs336_systems.experiments.training_step import _longest_text

    full = get("training_step").presets["full"].longest.presets
    rows = [{"preset": pr, "context_length": 256, "fits": True, "peak_GiB": 2.0, "longest": 256} for pr in full]
    params = {"longest_high": 131072, "attention": "flash_triton"}
    assert "Not searched" not in str(_longest_text(pd.DataFrame(rows), params))
    partial = _longest_text(pd.DataFrame([r for r in rows if r["preset"] != "xl"]), params)
    assert "Not searched in these runs: xl." in str(partial)


def test_the_steps_answer_shows_presets_measured_on_older_code_in_their_own_marked_tables(tmp_path, monkeypatch):
    """The combined ``steps`` table takes only the presets measured on the current code; a preset whose table is
    older is shown on its own (carrying its stale mark), and its cells that ran are named as measured on other
    code, not as unmeasured; cells that failed or that no job ran stay unmeasured."""
    from cs336_systems.experiments import training_step as ts
    from cs336_systems.report import data as report_data
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Table

    current = "c" * 40
    monkeypatch.setattr(report_data, "freshness", lambda meta, depends: types.SimpleNamespace(
        stale=meta.get("git_commit") != current, reason="changed since: x.py"))
    monkeypatch.setattr(report_data, "_stale_note", lambda verdict: verdict.reason)
    folder = tmp_path / "training_step"
    folder.mkdir()

    def write(name, cells, commit=current):
        rows = [{"preset": pr, "context_length": c, "batch_size": 1, "status": status, "ours_step_ms": 10.0,
                 "ours_spread_ms": 0.1, "reference_step_ms": 10.5, "reference_spread_ms": 0.1}
                for pr, c, status in cells]
        pd.DataFrame(rows).to_csv(folder / f"{name}.csv", index=False)
        (folder / f"{name}.meta.json").write_text(json.dumps({"device": "H200", "git_commit": commit}))

    small = [("small", 1024, "ok"), ("small", 4096, "ok")]
    write("steps", small)
    write("steps_small", small)
    write("steps_large", [("large", 1024, "ok"), ("large", 4096, "OOM")], commit="0" * 40)

    def shown(blocks):
        steps = next(q for q in blocks if getattr(q, "label", None) == "steps")
        text = " ".join(getattr(x, "markdown", "") for x in steps.blocks)
        return text, [x for x in steps.blocks if isinstance(x, Table)]

    text, tables = shown(ts.answer(SectionData(tmp_path, "training_step")))
    assert "Measured only on other code than the current (shown below, marked stale): large at 1024." in text
    assert "Not measured in these runs: medium at 1024" in text and "large at 4096" in text.split("Not measured")[1]
    assert [t.source.rsplit("/", 1)[-1] for t in tables] == ["steps.csv", "steps_large.csv"]
    assert "stale" not in tables[0].meta and tables[1].meta["stale"]

    write("steps", small + [("large", 1024, "ok")])  # both on the current code: one table, nothing called other
    write("steps_large", [("large", 1024, "ok")])
    text, tables = shown(ts.answer(SectionData(tmp_path, "training_step")))
    assert "other code" not in text and len(tables) == 1


def test_bucketed_full_run_fits_the_machine_and_the_launcher(monkeypatch) -> None:
    """--full measures 2 and 4 GPUs: on 2 GPUs that is one line naming the fix; under torchrun/srun the launcher's
    world is the one run (not the same world once per listed size)."""
    import torch

    from cs336_systems.distributed import runner
    from cs336_systems.experiments import ddp_bucketed, ddp_common

    full = get("ddp_bucketed").params("full")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nproc=\[2, 4\] needs 4 GPUs and this machine has 2: pass --set nproc=2"):
        ddp_bucketed.run(full, None)
    seen = []
    monkeypatch.setattr(ddp_common, "run_ddp", lambda section, p, out, modes, **kw: seen.append(p.nproc) or {})
    monkeypatch.setattr(runner, "launched_externally", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    ddp_bucketed.run(full, None)
    assert seen == [[4]]


def test_sharding_extra_world_sizes_are_tagged_with_their_own_size(monkeypatch, tmp_path) -> None:
    """nproc=[2, 4]: the first world size writes the answers' tables, the second `_np4` tables whose record
    says 4; too few GPUs for the largest is one line before anything runs."""
    import json

    import torch

    from cs336_systems.distributed import runner
    from cs336_systems.experiments import optimizer_state_sharding as oss
    from cs336_systems.results import ResultWriter

    def fake(worker, n, config, optimizers):
        return [[{"optimizer": o, "rank": r, "world_size": n, "step_ms": 10.0 * n, "step_ms_std": 0.1,
                  **{k: 1.0 for k in ("after_init_allocated", "after_init_peak", "before_step_allocated",
                                      "before_step_peak", "after_step_allocated", "after_step_peak", "parameters",
                                      "gradients", "optimizer_state", "activations")},
                  **{f"predicted_{k}": 1.0 for k in ("parameters", "gradients", "optimizer_state", "activations")}}
                 for o in optimizers] for r in range(n)]

    monkeypatch.setattr(runner, "run_on_ranks", fake)
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    p = dataclasses.replace(get("optimizer_state_sharding").params("smoke"), nproc=[2, 4])
    out = ResultWriter("optimizer_state_sharding", smoke=False, params=dataclasses.asdict(p))
    written = oss.run(p, out)
    assert {"timing", "timing_np4", "memory_np4"} <= set(written)
    folder = tmp_path / "optimizer_state_sharding"
    assert json.loads((folder / "timing_np4.meta.json").read_text())["params"]["world_size"] == 4
    assert json.loads((folder / "timing.meta.json").read_text())["params"]["world_size"] == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nproc=\[2, 4\] needs 4 GPUs and this machine has 2"):
        oss.run(p, out)


from cs336_systems.experiments.section import group as _group  # noqa: E402
from cs336_systems.experiments.section import param as _param  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Shapes:
    rounds: int = _param(3, "alternating rounds")
    dims: list[int] = _param([64, 128], "head dimensions")


@dataclasses.dataclass(frozen=True)
class _GroupedParams:
    budget_s: float = _param(60.0, "time budget")
    shapes: _Shapes = _group(_Shapes(), "the shapes grid")


def test_a_group_of_parameters_is_set_by_dotted_name_listed_and_recorded_flat() -> None:
    """One part's parameters as a group: ``--set shapes.rounds=5`` (or a nested dict from a notebook) reaches
    inside it, a wrong name fails in one line naming the group's parameters, ``--help`` lists ``shapes.rounds``,
    and the run-parameters line spells what differs from the preset the same way."""
    from cs336_systems.experiments.section import Section
    from cs336_systems.report.data import params_line, register_section
    from cs336_systems.results import _jsonable, flat_params

    Shapes, Params = _Shapes, _GroupedParams
    section = Section("grouped_demo", "9.9", "demo", (), answer=lambda d: [], gpus=0,
                      presets={p: Params() for p in PRESETS})
    p = section.params("full", {"shapes.rounds": CommandLineText("5"), "budget_s": 30})
    assert (p.shapes.rounds, p.shapes.dims, p.budget_s) == (5, [64, 128], 30.0)
    assert section.params("full", {"shapes": {"dims": [32]}}).shapes == Shapes(3, [32])
    assert section.params("full").shapes == Shapes()  # the preset itself is unchanged
    with pytest.raises(ValueError, match=r"grouped_demo.shapes has no parameter 'round'; parameters: rounds, dims"):
        section.params("full", {"shapes.round": 5})
    with pytest.raises(ValueError, match=r"grouped_demo.shapes is a group of parameters: set grouped_demo.shapes.NAME"):
        section.params("full", {"shapes": 5})
    with pytest.raises(ValueError, match=r"grouped_demo.budget_s is a parameter, not a group"):
        section.params("full", {"budget_s.x": 5})
    with pytest.raises(ValueError, match=r"grouped_demo.shapes.rounds"):
        section.params("full", {"shapes.rounds": "many"})
    assert [row[0] for row in section.describe_params()] == ["budget_s", "shapes.rounds", "shapes.dims"]
    from cs336_systems.experiments.__main__ import assignment

    assert assignment("shapes.rounds=5") == ("shapes.rounds", "5")
    with pytest.raises(Exception, match="expected KEY=VALUE"):
        assignment("shapes..rounds=5")
    recorded = json.loads(json.dumps(_jsonable(p)))
    assert recorded["shapes"] == {"rounds": 5, "dims": [64, 128]}
    assert flat_params(recorded) == {"budget_s": 30.0, "shapes.rounds": 5, "shapes.dims": [64, 128]}
    register_section(section)
    try:
        line = params_line({"section": "grouped_demo", "params": {**recorded, "run_preset": "full"}})
    finally:
        from cs336_systems.report.data import SECTIONS as registered

        registered.pop("grouped_demo", None)
    assert line == "--full, with budget_s=30, shapes.rounds=5"


def test_communication_accounting_states_the_tokens_its_activation_total_counts(tmp_path, monkeypatch) -> None:
    """(a)'s activation total is for the run's tokens per device: the answer says how many, and whether they are
    (c)'s compute-bound batch."""
    from pathlib import Path

    from cs336_systems.report.data import SectionData

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    section = get("communication_accounting")

    def part_a(tokens: int | None) -> str:
        assert main(["communication_accounting", "--full"] + (["--set", f"tokens_per_device={tokens}"]
                                                              if tokens else [])) == 0
        (a, *_) = [q for q in section.answer(SectionData(Path(tmp_path), "communication_accounting"))
                   if getattr(q, "label", None) == "a"]
        return " ".join(b.plain() for b in a.blocks if hasattr(b, "plain"))

    assert ("17.5 MB per token ($2\\,L\\,(d_{\\mathrm{model}} + d_{\\mathrm{ff}})$ bytes: each linear keeps its "
            "input), so 5.62 GB for the table's 320 tokens per device (the compute-bound batch per device of part "
            "(c), rounded up).") in part_a(None)
    text = part_a(1024)
    assert "so 18.0 GB for the table's 1,024 tokens per device." in text and "part (c)" not in text


def test_the_warmup_table_names_models_as_the_writeups_handout_does() -> None:
    """2026's table shows its xl (the 2.7B preset) with the preset beside it, and not 2025's xl."""
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _preset_where_renamed
    from cs336_systems.report.answers import edition_rows

    study = pd.DataFrame({"size": ["small", "xl", "2.7B"], "warmup": 0, "status": "ok"})
    shown = _preset_where_renamed(edition_rows(study, "2026"))
    assert list(shown["size"]) == ["small", "xl"] and list(shown["preset"]) == ["small", "2.7B"]
    assert "preset" not in _preset_where_renamed(edition_rows(study, "2025")).columns


def test_the_cold_start_is_given_for_both_passes() -> None:
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _cold_against_warm

    study = pd.DataFrame({"size": ["small", "small"], "warmup": [0, 5], "status": "ok",
                          "forward_mean_ms": [58.0, 19.8], "forward_std_ms": [121.0, 0.36],
                          "backward_mean_ms": [44.4, 38.2], "backward_std_ms": [19.0, 0.11]})
    text = _cold_against_warm(study)
    assert "the forward's mean is 2.93× its mean after 5 warm-up steps" in text  # one size: one value, no range
    assert ", while the backward's cold mean is 1.16× its warm one (the first forward has already set up the CUDA " \
           "context)." in text
    slower = study.assign(backward_mean_ms=[200.0, 38.2])  # the backward hit harder than the forward: no cause given
    assert _cold_against_warm(slower).rstrip().endswith("the backward's cold mean is 5.24× its warm one.")


def test_the_ddp_launches_part_times_the_single_and_torch_steps_in_fresh_launches(tmp_path, monkeypatch) -> None:
    """naive_ddp's processes part alone: every round launches the ranks anew for each model, models alternating;
    the table keeps each launch's rows with its round, the other parts write nothing, and the answer gives the
    spread between launches."""
    from cs336_systems import results
    from cs336_systems.benchmarking import ddp_steps
    from cs336_systems.experiments import get, naive_ddp
    from cs336_systems.experiments.__main__ import writer
    from cs336_systems.report.data import SectionData

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    launches = []

    def run_benchmark(cfg, nproc, backend):
        launches.append((cfg.preset, tuple(cfg.modes), nproc))
        ms = 100.0 + 10 * len(launches)
        return {"rows": [{"variant": v, "mode": v, "bucket_size_mb": 25.0 if v == "torch" else None, "comm_dtype": None,
                          "grad_views": False, "cuda_graph": False, "step_ms": ms, "step_ms_std": 1.0, "preset": cfg.preset,
                          "autocast": cfg.autocast, "context_length": cfg.context_length,
                          "batch_per_rank": cfg.batch_per_rank, "world_size": 1 if v == "single" else nproc}
                         for v in cfg.modes]}

    monkeypatch.setattr(ddp_steps, "run_benchmark", run_benchmark)
    section = get("naive_ddp")
    p = section.params("smoke", {"parts": ["processes"], "process_presets": ["tiny", "small"], "process_rounds": 2})
    section.run(p, writer(section, p, "smoke", publish=True))
    assert launches == [("tiny", ("single", "torch"), 2), ("small", ("single", "torch"), 2),
                        ("small", ("single", "torch"), 2), ("tiny", ("single", "torch"), 2)]
    table = results.load_table("naive_ddp", "step_processes", root=tmp_path)
    assert sorted(table["round"].unique()) == [0, 1] and len(table) == 8
    assert not (tmp_path / "naive_ddp" / "toy_check.csv").exists()
    summary = naive_ddp.between_launches(table)
    tiny = summary[(summary["preset"] == "tiny") & (summary["variant"] == "single")].iloc[0]
    assert (tiny["launches"], tiny["median_ms"], tiny["min_ms"], tiny["max_ms"]) == (2, 125.0, 110.0, 140.0)
    text = naive_ddp._launches(SectionData(tmp_path, "naive_ddp")).plain()
    assert text.startswith("Timed again in 2 fresh launches per model (fp32, 2 GPUs)") and "tiny single 125 ms (110–140)" in text
    with pytest.raises(ValueError, match="unknown part 'launches'"):
        section.params("smoke", {"parts": ["launches"]})
    with pytest.raises(ValueError, match=r"process_modes: unknown \['flatt'\]"):
        section.params("smoke", {"process_modes": ["single", "flatt"]})
