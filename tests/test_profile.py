"""Tests for lightning_mp_lstm.planning.profile: measured block and stage times, on the device asked for."""

from __future__ import annotations

import torch

from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.pipeline.stages import StageModule
from lightning_mp_lstm.planning import profile
from tests.helpers import tiny_model


def test_block_seconds_are_positive_and_grow_with_the_vocabulary():
    small = pipeline_model(tiny_model(num_layers=2, vocab=50, hidden_size=64))
    big = pipeline_model(tiny_model(num_layers=2, vocab=8000, hidden_size=64))
    cpu = torch.device("cpu")
    times_small = profile.block_seconds(small, small.block_names, 4, 16, cpu, repeats=5, warmup=1)
    times_big = profile.block_seconds(big, big.block_names, 4, 16, cpu, repeats=5, warmup=1)
    assert list(times_small) == small.block_names and all(t > 0 for t in times_small.values())
    assert times_big["decoder"] > 3 * times_small["decoder"]  # 160x the decoder's FLOPs


def test_a_fast_block_is_timed_until_its_runs_fill_the_seconds_asked_for():
    """``least``: more runs than ``repeats`` until they took that long, at most ``MOST_REPEATS`` (a block of a few
    milliseconds timed three times on a shared machine moved by a third call to call)."""
    model = pipeline_model(tiny_model(num_layers=1, vocab=50, hidden_size=16))
    cpu = torch.device("cpu")

    def runs(least: float) -> set[float]:
        return set(profile.block_seconds(model, model.block_names, 2, 4, cpu, repeats=2, warmup=1, statistic=len,
                                         least=least).values())

    assert runs(0.0) == {2} and runs(1e-12) == {2}
    assert runs(1e9) == {profile.MOST_REPEATS}


def test_profiling_builds_its_blocks_on_the_device_and_leaves_the_model_alone():
    """What reaches the timer is on the device profiling was asked for, even when the model itself has no storage
    there (here: the meta device) -- the order bug that crashed CUDA runs profiling CPU blocks with GPU inputs."""
    torch.manual_seed(0)
    with torch.device("meta"):
        module = tiny_model(num_layers=2)
    model = pipeline_model(module)
    devices = []
    timer = profile._time

    def recording(step, make_input, device, modules, repeats, warmup, *statistic):
        devices.extend({p.device.type for m in modules for p in m.parameters()} | {make_input().device.type})
        return timer(step, make_input, device, modules, repeats, warmup, *statistic)

    profile._time = recording
    try:
        state = torch.get_rng_state()
        times = profile.block_seconds(model, model.block_names, 2, 5, torch.device("cpu"), repeats=1, warmup=0)
    finally:
        profile._time = timer
    assert set(times) == set(model.block_names) and set(devices) == {"cpu"}
    assert torch.equal(torch.get_rng_state(), state)  # no random draw leaks out
    assert all(p.is_meta for p in module.parameters())  # nothing of the model was materialized


def test_stage_seconds_time_the_real_modules_without_keeping_gradients():
    module = tiny_model(num_layers=2)
    model = pipeline_model(module)
    stages = {0: StageModule(model.blocks(["embedding", "lstm.0"])),
              1: StageModule(model.blocks(["lstm.1", "decoder"]))}
    times = profile.stage_seconds(model, stages, 2, 5, torch.device("cpu"))
    assert sorted(times) == [0, 1] and all(t > 0 for t in times.values())
    assert all(p.grad is None for p in module.parameters())


def test_median_interval():
    assert profile.median_interval([0.0, 1.0, 3.0, 4.0]) == 1.0
    assert profile.median_interval([1.0]) is None
