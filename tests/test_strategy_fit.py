"""`Trainer.fit` with the mp_lstm strategy equals one process on the same global batches."""

from __future__ import annotations

import warnings

import pytest

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from tests.helpers import (
    FixedBatches,
    assert_ranks_match,
    assert_same_predictions,
    parameters_of,
    quiet_trainer,
    replica_share,
    run_ranks,
    tiny_model,
)

STEPS = 5
ACCUMULATE = 2
TRAIN_LENGTHS = (5, 9, 7, 5, 9) * ACCUMULATE


def _data() -> FixedBatches:
    return FixedBatches(TRAIN_LENGTHS)


def _model(optimizer: str):
    lr = 0.5 if optimizer == "sgd" else 0.01
    return tiny_model(num_layers=3, optimizer=optimizer, lr=lr, momentum=0.9 if optimizer == "sgd" else 0.0)


def _fit(strategy, devices: int, optimizer: str) -> dict:
    warnings.filterwarnings("ignore")
    model = _model(optimizer)
    trainer = quiet_trainer(strategy, devices, max_steps=STEPS, max_epochs=1, accumulate_grad_batches=ACCUMULATE,
                            gradient_clip_val=0.05, num_sanity_val_steps=1)
    trainer.fit(model, datamodule=_data())
    fitted_layout = getattr(trainer.strategy, "layout", None) if devices > 1 else None
    fingerprint = trainer.strategy.plan.fingerprint if devices > 1 else None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    params = parameters_of(model)
    validated = trainer.validate(model, datamodule=_data(), verbose=False)
    predictions = trainer.predict(model, datamodule=_data())
    replica = (trainer.strategy.data_parallel_rank, fitted_layout.data_parallel_size) if devices > 1 else (0, 1)
    return {"metrics": metrics, "params": params, "validate": validated, "predict": predictions, "replica": replica,
            "steps": trainer.global_step, "fitted_layout": fitted_layout, "fingerprint": fingerprint,
            "layout_after_predict": getattr(trainer.strategy, "layout", None) if devices > 1 else None}


def _fit_worker(rank: int, world_size: int, strategy_kwargs: dict, optimizer: str) -> dict:
    return _fit(MPLSTMStrategy(**strategy_kwargs), world_size, optimizer)


def _compare(results: list[dict], reference: dict) -> None:
    assert_ranks_match([r["params"] for r in results], reference["params"])
    for rank, r in enumerate(results):
        assert r["steps"] == reference["steps"] == STEPS, rank
        # Every rank sees the global losses, so logging and monitoring work unchanged.
        for key in ("train/loss", "val/loss", "val/ppl"):
            assert r["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5), (rank, key)
        assert r["validate"][0]["val/loss"] == pytest.approx(reference["validate"][0]["val/loss"], rel=1e-5)
        # Each replica was given its share of every batch: each of its ranks returns that share's predictions.
        assert_same_predictions(r["predict"], replica_share(reference["predict"], *r["replica"]))


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {opt: _fit("auto", 1, opt) for opt in ("sgd", "adam")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.processes
def test_fit_pp2_equals_single_process(references, optimizer):
    results = run_ranks(_fit_worker, 2, dict(schedule="1F1B", n_microbatches=2), optimizer, timeout=180)
    _compare(results, references[optimizer])


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_fit_dp2_pp2_equals_single_process(references):
    kwargs = dict(data_parallel_size=2, schedule="GPipe", n_microbatches=2)
    _compare(run_ranks(_fit_worker, 4, kwargs, "adam", timeout=280), references["adam"])


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_fit_pp2_v2_interleaved_equals_single_process(references):
    kwargs = dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=4)
    _compare(run_ranks(_fit_worker, 2, kwargs, "sgd", timeout=280), references["sgd"])


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_fit_balanced_partition_and_auto_microbatches_equal_single_process(references):
    """Profiling on rank 0 (time costs, microbatch sizes) changes the split, never the numbers."""
    kwargs = dict(partition="balanced", balance_by="time", n_microbatches="auto", schedule="1F1B")
    results = run_ranks(_fit_report_worker, 2, kwargs, "adam", timeout=180)
    _compare(results, references["adam"])
    for r in results:
        m = r["fitted_layout"].n_microbatches
        predictions = dict(r["predictions"])
        assert sorted(predictions) == [2, 4, 8]  # divisors of the 8-row batch 1F1B accepts with 2 stages
        assert m == min(predictions, key=lambda k: (predictions[k], k))  # the predicted fastest
        assert r["layout_after_predict"] == r["fitted_layout"]  # validate/predict keep the m chosen in fit
        assert r["measured"] is not None and len(r["measured"]) == 2 and min(r["measured"]) > 0
        assert r["partition"] == results[0]["partition"]  # every rank uses rank 0's plan
        assert r["predictions"] == results[0]["predictions"]
        assert r["fingerprint"] == results[0]["fingerprint"] == r["fingerprint_after_predict"]


def _fit_report_worker(rank: int, world_size: int, strategy_kwargs: dict, optimizer: str) -> dict:
    strategy = MPLSTMStrategy(report_after_steps=3, **strategy_kwargs)
    result = _fit(strategy, world_size, optimizer)
    plan = strategy.plan
    return {**result, "predictions": plan.predictions, "measured": strategy.measurements.stage_seconds,
            "partition": strategy.partition, "fingerprint": result["fingerprint"],
            "fingerprint_after_predict": plan.fingerprint}


def test_references_see_every_batch_once_per_step(references):
    # The single-process references are what the comparisons trust: they must have trained and moved.
    untrained = parameters_of(_model("adam"))
    moved = max(float((p - untrained[n]).abs().max()) for n, p in references["adam"]["params"].items())
    assert references["adam"]["steps"] == STEPS and moved > 1e-3


@pytest.mark.processes
def test_the_steps_leave_what_setup_built_out_of_the_collectors_passes():
    """A full pass of Python's collector over everything imported and built took about 200 ms on the 2-core box: the
    main job's step 26 took 242 ms where its neighbours took 19. The steps run with those objects frozen out of the
    collector's passes (``gc.freeze``), and teardown puts them back."""
    import gc

    import lightning.pytorch as pl

    frozen: list[int] = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            frozen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, verify=False)
    quiet_trainer(strategy, 1, [Watch()], max_steps=2, limit_val_batches=0).fit(tiny_model(),
                                                                              datamodule=FixedBatches())
    assert len(frozen) == 2 and min(frozen) > 50_000  # torch and Lightning alone hold more objects than that
    assert gc.get_freeze_count() == 0
    strategy.shutdown()
