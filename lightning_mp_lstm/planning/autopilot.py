"""The autopilot: every layout of the devices at hand ranked by predicted step time, among those whose memory plan
fits, and the fastest of them chosen.

:func:`rank_layouts` joins the two predictions the planning package makes: the step time of each candidate
(:func:`~lightning_mp_lstm.planning.advice.advise`: one process, data parallel, pipelines and wavefront pipelines and
their products, each with its best microbatch count) and each candidate's memory per process
(:func:`~lightning_mp_lstm.planning.memory.plan_memory` on the candidate's own partition). A candidate that does not
fit is never chosen, however fast, and one predicted less than :data:`TIE` faster than one on fewer processes loses
to it (:func:`choose`); :func:`render_ranking` prints the table with the reason each one loses.

Where replicas cannot hold their stages whole, the same layout with replicas that shard them (``shard_replicas=True``,
ZeRO-3 over the replicas) is ranked too, with its own memory plan and step time. It is never ranked where the
replicated layout fits: it gathers every block at each step and returns its freed memory at once, so it is slower
there (on MXNet's 8 x 1024 model, dp2, 1.29x; docs/layouts.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp_lstm.base.allocator import leaves_little_room
from lightning_mp_lstm.planning.advice import Candidate, advise
from lightning_mp_lstm.planning.calibration import Calibration
from lightning_mp_lstm.planning.layout import WAVEFRONT, ParallelLayout
from lightning_mp_lstm.planning.memory import GIB, MIB, BatchShape, MemoryPlan, ModelMemory, plan_memory

__all__ = ["TIE", "RankedLayout", "choose", "fastest_that_fits", "rank_layouts", "render_ranking"]


@dataclass(frozen=True)
class RankedLayout:
    """One candidate of the ranking: its layout, predicted step and memory plan (``None``: memory not planned)."""

    candidate: Candidate
    layout: ParallelLayout
    memory: MemoryPlan | None

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def processes(self) -> int:
        return self.layout.world_size

    @property
    def fits(self) -> bool:
        return self.memory is None or self.memory.fits

    def settings(self) -> dict[str, Any]:
        """The strategy's options that run this candidate (``MPLSTMStrategy(**settings)``)."""
        layout = self.layout
        return {"data_parallel_size": layout.data_parallel_size,
                "pipeline_parallel_size": layout.pipeline_parallel_size,
                "schedule": layout.schedule, "n_microbatches": layout.n_microbatches,
                "time_chunks": layout.time_chunks if layout.style == "wavefront" else None,
                "shard_replicas": self.candidate.sharded}


def candidate_layout(candidate: Candidate, schedule: str) -> ParallelLayout:
    """The layout that runs ``candidate`` (a pipeline on ``schedule``, a wavefront on its own schedule)."""
    if candidate.pipeline_parallel_size == 1:
        return ParallelLayout(candidate.data_parallel_size, 1, 1, schedule, 1)
    if candidate.time_chunks > 1:
        return ParallelLayout(candidate.data_parallel_size, candidate.pipeline_parallel_size, 1, WAVEFRONT,
                              candidate.n_microbatches, 1, candidate.time_chunks)
    return ParallelLayout(candidate.data_parallel_size, candidate.pipeline_parallel_size, 1, schedule,
                          candidate.n_microbatches)


def rank_layouts(model: Any, processes: Sequence[int], batch_rows: int, length: int, device: torch.device,
                 calibration: Calibration, memory: ModelMemory | None = None,
                 batch_for: Callable[[ParallelLayout], BatchShape | None] | None = None, floor: int = 0,
                 budget_for: Callable[[ParallelLayout], tuple[int | None, str]] | None = None,
                 schedule: str = "1F1B", cores: int | None = None, shard: bool = False) -> list[RankedLayout]:
    """Every candidate layout for each count of ``processes`` (and one process), those that fit first, each group
    fastest predicted first.

    Args:
        model: a LightningModule with a pipeline declaration, or its pipeline view (possibly on the meta device).
        processes: the process counts to consider (one process is always a candidate).
        batch_rows, length: the global batch's rows and mean padded length (the step times).
        device, calibration, schedule, cores: as for :func:`~lightning_mp_lstm.planning.advice.advise`.
        memory: the blocks' memory from their shapes; ``None``: memory is not planned (every candidate fits).
        batch_for: a layout's largest training batch per replica (the memory plan's); ``None`` or a ``None``
            result: memory is not planned.
        floor: bytes every process holds before its blocks.
        budget_for: a layout's bytes per process and where that comes from.
        shard: where a layout's replicas do not fit, rank the same layout with replicas that shard their stages
            (:func:`~lightning_mp_lstm.planning.advice.advise` with ``sharded=True``); needs the memory planned.
    """

    def planned(candidate: Candidate) -> RankedLayout:
        layout = candidate_layout(candidate, schedule)
        plan = None
        batch = batch_for(layout) if memory is not None and batch_for is not None else None
        if batch is not None:
            budget, source = budget_for(layout) if budget_for is not None else (None, "")
            plan = plan_memory(memory, layout, candidate.partition, batch, floor, budget, source,
                               shard=layout.data_parallel_size if candidate.sharded else 1)
        return RankedLayout(candidate, layout, plan)

    def candidates(**kwargs: Any) -> list[Candidate]:
        return advise(model, processes, batch_rows, length, device, calibration, schedule=schedule, cores=cores,
                      **kwargs)

    ranked = [planned(c) for c in candidates()]
    # A process whose plan leaves little room returns what its steps free (base.allocator.steady_threshold): its
    # blocks are timed so.
    tight = {_kind(r.candidate) for r in ranked if r.fits and _tight(r.memory)}
    if tight:
        returned = {_kind(c): c for c in candidates(memory_returned=True, only={k[:2] for k in tight})}
        ranked = [planned(returned[kind]) if (kind := _kind(r.candidate)) in tight and kind in returned else r
                  for r in ranked]
    crowded_out = {(r.layout.data_parallel_size, r.layout.pipeline_parallel_size) for r in ranked
                   if not r.fits and r.layout.data_parallel_size > 1}
    if shard and crowded_out and memory is not None:
        ranked += [planned(c) for c in candidates(sharded=True, only=crowded_out)]
    return sorted(ranked, key=lambda r: (not r.fits, r.candidate.predicted_seconds))


def _kind(candidate: Candidate) -> tuple[int, int, bool]:
    """What a candidate is apart from its microbatches: replicas, stages, and whether it is a wavefront."""
    return candidate.data_parallel_size, candidate.pipeline_parallel_size, candidate.time_chunks > 1


def _tight(plan: MemoryPlan | None) -> bool:
    """Whether a process of ``plan`` runs with its freed memory returned (its peak near its budget)."""
    return plan is not None and leaves_little_room(plan.peak, plan.budget)


#: A candidate predicted less than this much faster than one on fewer processes is a tie, and the fewer processes
#: win it. Predictions move about this much call to call on a shared machine: the long job's ranking twice in a row
#: on the 2-core box predicted one process 0.0724 and 0.0646 s, and its two workers at once 1.00x and 1.18x slower
#: than one alone (2026-11-29); a ranking that had put dp2 4 % ahead of one process picked a layout that measured
#: 1.14x the best. Fewer processes also hold less memory in all.
TIE = 0.10


def choose(ranked: Sequence[RankedLayout]) -> RankedLayout:
    """The candidate that fits on the fewest processes among those predicted within :data:`TIE` of the fastest that
    fits (the fastest of them); where none fits, the one that needs the least memory (whose refusal then says what
    to change)."""
    fastest = fastest_that_fits(ranked)
    if fastest is not None:
        limit = (1 + TIE) * fastest.candidate.predicted_seconds
        close = [r for r in ranked if r.fits and r.candidate.predicted_seconds <= limit]
        return min(close, key=lambda r: (r.processes, r.candidate.predicted_seconds))
    return min(ranked, key=lambda r: r.memory.peak if r.memory is not None else 0)


def fastest_that_fits(ranked: Sequence[RankedLayout]) -> RankedLayout | None:
    """The candidate that fits with the shortest predicted step (``None``: none fits)."""
    return min((r for r in ranked if r.fits), key=lambda r: r.candidate.predicted_seconds, default=None)


def _peak(ranked: RankedLayout) -> str:
    return f"{ranked.memory.peak / MIB:,.0f}" if ranked.memory is not None else "-"


def _verdict(ranked: RankedLayout, best: RankedLayout | None) -> str:
    if not ranked.fits:
        plan = ranked.memory
        assert plan is not None and plan.budget is not None
        return f"does not fit: {plan.peak / GIB:,.2f} of {plan.budget / GIB:,.2f} GiB"
    if ranked is best:
        return "chosen"
    ratio = ranked.candidate.predicted_seconds / best.candidate.predicted_seconds
    if ratio < 1:
        return f"{ratio:.2f}x: a tie, on more processes"
    return f"{ratio:.2f}x slower"


def render_ranking(ranked: Sequence[RankedLayout], tokens: float | None = None) -> str:
    """The ranking as a table: layout, processes, threads each, predicted seconds per step (and tokens/s when
    ``tokens`` per step is given), the fullest process's predicted peak, and why each candidate loses."""
    best = choose(ranked) if any(r.fits for r in ranked) else None  # none: every row says why it does not fit
    header = ["layout", "processes", "threads", "s/step", *(["tokens/s"] if tokens else []), "peak MiB", "verdict"]
    rows = [[r.name, str(r.processes), str(r.candidate.threads_per_process),
             f"{r.candidate.predicted_seconds:.4f}",
             *([f"{tokens / r.candidate.predicted_seconds:,.0f}"] if tokens else []), _peak(r),
             _verdict(r, best)] for r in ranked]
    widths = [max(len(header[c]), *(len(row[c]) for row in rows)) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i in (0, len(cells) - 1) else c.rjust(widths[i])
                         for i, c in enumerate(cells)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)])
