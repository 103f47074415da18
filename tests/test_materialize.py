"""No process materializes blocks it does not hold: a model built on the meta device (``trainer.init_module``
with ``empty_init=True``) gets, on every rank, exactly the one-process model's values for its own blocks; and
planning measures blocks on the device they will run on."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.planning import profile
from tests.helpers import FixedBatches, assert_ranks_match, parameters_of, quiet_trainer, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes


class _AtFitStart(pl.Callback):
    """Records this rank's parameters (values and devices) once the strategy set the model up."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.params = parameters_of(pl_module)
        self.devices = {p.device.type for p in pl_module.parameters()}
        self.root_device = trainer.strategy.root_device.type


def _meta_worker(rank: int, world_size: int, strategy_kwargs: dict) -> dict:
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60, **strategy_kwargs)
    devices = []
    timer = profile._time

    def recording(step, make_input, device, modules, repeats, warmup, *statistic):
        devices.extend({p.device.type for m in modules for p in m.parameters()})
        return timer(step, make_input, device, modules, repeats, warmup, *statistic)

    profile._time = recording  # what reaches the timer during planning
    recorder = _AtFitStart()
    trainer = quiet_trainer(strategy, world_size, [recorder], max_steps=1)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        model = tiny_model(num_layers=2, seed=0)
    built_on_meta = all(p.is_meta for p in model.parameters())
    trainer.fit(model, datamodule=FixedBatches())
    return {"params": recorder.params, "devices": recorder.devices, "root": recorder.root_device,
            "built_on_meta": built_on_meta, "profiled_on": sorted(set(devices)),
            "partition": trainer.strategy.partition}


@pytest.mark.timeout(200)
def test_a_meta_model_on_pp4_starts_from_the_one_process_values():
    per_rank = run_ranks(_meta_worker, 4, dict(schedule="GPipe", n_microbatches=2), timeout=180)
    reference = parameters_of(tiny_model(num_layers=2, seed=0))
    assert_ranks_match([r["params"] for r in per_rank], reference, tol=1e-12)
    for rank, result in enumerate(per_rank):
        assert result["built_on_meta"], rank
        # Each rank holds exactly one block (4 blocks, 4 stages) and nothing of the others.
        block = result["partition"][rank][0]
        assert sorted(result["params"]) == sorted(n for n in reference if n.startswith(block + ".")), rank
        assert result["devices"] == {result["root"]}, rank


@pytest.mark.timeout(200)
def test_planning_profiles_blocks_on_the_device_they_run_on():
    """The balanced-by-time split and n_microbatches='auto' measure on strategy.root_device, with a model that
    has no storage anywhere yet (profiling the model's own meta blocks, or blocks on another device than the
    inputs, is the ordering bug that crashed CUDA runs)."""
    kwargs = dict(partition="balanced", balance_by="time", n_microbatches="auto", schedule="1F1B")
    per_rank = run_ranks(_meta_worker, 2, kwargs, timeout=180)
    for rank, result in enumerate(per_rank):
        assert result["profiled_on"] == [result["root"]], rank
        assert result["partition"] == per_rank[0]["partition"]
