"""Every layout and schedule gives the single-process loss and gradients (dropout off)."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_mp_lstm.layout import ParallelLayout
from lightning_mp_lstm.model import LSTMLanguageModel
from lightning_mp_lstm.partition import even_partition
from lightning_mp_lstm.pipeline import all_reduce_gradients, build_pipeline
from tests.helpers import VOCAB, lm_batches, rel_error, run_ranks


def _compare_worker(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = []
    for cfg in configs:
        cfg = dict(cfg)
        ragged = cfg.pop("ragged", False)  # rows not divisible by n_microbatches: padded with empty rows
        layout = ParallelLayout(**cfg)
        dp_rank, pp_rank = layout.coordinates(rank)
        mesh = init_device_mesh("cpu", (layout.data_parallel_size, layout.pipeline_parallel_size),
                                mesh_dim_names=("dp", "pp"))
        torch.manual_seed(0)
        model = LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=max(2, layout.num_stages - 1))
        reference = copy.deepcopy(model)
        partition = even_partition(model.block_names, layout.num_stages)
        runner = build_pipeline(model, layout, partition, pp_rank, mesh["pp"].get_group(), mesh["dp"].get_group(),
                                torch.device("cpu"))
        share = 2 * layout.n_microbatches - (1 if ragged else 0)
        worst = {"loss": 0.0, "grad": 0.0, "params": 0}
        for inputs, targets in lm_batches(share * layout.data_parallel_size, lengths=(5, 9)):
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            rows = slice(dp_rank * share, (dp_rank + 1) * share)
            loss, n_tokens = runner.run((inputs[rows], targets[rows]), train=True)
            all_reduce_gradients(model.parameters(), mesh["dp"].get_group())
            ref_loss, ref_tokens = reference._local_loss((inputs, targets))
            ref_loss.backward()
            assert int(n_tokens) == int(ref_tokens)
            worst["loss"] = max(worst["loss"], rel_error(loss, ref_loss.detach()))
            ref_params = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                worst["grad"] = max(worst["grad"], rel_error(p.grad, ref_params[name].grad))
            worst["params"] = len(list(model.parameters()))
        # One stage + schedule per bucket shape, built lazily and reused (none for a one-stage pipeline).
        worst["shapes"] = runner.cached_shapes
        results.append({"config": cfg, **worst})
        dist.barrier()
    dist.destroy_process_group()
    return results


def _check(results_per_rank: list[list[dict]], n_blocks_total: int | None = None) -> None:
    for rank_results in results_per_rank:
        for r in rank_results:
            assert r["params"] > 0, r
            assert r["loss"] < 1e-5, r
            assert r["grad"] < 1e-5, r
            if r["config"]["pipeline_parallel_size"] > 1:
                assert [(length, mode) for _, length, mode in r["shapes"]] == [(5, "train"), (9, "train")], r


PP2 = [
    dict(pipeline_parallel_size=2, schedule="GPipe", n_microbatches=2),
    dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=2, schedule="1F1B", n_microbatches=4, ragged=True),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=4),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble", n_microbatches=4),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="DualPipeV", n_microbatches=4),
    dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="LoopedBFS", n_microbatches=2),
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
def test_pure_data_parallel_and_interleaved_two_ranks():
    configs = [
        dict(data_parallel_size=2, pipeline_parallel_size=1, schedule="1F1B", n_microbatches=2),
    ]
    _check(run_ranks(_compare_worker, 2, configs, timeout=100))
