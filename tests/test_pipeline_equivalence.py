"""The pipeline engine's complete step (forward, backward, the sums over replicas) gives the loss and gradients of
the plain module on one process, for every schedule and layout (dropout off)."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_mp_lstm.models.language_model_blocks import prediction_from_logits
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum
from lightning_mp_lstm.planning.layout import ParallelLayout
from tests.helpers import cpu_engine, lm_batches, rel_error, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes


def _compare_worker(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = []
    for cfg in configs:
        cfg = dict(cfg)
        ragged = cfg.pop("ragged", False)  # rows not divisible by n_microbatches: padded with empty rows
        rows = cfg.pop("rows_per_microbatch", 2)
        layout = ParallelLayout(**cfg)
        # The loss decodes slices of 4 tokens (a microbatch has 10 to 18): the reference's logits are whole.
        module = tiny_model(num_layers=max(2, layout.num_stages - 1), loss_chunk_tokens=4)
        reference = copy.deepcopy(module)
        engine = cpu_engine(module, layout, rank)
        share = rows * layout.n_microbatches - (1 if ragged else 0)
        worst = {"loss": 0.0, "grad": 0.0, "params": len(list(module.parameters()))}
        for inputs, targets in lm_batches(share * layout.data_parallel_size, lengths=(5, 9)):
            module.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            result = engine.forward_backward((inputs, targets))  # the global batch: each replica takes its rows
            engine.reduce_gradients(module.parameters())
            ref_tokens = (targets != 0).sum()
            ref_loss = token_loss_sum(reference(inputs)[0], targets) / ref_tokens
            ref_loss.backward()
            assert int(result.tokens) == int(ref_tokens)
            worst["loss"] = max(worst["loss"], rel_error(result.loss, ref_loss.detach()))
            ref_params = dict(reference.named_parameters())
            for name, p in module.named_parameters():
                worst["grad"] = max(worst["grad"], rel_error(p.grad, ref_params[name].grad))
            # Forward only (validation, prediction) on the same batch: every schedule, V-shaped ones included.
            with torch.no_grad():
                evaluated = engine.evaluate((inputs, targets))
                logits = reference(inputs)[0]
                expected = token_loss_sum(logits, targets) / ref_tokens
            predicted = engine.predict((inputs, targets))["log_probs"]
            worst["eval"] = max(worst.get("eval", 0.0), rel_error(evaluated.loss, expected),
                                rel_error(predicted, prediction_from_logits(logits, targets)["log_probs"]))
        # One stage + schedule per bucket shape and mode, built lazily and reused.
        worst["shapes"] = [key for key in engine.cached_shapes if key[2] == "train"]
        results.append({"config": cfg, **worst})
        dist.barrier()
    dist.destroy_process_group()
    return results


def _check(results_per_rank: list[list[dict]]) -> None:
    for rank_results in results_per_rank:
        for r in rank_results:
            assert r["params"] > 0, r
            assert r["loss"] < 1e-6, r
            assert r["grad"] < 1e-5, r
            assert r["eval"] < 1e-5, r
            assert [(length, mode) for _, length, mode in r["shapes"]] == [(5, "train"), (9, "train")], r


PP2 = [
    dict(pipeline_parallel_size=2, schedule="GPipe", n_microbatches=2),
    dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=4, ragged=True),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble", n_microbatches=4),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="DualPipeV", n_microbatches=4),
    # A microbatch of one row: a batch-first LSTM's output is then a view, which the split backward cannot detach.
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble", n_microbatches=4,
         rows_per_microbatch=1),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="LoopedBFS", n_microbatches=2),
    dict(data_parallel_size=2, pipeline_parallel_size=1, schedule="1F1B", n_microbatches=2),
]
PP4 = [
    dict(pipeline_parallel_size=4, schedule="GPipe", n_microbatches=2),
    dict(pipeline_parallel_size=4, schedule="1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=4, stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=4, stages_per_rank=2, schedule="InterleavedZeroBubble", n_microbatches=4),
    dict(data_parallel_size=2, pipeline_parallel_size=2, schedule="1F1B", n_microbatches=2),
    dict(data_parallel_size=4, pipeline_parallel_size=1, schedule="GPipe", n_microbatches=1),
    dict(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2, schedule="Interleaved1F1B",
         n_microbatches=2),
]


@pytest.mark.timeout(240)
def test_two_processes_match_single_process():
    _check(run_ranks(_compare_worker, 2, PP2, timeout=200))


@pytest.mark.timeout(300)
def test_four_processes_match_single_process():
    _check(run_ranks(_compare_worker, 4, PP4, timeout=280))


@pytest.mark.timeout(120)
def test_one_process_runs_the_same_schedules():
    """pp=1 runs through the same schedule path (no separate local loop), microbatches included."""
    configs = [dict(schedule="1F1B", n_microbatches=1), dict(schedule="GPipe", n_microbatches=2, ragged=True),
               dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2)]
    _check(run_ranks(_compare_worker, 1, configs, timeout=100))
