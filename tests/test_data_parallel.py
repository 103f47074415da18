"""Data parallelism through the same strategy, fed by the real bucketed data module."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.data import LMDataModule
from tests.helpers import rel_error, run_ranks

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
