"""The per-kernel comparison of two training-step stacks: names grouped by kind, buckets as the split's."""

from __future__ import annotations

import re
import time

import pandas as pd
import pytest
import torch

from cs336_systems.benchmarking.step_kernels import kernel_summary, main, short_name, side_by_side


def test_short_names_group_inductor_serials_and_drop_templates() -> None:
    assert short_name("triton_poi_fused_add_mul_3") == short_name("triton_poi_fused_add_mul_17") \
        == "triton_poi_fused_add_mul"
    assert short_name("triton_red_fused__to_copy_mean_pow_0") == "triton_red_fused__to_copy_mean_pow"
    # ATen's kernels are told apart by their functors, not by the shared template
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                      "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)") \
        == "vectorized_elementwise_kernel<FillFunctor>"
    assert short_name("adamw_kernel") == "adamw_kernel" and len(short_name("x" * 200, limit=20)) == 20


def test_kernel_summary_sums_per_step_and_puts_optimizer_launches_in_their_bucket() -> None:
    records = pd.DataFrame({
        "name": ["triton_poi_fused_add_1", "triton_poi_fused_add_2", "sm90_xmma_gemm_bf16", "adamw_kernel",
                 "triton_poi_fused_mul_0"],
        "duration_us": [10.0, 30.0, 400.0, 50.0, 20.0],
        "launch_us": [1.0, 2.0, 3.0, float("nan"), 105.0],
    })
    table = kernel_summary(records, steps=2, optimizer_intervals=[(100.0, 110.0)])
    rows = {(r.bucket, r.kernel): r for r in table.itertuples()}
    add = rows[("norms & elementwise", "triton_poi_fused_add")]
    assert add.ms_per_step == pytest.approx(0.02) and add.launches_per_step == 1 and add.us_per_launch == 20
    assert ("optimizer", "adamw_kernel") in rows and ("optimizer", "triton_poi_fused_mul") in rows  # by name, by range
    assert rows[("matmul", "sm90_xmma_gemm_bf16")].ms_per_step == pytest.approx(0.2)
    assert table["ms_per_step"].is_monotonic_decreasing
    both = side_by_side(pd.concat([table.assign(stack="ours"), table.assign(stack="reference")]))
    assert both.loc["matmul", ("ms_per_step", "ours")] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        kernel_summary(records, steps=0)


@pytest.mark.slow
def test_command_profiles_both_stacks_on_cpu(tmp_path, capsys) -> None:
    csv = tmp_path / "k.csv"
    assert main(["--preset", "tiny", "--context-length", "16", "--batch-size", "2", "--precision", "fp32",
                 "--steps", "1", "--warmup", "1", "--top", "3", "--host-profile", "5", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "ours: the 3 largest norms & elementwise kernel kinds" in out and "reference:" in out
    assert re.search(r"^ours: host [\d.]+ ms to issue a step, GPU kernels [\d.]+ ms$", out, re.M)
    assert "reference: host profile of one step" in out and "tottime" in out
    assert set(pd.read_csv(csv)["stack"]) == {"ours", "reference"}
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="unknown stack 'theirs'"):
        main(["--stacks", "ours,theirs"])


def test_host_time_counts_the_issuing_and_flags_a_wait() -> None:
    from cs336_systems.benchmarking.step_kernels import host_ms_per_step

    ms, waited = host_ms_per_step(lambda: time.sleep(0.01), 3, torch.device("cpu"))
    assert 9 <= ms < 200 and not waited  # a CPU step runs where it is issued


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_synchronizing_step_is_flagged_on_a_gpu() -> None:
    from cs336_systems.benchmarking.step_kernels import host_ms_per_step

    x = torch.ones(1024, device="cuda")
    x.mul_(1.0).sum().item()  # the first launch of each kernel loads its module and waits: warm both up first
    fast, waited = host_ms_per_step(lambda: x.mul_(1.0), 5, torch.device("cuda"))
    assert not waited and fast < 50  # queued behind the sleep: only the launch is timed
    slow, waited = host_ms_per_step(lambda: x.sum().item(), 1, torch.device("cuda"))
    assert waited and slow > 500  # .item() waits for the 2 s sleep
