"""Every process of one data-parallel replica loads the same batch: Lightning's worker seeding goes by replica, and
processes that loaded different batches stop at the first step of the epoch (or of an evaluation), on every rank."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.strategy.batches import batch_fingerprint
from tests.helpers import VOCAB, quiet_trainer, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes


class RandomlyRelabelled(Dataset):
    """Token rows, each relabelled by a random shift of its ids (inputs and targets alike) when it is loaded.

    Args:
        per_process: draw the shift from a generator seeded by the process's global rank (else from torch's global
            one, which Lightning seeds in a loader's workers).
    """

    def __init__(self, per_process: bool = False) -> None:
        self.rows = torch.randint(0, VOCAB, (32, 8), generator=torch.Generator().manual_seed(1))
        self.per_process = per_process
        self._generator: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_process and self._generator is None:
            self._generator = torch.Generator().manual_seed(dist.get_rank())
        shift = torch.randint(0, VOCAB, (), generator=self._generator)
        row = (self.rows[index] + shift) % VOCAB
        return row[:-1], row[1:]


class Relabelled(pl.LightningDataModule):
    def __init__(self, per_process: bool = False, workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.per_process, self.workers = 8, per_process, workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomlyRelabelled(self.per_process), batch_size=self.batch_size, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class BatchProbe(pl.Callback):
    def __init__(self) -> None:
        self.fingerprints: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.fingerprints.append(batch_fingerprint(batch))


def _worker(rank: int, world_size: int, per_process: bool, workers: int) -> dict:
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, workers=True, verbose=False)
    probe = BatchProbe()
    trainer = quiet_trainer(MPLSTMStrategy(n_microbatches=2, report_after_steps=None), world_size, [probe],
                            max_epochs=2, limit_val_batches=0)
    try:
        trainer.fit(tiny_model(), datamodule=Relabelled(per_process, workers))
        error = None
    except ValueError as err:
        error = str(err)
    return {"fingerprints": probe.fingerprints, "error": error, "global_step": trainer.global_step}


@pytest.mark.timeout(120)
def test_loader_workers_seeded_by_lightning_draw_the_same_on_every_process_of_a_replica():
    """``seed_everything(workers=True)`` and a loader with workers: Lightning seeded each process's workers by global
    rank, so the two stages of the pipeline relabelled each batch differently (inputs of one batch, targets of
    another; no error)."""
    first, second = run_ranks(_worker, 2, False, 1, timeout=100)
    assert first["error"] is None and second["error"] is None
    assert first["global_step"] == second["global_step"] == 8
    assert len(first["fingerprints"]) == 8 and first["fingerprints"] == second["fingerprints"]
    assert len({str(f) for f in first["fingerprints"]}) == 8  # the batches do differ from one another


@pytest.mark.timeout(120)
def test_processes_of_a_replica_that_loaded_different_batches_stop_at_the_first_step():
    first, second = run_ranks(_worker, 2, True, 0, timeout=100)
    assert first["error"] == second["error"] == (
        "the processes of data-parallel replica 0 loaded different batches at the first batch of epoch 0 (global "
        "ranks 0 and 1): every pipeline stage and tensor-parallel shard of a replica must see the same batch (the "
        "first stage reads its inputs, the last its targets). A random transform in the data pipeline that draws "
        "per process does this, e.g. a DataLoader worker_init_fn or a generator seeded by global rank; seed it by "
        "data-parallel rank (trainer.strategy.distributed_sampler_kwargs['rank']) or by nothing, or draw in a method "
        "the pipeline declaration names")
    assert first["global_step"] == second["global_step"] == 0


def _validate_worker(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    trainer = quiet_trainer(MPLSTMStrategy(n_microbatches=2, report_after_steps=None), world_size)
    try:
        trainer.validate(tiny_model(), datamodule=Relabelled(per_process=True))
        return "no error"
    except ValueError as err:
        return str(err)


@pytest.mark.timeout(120)
def test_an_evaluation_whose_processes_loaded_different_batches_stops_at_its_first_batch():
    first, second = run_ranks(_validate_worker, 2, timeout=100)
    assert first == second
    assert first.startswith("the processes of data-parallel replica 0 loaded different batches at the first val "
                            "batch (global ranks 0 and 1)")
