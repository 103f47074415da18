"""Tests for lightning_mp_lstm.partition."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mp_lstm import partition as P
from lightning_mp_lstm.partition import (
    ModelShape,
    PartitionError,
    balanced_partition,
    block_names,
    choose_microbatches,
    costs_for,
    even_partition,
    flop_costs,
    memory_costs,
    parameter_counts,
    partition_blocks,
    partition_report,
    predict_step_times,
    predicted_step_time,
    profile_block_times,
    time_costs,
    validate_partition,
)

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


def test_block_names():
    assert block_names(2) == ["embedding", "lstm.0", "lstm.1", "decoder"]
    assert len(NAMES8) == 10
    with pytest.raises(PartitionError, match="num_layers"):
        block_names(0)


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


# --------------------------------------------------------------------------- #
# Cost models
# --------------------------------------------------------------------------- #


def _torch_blocks(shape: ModelShape) -> dict[str, torch.nn.Module]:
    embedding = torch.nn.Embedding(shape.vocab_size, shape.embedding_dim)
    lstms = {
        f"lstm.{i}": torch.nn.LSTM(shape.lstm_input_size(i), shape.hidden_size, batch_first=True)
        for i in range(shape.num_layers)
    }
    decoder = torch.nn.Linear(shape.hidden_size, shape.vocab_size)
    if shape.tie_weights:
        decoder.weight = embedding.weight
    return {"embedding": embedding, **lstms, "decoder": decoder}


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_match_torch(tie):
    shape = ModelShape(vocab_size=37, embedding_dim=12, hidden_size=12 if tie else 9, num_layers=3, tie_weights=tie)
    modules = _torch_blocks(shape)
    counts = parameter_counts(shape)
    assert list(counts) == block_names(3)
    model = torch.nn.ModuleDict({k.replace(".", "_"): v for k, v in modules.items()})
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())  # shared weight once
    for name in ["embedding", "lstm.0", "lstm.1", "lstm.2"]:
        assert counts[name] == sum(p.numel() for p in modules[name].parameters())
    if tie:
        assert counts["decoder"] == 37  # bias only
    else:
        assert counts["decoder"] == 9 * 37 + 37


def test_model_shape_validation():
    with pytest.raises(PartitionError, match="embedding_dim == hidden_size"):
        ModelShape(100, 16, 32, 2, tie_weights=True)
    with pytest.raises(PartitionError, match="num_layers"):
        ModelShape(100, 16, 32, 0)


def test_memory_costs():
    shape = ModelShape(vocab_size=100, embedding_dim=8, hidden_size=8, num_layers=2, tie_weights=True)
    counts = parameter_counts(shape)
    adam = memory_costs(shape)
    assert adam["embedding"] == 100 * 8 * 4 * 4  # params + grads + 2 Adam states, fp32
    assert adam["lstm.1"] == counts["lstm.1"] * 4 * 4
    assert memory_costs(shape, "sgd")["lstm.0"] == counts["lstm.0"] * 4 * 2
    assert memory_costs(shape, "sgd_momentum", bytes_per_param=2)["decoder"] == 100 * 2 * 3
    assert memory_costs(shape, replicate_tied=True)["decoder"] == (100 + 800) * 16
    with pytest.raises(PartitionError, match="allowed optimizers are: adam, sgd, sgd_momentum"):
        memory_costs(shape, "adagrad")


def test_flop_costs_formulas_and_bucket_mix():
    shape = ModelShape(vocab_size=1000, embedding_dim=20, hidden_size=40, num_layers=2)
    f = flop_costs(shape, batch_size=4, bucket_lengths=[10])
    tok = 40
    assert f["embedding"] == 2 * tok * 20
    assert f["lstm.0"] == 3 * tok * (8 * 40 * (20 + 40) + 20 * 40)
    assert f["lstm.1"] == 3 * tok * (8 * 40 * 80 + 20 * 40)
    assert f["decoder"] == 3 * tok * (2 * 40 * 1000 + 1000) + 6 * tok * 1000
    # Bucket mix: weighted average, uniform by default.
    mix = flop_costs(shape, 4, [10, 30])
    assert mix["lstm.1"] == pytest.approx(flop_costs(shape, 4, [20])["lstm.1"])
    weighted = flop_costs(shape, 4, [10, 30], [3, 1])
    assert weighted["decoder"] == pytest.approx(flop_costs(shape, 4, [15])["decoder"])
    with pytest.raises(PartitionError, match="bucket_weights"):
        flop_costs(shape, 4, [10, 30], [1])


def test_flops_balancing_moves_lstms_away_from_heavy_decoder():
    shape = ModelShape(vocab_size=10000, embedding_dim=200, hidden_size=400, num_layers=8)
    costs = flop_costs(shape, batch_size=32, bucket_lengths=[10, 20, 30, 40])
    balanced = partition_blocks(shape.block_names, costs, 2)
    even = even_partition(shape.block_names, 2)
    lstm_with_decoder = lambda stages: sum(n.startswith("lstm.") for n in stages[-1])  # noqa: E731
    assert lstm_with_decoder(even) == 4
    assert lstm_with_decoder(balanced) == 2
    assert balanced == [["embedding"] + [f"lstm.{i}" for i in range(6)], ["lstm.6", "lstm.7", "decoder"]]
    report = partition_report(balanced, costs, parameter_counts(shape), memory_costs(shape))
    assert report.ratio_vs_even < 0.85


def test_memory_and_flops_balancing_differ():
    # Large vocabulary, small LSTMs: embedding and decoder dominate memory
    # equally, but only the decoder dominates compute.
    shape = ModelShape(vocab_size=50000, embedding_dim=256, hidden_size=256, num_layers=4)
    names = shape.block_names
    by_memory = partition_blocks(names, costs_for("memory", shape), 2)
    by_flops = partition_blocks(names, costs_for("flops", shape, batch_size=32, bucket_lengths=[35]), 2)
    assert by_memory == [["embedding", "lstm.0", "lstm.1"], ["lstm.2", "lstm.3", "decoder"]]
    assert by_flops == [["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"], ["decoder"]]
    assert partition_blocks(names, costs_for("memory", shape), 3) == [
        ["embedding"],
        ["lstm.0", "lstm.1", "lstm.2", "lstm.3"],
        ["decoder"],
    ]


def test_costs_for_dispatch_and_errors():
    shape = ModelShape(100, 8, 8, 2)
    assert costs_for("memory", shape, optimizer="sgd") == memory_costs(shape, "sgd")
    measured = {n: 0.1 * (i + 1) for i, n in enumerate(shape.block_names)}
    assert costs_for("time", shape, measured=measured) == measured
    with pytest.raises(PartitionError, match="allowed kinds are: time, flops, memory"):
        costs_for("energy", shape)
    with pytest.raises(PartitionError, match="requires the argument\\(s\\): batch_size, bucket_lengths"):
        costs_for("flops", shape)
    with pytest.raises(PartitionError, match="missing costs for: decoder"):
        time_costs({"embedding": 1.0, "lstm.0": 1.0, "lstm.1": 1.0}, shape.block_names)
    with pytest.raises(PartitionError, match="'lstm.0'.*finite"):
        time_costs({"lstm.0": float("nan")})


class _LSTMBlock(torch.nn.Module):
    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(input_size, hidden_size, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out


def _profile_modules(vocab: int, emb: int = 16, hidden: int = 32, layers: int = 2):
    blocks = {"embedding": torch.nn.Embedding(vocab, emb)}
    for i in range(layers):
        blocks[f"lstm.{i}"] = _LSTMBlock(emb if i == 0 else hidden, hidden)
    blocks["decoder"] = torch.nn.Linear(hidden, vocab)
    return blocks


@pytest.fixture
def single_thread():
    # One intra-op thread keeps timings stable on a shared, loaded CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_block_times_positive_and_decoder_scales(single_thread):
    torch.manual_seed(0)
    B, T = 4, 16
    tokens = torch.randint(0, 50, (B, T))
    # Chained inputs: each block is fed the previous block's output.
    small = profile_block_times(_profile_modules(50, hidden=128), tokens, repeats=5, warmup=1)
    assert list(small) == block_names(2)
    assert all(t > 0 for t in small.values())

    # Explicit per-block inputs, 160x larger vocabulary (~160x the decoder FLOPs).
    big_blocks = _profile_modules(8000, hidden=128)
    inputs = {
        "embedding": tokens,
        "lstm.0": torch.randn(B, T, 16),
        "lstm.1": torch.randn(B, T, 128),
        "decoder": torch.randn(B, T, 128),
    }
    big = profile_block_times(big_blocks, inputs, repeats=5, warmup=1)
    assert all(t > 0 for t in big.values())
    assert big["decoder"] > 3 * small["decoder"]
    # Parameters got gradients during profiling but were reset afterwards.
    assert all(p.grad is None for m in big_blocks.values() for p in m.parameters())
    assert time_costs(big, block_names(2)) == big


def test_profile_block_times_errors():
    blocks = _profile_modules(10)
    with pytest.raises(PartitionError, match="no input for blocks: lstm.0"):
        profile_block_times(blocks, {"embedding": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(PartitionError, match="repeats"):
        profile_block_times(blocks, torch.zeros(1, 2, dtype=torch.long), repeats=0)


# --------------------------------------------------------------------------- #
# Step-time models and microbatches
# --------------------------------------------------------------------------- #


def test_predicted_step_time():
    assert predicted_step_time([2.0, 4.0], 1) == 8.0
    assert predicted_step_time([2.0, 4.0, 3.0, 1.0], 4) == pytest.approx(7 * 4.0 / 4)


def test_choose_microbatches_argmin_and_divisors():
    def t(b: int) -> float:
        return 1.0 + 0.1 * b  # fixed per-microbatch overhead + linear work

    predicted = predict_step_times(64, 4, t)
    assert list(predicted) == [1, 2, 4, 8, 16, 32, 64]
    assert predicted[4] == pytest.approx(7 * (1.0 + 1.6))
    expected = min(predicted, key=predicted.get)
    assert expected == 4
    assert choose_microbatches(64, 4, t) == 4

    # Only divisors of the batch are considered.
    predicted = predict_step_times(60, 3, t)
    assert all(60 % m == 0 for m in predicted)
    assert 7 not in predicted and 8 not in predicted
    assert choose_microbatches(60, 3, t) == min(predicted, key=predicted.get)
    with pytest.raises(PartitionError, match="\\[7\\] do not divide batch_size=60"):
        choose_microbatches(60, 3, t, candidates=[2, 7])
    assert choose_microbatches(64, 4, t, candidates=[1, 2]) == 2
    # Require at least S microbatches.
    assert choose_microbatches(64, 4, lambda b: 1.0 + 0.01 * b, at_least_num_stages=True) == 4
    assert choose_microbatches(64, 4, lambda b: 1.0 + 0.01 * b) == 1
    with pytest.raises(PartitionError, match="no candidate"):
        choose_microbatches(6, 8, t, at_least_num_stages=True)


def test_choose_microbatches_from_measurements_loglog():
    measured = {1: 1.0, 4: 2.0, 16: 4.0}  # t(b) = sqrt(b): log-log interpolation is exact
    predicted = predict_step_times(32, 2, measured)
    for m, value in predicted.items():
        assert value == pytest.approx((m + 1) * math.sqrt(32 / m))
    assert choose_microbatches(32, 2, measured) == min(predicted, key=predicted.get) == 1
    # Measurements of t(b) = 1 + 0.1 b (a per-microbatch overhead): interior optimum.
    overhead = {b: 1.0 + 0.1 * b for b in (1, 4, 16, 64)}
    predicted = predict_step_times(64, 4, overhead)
    assert predicted[4] == pytest.approx(7 * 2.6)  # b = 16 was measured
    assert predicted[1] == pytest.approx(4 * 7.4)
    assert choose_microbatches(64, 4, overhead) == min(predicted, key=predicted.get) == 4
    # Single measurement: linear scaling.
    assert predict_step_times(8, 2, {4: 2.0})[2] == pytest.approx(3 * 2.0)
    assert predict_step_times(8, 2, {4: 2.0})[8] == pytest.approx(9 * 0.5)


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def test_partition_report_renders():
    shape = ModelShape(vocab_size=10000, embedding_dim=200, hidden_size=400, num_layers=8)
    costs = flop_costs(shape, 32, [20])
    stages = partition_blocks(shape.block_names, costs, 2)
    report = partition_report(
        stages, costs, parameter_counts(shape), memory_costs(shape), measured_stage_times=[1.0, 3.0]
    )
    text = str(report)
    assert "embedding, lstm.0-5" in text and "lstm.6-7, decoder" in text
    assert "measured %" in text and "75.0" in text
    even_costs = [sum(costs[n] for n in s) for s in even_partition(shape.block_names, 2)]
    ratio = max(sum(costs[n] for n in s) for s in stages) / max(even_costs)
    assert report.ratio_vs_even == pytest.approx(ratio)
    assert f"predicted step-time ratio vs even split: {ratio:.3f}" in text
    assert sum(report.stage_parameters) == sum(parameter_counts(shape).values())
    mib = report.stage_memory_bytes[1] / 2**20
    assert f"{mib:.1f}" in text
    assert report.cost_shares == pytest.approx([c / sum(report.stage_costs) for c in report.stage_costs])
    # All blocks appear (in compact or full form) across both stage rows.
    assert all(any(n in s for s in report.stages) for n in shape.block_names)


def test_partition_report_one_block_per_stage_and_errors():
    shape = ModelShape(100, 8, 8, 2)
    costs = memory_costs(shape)
    stages = [[n] for n in shape.block_names]
    text = str(partition_report(stages, costs, parameter_counts(shape), costs))
    for name in shape.block_names:
        assert name in text
    assert "ratio vs even split: 1.000" in text
    with pytest.raises(PartitionError, match="contiguous"):
        partition_report(list(reversed(stages)), costs, parameter_counts(shape), costs)
    with pytest.raises(PartitionError, match="2 measured stage times for 4 stages"):
        partition_report(stages, costs, parameter_counts(shape), costs, measured_stage_times=[1, 2])


def test_public_api_exported():
    for name in P.__all__:
        assert hasattr(P, name)


def test_microbatch_step_time_fill_drain_model():
    from lightning_mp_lstm.partition import microbatch_step_time

    assert microbatch_step_time([2.0, 2.0, 2.0], 4) == pytest.approx((4 + 3 - 1) * 2.0)
    # Unbalanced: the busiest process paces m - 1 microbatches, fill and drain pass each process once.
    assert microbatch_step_time([1.0, 3.0], 4) == pytest.approx(3 * 3.0 + 4.0)
