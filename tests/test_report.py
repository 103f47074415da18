"""Tests for lightning_mp_lstm.planning.report: the plan and the measurements, rendered."""

from __future__ import annotations

import torch

from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.plan import PlanOptions, make_plan
from lightning_mp_lstm.planning.report import Measurements, render, stage_summary
from tests.helpers import tiny_model


def _plan():
    model = tiny_model(num_layers=8, vocab=2000, embedding_dim=20, hidden_size=40)
    return make_plan(model, ParallelLayout(1, 2, 1, "1F1B", 2), PlanOptions(partition="balanced", balance_by="flops"),
                     32, 20, torch.device("cpu"))


def test_render_shows_stages_shares_and_the_ratio_to_the_even_split():
    plan = _plan()
    text = render(plan)
    summary = stage_summary(plan)
    assert text.splitlines()[0].split() == ["stage", "blocks", "params", "memory", "MiB", "flops", "%"]
    for stage in plan.partition:
        assert stage[0] in text  # compact runs such as "lstm.0-5" start with a real block name
    shares = [c / sum(summary["costs"]) for c in summary["costs"]]
    assert f"{100 * shares[1]:.1f}" in text
    ratio = max(summary["costs"]) / max(summary["even"])
    assert f"predicted step-time ratio vs even split: {ratio:.3f}" in text and ratio < 1
    assert f"{int(summary['parameters'][0]):,}" in text
    assert "measured %" not in text


def test_measurements_are_shown_next_to_the_plan_which_does_not_change():
    plan = _plan()
    before = plan.fingerprint
    text = render(plan, Measurements(stage_seconds=(1.0, 3.0), step_seconds=0.5))
    assert "measured %" in text and "75.0" in text and "measured 500.0 ms" in text
    assert plan.fingerprint == before


def test_compact_block_runs():
    from lightning_mp_lstm.planning.partition import compact_blocks

    assert compact_blocks(["embedding", "lstm.0", "lstm.1", "lstm.2", "decoder"]) == "embedding, lstm.0-2, decoder"
    assert compact_blocks(["lstm.1", "lstm.3"]) == "lstm.1, lstm.3"
    assert compact_blocks(["encoder", "rnn.0", "rnn.1", "decoder"]) == "encoder, rnn.0-1, decoder"
