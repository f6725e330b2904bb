"""The torch-native reference LM and the side-by-side training-step benchmark (CPU smoke)."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch
from cs336_basics.model import BasicsTransformerLM

from cs336_systems.benchmarking import train_step
from cs336_systems.benchmarking.torch_native_lm import TorchNativeLM
from cs336_systems.configs import get_config, param_counts


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_reference_has_our_parameter_count(preset: str) -> None:
    cfg = get_config(preset)
    ours = sum(p.numel() for p in BasicsTransformerLM(**cfg.model_kwargs(), device="meta").parameters())
    with torch.device("meta"):
        ref = sum(p.numel() for p in TorchNativeLM.from_config(cfg).parameters())
    assert ref == ours == param_counts(preset)["total"]


def test_reference_is_a_causal_language_model() -> None:
    torch.manual_seed(0)
    model = TorchNativeLM.from_config("tiny", context_length=16)
    tokens = torch.randint(0, get_config("tiny").vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, get_config("tiny").vocab_size) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % get_config("tiny").vocab_size
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])  # the future does not leak back
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    with pytest.raises(ValueError, match="exceeds context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.slow
def test_both_stacks_train_and_are_compared_side_by_side() -> None:
    spec = train_step.StepSpec("tiny", context_length=16, batch_size=2, precision="fp32")
    rows = train_step.compare(spec, rounds=2, steps=2, warmup=1, device=torch.device("cpu"))
    assert list(rows["stack"]) == ["ours", "reference", "reference", "ours"]  # alternating, rotating order
    assert rows["num_params"].nunique() == 1 and (rows["step_ms"] > 0).all()
    table = train_step.summarize(rows, spec, "CPU")
    assert set(table["stack"]) == {"ours", "reference"}
    assert table.loc[table["stack"] == "reference", "vs_reference"].item() == 1.0
    assert math.isnan(table["MFU_pct"].iloc[0])  # no data-sheet peak for a CPU
    h100 = train_step.summarize(rows, spec, "NVIDIA H100 80GB HBM3", "highest")
    assert (h100["MFU_pct"] > 0).all()
    step = train_step.TrainStep("reference", spec, torch.device("cpu"))
    first = step.step().item()
    for _ in range(5):
        last = step.step().item()
    assert last < first  # the reference's fused/foreach AdamW step trains the same batch down


def test_our_fused_head_gives_the_same_loss_without_logits() -> None:
    plain = train_step.TrainStep("ours", train_step.StepSpec("tiny", 16, 2, "fp32"), torch.device("cpu"))
    fused = train_step.TrainStep("ours", train_step.StepSpec("tiny", 16, 2, "fp32", fused_head=True),
                                 torch.device("cpu"))
    torch.testing.assert_close(fused.step(), plain.step())  # same seed and batch: same loss
    torch.testing.assert_close(fused.step(), plain.step(), rtol=1e-4, atol=1e-5)  # and the same update
    cfg = get_config("tiny")
    assert fused.body(fused.inputs).shape[-1] == cfg.d_model  # hidden states: the logits are never formed
    assert plain.body(plain.inputs).shape[-1] == cfg.vocab_size


@pytest.mark.slow
def test_our_fused_projections_train_as_the_unfused_model() -> None:
    cpu = torch.device("cpu")
    plain = train_step.TrainStep("ours", train_step.StepSpec("tiny", 16, 2, "fp32"), cpu)
    fused = train_step.TrainStep("ours", train_step.StepSpec("tiny", 16, 2, "fp32", fused_projections=True,
                                                             checkpoint=(1,)), cpu)
    names = {n for n, _ in fused.model.named_parameters()}
    assert any(n.endswith("qkv_proj.weight") for n in names) and not any(n.endswith("q_proj.weight") for n in names)
    assert fused.num_params == plain.num_params
    for _ in range(3):  # same seed, batch and optimizer: the same losses step after step
        torch.testing.assert_close(fused.step(), plain.step(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.model.state_dict(), plain.model.state_dict(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_one_resident_stack_at_a_time_still_alternates(monkeypatch) -> None:
    spec = train_step.StepSpec("tiny", context_length=16, batch_size=2, precision="fp32")
    built = []
    init = train_step.TrainStep.__init__
    monkeypatch.setattr(train_step.TrainStep, "__init__", lambda self, stack, *a, **k: built.append(stack) or
                        init(self, stack, *a, **k))
    rows = train_step.compare(spec, rounds=3, steps=1, warmup=0, device=torch.device("cpu"), split_steps=1,
                              resident="one")
    assert rows.attrs["resident"] == "one"
    assert built == ["ours", "reference", "ours", "reference"]  # ours | ref, ref | ours, ours | ref: adjacent turns share
    assert list(rows["stack"]) == ["ours", "reference", "reference", "ours", "ours", "reference"]
    assert (rows["step_ms"] > 0).all() and set(rows.attrs["split"]["stack"]) == {"ours", "reference"}
    both = train_step.compare(spec, rounds=1, steps=1, warmup=0, device=torch.device("cpu"))
    assert both.attrs["resident"] == "both"  # auto, on a CPU


def test_residency_follows_the_memory_calculator() -> None:
    h100 = 80 * 2**30
    assert train_step.both_fit(train_step.StepSpec("small", 1024, 8, attention="flash_triton"), h100)
    # xl: 32 GB of weights, gradients and AdamW state per stack; two stacks do not fit in 80 GB
    assert not train_step.both_fit(train_step.StepSpec("xl", 1024, 8, attention="flash_triton"), h100)
    assert train_step.both_fit(train_step.StepSpec("xl", 1024, 8), h100, stacks=1)
    # naive attention saves its score matrices: medium at 4096 tokens of context no longer fits twice
    assert train_step.both_fit(train_step.StepSpec("medium", 4096, 2, attention="sdpa"), h100)
    assert not train_step.both_fit(train_step.StepSpec("medium", 4096, 2, attention="naive"), h100)


def test_bad_arguments_fail_in_one_line() -> None:
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        train_step.StepSpec(attention="nope").check()
    with pytest.raises(ValueError, match="optimizer must be 'flat'"):
        train_step.StepSpec(optimizer="sgd").check()
    with pytest.raises(ValueError, match="reference_sdpa must be one of"):
        train_step.StepSpec(reference_sdpa="fast").check()
    with pytest.raises(ValueError, match="reference_sdpa 'cudnn' has no float32 kernel"):
        train_step.StepSpec(precision="fp32", reference_sdpa="cudnn").check()
    assert train_step.StepSpec(precision="fp32").reference_backend == "efficient"
    assert train_step.StepSpec(precision="bf16").reference_backend == "cudnn"
    with pytest.raises(ValueError, match="compile_mode must be one of default, reduce-overhead"):
        train_step.StepSpec(compile_mode="fastest").check()
    with pytest.raises(ValueError, match="unknown stack 'theirs'"):
        train_step.TrainStep("theirs", train_step.StepSpec("tiny"), torch.device("cpu"))
    with pytest.raises(ValueError, match="resident must be one of auto, both, one"):
        train_step.compare(train_step.StepSpec("tiny", 16, 2, "fp32"), resident="all", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="need rounds >= 1"):
        train_step.compare(train_step.StepSpec("tiny", 16, 2, "fp32"), rounds=0, device=torch.device("cpu"))


def test_optimizer_step_benchmark_runs_and_reports_the_floor() -> None:
    from cs336_systems.benchmarking import optimizer_step

    table = optimizer_step.measure("tiny", ("flat", "basics", "torch_fused"), rounds=1, steps=1,
                                   device=torch.device("cpu"))
    assert list(table["optimizer"]) == ["flat", "basics"]  # torch's fused kernel needs CUDA
    assert (table["params"] == param_counts("tiny")["total"]).all() and (table["GB_per_s"] > 0).all()
    assert table["floor_ms"].isna().all()  # no data-sheet bandwidth for a CPU
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        optimizer_step.measure("tiny", ("sgd",), device=torch.device("cpu"))


def test_bisection_finds_the_boundary() -> None:
    from cs336_systems.benchmarking.max_context import bisect_longest

    best, tried = bisect_longest(lambda c: c <= 5000, 256, 131072, 256)
    assert best == 4864 and tried[:2] == [256, 131072] and len(tried) <= 12
    assert bisect_longest(lambda c: True, 256, 1024, 256) == (1024, [256, 1024])
    assert bisect_longest(lambda c: False, 256, 1024, 256) == (None, [256])
    with pytest.raises(ValueError, match="need 1 <= granularity <= low <= high"):
        bisect_longest(lambda c: True, 100, 50, 10)


@pytest.mark.slow
def test_longest_context_search_runs_our_step_with_checkpointing() -> None:
    from cs336_systems.benchmarking.max_context import longest_contexts

    base = train_step.StepSpec(batch_size=1, precision="fp32", checkpoint=(1,))
    table = longest_contexts(["tiny"], base, low=16, high=32, granularity=16, device=torch.device("cpu"))
    assert list(table["context_length"]) == [16, 32] and table["fits"].all() and (table["longest"] == 32).all()


@pytest.mark.slow
def test_a_preset_measured_in_two_runs_combines_only_at_one_commit(tmp_path, monkeypatch) -> None:
    from cs336_systems import results
    from cs336_systems.experiments import get, training_step
    from cs336_systems.experiments.__main__ import writer

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setattr(results, "git_commit", lambda: "a" * 40)
    section = get("training_step")
    base = {"presets": ["tiny"], "split_steps": 0, "longest.presets": []}

    def measure(contexts: list[int]) -> list[int]:
        p = section.params("smoke", {**base, "contexts": contexts})
        training_step.run(p, writer(section, p, "smoke", publish=True))
        return list(results.load_table("training_step", "steps_tiny", root=tmp_path)["context_length"])

    assert measure([32]) == [32]
    assert measure([16]) == [16, 32]  # same commit and settings: the other context's row stays
    assert measure([16]) == [16, 32]  # a context measured again replaces its row
    monkeypatch.setattr(results, "git_commit", lambda: "b" * 40)
    assert measure([16]) == [16]  # other code: the table starts over
    base["rounds"] = 2
    assert measure([32]) == [32]  # other settings: likewise
    monkeypatch.setattr(results, "git_commit", lambda: "c" * 40)
    sweep = training_step.run_sweep

    def job_beside(*args, **kwargs):  # another job of the preset writes its row while this one measures
        monkeypatch.setattr(training_step, "run_sweep", sweep)
        measure([16])
        return sweep(*args, **kwargs)

    monkeypatch.setattr(training_step, "run_sweep", job_beside)
    assert measure([32]) == [16, 32]  # two jobs side by side on one host keep each other's rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_split_on_a_gpu_partitions_the_step() -> None:
    """Each stack's optimizer kernels land in the optimizer bucket, and no kernel is counted twice: the kernel
    buckets add up to at most the measured step."""
    device = torch.device("cuda")
    spec = train_step.StepSpec("small", 256, 2, "bf16")
    for stack in train_step.STACKS:
        run = train_step.TrainStep(stack, spec, device)
        for _ in range(2):
            run.step()
        split = run.time_split(3).set_index("bucket")["ms_per_step"]
        step_ms = run.time_ms(3)
        # AdamW over small's 128 M fp32 parameters moves about 3.6 GB: over 0.5 ms on any current GPU
        assert split["optimizer"] > 0.5, (stack, split.to_dict())
        assert split.drop("host / idle").sum() <= 1.1 * step_ms, (stack, split.to_dict(), step_ms)
        del run


def test_matmul_ceiling_is_measured_and_gives_a_second_mfu() -> None:
    from cs336_systems.benchmarking import matmul_ceiling

    table = matmul_ceiling.measure("fp32", (32, 64), torch.device("cpu"))
    assert list(table["n"]) == [32, 64] and (table["TFLOP_per_s"] > 0).all()
    ceiling = matmul_ceiling.ceiling_tflops(table)
    assert ceiling == table["TFLOP_per_s"].max()
    spec = train_step.StepSpec("tiny", context_length=16, batch_size=2, precision="fp32")
    rows = train_step.compare(spec, rounds=1, steps=1, warmup=0, device=torch.device("cpu"))
    out = train_step.summarize(rows, spec, "CPU", ceiling_tflops=2.0)
    assert (out["MFU_of_ceiling_pct"] == 100 * out["TFLOP_per_s"] / 2.0).all()
    assert "MFU_of_ceiling_pct" not in train_step.summarize(rows, spec, "CPU")
    with pytest.raises(ValueError, match="dtype must be one of"):
        matmul_ceiling.measure("int8", (32,))


def test_time_split_answer_names_the_buckets_where_our_step_loses():
    from cs336_systems.experiments.training_step import _split_text, split_by_bucket

    rows = []
    for preset, extra in (("small", 5.0), ("xl", 10.0)):
        for stack, elementwise, optimizer in (("ours", 6.0 + extra, 1.0), ("reference", 6.0, 2.0)):
            for bucket, ms in (("matmul", 8.0), ("norms & elementwise", elementwise), ("optimizer", optimizer),
                               ("host / idle", 1.0 + (0.5 if stack == "ours" else 0.0))):
                rows.append({"bucket": bucket, "ms_per_step": ms, "share": 0.0, "stack": stack,
                             "preset": preset, "context_length": 1024})
    split = pd.DataFrame(rows)
    wide = split_by_bucket(split)
    assert len(wide) == 4 and {"matmul", "optimizer"} <= set(wide.columns)
    text = _split_text(split).markdown
    # 15 ms of the 16 ms gap is elementwise, 1 ms host; our optimizer is 1 ms faster per step.
    assert "93.8% lies in norms & elementwise and 6.25% in host / idle" in text
    assert "5.00 ms–10.0 ms per step more" in text and "ours is faster in optimizer (by 1.00 ms a step" in text
    assert "Matmuls differ by 0" in text and "fuses the Q, K, V" not in text
    assert _split_text(split[split["stack"] == "ours"]) is None
    assert text.startswith("Of the time by which our step trails the reference")
    # a step faster overall that still spends more in some buckets says so instead of "trails"
    faster = split.assign(ms_per_step=split["ms_per_step"].where(
        (split["stack"] != "reference") | (split["bucket"] != "optimizer"), 30.0))
    text = _split_text(faster).markdown
    assert text.startswith("Our step is the faster one overall;") and "trails" not in text
    assert "93.8% lies in norms & elementwise" in text
    # when the GEMMs do hold part of the gap, the answer says why instead of clearing them
    slower = split.assign(ms_per_step=split["ms_per_step"].where(
        (split["stack"] != "ours") | (split["bucket"] != "matmul"), 12.0))
    text = _split_text(slower).markdown
    assert "Matmuls differ" not in text and "fuses the Q, K, V projections" in text and "off" in text
    fused = _split_text(slower, {"fused_projections": True}).markdown
    assert "Both models run Q, K, V as one GEMM" in fused and "fuses the Q, K, V" not in fused
    # a bucket we lose overall but win in one cell reads as a range from less to more, not a negative "more"
    mixed = split.assign(ms_per_step=split["ms_per_step"].where(
        (split["stack"] != "ours") | (split["bucket"] != "norms & elementwise") | (split["preset"] != "small"),
        5.5))
    assert "from 0.500 ms per step less to 10.0 ms more, by cell" in _split_text(mixed).markdown


@pytest.mark.slow
@pytest.mark.parametrize("stack", train_step.STACKS)
def test_compiled_model_and_loss_match_the_eager_step(stack: str) -> None:
    spec = train_step.StepSpec("tiny", context_length=16, batch_size=2, precision="fp32")
    eager = train_step.TrainStep(stack, spec, torch.device("cpu"))
    compiled = train_step.TrainStep(stack, dataclasses.replace(spec, compile=True), torch.device("cpu"))
    assert compiled.forward_loss is not compiled._forward_loss  # the loss is inside the compiled region
    for _ in range(2):  # same seed and batch: the same losses, so the same updates in between
        torch.testing.assert_close(compiled.step(), eager.step(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_steps_train_as_the_plain_compiled_ones() -> None:
    device = torch.device("cuda")
    spec = train_step.StepSpec("tiny", 64, 2, "bf16", compile=True, attention="flash_triton")
    plain = train_step.TrainStep("ours", spec, device)
    graphs = train_step.TrainStep("ours", dataclasses.replace(spec, compile_mode="reduce-overhead"), device)
    assert graphs.cuda_graphs and not plain.cuda_graphs
    for _ in range(4):  # warm-up, recording, then replays: each returns its own step's loss
        torch.testing.assert_close(graphs.step(), plain.step(), rtol=2e-2, atol=2e-2)


def test_steps_answer_calls_a_difference_within_the_spread_no_difference() -> None:
    from cs336_systems.experiments.training_step import _ties_text

    steps = pd.DataFrame({"preset": ["small", "xl"], "context_length": [1024, 4096],
                          "ours_step_ms": [20.0, 270.0], "reference_step_ms": [18.0, 269.0],
                          "ours_spread_ms": [0.5, 2.0], "reference_spread_ms": [0.4, 0.3]})
    assert _ties_text(steps) == (" In 1 of the 2 cells (xl at 4096) the two differ by less than the spread of "
                                 "their rounds: no difference.")
    assert _ties_text(steps.assign(ours_spread_ms=[0.5, 0.5])) == ""


def test_the_baseline_is_our_model_as_it_started_at_the_same_cell() -> None:
    spec = train_step.StepSpec("small", 4096, 2, "bf16", compile=True, compile_mode="reduce-overhead",
                               attention="flash_triton", optimizer="flat", checkpoint=(4,), fused_head=True)
    before = train_step.baseline_spec(spec)
    assert (before.preset, before.context_length, before.batch_size, before.precision) == ("small", 4096, 2, "bf16")
    assert (before.compile, before.attention, before.optimizer, before.checkpoint, before.fused_head) == (
        False, "sdpa", "basics", (), False)


@pytest.mark.slow
def test_measure_alone_times_rounds_and_reports_running_out_of_memory(monkeypatch) -> None:
    spec = train_step.StepSpec("tiny", context_length=16, batch_size=2, precision="fp32")
    rows = train_step.measure_alone(spec, rounds=2, steps=1, warmup=1, device=torch.device("cpu"), split_steps=1)
    assert list(rows["round"]) == [0, 1] and set(rows["stack"]) == {"baseline"} and (rows["step_ms"] > 0).all()
    assert rows.attrs["status"] == "ok" and set(rows.attrs["split"]["stack"]) == {"baseline"}

    def too_big(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_step.TrainStep, "__init__", too_big)
    oom = train_step.measure_alone(spec, rounds=2, steps=1, warmup=0, device=torch.device("cpu"))
    assert oom.empty and oom.attrs["status"] == "OOM" and "split" not in oom.attrs
    monkeypatch.setattr(train_step.TrainStep, "__init__", lambda self, *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # any other failure is a failure
        train_step.measure_alone(spec, rounds=1, steps=1, warmup=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="rounds >= 1"):
        train_step.measure_alone(spec, rounds=0)


@pytest.mark.slow
def test_each_cell_times_and_profiles_the_baseline_and_the_answer_compares_before_and_after(tmp_path,
                                                                                            monkeypatch) -> None:
    from cs336_systems import results
    from cs336_systems.experiments import get, training_step
    from cs336_systems.experiments.__main__ import writer

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    section = get("training_step")
    p = section.params("smoke", {"presets": ["tiny"], "contexts": [16], "longest.presets": []})
    assert p.baseline and p.split_steps
    training_step.run(p, writer(section, p, "smoke", publish=True))
    steps = results.load_table("training_step", "steps_tiny", root=tmp_path)
    assert steps.loc[0, "baseline_status"] == "ok" and steps.loc[0, "baseline_step_ms"] > 0
    split = results.load_table("training_step", "time_split_tiny", root=tmp_path)
    assert set(split["stack"]) == {"ours", "reference", "baseline"}
    # a baseline that runs out of memory is a status; the pair's numbers stay numbers
    def no_room(*args, **kwargs) -> pd.DataFrame:
        frame = pd.DataFrame(columns=["round", "stack", "step_ms", "num_params"])
        frame.attrs["status"] = "OOM"
        return frame

    monkeypatch.setattr(train_step, "measure_alone", no_room)
    training_step.run(p, writer(section, p, "smoke", publish=True))
    steps = results.load_table("training_step", "steps_tiny", root=tmp_path)
    assert steps.loc[0, "baseline_status"] == "OOM" and pd.isna(steps.loc[0].get("baseline_step_ms"))
    assert steps["ours_step_ms"].dtype.kind == "f" and steps.loc[0, "ours_step_ms"] > 0
    # the answer: the speed-up over the baseline and the buckets it came from (synthetic numbers)
    row = {"preset": "xl", "context_length": 1024, "ours_step_ms": 100.0, "baseline_step_ms": 250.0,
           "baseline_MFU_pct": 17.5, "baseline_status": "ok"}
    oom = {**row, "preset": "2.7B", "baseline_step_ms": float("nan"), "baseline_MFU_pct": float("nan"),
           "baseline_status": "OOM"}
    buckets = [{"preset": "xl", "context_length": 1024, "stack": stack, "bucket": b, "ms_per_step": ms, "share": 0.0}
               for stack, ms_by in (("baseline", (80.0, 60.0, 60.0)), ("ours", (70.0, 20.0, 10.0)),
                                     ("reference", (70.0, 20.0, 9.0)))
               for b, ms in zip(("matmul", "attention", "optimizer"), ms_by)]
    text = training_step._before_text(pd.DataFrame([row, oom]), pd.DataFrame(buckets)).markdown
    assert "our step is 2.50×–2.50× as fast" in text and "17.5–17.5% MFU" in text
    assert "40.0% came from attention, 50.0% came from optimizer" not in text  # ordered by size
    assert "50.0% came from optimizer, 40.0% came from attention and 10.0% came from matmul" in text
    assert "does not fit at 2.7B at 1024 (out of memory)" in text
    assert training_step._before_text(pd.DataFrame([{"ours_step_ms": 1.0}]), None) is None


def test_longest_context_searches_of_several_jobs_combine_by_preset(tmp_path, monkeypatch) -> None:
    from cs336_systems import results
    from cs336_systems.benchmarking import max_context
    from cs336_systems.experiments import get, training_step
    from cs336_systems.experiments.__main__ import writer

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setattr(results, "git_commit", lambda: "c" * 40)
    searched: list[str] = []

    def stand_in(presets, base, **kwargs):
        searched.extend(presets)
        return pd.DataFrame([{"preset": pr, "context_length": 64, "fits": True, "peak_GiB": 1.0, "longest": 64}
                             for pr in presets])

    monkeypatch.setattr(max_context, "longest_contexts", stand_in)
    section = get("training_step")

    def search(presets: list[str], **extra) -> list[str]:
        p = section.params("smoke", {"presets": [], "longest.presets": presets, **extra})
        training_step.run(p, writer(section, p, "smoke", publish=True))
        return list(results.load_table("training_step", "longest_context", root=tmp_path)["preset"])

    assert search(["xl"]) == ["xl"]
    assert search(["small", "tiny"]) == ["tiny", "small", "xl"]  # combined, in the presets' order
    assert searched == ["xl", "small", "tiny"]  # one preset at a time
    assert search(["small"]) == ["tiny", "small", "xl"]  # searched again: its rows replaced
    assert search(["small"], **{"longest.high": 64}) == ["small"]  # another setting: starts over


def test_longest_answer_gives_peak_memory_and_says_at_least_where_the_search_stopped() -> None:
    from cs336_systems.experiments import training_step

    rows = pd.DataFrame([
        {"preset": "small", "context_length": 256, "fits": True, "peak_GiB": 2.0, "longest": 1024},
        {"preset": "small", "context_length": 1024, "fits": True, "peak_GiB": 9.5, "longest": 1024},
        {"preset": "xl", "context_length": 256, "fits": True, "peak_GiB": 30.0, "longest": 512},
        {"preset": "xl", "context_length": 1024, "fits": False, "peak_GiB": float("nan"), "longest": 512},
        {"preset": "xl", "context_length": 512, "fits": True, "peak_GiB": 41.25, "longest": 512},
        {"preset": "2.7B", "context_length": 256, "fits": False, "peak_GiB": float("nan"), "longest": float("nan")},
    ])
    text = training_step._longest_text(rows, {"longest": {"high": 1024, "checkpoint": [4]},
                                              "attention": "flash_triton"}).markdown
    flat = training_step._longest_text(rows, {"longest_high": 1024, "longest_checkpoint": [4],
                                              "attention": "flash_triton"}).markdown
    assert flat == text  # records from before the parameter groups read the same
    assert "small at least 1,024 (9.5 GiB peak)" in text and "xl 512 (41.2 GiB peak)" in text
    assert "2.7B none" in text and "segments of 4 blocks" in text
    assert "so small may train at longer contexts" in text
    # searched past every preset's limit: no "at least", no note
    text = training_step._longest_text(rows, {"longest": {"high": 4096}}).markdown
    assert "at least" not in text and "longest.high" not in text
    assert training_step._longest_text(None, {}) is None
    # the writeup's table: each preset's longest fit and shortest failure, in context order
    edge = training_step._boundary(rows)
    assert list(zip(edge["preset"], edge["context_length"], edge["fits"])) == [
        ("small", 1024, True), ("xl", 512, True), ("xl", 1024, False), ("2.7B", 256, False)]
    assert "longest" not in edge.columns and training_step._boundary(None) is None


def test_steps_answer_names_the_slowest_cell_and_the_fastest_or_closest(tmp_path) -> None:
    import json

    from cs336_systems.experiments import training_step
    from cs336_systems.report.data import SectionData
    from cs336_systems.report.document import Text

    folder = tmp_path / "training_step"
    folder.mkdir()

    def first_sentence(ours: list[float]) -> str:
        rows = [{"preset": pr, "context_length": 1024, "batch_size": 8, "status": "ok", "ours_step_ms": o,
                 "reference_step_ms": 10.0, "ours_spread_ms": 0.01, "reference_spread_ms": 0.01,
                 "ours_MFU_pct": 40.0, "reference_MFU_pct": 41.0} for pr, o in zip(("small", "xl"), ours)]
        pd.DataFrame(rows).to_csv(folder / "steps.csv", index=False)
        (folder / "steps.meta.json").write_text(json.dumps({"params": {"compile": False}}))
        blocks = training_step.answer(SectionData(tmp_path, "training_step"))[0].blocks
        return next(b.plain() for b in blocks if isinstance(b, Text) and "Ours runs at" in b.plain())

    assert "small at 1024 the slowest, xl at 1024 the fastest)" in first_sentence([11.0, 9.0])
    assert "small at 1024 the slowest, xl at 1024 the closest), behind it in every cell" in first_sentence([12.0, 11.0])


def test_packed_attention_is_on_by_default_and_the_flag_turns_it_off() -> None:
    """``--fused-projections`` with flash_triton attends over the packed QKV output unless
    ``--no-packed-attention`` asks for split heads (the A/B of docs/training_step/NOTES.md)."""
    import argparse

    def spec_of(*flags: str) -> train_step.StepSpec:
        parser = argparse.ArgumentParser()
        train_step.add_step_arguments(parser)
        return train_step.step_from_args(parser.parse_args(["--preset", "tiny", *flags]))[0]

    assert spec_of("--fused-projections").packed_attention
    split = spec_of("--fused-projections", "--attention", "flash_triton", "--no-packed-attention")
    assert not split.packed_attention
    built = train_step.TrainStep("ours", dataclasses.replace(split, context_length=16, batch_size=2, precision="fp32"),
                                 torch.device("cpu"))
    assert not any(getattr(m, "packed", False) for m in built.model.modules())
    packed = train_step.TrainStep("ours", dataclasses.replace(split, context_length=16, batch_size=2,
                                                              precision="fp32", packed_attention=True),
                                  torch.device("cpu"))
    assert all(layer.attn.packed for layer in packed.model.layers)
