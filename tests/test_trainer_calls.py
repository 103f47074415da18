"""A Trainer's calls in any order train what one process trains: ``validate`` before ``fit``, ``validate`` between two
``fit`` calls. Lightning runs ``Trainer.validate`` under inference mode (on one device and with NCCL; with gloo under
``no_grad``) and a fit's validation without it, so what one evaluation makes must serve the next."""

from __future__ import annotations

import warnings

import pytest

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from tests.helpers import (
    FixedBatches,
    ValLosses,
    assert_ranks_match,
    evaluate_in_inference_mode,
    parameters_of,
    quiet_trainer,
    run_ranks,
    tiny_model,
)

STEPS = 3


def _calls(strategy, devices: int) -> dict:
    """Validate, fit ``STEPS`` steps (validating at the last), validate, fit ``STEPS`` more."""
    warnings.filterwarnings("ignore")
    model, validations = tiny_model(num_layers=3, optimizer="adam", lr=0.01), ValLosses()
    data = FixedBatches(validate_on_train=True)
    trainer = quiet_trainer(strategy, devices, [validations], max_steps=STEPS, max_epochs=-1,
                            val_check_interval=STEPS)
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(model, datamodule=data)
    return {"validations": validations.values, "loss": float(trainer.callback_metrics["train/loss"]),
            "steps": trainer.global_step, "params": parameters_of(model)}


def _calls_worker(rank: int, world_size: int, strategy_kwargs: dict, inference_mode: bool) -> dict:
    if inference_mode:
        evaluate_in_inference_mode()
    return _calls(MPLSTMStrategy(**strategy_kwargs), world_size)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _calls("auto", 1)  # one device: Lightning's validate runs under inference mode


def test_one_process_validates_fits_and_validates_between_fits(reference):
    """Failed before the evaluation means were updated out of place: the fit after a ``validate`` updated the
    inference tensors that validate had made, in place."""
    untrained = parameters_of(tiny_model(num_layers=3, optimizer="adam", lr=0.01))
    assert reference["steps"] == 2 * STEPS
    # validate, the first fit's validation (its last step), validate, the second fit's (at its 3rd and 6th step).
    assert len(reference["validations"]) == 4
    assert reference["validations"][1] == pytest.approx(reference["validations"][2], rel=1e-6)
    assert reference["validations"][0] > reference["validations"][1] > reference["validations"][3]
    assert max(float((p - untrained[n]).abs().max()) for n, p in reference["params"].items()) > 1e-3


def test_mp_lstm_on_one_process_evaluating_under_inference_mode_trains_as_plain_lightning(reference, monkeypatch):
    """As on one GPU (NCCL): Lightning's validate runs under inference mode with the strategy too."""
    evaluate_in_inference_mode(monkeypatch)
    result = _calls(MPLSTMStrategy(), 1)
    assert result["validations"] == pytest.approx(reference["validations"], rel=1e-6)
    assert_ranks_match([result["params"]], reference["params"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("strategy_kwargs", "inference_mode"), [
    (dict(schedule="1F1B", n_microbatches=2), False),
    (dict(schedule="1F1B", n_microbatches=2), True),
    (dict(schedule="ZBVZeroBubble", stages_per_rank=2, n_microbatches=2), True),
], ids=["1F1B", "1F1B, inference mode", "ZBVZeroBubble, inference mode"])
@pytest.mark.processes
def test_a_pipeline_validates_fits_and_validates_between_fits_as_one_process(reference, strategy_kwargs,
                                                                            inference_mode):
    """On two processes, with Lightning evaluating under inference mode as it does with NCCL, or under gloo's
    ``no_grad``: every validation's loss, the last training loss and every rank's parameters equal one process's."""
    results = run_ranks(_calls_worker, 2, strategy_kwargs, inference_mode, timeout=180)
    assert_ranks_match([r["params"] for r in results], reference["params"])
    for rank, result in enumerate(results):
        assert result["steps"] == 2 * STEPS, rank
        assert result["validations"] == pytest.approx(reference["validations"], rel=1e-5), rank
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5), rank
