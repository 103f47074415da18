"""`Trainer.fit` with the mp_lstm strategy equals one process on the same global batches."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from tests.multiprocess import run_ranks
from tests.test_pipeline_equivalence import VOCAB, _batches, _rel

STEPS = 5
ACCUMULATE = 2


class FixedBatches(pl.LightningDataModule):
    """Global batches of two lengths; each data-parallel replica gets its contiguous share."""

    batch_size = 8  # global sentences per batch, as LMDataModule exposes it
    bucket_lengths = [5, 9]

    def __init__(self, rows: int = 8) -> None:
        super().__init__()
        self.train = _batches(rows, lengths=(5, 9, 7, 5, 9) * ACCUMULATE, seed=3)
        self.val = _batches(rows, lengths=(6, 9), seed=4)

    def _shard(self, batches):
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
        out = []
        for x, y in batches:
            share = x.shape[0] // replicas
            out.append((x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
        return DataLoader(out, batch_size=None)

    def train_dataloader(self):
        return self._shard(self.train)

    def val_dataloader(self):
        return self._shard(self.val)

    def predict_dataloader(self):
        return self._shard(self.val)

    test_dataloader = val_dataloader


def _model(optimizer: str) -> LSTMLanguageModel:
    torch.manual_seed(0)
    lr = 0.5 if optimizer == "sgd" else 0.01
    return LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=3, optimizer=optimizer, lr=lr,
                             momentum=0.9 if optimizer == "sgd" else 0.0)


def _trainer(strategy, devices: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, max_epochs=1,
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.05, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
    )


def _fit(strategy, devices: int, optimizer: str) -> dict:
    warnings.filterwarnings("ignore")
    model = _model(optimizer)
    trainer = _trainer(strategy, devices)
    trainer.fit(model, datamodule=FixedBatches())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    validated = trainer.validate(model, datamodule=FixedBatches(), verbose=False)
    predictions = trainer.predict(model, datamodule=FixedBatches())
    return {"metrics": metrics, "params": params, "validate": validated, "predict": predictions,
            "steps": trainer.global_step}


def _fit_worker(rank: int, world_size: int, strategy_kwargs: dict, optimizer: str) -> dict:
    return _fit(MPLSTMStrategy(**strategy_kwargs), world_size, optimizer)


def _compare(results: list[dict], reference: dict) -> None:
    merged = {}
    for r in results:
        merged.update(r["params"])
        assert r["steps"] == STEPS
    assert merged.keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        assert _rel(merged[name], ref) < 1e-5, name
    # Every rank sees the global losses, so logging and monitoring work unchanged.
    for r in results:
        for key in ("train/loss", "val/loss", "val/ppl"):
            assert r["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5), key
        assert r["validate"][0]["val/loss"] == pytest.approx(reference["validate"][0]["val/loss"], rel=1e-5)
    first = results[0]["predict"]
    for got, ref in zip(first, reference["predict"]):
        torch.testing.assert_close(got["log_probs"], ref["log_probs"], rtol=1e-5, atol=1e-6)
        assert torch.equal(got["mask"], ref["mask"])


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    torch.set_num_threads(1)
    return {opt: _fit("auto", 1, opt) for opt in ("sgd", "adam")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fit_pp2_equals_single_process(references, optimizer):
    results = run_ranks(_fit_worker, 2, dict(schedule="1F1B", n_microbatches=2), optimizer, timeout=180)
    _compare(results, references[optimizer])


@pytest.mark.timeout(300)
def test_fit_dp2_pp2_equals_single_process(references):
    kwargs = dict(data_parallel_size=2, schedule="GPipe", n_microbatches=2)
    _compare(run_ranks(_fit_worker, 4, kwargs, "adam", timeout=280), references["adam"])


@pytest.mark.timeout(300)
def test_fit_pp2_v2_interleaved_equals_single_process(references):
    kwargs = dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=4)
    _compare(run_ranks(_fit_worker, 2, kwargs, "sgd", timeout=280), references["sgd"])


@pytest.mark.timeout(200)
def test_fit_balanced_partition_and_auto_microbatches_equal_single_process(references):
    """Profiling on rank 0 (time costs, microbatch sizes) changes the split, never the numbers."""
    kwargs = dict(partition="balanced", balance_by="time", n_microbatches="auto", schedule="1F1B")
    results = run_ranks(_fit_report_worker, 2, kwargs, "adam", timeout=180)
    _compare(results, references["adam"])
    for r in results:
        assert r["m"] in (2, 4, 8)  # divisors of the 8-row batch that 1F1B accepts with 2 stages
        assert sorted(r["predictions"]) == [2, 4, 8]
        assert r["measured"] is not None and len(r["measured"]) == 2 and min(r["measured"]) > 0
        assert r["partition"] == results[0]["partition"]  # every rank uses rank 0's plan


def _fit_report_worker(rank: int, world_size: int, strategy_kwargs: dict, optimizer: str) -> dict:
    strategy = MPLSTMStrategy(report_after_steps=3, **strategy_kwargs)
    result = _fit(strategy, world_size, optimizer)
    report = strategy.report
    return {**result, "m": strategy.layout.n_microbatches, "predictions": report.microbatch_predictions,
            "measured": report.measured_stage_times, "partition": strategy.partition}
