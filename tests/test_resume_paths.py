"""Every way a user saves a run resumes exactly (issue #23).

A run is stopped and saved one way, then resumed with ``fit(..., ckpt_path=...)`` by fresh objects; its loss
curve after the resume (with the current epoch and batch index of every step) and its final parameters must equal
an uninterrupted run's (1e-5 relative), on every rank. The save paths:

* ``trainer.save_checkpoint`` after ``fit`` returned at ``max_steps`` (mid-epoch), after ``fit`` returned at
  ``max_epochs``, and after a ``KeyboardInterrupt`` ended ``fit`` (Lightning ends it gracefully and exits);
* ``ModelCheckpoint(every_n_train_steps=k)``, ``ModelCheckpoint(every_n_epochs=1)`` and
  ``ModelCheckpoint(save_last=True)`` (``last.ckpt``, written when ``max_steps`` ends the epoch early).

Each is resumed by steps (``max_steps``) and, on one process, also by epochs (``max_epochs``); with SGD and a
learning rate that decays every step (the scheduler's count must resume) and with Adam (optimizer state). Layouts:
one process with Lightning's default strategy and with ``mp_lstm``, pp2 and dp2 x pp2. The reference is one
uninterrupted one-process run per optimizer (every layout equals it, see ``tests/test_resume.py``).
"""

from __future__ import annotations

import signal
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.data import LMDataModule
from tests.helpers import assert_ranks_match, parameters_of, quiet_trainer, run_ranks

DATA = {"source": "synthetic", "batch_size": 8, "num_auto_buckets": 3, "shuffle": True, "seed": 5,
        "synthetic": {"num_train": 96, "num_valid": 16, "num_test": 16, "vocab_size": 40, "max_length": 12}}
EPOCH = 13  # global batches per epoch of DATA
MID = 5  # the mid-epoch stop
TOTAL = 2 * EPOCH  # the whole run: two epochs
OPTIMIZERS = ("sgd+schedule", "adam")
SAVE_PATHS = ("save_checkpoint at max_steps", "save_checkpoint at max_epochs", "save_checkpoint after Ctrl-C",
              "ModelCheckpoint every_n_train_steps", "ModelCheckpoint every_n_epochs", "ModelCheckpoint save_last")
#: Where each save path stops: mid-epoch or at the end of the first epoch.
STOPPED_AT = {path: EPOCH if "epochs" in path else MID for path in SAVE_PATHS}
RESUME_LIMITS = {"steps": {"max_steps": TOTAL}, "epochs": {"max_epochs": 2}}
LAYOUTS = {"pp2": dict(n_microbatches=2), "dp2_pp2": dict(data_parallel_size=2, n_microbatches=2, schedule="GPipe")}
#: The save paths the multi-process layouts run (every one; each rank runs them one after the other).
MULTI_PROCESS_PATHS = SAVE_PATHS


class StepDecayLanguageModel(LSTMLanguageModel):
    """SGD whose learning rate decays after every optimizer step."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Trace(pl.Callback):
    """``(global_step, current_epoch, batch_idx, train/loss)`` after every training batch."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.rows.append((trainer.global_step, trainer.current_epoch, batch_idx,
                          float(trainer.callback_metrics["train/loss"])))


class InterruptAt(pl.Callback):
    """Raise ``KeyboardInterrupt`` (what Ctrl-C does) at the end of global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def _strategy(layout: str) -> Any:
    if layout == "1 process":
        return "auto"
    return MPLSTMStrategy(report_after_steps=None, timeout=60, **LAYOUTS.get(layout, {}))


def _fit(layout: str, devices: int, optimizer: str, limits: dict, callbacks: tuple = (),
         ckpt_path: str | None = None) -> tuple[pl.Trainer, dict]:
    """Fit fresh objects; a ``KeyboardInterrupt`` ends ``fit`` as Lightning makes it (``SystemExit``)."""
    warnings.filterwarnings("ignore")
    data = LMDataModule(**DATA)
    data.setup("fit")
    torch.manual_seed(0)
    cls, lr = (StepDecayLanguageModel, 0.5) if optimizer == "sgd+schedule" else (LSTMLanguageModel, 0.01)
    model = cls(data.vocab_size, embedding_dim=6, hidden_size=8, num_layers=2, optimizer=optimizer.split("+")[0],
                lr=lr)
    trace = Trace()
    trainer = quiet_trainer(_strategy(layout), devices, [trace, *callbacks], limit_val_batches=0, **limits)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except SystemExit:  # Lightning's answer to KeyboardInterrupt, after shutting the fit down gracefully
        assert any(isinstance(c, InterruptAt) for c in callbacks)
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores Ctrl-C from then on
    assert trainer.num_training_batches == EPOCH
    return trainer, {"rows": trace.rows, "params": parameters_of(model), "steps": trainer.global_step}


def _save_and_resume(path: str, layout: str, devices: int, optimizer: str, resume: str, directory: str) -> dict:
    """Stop and save the run ``path``'s way, resume it from fresh objects; both parts' traces and the parameters."""
    directory = Path(directory)
    saved, callbacks = directory / "saved.ckpt", []
    limits = {"max_epochs": 1} if STOPPED_AT[path] == EPOCH else {"max_steps": MID}
    if path == "save_checkpoint after Ctrl-C":
        limits, callbacks = RESUME_LIMITS[resume], [InterruptAt(MID)]
    elif path == "ModelCheckpoint every_n_train_steps":
        callbacks = [ModelCheckpoint(dirpath=directory, filename="saved", every_n_train_steps=MID)]
    elif path == "ModelCheckpoint every_n_epochs":
        callbacks = [ModelCheckpoint(dirpath=directory, filename="saved", every_n_epochs=1)]
    elif path == "ModelCheckpoint save_last":
        # Writes last.ckpt (and epoch=0-step=5.ckpt) when max_steps ends the epoch early: on_train_epoch_end.
        callbacks, saved = [ModelCheckpoint(dirpath=directory, save_last=True)], directory / "last.ckpt"
    trainer, first = _fit(layout, devices, optimizer, limits, tuple(callbacks))
    try:
        if path.startswith("save_checkpoint"):
            trainer.save_checkpoint(saved)
    finally:
        if layout != "1 process" and devices == 1:
            trainer.strategy.shutdown()  # this process ran the job itself: release its process group
    trainer, resumed = _fit(layout, devices, optimizer, RESUME_LIMITS[resume], ckpt_path=str(saved))
    if layout != "1 process" and devices == 1:
        trainer.strategy.shutdown()
    return {"first": first, "resumed": resumed}


def _assert_resumes_exactly(per_rank: list[dict], reference: dict, path: str) -> None:
    stop = STOPPED_AT[path]
    for rank, run in enumerate(per_rank):
        for part, expected in (("first", reference["rows"][:stop]), ("resumed", reference["rows"][stop:])):
            got = run[part]["rows"]
            assert [r[:3] for r in got] == [r[:3] for r in expected], (rank, part)  # (step, epoch, batch_idx)
            for (step, _, _, loss), (_, _, _, want) in zip(got, expected):
                assert abs(loss - want) <= 1e-5 * abs(want), (rank, part, step, loss, want)
        assert run["resumed"]["steps"] == TOTAL, rank
    assert_ranks_match([run["resumed"]["params"] for run in per_rank], reference["params"])


_REFERENCES: dict[str, dict] = {}


def _reference(optimizer: str) -> dict:
    """The uninterrupted run (one process, Lightning's default strategy), once per optimizer."""
    if optimizer not in _REFERENCES:
        _, _REFERENCES[optimizer] = _fit("1 process", 1, optimizer, RESUME_LIMITS["steps"])
        assert [r[:3] for r in _REFERENCES[optimizer]["rows"]] == [
            (step + 1, step // EPOCH, step % EPOCH) for step in range(TOTAL)]
    return _REFERENCES[optimizer]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("resume", list(RESUME_LIMITS))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("path", SAVE_PATHS)
def test_one_process_resumes_exactly(path: str, optimizer: str, resume: str, tmp_path: Path) -> None:
    result = _save_and_resume(path, "1 process", 1, optimizer, resume, str(tmp_path))
    _assert_resumes_exactly([result], _reference(optimizer), path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SAVE_PATHS)
@pytest.mark.processes
def test_mp_lstm_on_one_process_resumes_exactly(path: str, tmp_path: Path) -> None:
    result = _save_and_resume(path, "mp_lstm", 1, "adam", "steps", str(tmp_path))
    _assert_resumes_exactly([result], _reference("adam"), path)


def _rank_worker(rank: int, world_size: int, layout: str, directory: str) -> dict:
    out = {}
    for i, path in enumerate(MULTI_PROCESS_PATHS):
        optimizer = OPTIMIZERS[i % len(OPTIMIZERS)]
        out[path] = _save_and_resume(path, layout, world_size, optimizer, "steps", f"{directory}/{i}")
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("layout", "world_size"), [("pp2", 2), ("dp2_pp2", 4)])
@pytest.mark.processes
def test_multi_process_layouts_resume_exactly(layout: str, world_size: int, tmp_path: Path) -> None:
    per_rank = run_ranks(_rank_worker, world_size, layout, str(tmp_path), timeout=540)
    for i, path in enumerate(MULTI_PROCESS_PATHS):
        reference = _reference(OPTIMIZERS[i % len(OPTIMIZERS)])
        _assert_resumes_exactly([result[path] for result in per_rank], reference, path)
