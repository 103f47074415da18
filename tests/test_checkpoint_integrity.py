"""A checkpoint you can trust (issue #47): every checkpoint records CRC-32 checksums when it is written (each tensor of
one file, each block of a sharded directory) and every reader compares them, so bytes damaged on disk or in a copy,
every number still finite, are refused before anything trains on them, naming the damaged entries: ``read_checkpoint``
(``train.py``'s check before launch, ``generate.py``), the strategy loading into any layout (every rank raises),
``read_sharded`` and ``consolidate``. A checkpoint written before (no record) loads as it did."""

from __future__ import annotations

import re
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.app.generation import load_for_generation
from lightning_mp_lstm.app.training import check_resume
from lightning_mp_lstm.checkpoint import (
    SHARDED_METADATA,
    CheckpointError,
    consolidate,
    read_checkpoint,
    read_sharded,
)
from lightning_mp_lstm.checkpoint.integrity import INTEGRITY_KEY, with_record
from lightning_mp_lstm.data import LMDataModule
from tests.helpers import damage_tensor_bytes, quiet_trainer, run_ranks

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

DATA = {"source": "synthetic", "batch_size": 8, "buckets": [8, 16],
        "synthetic": {"num_train": 48, "num_valid": 8, "num_test": 8, "vocab_size": 30, "num_classes": 4}}
SIZES = {"embedding_dim": 8, "hidden_size": 8, "num_layers": 2}
#: A damaged file's message (the names of the damaged tensors follow).
DAMAGED_FILE = r"checkpoint \S+ is damaged: \d+ of its \d+ tensors differ from the CRC-32 checksums recorded when it " \
               r"was written: "
DAMAGED_DIRECTORY = r"sharded checkpoint \S+ is damaged: \d+ of the \d+ blocks checked differ from the CRC-32 " \
                    r"checksums recorded when they were written: "


def _fit(checkpoint_format: str, devices: int, ckpt_path: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    data = LMDataModule(**DATA)
    data.setup("fit")
    torch.manual_seed(0)
    model = LSTMLanguageModel(data.vocab_size, optimizer="adam", lr=0.01, **SIZES)
    strategy = MPLSTMStrategy(checkpoint_format=checkpoint_format, n_microbatches=2, report_after_steps=None,
                              timeout=30)
    trainer = quiet_trainer(strategy, devices, max_steps=2, limit_val_batches=0)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except CheckpointError as error:
        return {"error": str(error)}
    return {"error": None, "trainer": trainer}


def _save_worker(rank: int, world_size: int, directory: str) -> None:
    for checkpoint_format, name in (("sharded", "sharded.ckpt"), ("file", "file.ckpt")):
        _fit(checkpoint_format, world_size)["trainer"].save_checkpoint(Path(directory) / name)


def _load_worker(rank: int, world_size: int, paths: list[str]) -> list[str | None]:
    return [_fit("file", world_size, ckpt_path=path)["error"] for path in paths]


def _damaged_copy(source: Path, target: Path) -> Path:
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy(source, target)
    damage_tensor_bytes(target)
    return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A sharded directory and a file, both written by pp2 after two steps."""
    directory = tmp_path_factory.mktemp("integrity")
    run_ranks(_save_worker, 2, str(directory), timeout=150)
    return directory


@pytest.mark.timeout(200)
def test_a_file_damaged_after_it_was_written_is_refused_naming_its_tensors(saved, tmp_path):
    good = saved / "file.ckpt"
    checkpoint = read_checkpoint(good)
    names = {name for name in checkpoint[INTEGRITY_KEY]["tensors"]}
    assert "lstm.0.weight_hh_l0" in names and any(name.startswith("optimizer 0 state 'exp_avg'") for name in names)
    damaged = _damaged_copy(good, tmp_path / "damaged.ckpt")
    assert all(torch.isfinite(v).all() for v in torch.load(damaged, weights_only=False)["state_dict"].values())
    for read in (read_checkpoint, load_for_generation):  # train.py's check before launch; generate.py
        with pytest.raises(CheckpointError, match=DAMAGED_FILE) as caught:
            read(damaged)
        listed = str(caught.value).split("was written: ", 1)[1].split("; ", 1)[0]
        assert listed and all(name.strip() in names for name in re.sub(r" and \d+ more$", "", listed).split(", "))
    # The pickled rest (epoch, loops, hyperparameters, vocabulary) is covered by its zip entry's CRC-32.
    structure = tmp_path / "structure.ckpt"
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as archive:
        pickled = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    data[pickled.header_offset + 80] ^= 0x01
    structure.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"structure.ckpt is damaged: the bytes of \S+/data.pkl \(everything "
                                              r"but the tensors"):
        read_checkpoint(structure)
    # Written before checksums were recorded, or edited and saved again with a new record: no false alarm.
    old = tmp_path / "old.ckpt"
    torch.save({k: v for k, v in checkpoint.items() if k != INTEGRITY_KEY}, old)
    edited = tmp_path / "edited.ckpt"
    changed = {**checkpoint, "state_dict": {**checkpoint["state_dict"], "decoder.bias": checkpoint["state_dict"][
        "decoder.bias"] + 1}}
    torch.save(with_record(changed), edited)
    for path in (old, edited):
        assert read_checkpoint(path)["global_step"] == 2
        load_for_generation(path)


@pytest.mark.timeout(250)
def test_a_damaged_checkpoint_is_refused_on_every_rank_of_a_layout_in_both_formats(saved, tmp_path):
    sharded = saved / "sharded.ckpt"
    meta = torch.load(sharded / SHARDED_METADATA, weights_only=False)
    assert set(meta[INTEGRITY_KEY]) == {"algorithm", "blocks", "metadata"} and meta[INTEGRITY_KEY]["blocks"]
    damaged_file = _damaged_copy(saved / "file.ckpt", tmp_path / "file.ckpt")
    damaged_directory = _damaged_copy(sharded, tmp_path / "sharded.ckpt")
    per_rank = run_ranks(_load_worker, 2, [str(damaged_file), str(damaged_directory)], timeout=200)
    for rank, (file_error, directory_error) in enumerate(per_rank):
        assert file_error and re.search(DAMAGED_FILE, file_error), (rank, file_error)
        assert directory_error and re.search(DAMAGED_DIRECTORY + r"(model|optimizer)\.\S+ in __\d_\d\.distcp",
                                             directory_error), (rank, directory_error)
    # One process: train.py's check before launch (check_resume: a sharded directory resumes too), generate.py,
    # consolidate.
    data = LMDataModule(**DATA)
    data.setup("fit")
    model = LSTMLanguageModel(data.vocab_size, **SIZES)
    for read in (lambda p: check_resume(str(p), model, data), load_for_generation,
                 lambda p: consolidate(p, tmp_path / "one.ckpt")):
        with pytest.raises(CheckpointError, match=DAMAGED_DIRECTORY):
            read(damaged_directory)
    assert not (tmp_path / "one.ckpt").exists()
    shapes = check_resume(str(sharded), model, data)["state_dict"]
    assert shapes["lstm.0.weight_hh_l0"].shape == (32, 8) and shapes["lstm.0.weight_hh_l0"].is_meta
    consolidate(sharded, tmp_path / "consolidated.ckpt")
    assert INTEGRITY_KEY in read_checkpoint(tmp_path / "consolidated.ckpt")
    # A directory written before checksums were recorded reads as it did.
    old = tmp_path / "old.ckpt"
    shutil.copytree(sharded, old)
    torch.save({k: v for k, v in meta.items() if k != INTEGRITY_KEY}, old / SHARDED_METADATA)
    assert read_sharded(old)["global_step"] == 2
    load_for_generation(old)
