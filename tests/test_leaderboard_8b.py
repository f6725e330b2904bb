"""The 2026 leaderboard harness: the full shape's memory plan and the step at a tiny shape (CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cs336_systems.benchmarking import leaderboard_8b as lb
from cs336_systems.configs import param_counts

TINY = lb.LeaderboardShape(context_length=16, vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4,
                           batch_size=2)


def test_memory_plan_of_the_full_shape_says_what_it_takes_to_fit() -> None:
    plan = lb.memory_plan(lb.LeaderboardShape(), gpus=2, gpu_gb=180.0)
    assert plan.attrs["params"] == param_counts(lb.LeaderboardShape().config())["total"]
    assert 8.0e9 < plan.attrs["params"] < 8.3e9  # "an 8B model"
    assert (plan["total_GB"].diff().dropna() < 0).all()  # every measure saves memory
    assert not plan["fits"].iloc[:-1].any() and plan["fits"].iloc[-1]  # only the last row fits
    k = plan.attrs["checkpointed_blocks"]
    assert 0 < k < 34 and plan["measure"].iloc[-1] == f"+ checkpoint {k} of 34 blocks"
    # bf16 weights + gradients + two AdamW moments: 8 bytes per parameter, halved by FSDP over two GPUs
    one_gpu = plan.iloc[0][["weights_GB", "gradients_GB", "adamw_moments_GB"]].sum()
    assert one_gpu == pytest.approx(8 * plan.attrs["params"] / 1e9)
    roomy = lb.memory_plan(lb.LeaderboardShape(), gpus=8, gpu_gb=1000.0)
    assert roomy["fits"].iloc[-1] and not roomy["measure"].str.contains("checkpoint").any()
    tight = lb.memory_plan(lb.LeaderboardShape(), gpus=2, gpu_gb=10.0)
    assert "still does not fit" in tight["measure"].iloc[-1] and not tight["fits"].any()
    with pytest.raises(ValueError, match="need gpus >= 1"):
        lb.memory_plan(gpus=0)


def test_the_step_trains_and_the_fused_head_gives_the_same_loss() -> None:
    cpu = torch.device("cpu")
    fused = lb.build_step(TINY, lb.StepOptions(attention="sdpa", fused_head=True), cpu)
    plain = lb.build_step(TINY, lb.StepOptions(attention="sdpa", fused_head=False), cpu)
    first_fused, first_plain = fused().item(), plain().item()
    assert first_fused == pytest.approx(first_plain, rel=2e-2)  # same seed, same model; bf16 logits
    assert next(fused.model.parameters()).dtype == torch.bfloat16
    losses = [fused().item() for _ in range(4)]
    assert losses[-1] < first_fused  # AdamW trains the one batch down
    result = lb.time_step(TINY, lb.StepOptions(attention="sdpa", checkpoint=(1,), optimizer="basics"), cpu,
                          warmup_ms=0, rep_ms=1000)
    assert result["step_ms"] > 0 and result["within_10_min"]
    assert result["params"] == param_counts(TINY.config())["total"]


def test_bad_options_fail_in_one_line(capsys) -> None:
    with pytest.raises(ValueError, match="optimizer must be one of"):
        lb.StepOptions(optimizer="sgd").check()
    with pytest.raises(ValueError, match="unknown attention"):
        lb.StepOptions(attention="nope").check()
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        lb.LeaderboardShape(d_model=4100).config()
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):  # exit 2, one line, via run_main
        lb.main(["--layers", "0"])


def test_the_leaderboard_section_writes_the_plan_and_the_timed_step(tmp_path, monkeypatch) -> None:
    """§1.5 as a unit: the full shape's plan and a step at the smoke shape, each a result the writeup reads."""
    import json

    import pandas as pd

    from cs336_systems.experiments import get
    from cs336_systems.experiments.__main__ import main
    from cs336_systems.experiments.leaderboard import _plan_sentence, _step_sentence

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert main(["leaderboard", "--smoke"]) == 0
    folder = tmp_path / "leaderboard"
    plan = pd.read_csv(folder / "memory_plan.csv")
    assert plan["fits"].tolist() == lb.memory_plan(lb.LeaderboardShape())["fits"].tolist()  # always the full shape
    step = pd.read_csv(folder / "step.csv")
    assert step.loc[0, "status"] == "ok" and step.loc[0, "step_ms"] > 0 and bool(step.loc[0, "within_10_min"])
    assert step.loc[0, "shape"] == "2 layers, context 16, batch 2"
    meta = json.loads((folder / "step.meta.json").read_text())
    assert meta["extra"]["options"]["checkpoint"] == [1] and meta["extra"]["shape"]["num_layers"] == 2
    text = _plan_sentence(plan, json.loads((folder / "memory_plan.meta.json").read_text())).markdown
    k = plan["measure"].iloc[-1].removeprefix("+ ")
    assert "The full shape has 8.13 B parameters" in text and f"FSDP, and {k} (" in text
    said = _step_sentence(step, meta).markdown
    assert "at 2 layers, context 16, batch 2" in said and "within the 10-minute rule" in said
    oom = step.assign(status="OOM")
    assert _step_sentence(oom, meta).markdown == "The reduced step did not run: OOM."
    with pytest.raises(ValueError, match="optimizer must be one of"):
        get("leaderboard").params("full", {"optimizer": "sgd"})
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        get("leaderboard").params("full", {"d_model": 4100})


def _two_rank_losses(fused: bool) -> list[float]:
    step = lb.build_step(TINY, lb.StepOptions(attention="sdpa", fused_head=fused, checkpoint=(1,)), torch.device("cpu"))
    return [step().item() for _ in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_the_two_rank_step_is_the_one_gpu_step_under_fsdp(fused: bool) -> None:
    """Each rank trains its half of the batch under FSDP (every block checkpointed); the ranks' first losses
    average to the one-process loss of the whole batch, and the step trains."""
    from cs336_systems.distributed.launch import spawn

    ranks = spawn(_two_rank_losses, 2, fused, backend="gloo", timeout_s=120)
    single = lb.build_step(TINY, lb.StepOptions(attention="sdpa", fused_head=fused, checkpoint=(1,)),
                           torch.device("cpu"))().item()
    first = sum(r[0] for r in ranks) / 2  # both losses are means over a rank's tokens: the halves average
    assert first == pytest.approx(single, rel=2e-2)
    assert all(r[-1] < r[0] for r in ranks)


def test_the_step_on_two_ranks_is_timed_with_agreed_counts() -> None:
    result = lb.time_step_on_ranks(TINY, lb.StepOptions(attention="sdpa", checkpoint=(1,)), 2, warmup_ms=0,
                                   rep_ms=200)
    assert result["gpus"] == 2 and result["step_ms"] > 0 and result["within_10_min"] and result["empty_caches"]
    assert result["params"] == param_counts(TINY.config())["total"]
    with pytest.raises(ValueError, match="needs nproc >= 2"):
        lb.time_step_on_ranks(TINY, lb.StepOptions(attention="sdpa"), 1)


def _odd_batch() -> None:
    lb.build_step(lb.LeaderboardShape(**{**TINY.__dict__, "batch_size": 3}), lb.StepOptions(attention="sdpa"),
                  torch.device("cpu"))


def test_a_batch_that_does_not_split_over_the_ranks_is_refused() -> None:
    from cs336_systems.distributed.launch import spawn

    with pytest.raises(Exception, match="batch 3 does not split over 2 ranks"):
        spawn(_odd_batch, 2, backend="gloo", timeout_s=60)


def test_the_plan_leaves_headroom_and_chooses_how_many_blocks_to_checkpoint() -> None:
    full = lb.LeaderboardShape()
    plan = lb.memory_plan(full, gpus=2, gpu_gb=141.0)
    k = plan.attrs["checkpointed_blocks"]
    assert plan.attrs["headroom_gb"] == lb.HEADROOM_GB and plan["total_GB"].iloc[-1] <= 141.0 - lb.HEADROOM_GB
    # k is the fewest: with k - 1 blocks checkpointed the step would not leave the headroom free
    row = plan.iloc[-1]
    per_block = (plan.iloc[-2]["activations_GB"] - row["activations_GB"]) / k  # each checkpointed block's saving
    assert row["total_GB"] + per_block > 141.0 - lb.HEADROOM_GB
    without = lb.memory_plan(full, gpus=2, gpu_gb=141.0, headroom_gb=0.0)
    assert without.attrs["checkpointed_blocks"] <= k  # the headroom costs recomputation, never saves it
    assert lb.checkpoint_blocks("plan", plan) == k and lb.checkpoint_blocks("all", plan) is None
    assert lb.checkpoint_blocks("5", plan) == 5
    with pytest.raises(ValueError, match="checkpoint blocks are all, plan or a number, got 'most'"):
        lb.checkpoint_blocks("most", plan)
    with pytest.raises(ValueError, match="0 <= headroom_gb < gpu_gb"):
        lb.memory_plan(full, gpu_gb=8.0, headroom_gb=8.0)
    with pytest.raises(ValueError, match="checkpoint_blocks needs checkpoint levels"):
        lb.StepOptions(checkpoint_blocks=3).check()


def test_the_step_checkpoints_only_the_blocks_it_is_told_to() -> None:
    cpu = torch.device("cpu")
    step = lb.build_step(TINY, lb.StepOptions(attention="sdpa", checkpoint=(1,), checkpoint_blocks=1), cpu)
    assert "first 1 of 2 blocks" in repr(step.model.layers)
    assert torch.isfinite(step())


def _losses_of_each_stack(options: list[lb.StepOptions]) -> list[list[float]]:
    runs = []
    for o in options:
        step = lb.build_step(TINY, o, torch.device("cpu"))
        runs.append([step().item() for _ in range(3)])
        if o.compile:  # FSDP2 wraps each block; compile() gave it a compiled call
            assert all(b._compiled_call_impl is not None for b in step.model.lm.layers.children())
    return runs


@pytest.mark.slow
def test_the_fsdp2_reference_trains_the_same_model_as_our_fsdp() -> None:
    """Under FSDP2 the step is our FSDP's to the last bit (same shards of the batch, same bf16 math); the
    reference (SDPA, every block compiled: traced and differentiated by ``aot_eager`` here, which generates no
    kernels, so a CPU with a cold compile cache runs it in seconds) stays within bf16 rounding of it."""
    from cs336_systems.distributed.launch import spawn

    ours = lb.StepOptions(attention="sdpa", checkpoint=(1,), checkpoint_blocks=1)
    reference = replace(ours.reference(), compile_backend="aot_eager")
    ranks = spawn(_losses_of_each_stack, 2, [ours, replace(ours, stack="fsdp2"), reference],
                  backend="gloo", timeout_s=300)
    for ours_losses, fsdp2, reference in ranks:
        assert fsdp2 == ours_losses
        assert reference == pytest.approx(ours_losses, rel=1e-2)
        assert reference[-1] < reference[0]


def test_the_reference_is_the_same_step_on_torch_parts_and_bad_stacks_fail_in_one_line() -> None:
    ours = lb.StepOptions(checkpoint=(1,), checkpoint_blocks=20)
    ref = ours.reference()
    assert (ref.stack, ref.attention, ref.optimizer, ref.compile) == ("fsdp2", "sdpa", "torch_fused", True)
    assert (ref.checkpoint, ref.checkpoint_blocks, ref.fused_head) == (ours.checkpoint, 20, True)
    with pytest.raises(ValueError, match="unknown torch.compile backend 'tvm2'"):
        lb.StepOptions(compile=True, compile_backend="tvm2").check()
    with pytest.raises(ValueError, match="stack must be one of ours, fsdp2, got 'ddp'"):
        lb.StepOptions(stack="ddp").check()
    with pytest.raises(ValueError, match="--stack fsdp2 shards over ranks"):
        lb.build_step(TINY, lb.StepOptions(attention="sdpa", stack="fsdp2"), torch.device("cpu"))
    with pytest.raises(ValueError, match="--stack fsdp2 shards over ranks"):
        lb.main(["--layers", "2", "--context", "16", "--reference", "--attention", "sdpa"])


def test_the_answer_compares_our_step_with_the_reference_within_the_spread() -> None:
    import pandas as pd

    from cs336_systems.experiments.leaderboard import _reference_sentence

    table = pd.DataFrame({"stack": ["ours", "torch reference"], "status": ["ok", "ok"],
                          "step_ms": [5000.0, 6000.0], "step_spread_ms": [20.0, 30.0]})
    meta = {"extra": {"reference_options": {"compile": True}}}
    said = _reference_sentence(table, meta, table.iloc[0])
    assert "took 6,000 ms: ours is 17% faster (1.20× its speed), beyond the steps' summed spread of ±50.0 ms" in said
    assert "every block compiled" in said and "It is a yardstick, not an entry" in said
    close = table.assign(step_ms=[5000.0, 5030.0])
    assert "no difference" in _reference_sentence(close, meta, close.iloc[0])
    unknown = table.assign(step_spread_ms=[float("nan"), float("nan")])  # a run that recorded no spread
    assert "nan" not in _reference_sentence(unknown, meta, unknown.iloc[0])
    failed = table.assign(status=["ok", "OOM"])
    assert _reference_sentence(failed, meta, failed.iloc[0]).endswith("did not run: OOM.")
    assert "was not run" in _reference_sentence(table.iloc[:1], meta, table.iloc[0])


def test_the_time_split_tool_refuses_what_it_cannot_split_in_one_line() -> None:
    from cs336_systems.benchmarking import leaderboard_split as split

    for argv, message in [(["--stacks", "ours,ddp"], "--stacks takes ours, reference, got 'ours,ddp'"),
                          (["--nproc", "1"], "--nproc must be >= 2, got 1"),
                          (["--checkpoint-blocks", "plan"], "--checkpoint-blocks takes all or a number here"),
                          (["--layers", "0"], "num_layers must be a positive integer")]:
        with pytest.raises(ValueError, match=message):
            split.main(argv)
    with pytest.raises(ValueError, match="run it on a GPU"):
        split.profile_split(TINY, lb.StepOptions(attention="sdpa"), torch.device("cpu"))


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_time_split_of_a_small_step_on_two_gpus_covers_its_window(tmp_path) -> None:
    """Two GPUs, 2 layers at context 4096, ours with its pointwise parts compiled: every bucket is non-negative,
    the shares cover the profiled window, and the checkpointed blocks' replay counts as recomputation."""
    from cs336_systems.benchmarking import leaderboard_split as split

    assert split.main(["--layers", "2", "--context", "4096", "--steps", "1", "--warmup", "1", "--compile-pointwise",
                       "--out", str(tmp_path)]) == 0
    import pandas as pd

    table = pd.read_csv(tmp_path / "time_split.csv")
    assert set(table["stack"]) == {"ours", "reference"} and set(table["rank"]) == {0, 1}
    assert (table["ms_per_step"] >= 0).all()
    for _, one in table.groupby(["stack", "rank"]):
        assert one["share"].sum() == pytest.approx(1.0, abs=0.05)  # compute on one stream: buckets tile the window
    recomputed = table[(table["bucket"] == "recomputation") & (table["stack"] == "ours")]["ms_per_step"]
    assert len(recomputed) == 2 and (recomputed > 0).all()
    assert (tmp_path / "time_split.png").stat().st_size > 0


def test_spawned_ranks_compile_into_empty_caches_and_the_answer_says_so(monkeypatch) -> None:
    import os

    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with lb.empty_compile_caches() as emptied:
        folders = [os.environ[name] for name in lb.CACHE_VARIABLES]
        assert emptied and all(os.path.basename(f) in ("triton_cache_dir", "torchinductor_cache_dir") for f in folders)
        assert not any(os.path.exists(f) and os.listdir(f) for f in folders)
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with lb.empty_compile_caches(False) as emptied:
        assert not emptied and os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"


def test_the_time_split_sentence_names_the_largest_work_and_the_waits() -> None:
    import pandas as pd

    from cs336_systems.experiments.leaderboard import _split_sentence

    rows = [("ours", 0, "matmul", 3000.0), ("ours", 0, "attention", 2000.0), ("ours", 0, "optimizer", 100.0),
            ("ours", 0, "norms & elementwise", 500.0), ("ours", 0, "communication (exposed)", 300.0),
            ("ours", 0, "idle", 200.0), ("ours", 1, "matmul", 9999.0)]
    split = pd.DataFrame(rows, columns=["stack", "rank", "bucket", "ms_per_step"])
    said = _split_sentence(split, 2).markdown
    assert said.startswith("Where the time goes on one GPU (rank 0; 2 profiled steps")
    assert ("ours, 6,100 ms per profiled step: matmul 3,000 ms, attention 2,000 ms, norms & elementwise 500 ms; "
            "communication alone 300 ms, idle 200 ms.") in said
    assert _split_sentence(split.drop(columns="rank"), 2) is None


def test_the_time_split_difference_names_what_the_slower_stack_loses() -> None:
    """Each kind of work's difference on rank 0, largest first; under 1% of the step is left out."""
    import pandas as pd

    from cs336_systems.experiments.leaderboard import _split_difference

    ours = {"matmul": 2300.0, "attention": 2900.0, "norms & elementwise": 900.0, "optimizer": 23.0, "idle": 8.0}
    ref = {"matmul": 2500.0, "attention": 2400.0, "norms & elementwise": 380.0, "optimizer": 22.0, "idle": 9.0}
    rows = [(stack, rank, b, ms) for stack, split in (("ours", ours), ("torch reference", ref))
            for rank in (0, 1) for b, ms in split.items()]
    said = _split_difference(pd.DataFrame(rows, columns=["stack", "rank", "bucket", "ms_per_step"])).markdown
    assert said.startswith("Our profiled step is 820 ms longer than the torch reference's: norms & elementwise "
                           "+520 ms, attention +500 ms, matmul −200 ms.")
    assert "optimizer" not in said.split(".")[0] and "idle" not in said.split(".")[0]
    assert "compiles each block" in said and "cuDNN" in said and "one PyTorch kernel at a time" in said
    frame = pd.DataFrame(rows, columns=["stack", "rank", "bucket", "ms_per_step"])
    compiled = _split_difference(frame, pointwise_compiled=True).markdown
    assert "compiles only those three" in compiled and "one PyTorch kernel at a time" not in compiled
    alone = pd.DataFrame([("ours", 0, "matmul", 1.0)], columns=["stack", "rank", "bucket", "ms_per_step"])
    assert _split_difference(alone) is None
