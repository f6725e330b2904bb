"""CPU checks of the attention host-overhead benchmark's inputs and tables (its timings need a GPU)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from cs336_systems.benchmarking import flash_host_overhead as fho


def test_bshd_inputs_are_head_views_of_token_major_tensors() -> None:
    q, k, v, do = fho.make_inputs((2, 3, 5, 4), torch.float32, "bshd", device="cpu")
    for t in (q, k, v, do):
        assert t.shape == (2, 3, 5, 4)
        assert t.stride() == (60, 4, 12, 1)  # (batch, seq, heads, d) memory
        assert not t.is_contiguous()
    assert all(t.requires_grad for t in (q, k, v)) and not do.requires_grad
    q, *_ = fho.make_inputs((2, 3, 5, 4), torch.float32, "bhsd", device="cpu")
    assert q.is_contiguous()
    with pytest.raises(ValueError, match="layout must be one of"):
        fho.make_inputs((2, 3, 5, 4), torch.float32, "sbhd", device="cpu")


def test_kernel_table_takes_the_median_per_kernel_and_implementation() -> None:
    rows = pd.DataFrame([
        {"round": 0, "impl": "ours", "kernel: fwd": 10.0, "kernel: bwd": 30.0, "kernel: cudnn": None},
        {"round": 1, "impl": "ours", "kernel: fwd": 14.0, "kernel: bwd": 20.0, "kernel: cudnn": None},
        {"round": 2, "impl": "ours", "kernel: fwd": 12.0, "kernel: bwd": 25.0, "kernel: cudnn": None},
        {"round": 0, "impl": "sdpa_cudnn", "kernel: fwd": None, "kernel: bwd": None, "kernel: cudnn": 7.0},
    ])
    table = fho.kernel_table(rows)
    assert table.loc["fwd", "ours"] == 12.0 and table.loc["bwd", "ours"] == 25.0
    assert table.loc["cudnn", "sdpa_cudnn"] == 7.0 and pd.isna(table.loc["fwd", "sdpa_cudnn"])


@pytest.mark.parametrize(("impl", "views"), [(fho.GLUON_VIEWS, True), (fho.NO_GLUON_VIEWS, False)])
def test_gluon_view_variants_set_the_option_for_the_measurement_only(impl: str, views: bool) -> None:
    from cs336_systems.attention import options

    before = options.current()
    with options.use(gluon_head_views=not views), fho._backend(impl):
        assert options.current().gluon_head_views is views
        assert options.current().gluon == before.gluon  # nothing else changes
    assert options.current() == before


def test_gluon_short_variant_runs_gluon_at_every_length() -> None:
    from cs336_systems.attention import options

    before = options.current()
    with fho._backend(fho.GLUON_SHORT):
        assert options.current().gluon_min_key_work == 0 and options.current().gluon_head_views is False
    with fho._backend(fho.GLUON_VIEWS):
        assert options.current().gluon_min_key_work == 0 and options.current().gluon_head_views is True
    assert options.current() == before


def test_unknown_implementation_is_one_line() -> None:
    with pytest.raises(ValueError, match="unknown implementation 'ourz'; choose from ours, sdpa_flash"):
        fho.attention_fn("ourz")


def test_a_variant_sets_its_options_for_the_measurement() -> None:
    from cs336_systems.attention import options

    name, changes = fho.parse_variant('fwd128={"candidates": {"forward": [[128, 128, 8, 3]]}, "autotune": false}')
    assert name == "fwd128"
    before = options.current()
    with fho._backend(name, {name: changes}):
        assert options.current().tiles("forward") == (options.Tile(128, 128, 8, 3),)
        assert options.current().autotune is False
        assert options.current().tiles("dq") == before.tiles("dq")  # phases left out keep theirs
    assert options.current() == before
    assert fho.attention_fn(name, {name: changes}) == fho.attention_fn("ours")


@pytest.mark.parametrize(("text", "message"), [
    ("fwd128", "a variant is NAME=JSON"),
    ("ours={}", "variant name 'ours' is taken"),
    ("v={autotune: false}", "its options are not JSON"),
    ("v=[1]", "options must be a JSON object"),
    ('v={"tiles": 3}', r"unknown options \['tiles'\]"),
    ('v={"autotune": "yes"}', "variant v: autotune must be True or False"),
    ('v={"candidates": {"fwd": [[64, 64, 4, 3]]}}', "variant v: candidates for unknown phases"),
])
def test_bad_variants_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fho.parse_variant(text)


def test_main_rejects_an_unknown_implementation_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown implementation 'v2'; choose from .*, v1"):
        fho.main(["--impls", "ours,v2", "--variant", 'v1={"gluon": false}'])


def test_a_variant_is_measured_even_when_impls_leaves_it_out() -> None:
    """``--variant`` alone used to define a variant that nothing measured; now it follows ``--impls``, or takes
    the place ``--impls`` gives it."""
    variants = {"v1": {"gluon": False}, "v2": {"autotune": False}}
    assert fho.selected_impls("ours,sdpa_cudnn", variants) == ("ours", "sdpa_cudnn", "v1", "v2")
    assert fho.selected_impls("v2,ours", variants) == ("v2", "ours", "v1")
    assert fho.selected_impls("ours", {}) == ("ours",)
