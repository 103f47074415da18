"""One plan for the whole pipeline: which blocks each stage holds and how many microbatches a batch has.

:func:`make_plan` turns a model (any :class:`~lightning_mp_lstm.models.contract.PipelineModel`), a layout and the
:class:`PlanOptions` into a frozen :class:`PipelinePlan`: the partition, the number of microbatches, the
per-block costs it was balanced on and the predicted step times. It is computed once, by every rank together,
and rank 0's plan is broadcast, so the plan is identical everywhere (:attr:`PipelinePlan.fingerprint`).

Measured costs are measured where the blocks will run: for ``balance_by="time"`` every pipeline rank of the first
replica times the blocks of its stages in the even split, on its own device; for ``n_microbatches="auto"``
every such rank times its final stages at each candidate microbatch size. No process ever needs more than its
own share of the model. One step-time model (:func:`step_time`) serves every prediction.

The ``Wavefront`` schedule has two axes to split a batch along: rows (``n_microbatches``) and time
(``time_chunks``). Its ``"auto"`` times each rank's stages at every candidate row count, at the full length and at
the shortest candidate chunk, and fits ``seconds = fixed + per_step x length`` (:class:`ChunkCost`: an LSTM's time is
linear in the length, plus what a call costs whatever its length). That measured curve of cost against rows is what
decides: on a GPU a row microbatch costs nearly what the whole batch does, so time chunks win; here both are
weighed by the same step-time model over ``m x k`` units.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp_lstm.base.faults import gather, result_from
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.partition import PartitionError, even_partition, partition_blocks, validate_partition

__all__ = ["BALANCE_BY", "PARTITIONS", "ChunkCost", "PipelinePlan", "PlanOptions", "chunk_candidates", "make_plan",
           "microbatch_candidates", "step_time"]

#: Named partitions (besides explicit lists of block names per stage); ``"balanced<N>"`` (``"balanced4"``) is the
#: balanced partition over N stages.
PARTITIONS = ("even", "balanced", "per_block")
_BALANCED_N = re.compile(r"balanced(\d+)")
#: What ``partition="balanced"`` balances: measured seconds, analytic FLOPs, or training memory.
BALANCE_BY = ("time", "flops", "memory")


@dataclass(frozen=True)
class PlanOptions:
    """How to split the model, as the user chose it; validated on construction.

    Attributes:
        partition: ``"even"`` (blocks spread evenly, the first stages take the remainder), ``"balanced"`` (the
            exact contiguous split minimizing the slowest stage, see ``balance_by``, over the layout's stages),
            ``"balanced<N>"`` (the same over N stages, e.g. ``"balanced4"``: the layout must have N stages, or
            follows from it), ``"per_block"`` (one block per stage) or one list of block names per stage.
        balance_by: the cost ``"balanced"`` minimizes: ``"time"`` (measured), ``"flops"`` or ``"memory"``.
        stage_speeds: relative speed of each stage's device for balancing (default: all equal).
        n_microbatches: microbatches per replica batch; ``None``: the number of stages; ``"auto"``: the count
            with the lowest predicted step time, from times measured at every candidate size.
        max_microbatches: the largest count ``"auto"`` considers.
        time_chunks: chunks of the time axis (schedule ``"Wavefront"`` only); ``None``: the number of stages;
            ``"auto"``: with ``n_microbatches``, the pair with the lowest predicted step time.
        max_time_chunks: the largest count ``time_chunks="auto"`` considers (and never more than the shortest
            bucket).
        num_stages: the stage count ``"balanced<N>"`` asks for (``N``); ``None`` otherwise.
    """

    partition: str | tuple[tuple[str, ...], ...] = "even"
    balance_by: str = "time"
    stage_speeds: tuple[float, ...] | None = None
    n_microbatches: int | str | None = None
    max_microbatches: int = 32
    time_chunks: int | str | None = None
    max_time_chunks: int = 16
    num_stages: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        partition = self.partition
        if isinstance(partition, str):
            numbered = _BALANCED_N.fullmatch(partition)
            if numbered is not None and int(numbered.group(1)) >= 1:
                object.__setattr__(self, "partition", "balanced")
                object.__setattr__(self, "num_stages", int(numbered.group(1)))
            elif partition not in PARTITIONS:
                raise PartitionError(
                    f"unknown partition {partition!r}; allowed: {', '.join(map(repr, PARTITIONS))}, "
                    "'balanced<N>' (e.g. 'balanced4': balanced over N stages), or one list of block names per stage"
                )
        elif isinstance(partition, Sequence) and partition and all(isinstance(stage, str) for stage in partition):
            raise PartitionError(
                f"the partition is a flat list of block names {list(partition)!r}; give one list of block names per "
                "stage, e.g. [['embedding', 'lstm.0'], ['lstm.1', 'decoder']]"
            )
        elif not isinstance(partition, Sequence) or any(isinstance(s, str) or not isinstance(s, Sequence)
                                                         for s in partition):
            raise PartitionError(
                f"partition must be one of {', '.join(map(repr, PARTITIONS))} or one list of block names per stage "
                f"(e.g. [['embedding', 'lstm.0'], ['lstm.1', 'decoder']]), got {partition!r}"
            )
        else:
            object.__setattr__(self, "partition", tuple(tuple(stage) for stage in partition))
        if self.balance_by not in BALANCE_BY:
            raise PartitionError(f"unknown balance_by {self.balance_by!r}; allowed: {', '.join(BALANCE_BY)}")
        speeds = self.stage_speeds
        if speeds is not None:
            if isinstance(speeds, str) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in speeds
            ):
                raise PartitionError(f"stage_speeds must be positive numbers, one per stage, got {speeds!r}")
            object.__setattr__(self, "stage_speeds", tuple(float(v) for v in speeds))
        for name in ("n_microbatches", "time_chunks"):
            m = getattr(self, name)
            if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)):
                if isinstance(m, str) and m.isdigit() and int(m) >= 1:
                    object.__setattr__(self, name, int(m))
                else:
                    raise LayoutError(f"{name} must be a positive integer, None or 'auto', got {m!r}")

    @property
    def auto_microbatches(self) -> bool:
        return self.n_microbatches == "auto"

    @property
    def auto_time_chunks(self) -> bool:
        return self.time_chunks == "auto"

    def stage_count(self, block_names: Sequence[str] | None = None) -> int | None:
        """The number of stages the partition itself implies (explicit lists, one per block), if any."""
        if isinstance(self.partition, tuple):
            return len(self.partition)
        if self.num_stages is not None:
            return self.num_stages
        if self.partition == "per_block" and block_names is not None:
            return len(block_names)
        return None

    def fixed_partition(self, block_names: Sequence[str], num_stages: int) -> list[list[str]] | None:
        """The partition when it needs no costs (validated against the model and layout), else ``None``.

        Raises:
            PartitionError: the partition does not fit ``block_names`` or ``num_stages``.
        """
        names = list(block_names)
        if isinstance(self.partition, tuple):
            return validate_partition(self.partition, names, num_stages)
        if num_stages > len(names):
            raise PartitionError(
                f"the layout has {num_stages} pipeline stages but the model has {len(names)} blocks "
                f"({', '.join(names)}); every stage needs a block: use at most {len(names)} stages or more layers"
            )
        if self.partition == "per_block":
            if num_stages != len(names):
                raise PartitionError(
                    f"partition 'per_block' puts each of the {len(names)} blocks on its own stage, but the layout "
                    f"has {num_stages} stages"
                )
            return [[name] for name in names]
        if self.partition == "even" or num_stages == 1:  # one stage holds every block: nothing to balance
            return even_partition(names, num_stages)
        return None

    @property
    def name(self) -> str:
        """The partition as the user named it (``"balanced4"``, ``"even"``, or ``"manual"`` for lists)."""
        if isinstance(self.partition, tuple):
            return "manual"
        return f"balanced{self.num_stages}" if self.num_stages is not None else self.partition

    def check(self, block_names: Sequence[str], layout: ParallelLayout) -> None:
        """Everything that can be checked without costs; raises what :meth:`fixed_partition` raises, and for
        ``stage_speeds`` of the wrong length."""
        names = list(block_names)
        if self.num_stages is not None and self.num_stages != layout.num_stages:
            raise PartitionError(
                f"partition {self.name!r} asks for {self.num_stages} pipeline stages, but the layout has "
                f"{layout.num_stages} (pipeline_parallel_size={layout.pipeline_parallel_size} x stages_per_rank="
                f"{layout.stages_per_rank}); use partition 'balanced' to follow the layout, or a layout of "
                f"{self.num_stages} stages (layout=auto sizes the pipeline from the partition)"
            )
        if not isinstance(self.partition, tuple) and layout.num_stages > len(names):
            raise PartitionError(
                f"the layout has {layout.num_stages} pipeline stages (pipeline_parallel_size="
                f"{layout.pipeline_parallel_size} x stages_per_rank={layout.stages_per_rank}) but the model has "
                f"{len(names)} blocks ({', '.join(names)}); every stage needs a block: use at most {len(names)} "
                "stages or more layers"
            )
        self.fixed_partition(names, layout.num_stages)
        if self.auto_time_chunks and layout.style != "wavefront":
            raise LayoutError(f"time_chunks='auto' splits the time axis, which only schedule Wavefront does; "
                              f"schedule {layout.schedule} splits the batch: use schedule='Wavefront' or leave "
                              "time_chunks unset")
        if self.stage_speeds is not None and len(self.stage_speeds) != layout.num_stages:
            raise PartitionError(
                f"stage_speeds has {len(self.stage_speeds)} values but the layout has {layout.num_stages} stages; "
                "give one relative speed per stage"
            )


@dataclass(frozen=True)
class PipelinePlan:
    """The resolved plan; identical on every rank, never changed after :func:`make_plan`.

    Attributes:
        layout: the layout, with the number of microbatches the plan chose.
        partition: block names of every stage, in stage order.
        cost_kind: what ``block_costs`` measure: ``"time"`` (seconds of a microbatch), ``"flops"`` or
            ``"memory"`` (bytes).
        block_costs: ``(block, cost)`` pairs in model order.
        block_parameters: ``(block, parameters)`` pairs in model order.
        block_memory: ``(block, bytes of parameters, gradients and optimizer state)`` pairs in model order.
        microbatch_rows: sequences per microbatch the costs were measured for; ``length`` their length.
        predictions: ``(m, predicted seconds per step)`` for every count ``n_microbatches="auto"`` weighed.
        split_blocks: the blocks whose parameters are split over the ``layout.tensor_parallel_size`` processes of
            their stage (each holds ``1 / tensor_parallel_size`` of them); empty without tensor parallelism.
        unit_predictions: ``(m, k, predicted seconds per step)`` of every rows x chunks pair a Wavefront ``"auto"``
            weighed.
        chunk_costs: ``(m, fixed, per_step)`` seconds of the slowest rank's stages for one unit of ``rows / m`` rows
            (:class:`ChunkCost`), measured for the same ``"auto"``.
    """

    layout: ParallelLayout
    partition: tuple[tuple[str, ...], ...]
    cost_kind: str
    block_costs: tuple[tuple[str, float], ...]
    block_parameters: tuple[tuple[str, int], ...]
    block_memory: tuple[tuple[str, float], ...]
    microbatch_rows: int
    length: int
    stage_speeds: tuple[float, ...] | None = None
    predictions: tuple[tuple[int, float], ...] | None = None
    split_blocks: tuple[str, ...] = ()
    unit_predictions: tuple[tuple[int, int, float], ...] | None = None
    chunk_costs: tuple[tuple[int, float, float], ...] | None = None
    fingerprint: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        payload = json.dumps([repr(self.layout), self.partition, self.cost_kind, self.block_costs,
                              self.predictions, self.unit_predictions], default=str)
        object.__setattr__(self, "fingerprint", hashlib.sha256(payload.encode()).hexdigest()[:16])

    @property
    def n_microbatches(self) -> int:
        return self.layout.n_microbatches

    def stage_of(self, block: str) -> int:
        """The stage that holds ``block``."""
        return next(s for s, stage in enumerate(self.partition) if block in stage)

    def blocks_of(self, pipeline_rank: int) -> list[str]:
        """The blocks a pipeline rank holds (all its stages), in model order."""
        stages = self.layout.stage_indices(pipeline_rank)
        return [name for s in sorted(stages) for name in self.partition[s]]


def step_time(microbatch_seconds: Sequence[float], n_microbatches: int) -> float:
    """Seconds of one GPipe / 1F1B training step from each pipeline rank's seconds for one microbatch.

    ``(m - 1) * max(t) + sum(t)``: the busiest rank sets the pace of the steady state, and the fill and drain
    pass every microbatch through each rank once. With equal times on ``S`` ranks this is ``(m + S - 1) * t``.
    Communication, the optimizer step and interleaving are left out.
    """
    return (n_microbatches - 1) * max(microbatch_seconds) + sum(microbatch_seconds)


@dataclass(frozen=True)
class ChunkCost:
    """Seconds of one unit on one rank as a function of its length: ``fixed + per_step x length``."""

    fixed: float
    per_step: float

    @classmethod
    def fit(cls, long: tuple[int, float], short: tuple[int, float]) -> ChunkCost:
        """The line through ``(length, seconds)`` measured at two lengths (a single length: a line through 0);
        never negative (noise can make the short run the slower one)."""
        (n1, t1), (n0, t0) = long, short
        if n1 == n0:
            return cls(0.0, t1 / max(n1, 1))
        per_step = max((t1 - t0) / (n1 - n0), 0.0)
        fixed = max(t0 - per_step * n0, 0.0)
        return cls(fixed, per_step if fixed + per_step * n1 > 0 else t1 / n1)

    def seconds(self, length: int) -> float:
        return self.fixed + self.per_step * length


def chunk_candidates(length: int, bucket_lengths: Sequence[int] | None = None, max_time_chunks: int = 16) -> list[int]:
    """The time-chunk counts ``time_chunks="auto"`` may choose: 1 to the shortest bucket (or ``length``), at most
    ``max_time_chunks``."""
    shortest = min(bucket_lengths) if bucket_lengths else length
    return list(range(1, max(1, min(shortest, length, max_time_chunks)) + 1))


def _unit_predictions(per_rank: Sequence[dict[int, ChunkCost]], counts: Sequence[int], chunks: Sequence[int],
                      length: int) -> tuple[tuple[int, int, float], ...]:
    """``(m, k, seconds)``: the step-time model over ``m x k`` units, each as long as the longest chunk."""
    return tuple((m, k, step_time([costs[m].seconds(-(-length // k)) for costs in per_rank], m * k))
                 for m in counts for k in chunks)


def microbatch_candidates(layout: ParallelLayout, batch_rows: int, max_microbatches: int = 32) -> list[int]:
    """The microbatch counts ``n_microbatches="auto"`` may choose: divisors of the per-replica batch, at most
    ``max_microbatches``, that the layout's schedule accepts.

    Raises:
        LayoutError: there is none (the message names the batch, the schedule and the stage count).
    """
    candidates = []
    for m in range(1, min(batch_rows, max_microbatches) + 1):
        if batch_rows % m:
            continue
        try:
            replace(layout, n_microbatches=m)
        except LayoutError:
            continue
        candidates.append(m)
    if not candidates:
        raise LayoutError(
            f"n_microbatches='auto' found no count: none of 1..{min(batch_rows, max_microbatches)} divides the "
            f"per-replica batch of {batch_rows} sentences and suits schedule {layout.schedule} with "
            f"{layout.num_stages} stages; use a larger batch_size or a fixed n_microbatches"
        )
    return candidates


def _measure_on_first_replica(layout: ParallelLayout, global_rank: int, measure: Any) -> list[Any]:
    """Run ``measure(pipeline_rank)`` on the pipeline ranks of replica 0, tensor rank 0 (the others contribute
    ``None``) and gather the results, indexed by pipeline rank. Without a process group (planning ahead in one
    process) this process measures every pipeline rank's share itself."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [measure(rank) for rank in range(layout.pipeline_parallel_size)]
    replica, pipeline_rank, tensor_rank = layout.mesh_coordinates(global_rank)
    results = gather(lambda: measure(pipeline_rank) if replica == 0 and tensor_rank == 0 else None)
    return [results[layout.global_rank(0, rank)] for rank in range(layout.pipeline_parallel_size)]


def make_plan(model: Any, layout: ParallelLayout, options: PlanOptions, batch_rows: int, length: int,
              device: torch.device, bucket_lengths: Sequence[int] | None = None) -> PipelinePlan:
    """Plan the pipeline; every rank calls it (it is collective when a process group exists).

    Args:
        model: the (unpruned, possibly meta-device) model: a declared LightningModule or its pipeline view.
        layout: the resolved layout (its ``n_microbatches`` is the count to use unless ``"auto"``).
        options: what the user chose.
        batch_rows: sequences per replica batch; ``length``: their mean padded length (the bucket mix).
        device: this process's device: every measurement runs there.
        bucket_lengths: the data's sequence lengths, if known: ``time_chunks="auto"`` stays within the shortest.

    Raises:
        PartitionError, LayoutError: on every rank, when the options do not fit the model, layout or batch.
    """
    model = pipeline_model(model)
    names = list(model.block_names)
    options.check(names, layout)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    rows = max(1, batch_rows // layout.n_microbatches)
    partition = options.fixed_partition(names, layout.num_stages)
    kind = options.balance_by if partition is None else "flops"
    if kind == "time":
        provisional = even_partition(names, layout.num_stages)

        def time_own_blocks(pipeline_rank: int) -> dict[str, float]:
            blocks = [n for s in layout.stage_indices(pipeline_rank) for n in provisional[s]]
            return profile.block_seconds(model, blocks, rows, length, device)

        costs = {k: v for part in _measure_on_first_replica(layout, rank, time_own_blocks) for k, v in part.items()}
        costs = {name: costs[name] for name in names}
    else:
        costs = model.analytic_costs(kind, rows, length)
    if partition is None:
        partition = partition_blocks(names, costs, layout.num_stages, options.stage_speeds)
    predictions = unit_predictions = chunk_costs = None
    wavefront = layout.style == "wavefront"
    if wavefront and (options.auto_microbatches or options.auto_time_chunks):
        counts = microbatch_candidates(layout, batch_rows, options.max_microbatches) if options.auto_microbatches \
            else [layout.n_microbatches]
        chunks = chunk_candidates(length, bucket_lengths, options.max_time_chunks) if options.auto_time_chunks \
            else [layout.time_chunks]
        short = -(-length // max(chunks))

        def time_units(pipeline_rank: int) -> dict[int, ChunkCost]:
            blocks = [n for s in layout.stage_indices(pipeline_rank) for n in partition[s]]

            def seconds(rows: int, steps: int) -> float:
                return sum(profile.block_seconds(model, blocks, rows, steps, device, repeats=3, warmup=1).values())

            return {m: ChunkCost.fit((length, seconds(batch_rows // m, length)),
                                     (short, seconds(batch_rows // m, short)) if short < length else
                                     (length, 0.0)) for m in counts}

        per_rank = _measure_on_first_replica(layout, rank, time_units)
        unit_predictions = _unit_predictions(per_rank, counts, chunks, length)
        best_m, best_k, _ = min(unit_predictions, key=lambda item: (item[2], item[0] * item[1], item[0]))
        layout = replace(layout, n_microbatches=best_m, time_chunks=best_k)
        slowest = [max(per_rank, key=lambda costs: costs[m].seconds(length))[m] for m in counts]
        chunk_costs = tuple((m, c.fixed, c.per_step) for m, c in zip(counts, slowest))
    elif options.auto_microbatches:
        candidates = microbatch_candidates(layout, batch_rows, options.max_microbatches)

        def time_own_stages(pipeline_rank: int) -> dict[int, float]:
            blocks = [n for s in layout.stage_indices(pipeline_rank) for n in partition[s]]
            return {m: sum(profile.block_seconds(model, blocks, batch_rows // m, length, device, repeats=3,
                                                 warmup=1).values()) for m in candidates}

        per_rank = _measure_on_first_replica(layout, rank, time_own_stages)
        predictions = tuple((m, step_time([times[m] for times in per_rank], m)) for m in candidates)
        best = min(predictions, key=lambda item: (item[1], item[0]))[0]
        layout = replace(layout, n_microbatches=best)
    plan = PipelinePlan(
        layout=layout,
        partition=tuple(tuple(stage) for stage in partition),
        cost_kind=kind,
        block_costs=tuple((name, float(costs[name])) for name in names),
        block_parameters=tuple(model.analytic_costs("parameters", rows, length).items()),
        block_memory=tuple(model.analytic_costs("memory", rows, length).items()),
        microbatch_rows=rows,
        length=length,
        stage_speeds=options.stage_speeds,
        predictions=predictions,
        split_blocks=tuple(model.tensor_parallel_blocks()) if layout.tensor_parallel_size > 1 and hasattr(
            model, "tensor_parallel_blocks") else (),
        unit_predictions=unit_predictions,
        chunk_costs=chunk_costs,
    )
    return result_from(0, lambda: plan)  # rank 0's plan, everywhere
