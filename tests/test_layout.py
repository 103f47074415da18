"""Layout validation without processes: every bad combination names its factors."""

import pytest

from lightning_mp_lstm.planning.layout import SCHEDULES, LayoutError, ParallelLayout, schedule_style


def test_world_size_and_stage_counts():
    layout = ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2,
                            schedule="interleaved1f1b", n_microbatches=4)
    assert layout.schedule == "Interleaved1F1B"
    assert (layout.world_size, layout.num_stages) == (4, 4)
    assert layout.coordinates(3) == (1, 1)
    assert layout.stage_indices(1) == [1, 3]


def test_v_schedules_place_first_and_last_stage_on_rank_zero():
    layout = ParallelLayout(pipeline_parallel_size=2, stages_per_rank=2, schedule="ZBVZeroBubble", n_microbatches=4)
    assert layout.stage_indices(0) == [0, 3]
    assert layout.stage_indices(1) == [1, 2]


def test_world_size_mismatch_names_every_factor():
    layout = ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, n_microbatches=2)
    with pytest.raises(LayoutError, match=r"data_parallel_size=2 x pipeline_parallel_size=2 = 4 .*world size is 3"):
        layout.check_world_size(3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="2F2B"), r"unknown schedule '2F2B'; allowed: GPipe, 1F1B, Interleaved1F1B"),
        (dict(schedule="Interleaved1F1B", stages_per_rank=1), r"multi-stage schedule and needs stages_per_rank >= 2"),
        (dict(schedule="1F1B", stages_per_rank=2), r"runs one stage per rank, but stages_per_rank=2"),
        (dict(schedule="ZBVZeroBubble", stages_per_rank=3), r"V-shaped and needs stages_per_rank=2"),
        (dict(schedule="1F1B", pipeline_parallel_size=4, n_microbatches=2), r"n_microbatches >= number of stages"),
        (dict(schedule="Interleaved1F1B", pipeline_parallel_size=2, stages_per_rank=2, n_microbatches=7),
         r"multiple of max\(1, n_microbatches // pipeline_parallel_size\) = 3; got n_microbatches=7"),
        (dict(data_parallel_size=0), r"data_parallel_size must be a positive integer, got 0"),
    ],
)
def test_bad_layouts(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs)


def test_microbatches_must_divide_the_batch():
    layout = ParallelLayout(pipeline_parallel_size=2, n_microbatches=4)
    layout.check_batch(8)
    with pytest.raises(LayoutError, match=r"n_microbatches=4 must divide the per-replica batch of 6 .*\[1, 2, 3, 6\]"):
        layout.check_batch(6)
    with pytest.raises(LayoutError, match=r"at most 2"):
        layout.check_batch(2)


def test_every_torch_schedule_is_known():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.lower().endswith(name.lower())
        assert schedule_style(name.upper())[0] == name


def test_tensor_parallel_is_the_innermost_mesh_dimension():
    layout = ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2, n_microbatches=2)
    assert layout.world_size == 8 and layout.num_stages == 2
    # r = (replica * pp + pipeline_rank) * tp + tensor_rank: a stage's shards are neighbouring ranks
    assert [layout.mesh_coordinates(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(layout.global_rank(*layout.mesh_coordinates(r)) == r for r in range(8))
    assert layout.coordinates(7) == (1, 1) and layout.tensor_rank(7) == 1


def test_tensor_parallel_world_size_and_resolve():
    layout = ParallelLayout.resolve(4, data_parallel_size=1, tensor_parallel_size=2)
    assert (layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.world_size) == (2, 2, 4)
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size=1 x tensor_parallel_size=2 = 2 .*world size is 3"):
        ParallelLayout(tensor_parallel_size=2).check_world_size(3)
    with pytest.raises(LayoutError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4 does not divide the "
                                          r"world size 6; allowed products: \[1, 2, 3, 6\]"):
        ParallelLayout.resolve(6, data_parallel_size=2, tensor_parallel_size=2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(LayoutError, match=rf"tensor_parallel_size must be a positive integer, got {bad!r}"):
            ParallelLayout(tensor_parallel_size=bad)
        with pytest.raises(LayoutError, match="tensor_parallel_size must be a positive integer"):
            ParallelLayout.resolve(2, tensor_parallel_size=bad)
