"""A stage with one stage per process on gloo posts each microbatch's receive when the schedule asks for the one
before it (``Stage.receive_ahead``); no other placement or backend does. The equivalence tests
(``tests/test_pipeline_equivalence.py``) check the values it receives."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_mp_lstm.pipeline import engine as engine_module
from lightning_mp_lstm.pipeline.stages import Stage
from lightning_mp_lstm.planning.layout import ParallelLayout
from tests.helpers import cpu_engine, lm_batches, run_ranks, tiny_model


def _posted_worker(rank: int, world_size: int, schedule: str) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    seen: dict[str, list] = {"forward": [], "backward": []}
    forward, backward = Stage.forward_one_chunk, Stage.backward_one_chunk

    def record_forward(self, chunk, *args, **kwargs):
        seen["forward"].append((chunk, sorted(i for d, i in self._posted if d == "forward")))
        return forward(self, chunk, *args, **kwargs)

    def record_backward(self, chunk, *args, **kwargs):
        seen["backward"].append((chunk, sorted(i for d, i in self._posted if d == "backward")))
        return backward(self, chunk, *args, **kwargs)

    Stage.forward_one_chunk, Stage.backward_one_chunk = record_forward, record_backward
    layout = ParallelLayout(pipeline_parallel_size=2, schedule=schedule, n_microbatches=4)
    engine = cpu_engine(tiny_model(), layout, rank)
    inputs, targets = lm_batches(8, lengths=(6,))[0]
    for _ in range(2):  # the second step runs without the first step's shape inference
        seen["forward"].clear()
        seen["backward"].clear()
        engine.forward_backward((inputs, targets))
    stage = next(iter(engine._schedules.values()))._stage
    result = {**seen, "ahead": stage.receive_ahead, "left": sorted(stage._posted)}
    dist.barrier()
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.processes
def test_each_receive_is_posted_when_the_schedule_asks_for_the_one_before_it(schedule):
    first, last = run_ranks(_posted_worker, 2, schedule, timeout=90)
    assert first["ahead"] and last["ahead"]
    # The last stage receives activations: as microbatch i's forward starts, i + 1's receive is posted beside i's.
    assert last["forward"] == [(i, [i, i + 1] if i < 3 else [i]) for i in range(4)]
    # The first stage receives gradients: as microbatch i's backward starts, i + 1's receive is posted too.
    assert first["backward"] == [(i, [i, i + 1] if i < 3 else [i]) for i in range(4)]
    # Nothing is posted where nothing comes (the first stage's input, the last stage's output gradient) or is left
    # posted after the step.
    assert all(posted == [] for _, posted in first["forward"] + last["backward"])
    assert first["left"] == last["left"] == []


@pytest.mark.parametrize(("config", "backend", "ahead"), [
    (dict(schedule="1F1B", n_microbatches=2), "gloo", True),
    (dict(schedule="GPipe", n_microbatches=2), "gloo", True),
    (dict(schedule="1F1B", n_microbatches=2), "nccl", False),  # NCCL pairs p2p operations in issue order
    (dict(stages_per_rank=2, schedule="Interleaved1F1B", n_microbatches=2), "gloo", False),  # two kinds per peer
])
def test_receives_go_ahead_only_for_one_stage_per_process_on_gloo(one_process_group, monkeypatch, config, backend,
                                                                  ahead):
    engine = cpu_engine(tiny_model(), ParallelLayout(**config), 0)
    monkeypatch.setattr(engine_module.dist, "get_backend", lambda group=None: backend)
    schedule = engine._build_schedule("train", rows=4, length=5)
    stages = [schedule._stage] if hasattr(schedule, "_stage") else schedule._stages
    assert [stage.receive_ahead for stage in stages] == [ahead] * len(stages)
    assert all(isinstance(stage, Stage) for stage in stages)
