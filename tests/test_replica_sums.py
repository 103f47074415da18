"""Replicated gradients are summed over the replicas during the backward pass (posted as each is accumulated for
the last time in the step), with the same gradients as one process with the whole batch."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_mp_lstm.models import decoded_loss
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum
from lightning_mp_lstm.pipeline.replica_sums import ReplicaSums
from lightning_mp_lstm.planning.layout import ParallelLayout
from tests.helpers import cpu_engine, lm_batches, rel_error, run_ranks, tiny_model


def test_sums_are_posted_in_one_order_whatever_order_autograd_finishes_the_gradients(one_process_group):
    """A group's collectives pair up in the order they are posted: two replicas whose autograd finished the same
    gradients in different orders must still post their sums in the same order (reversed registration)."""
    module = torch.nn.Module()
    for name in "abc":
        module.register_parameter(name, torch.nn.Parameter(torch.full((3,), 2.0)))
    a, b, c = module.a, module.b, module.c
    sums = ReplicaSums(dist.group.WORLD)
    sums.attach({0: module})
    for first, last in ((a, c), (c, a)):  # a chain finishes its last factor's gradient first
        module.zero_grad(set_to_none=True)
        with sums.step(), sums.posting(0):
            ((((first * 2).sum() * b).sum() * last).sum()).backward()
            assert list(sums._posted) == [id(c), id(b), id(a)]
        assert sums.finish() == [c, b, a] and sums.overlapped == 3
        assert float(first.grad[0]) == 2 * 3 * 2 * 3 * 2 and float(b.grad[0]) == 4 * 3 * 2 * 3


def _reentrant(function, *args, use_reentrant, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202, ARG001
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def _worker(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """Per config: the worst relative error of the loss and every gradient against one process, how many
    parameters the backward pass summed, how many this rank holds, and how many gradients grew after their sum was
    posted."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    regrown: list[int] = []
    finish = ReplicaSums.finish

    def counting_finish(self: ReplicaSums) -> set[int]:
        regrown.append(len(self._again))
        return finish(self)

    ReplicaSums.finish = counting_finish
    results = []
    for cfg in configs:
        cfg = dict(cfg)
        accumulation = cfg.pop("accumulation", 1)
        reentrant = cfg.pop("reentrant", False)
        decoded_loss.checkpoint = _reentrant if reentrant else torch.utils.checkpoint.checkpoint
        layout = ParallelLayout(**cfg)
        module = tiny_model(num_layers=max(2, layout.num_stages - 1), loss_chunk_tokens=4)
        reference = copy.deepcopy(module)
        engine = cpu_engine(module, layout, rank)
        held = len({id(p) for stage in engine.stage_modules.values() for p in stage.parameters()})
        worst = {"loss": 0.0, "grad": 0.0, "held": held, "overlapped": [], "regrown": 0}
        regrown.clear()
        for inputs, targets in lm_batches(2 * layout.n_microbatches * layout.data_parallel_size, lengths=(5, 9)):
            module.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            result = engine.forward_backward((inputs, targets), accumulation=accumulation)
            worst["overlapped"].append(engine.replica_sums.overlapped if accumulation == 1 else 0)
            engine.reduce_gradients(module.parameters())
            expected_loss = token_loss_sum(reference(inputs)[0], targets) / (targets != 0).sum()
            (expected_loss / accumulation).backward()
            worst["loss"] = max(worst["loss"], rel_error(result.loss, expected_loss.detach()))
            expected = dict(reference.named_parameters())
            for name, p in module.named_parameters():
                worst["grad"] = max(worst["grad"], rel_error(p.grad, expected[name].grad))
        worst["regrown"] = sum(regrown)
        results.append({"config": cfg, "accumulation": accumulation, "reentrant": reentrant, **worst})
        dist.barrier()
    dist.destroy_process_group()
    return results


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_two_replicas_sum_every_gradient_during_the_backward_pass_with_one_process_gradients():
    configs = [dict(data_parallel_size=2, schedule="1F1B", n_microbatches=2),
               dict(data_parallel_size=2, schedule="GPipe", n_microbatches=1, reentrant=True),
               dict(data_parallel_size=2, schedule="1F1B", n_microbatches=1, accumulation=2)]
    for rank in run_ranks(_worker, 2, configs, timeout=180):
        plain, reentrant, accumulated = rank
        for r in rank:
            assert r["loss"] < 1e-6 and r["grad"] < 1e-5, r
        # Every parameter's sum was posted during the backward pass, none left for after it.
        assert plain["overlapped"] == [plain["held"]] * 2 and plain["regrown"] == 0, plain
        # A decoder checkpointed with use_reentrant=True accumulates its gradient once per slice of tokens: the
        # parts after the first posted sum are summed on their own, and the gradients are still one process's.
        assert reentrant["overlapped"] == [reentrant["held"]] * 2 and reentrant["regrown"] > 0, reentrant
        # Accumulated batches are summed after the last one, as before.
        assert accumulated["overlapped"] == [0, 0] and accumulated["regrown"] == 0, accumulated


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_pipelined_replicas_sum_each_stages_gradients_during_its_last_backward():
    configs = [dict(data_parallel_size=2, pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2),
               dict(data_parallel_size=2, pipeline_parallel_size=2, schedule="Wavefront", n_microbatches=1,
                    time_chunks=2),
               dict(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2, schedule="Interleaved1F1B",
                    n_microbatches=2),
               # A split backward: torch adds the weight gradients itself; the stage posts them after its last.
               dict(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble",
                    n_microbatches=4)]
    for rank in run_ranks(_worker, 4, configs, timeout=280):
        for r in rank:
            assert r["loss"] < 1e-6 and r["grad"] < 1e-5, r
            assert r["overlapped"] == [r["held"]] * 2 and r["held"] > 0, r


def _unused_worker(rank: int, world_size: int, cases: list[tuple[bool, int]]) -> list[dict]:
    """Per case (whether any replica's targets reach the adaptive softmax's last cluster, accumulation): the worst
    relative error of a gradient against one process, and the parameters whose gradient is ``None`` here and there."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = []
    for reached, accumulation in cases:
        module = tiny_model(num_layers=2, vocab=100, softmax="adaptive", hidden_size=32, embedding_dim=32)
        reference = copy.deepcopy(module)
        engine = cpu_engine(module, ParallelLayout(data_parallel_size=2, schedule="1F1B", n_microbatches=1), rank)
        generator = torch.Generator().manual_seed(3)
        inputs = torch.randint(1, 10, (4, 5), generator=generator)
        targets = torch.randint(1, 10, (4, 5), generator=generator)
        if reached:
            targets[0, 0] = 99  # in replica 0's rows only
        module.zero_grad(set_to_none=True)
        engine.forward_backward((inputs, targets), accumulation=accumulation)
        engine.reduce_gradients(module.parameters())
        loss, _ = reference._loss((inputs, targets), "train")  # what its training_step returns, without a Trainer
        (loss / accumulation).backward()
        expected = dict(reference.named_parameters())
        got = dict(module.named_parameters())
        results.append({
            "none": sorted(n for n, p in got.items() if p.grad is None),
            "expected_none": sorted(n for n, p in expected.items() if p.grad is None),
            "grad": max((rel_error(p.grad, expected[n].grad) for n, p in got.items() if p.grad is not None
                         and expected[n].grad is not None), default=0.0)})
        dist.barrier()
    dist.destroy_process_group()
    return results


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_a_gradient_one_replica_did_not_compute_is_summed_and_one_no_replica_computed_stays_none():
    """An adaptive softmax's last cluster reached by one replica's targets only: that replica alone computes its
    gradient, the other adds zeros (both post the same sums; before, the replicas posted different collectives and
    gloo aborted). Reached by none: its gradient stays None, as one process leaves it."""
    cases = [(True, 1), (True, 2), (False, 1), (False, 2)]
    for rank in run_ranks(_unused_worker, 2, cases, timeout=180):
        for (reached, _), r in zip(cases, rank, strict=True):
            assert r["grad"] < 1e-5, r
            assert r["none"] == r["expected_none"], r
            # The middle cluster is reached by no target in either case; the last one only where a replica's is.
            assert ("decoder.tail.1.0.weight" in r["none"]) != reached and "decoder.tail.0.0.weight" in r["none"], r
