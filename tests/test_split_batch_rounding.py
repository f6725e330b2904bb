"""The reproduction of the full-batch vs data-parallel gap (cs336_systems.distributed.split_batch_rounding)."""

import pytest

from cs336_systems.benchmarking.__main__ import main as benchmarking
from cs336_systems.distributed.split_batch_rounding import split_batch_gaps


def test_the_gap_is_a_few_roundings_in_either_dtype() -> None:
    table = split_batch_gaps()  # the course test's shape: 160 tokens, 80 per rank
    assert set(zip(table["computation"], table["dtype"])) == {
        (c, d) for c in ("gemm", "data_parallel") for d in ("float32", "float64")}
    # a wrong scale (a missing 1 / world_size) or a wrong product would be millions of epsilons off
    assert (table["ulps_of_max"] < 64).all(), table
    by = table.set_index(["computation", "dtype"])["max_abs_diff"]
    for c in ("gemm", "data_parallel"):  # rounding: the gap shrinks with the dtype's epsilon (2^-52 vs 2^-23)
        if by[(c, "float32")] > 0:
            assert by[(c, "float64")] < 1e-6 * by[(c, "float32")]


def test_one_rank_is_the_full_batch_bit_for_bit() -> None:
    table = split_batch_gaps(world_size=1)
    assert table["bitwise_equal"].all() and (table["max_abs_diff"] == 0).all()


def test_bad_arguments_end_in_one_line(capsys) -> None:
    with pytest.raises(ValueError, match="does not split evenly"):
        split_batch_gaps(tokens=161)
    with pytest.raises(ValueError, match="must be positive"):
        split_batch_gaps(world_size=0)
    with pytest.raises(ValueError, match="does not split evenly"):  # exit 2, one line, via run_main
        benchmarking(["split_batch_rounding", "--tokens", "161"])
