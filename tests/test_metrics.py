"""What a language model logs in training (``lightning_mp_lstm.models.metrics``): the loss every step, the speed
where Lightning hands on-step values to its loggers, at an epoch's last batch and at the run's last step."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lightning_mp_lstm.models.metrics as metrics_module
from lightning_mp_lstm.models.metrics import LanguageModelMetrics, TokenMean
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


def test_the_epoch_speed_is_the_mean_of_every_step_logged_or_not(monkeypatch):
    # Steps of 1, 2, 4 and 5 s of 100 tokens each after the epoch's first; Lightning logs every third step.
    clock = iter([0.0, 1.0, 3.0, 7.0, 12.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=3, is_last_batch=False, should_stop=False, max_steps=-1)
    logged: list[tuple[int, str, Any]] = []
    module = SimpleNamespace(_trainer=trainer, log=lambda name, value, **kw: logged.append((trainer.global_step, name,
                                                                                          value)))
    metrics = LanguageModelMetrics()
    metrics.start_epoch()
    for step in range(5):
        trainer.global_step = step
        trainer.is_last_batch = step == 4
        metrics.log(module, "train", torch.tensor(1.0), torch.tensor(100), rows=2)
    speeds = {(step, name): value for step, name, value in logged if name.startswith("train/tokens_per_s")}
    assert sorted(speeds) == [(2, "train/tokens_per_s_epoch"), (2, "train/tokens_per_s_step"),
                              (4, "train/tokens_per_s_epoch"), (4, "train/tokens_per_s_step")]
    assert float(speeds[2, "train/tokens_per_s_step"]) == pytest.approx(200 / 3)  # 200 tokens in 1 + 2 s
    assert float(speeds[4, "train/tokens_per_s_step"]) == pytest.approx(200 / 9)  # 200 tokens in 4 + 5 s
    epoch = speeds[4, "train/tokens_per_s_epoch"]  # the metric Lightning computes at the epoch's end
    assert float(epoch.compute()) == pytest.approx((100 + 50 + 25 + 20) / 4)
    assert epoch._update_count == 2  # updated at the two logging steps only (its NaN check reads the device)


def test_a_token_mean_made_under_inference_mode_adds_up_outside_it():
    """``Trainer.validate`` evaluates under inference mode (one device, NCCL), a fit's validation without it: a mean
    made (or reset) by the first is updated by the second, which an in-place update of its states refused."""
    with torch.inference_mode():
        mean = TokenMean()
        mean.update(torch.tensor(2.0), torch.tensor(3.0))
    with torch.no_grad():
        mean.update(torch.tensor(4.0), torch.tensor(1.0))
    assert float(mean.compute()) == pytest.approx((2 * 3 + 4 * 1) / 4)
    with torch.inference_mode():
        mean.reset()
    mean.update(torch.tensor(5.0), torch.tensor(2.0))
    assert float(mean.compute()) == pytest.approx(5.0)
