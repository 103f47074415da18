"""Stopping a run on a signal (a scheduler's ``SIGTERM``, Ctrl-C's ``SIGINT``, a closed terminal's ``SIGHUP``) at a
step boundary (the next but one), with a checkpoint to resume from.

Lightning 2.6 answers ``SIGTERM`` itself (``_SignalConnector._sigterm_notifier_fn``): its handler broadcasts a
tensor from rank 0 *inside the signal handler*, wherever the main thread is, in the middle of a pipeline transfer
too, so the ranks' collectives no longer pair up and the run hangs until the process-group timeout; and its loops
then raise ``SIGTERMException``, a ``SystemExit`` whose status is 0, without a checkpoint. Its SLURM requeue
handler saves a checkpoint (collectives again) inside the handler.

:class:`StopOnSignal` replaces those handlers while a Trainer stage runs. The handler only notes the signal. At the
end of every training step that stepped the optimizer, every rank learns with one small all-reduce, started at the
previous step's end and read at this one (no rank waits for the others), whether any rank got a signal by then; if
one did, they save a checkpoint together (:meth:`Trainer.save_checkpoint`, where a
``ModelCheckpoint(every_n_train_steps)`` saves: it resumes exactly) and every rank raises :class:`RunStopped`, whose
``exit_code`` is ``128 + the signal's number``, as a shell reports a process ended by that signal. Under SLURM with
``auto_requeue`` (Lightning's default there) the checkpoint is Lightning's HPC checkpoint, which a requeued job
resumes from by itself, and the requeue signal also requeues the job with Lightning's own requeue function. An
evaluation stage (``validate``/``test``/``predict``) stops at its next batch without a checkpoint: it changes no
weights. ``MPLSTMStrategy`` adds this callback to its Trainer (its ``stop_signals`` option).

A second Ctrl-C after the first goes to the handler that was there before the stage: Python's raises
``KeyboardInterrupt`` (checkpoints already written stay; the stop's own is written only if it was finished);
``train.py``'s ends every process at once with a short message that says which checkpoint is kept
(:mod:`lightning_mp_lstm.app.stopped`). Once a signal was received, this callback's handler stays installed after the
stage ends (Lightning restores the earlier handlers then), so that a second Ctrl-C while the processes end is
answered the same way. A ``SIGHUP`` also points this process's output, where it was a terminal, at ``/dev/null``: the
terminal is gone and every write to it fails (``EIO``); tqdm and ``logging`` swallow that, a plain ``print`` would fail
the run before it saves. Between Lightning's registration of its handlers and the first hook of a stage (its setup
barrier), and between stages of a run that got no signal, Lightning's handlers or Python's defaults apply.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_mp_lstm.base.faults import object_group

__all__ = ["STOP_SIGNALS", "RunStopped", "StopOnSignal", "check_stop_signals", "expect_ranks_to_stop", "received_stop"]

#: Signals a run may stop on (SIGKILL and SIGSTOP cannot be caught).
STOP_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: Signals a terminal sends to every process of the job it runs (Ctrl-C; closing it): global rank 0 speaks for all.
_EVERY_PROCESS = (signal.SIGINT, signal.SIGHUP)


def check_stop_signals(names: Any) -> tuple[signal.Signals, ...]:
    """The signals of ``names`` (a sequence of names from :data:`STOP_SIGNALS`).

    Raises:
        ValueError: ``names`` is not a sequence of those names (the message names the value and the allowed ones).
    """
    values = [names] if isinstance(names, str) else names
    try:
        values = list(values or ())
    except TypeError:
        values = [names]
    unknown = [v for v in values if not isinstance(v, str) or v.upper() not in STOP_SIGNALS]
    if unknown:
        raise ValueError(f"stop_signals: unknown signal {unknown[0]!r} in {names!r}; allowed: "
                         f"{', '.join(STOP_SIGNALS)}")
    return tuple(dict.fromkeys(signal.Signals[v.upper()] for v in values))


class RunStopped(RuntimeError):
    """A run stopped on a signal: raised on every rank at the same step, after the checkpoint (if any) was saved.

    Attributes:
        signal_name: the signal (``"SIGTERM"``...).
        exit_code: ``128 +`` the signal's number: what ``train.py`` exits with.
        checkpoint: where the run was saved (``None``: an evaluation stage, nothing to save).
        requeued: the SLURM job was requeued (it resumes from ``checkpoint`` by itself).
    """

    def __init__(self, signal_name: str, where: str, checkpoint: str | None = None, requeued: bool = False) -> None:
        self.signal_name, self.where, self.checkpoint, self.requeued = signal_name, where, checkpoint, requeued
        self.exit_code = 128 + int(signal.Signals[signal_name])
        if checkpoint is None:
            saved = "no checkpoint was written (evaluation changes no weights)"
        elif requeued:
            saved = f"saved a checkpoint to {checkpoint}; the SLURM job was requeued and resumes from it"
        else:
            saved = f"saved a checkpoint to {checkpoint}; resume from it with ckpt_path={checkpoint}"
        super().__init__(f"mp_lstm: stopped by {signal_name} {where}; {saved}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.signal_name, self.where, self.checkpoint, self.requeued)


def expect_ranks_to_stop(trainer: pl.Trainer) -> None:
    """Tell the launcher (``python train.py``'s) that every rank is about to end: its watcher would otherwise take a
    rank that exits first, with a non-zero status, for a crash and kill the others, global rank 0 included, in the
    middle of saving or reporting. Call it on every rank before the ranks end together."""
    stop_watching = getattr(trainer.strategy.launcher, "stop_watching", None)
    if callable(stop_watching):
        stop_watching()


def _requeue_signal(trainer: pl.Trainer) -> signal.Signals | None:
    """The requeue signal of a SLURM environment with ``auto_requeue``, else ``None``."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


class StopOnSignal(Callback):
    """Stop every rank at the same step boundary (the next but one) when any rank receives one of ``signals``; save a
    checkpoint first.

    Args:
        signals: names from :data:`STOP_SIGNALS` (``train.py``: ``SIGTERM``, ``SIGINT`` and ``SIGHUP``). Under SLURM
            with ``auto_requeue``, the environment's requeue signal is caught too.

    Raises:
        RunStopped: on every rank, after the checkpoint is saved.
    """

    #: The callback of this process that received a stop signal, if one did (:func:`received_stop`).
    received_by: StopOnSignal | None = None

    def __init__(self, signals: Any = ("SIGTERM",)) -> None:
        self.signals = check_stop_signals(signals)
        self.received: signal.Signals | None = None
        self.requeue = False
        self.is_global_zero = True
        #: The checkpoint this stop wrote, and its global step (set once the checkpoint is complete).
        self.saved: tuple[str, int] | None = None
        #: Where this stop writes its checkpoint (the previous one stays there until the new one is complete).
        self.last_checkpoint: str | None = None
        self._requeue_signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}  # the handlers this one replaced, for a second Ctrl-C
        self._terminals = [fd for fd in (1, 2) if _is_terminal(fd)]
        self._connector: Any = None
        #: Every rank stopped (``RunStopped`` raised): a further signal is answered by the earlier handler.
        self.stopped = False
        self._last_step = -1
        self._pending: tuple[Any, torch.Tensor] | None = None  # the agreement started at the last step boundary

    # ----- the handler: notes the signal, nothing else ---------------------------------------------------------
    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.is_global_zero = trainer.is_global_zero
        self._connector = trainer._signal_connector
        if trainer.state.fn == TrainerFn.FITTING:
            self.last_checkpoint = str(last_checkpoint_path(trainer))
        if trainer.received_sigterm:  # Lightning's handler ran before this one replaced it: take the signal over
            self._note(signal.SIGTERM)
            trainer._signal_connector.received_sigterm = False  # else Lightning's loop exits with status 0
        self._requeue_signal = requeue = _requeue_signal(trainer)
        before = getattr(self._connector, "_original_handlers", None) or {}  # what Lightning found and restores
        for signum in dict.fromkeys([*self.signals, *([requeue] if requeue is not None else [])]):
            previous = before.get(signum, signal.getsignal(signum))
            if previous != self._handle:
                self._previous[signum] = previous
            signal.signal(signum, self._handle)
        if self.received is not None:
            self._outlive_the_stage()

    def _note(self, signum: int, requeue: bool = False) -> None:
        if self.received is None:
            StopOnSignal.received_by = self
        if self.received is None or self.received == signal.SIGINT:
            self.received = signal.Signals(signum)
        self.requeue = self.requeue or requeue
        self._outlive_the_stage()

    def _outlive_the_stage(self) -> None:
        """Keep this handler installed when the stage ends (Lightning's teardown restores the handlers it found when
        the stage began): a second Ctrl-C while the processes end is then answered as one during the stage."""
        original = getattr(self._connector, "_original_handlers", None)
        if isinstance(original, dict):
            for signum in self._previous:
                original[signum] = self._handle

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and (signum == signal.SIGINT or self.stopped):
            # Ctrl-C again, or any signal once every rank stopped: the handler from before the stage answers it.
            self._pass_on(signum, frame)
            return
        if signum == signal.SIGHUP:  # the terminal is gone: a print to it would fail the run before it saves
            _detach(self._terminals)
        first = self.received is None
        self._note(signum, requeue=signum == self._requeue_signal)
        if first and (self.is_global_zero or signum not in _EVERY_PROCESS):  # each rank got it: say it once
            hint = " (Ctrl-C again ends every process at once)" if signum == signal.SIGINT else ""
            name = signal.Signals(signum).name
            write_now(f"\nmp_lstm: {name} received (pid {os.getpid()}): stopping at the end of the next step and "
                      f"saving a checkpoint{hint}\n")

    def _pass_on(self, signum: int, frame: Any) -> None:
        """Answer ``signum`` as the handler this one replaced would: call it, or do the default (``SIGINT``:
        ``KeyboardInterrupt``; another signal: end the process by it)."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            return
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._install(trainer)
        if signal.SIGTERM in self.signals:
            # Lightning broadcasts its SIGTERM flag from rank 0 at the start of every training batch, a collective
            # that lines every rank up once a step; with this handler in its place the flag can no longer be set.
            epoch_loop = trainer.fit_loop.epoch_loop
            if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
                epoch_loop._broadcast_sigterm_tensor = lambda: None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pending = None  # a failed rank may never join it: nothing to wait for

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    on_validation_start = on_test_start = on_predict_start = on_sanity_check_start

    def _evaluation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            self._settle()

    on_validation_end = on_test_end = on_predict_end = _evaluation_end

    # ----- the step boundary: agree, save, stop ----------------------------------------------------------------
    def _agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank had received a signal at the previous step boundary: one all-reduce (MAX) of two integers
        over every rank, started at that boundary and read at this one (long done by then), so no rank waits for the
        others at a step's end; every rank reads the same value, so all stop at the same boundary, one step after."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        group = object_group() if distributed else None
        # The object group is gloo (host memory) under mp_lstm; a default nccl group needs the device.
        nccl = distributed and dist.get_backend(group) == "nccl"
        device = trainer.strategy.root_device if nccl else torch.device("cpu")
        code = torch.tensor([int(self.received or 0), int(self.requeue)], device=device)
        if not distributed:
            return self._read(code)
        previous = self._pending
        self._pending = (dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group, async_op=True), code)
        if previous is None:
            return False
        work, agreed = previous
        work.wait()
        return self._read(agreed)

    def _read(self, code: torch.Tensor) -> bool:
        signum, requeue = (int(v) for v in code.tolist())
        if signum:
            self.received, self.requeue = signal.Signals(signum), bool(requeue)
        return bool(signum)

    def _settle(self) -> None:
        """Wait for an agreement still in flight (a stage ends: its collectives must not outlive it)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = trainer.global_step
        if not self._agreed(trainer):
            return
        expect_ranks_to_stop(trainer)
        where = (f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, after batch_idx {batch_idx} of "
                 f"{trainer.num_training_batches})")
        assert self.received is not None
        saved = self._save(trainer)
        self.stopped = True
        raise RunStopped(self.received.name, where, saved, requeued=self.requeue)

    def _save(self, trainer: pl.Trainer) -> str:
        """Save the run where it stands (every rank calls this): Lightning's HPC checkpoint (and requeue) under
        SLURM's auto-requeue, else the checkpoint callback's ``last`` file."""
        if _requeue_signal(trainer) is not None:
            connector = trainer._checkpoint_connector
            if self.requeue:  # Lightning's own requeue: saves the HPC checkpoint, then rank 0 runs scontrol requeue
                trainer._signal_connector._slurm_sigusr_handler_fn(self.received, None)
                return str(connector._hpc_resume_path)
            path = connector.hpc_save_path(trainer.default_root_dir)
        else:
            path = last_checkpoint_path(trainer)
            if isinstance(trainer.checkpoint_callback, ModelCheckpoint):  # its state, saved too, names its last file
                trainer.checkpoint_callback.last_model_path = path
        self.last_checkpoint = str(path)
        trainer.save_checkpoint(path, weights_only=False)
        self.saved = (str(path), trainer.global_step)
        return str(path)

    def _evaluation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit: the next training step stops
            return
        if self._agreed(trainer):
            expect_ranks_to_stop(trainer)
            assert self.received is not None and trainer.state.stage is not None
            self.stopped = True
            raise RunStopped(self.received.name, f"while running {trainer.state.stage.value}")

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _evaluation_batch_end


def received_stop() -> StopOnSignal | None:
    """The :class:`StopOnSignal` of this process that received a stop signal (the latest), or ``None``: what a
    handler for a second signal reads to say what was saved."""
    return StopOnSignal.received_by


def write_now(text: str) -> None:
    """Write ``text`` to standard error unbuffered (``os.write``: a print from a signal handler could re-enter the
    buffered writer the main thread is in); a terminal that is gone (``EIO``) or a closed pipe is skipped."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _detach(fds: list[int]) -> None:
    """Point ``fds`` (this process's output descriptors that were a terminal) at ``/dev/null``, as ``nohup`` does."""
    if not fds:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)
    fds.clear()


def last_checkpoint_path(trainer: pl.Trainer) -> str:
    """The ``last`` checkpoint of the Trainer's (first) ``ModelCheckpoint`` (``<dirpath>/last.ckpt``), else
    ``<default_root_dir>/checkpoints/last.ckpt``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        step = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
        return callback.format_checkpoint_name(step, filename=callback.CHECKPOINT_NAME_LAST)
    return str(Path(trainer.default_root_dir) / "checkpoints" / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt")
