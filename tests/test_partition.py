"""Tests for lightning_mp_lstm.planning.partition: validation, the even split and exact balancing (pure Python)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mp_lstm.planning import partition as P
from lightning_mp_lstm.planning.partition import (
    PartitionError,
    balanced_partition,
    even_partition,
    stage_totals,
    validate_partition,
)


def block_names(num_layers: int) -> list[str]:
    return ["embedding", *(f"lstm.{i}" for i in range(num_layers)), "decoder"]


NAMES8 = block_names(8)


# --------------------------------------------------------------------------- #
# Brute force reference
# --------------------------------------------------------------------------- #


def _compositions(n: int, k: int):
    """All size vectors of n blocks into k non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(k)]


def _stage_times(costs, sizes, speeds):
    times, start = [], 0
    for s, size in enumerate(sizes):
        times.append(sum(costs[start : start + size]) / speeds[s])
        start += size
    return times


def _brute_force(costs, k, speeds):
    """Exact (Fraction) optimum: min bottleneck, then min sum of squares, then lexicographic."""
    costs = [Fraction(c) for c in costs]
    speeds = [Fraction(s) for s in speeds]
    best = None
    for sizes in _compositions(len(costs), k):
        times = _stage_times(costs, sizes, speeds)
        key = (max(times), sum(t * t for t in times), sizes)
        if best is None or key < best:
            best = key
    return best


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    costs=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=9),
    with_speeds=st.booleans(),
)
def test_balanced_partition_matches_brute_force_integers(data, costs, with_speeds):
    k = data.draw(st.integers(min_value=1, max_value=len(costs)), label="k")
    speeds = (
        data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k), label="speeds")
        if with_speeds
        else None
    )
    sizes = balanced_partition(costs, k, speeds)
    bottleneck, sumsq, ref_sizes = _brute_force(costs, k, speeds or [1] * k)
    assert sum(sizes) == len(costs) and len(sizes) == k and min(sizes) >= 1
    times = _stage_times(costs, sizes, speeds or [1] * k)
    assert max(times) == pytest.approx(float(bottleneck), rel=1e-12, abs=1e-12)
    # Exact tie-break: min sum of squares, then lexicographically first.
    assert sizes == ref_sizes


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    costs=st.lists(
        st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=9,
    ),
    with_speeds=st.booleans(),
)
def test_balanced_partition_optimal_bottleneck_floats(data, costs, with_speeds):
    k = data.draw(st.integers(min_value=1, max_value=len(costs)), label="k")
    speeds = (
        data.draw(
            st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=k, max_size=k), label="speeds"
        )
        if with_speeds
        else [1.0] * k
    )
    sizes = balanced_partition(costs, k, speeds)
    got = max(_stage_times(costs, sizes, speeds))
    best = min(max(_stage_times(costs, s, speeds)) for s in _compositions(len(costs), k))
    assert got == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_balanced_partition_simple_cases():
    assert balanced_partition([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]  # 5 | 5 beats 6 | 4
    assert balanced_partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    # A twice-as-fast second device takes twice the work.
    assert balanced_partition([1] * 6, 2, speeds=[1, 2]) == [2, 4]
    # Bottleneck 10 in every split; equal sums of squares for [1, 1, 2] and
    # [1, 2, 1] (10, 1, 2 vs 10, 2, 1): the lexicographically first wins.
    assert balanced_partition([10, 1, 1, 1], 3) == [1, 1, 2]
    # Bottleneck tie (9 | ...): sum of squares prefers spreading the rest evenly.
    assert balanced_partition([9, 2, 2, 2, 2], 3) == [1, 2, 2]
    assert balanced_partition([0, 0, 0], 2) == [1, 2]


def test_balanced_partition_errors():
    with pytest.raises(PartitionError, match="num_stages=4.*3 blocks|3 blocks into num_stages=4"):
        balanced_partition([1, 2, 3], 4)
    with pytest.raises(PartitionError, match="costs\\[1\\]=-1.0"):
        balanced_partition([1, -1, 3], 2)
    with pytest.raises(PartitionError, match="got 3 speeds for num_stages=2"):
        balanced_partition([1, 2, 3], 2, speeds=[1, 1, 1])
    with pytest.raises(PartitionError, match="speeds\\[0\\]=0.0"):
        balanced_partition([1, 2, 3], 2, speeds=[0, 1])


# --------------------------------------------------------------------------- #
# Block names, validation, even split
# --------------------------------------------------------------------------- #


def test_validate_partition_ok():
    stages = (("embedding", "lstm.0"), ["lstm.1", "decoder"])
    assert validate_partition(stages, block_names(2), num_stages=2) == [
        ["embedding", "lstm.0"],
        ["lstm.1", "decoder"],
    ]


def test_validate_unknown_name_lists_valid_names():
    with pytest.raises(PartitionError) as err:
        validate_partition([["embedding", "lstm.0"], ["lstm.7", "decoder"]], block_names(2))
    msg = str(err.value)
    assert "'lstm.7'" in msg and "stage 1" in msg
    assert "valid block names are: embedding, lstm.0, lstm.1, decoder" in msg


def test_validate_duplicates_and_missing():
    with pytest.raises(PartitionError) as err:
        validate_partition([["embedding", "lstm.0"], ["lstm.0", "decoder"]], block_names(2))
    msg = str(err.value)
    assert "duplicated blocks: 'lstm.0' (in stages 0, 1)" in msg
    assert "missing blocks: lstm.1" in msg

    with pytest.raises(PartitionError, match="missing blocks: lstm.1, decoder") as err:
        validate_partition([["embedding", "lstm.0"]], block_names(2))
    assert "duplicated" not in str(err.value)


def test_validate_out_of_order_and_non_contiguous():
    with pytest.raises(PartitionError) as err:
        validate_partition([["embedding", "lstm.1"], ["lstm.0", "decoder"]], block_names(2))
    msg = str(err.value)
    assert "contiguous and in model order" in msg
    assert "stage 0 has 'lstm.1' where 'lstm.0' was expected" in msg

    with pytest.raises(PartitionError, match="stage 0 has 'lstm.0' where 'embedding' was expected"):
        validate_partition([["lstm.0", "lstm.1", "decoder"], ["embedding"]], block_names(2))


def test_validate_empty_stage():
    with pytest.raises(PartitionError, match="stage 1 is empty"):
        validate_partition([["embedding", "lstm.0"], [], ["lstm.1", "decoder"]], block_names(2))


def test_validate_wrong_count():
    with pytest.raises(PartitionError) as err:
        validate_partition([["embedding", "lstm.0"], ["lstm.1", "decoder"]], block_names(2), num_stages=4)
    msg = str(err.value)
    assert "2 stages but num_stages=4" in msg
    assert "pipeline_parallel_size x stages_per_rank" in msg


def test_validate_rejects_bare_string_stage():
    with pytest.raises(PartitionError, match="stage 0 must be a list of block names"):
        validate_partition(["embedding", ["lstm.0", "lstm.1", "decoder"]], block_names(2))


def test_even_partition():
    assert even_partition(NAMES8, 2) == [
        ["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"],
        ["lstm.4", "lstm.5", "lstm.6", "lstm.7", "decoder"],
    ]
    assert even_partition(NAMES8, 4) == [
        ["embedding", "lstm.0", "lstm.1"],
        ["lstm.2", "lstm.3", "lstm.4"],
        ["lstm.5", "lstm.6"],
        ["lstm.7", "decoder"],
    ]
    assert even_partition(NAMES8, 10) == [[n] for n in NAMES8]
    with pytest.raises(PartitionError, match="10 blocks into num_stages=11"):
        even_partition(NAMES8, 11)


def test_a_flat_list_is_named_as_such():
    with pytest.raises(PartitionError, match=r"flat list of block names \['embedding', 'lstm.0'\]"):
        validate_partition(["embedding", "lstm.0"], block_names(1))


def test_stage_totals():
    assert stage_totals([["a", "b"], ["c"]], {"a": 1.0, "b": 2.0, "c": 4.0}) == [3.0, 4.0]


def test_public_api_exported_and_no_torch():
    for name in P.__all__:
        assert hasattr(P, name)
    assert "torch" not in P.__dict__  # pure Python
