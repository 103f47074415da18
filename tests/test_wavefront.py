"""Wavefront pipelining (schedule="Wavefront", time chunks): exact full backpropagation through time.

Against the plain module on one process (dropout off, 1e-5 relative, every rank checked on its own): the engine's
loss, every gradient, the evaluation loss and the predictions of bucketed batches whose lengths are not multiples of
the chunk count, for pp1 (one process, two stages), pp2, pp2 with two stages per process (the interleaved analogue),
rows x chunks, dp2, pp4 and dp2 x pp2; then whole Trainer runs (loss curve, every gradient of every step, final
parameters) with tied weights, Adam and clipping on pp2, pp2 x 2 stages, pp4 and dp2 x pp2, and in stream mode with
the state carried across batches on pp2 and dp2 x pp2.
"""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LayoutError
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.models.language_model_blocks import prediction_from_logits
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum
from lightning_mp_lstm.pipeline.wavefront import chunk_lengths
from lightning_mp_lstm.planning import advice, report
from lightning_mp_lstm.planning import plan as plan_module
from lightning_mp_lstm.planning.advice import advise
from lightning_mp_lstm.planning.calibration import Calibration
from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.planning.plan import ChunkCost, PlanOptions, chunk_candidates, make_plan, step_time
from tests.helpers import (
    FixedBatches,
    Gradients,
    TrainLosses,
    assert_split_equals_one_process,
    cpu_engine,
    fit_and_record,
    lm_batches,
    quiet_trainer,
    rel_error,
    run_ranks,
    tiny_model,
)

LENGTHS = (5, 9, 7)  # bucket lengths of the engine's batches: none a multiple of 2, 3 or 4
CPU = torch.device("cpu")


def _wavefront(**kwargs: Any) -> dict:
    return dict(schedule="Wavefront", **kwargs)


# ----- no processes ------------------------------------------------------------------------------------------
def test_chunk_lengths_are_near_equal_and_never_empty():
    assert chunk_lengths(9, 4) == [3, 2, 2, 2]
    assert chunk_lengths(8, 4) == [2, 2, 2, 2]
    assert chunk_lengths(3, 5) == [1, 1, 1]  # a batch shorter than the chunk count: one step per chunk
    assert chunk_lengths(7, 1) == [7]


def test_layout_defaults_and_validation():
    layout = ParallelLayout.resolve(2, schedule="wavefront", pipeline_parallel_size=2)
    assert (layout.schedule, layout.n_microbatches, layout.time_chunks, layout.stages_per_rank) == \
        ("Wavefront", 1, 2, 1)
    assert layout.units == 2 and layout.style == "wavefront"
    looped = ParallelLayout(1, 2, 2, "Wavefront", 2, time_chunks=3)
    assert looped.stage_indices(0) == [0, 2] and looped.rank_of_stage(3) == 1 and looped.units == 6
    with pytest.raises(LayoutError, match=r"time_chunks=4 splits the time axis, which only schedule Wavefront does; "
                                          r"schedule 1F1B splits the batch"):
        ParallelLayout(1, 2, 1, "1F1B", 2, time_chunks=4)
    with pytest.raises(LayoutError, match=r"time_chunks must be a positive integer, got 0"):
        ParallelLayout(1, 2, 1, "Wavefront", 1, time_chunks=0)
    with pytest.raises(LayoutError, match=r"time_chunks=6 .* the shortest bucket has 5 steps \(buckets \[5, 9\]\); "
                                          r"allowed: 1 to 5, or 'auto'"):
        ParallelLayout(1, 2, 1, "Wavefront", 1, time_chunks=6).check_time_chunks([9, 5])
    with pytest.raises(LayoutError, match=r"time_chunks must be a positive integer, None or 'auto', got 'many'"):
        PlanOptions(time_chunks="many")
    assert PlanOptions(time_chunks="3").time_chunks == 3
    with pytest.raises(LayoutError, match=r"time_chunks='auto' .* schedule GPipe splits the batch"):
        PlanOptions(time_chunks="auto").check(["embedding", "lstm.0", "decoder"], ParallelLayout(1, 2, 1, "GPipe", 2))


def test_chunk_cost_fit_and_candidates():
    cost = ChunkCost.fit((20, 0.012), (5, 0.0045))  # 2 ms per call + 0.5 ms per step
    assert cost.fixed == pytest.approx(0.002) and cost.per_step == pytest.approx(0.0005)
    assert cost.seconds(10) == pytest.approx(0.007)
    assert ChunkCost.fit((20, 0.01), (5, 0.011)) == ChunkCost(0.011, 0.0)  # noise: never a negative slope
    assert ChunkCost.fit((20, 0.01), (20, 0.0)).seconds(20) == pytest.approx(0.01)
    assert chunk_candidates(35, [8, 16, 24], max_time_chunks=16) == list(range(1, 9))
    assert chunk_candidates(6, None, max_time_chunks=16) == [1, 2, 3, 4, 5, 6]


def test_auto_weighs_rows_against_chunks_with_the_step_model(monkeypatch):
    """Block times of 0.1 ms per call + 10 us per row and step: the plan fits that line per row count, predicts every
    rows x chunks pair with step_time over m x k units, picks the fastest, and the report says which and why."""
    def fake_seconds(model, names, rows, length, device, repeats=5, warmup=2):
        return {name: 1e-4 + 1e-5 * rows * length for name in names}

    monkeypatch.setattr(plan_module.profile, "block_seconds", fake_seconds)
    layout = ParallelLayout(1, 2, 1, "Wavefront", 1, time_chunks=2)
    plan = make_plan(tiny_model(num_layers=2), layout, PlanOptions(n_microbatches="auto", time_chunks="auto"), 8, 12,
                     CPU, bucket_lengths=[12, 20])
    predictions = {(m, k): t for m, k, t in plan.unit_predictions}
    assert sorted({m for m, _ in predictions}) == [1, 2, 4, 8] and sorted({k for _, k in predictions}) == list(
        range(1, 13))
    for (m, k), seconds in predictions.items():
        unit = 2 * (1e-4 + 1e-5 * (8 // m) * -(-12 // k))  # two blocks per rank
        assert seconds == pytest.approx(step_time([unit, unit], m * k)), (m, k)
    best = min(predictions, key=predictions.get)
    assert (plan.n_microbatches, plan.layout.time_chunks) == best == (1, 3)
    assert {m: (fixed, per_step) for m, fixed, per_step in plan.chunk_costs}[2] == pytest.approx((2e-4, 2 * 4e-5))
    text = report.render(plan)
    assert "axes: rows x time chunks = 1 x 3 = 3 units; bubble (S-1)/(units+S-1) = 25.0% with S=2" in text
    assert "auto chose m=1 x k=3: predicted" in text and "why: on this device" in text and "m=2: 1.09x" in text


def test_report_says_the_axes_came_from_the_options_when_not_auto():
    layout = ParallelLayout(1, 2, 1, "Wavefront", 2, time_chunks=4)
    plan = make_plan(tiny_model(num_layers=2), layout, PlanOptions(), 8, 12, CPU)
    assert plan.unit_predictions is None and (plan.n_microbatches, plan.layout.time_chunks) == (2, 4)
    text = report.render(plan)
    assert "axes: rows x time chunks = 2 x 4 = 8 units; bubble (S-1)/(units+S-1) = 11.1% with S=2" in text
    assert "axis chosen by the options: n_microbatches=2, time_chunks=4 as given" in text


def test_advice_prefers_time_chunks_when_rows_cost_nothing(monkeypatch):
    """The GPU curve (a block's time flat in rows, linear in length): a batch-split pipeline pays the whole batch's
    time per microbatch, a wavefront pipeline a chunk's."""
    monkeypatch.setattr(advice.profile, "block_seconds",
                        lambda model, names, rows, length, *args, **kwargs: {n: 1e-3 * length for n in names})
    candidates = advise(tiny_model(num_layers=2), 2, 16, 12, CPU, Calibration(((1, 1.0),), float("inf")), cores=2,
                        time_chunks=(2, 4, 12))
    best = candidates[0]
    assert (best.name, best.n_microbatches, best.time_chunks) == ("pp2 wavefront, m=1 x k=12", 1, 12)
    assert best.predicted_seconds == pytest.approx(step_time([2e-3, 2e-3], 12))  # two blocks of 1 step per rank
    batch_split = next(c for c in candidates if c.name.startswith("pp2 balanced"))
    assert batch_split.predicted_seconds >= 3 * 24e-3 * (1 - 1e-9)  # m + 1 >= 3 units of the whole batch's time


# ----- the engine against one process ------------------------------------------------------------------------
def _engine_worker(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    results = []
    for cfg in configs:
        cfg = dict(cfg)
        rows = cfg.pop("rows", 4)
        layout = ParallelLayout(**cfg)
        module = tiny_model(num_layers=max(2, layout.num_stages - 1))
        reference = copy.deepcopy(module)
        engine = cpu_engine(module, layout, rank)
        worst = {"loss": 0.0, "grad": 0.0, "eval": 0.0, "log_probs": 0.0, "tokens_equal": True}
        for inputs, targets in lm_batches(rows * layout.data_parallel_size, lengths=LENGTHS):
            module.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            result = engine.forward_backward((inputs, targets))  # each replica takes its rows of the global batch
            engine.reduce_gradients(module.parameters())
            logits = reference(inputs)[0]
            expected = token_loss_sum(logits, targets) / (targets != 0).sum()
            expected.backward()
            worst["loss"] = max(worst["loss"], rel_error(result.loss, expected.detach()))
            ref_params = dict(reference.named_parameters())
            for name, p in module.named_parameters():
                worst["grad"] = max(worst["grad"], rel_error(p.grad, ref_params[name].grad))
            worst["eval"] = max(worst["eval"], rel_error(engine.evaluate((inputs, targets)).loss, expected.detach()))
            got, want = engine.predict((inputs, targets)), prediction_from_logits(logits.detach(), targets)
            worst["log_probs"] = max(worst["log_probs"], rel_error(got["log_probs"], want["log_probs"]))
            worst["tokens_equal"] &= bool(torch.equal(got["next_token"], want["next_token"]))
        worst["params"] = sum(1 for _ in module.parameters())
        worst["shapes"] = engine.cached_shapes
        results.append({"config": cfg, **worst})
        dist.barrier()
    dist.destroy_process_group()
    return results


def _check(per_rank: list[list[dict]], rows: int = 4) -> None:
    for results in per_rank:
        for r in results:
            assert r["params"] > 0, r
            for key in ("loss", "grad", "eval", "log_probs"):
                assert r[key] < 1e-5, (key, r)
            assert r["tokens_equal"], r
            # One schedule per bucket shape and mode, built on first use and kept.
            assert {(length, mode) for _, length, mode in r["shapes"]} == {
                (n, mode) for n in LENGTHS for mode in ("train", "eval", "predict")}, r


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_one_process_and_the_state_gradient_that_makes_it_exact():
    configs = [_wavefront(pipeline_parallel_size=1, stages_per_rank=2, n_microbatches=1, time_chunks=3),
               _wavefront(pipeline_parallel_size=1, n_microbatches=2, time_chunks=6)]  # 6 > 5: one step per chunk
    _check(run_ranks(_engine_worker, 1, configs, timeout=180))
    # What the comparisons tell apart: chunks whose state is carried without its gradient (truncated BPTT) miss.
    model = tiny_model(num_layers=2)
    inputs, targets = lm_batches(4, lengths=(9,))[0]
    token_loss_sum(model(inputs)[0], targets).backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    state: list[Any] = [None, None]
    for steps in (slice(0, 5), slice(5, 9)):
        chunk = model.embedding(inputs[:, steps])
        for k, layer in enumerate(model.lstm):
            chunk, new = layer(chunk, state[k])
            state[k] = tuple(t.detach() for t in new)
        token_loss_sum(model.decoder(chunk), targets[:, steps]).backward()
    truncated = max(rel_error(p.grad, exact[n]) for n, p in model.named_parameters())
    assert truncated > 1e-3


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_two_processes_match_one_process():
    configs = [_wavefront(pipeline_parallel_size=2, time_chunks=2),
               _wavefront(pipeline_parallel_size=2, time_chunks=3, n_microbatches=2, rows=5),  # rows x chunks, ragged
               _wavefront(pipeline_parallel_size=2, stages_per_rank=2, time_chunks=4),  # 4 stages on 2 processes
               _wavefront(data_parallel_size=2, pipeline_parallel_size=1, time_chunks=2)]
    _check(run_ranks(_engine_worker, 2, configs, timeout=280))


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_four_processes_match_one_process():
    configs = [_wavefront(pipeline_parallel_size=4, time_chunks=3),
               _wavefront(data_parallel_size=2, pipeline_parallel_size=2, n_microbatches=2, time_chunks=2)]
    _check(run_ranks(_engine_worker, 4, configs, timeout=280))


# ----- whole Trainer runs: tied weights, buckets, stream mode ----------------------------------------------------
STEPS = 4
TIED_LAYOUTS = {
    "pp2 k=2": (2, _wavefront(time_chunks=2)),
    "pp2 x 2 stages, k=3": (2, _wavefront(stages_per_rank=2, time_chunks=3)),
    "pp4 k=2": (4, _wavefront(time_chunks=2)),
    "dp2 x pp2, m=2 x k=2": (4, _wavefront(data_parallel_size=2, n_microbatches=2, time_chunks=2)),
}


def _tied_model() -> Any:
    return tiny_model(num_layers=3, embedding_dim=8, hidden_size=8, tie_weights=True, optimizer="adam", lr=0.02)


def _fit_tied(strategy: Any, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    model, losses, grads = _tied_model(), TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=STEPS, gradient_clip_val=0.05,
                            limit_val_batches=0)
    trainer.fit(model, datamodule=FixedBatches(train_lengths=(5, 9, 7, 5)))
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"params": params, "losses": losses.values, "grads": grads.steps}


@pytest.fixture(scope="module")
def tied_reference() -> dict:
    return _fit_tied("auto", 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(TIED_LAYOUTS))
@pytest.mark.processes
def test_tied_weights_on_bucketed_batches_match_one_process(layout, tied_reference):
    processes, kwargs = TIED_LAYOUTS[layout]
    assert_split_equals_one_process(_fit_tied, processes, kwargs, tied_reference, STEPS)
    assert tied_reference["losses"][-1][1] < tied_reference["losses"][0][1]  # a moving run is compared


STREAM = {"source": "synthetic", "mode": "stream", "batch_size": 8, "bptt": 7, "eval_batch_size": 4, "seed": 2,
          "synthetic": {"num_train": 60, "num_valid": 20, "num_test": 20, "vocab_size": 30, "max_length": 10}}
STREAM_LAYOUTS = {
    "pp2 k=3": (2, _wavefront(time_chunks=3)),
    "dp2 x pp2, m=2 x k=4": (4, _wavefront(data_parallel_size=2, n_microbatches=2, time_chunks=4)),
}


def _fit_stream(strategy: Any, devices: int, carry_state: bool = True) -> dict:
    warnings.filterwarnings("ignore")
    data = LMDataModule(**STREAM)
    data.setup("fit")
    model = tiny_model(num_layers=3, vocab=data.vocab_size, optimizer="adam", lr=0.02, carry_state=carry_state)
    return fit_and_record(strategy, devices, model, data, STEPS)


@pytest.fixture(scope="module")
def stream_reference() -> dict:
    return _fit_stream("auto", 1)


def test_the_carried_state_changes_the_stream_run(stream_reference):
    """The comparisons below are about something: without the carried state every later step's gradients differ by
    far more than the tolerance."""
    stateless = _fit_stream("auto", 1, carry_state=False)
    for step in range(1, STEPS):
        got, expected = stateless["grads"][step], stream_reference["grads"][step]
        assert max(rel_error(got[name], expected[name]) for name in expected) > 1e-3, step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(STREAM_LAYOUTS))
@pytest.mark.processes
def test_stream_mode_with_carried_state_matches_one_process(layout, stream_reference):
    processes, kwargs = STREAM_LAYOUTS[layout]
    results = assert_split_equals_one_process(_fit_stream, processes, kwargs, stream_reference, STEPS)
    for r in results:
        assert r["val"] == pytest.approx(stream_reference["val"], rel=1e-5)
