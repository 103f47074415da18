"""The clip's global norm over the pipeline through receives posted before the schedule (gloo): the same norm as the
all-reduce, the same bits on every rank, and a step that ends without its clip leaves no receive behind."""

from __future__ import annotations

import types
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_mp_lstm.planning.layout import ParallelLayout
from lightning_mp_lstm.strategy import precision as precision_module
from lightning_mp_lstm.strategy.precision import PipelinePrecision
from tests.helpers import cpu_engine, run_ranks, tiny_model


def _give_gradients(module: torch.nn.Module, rank: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * scale
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _clip(engine, module: torch.nn.Module, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    norm = engine.clip_grad_norm_(list(module.parameters()), max_norm)
    return float(norm), [p.grad.clone() for p in module.parameters()]


def _exchange_worker(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    layout = ParallelLayout(pipeline_parallel_size=world_size, n_microbatches=world_size)
    module = tiny_model(num_layers=world_size)
    engine = cpu_engine(module, layout, rank)
    own = _give_gradients(module, rank, scale=0.3)
    squared = sum(float(g.double().pow(2).sum()) for g in own.values())
    expected = sum(dist_all(squared)) ** 0.5

    reference_norm, reference_grads = _clip(engine, module, max_norm=1.0)  # the all-reduce
    _give_gradients(module, rank, scale=0.3)
    engine.expect_clip()
    posted = engine._norms.posted
    exchanged_norm, exchanged_grads = _clip(engine, module, max_norm=1.0)

    # A step that ends without its clip (an error on every rank): its receives are answered, the next clip is right.
    _give_gradients(module, rank, scale=0.3)
    engine.expect_clip()
    engine.cancel_clip()
    engine.expect_clip()
    after_cancel_norm, _ = _clip(engine, module, max_norm=1.0)
    engine.flush()
    dist.barrier()
    dist.destroy_process_group()
    return {"expected": expected, "reference": reference_norm, "exchanged": exchanged_norm,
            "after_cancel": after_cancel_norm, "posted": posted,
            "same_grads": all(torch.equal(a, b) for a, b in zip(reference_grads, exchanged_grads, strict=True)),
            "clipped": all(not torch.equal(a, b) for a, b in zip(reference_grads, own.values(), strict=True))}


def dist_all(value: float) -> list[float]:
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.processes
def test_the_posted_receives_give_every_rank_the_global_norm_bit_for_bit(world_size):
    results = run_ranks(_exchange_worker, world_size, timeout=90)
    for r in results:
        assert r["posted"]
        assert r["reference"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["exchanged"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["after_cancel"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["clipped"]  # the norm is above max_norm: the gradients were scaled
        assert r["same_grads"] or world_size > 2  # two ranks: a + b either way; more: the sum's order may differ
    # Every rank scales by the same coefficient: the exchanged sums are the same bits everywhere.
    assert len({r["exchanged"] for r in results}) == 1
    assert len({r["after_cancel"] for r in results}) == 1


class _Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def expect_clip(self) -> None:
        self.calls.append("expect")

    def cancel_clip(self) -> None:
        self.calls.append("cancel")

    def reduce_gradients(self, parameters) -> None:
        self.calls.append("reduce")


def _module(clip_val, algorithm, automatic=True) -> pl.LightningModule:
    module = pl.LightningModule()
    module.automatic_optimization = automatic
    module._trainer = types.SimpleNamespace(gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    return module


@pytest.mark.parametrize(("clip_val", "algorithm", "automatic", "clips"), [
    (0.5, None, True, True),
    (0.5, pl.utilities.GradClipAlgorithmType.NORM, True, True),
    (0.5, pl.utilities.GradClipAlgorithmType.VALUE, True, False),
    (None, None, True, False),
    (0.0, None, True, False),
    (0.5, None, False, False),  # manual optimization: Lightning never clips for it
])
def test_the_receives_are_posted_only_for_a_step_lightning_clips_by_norm(clip_val, algorithm, automatic, clips):
    assert precision_module._clips_by_norm(_module(clip_val, algorithm, automatic)) == clips


def test_a_step_that_raises_answers_the_receives_it_posted():
    plugin = PipelinePrecision()
    plugin.engine = _Engine()
    module = _module(0.5, None)
    weight = torch.nn.Parameter(torch.ones(2))
    module.register_parameter("weight", weight)
    plugin.connect(module, [], [])
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def closure():
        raise FloatingPointError("the loss is nan on every rank")

    with pytest.raises(FloatingPointError):
        plugin.optimizer_step(optimizer, module, closure)
    assert plugin.engine.calls == ["expect", "cancel"]


def _sum_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    from lightning_mp_lstm.pipeline.gradients import all_reduce_gradients

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    weights = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5)),
               torch.nn.Parameter(torch.zeros(2))]
    weights[0].grad = torch.arange(12.0).reshape(4, 3).t() * (rank + 1)  # not contiguous
    weights[1].grad = torch.full((5,), float(rank + 1))
    all_reduce_gradients(weights, dist.group.WORLD)
    dist.destroy_process_group()
    return [w.grad for w in weights[:2]] + [weights[2].grad]


@pytest.mark.processes
def test_replicas_sum_every_gradient_in_place_a_non_contiguous_one_too():
    """The gradients' all-reduces are posted at once, each on its own tensor (no flat copy); a gradient that is not
    contiguous is reduced through a contiguous copy and written back; a parameter without one is left alone."""
    results = run_ranks(_sum_worker, 2, timeout=90)
    for grads in results:
        torch.testing.assert_close(grads[0], torch.arange(12.0).reshape(4, 3).t() * 3, rtol=0, atol=0)
        torch.testing.assert_close(grads[1], torch.full((5,), 3.0), rtol=0, atol=0)
        assert grads[2] is None
