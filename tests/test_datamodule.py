"""Tests for LMDataModule."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_mp_lstm.data import CorpusError, LMBatch, LMDataModule, Vocabulary

SMALL = {"num_train": 600, "num_valid": 100, "num_test": 80}


def _fake_trainer(num_replicas: int, rank: int, weights: list[float] | None = None) -> SimpleNamespace:
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
    if weights is not None:
        strategy.data_parallel_weights = weights
    return SimpleNamespace(strategy=strategy, current_epoch=0)


def test_synthetic_setup_and_batches() -> None:
    dm = LMDataModule(synthetic=SMALL, batch_size=16, buckets=[8, 16, 24, 32, 60])
    with pytest.raises(RuntimeError, match="call setup"):
        _ = dm.vocab_size
    dm.setup("fit")
    vocab = dm.vocab
    dm.setup("validate")  # idempotent
    assert dm.vocab is vocab and dm.prepare_vocab() is vocab
    assert 900 < dm.vocab_size <= 1003
    assert dm.entropy_floor == pytest.approx(math.exp(dm.language.entropy_rate()))
    assert dm.entropy_floor < 0.5 * dm.unigram_perplexity
    rows = 0
    for batch in dm.train_dataloader():
        assert isinstance(batch, LMBatch)
        assert batch.inputs.shape[1] in (8, 16, 24, 32, 60) and batch.inputs.shape[0] <= 16
        real = batch.targets[:, 1:] != 0  # input t+1 is target t wherever target t+1 is real
        assert torch.equal(batch.inputs[:, 1:][real], batch.targets[:, :-1][real])
        assert torch.equal(batch.inputs != 0, batch.targets != 0)
        assert (batch.inputs[:, 0] == vocab.eos_id).all()
        rows += batch.inputs.shape[0]
    assert rows == SMALL["num_train"]
    assert sum(b.inputs.shape[0] for b in dm.val_dataloader()) == SMALL["num_valid"]
    assert sum(b.inputs.shape[0] for b in dm.test_dataloader()) == SMALL["num_test"]
    assert sum(b.inputs.shape[0] for b in dm.predict_dataloader()) == SMALL["num_test"]
    assert dm.long_sentence_counts == {"train": 0, "valid": 0, "test": 0}


def test_synthetic_is_deterministic_and_configurable() -> None:
    a = LMDataModule(synthetic={**SMALL, "vocab_size": 1200, "num_classes": 6}, seed=3)
    b = LMDataModule(synthetic={**SMALL, "vocab_size": 1200, "num_classes": 6}, seed=3)
    a.setup()
    b.setup()
    assert a.vocab == b.vocab and a.language.num_classes == 6 and a.language.vocab_size == 1200
    assert [x.inputs.tolist() for x in a.train_dataloader()] == [x.inputs.tolist() for x in b.train_dataloader()]


def test_ptb_files_train_on_valid_evaluate_on_test(ptb: Path, caplog: pytest.LogCaptureFixture) -> None:
    valid, test = str(ptb / "ptb.valid.txt"), str(ptb / "ptb.test.txt")
    dm = LMDataModule(source="ptb", train=valid, valid=test, test=test, buckets=[8, 16, 24, 32, 60], batch_size=64)
    dm.setup("fit")
    words = {t for line in Path(valid).read_text().split("\n") for t in line.split()}
    assert dm.vocab_size == len(words - {"<unk>"}) + 3
    assert dm.entropy_floor is None
    assert 100 < dm.unigram_perplexity < 2000
    with caplog.at_level("WARNING", logger="lightning_mp_lstm.data"):
        stats = dm.stats()
    assert stats["sentences"] == {"train": 3370, "valid": 3761, "test": 3761}
    assert stats["long_sentences"]["train"] > 0 and stats["long_sentences"]["test"] > 0
    assert any("longer than the largest bucket (60 tokens)" in r.getMessage() for r in caplog.records)
    # split policy: the number of predicted tokens equals the corpus size
    n_tokens = sum(int((b.targets != 0).sum()) for b in dm.val_dataloader())
    assert n_tokens == stats["tokens"]["valid"] == 82430
    unk = dm.vocab.unk_id
    assert any((b.targets == unk).any() for b in dm.val_dataloader())


def test_ptb_directory_and_auto_buckets(ptb: Path, tmp_path: Path) -> None:
    for split, src in (("train", "ptb.valid.txt"), ("valid", "ptb.test.txt"), ("test", "ptb.test.txt")):
        (tmp_path / f"ptb.{split}.txt").write_bytes((ptb / src).read_bytes())
    dm = LMDataModule(source="ptb", path=str(tmp_path), buckets="auto", num_auto_buckets=4, max_tokens=1000)
    assert LMDataModule(source="ptb", path=str(tmp_path), num_auto_buckets=None).num_auto_buckets == 5
    dm.setup()
    train = dm.dataset("train")
    assert len(train.buckets) == 4 and train.buckets[-1] == dm.longest_sentence()[0]
    assert all(b.inputs.numel() <= 1000 for b in dm.train_dataloader())


def test_state_dict_roundtrip_restores_vocab() -> None:
    src = LMDataModule(synthetic=SMALL, min_freq=3)
    src.setup()
    state = src.state_dict()
    assert set(state) == {"vocab"}
    dst = LMDataModule(synthetic=SMALL)  # would build a bigger vocabulary (min_freq=1)
    dst.load_state_dict(state)
    dst.setup("fit")
    assert dst.vocab == src.vocab
    # restored after setup (Lightning restores after setup): data is re-encoded
    late = LMDataModule(synthetic=SMALL)
    late.setup()
    first_batches = list(late.train_dataloader())
    assert max(int(b.targets.max()) for b in first_batches) >= len(src.vocab)
    late.load_state_dict(state)
    assert late.vocab == src.vocab
    assert max(int(b.targets.max()) for b in late.train_dataloader()) < len(src.vocab)
    assert LMDataModule(synthetic=SMALL).state_dict() == {}


def test_sharding_from_strategy_kwargs() -> None:
    dm = LMDataModule(synthetic=SMALL, batch_size=12, seed=1)
    dm.setup()
    dm.trainer = None
    glob = [b.inputs for b in dm.train_dataloader()]
    parts = []
    for rank in (0, 1):
        dm.trainer = _fake_trainer(2, rank, weights=[1, 2])
        parts.append([b.inputs for b in dm.train_dataloader()])
    assert len(parts[0]) == len(parts[1]) == len(glob)
    for g, a, b in zip(glob, *parts):
        assert torch.equal(torch.cat([a, b]), g)
        assert a.shape[0] >= 1 and abs(b.shape[0] - 2 * a.shape[0]) <= 2
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=None), current_epoch=0)
    assert len(list(dm.val_dataloader())) == len(list(LMDataModule(synthetic=SMALL, batch_size=12).val_dataloader()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"source": "csv"}, ValueError, "unknown data source 'csv'"),
        ({"long_sentence_policy": "wrap"}, ValueError, "split, truncate, drop"),
        ({"batch_size": None}, ValueError, "batch_size and/or max_tokens"),
        ({"buckets": "quantile"}, ValueError, "'auto' or None"),
        ({"source": "ptb"}, ValueError, "needs a path"),
        ({"source": "text", "path": "/x", "download": True}, ValueError, "only available for source='ptb'"),
    ],
)
def test_invalid_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LMDataModule(**kwargs)


def test_bad_inputs_raise_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("a b\n")
    (tmp_path / "valid.txt").write_text("a\n")
    with pytest.raises(CorpusError, match=r"missing test split .*test\.txt"):
        LMDataModule(source="text", path=str(tmp_path)).setup()
    (tmp_path / "test.txt").write_bytes(b"\n\n")
    with pytest.raises(CorpusError, match=r"test\.txt.*is empty"):
        LMDataModule(source="text", path=str(tmp_path)).setup()
    (tmp_path / "test.txt").write_bytes(b"ok\n\xff\xfe bad\n")
    with pytest.raises(CorpusError, match="not valid UTF-8: line 2"):
        LMDataModule(source="text", path=str(tmp_path)).setup()
    (tmp_path / "test.txt").write_bytes(b"\x7fELF\x02\x01\x00\x00")
    with pytest.raises(CorpusError, match="looks binary: NUL byte on line 1"):
        LMDataModule(source="text", path=str(tmp_path)).setup()


def test_prepare_data_downloads(ptb: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import shutil

    import lightning_mp_lstm.data.datamodule as dm_module
    from lightning_mp_lstm.data.download import download_ptb

    srv = tmp_path / "srv"
    srv.mkdir()
    for split, src in (("train", "ptb.valid.txt"), ("valid", "ptb.valid.txt"), ("test", "ptb.test.txt")):
        shutil.copy(ptb / src, srv / f"ptb.{split}.txt")
    train_hash = hashlib.sha256((srv / "ptb.train.txt").read_bytes()).hexdigest()
    calls = []

    def offline(cache_dir: Path) -> Path:  # the default URL redirected to the local "server"
        calls.append(cache_dir)
        return download_ptb(cache_dir, base_url=srv.as_uri(), sha256={"train": train_hash})

    monkeypatch.setattr(dm_module, "download_ptb", offline)
    dm = LMDataModule(source="ptb", download=True, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    assert calls == [tmp_path / "cache" / "ptb"]
    dm.setup()
    assert dm.stats()["sentences"] == {"train": 3370, "valid": 3370, "test": 3761}


class _TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.out = nn.Linear(8, vocab_size)
        self.seen: dict[int, list[list[int]]] = {}

    def _loss(self, batch: LMBatch) -> torch.Tensor:
        logits = self.out(self.lstm(self.emb(batch.inputs))[0])
        total = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=0, reduction="sum")
        return total / (batch.targets != 0).sum()

    def training_step(self, batch: LMBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, LMBatch)
        self.seen.setdefault(self.current_epoch, []).append(batch.targets[:, 0].tolist())
        return self._loss(batch)

    def validation_step(self, batch: LMBatch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=batch.inputs.shape[0])

    def predict_step(self, batch: LMBatch, batch_idx: int) -> torch.Tensor:
        return batch.inputs.shape[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_checkpoint_vocabulary_other_than_the_data_replaces_it_with_a_warning() -> None:
    trained = LMDataModule(synthetic=SMALL, batch_size=16, seed=1)
    saved = {"vocab": trained.prepare_vocab().state_dict()}
    other = LMDataModule(synthetic=SMALL, batch_size=16, seed=2)
    other.setup()  # built its own vocabulary
    expected = (r"the checkpoint's vocabulary replaces the one built from the training data "
                r"\(checkpoint vs data: [\d,]+ words vs [\d,]+ words; first difference at id \d+")
    with pytest.warns(UserWarning, match=expected):
        other.load_state_dict(saved)
    assert other.vocab == trained.vocab
    same = LMDataModule(synthetic=SMALL, batch_size=16, seed=1)
    same.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same data gives the same vocabulary: no warning
        same.load_state_dict(saved)


def test_lightning_fit_reshuffles_per_epoch_and_checkpoints_vocab(tmp_path: Path) -> None:
    small = {"num_train": 120, "num_valid": 30, "num_test": 20}
    dm = LMDataModule(synthetic=small, batch_size=16, buckets=[16, 60])
    dm.setup("fit")
    model = _TinyLM(dm.vocab_size)
    kw = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
    }
    trainer = pl.Trainer(max_epochs=2, enable_checkpointing=False, **kw)
    trainer.fit(model, datamodule=dm)
    assert set(model.seen) == {0, 1}
    assert model.seen[0] != model.seen[1]  # Lightning called set_epoch on our batch sampler
    assert sorted(sum(model.seen[0], [])) == sorted(sum(model.seen[1], []))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["LMDataModule"]
    assert Vocabulary.from_state_dict(saved["vocab"]) == dm.vocab
    # resume with a data module configured differently: the checkpoint's vocabulary wins
    dm2 = LMDataModule(synthetic=small, batch_size=16, buckets=[16, 60], max_vocab_size=50)
    trainer2 = pl.Trainer(max_epochs=3, enable_checkpointing=False, **kw)
    trainer2.fit(_TinyLM(dm.vocab_size), datamodule=dm2, ckpt_path=ckpt)
    assert dm2.vocab == dm.vocab
    preds = pl.Trainer(**kw).predict(model, datamodule=dm)
    assert sum(preds) == small["num_test"]


def test_mean_padded_length_follows_the_bucket_mix(tmp_path: Path) -> None:
    # Training sentences with 2, 3 and 7 words (+ <eos>): lengths 3, 4, 8 -> buckets 4, 4, 8.
    # Six short sentences and two long: (6 * 4 + 2 * 8) / 8 = 5.0, not the plain bucket mean 6.0.
    train = ["a b", "a b c", "b c", "c a b", "a a", "b b b", "a b c a b c a", "c b a c b a c"]
    for split in ("train", "valid", "test"):
        (tmp_path / f"ptb.{split}.txt").write_text("\n".join(train) + "\n")
    dm = LMDataModule(source="ptb", path=str(tmp_path), buckets=[4, 8], batch_size=2)
    assert dm.mean_padded_length == pytest.approx(5.0)
    assert sum(dm.bucket_lengths) / 2 == 6.0


BUCKETS = [8, 16, 24, 32, 60]


@pytest.mark.timeout(60)
def test_unshareable_eval_batch_size_fails_at_setup() -> None:
    # With 2 replicas the valid split's bucket of length 16 (35 sentences) forms 17 global batches of 2
    # and one of 1: the training batch size is fine, the evaluation batch size is not.
    dm = LMDataModule(synthetic=SMALL, batch_size=16, eval_batch_size=2, buckets=BUCKETS)
    dm.trainer = _fake_trainer(2, 0)
    valid_error = r"valid split \(eval_batch_size=2\): bucket of length 16 has 35 sentences.*2 replicas"
    with pytest.raises(ValueError, match=valid_error):
        dm.setup("fit")  # before any loader is requested, so before training starts
    with pytest.raises(ValueError, match=valid_error):
        dm.setup("validate")
    with pytest.raises(ValueError, match=r"test split \(eval_batch_size=2\): bucket of length 16 has 29 sentences"):
        dm.setup("predict")
    assert len(dm.train_dataloader()) == 39  # 62 -> 4, 203 -> 13, 158 -> 10, 91 -> 6, 86 -> 6 batches
    dm.trainer = _fake_trainer(1, 0)
    dm.setup("fit")  # one replica can take a batch of 1
    # a token budget: 120 // 60 = 2 sentences per batch of the bucket of length 60 (335 training sentences)
    tokens = LMDataModule(synthetic=SMALL, batch_size=None, max_tokens=120, buckets=[16, 60])
    tokens.trainer = _fake_trainer(2, 1)
    with pytest.raises(ValueError, match=r"train split \(max_tokens=120\): bucket of length 60 has 335 sentences"):
        tokens.setup("fit")


def test_setup_checks_the_samplers_of_its_stage_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_mp_lstm.data.loaders as module  # where LMDataModule builds its batch samplers

    built: list[tuple[int, bool]] = []

    class Counting(module.BucketBatchSampler):
        def __init__(self, *args, **kwargs) -> None:
            built.append((kwargs["batch_size"], kwargs["shuffle"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(module, "BucketBatchSampler", Counting)
    dm = LMDataModule(synthetic=SMALL, batch_size=16, eval_batch_size=4, buckets=BUCKETS)
    dm.setup("fit")
    assert built == []  # no trainer: nothing to check yet
    dm.trainer = _fake_trainer(2, 1)
    for _ in range(3):
        dm.setup("fit")
    assert built == [(16, True), (4, False)]
    dm.setup("validate")
    dm.setup("test")
    assert built == [(16, True), (4, False), (4, False)]
    dm.trainer = _fake_trainer(2, 0)  # another rank: its samplers are checked again
    dm.setup("validate")
    assert len(built) == 4
