"""Stream mode: one token stream in rows, windows of bptt tokens, every LSTM layer's state carried across batches.

Exact against a one-process stateful run (loss curve, every gradient of every step, final parameters, 1e-5) for
pp2, pp4, dp2 x pp2 and interleaved pp2 x 2, over several consecutive batches, so the carried state matters;
evaluation starts from zero state every time; a mid-epoch checkpoint continues with the next window.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.data.stream import TokenStream
from tests.helpers import (
    assert_split_equals_one_process,
    fit_and_record,
    quiet_trainer,
    run_ranks,
    tiny_model,
)

ROWS, BPTT, STEPS = 8, 6, 5
DATA = {"source": "synthetic", "mode": "stream", "batch_size": ROWS, "bptt": BPTT, "eval_batch_size": 4, "seed": 2,
        "synthetic": {"num_train": 60, "num_valid": 20, "num_test": 20, "vocab_size": 30, "max_length": 10}}
LAYOUTS = {
    "pp2": (2, dict(schedule="1F1B", n_microbatches=2)),
    "pp2_v2 interleaved": (2, dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2)),
    "pp4": (4, dict(schedule="GPipe", n_microbatches=2)),
    "dp2_pp2": (4, dict(data_parallel_size=2, schedule="GPipe", n_microbatches=2)),
}


class FirstTokens(pl.Callback):
    """The first tokens of every row of every training batch this process saw."""

    def __init__(self) -> None:
        self.values: list[list[int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.values.append(batch[0][:, 0].tolist())


def _data() -> LMDataModule:
    data = LMDataModule(**DATA)
    data.setup("fit")
    return data


def _model(vocab: int, carry_state: bool = True) -> Any:
    return tiny_model(num_layers=3, vocab=vocab, optimizer="adam", lr=0.02, carry_state=carry_state)


def _fit(strategy: Any, devices: int, carry_state: bool = True) -> dict:
    warnings.filterwarnings("ignore")
    data = _data()
    return fit_and_record(strategy, devices, _model(data.vocab_size, carry_state), data, STEPS, validations=2)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _fit("auto", 1)


def test_the_carried_state_changes_the_losses(reference):
    """The comparisons below are about something: without carrying, the losses after the first batch differ."""
    stateless = _fit("auto", 1, carry_state=False)
    assert stateless["losses"][0][1] == pytest.approx(reference["losses"][0][1], rel=1e-6)
    assert all(abs(a[1] - b[1]) > 1e-4 for a, b in zip(stateless["losses"][1:], reference["losses"][1:]))
    assert reference["val"][0] == reference["val"][1]  # every evaluation starts from zero state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.processes
def test_stream_mode_with_carried_state_matches_one_process(layout, reference):
    processes, kwargs = LAYOUTS[layout]
    results = assert_split_equals_one_process(_fit, processes, kwargs, reference, STEPS)
    for r in results:
        assert r["val"] == pytest.approx(reference["val"], rel=1e-5)


def test_token_stream_rows_are_contiguous_and_windows_consecutive():
    sentences = [[3, 4, 1], [5, 1], [6, 7, 8, 1], [9, 1], [2, 2, 1]]
    stream = TokenStream(sentences, eos_id=1, rows=2, bptt=3)
    flat = [1, 3, 4, 1, 5, 1, 6, 7, 8, 1, 9, 1, 2, 2, 1]  # 15 tokens: 2 rows of 7, one token dropped
    assert stream.data.tolist() == [flat[:7], flat[7:14]]
    assert stream.buckets == [3, 3] and stream.bucket_indices.tolist() == [0, 0, 1, 1]
    for row in range(2):
        inputs = torch.cat([stream[w * 2 + row][0] for w in range(2)]).tolist()
        targets = torch.cat([stream[w * 2 + row][1] for w in range(2)]).tolist()
        assert inputs == flat[row * 7: row * 7 + 6] and targets == flat[row * 7 + 1: row * 7 + 7]
    assert stream.num_tokens == 12
    with pytest.raises(ValueError, match="too few for 10 rows"):
        TokenStream([[3, 1]], eos_id=1, rows=10, bptt=3)
    with pytest.raises(ValueError, match="bptt must be a positive integer, got 0"):
        TokenStream(sentences, eos_id=1, rows=2, bptt=0)


def test_stream_batches_split_rows_over_replicas_in_order():
    data = _data()
    whole = list(data.stream("train", ROWS).data)
    batches = [data._batch_sampler("train", train=True) for _ in range(1)][0][1]
    assert len(batches) == -(-(len(whole[0]) - 1) // BPTT)
    assert list(data.bucket_lengths) == [BPTT] and data.mean_padded_length == BPTT
    for bad, message in ((dict(mode="streams"), "unknown mode 'streams'; allowed: sentences, stream"),
                         (dict(max_tokens=100), "give batch_size and no max_tokens"),
                         (dict(bptt=-1), "bptt must be a positive integer, got -1")):
        with pytest.raises(ValueError, match=message):
            LMDataModule(**{**DATA, **bad})


def _resume_worker(rank: int, world_size: int, checkpoint: str) -> dict:
    warnings.filterwarnings("ignore")
    data, tokens = _data(), FirstTokens()
    trainer = quiet_trainer(MPLSTMStrategy(report_after_steps=None, timeout=60, n_microbatches=2), world_size,
                            [tokens], max_steps=STEPS, limit_val_batches=0)
    trainer.fit(_model(data.vocab_size), datamodule=data, ckpt_path=checkpoint)
    return {"tokens": tokens.values}


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_a_mid_epoch_checkpoint_continues_with_the_next_window_on_another_layout(tmp_path: Path):
    warnings.filterwarnings("ignore")
    data, tokens = _data(), FirstTokens()
    trainer = quiet_trainer("auto", 1, [tokens], max_steps=STEPS, limit_val_batches=0)
    trainer.fit(_model(data.vocab_size), datamodule=data)
    data, stop = _data(), 2
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="stop", every_n_train_steps=stop, save_top_k=1)
    trainer = quiet_trainer("auto", 1, [checkpoint], max_steps=stop, limit_val_batches=0)
    trainer.fit(_model(data.vocab_size), datamodule=data)
    resumed = run_ranks(_resume_worker, 2, str(tmp_path / "stop.ckpt"), timeout=180)
    for r in resumed:
        assert r["tokens"] == tokens.values[stop:]
