"""Data parallelism through the same strategy, fed by the real bucketed data module."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.data import LMDataModule
from tests.helpers import rel_error, run_ranks

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

SYNTHETIC = {"num_train": 240, "num_valid": 40, "num_test": 40, "vocab_size": 1000}


def _fit(strategy, devices: int) -> dict[str, torch.Tensor]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    data = LMDataModule(synthetic=SYNTHETIC, buckets=[16, 32, 60], batch_size=16, shuffle=True, seed=3)
    data.setup("fit")
    model = LSTMLanguageModel(data.vocab_size, embedding_dim=8, hidden_size=8, num_layers=2, optimizer="adam",
                              lr=0.01)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, limit_train_batches=6,
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=2, num_sanity_val_steps=0, gradient_clip_val=0.5)
    trainer.fit(model, datamodule=data)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "val": float(trainer.callback_metrics["val/loss"])}


def _worker(rank: int, world_size: int, kwargs: dict) -> dict:
    return _fit(MPLSTMStrategy(**kwargs), world_size)


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    return _fit("auto", 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(data_parallel_size=2, n_microbatches=2),
        dict(data_parallel_size=2, n_microbatches=1, data_parallel_weights=[1.0, 3.0]),
    ],
    ids=["dp2", "dp2-weighted-1-3"],
)
def test_data_parallel_equals_single_process(reference, kwargs):
    results = run_ranks(_worker, 2, kwargs, timeout=160)
    for r in results:  # replicas hold identical parameters, equal to one process on the global batch
        for name, ref in reference["params"].items():
            assert rel_error(r["params"][name], ref) < 1e-5, name
        assert r["val"] == pytest.approx(reference["val"], rel=1e-5)


class _RowsBySentence(BasePredictionWriter):
    """Keeps what a prediction writer pairs up: each sentence index Lightning names (``batch_indices``) with the
    prediction row at its place, as the log-probabilities of its real tokens."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.rows: dict[int, list[float]] = {}
        self.misaligned: list[tuple[int, int]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        if len(batch_indices) != prediction["mask"].shape[0]:
            self.misaligned.append((len(batch_indices), int(prediction["mask"].shape[0])))
        for index, log_probs, mask in zip(batch_indices, prediction["log_probs"], prediction["mask"], strict=False):
            self.rows[int(index)] = log_probs[mask].tolist()


def _predict(strategy, devices: int) -> dict:
    warnings.filterwarnings("ignore")
    data = LMDataModule(synthetic=SYNTHETIC, buckets=[16, 32, 60], batch_size=16)
    data.setup("fit")
    torch.manual_seed(0)
    model = LSTMLanguageModel(data.vocab_size, embedding_dim=8, hidden_size=8, num_layers=2)
    writer = _RowsBySentence()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, callbacks=[writer],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.predict(model, datamodule=data, return_predictions=False)
    return {"rows": writer.rows, "misaligned": writer.misaligned}


def _predict_worker(rank: int, world_size: int) -> dict:
    return _predict(MPLSTMStrategy(data_parallel_size=2, n_microbatches=1), world_size)


@pytest.mark.timeout(180)
def test_a_prediction_writer_pairs_every_sentence_with_its_own_prediction_on_dp2():
    """Each replica loads its own share of a prediction batch (``LMDataModule``): its ranks get that share's
    predictions, so Lightning's ``batch_indices`` name the rows a writer receives, as under DDP; every sentence's
    prediction equals the plain module's in one process."""
    torch.set_num_threads(1)
    reference = _predict("auto", 1)["rows"]
    results = run_ranks(_predict_worker, 2, timeout=160)
    assert [r["misaligned"] for r in results] == [[], []]
    assert len(reference) == SYNTHETIC["num_test"]
    assert set(results[0]["rows"]) | set(results[1]["rows"]) == set(reference)
    for result in results:
        for index, log_probs in result["rows"].items():
            assert log_probs == pytest.approx(reference[index], rel=1e-5, abs=1e-6), index


class FirstTokens(pl.Callback):
    """The first token of every row of every training batch this process loaded."""

    def __init__(self) -> None:
        self.values: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.values.append(batch[0][:, 0].tolist())


def _unseeded_worker(rank: int, world_size: int) -> dict:
    """A script that never seeds: a shuffling DataLoader of its own, a model with tied weights built in each process."""
    import os

    from torch.utils.data import DataLoader

    warnings.filterwarnings("ignore")
    os.environ.pop("PL_GLOBAL_SEED", None)  # inherited from a test that seeded: this script did not
    sentences = [(torch.full((6,), i), torch.full((6,), i)) for i in range(1, 17)]
    loader = DataLoader(sentences, batch_size=4, shuffle=True)
    model = LSTMLanguageModel(20, embedding_dim=8, hidden_size=8, num_layers=2, tie_weights=True, lr=0.5)
    seen = FirstTokens()
    strategy = MPLSTMStrategy(data_parallel_size=2, pipeline_parallel_size=2, n_microbatches=2, timeout=60,
                              report_after_steps=None)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[seen])
    trainer.fit(model, train_dataloaders=loader)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "seen": seen.values}


@pytest.mark.timeout(200)
def test_a_script_that_never_seeds_trains_one_model_on_every_sentence_once_an_epoch():
    """Each process of a launched script draws its own random state (spawned here, as Lightning's launcher and torchrun
    start them). Before: replica 1 trained from other initial values than replica 0 (0.19 apart after 2 steps of dp2),
    the tied decoder copy on pipeline rank 1 started from other values than the embedding (0.19 apart), and a
    shuffling DataLoader gave each process its own order (pp2: a "different batches" error; dp2: silently some
    sentences twice an epoch and some never)."""
    ranks = run_ranks(_unseeded_worker, 4, timeout=180, start_method="spawn")
    assert all(r["seen"] == ranks[0]["seen"] for r in ranks)  # every process loaded the same global batches
    for epoch in (ranks[0]["seen"][:4], ranks[0]["seen"][4:]):
        assert sorted(token for batch in epoch for token in batch) == list(range(1, 17))
    assert ranks[0]["seen"][:4] != ranks[0]["seen"][4:]  # shuffled, anew each epoch
    for first, second in ((0, 2), (1, 3)):  # replica 0's and replica 1's copy of each pipeline rank's blocks
        assert set(ranks[first]["params"]) == set(ranks[second]["params"])
        for name, value in ranks[first]["params"].items():
            assert torch.equal(value, ranks[second]["params"][name]), name
    for replica in (0, 2):  # the tied weight: the embedding on pipeline rank 0, the decoder's copy on rank 1
        assert torch.equal(ranks[replica]["params"]["embedding.weight"], ranks[replica + 1]["params"]["decoder.weight"])
