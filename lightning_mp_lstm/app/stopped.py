"""A run of ``train.py`` stopped on a signal, and resumed.

:func:`exit_when_stopped` ends the program when every rank stopped (``RunStopped``, from
:class:`~lightning_mp_lstm.strategy.stopping.StopOnSignal`): global rank 0 prints where the run stopped and the
command that resumes it (:func:`resume_command`: this job's overrides, its run folder and the checkpoint), the run's
log file gets the same lines, and the status is 128 + the signal's number. A second Ctrl-C ends every process at once,
with a line that says which checkpoint is kept. A run resumed into its folder continues its ``metrics.csv``
(:func:`continue_logs`) instead of Lightning's ``CSVLogger`` deleting it.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_mp_lstm.strategy.launcher import hydra_quote
from lightning_mp_lstm.strategy.stopping import RunStopped, StopOnSignal, received_stop, write_now

__all__ = ["continue_logs", "exit_when_stopped", "resume_command"]

#: What Lightning's ``CSVLogger`` calls the file of a run's metrics.
METRICS_FILE = "metrics.csv"


def _quoted(value: str) -> str:
    """``value`` as a Hydra override value: as it is when plain, else quoted (``,``, ``=``, spaces...)."""
    return value if re.fullmatch(r"[\w./-]+", value) else hydra_quote(value)


def resume_command(checkpoint: str) -> str:
    """The command that resumes this Hydra job from ``checkpoint`` in the same run folder: the program, this job's
    overrides, ``hydra.run.dir`` set to the job's folder (the resumed run writes its checkpoints and logs beside the
    stopped run's, and continues its ``metrics.csv``) and ``ckpt_path`` set to ``checkpoint``. Outside a Hydra job
    there is no run folder: ``ckpt_path=<checkpoint>`` alone."""
    from hydra.core.hydra_config import HydraConfig

    overrides: list[str] = []
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        overrides = [o for o in hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") != "ckpt_path"]
        overrides.append(f"hydra.run.dir={_quoted(str(hydra.runtime.output_dir))}")
    return shlex.join(["python", sys.argv[0] or "train.py", *overrides, f"ckpt_path={_quoted(checkpoint)}"])


def _to_log_files(text: str) -> None:
    """Write ``text`` to the run's log files (Hydra's ``<run folder>/<job name>.log``): the terminal that started a run
    stopped by ``SIGHUP`` is gone, and a batch job's output may be too."""
    record = logging.LogRecord("lightning_mp_lstm", logging.WARNING, __file__, 0, text.strip(), None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                handler.handle(record)
            except Exception:  # noqa: BLE001  (a log file that cannot be written: the message was printed)
                pass


def _say(text: str) -> None:
    """Print ``text`` on standard error after what is buffered (a terminal that is gone is skipped), and write it to
    the run's log files. Not from a signal handler (the buffered writers could be in use): use ``write_now``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    write_now(text)
    _to_log_files(text)


def at_once_message(stop: StopOnSignal, signum: int) -> str:
    """What global rank 0 says when a second Ctrl-C ends every process at once: which checkpoint is kept."""
    name = signal.Signals(signum).name
    if stop.saved is not None:
        path, step = stop.saved
        kept = f"the stop's checkpoint of global step {step} was written to {path}"
    elif stop.last_checkpoint and Path(stop.last_checkpoint).exists():
        path = stop.last_checkpoint
        kept = f"the stop's checkpoint was not written; {path} holds the last checkpoint written before it"
    else:
        return f"\nmp_lstm: {name} again: ended every process at once; no checkpoint of this run was written\n"
    return f"\nmp_lstm: {name} again: ended every process at once; {kept}\nResume with: {resume_command(path)}\n"


#: Whether this process printed where its run stopped (a second Ctrl-C after that has nothing to add).
_TOLD: list[bool] = [False]


def _end_at_once(signum: int, frame: Any) -> None:
    """``train.py``'s answer to a second Ctrl-C: end this process now, saying (global rank 0, unless it said where the
    run stopped already) what was kept. Before any stop signal, Python's: ``KeyboardInterrupt``."""
    stop = received_stop()
    if stop is None:
        signal.default_int_handler(signum, frame)
        return
    if stop.is_global_zero and not _TOLD[0]:
        write_now(at_once_message(stop, signum))
    # At once: no interpreter shutdown (and no collective left half done); a checkpoint file is replaced whole or not.
    os._exit(128 + signum)


@contextmanager
def exit_when_stopped() -> Iterator[None]:
    """Around ``train(cfg)`` in ``train.py``: a run stopped on a signal
    (:class:`~lightning_mp_lstm.strategy.stopping.RunStopped`) ends the program with its ``exit_code`` (``128 +`` the
    signal's number: 143 for ``SIGTERM``, 130 for Ctrl-C, 129 for ``SIGHUP``), after global rank 0 printed where it
    stopped and the command that resumes it (also written to the run's log file), instead of a traceback. A second
    Ctrl-C, at any moment after the first, ends every process at once, exit status 130, with one line saying which
    checkpoint is kept."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if main:
        signal.signal(signal.SIGINT, _end_at_once)
    ending = False
    try:
        yield
    except RunStopped as stopped:
        ending = True  # the handler stays: a second Ctrl-C while the program ends ends it at once
        if rank_zero_only.rank == 0:
            lines = [f"\n{stopped}"]
            if stopped.checkpoint and not stopped.requeued:
                lines.append(f"Resume with: {resume_command(stopped.checkpoint)}")
            _say("\n".join(lines) + "\n")
            _TOLD[0] = True
        raise SystemExit(stopped.exit_code) from None
    finally:
        if main and not ending:
            signal.signal(signal.SIGINT, previous)


def _logged_before(row: dict[str, Any], step: int) -> bool:
    """Whether a ``metrics.csv`` row was logged before global step ``step`` (a row without a readable step is kept)."""
    try:
        return float(row.get("step") or "") < step
    except ValueError:
        return True


def continue_logs(trainer: pl.Trainer, step: int) -> None:
    """A run resumed from a checkpoint of global step ``step`` into a folder that already holds a ``metrics.csv`` of
    its ``CSVLogger`` continues it: Lightning's logger deletes the file when it starts; here the rows logged before
    ``step`` are kept (rows of later steps, from the part after an earlier checkpoint, are dropped: the resumed run
    logs those steps again) and the resumed run's rows follow. On global rank 0, before ``fit``."""
    if rank_zero_only.rank != 0:
        return
    # Lightning's ModelCheckpoint also warns that the folder it resumes into "exists and is not empty": expected here.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    for logger in trainer.loggers:
        path = Path(logger.log_dir) / METRICS_FILE if isinstance(logger, CSVLogger) else None
        if path is None or not path.is_file():
            continue
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            header = sorted(reader.fieldnames or [])
            rows = [row for row in reader if _logged_before(row, step)]
        with warnings.catch_warnings():  # "Previous log files in this directory will be deleted": not these
            warnings.simplefilter("ignore")
            writer = logger.experiment  # Lightning's writer: it deleted the file
        writer.metrics_keys = header
        with path.open("w", newline="") as handle:
            out = csv.DictWriter(handle, fieldnames=header)
            out.writeheader()
            out.writerows(rows)
