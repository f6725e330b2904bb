"""Hand-checked values for the analytic memory / communication models.

XXL (d_model 16384, d_ff 53248, 126 blocks of two linears):
    Ψ = 2 · 16384 · 53248 · 126 = 219,848,638,464 parameters
    fp32 weights + grads + AdamW = 16 B · Ψ = 3,517,578,215,424 B ≈ 3.52 TB ≈ 43.97 H100-80GB
    bf16 activations saved per token = 2 B · (16384 + 53248) · 126 = 17,547,264 B
    smallest N with 16Ψ/N < 95 GB: 16Ψ / 95e9 = 37.03 → 38
    α = 4.6e14 / 1.8e11 = 2555.56; compute bound per chip at α / (Y·M_X) = 2555.56 / 8 = 319.44 tokens,
    globally 64 · 319.44 = 20,444.4 tokens; TP stays compute bound since F = 53248 ≥ α·Y/M_Y = 10,222.
"""

from __future__ import annotations

import pytest

from cs336_systems import accounting as acc
from cs336_systems.configs import memory_breakdown, param_counts

XXL = acc.FFNModel.from_preset("xxl")
PSI = 219_848_638_464


def test_xxl_memory_by_hand():
    assert XXL == acc.FFNModel(16384, 53248, 126)
    assert XXL.num_params == PSI
    mem = acc.ffn_model_memory(XXL, tokens=1000)
    assert mem["master_weights"] == 4 * PSI and mem["optimizer_state"] == 8 * PSI
    assert mem["weights_grads_optimizer"] == 3_517_578_215_424
    assert mem["activations_per_token"] == 17_547_264
    assert mem["activations"] == 17_547_264_000
    assert acc.device_equivalents(mem["weights_grads_optimizer"]) == pytest.approx(43.97, abs=0.01)


def test_fsdp_sharding_to_fit_a_v5p():
    assert acc.min_fsdp_devices(XXL, acc.TPU_V5P_BYTES) == 38
    assert acc.fsdp_memory_per_device(XXL, 38) < 95e9 < acc.fsdp_memory_per_device(XXL, 37)
    # 4096 tokens: A = 71.87 GB; (16Ψ + A/2)/N + A/2 < 95 GB ⇔ N > 3553.5 GB / 59.06 GB = 60.2 → 61.
    assert acc.fsdp_memory_per_device(XXL, 1, 4096) == pytest.approx(16 * PSI + 17_547_264 * 4096)
    assert acc.min_fsdp_devices(XXL, acc.TPU_V5P_BYTES, 4096) == 61
    with pytest.raises(ValueError, match="unsharded activations"):
        acc.min_fsdp_devices(XXL, acc.TPU_V5P_BYTES, 20_000)
    with pytest.raises(ValueError):
        acc.fsdp_memory_per_device(XXL, 0)


def test_compute_bound_batch_by_hand():
    mesh = acc.Mesh(X=16, Y=4, M_X=2, M_Y=1)
    out = acc.compute_bound_batch(XXL, mesh)
    assert out["alpha"] == pytest.approx(2555.56, abs=0.01)
    assert out["per_device_tokens"] == pytest.approx(319.44, abs=0.01)
    assert out["global_tokens"] == pytest.approx(20444.4, abs=0.1)
    assert out["per_fsdp_shard_tokens"] == pytest.approx(1277.8, abs=0.1)
    assert out["tp_compute_bound"] and out["tp_min_d_ff"] == pytest.approx(10222.2, abs=0.1)
    # At the threshold the FSDP all-gather exactly matches the math; TP is cheaper.
    t = acc.fsdp_tp_forward_times(XXL, out["global_tokens"], mesh)
    assert t["T_math"] == pytest.approx(t["T_fsdp"]) and t["T_tp"] < t["T_math"]
    # Gathering weights in 1 byte (fp8/int8) halves the threshold.
    assert acc.compute_bound_batch(XXL, mesh, comm_bytes=1)["per_device_tokens"] == pytest.approx(319.44 / 2, abs=0.01)
    with pytest.raises(ValueError):
        acc.Mesh(X=0)


def test_strategy_memory_and_traffic_relations():
    n = param_counts("xl")["total"]
    ddp = acc.training_memory_per_rank("xl", "ddp", 2, 4, 128)
    sharded = acc.training_memory_per_rank("xl", "sharded_optimizer", 2, 4, 128)
    zero3 = acc.training_memory_per_rank("xl", "zero3", 4, 4, 128)
    assert ddp["parameters"] == 4 * n and ddp["optimizer_state"] == 8 * n
    assert ddp["activations"] == memory_breakdown("xl", 4, 128)["activations"]
    assert sharded["optimizer_state"] == 4 * n and sharded["gradients"] == ddp["gradients"]
    assert zero3["parameters"] == n and zero3["gradients"] == n and zero3["optimizer_state"] == 2 * n
    fsdp = acc.training_memory_per_rank("xl", "fsdp", 2, 4, 128)
    assert fsdp["parameters"] < 0.51 * ddp["parameters"] and fsdp["fsdp_working_set"] > 0

    psi = 4 * n
    assert acc.communication_per_step("xl", "ddp", 2)["total"] == pytest.approx(psi)  # 2·(1/2)·Ψ
    assert acc.communication_per_step("xl", "sharded_optimizer", 2)["total"] == pytest.approx(1.5 * psi)
    assert acc.communication_per_step("xl", "zero1", 2)["total"] == pytest.approx(psi)
    assert acc.communication_per_step("xl", "zero3", 4)["total"] == pytest.approx(3 * 0.75 * psi)
    with pytest.raises(ValueError, match="strategy"):
        acc.training_memory_per_rank("xl", "pipeline", 2)


def test_largest_trainable_preset_orders_strategies():
    h200 = 141 * acc.GB
    ddp = acc.largest_trainable_preset("ddp", 4, h200, batch_size=1, context_length=512)
    fsdp = acc.largest_trainable_preset("fsdp", 4, h200, batch_size=1, context_length=512)
    assert ddp is not None and fsdp is not None
    assert param_counts(acc.ladder_config(fsdp))["total"] > param_counts(acc.ladder_config(ddp))["total"]
    assert acc.largest_trainable_preset("ddp", 1, 1e6) is None
