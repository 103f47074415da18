"""Parallel layout: how processes are arranged into data-parallel replicas and pipeline stages.

The layout is a small validated dataclass. It knows nothing about processes; the strategy builds a
:class:`~torch.distributed.device_mesh.DeviceMesh` from it once the process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayoutError", "ParallelLayout", "SCHEDULES", "schedule_style"]

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


class LayoutError(ValueError):
    """A parallel layout that cannot run: the message names every factor and what is allowed."""


def schedule_style(name: str) -> tuple[str, str]:
    """Return the canonical schedule name and its stage placement style.

    Args:
        name: a schedule name, case-insensitive (``"1f1b"``, ``"GPipe"``, ``"zbvzerobubble"``...).

    Returns:
        ``(canonical_name, style)`` with style ``"single"``, ``"loop"`` or ``"v"``.

    Raises:
        LayoutError: the name is not one of :data:`SCHEDULES`.
    """
    by_lower = {k.lower(): k for k in SCHEDULES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise LayoutError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    return canonical, SCHEDULES[canonical]


@dataclass(frozen=True)
class ParallelLayout:
    """Data parallel x pipeline parallel (x virtual stages per rank) arrangement of processes.

    Global rank ``r`` is replica ``r // pipeline_parallel_size`` and pipeline rank
    ``r % pipeline_parallel_size`` (a row-major ``(data_parallel, pipeline_parallel)`` mesh).

    Attributes:
        data_parallel_size: number of model replicas; data is sharded across them only.
        pipeline_parallel_size: number of processes one replica's pipeline spans.
        stages_per_rank: pipeline stages held by each process (2 for interleaved / V schedules).
        schedule: a name from :data:`SCHEDULES` (case-insensitive).
        n_microbatches: microbatches per (per-replica) batch.
    """

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    stages_per_rank: int = 1
    schedule: str = "1F1B"
    n_microbatches: int = 1

    def __post_init__(self) -> None:
        for field_name in ("data_parallel_size", "pipeline_parallel_size", "stages_per_rank", "n_microbatches"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{field_name} must be a positive integer, got {value!r}")
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
        """Processes the layout needs: data_parallel_size x pipeline_parallel_size."""
        return self.data_parallel_size * self.pipeline_parallel_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages in one replica: pipeline_parallel_size x stages_per_rank."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def style(self) -> str:
        """Stage placement style of the schedule: ``"single"``, ``"loop"`` or ``"v"``."""
        return SCHEDULES[self.schedule]

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`LayoutError` unless the layout uses exactly ``world_size`` processes."""
        if world_size != self.world_size:
            raise LayoutError(
                f"the layout needs data_parallel_size={self.data_parallel_size} x "
                f"pipeline_parallel_size={self.pipeline_parallel_size} = {self.world_size} processes "
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

    def stage_indices(self, pipeline_rank: int) -> list[int]:
        """Global stage indices held by ``pipeline_rank``, in the order the schedule expects."""
        pp, spr = self.pipeline_parallel_size, self.stages_per_rank
        if not 0 <= pipeline_rank < pp:
            raise LayoutError(f"pipeline_rank must be in [0, {pp}), got {pipeline_rank}")
        if self.style == "v":
            return [pipeline_rank, self.num_stages - 1 - pipeline_rank]
        return [pipeline_rank + k * pp for k in range(spr)]

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """``(data_parallel_rank, pipeline_rank)`` of a global rank."""
        return divmod(global_rank, self.pipeline_parallel_size)
