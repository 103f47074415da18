"""The sharded checkpoint format: every rank writes its own tensors (nothing is gathered on rank 0), and the
directory resumes on any layout, exactly; ``consolidate`` turns it into one ordinary file."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm.checkpoint import SHARDED_METADATA, consolidate, is_sharded, read_checkpoint
from tests.helpers import FixedBatches, assert_ranks_match, parameters_of, quiet_trainer, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

FIRST, TOTAL = 2, 3  # epochs before the checkpoint, epochs in all


def _fit(strategy, devices: int, max_epochs: int, ckpt_path=None) -> tuple:
    warnings.filterwarnings("ignore")
    model = tiny_model(optimizer="adam", lr=0.01)
    trainer = quiet_trainer(strategy, devices, max_epochs=max_epochs)
    trainer.fit(model, datamodule=FixedBatches((5, 9, 7)), ckpt_path=ckpt_path)
    return trainer, model


def _sharded(**kwargs) -> MPLSTMStrategy:
    return MPLSTMStrategy(checkpoint_format="sharded", n_microbatches=2, report_after_steps=None, timeout=60, **kwargs)


def _save_worker(rank: int, world_size: int, directory: str) -> dict:
    trainer, model = _fit(_sharded(), 2, FIRST)
    gathered_keys = sorted(trainer.strategy.lightning_module_state_dict())  # what saving puts on this rank
    trainer.save_checkpoint(Path(directory) / "sharded.ckpt")
    trainer.save_checkpoint(Path(directory) / "sharded.ckpt")  # overwriting an existing directory
    return {"params": parameters_of(model), "keys": gathered_keys}


def _resume_worker(rank: int, world_size: int, directory: str) -> dict:
    _, model = _fit(_sharded(data_parallel_size=2, schedule="GPipe"), 4, TOTAL,
                    ckpt_path=Path(directory) / "sharded.ckpt")
    return parameters_of(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("sharded")
    return run_ranks(_save_worker, 2, str(directory), timeout=150), directory


@pytest.mark.timeout(200)
def test_every_rank_writes_its_own_tensors_into_one_directory(saved):
    results, directory = saved
    path = directory / "sharded.ckpt"
    assert is_sharded(path) and (path / SHARDED_METADATA).is_file()
    assert sorted(p.name for p in directory.iterdir()) == ["sharded.ckpt"]  # no partial or old directory left
    assert len(list(path.glob("*.distcp"))) == 2  # one file of tensors per rank
    # Nothing was gathered: each rank's state holds its own blocks only.
    for rank, result in enumerate(results):
        assert result["keys"] == sorted(result["params"]) and result["keys"], rank
    meta = read_checkpoint(path / SHARDED_METADATA, model_state=False)
    assert "state_dict" not in meta and meta["global_step"] == 3 * FIRST
    names = [n for n, _ in tiny_model().named_parameters()]
    assert [n for g in meta["param_groups"][0] for n in g["params"]] == names  # every parameter, in model order


@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_exactly_on_another_layout_and_in_one_process(saved):
    _, directory = saved
    _, uninterrupted = _fit("auto", 1, TOTAL)
    reference = parameters_of(uninterrupted)
    per_rank = run_ranks(_resume_worker, 4, str(directory), timeout=250)
    assert_ranks_match(per_rank, reference)
    strategy = _sharded()
    try:
        _, one_process = _fit(strategy, 1, TOTAL, ckpt_path=directory / "sharded.ckpt")
    finally:
        strategy.shutdown()  # this process ran the job itself: release its process group
    assert_ranks_match([parameters_of(one_process)], reference)


@pytest.mark.timeout(200)
def test_consolidate_gives_an_ordinary_checkpoint(saved, tmp_path):
    results, directory = saved
    output = tmp_path / "one.ckpt"
    consolidate(directory / "sharded.ckpt", output)
    model = LSTMLanguageModel.load_from_checkpoint(output, map_location="cpu")
    assert_ranks_match([parameters_of(model)], {**results[0]["params"], **results[1]["params"]}, tol=1e-12)
    _, uninterrupted = _fit("auto", 1, TOTAL)
    _, resumed = _fit("auto", 1, TOTAL, ckpt_path=output)  # plain Lightning, optimizer state included
    assert_ranks_match([parameters_of(resumed)], parameters_of(uninterrupted))
    assert torch.equal(read_checkpoint(output)["state_dict"]["decoder.bias"], results[1]["params"]["decoder.bias"])
