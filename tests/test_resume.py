"""Resume anywhere: a checkpoint taken mid-epoch or at an epoch end, on any layout, continues on any layout
exactly as an uninterrupted run (final parameters of every rank and the logged loss curve, 1e-5 relative).

One uninterrupted one-process run is the reference. The interrupted runs stop after a number of optimizer steps
(mid-epoch: ``ModelCheckpoint(every_n_train_steps=...)``) or after an epoch and resume on another layout:
1 process -> pp2, pp2 -> pp2, pp2 -> dp2 x pp2 (epoch end), interleaved pp2 x 2 -> 1 process. The one-process
checkpoints come from Lightning's default strategy (optimizer state keyed by position).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.data import LMDataModule
from tests.helpers import (
    TrainLosses,
    assert_ranks_match,
    parameters_of,
    quiet_trainer,
    rel_error,
    run_ranks,
    tiny_model,
)

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

EPOCHS = 2
MID_EPOCH_STEP = 5  # not a multiple of the epoch's batches
DATA = {"source": "synthetic", "batch_size": 8, "num_auto_buckets": 3, "shuffle": True, "seed": 5,
        "synthetic": {"num_train": 96, "num_valid": 16, "num_test": 16, "vocab_size": 40, "max_length": 12}}
LAYOUTS = {
    "pp2": dict(n_microbatches=2),
    "dp2_pp2": dict(data_parallel_size=2, n_microbatches=2, schedule="GPipe"),
    "pp2_v2": dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2),
}


def _fit(strategy, devices: int, directory: Path, stop: dict | None = None, ckpt_path=None) -> dict:
    """Fit (``stop``: ``{"max_steps": k}`` or ``{"max_epochs": 1}`` for the first part of an interrupted run),
    saving a checkpoint where it stops; return the parameters, the loss curve and the checkpoint path."""
    warnings.filterwarnings("ignore")
    data = LMDataModule(**DATA)
    data.setup("fit")
    model = tiny_model(num_layers=2, vocab=data.vocab_size, optimizer="adam", lr=0.01)
    losses = TrainLosses()
    callbacks = [losses]
    if stop is not None:
        every = {"every_n_train_steps": stop["max_steps"]} if "max_steps" in stop else {"every_n_epochs": 1}
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="stop", save_top_k=-1, **every))
    limits = stop or {"max_epochs": EPOCHS}
    trainer = quiet_trainer(strategy, devices, callbacks, limit_val_batches=0, **limits)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return {"params": parameters_of(model), "losses": losses.values, "steps": trainer.global_step,
            "checkpoint": str(directory / "stop.ckpt")}


def _mp(name: str) -> MPLSTMStrategy:
    return MPLSTMStrategy(report_after_steps=None, timeout=60, **LAYOUTS[name])


def _two_rank_worker(rank: int, world_size: int, tmp: str, one_process_checkpoint: str) -> dict:
    tmp_path = Path(tmp)
    out = {"1proc->pp2": _fit(_mp("pp2"), 2, tmp_path / "unused", ckpt_path=one_process_checkpoint)}
    first = _fit(_mp("pp2"), 2, tmp_path / "pp2_mid", stop={"max_steps": MID_EPOCH_STEP})
    out["pp2->pp2"] = _fit(_mp("pp2"), 2, tmp_path / "unused", ckpt_path=first["checkpoint"])
    out["pp2 epoch end"] = _fit(_mp("pp2"), 2, tmp_path / "pp2_epoch", stop={"max_epochs": 1})
    out["pp2_v2 mid"] = _fit(_mp("pp2_v2"), 2, tmp_path / "pp2_v2_mid", stop={"max_steps": MID_EPOCH_STEP})
    return out


def _four_rank_worker(rank: int, world_size: int, checkpoint: str, tmp: str) -> dict:
    return _fit(_mp("dp2_pp2"), 4, Path(tmp) / "unused", ckpt_path=checkpoint)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("resume")
    reference = _fit("auto", 1, tmp / "unused")
    one_process = _fit("auto", 1, tmp / "one_mid", stop={"max_steps": MID_EPOCH_STEP})
    two = run_ranks(_two_rank_worker, 2, str(tmp), one_process["checkpoint"], timeout=280)
    four = run_ranks(_four_rank_worker, 4, two[0]["pp2 epoch end"]["checkpoint"], str(tmp), timeout=200)
    back_to_one = _fit("auto", 1, tmp / "unused", ckpt_path=two[0]["pp2_v2 mid"]["checkpoint"])
    return {"reference": reference, "one_process": one_process, "two": two, "four": four,
            "back_to_one": back_to_one}


def _assert_continues(resumed_per_rank: list[dict], reference: dict, resumed_from_step: int) -> None:
    assert_ranks_match([r["params"] for r in resumed_per_rank], reference["params"])
    expected = [(step, loss) for step, loss in reference["losses"] if step > resumed_from_step]
    for rank, resumed in enumerate(resumed_per_rank):
        assert resumed["steps"] == reference["steps"], rank
        assert [step for step, _ in resumed["losses"]] == [step for step, _ in expected], rank
        for (step, got), (_, want) in zip(resumed["losses"], expected):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, step, got, want)


@pytest.mark.timeout(600)
def test_the_interruptions_stop_where_intended(runs):
    reference = runs["reference"]
    epoch_steps = reference["steps"] // EPOCHS
    assert epoch_steps > MID_EPOCH_STEP and epoch_steps % MID_EPOCH_STEP  # the mid-epoch stops are mid-epoch
    mid = read_checkpoint(runs["one_process"]["checkpoint"])
    assert mid["global_step"] == MID_EPOCH_STEP and mid["epoch"] == 0
    (loader_state,) = mid["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["batches_done"] == MID_EPOCH_STEP  # consumed batches, not prefetched ones
    # Positional optimizer state: what Lightning's default strategy writes.
    assert all(isinstance(i, int) for g in mid["optimizer_states"][0]["param_groups"] for i in g["params"])
    end = read_checkpoint(runs["two"][0]["pp2 epoch end"]["checkpoint"])
    assert end["global_step"] == epoch_steps
    # The loss curve of the first part equals the reference's first steps.
    first = runs["one_process"]["losses"]
    assert len(first) == MID_EPOCH_STEP
    assert all(abs(a - b) <= 1e-5 * abs(b) for (_, a), (_, b) in zip(first, reference["losses"]))


@pytest.mark.timeout(600)
def test_one_process_mid_epoch_checkpoint_resumes_on_pp2(runs):
    _assert_continues([r["1proc->pp2"] for r in runs["two"]], runs["reference"], MID_EPOCH_STEP)


@pytest.mark.timeout(600)
def test_pp2_mid_epoch_checkpoint_resumes_on_pp2(runs):
    _assert_continues([r["pp2->pp2"] for r in runs["two"]], runs["reference"], MID_EPOCH_STEP)


@pytest.mark.timeout(600)
def test_pp2_epoch_end_checkpoint_resumes_on_dp2_pp2(runs):
    epoch_steps = runs["reference"]["steps"] // EPOCHS
    _assert_continues(runs["four"], runs["reference"], epoch_steps)


@pytest.mark.timeout(600)
def test_interleaved_mid_epoch_checkpoint_resumes_in_one_process(runs):
    _assert_continues([runs["back_to_one"]], runs["reference"], MID_EPOCH_STEP)


@pytest.mark.timeout(600)
def test_without_the_loader_state_the_resumed_run_would_differ(runs, tmp_path):
    """The comparisons above can fail: dropping the saved data position replays the epoch's first batches."""
    checkpoint = read_checkpoint(runs["one_process"]["checkpoint"])
    del checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(checkpoint, tmp_path / "no_position.ckpt")
    replayed = _fit("auto", 1, tmp_path / "unused", ckpt_path=tmp_path / "no_position.ckpt")
    worst = max(rel_error(p, runs["reference"]["params"][n]) for n, p in replayed["params"].items())
    assert worst > 1e-3
