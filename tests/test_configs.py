import pytest
import torch

from cs336_systems import configs


def test_presets_match_the_handout() -> None:
    shapes = {n: (c.d_model, c.d_ff, c.num_layers, c.num_heads) for n, c in configs.PRESETS.items()}
    assert shapes["small"] == (768, 3072, 12, 12)
    assert shapes["medium"] == (1024, 4096, 24, 16)
    assert shapes["large"] == (1280, 5120, 36, 20)
    assert shapes["xl"] == (1600, 6400, 48, 25)
    assert shapes["2.7B"] == (2560, 10240, 32, 32)
    assert shapes["xxl"][:3] == (16384, 53248, 126)
    assert all(configs.PRESETS[n].vocab_size == 10_000 and configs.PRESETS[n].batch_size == 4 for n in configs.HANDOUT_SIZES)


def test_editions_never_share_a_name() -> None:
    assert configs.get_config("xl").d_model == 1600 and configs.get_config("xl@2025").name == "xl"
    xl26 = configs.get_config("XL@2026")
    assert (xl26.d_model, xl26.d_ff, xl26.num_layers, xl26.num_heads) == (2560, 10240, 32, 32)
    ten = configs.get_config("10B@2026")
    assert (ten.d_model, ten.d_ff, ten.num_layers, ten.num_heads) == (4608, 12288, 50, 36)
    assert 12.5e9 < configs.param_counts("10B@2026")["total"] < 13e9  # the handout calls it 10B; counted: 12.8 B
    assert configs.get_config("small@2026") == configs.get_config("small")  # the tables agree below xl
    assert [configs.get_config(n).name for n in configs.HANDOUT_SIZES_BY_EDITION["2026"]] == [
        "small", "medium", "large", "xl@2026", "10B@2026"]
    with pytest.raises(ValueError, match="the 2026 handout has no '2.7B' model; its sizes: small"):
        configs.get_config("2.7B@2026")
    with pytest.raises(ValueError, match="unknown edition '2027'"):
        configs.get_config("xl@2027")


def test_a_size_name_means_each_handouts_own_model() -> None:
    assert configs.handout_size("xl", "2026") == "xl@2026" and configs.handout_size("XL", "2026") == "xl@2026"
    assert configs.handout_size("xl", "2025") == "xl" and configs.handout_size("small", "2026") == "small"
    assert configs.handout_size("2.7B", "2026") == "2.7B"  # not in 2026's table: the name stays
    assert configs.handout_size("xl@2026", "2025") == "xl@2026"  # an explicit edition is kept
    assert configs.handout_size("xl", "cse599o") == "large" == configs.handout_size("small", "cse599o")  # Table 1
    with pytest.raises(ValueError, match="unknown edition '2027'; editions: 2025, 2026, cse599o"):
        configs.handout_size("xl", "2027")


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid presets: tiny, small"):
        configs.get_config("huge")
    assert configs.get_config("XL").name == "xl"
    assert configs.get_config("small", context_length=128).context_length == 128


@pytest.mark.parametrize("name", ["tiny", "small", "2.7B"])
def test_param_count_matches_built_model(name: str) -> None:
    model = configs.build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == configs.param_counts(name)["total"]
    assert model.get_num_params() == configs.param_counts(name)["non_embedding"]


def test_flops_hand_checked_on_tiny() -> None:
    c = configs.get_config("tiny")  # d=64, f=256, L=2, V=512
    matmul = 2 * (4 * 64 * 64 + 3 * 64 * 256) + 512 * 64
    fl = configs.flops_per_token(c, context_length=32)
    assert fl["dense_forward"] == 2 * matmul
    assert fl["attention_forward"] == 4 * 2 * 32 * 64
    assert fl["train"] == 3 * fl["forward"]
    assert configs.step_flops(c, 4, 32, "forward") == fl["forward"] * 4 * 32
    with pytest.raises(ValueError):
        configs.step_flops(c, 4, 32, "backward-only")


def test_memory_breakdown_and_residual_stream() -> None:
    mem = configs.memory_breakdown("small", 4, 128)
    n = configs.param_counts("small")["total"]
    assert mem["parameters"] == mem["gradients"] == 4 * n
    assert mem["optimizer_state"] == 8 * n
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert configs.residual_stream_bytes("2.7B", 4, 512, "fp32") == 4 * 512 * 2560 * 4
    assert configs.dtype_bytes(torch.bfloat16) == 2
    with pytest.raises(ValueError):
        configs.dtype_bytes("fp8x")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"context_length": -5}, "context_length must be a positive integer, got -5"),
    ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
    ({"d_ff": 0}, "d_ff must be a positive integer, got 0"),
    ({"num_heads": 7}, "d_model 768 is not divisible by num_heads 7"),
    ({"d_model": 36, "num_heads": 4}, "head dimension d_model / num_heads = 9 must be even"),
    ({"batch_size": True}, "batch_size must be a positive integer, got True"),
    ({"context_lenght": 128}, "unknown model field(s) ['context_lenght']"),
])
def test_impossible_models_are_one_line_errors(overrides, message) -> None:
    with pytest.raises(ValueError) as exc:
        configs.get_config("small", **overrides)
    assert message in str(exc.value) and "\n" not in str(exc.value)
