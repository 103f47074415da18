"""What a language model logs in training (``lightning_mp_lstm.models.metrics``): the loss every step, the speed
where Lightning hands on-step values to its loggers, at an epoch's last batch and at the run's last step."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import FixedBatches, quiet_trainer, tiny_model


@pytest.mark.parametrize(("every", "max_steps", "speed_batches"), [(2, 5, [1, 3, 4]), (3, 4, [2, 3]), (1, 3, [1, 2])])
def test_the_speed_is_logged_at_logging_steps_and_the_last_the_loss_every_step(every, max_steps, speed_batches):
    warnings.filterwarnings("ignore")
    model = tiny_model()
    logged: dict[int, list[str]] = {}
    log = model.log

    def recording(name, value, *args, **kwargs):
        logged.setdefault(model.trainer.fit_loop.epoch_loop.batch_idx, []).append(name)
        return log(name, value, *args, **kwargs)

    model.log = recording
    trainer = quiet_trainer("auto", 1, max_steps=max_steps, max_epochs=1, log_every_n_steps=every,
                            limit_val_batches=0)
    trainer.fit(model, datamodule=FixedBatches())  # 5 training batches: the last one ends the epoch
    assert sorted(logged) == list(range(max_steps))
    assert all("train/loss" in names for names in logged.values())
    speed = [batch for batch, names in logged.items() if "train/tokens_per_s_step" in names]
    assert speed == speed_batches
    assert speed == [batch for batch, names in logged.items() if "train/tokens_per_s_epoch" in names]
    metrics = trainer.callback_metrics
    assert float(metrics["train/tokens_per_s_step"]) > 0 and float(metrics["train/tokens_per_s_epoch"]) > 0
