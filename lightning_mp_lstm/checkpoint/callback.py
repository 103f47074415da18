"""The run's checkpoint callback: Lightning's ``ModelCheckpoint``, whose step checkpoints do not wait for a
validation metric."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

__all__ = ["RunCheckpoint"]


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``every_n_train_steps`` saves happen at their step also when it monitors a metric.

    Lightning 2.6 defers a step save of a callback with ``monitor`` until the monitored metric exists, that is until
    the next validation (on ``train.py``'s default data, 2,500 steps later), without a word. Here such a step saves
    the ``last`` checkpoint (``save_last``) at once, a checkpoint that resumes exactly (it is written where
    Lightning writes every step checkpoint); the monitored, best checkpoint still waits for its metric. Without
    ``save_last`` nothing can be written without the metric, and that is said once. Takes ``ModelCheckpoint``'s
    arguments.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        every = self._every_n_train_steps
        if self.monitor is None or every < 1 or trainer.global_step % every or self._should_skip_saving_checkpoint(
                trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor in candidates:  # Lightning saved with the metric (or found it not among the best)
            return
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
        elif not getattr(self, "_warned_deferred", False):
            self._warned_deferred = True
            rank_zero_warn(f"RunCheckpoint(every_n_train_steps={every}, monitor={self.monitor!r}, save_last=False) "
                           f"saves nothing until {self.monitor!r} is logged (the next validation); set save_last=True "
                           "to save the last checkpoint every step interval")
