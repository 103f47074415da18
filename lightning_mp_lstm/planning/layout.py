"""Parallel layout: how processes are arranged into data-parallel replicas, pipeline stages and tensor-parallel
shards.

The layout is a small validated, immutable dataclass: :meth:`ParallelLayout.resolve` turns the user's options
(``"auto"`` included) and the world size into one, once; it maps stages to ranks both ways and builds the
:class:`~torch.distributed.device_mesh.DeviceMesh` with its dimension names once the process group exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mp_lstm.base.validation import check_positive_int

__all__ = ["MESH_DIMS", "LayoutError", "ParallelLayout", "SCHEDULES", "TIME_SCHEDULES", "WAVEFRONT",
           "default_stages_per_rank", "schedule_style"]

#: Names of the device mesh's dimensions, outermost first.
MESH_DIMS = ("data_parallel", "pipeline_parallel", "tensor_parallel")

# Schedule name -> how stages sit on ranks. "single": one stage per rank; "loop": stage s on rank
# s % pp (interleaved); "v": rank r holds stages r and 2*pp-1-r (V-shaped). Names as torch spells them.
SCHEDULES: dict[str, str] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
#: The schedule that splits the time axis instead of the batch (:mod:`lightning_mp_lstm.pipeline.wavefront`, this
#: library's own): stage s on rank s % pp, one or more stages per rank.
WAVEFRONT = "Wavefront"
#: Schedules of this library (not torch's), by name -> placement style.
TIME_SCHEDULES: dict[str, str] = {WAVEFRONT: "wavefront"}


class LayoutError(ValueError):
    """A parallel layout that cannot run: the message names every factor and what is allowed."""


def schedule_style(name: str) -> tuple[str, str]:
    """Return the canonical schedule name and its stage placement style.

    Args:
        name: a schedule name, case-insensitive (``"1f1b"``, ``"GPipe"``, ``"zbvzerobubble"``...).

    Returns:
        ``(canonical_name, style)`` with style ``"single"``, ``"loop"``, ``"v"`` or ``"wavefront"`` (stages placed
        as ``"loop"`` does, any number per rank).

    Raises:
        LayoutError: the name is not one of :data:`SCHEDULES` or :data:`TIME_SCHEDULES`.
    """
    known = {**SCHEDULES, **TIME_SCHEDULES}
    by_lower = {k.lower(): k for k in known}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise LayoutError(f"unknown schedule {name!r}; allowed: {', '.join(known)}")
    return canonical, known[canonical]


@dataclass(frozen=True)
class ParallelLayout:
    """Data parallel x pipeline parallel x tensor parallel (x virtual stages per rank) arrangement of processes.

    A row-major ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh: global rank
    ``r = (replica * pipeline_parallel_size + pipeline_rank) * tensor_parallel_size + tensor_rank``, so the
    tensor-parallel shards of one stage are neighbouring ranks (one node, the fastest links).

    Attributes:
        data_parallel_size: number of model replicas; data is sharded across them only.
        pipeline_parallel_size: number of processes one replica's pipeline spans.
        stages_per_rank: pipeline stages held by each process (2 for interleaved / V schedules).
        schedule: a name from :data:`SCHEDULES` or ``"Wavefront"`` (case-insensitive).
        n_microbatches: microbatches per (per-replica) batch: splits of its rows.
        tensor_parallel_size: processes one stage's weight matrices are split over (vocabulary-parallel
            embedding and decoder); every one of them runs the same pipeline on the same batch.
        time_chunks: splits of the time axis of every microbatch (``"Wavefront"`` only; 1 otherwise): a stage runs
            chunk c as soon as the previous stage sent it, carrying the LSTM state from chunk c - 1.
    """

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    stages_per_rank: int = 1
    schedule: str = "1F1B"
    n_microbatches: int = 1
    tensor_parallel_size: int = 1
    time_chunks: int = 1

    def __post_init__(self) -> None:
        for field_name in ("data_parallel_size", "pipeline_parallel_size", "stages_per_rank", "n_microbatches",
                           "tensor_parallel_size", "time_chunks"):
            check_positive_int(field_name, getattr(self, field_name), LayoutError)
        canonical, style = schedule_style(self.schedule)
        object.__setattr__(self, "schedule", canonical)
        spr = self.stages_per_rank
        if style == "single" and spr != 1:
            raise LayoutError(
                f"schedule {canonical} runs one stage per rank, but stages_per_rank={spr}; "
                f"use stages_per_rank=1 or a multi-stage schedule "
                f"({', '.join(k for k, v in SCHEDULES.items() if v != 'single')})"
            )
        if style == "loop" and spr < 2:
            raise LayoutError(
                f"schedule {canonical} is a multi-stage schedule and needs stages_per_rank >= 2, "
                f"got stages_per_rank={spr}; use GPipe or 1F1B for one stage per rank"
            )
        if style == "v" and spr != 2:
            raise LayoutError(
                f"schedule {canonical} is V-shaped and needs stages_per_rank=2, got stages_per_rank={spr}"
            )
        if style != "wavefront" and self.time_chunks != 1:
            raise LayoutError(
                f"time_chunks={self.time_chunks} splits the time axis, which only schedule {WAVEFRONT} does; "
                f"schedule {canonical} splits the batch: use schedule={WAVEFRONT!r} or time_chunks=1"
            )
        m, pp, stages = self.n_microbatches, self.pipeline_parallel_size, self.num_stages
        if canonical in ("1F1B", "DualPipeV") and m < stages:
            raise LayoutError(
                f"schedule {canonical} needs n_microbatches >= number of stages; got n_microbatches={m}, "
                f"stages={stages} (pipeline_parallel_size={pp} x stages_per_rank={spr})"
            )
        if canonical in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, m // pp)
            if m % rounds:
                raise LayoutError(
                    f"schedule {canonical} needs n_microbatches to be a multiple of "
                    f"max(1, n_microbatches // pipeline_parallel_size) = {rounds}; got n_microbatches={m} "
                    f"with pipeline_parallel_size={pp} (try a multiple of {pp})"
                )

    @property
    def world_size(self) -> int:
        """Processes the layout needs: data_parallel_size x pipeline_parallel_size x tensor_parallel_size."""
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def processes_per_replica(self) -> int:
        """Processes that share each replica's batch (and hold its model in parts): pipeline x tensor parallel."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages in one replica: pipeline_parallel_size x stages_per_rank."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def style(self) -> str:
        """Stage placement style of the schedule: ``"single"``, ``"loop"``, ``"v"`` or ``"wavefront"``."""
        return schedule_style(self.schedule)[1]

    @property
    def units(self) -> int:
        """Pieces one replica batch is pipelined in: ``n_microbatches x time_chunks``."""
        return self.n_microbatches * self.time_chunks

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`LayoutError` unless the layout uses exactly ``world_size`` processes."""
        if world_size != self.world_size:
            tp = f" x tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
            raise LayoutError(
                f"the layout needs data_parallel_size={self.data_parallel_size} x "
                f"pipeline_parallel_size={self.pipeline_parallel_size}{tp} = {self.world_size} processes "
                f"(stages_per_rank={self.stages_per_rank} adds virtual stages, not processes), "
                f"but the world size is {world_size}"
            )

    def check_batch(self, batch_size: int) -> None:
        """Raise :class:`LayoutError` if a per-replica batch of ``batch_size`` cannot be split."""
        if self.n_microbatches > batch_size or batch_size % self.n_microbatches:
            raise LayoutError(
                f"n_microbatches={self.n_microbatches} must divide the per-replica batch of {batch_size} "
                f"sentences and be at most {batch_size}; allowed values: "
                f"{[m for m in range(1, batch_size + 1) if batch_size % m == 0]}"
            )

    def check_time_chunks(self, bucket_lengths: Sequence[int]) -> None:
        """Raise :class:`LayoutError` unless every bucket (sequence length) has at least ``time_chunks`` steps."""
        shortest = min(int(b) for b in bucket_lengths) if len(bucket_lengths) else None
        if shortest is not None and self.time_chunks > shortest:
            raise LayoutError(
                f"time_chunks={self.time_chunks} splits every batch's time axis into {self.time_chunks} chunks, but "
                f"the shortest bucket has {shortest} steps (buckets {sorted(set(bucket_lengths))}); allowed: 1 to "
                f"{shortest}, or 'auto'"
            )

    def stage_indices(self, pipeline_rank: int) -> list[int]:
        """Global stage indices held by ``pipeline_rank``, in the order the schedule expects."""
        pp, spr = self.pipeline_parallel_size, self.stages_per_rank
        if not 0 <= pipeline_rank < pp:
            raise LayoutError(f"pipeline_rank must be in [0, {pp}), got {pipeline_rank}")
        if self.style == "v":
            return [pipeline_rank, self.num_stages - 1 - pipeline_rank]
        return [pipeline_rank + k * pp for k in range(spr)]

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """``(data_parallel_rank, pipeline_rank)`` of a global rank (its tensor-parallel rank left out)."""
        return divmod(global_rank // self.tensor_parallel_size, self.pipeline_parallel_size)

    def tensor_rank(self, global_rank: int) -> int:
        """The tensor-parallel rank of a global rank: which shard of its stage's split weights it holds."""
        return global_rank % self.tensor_parallel_size

    def global_rank(self, data_parallel_rank: int, pipeline_rank: int, tensor_rank: int = 0) -> int:
        """The global rank at ``(data_parallel_rank, pipeline_rank, tensor_rank)`` of the mesh."""
        return (data_parallel_rank * self.pipeline_parallel_size + pipeline_rank) * self.tensor_parallel_size \
            + tensor_rank

    def mesh_coordinates(self, global_rank: int) -> tuple[int, int, int]:
        """``(data_parallel_rank, pipeline_rank, tensor_rank)`` of a global rank (its place in the mesh)."""
        return (*self.coordinates(global_rank), self.tensor_rank(global_rank))

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that holds stage ``stage`` (the inverse of :meth:`stage_indices`)."""
        for rank in range(self.pipeline_parallel_size):
            if stage in self.stage_indices(rank):
                return rank
        raise LayoutError(f"stage must be in [0, {self.num_stages}), got {stage}")

    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int | str = "auto",
        stages_per_rank: int | None = None,
        schedule: str = "1F1B",
        n_microbatches: int | None = None,
        tensor_parallel_size: int = 1,
        time_chunks: int | None = None,
    ) -> ParallelLayout:
        """The layout for ``world_size`` processes from the user's options.

        Args:
            world_size: processes in the job.
            data_parallel_size: replicas of the pipeline.
            pipeline_parallel_size: processes per pipeline; ``"auto"``: ``world_size / (data_parallel_size x
                tensor_parallel_size)``.
            stages_per_rank: stages per process; ``None``: 1 for GPipe/1F1B/Wavefront, 2 for interleaved and V
                schedules.
            schedule: a name from :data:`SCHEDULES` or ``"Wavefront"`` (case-insensitive).
            n_microbatches: microbatches per replica batch; ``None``: the number of stages (1 for Wavefront, which
                splits time instead).
            tensor_parallel_size: processes each stage's split weights are sharded over.
            time_chunks: chunks of the time axis (Wavefront); ``None``: the number of stages for Wavefront, else 1.

        Raises:
            LayoutError: the options do not fit together or do not use exactly ``world_size`` processes.
        """
        dp = check_positive_int("data_parallel_size", data_parallel_size, LayoutError)
        tp = check_positive_int("tensor_parallel_size", tensor_parallel_size, LayoutError)
        if pipeline_parallel_size == "auto":
            if world_size % (dp * tp):
                allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
                raise LayoutError(
                    f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} does not divide the world "
                    f"size {world_size}; allowed products: {allowed}"
                    if tp > 1 else
                    f"data_parallel_size={dp} does not divide the world size {world_size}; allowed: {allowed}"
                )
            pipeline_parallel_size = world_size // (dp * tp)
        _, style = schedule_style(schedule)
        spr = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(style)
        stages = pipeline_parallel_size * spr if isinstance(pipeline_parallel_size, int) else 1
        wavefront = style == "wavefront"
        m = n_microbatches if n_microbatches is not None else (1 if wavefront else stages)
        k = time_chunks if time_chunks is not None else (stages if wavefront else 1)
        layout = cls(dp, pipeline_parallel_size, spr, schedule, m, tp, k)
        layout.check_world_size(world_size)
        return layout

    def build_mesh(self, device_type: str, backend: str, timeout: timedelta) -> DeviceMesh:
        """The ``(data_parallel, pipeline_parallel, tensor_parallel)`` device mesh; its sub-groups get ``timeout`` too.

        ``init_device_mesh`` creates sub-groups with torch's default timeout (30 minutes on gloo, 10 on nccl),
        whatever the default group's, so a crashed rank would hang the other replicas' pipelines; the backend
        options fix that for every group that communicates (see :func:`_timeout_options`).
        """
        return init_device_mesh(
            device_type,
            (self.data_parallel_size, self.pipeline_parallel_size, self.tensor_parallel_size),
            mesh_dim_names=MESH_DIMS,
            backend_override=_timeout_options(backend, timeout, self.mesh_sizes),
        )

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The size of every mesh dimension, by name (:data:`MESH_DIMS`)."""
        return dict(zip(MESH_DIMS, (self.data_parallel_size, self.pipeline_parallel_size, self.tensor_parallel_size),
                        strict=True))


def default_stages_per_rank(style: str) -> int:
    """Stages per process when the user gives none: 1 for one-stage and wavefront schedules, else 2."""
    return 1 if style in ("single", "wavefront") else 2


def _timeout_options(backend: str, timeout: timedelta, sizes: dict[str, int]) -> dict[str, Any] | None:
    """``init_device_mesh``'s ``backend_override``: backend options with ``timeout`` for the mesh dimensions whose
    groups communicate.

    torch (2.13, ``DeviceMesh._init_one_process_group``) makes one group per dimension whatever it is given. Without
    an override, a dimension that spans every rank reuses the default group, which has the strategy's timeout
    already; any override makes a new group instead (on nccl a second communicator over every rank). A size-1
    dimension's group never communicates (the engine skips groups of one), so its torch default timeout does not
    matter. So only dimensions of size > 1 get options, and on nccl not one that spans every rank. (On gloo that
    dimension keeps its options: on a machine with CUDA, torch gives a gloo default group's dimension a new group of
    torch's default timeout.)
    """
    if backend == "gloo":
        make = dist.ProcessGroupGloo._Options
    elif backend == "nccl" and dist.is_nccl_available():
        make = dist.ProcessGroupNCCL.Options
    else:
        return None
    world = 1
    for size in sizes.values():
        world *= size
    override = {}
    for name in MESH_DIMS:
        size = sizes[name]
        if size == 1 or (backend == "nccl" and size == world):
            continue
        options = make()
        options._timeout = timeout
        override[name] = (backend, options)
    return override or None
