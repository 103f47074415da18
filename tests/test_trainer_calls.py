"""A Trainer's calls in any order train what one process trains: ``validate`` before ``fit``, ``validate`` between two
``fit`` calls. Lightning runs ``Trainer.validate`` under inference mode (on one device and with NCCL; with gloo under
``no_grad``) and a fit's validation without it, so what one evaluation makes must serve the next. An evaluation of
several dataloaders gives each its own loss."""

from __future__ import annotations

import warnings

import pytest
from torch.utils.data import DataLoader

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from tests.helpers import (
    FixedBatches,
    ValLosses,
    assert_ranks_match,
    assert_same_predictions,
    evaluate_in_inference_mode,
    lm_batches,
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


def _validation_sets() -> list[list]:
    return [lm_batches(8, (6, 9), seed=4), lm_batches(8, (5, 7, 7), seed=11)]


class _SeveralValidationSets(FixedBatches):
    def __init__(self, which: int | None = None) -> None:
        super().__init__()
        self.which = which

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        sets = [self._shard(batches) for batches in _validation_sets()]
        return sets if self.which is None else sets[self.which]

    predict_dataloader = val_dataloader


def _validate_two_sets(strategy, devices: int, carry_state: bool = True) -> dict:
    warnings.filterwarnings("ignore")
    # Weights of up to 1 (not 0.1): the state a set starts from then shows in its predictions, not only its loss.
    model = tiny_model(num_layers=3, carry_state=carry_state, init_range=1.0)
    trainer = quiet_trainer(strategy, devices)
    together = trainer.validate(model, datamodule=_SeveralValidationSets(), verbose=False)
    alone = [trainer.validate(model, datamodule=_SeveralValidationSets(which), verbose=False)[0] for which in (0, 1)]
    predicted = trainer.predict(model, datamodule=_SeveralValidationSets())
    predicted_alone = [trainer.predict(model, datamodule=_SeveralValidationSets(which)) for which in (0, 1)]
    return {"together": together, "alone": alone, "predicted": predicted, "predicted_alone": predicted_alone}


def _validate_two_sets_worker(rank: int, world_size: int) -> dict:
    return _validate_two_sets(MPLSTMStrategy(schedule="1F1B", n_microbatches=2), world_size)


def _assert_each_set_as_alone(result: dict) -> None:
    for which, (together, alone) in enumerate(zip(result["together"], result["alone"], strict=True)):
        for name in ("val/loss", "val/ppl"):
            assert together[f"{name}/dataloader_idx_{which}"] == pytest.approx(alone[name], rel=1e-6), (which, name)
    for which, alone in enumerate(result["predicted_alone"]):
        assert_same_predictions(result["predicted"][which], alone)


@pytest.mark.parametrize("carry_state", [False, True])
def test_each_of_several_validation_sets_has_its_own_loss_in_one_process(carry_state):
    """The second set's loss was the mean over both sets (one mean for every dataloader); a model that carries its
    state across batches starts each set afresh, as when it is validated (or predicts) alone."""
    result = _validate_two_sets("auto", 1, carry_state)
    _assert_each_set_as_alone(result)
    assert abs(result["alone"][0]["val/loss"] - result["alone"][1]["val/loss"]) > 1e-3  # the sets differ


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_each_of_several_validation_sets_has_its_own_loss_on_a_pipeline():
    reference = _validate_two_sets("auto", 1)
    for result in run_ranks(_validate_two_sets_worker, 2, timeout=180):
        _assert_each_set_as_alone(result)
        for alone, expected in zip(result["alone"], reference["alone"], strict=True):
            assert alone == pytest.approx(expected, rel=1e-5)
        for alone, expected in zip(result["predicted_alone"], reference["predicted_alone"], strict=True):
            assert_same_predictions(alone, expected)
