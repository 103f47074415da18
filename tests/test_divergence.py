"""A finite but diverging loss stops the run (issue #32): above ``max_loss`` on every rank at the same step, or
after rising for ``patience`` steps in a row; a noisy but healthy loss does not."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import DivergenceError, DivergenceGuard, MPLSTMStrategy
from tests.helpers import RELIABILITY_MESSAGES, FixedBatches, quiet_trainer, run_ranks, tiny_model


def _feed(guard: DivergenceGuard, losses: list[float]) -> int:
    """Give ``guard`` one loss per step; the step it stopped at (``-1``: it did not)."""
    for step, loss in enumerate(losses, start=1):
        trainer = SimpleNamespace(callback_metrics={"train/loss": torch.tensor(loss)}, global_step=step,
                                  current_epoch=0, strategy=SimpleNamespace(launcher=None))
        try:
            guard.on_train_batch_end(trainer, None, None, None, step - 1)
        except DivergenceError as error:
            guard.message = str(error)
            return step
    return -1


def test_a_loss_rising_for_patience_steps_stops_and_a_noisy_one_does_not():
    noisy = [5.0, 4.8, 5.1, 4.7, 4.9, 4.6, 4.8, 4.5, 4.7] * 3
    assert _feed(DivergenceGuard(patience=4), noisy) == -1
    rising = [5.0, 4.8, 5.0, 5.3, 6.1, 9.0, 20.0]
    guard = DivergenceGuard(patience=4)
    assert _feed(guard, rising) == 6  # 4.8 -> 5.0 -> 5.3 -> 6.1 -> 9.0: four rises
    assert re.match(RELIABILITY_MESSAGES["diverging: rising"], guard.message), guard.message
    assert _feed(DivergenceGuard(), rising + [3e31]) == -1  # no bound, no patience: off
    with pytest.raises(ValueError, match=r"patience must be a positive integer, got 0"):
        DivergenceGuard(patience=0)


class _Explode(pl.Callback):
    """From batch 2 on, the rank that holds the decoder scales its weights up: finite, enormous logits."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2 and getattr(pl_module, "decoder", None) is not None:
            with torch.no_grad():
                pl_module.decoder.weight.mul_(1e6)


def _diverging_worker(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(n_microbatches=2, report_after_steps=None, timeout=30)
    trainer = quiet_trainer(strategy, world_size, [_Explode(), DivergenceGuard(max_loss=100.0)], max_steps=6)
    try:
        trainer.fit(tiny_model(), datamodule=FixedBatches())
    except DivergenceError as error:
        return {"message": str(error), "global_step": trainer.global_step}
    return {"message": None, "global_step": trainer.global_step}


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_a_loss_above_the_bound_stops_every_rank_at_the_same_step():
    results = run_ranks(_diverging_worker, 2, timeout=100)
    assert results[0] == results[1], results
    assert results[0]["global_step"] == 3, results  # the step with the enormous loss, and none after it
    assert re.match(RELIABILITY_MESSAGES["diverging: above max_loss"], results[0]["message"]), results[0]["message"]
