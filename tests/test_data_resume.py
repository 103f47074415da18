"""Exact resume of the data order: the batch sampler's and loader's state, and Lightning fits resumed from
mid-epoch and epoch-end checkpoints (one process)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

from lightning_mp_lstm.data import BucketBatchSampler, LMDataModule, ResumableDataLoader
from tests.helpers import TrainLosses, parameters_of, quiet_trainer, rel_error, tiny_model

SIZES = [13, 40, 7, 22, 31]  # examples per bucket
LENGTHS = [4, 8, 12, 16, 20]
EPOCH = 3


def _bucket_indices() -> np.ndarray:
    indices = np.repeat(np.arange(len(SIZES)), SIZES)
    np.random.default_rng(0).shuffle(indices)
    return indices


def _sampler(**kwargs: Any) -> BucketBatchSampler:
    kwargs = {"batch_size": 6, "seed": 11, **kwargs}
    return BucketBatchSampler(_bucket_indices(), LENGTHS, **kwargs)


def _epoch(epoch: int, **kwargs: Any) -> list[list[int]]:
    """The global batches of ``epoch`` (one replica)."""
    s = _sampler(**kwargs)
    s.set_epoch(epoch)
    return [b.tolist() for b in s.global_batches()]


def _global_batches_after_loading(state: dict, replicas: int, weights: list[float] | None = None) -> list[list[int]]:
    """What ``replicas`` fresh samplers that load ``state`` yield, the ranks' shares concatenated."""
    shards = []
    for rank in range(replicas):
        s = _sampler(num_replicas=replicas, rank=rank, replica_weights=weights)
        s.load_state_dict(state)
        shards.append(list(s))
        assert len(s) == 22  # len() stays the whole epoch's
    assert len({len(x) for x in shards}) == 1
    return [sum(parts, []) for parts in zip(*shards)]


# ----------------------------------------------------------------------------------------------- sampler state
@pytest.mark.parametrize(("replicas", "weights"), [(1, None), (2, None), (3, [1.0, 2.0, 0.5])])
def test_loaded_sampler_yields_the_remaining_global_batches(replicas: int, weights: list[float] | None) -> None:
    full = _epoch(EPOCH)
    assert len(full) == 22  # 3 + 7 + 2 + 4 + 6 batches
    saver = _sampler()
    saver.set_epoch(EPOCH)
    it = iter(saver)
    assert [next(it) for _ in range(5)] == full[:5]
    state = saver.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain values, as a checkpoint stores them
    assert {k: state[k] for k in ("version", "epoch", "batches_done", "num_batches")} == {
        "version": 1, "epoch": EPOCH, "batches_done": 5, "num_batches": 22}
    assert state["fingerprint"] == {"num_examples": 113, "bucket_lengths": LENGTHS, "bucket_sizes": SIZES,
                                    "caps": [6, 6, 6, 6, 6], "shuffle": True, "seed": 11}
    assert _global_batches_after_loading(state, replicas, weights) == full[5:]
    # the position is global: a state saved by one rank of two replicas resumes one replica (and vice versa)
    rank1 = _sampler(num_replicas=2, rank=1)
    rank1.set_epoch(EPOCH)
    it = iter(rank1)
    for _ in range(9):
        next(it)
    assert rank1.state_dict() == {**state, "batches_done": 9}
    assert _global_batches_after_loading(rank1.state_dict(), replicas, weights) == full[9:]


def test_epoch_end_state_resumes_at_the_next_epoch_and_later_epochs_are_whole() -> None:
    saver = _sampler()
    saver.set_epoch(EPOCH)
    assert [b for b in saver] == _epoch(EPOCH)
    state = saver.state_dict()
    assert (state["epoch"], state["batches_done"]) == (EPOCH, 22)  # finished: the next position is epoch 4
    s = _sampler()
    s.load_state_dict(state)
    assert s.epoch == EPOCH + 1 and s.state_dict() == state  # not consumed yet: reported as saved
    s.set_epoch(EPOCH + 1)  # what Lightning does before the epoch
    assert list(s) == _epoch(EPOCH + 1)
    assert list(s) == _epoch(EPOCH + 1)  # the position applies once


def test_set_epoch_keeps_the_restored_position_only_for_its_epoch() -> None:
    state = {**_sampler().state_dict(), "epoch": EPOCH, "batches_done": 4}
    s = _sampler()
    s.load_state_dict(state)
    s.set_epoch(EPOCH)
    assert list(s) == _epoch(EPOCH)[4:]
    s.set_epoch(EPOCH + 1)
    assert list(s) == _epoch(EPOCH + 1)
    other = _sampler()
    other.load_state_dict(state)
    other.set_epoch(EPOCH + 2)  # another epoch: the position is dropped
    assert list(other) == _epoch(EPOCH + 2)
    # iter() creates the iterator lazily: a set_epoch before the first batch still applies (Lightning does this)
    lazy = _sampler()
    lazy.load_state_dict(state)
    it = iter(lazy)
    lazy.set_epoch(EPOCH)
    assert list(it) == _epoch(EPOCH)[4:]


def test_mismatched_data_cannot_resume_mid_epoch() -> None:
    saver = _sampler()
    saver.set_epoch(EPOCH)
    it = iter(saver)
    next(it)
    next(it)
    state = saver.state_dict()
    with pytest.raises(ValueError, match=r"caps: saved \[6, 6, 6, 6, 6\], now \[5, 5, 5, 5, 5\]") as err:
        _sampler(batch_size=5).load_state_dict(state)
    assert "inside epoch 3 (after 2 of 22 global batches)" in str(err.value)
    assert "needs the same data, buckets, batch size / token budget, seed and shuffle" in str(err.value)
    with pytest.raises(ValueError, match=r"seed: saved 11, now 12"):
        _sampler(seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle: saved True, now False"):
        _sampler(shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"bucket_sizes: saved \[13, 40, 7, 22, 31\], now \[14, 40, 7, 22, 31\]"):
        BucketBatchSampler(np.append(_bucket_indices(), 0), LENGTHS, batch_size=6, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match=r"bucket_lengths: saved \[4, 8, 12, 16, 20\], now \[4, 8, 12, 16, 24\]"):
        BucketBatchSampler(_bucket_indices(), [4, 8, 12, 16, 24], batch_size=6, seed=11).load_state_dict(state)
    # batch sizes that give the same batches (caps clipped to the bucket sizes) do not matter
    same = BucketBatchSampler(_bucket_indices(), LENGTHS, batch_size=6, max_tokens=1000, seed=11)
    same.load_state_dict(state)
    assert list(same) == _epoch(EPOCH)[2:]
    # at an epoch boundary any data may follow: the new settings' next epoch
    for done, epoch in ((0, EPOCH), (22, EPOCH + 1)):
        other = _sampler(batch_size=5)
        other.load_state_dict({**state, "batches_done": done})
        assert list(other) == _epoch(epoch, batch_size=5)
    with pytest.raises(ValueError, match="not a BucketBatchSampler state"):
        _sampler().load_state_dict({"epoch": 1})


# ----------------------------------------------------------------------------------------------- the loader
class _Indices(Dataset):
    def __len__(self) -> int:
        return sum(SIZES)

    def __getitem__(self, index: int) -> int:
        return index


def _loader(num_workers: int = 0, **kwargs: Any) -> ResumableDataLoader:
    s = _sampler()
    s.set_epoch(EPOCH)
    return ResumableDataLoader(_Indices(), batch_sampler=s, num_workers=num_workers, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.processes
def test_loader_saves_what_was_consumed_not_what_was_prefetched(num_workers: int) -> None:
    full = _epoch(EPOCH)
    loader = _loader(num_workers)
    it = iter(loader)
    assert [next(it).tolist() for _ in range(6)] == full[:6]
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (EPOCH, 6)
    ahead = loader.batch_sampler.state_dict()["batches_done"]
    if num_workers:  # workers asked the sampler for batches ahead (2 per worker)
        assert ahead == 6 + 2 * num_workers
    else:
        assert ahead == 6
    del it
    resumed = _loader(num_workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # nothing consumed yet
    it = iter(resumed)
    assert len(resumed) == 22 and [b.tolist() for b in it] == full[6:]
    assert resumed.state_dict()["batches_done"] == 22  # the epoch is finished
    # a consumer that reports its own count (Lightning's fit loop, through LMDataModule) takes precedence
    counted = _loader(num_workers, consumed=lambda: 3)
    it = iter(counted)
    next(it)
    assert counted.state_dict()["batches_done"] == 3


# ------------------------------------------------------------------------------------------- Lightning fits
SYNTHETIC = {"num_train": 200, "num_valid": 20, "num_test": 20, "vocab_size": 40, "max_length": 12}
BATCHES_PER_EPOCH = 28  # 200 sentences in buckets [6, 8, 10, 11, 12] of 27, 45, 57, 29, 42, at most 8 per batch


class _Run(NamedTuple):
    parameters: dict[str, torch.Tensor]
    losses: list[tuple[int, float]]
    batches: list[tuple[int, str]]  # (global step, digest of the input tensor)


class _BatchDigests(pl.Callback):
    def __init__(self) -> None:
        self.values: list[tuple[int, str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        inputs = batch.inputs
        digest = hashlib.sha1(str(tuple(inputs.shape)).encode() + inputs.numpy().tobytes()).hexdigest()
        self.values.append((trainer.global_step, digest))


def _fit(root: Path, epochs: int, num_workers: int = 0, ckpt: Path | None = None,
         callbacks: tuple[pl.Callback, ...] = (), **kwargs: Any) -> _Run:
    dm = LMDataModule(source="synthetic", synthetic=SYNTHETIC, batch_size=8, shuffle=True, num_workers=num_workers)
    dm.setup("fit")
    model = tiny_model(vocab=dm.vocab_size, optimizer="adam", lr=0.01)
    losses, digests = TrainLosses(), _BatchDigests()
    trainer = quiet_trainer("auto", 1, callbacks=[losses, digests, *callbacks], max_epochs=epochs,
                            default_root_dir=str(root), **kwargs)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    assert trainer.num_training_batches == BATCHES_PER_EPOCH
    return _Run(parameters_of(model), losses.values, digests.values)


_REFERENCES: dict[tuple, _Run] = {}


def _reference(tmp_path: Path, **kwargs: Any) -> _Run:
    """The uninterrupted 2-epoch run (computed once per set of trainer settings)."""
    key = tuple(sorted(kwargs.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _fit(tmp_path / "reference", 2, **kwargs)
    return _REFERENCES[key]


def _loader_state(ckpt: Path) -> list[dict]:
    return torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]


def _assert_continues(resumed: _Run, reference: _Run, step: int) -> None:
    assert [s for s, _ in resumed.batches] == list(range(step + 1, 2 * BATCHES_PER_EPOCH + 1))
    assert resumed.batches == reference.batches[step:]  # the same batches at the same steps
    assert [s for s, _ in resumed.losses] == [s for s, _ in reference.losses[step:]]
    assert [v for _, v in resumed.losses] == pytest.approx([v for _, v in reference.losses[step:]], rel=1e-6)
    assert resumed.parameters.keys() == reference.parameters.keys()
    for name, value in reference.parameters.items():
        assert rel_error(resumed.parameters[name], value) < 1e-5, name


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("saved_at", "num_workers"), [("train_batch_end", 0), ("validation_end", 1)])
@pytest.mark.processes
def test_lightning_resumes_mid_epoch_exactly(tmp_path: Path, saved_at: str, num_workers: int) -> None:
    if saved_at == "train_batch_end":  # a checkpoint every 10 steps, the run stopped after 17
        settings: dict[str, Any] = {"limit_val_batches": 0}
        step, checkpoint = 10, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    else:  # validation twice per epoch, a checkpoint after each; the run stopped after 17 steps
        settings = {"val_check_interval": 0.5}
        step, checkpoint = 14, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    reference = _reference(tmp_path, **settings)
    stopped = _fit(tmp_path / "a", 2, num_workers, callbacks=(checkpoint,), max_steps=17, **settings)
    assert stopped.batches == reference.batches[:17]
    ckpt = tmp_path / f"epoch=0-step={step}.ckpt"
    resumed = _fit(tmp_path / "b", 2, num_workers, ckpt=ckpt, **settings)
    _assert_continues(resumed, reference, step)
    [state] = _loader_state(ckpt)  # the position Lightning's fit loop had consumed, not what workers fetched
    assert (state["epoch"], state["batches_done"], state["num_batches"]) == (0, step, BATCHES_PER_EPOCH)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("saved_at", "num_workers"),
                         [("validation_end", 1), ("train_epoch_end", 1), ("train_epoch_end", 0)])
@pytest.mark.processes
def test_lightning_resumes_after_an_epoch_end_checkpoint(tmp_path: Path, saved_at: str, num_workers: int) -> None:
    # With validation, ModelCheckpoint saves when the validation at the end of the epoch ends (Lightning then
    # restores "inside" the finished epoch and loads the loader state); without, at on_train_epoch_end
    # (Lightning restores at the start of the next epoch and loads no loader state). With DataLoader workers the
    # old data module shuffled the first resumed epoch like the epoch before it.
    if saved_at == "validation_end":
        settings: dict[str, Any] = {}
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    else:
        settings = {"limit_val_batches": 0}
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_on_train_epoch_end=True)
    reference = _reference(tmp_path, **settings)
    first = _fit(tmp_path / "a", 1, num_workers, callbacks=(checkpoint,), **settings)
    assert first.batches == reference.batches[:BATCHES_PER_EPOCH]
    ckpt = tmp_path / f"epoch=0-step={BATCHES_PER_EPOCH}.ckpt"
    resumed = _fit(tmp_path / "b", 2, num_workers, ckpt=ckpt, **settings)
    _assert_continues(resumed, reference, BATCHES_PER_EPOCH)
    assert {d for _, d in resumed.batches}.isdisjoint({d for _, d in first.batches})  # not epoch 0's shuffle
    [state] = _loader_state(ckpt)
    assert (state["epoch"], state["batches_done"]) == (0, BATCHES_PER_EPOCH)
