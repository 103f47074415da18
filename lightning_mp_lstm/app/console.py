"""What a ``train.py`` run prints: each message once, from global rank 0 unless a rank has its own to say, and no
warning the project causes that its user could not act on.

:func:`quiet` installs, in every process of a run (each rank runs ``train()``):

- warning filters for what the user cannot change (:data:`QUIET_WARNINGS`);
- on the console handlers (not the log files): informational records from global rank 0 only, since every rank
  builds the same data and joins the same group, and the data's warnings too (a rank's own warnings and errors
  still show, marked with its rank by Lightning); each message once per process (``validate`` and ``test`` load
  the same checkpoint and read the same split); and none of Lightning's advertising tips.
"""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["QUIET_WARNINGS", "SHARED_LOGGERS", "OncePerProcess", "RankZeroInfo", "quiet"]

#: ``(message pattern, why it says nothing the user can act on)`` of the warnings :func:`quiet` hides.
QUIET_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "Lightning 2.6's own pytree helper on torch 2.13, once per batch fetcher"),
    (r".*sync_dist=True.*",
     "every rank already holds the same global loss and metrics (the strategy broadcasts them)"),
    (r"`ModelCheckpoint\(monitor=.*\)` could not find the monitored key",
     "a run stopping before its first validation has no val/loss to rank checkpoints by (after a validation a "
     "missing key is Lightning's error, not a warning); last.ckpt is still written"),
    (r"The dirpath has changed from .* therefore `best_model_score`",
     "a run resumed into another run directory than the one that wrote its checkpoint cannot carry that run's best-k "
     "bookkeeping over (the printed resume command resumes into the same one, where it does); its best_model_path "
     "still does"),
)

#: Informational lines that are Lightning's advertising, not about the run.
_TIPS = ("💡 Tip:",)


#: Loggers whose records every rank makes alike (each rank reads the same data): their warnings come from rank 0.
SHARED_LOGGERS = ("lightning_mp_lstm.data",)


class RankZeroInfo(logging.Filter):
    """Passes informational records only on global rank 0, and warnings of :data:`SHARED_LOGGERS` too (the same on
    every rank); a rank's own warnings and every error on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(rank_zero_only, "rank", 0) == 0 or record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and not record.name.startswith(SHARED_LOGGERS)


class OncePerProcess(logging.Filter):
    """Passes a message below ERROR only the first time this process logs it (the test split is read again for
    ``test`` after ``validate``); drops Lightning's tips."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        if message.startswith(_TIPS) or message in self.seen:
            return False
        self.seen.add(message)
        return True


_FILTERS = (RankZeroInfo(), OncePerProcess())


def _console_handlers() -> list[logging.Handler]:
    """The console handlers of the root logger and of Lightning's own loggers (which do not propagate)."""
    handlers = []
    for name in ("", "lightning.pytorch", "lightning.fabric"):
        # A test runner's capture handlers (pytest's are StreamHandlers too) record what the code logs: no console.
        handlers += [h for h in logging.getLogger(name).handlers
                     if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                     and not type(h).__module__.startswith("_pytest")]
    return handlers


def quiet() -> None:
    """Install the warning filters and the console filters (idempotent; call it in every process of a run)."""
    for pattern, _ in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for handler in _console_handlers():
        for log_filter in _FILTERS:
            if log_filter not in handler.filters:
                handler.addFilter(log_filter)
