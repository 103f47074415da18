"""Replicas that shard (``shard_replicas=True``: FSDP2 over the data-parallel dimension of every stage) train what one
process trains, hold half of each stage's parameters, gradients and optimizer state per replica, and refuse what they
cannot run by name.

Every case trains with Adam and clipping by the global norm (a shard counted twice or left out would change the
norm); the batches change shape (torch's stages infer their buffers again, with gradients waiting under
``accumulate_grad_batches``) and, for a user's global batches, do not split evenly over the replicas.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.base import allocator
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.pipeline.sharding import sharded_modules
from lightning_mp_lstm.planning.layout import LayoutError
from lightning_mp_lstm.strategy import strategy as strategy_module
from tests.helpers import (
    FixedBatches,
    GlobalBatches,
    Gradients,
    TrainLosses,
    _split_worker,
    assert_ranks_match,
    assert_same_training,
    assert_split_equals_one_process,
    lm_batches,
    quiet_trainer,
    rel_error,
    run_ranks,
    tiny_model,
    whole,
)

STEPS = 3


def _model(tied: bool) -> Any:
    return tiny_model(num_layers=3, embedding_dim=8, hidden_size=8, tie_weights=tied, optimizer="adam", lr=0.02)


def _fit(strategy: Any, devices: int, tied: bool = False, rows: int = 8, accumulate: int = 1,
         checkpoint: str | None = None, resume: str | None = None, steps: int = STEPS) -> dict:
    warnings.filterwarnings("ignore")
    thresholds: list[tuple[int, ...]] = []
    set_threshold, reduce_scatter = strategy_module.return_freed_memory, dist.reduce_scatter_single
    strategy_module.return_freed_memory = lambda *t: thresholds.append(t) or set_threshold(*t)
    scatters = []  # FSDP's gradient reduce-scatters
    dist.reduce_scatter_single = lambda *a, **k: scatters.append(1) or reduce_scatter(*a, **k)
    try:
        return {**_fit_recorded(strategy, devices, tied, rows, accumulate, checkpoint, resume, steps, thresholds),
                "reduce_scatters": len(scatters)}
    finally:
        strategy_module.return_freed_memory, dist.reduce_scatter_single = set_threshold, reduce_scatter


def _fit_recorded(strategy: Any, devices: int, tied: bool, rows: int, accumulate: int, checkpoint: str | None,
                  resume: str | None, steps: int, thresholds: list) -> dict:
    model, losses, grads = _model(tied), TrainLosses(), Gradients(gather=True)
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=steps, gradient_clip_val=0.05,
                            accumulate_grad_batches=accumulate)
    data = FixedBatches(rows=rows)
    if rows % 2:  # a user's own global batches of 8, then of ``rows`` (a ragged end), of a size no loader declares
        data = GlobalBatches(train_lengths=(5, 9, 7), rows=8)
        data.train = data.train + lm_batches(rows, (5, 9, 7), seed=5)
        data.batch_size = None
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    held = [p for p in model.parameters()]
    state = [value for p in held for value in trainer.optimizers[0].state[p].values() if value.dim() > 0]
    return {
        "params": {n: whole(p) for n, p in model.named_parameters(remove_duplicate=False)},
        "losses": losses.values, "grads": grads.steps,
        "held": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in held),
        "whole": sum(p.numel() for p in held),
        "state_held": sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in state),
        "sharded": all(isinstance(p, DTensor) for p in held), "thresholds": thresholds,
        "units": _units_with_parameters(trainer.strategy),
    }


def _units_with_parameters(strategy: Any) -> int:
    """The FSDP units of this process that hold parameters of their own (each reduce-scatters its gradients)."""
    if not isinstance(strategy, MPLSTMStrategy) or not strategy.engine.sharded:
        return 0

    def owns_parameters(unit: torch.nn.Module) -> bool:
        inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
        return any(id(p) not in inner for p in unit.parameters())

    return sum(owns_parameters(unit) for unit in sharded_modules(strategy.engine.stage_modules.values()))


@pytest.fixture(scope="module")
def reference() -> dict:
    return _fit("auto", 1)


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_sharded_replicas_equal_one_process_hold_half_each_and_resume_exactly(reference, tmp_path):
    checkpoint = str(tmp_path / "sharded.ckpt")
    sharded = dict(data_parallel_size=2, shard_replicas=True)
    results = assert_split_equals_one_process(_fit, 2, sharded, reference, STEPS, checkpoint=checkpoint)
    for r in results:
        assert r["sharded"]
        assert r["held"] <= r["whole"] // 2 + 8 * 2  # every first dimension halved (odd sizes round up)
        assert r["state_held"] == 2 * r["held"]  # Adam's two moments, sharded like their parameter
        assert r["thresholds"][-1] == (allocator.MMAP_THRESHOLD,)  # the steps return the gathers' freed memory
    # The checkpoint is one process's (whole tensors), and sharded replicas resume from it as one process does.
    saved = read_checkpoint(checkpoint)
    for name, value in reference["params"].items():
        torch.testing.assert_close(saved["state_dict"][name], value, rtol=1e-5, atol=1e-7)
    one_process = _fit("auto", 1, resume=checkpoint, steps=STEPS + 2)
    resumed = run_ranks(_split_worker, 2, _fit, sharded, (), dict(resume=checkpoint, steps=STEPS + 2), timeout=280)
    assert_same_training(resumed, one_process, 2)
    assert_ranks_match([r["params"] for r in resumed], one_process["params"])
    # The same through a checkpoint every rank writes its own shards of (torch.distributed.checkpoint).
    directory = str(tmp_path / "shards")
    by_shards = {**sharded, "checkpoint_format": "sharded"}
    run_ranks(_split_worker, 2, _fit, by_shards, (), dict(checkpoint=directory), timeout=280)
    resumed = run_ranks(_split_worker, 2, _fit, by_shards, (), dict(resume=directory, steps=STEPS + 2), timeout=280)
    assert_same_training(resumed, one_process, 2)
    assert_ranks_match([r["params"] for r in resumed], one_process["params"])


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_sharded_replicas_of_a_tied_pipeline_equal_one_process():
    reference = _fit("auto", 1, tied=True)
    results = assert_split_equals_one_process(
        _fit, 4, dict(data_parallel_size=2, schedule="GPipe", n_microbatches=2, shard_replicas=True), reference,
        STEPS, tied=True)
    assert all(r["sharded"] for r in results)


@pytest.mark.timeout(300)
@pytest.mark.processes
@pytest.mark.parametrize("schedule", [
    dict(schedule="Interleaved1F1B", stages_per_rank=2, n_microbatches=2),
    dict(schedule="LoopedBFS", stages_per_rank=2, n_microbatches=2),
    dict(schedule="Wavefront", n_microbatches=2, time_chunks=3),
], ids=["Interleaved1F1B", "LoopedBFS", "Wavefront"])
def test_sharded_replicas_of_looped_and_wavefront_schedules_equal_one_process(reference, schedule):
    """Torch's schedules of two stages per process gather, reshard and reduce each stage's FSDP units themselves
    (their ``REDUCE_GRAD`` action finds the last backward's gradients reduced already); the wavefront's own loop
    reduces after each stage's last unit of rows x time chunks (the LSTM state carried over the chunks)."""
    layout = dict(data_parallel_size=2, pipeline_parallel_size=2, shard_replicas=True, **schedule)
    results = assert_split_equals_one_process(_fit, 4, layout, reference, STEPS)
    assert all(r["sharded"] for r in results)
    assert all(r["held"] <= r["whole"] // 2 + 8 * 2 for r in results)
    # Each block reduce-scatters once a step, after its stage's last backward, not once per unit (rows x chunks).
    # (Without it the wavefront's second unit found its blocks' gathered parameters freed.)
    assert [r["reduce_scatters"] for r in results] == [STEPS * r["units"] for r in results]
    assert all(r["units"] > 0 for r in results)


def _curve(result: dict) -> list[float]:
    return [loss for _, loss in result["losses"]]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_uneven_global_batches_and_accumulation_over_new_shapes_equal_one_process():
    # Batches of 8 rows, then of 7: the replicas' shares of the 7 are 4 and 3, a shape the second replica meets first
    # while the first one has it (padded to 4, both run it alike); gradients of two batches are summed per step.
    reference = _fit("auto", 1, rows=7, accumulate=2)
    results = run_ranks(_sharded_worker, 2, timeout=280)
    assert_ranks_match([r["params"] for r in results], reference["params"])
    for r in results:
        assert len(_curve(r)) == len(_curve(reference)) == 2 * STEPS
        assert _curve(r) == pytest.approx(_curve(reference), rel=1e-5)
        for got, expected in zip(r["grads"], reference["grads"], strict=True):
            assert max(rel_error(got[n], expected[n]) for n in expected) < 1e-5


def _sharded_worker(rank: int, world_size: int) -> dict:
    strategy = MPLSTMStrategy(data_parallel_size=2, shard_replicas=True, report_after_steps=None, timeout=60)
    return _fit(strategy, world_size, rows=7, accumulate=2)


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(data_parallel_size=2, tensor_parallel_size=2, shard_replicas=True), "tensor_parallel_size=2"),
    (dict(data_parallel_size=2, data_parallel_weights=[2, 1], shard_replicas=True), "data_parallel_weights"),
    (dict(shard_replicas="yes"), "'yes'"),
])
def test_what_sharded_replicas_cannot_run_is_refused_by_name(kwargs, named):
    with pytest.raises((LayoutError, ValueError), match=named):
        MPLSTMStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "trainer_kwargs", "named"), [
    (dict(schedule="ZBVZeroBubble", stages_per_rank=2), {}, "schedule='ZBVZeroBubble'.*allowed: GPipe, 1F1B, "),
    ({}, dict(precision="bf16-true"), "precision='bf16-true'"),
    (dict(verify=True), {}, "verify=True"),
])
def test_sharded_replicas_refuse_schedules_precisions_and_checks_they_cannot_run(kwargs, trainer_kwargs, named):
    strategy = MPLSTMStrategy(data_parallel_size=2, pipeline_parallel_size=2, shard_replicas=True, **kwargs)
    trainer = quiet_trainer(strategy, 4, max_steps=1, **trainer_kwargs)
    with pytest.raises((LayoutError, ValueError), match=named):
        strategy.check(tiny_model(num_layers=3), FixedBatches())
    del trainer
