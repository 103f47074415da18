"""Stopping a run whose training loss diverges while staying finite.

A non-finite loss stops every rank at once, naming the block (the strategy's finite check). A loss that explodes to
``3e31`` is finite: without a guard the run trains to its end and exits as if all were well. :class:`DivergenceGuard`
stops it when the loss passes a bound, or when it has risen step after step for a number of steps.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mp_lstm.base.validation import check_positive_int, check_positive_number
from lightning_mp_lstm.strategy.stopping import expect_ranks_to_stop

__all__ = ["DivergenceError", "DivergenceGuard"]


class DivergenceError(FloatingPointError):
    """The training loss diverged (raised on every rank at the same step)."""


class DivergenceGuard(Callback):
    """Stop training when the training loss is above ``max_loss``, or has risen at each of the last ``patience``
    steps.

    Under ``mp_lstm`` the training loss is the global batch's, the same on every rank, so every rank stops at the same
    step without exchanging anything; with another strategy, give ``monitor`` a loss logged with ``sync_dist=True``.

    Args:
        max_loss: the bound (``None``: none). For a per-token cross-entropy in nats, a healthy run starts near
            ``ln(vocabulary size)``.
        patience: steps in a row the loss may rise before the run stops (``None``: not checked). Choose it well
            above the noise of batch-to-batch losses.
        monitor: the logged training loss; the step's returned loss where nothing of that name is logged.

    Raises:
        DivergenceError: naming the step, the loss and the bound it broke.
    """

    def __init__(self, max_loss: float | None = None, patience: int | None = None, monitor: str = "train/loss") -> None:
        self.max_loss = None if max_loss is None else check_positive_number("max_loss", max_loss)
        self.patience = None if patience is None else check_positive_int("patience", patience)
        self.monitor = monitor
        self._recent: deque[float] = deque(maxlen=(patience or 0) + 1)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recent.clear()

    def _loss(self, trainer: pl.Trainer, outputs: Any) -> float | None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None and isinstance(outputs, dict):
            value = outputs.get("loss")
        return None if value is None else float(value)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = self._loss(trainer, outputs)
        if loss is None or not math.isfinite(loss):  # a non-finite loss is the strategy's to report
            return
        self._recent.append(loss)
        recent = list(self._recent)
        problem = None
        if self.max_loss is not None and loss > self.max_loss:
            problem = f"{self.monitor} is {loss:.4g}, above max_loss={self.max_loss:g}"
        elif self.patience and len(recent) == self.patience + 1 and all(a < b for a, b in zip(recent, recent[1:])):
            problem = (f"{self.monitor} rose at each of the last {self.patience} steps (patience={self.patience}): "
                       + " -> ".join(f"{v:.4g}" for v in recent))
        if problem is None:
            return
        expect_ranks_to_stop(trainer)
        raise DivergenceError(
            f"mp_lstm: training diverged at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch_idx {batch_idx}): {problem}. Lower the learning rate or clip gradients (gradient_clip_val); "
            "checkpoints saved before this step hold the weights from before it"
        )
