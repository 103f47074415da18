"""Tests for lightning_mp_lstm.planning.plan: typed options, the frozen plan, the one step-time model (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import plan as plan_module
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.partition import PartitionError
from lightning_mp_lstm.planning.plan import PlanOptions, make_plan, microbatch_candidates, step_time
from tests.helpers import tiny_model

CPU = torch.device("cpu")


def test_step_time_is_fill_drain_plus_the_busiest_rank():
    assert step_time([2.0, 2.0, 2.0], 4) == pytest.approx((4 + 3 - 1) * 2.0)
    assert step_time([1.0, 3.0], 4) == pytest.approx(3 * 3.0 + 4.0)  # the busiest rank paces m - 1 microbatches


def test_microbatch_candidates_follow_the_batch_and_the_schedule():
    assert microbatch_candidates(ParallelLayout(1, 2, 1, "1F1B", 2), 8) == [2, 4, 8]  # 1F1B: m >= stages
    assert microbatch_candidates(ParallelLayout(1, 2, 1, "GPipe", 2), 6) == [1, 2, 3, 6]
    with pytest.raises(LayoutError, match="found no count: none of 1..1 divides the per-replica batch of 1"):
        microbatch_candidates(ParallelLayout(1, 2, 1, "1F1B", 2), 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(partition="balanced:time"), r"unknown partition 'balanced:time'; allowed: 'even', 'balanced', "
                                          r"'per_block'"),
        (dict(partition=["embedding", "lstm.0"]), r"flat list of block names"),
        (dict(balance_by="speed"), r"unknown balance_by 'speed'; allowed: time, flops, memory"),
        (dict(stage_speeds=[1, -1]), r"stage_speeds must be positive numbers"),
        (dict(n_microbatches=0), r"n_microbatches must be a positive integer, None or 'auto', got 0"),
    ],
)
def test_options_are_checked_on_construction(kwargs, message):
    with pytest.raises((PartitionError, LayoutError), match=message):
        PlanOptions(**kwargs)


def test_fixed_partitions_and_their_errors():
    names = ["embedding", "lstm.0", "lstm.1", "decoder"]
    assert PlanOptions().fixed_partition(names, 2) == [["embedding", "lstm.0"], ["lstm.1", "decoder"]]
    assert PlanOptions(partition="per_block").fixed_partition(names, 4) == [[n] for n in names]
    assert PlanOptions(partition="per_block").stage_count(names) == 4
    assert PlanOptions(partition="balanced").fixed_partition(names, 2) is None
    with pytest.raises(PartitionError, match="puts each of the 4 blocks on its own stage, but the layout has 2"):
        PlanOptions(partition="per_block").fixed_partition(names, 2)
    with pytest.raises(PartitionError, match="the layout has 5 pipeline stages but the model has 4 blocks"):
        PlanOptions(partition="balanced").fixed_partition(names, 5)
    with pytest.raises(PartitionError, match="stage_speeds has 3 values but the layout has 2 stages"):
        PlanOptions(stage_speeds=(1, 2, 3)).check(names, ParallelLayout(1, 2, 1, "1F1B", 2))


def test_a_plan_is_frozen_and_fingerprinted():
    model = tiny_model(num_layers=4)
    layout = ParallelLayout(1, 2, 1, "1F1B", 2)
    plan = make_plan(model, layout, PlanOptions(partition="balanced", balance_by="flops"), 8, 10, CPU)
    again = make_plan(model, layout, PlanOptions(partition="balanced", balance_by="flops"), 8, 10, CPU)
    assert plan == again and plan.fingerprint == again.fingerprint and len(plan.fingerprint) == 16
    by_memory = make_plan(model, layout, PlanOptions(partition="balanced", balance_by="memory"), 8, 10, CPU)
    assert by_memory.fingerprint != plan.fingerprint and by_memory.cost_kind == "memory"
    even = make_plan(model, layout, PlanOptions(), 8, 10, CPU)
    assert even.partition == (("embedding", "lstm.0", "lstm.1"), ("lstm.2", "lstm.3", "decoder"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.partition = ()
    assert plan.cost_kind == "flops" and [n for n, _ in plan.block_costs] == pipeline_model(model).block_names
    assert sum(c for _, c in plan.block_parameters) == sum(p.numel() for p in model.parameters())
    assert plan.blocks_of(0) == list(plan.partition[0]) and plan.stage_of("decoder") == 1


def test_auto_microbatches_choose_the_predicted_fastest_count(monkeypatch):
    """With a known cost per microbatch (1 ms overhead + 0.1 ms per row and block), the plan's predictions are
    the step-time model's and its choice is their minimum."""
    def fake_seconds(model, names, rows, length, device, repeats=5, warmup=2):
        return {name: 1e-3 + 1e-4 * rows for name in names}

    monkeypatch.setattr(plan_module.profile, "block_seconds", fake_seconds)
    model = tiny_model(num_layers=2)
    layout = ParallelLayout(1, 2, 1, "1F1B", 2)
    plan = make_plan(model, layout, PlanOptions(n_microbatches="auto"), 64, 10, CPU)
    predictions = dict(plan.predictions)
    assert sorted(predictions) == [2, 4, 8, 16, 32]  # divisors of 64 that 1F1B takes, up to 32
    for m, seconds in predictions.items():
        per_rank = 2 * (1e-3 + 1e-4 * 64 / m)  # two blocks per rank
        assert seconds == pytest.approx(step_time([per_rank, per_rank], m))
    assert plan.n_microbatches == min(predictions, key=predictions.get)
    assert plan.layout == dataclasses.replace(layout, n_microbatches=plan.n_microbatches)


def test_balancing_by_time_uses_the_measured_costs(monkeypatch):
    measured = {"embedding": 1.0, "lstm.0": 1.0, "lstm.1": 1.0, "lstm.2": 1.0, "decoder": 4.0}
    monkeypatch.setattr(plan_module.profile, "block_seconds",
                        lambda model, names, *args, **kwargs: {n: measured[n] for n in names})
    plan = make_plan(tiny_model(num_layers=3), ParallelLayout(1, 2, 1, "1F1B", 2),
                     PlanOptions(partition="balanced"), 8, 10, CPU)
    assert plan.cost_kind == "time" and dict(plan.block_costs) == measured
    assert plan.partition == (("embedding", "lstm.0", "lstm.1", "lstm.2"), ("decoder",))
