"""Make the fit loop Lightning restored from a checkpoint agree with where training really stopped (issue #23).

Two cases of Lightning 2.6 (``lightning/pytorch/loops/fit_loop.py``, ``training_epoch_loop.py``) that a resumed
``fit`` gets wrong, whatever the strategy:

* **An epoch cut short.** ``FitLoop.on_advance_end`` (``fit_loop.py:476``) counts an epoch as processed, and runs
  ``on_train_epoch_end``, whenever the training-epoch loop returns, also when ``max_steps`` (or
  ``trainer.should_stop``) ended it after ``k`` of its ``N`` batches. A checkpoint saved then
  (``trainer.save_checkpoint`` after ``fit`` returned; ``ModelCheckpoint`` in ``on_train_epoch_end``:
  ``save_last``, ``every_n_epochs``) records a finished epoch, while its batch counters and the loader's position
  say ``k`` of ``N``. Resuming, Lightning starts the next epoch: it sets the sampler's epoch to the next one
  (``fit_loop.py:445``), which drops the loader's position, and counts that epoch's batches from ``k``, so the
  ``N - k`` remaining batches of the cut epoch are never trained and the next epoch stops after ``N - k``.
* **A finished epoch, resumed by steps** (upstream issue #19617). With ``max_steps`` set, the fit loop is always
  "restarting" (``fit_loop.py:139``); the training-epoch loop then restarts "on the last batch" of the finished
  epoch (``training_epoch_loop.py:182, 213``), so the next epoch counts from ``N`` and ends after one batch.

:func:`align_restored_fit_loop` repairs both. :class:`~lightning_mp_lstm.data.LMDataModule` calls it when the
fit loop asks for the training loader (``fit_loop.py:238``): after the loops were restored, before the loader's
saved position is loaded (``fit_loop.py:272``) and before the loops reset.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["align_restored_fit_loop"]

log = logging.getLogger("lightning_mp_lstm.data")


def _closed(progress: Any) -> bool:
    """The latest started epoch went through ``on_advance_end`` (processed), hooks run or running."""
    return (progress.ready == progress.started == progress.processed >= 1
            and progress.completed in (progress.processed, progress.processed - 1))


def align_restored_fit_loop(fit_loop: Any) -> str | None:
    """Repair a fit loop just restored from a checkpoint (no-op otherwise, and when there is nothing to repair).

    * **Epoch cut short** (closed although its last batch was not reached: ``k >= 1`` batches, not the last):
      reopen it as it was at the end of its batch ``k`` (the state a ``ModelCheckpoint(every_n_train_steps)``
      checkpoint of that batch has), so that the resumed ``fit`` continues that epoch with batch ``k + 1``, its
      current epoch and its shuffling seed, and the loader's saved position is loaded.
    * **Finished epoch, resumed by steps**: mark it completed and start the training-epoch loop afresh, as
      Lightning does when it resumes the same checkpoint by epochs.

    Args:
        fit_loop: ``trainer.fit_loop``.

    Returns:
        ``"cut epoch reopened"``, ``"finished epoch closed"`` or ``None`` (nothing done).
    """
    if not getattr(fit_loop, "is_resuming", False):  # only between restoring the loops and the first epoch
        return None
    epochs = fit_loop.epoch_progress
    if not (_closed(epochs.current) and _closed(epochs.total)):
        return None
    epoch_loop = fit_loop.epoch_loop
    batches = epoch_loop.batch_progress
    done = batches.current
    if not batches.is_last_batch and done.ready == done.started == done.processed == done.completed >= 1:
        for progress in (epochs.total, epochs.current):
            progress.processed -= 1
            progress.completed = progress.processed
        # As at the end of ``on_train_batch_end`` of batch k: Lightning counts it completed, and the batches that
        # stepped (the loggers' step) once more, when it resets a loop restored from that point.
        for progress in (batches.total, batches.current):
            progress.completed -= 1
        epoch_loop._batches_that_stepped -= 1
        fit_loop.restarting = True  # the epoch is open again: Lightning now loads the loader's saved position
        log.info("resuming inside epoch %d after its batch %d (the checkpoint closed the epoch early)",
                 epochs.current.processed, done.ready)
        return "cut epoch reopened"
    if fit_loop.restarting:  # forced by max_steps although the epoch is finished
        for progress in (epochs.total, epochs.current):
            progress.completed = progress.processed
        epoch_loop.restarting = False  # the next epoch starts from its first batch, counters reset
        return "finished epoch closed"
    return None
