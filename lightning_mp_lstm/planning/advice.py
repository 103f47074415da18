"""Which layout to pick: predicted step times of the candidate layouts for the devices at hand.

From the model's blocks timed on this machine (one thread) and a measured
:class:`~lightning_mp_lstm.planning.calibration.Calibration` (how much faster one process runs on several threads,
how fast processes exchange bytes, how much processes at once slow each other), :func:`advise` predicts the seconds
per training step of every way to use ``devices`` processes: one process with all cores, data parallel, pipelines
(each partition balanced by the measured times and the best number of microbatches), wavefront pipelines (the
time axis split into chunks, rows x chunks; :mod:`lightning_mp_lstm.pipeline.wavefront`) and their products, and orders
them. The step-time model is the plan's (:func:`~lightning_mp_lstm.planning.plan.step_time`, over ``m x k`` units for a
wavefront; its processes crowded as much as they are busy: :func:`pipeline_speeds`), plus the bytes a layout moves
between processes, the gradients a pipeline adds up microbatch by microbatch, the replicas' collectives on their
gradients, each process's optimizer step (and gradient clipping) over the parameters it holds, the fresh memory every
backward fills with the gradient of a parameter too large for the C library to keep (:func:`fresh_gradient_bytes`), and
what a step of the layout's kind costs beyond its blocks (all measured: :mod:`~lightning_mp_lstm.planning.calibration`).

The advice is for CPUs: it calibrates CPU threads and a host memory copy, and names candidates by cores. On any
other device :func:`~lightning_mp_lstm.planning.calibration.calibrate` and :func:`advise` refuse
(:func:`~lightning_mp_lstm.planning.calibration.check_device`); measure the layouts there instead
(``python benchmarks/run.py --device cuda``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp_lstm.base.allocator import STEADY_MMAP_THRESHOLD, freed_memory_returned
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.planning.calibration import LEAST_SECONDS, Calibration, check_device
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.partition import partition_blocks
from lightning_mp_lstm.planning.plan import ChunkCost, microbatch_candidates

__all__ = ["Candidate", "advise", "crowded_step_time", "fresh_gradient_bytes", "pipeline_speeds", "render",
           "shard_seconds"]

@dataclass(frozen=True)
class Candidate:
    """One way to use the devices, and its predicted seconds per step."""

    name: str
    data_parallel_size: int
    pipeline_parallel_size: int
    n_microbatches: int
    partition: tuple[tuple[str, ...], ...]
    threads_per_process: int
    predicted_seconds: float
    time_chunks: int = 1
    sharded: bool = False


def _block_bytes(model: Any, name: str, rows: int, length: int) -> int:
    """Bytes of the activation that enters block ``name`` (what crosses a stage boundary before it)."""
    example = model.example_input(name, rows, length, torch.device("meta"))
    return example.numel() * example.element_size()


def fresh_gradient_bytes(model: Any, names: Sequence[str]) -> dict[str, int]:
    """Bytes of each block's parameters whose gradient is at least glibc's largest mmap threshold
    (:data:`~lightning_mp_lstm.base.allocator.STEADY_MMAP_THRESHOLD`): every backward of the block makes such a
    gradient in memory mapped afresh, a page fault per page, whatever the process's threshold (a pipeline's every
    microbatch; it is then added to the one the parameter holds).

    A block's timing includes that fill too, but as the fastest of its runs, which on a machine with transparent huge
    pages is a run whose pages came whole: the 50,000 x 256 embedding (51 MB) of the 50,000-word job timed 5-30 ms per
    call. Its pipeline stage (with two LSTM layers) then took 86 ms per one-row microbatch in a 2-process run where the
    plan said 53 ms, and the decoder's stage 172 ms where it said 135; 51 MB at the measured first-touch speed
    (1.2 GB/s) is 43 ms (2026-11-29).
    """
    return {name: sum(p.numel() * p.element_size() for p in block.parameters()
                      if p.numel() * p.element_size() >= STEADY_MMAP_THRESHOLD)
            for name, block in model.blocks(names)}


def pipeline_speeds(calibration: Calibration, threads: int, replicas: int,
                    stage_seconds: Sequence[float]) -> tuple[float, float]:
    """How much faster than one thread a pipeline's processes compute in its steady state and in its fill and
    drain (:func:`crowded_step_time`). In the steady state each replica's busiest stage computes all the time and
    every other one the share of it its own work is: ``replicas x sum(stage / busiest)`` processes compute at once
    and slow each other that much (:meth:`Calibration.slowdown`); in the fill and drain one stage of each replica
    does. Charging every process of an uneven pipeline (a 50,000-word decoder's stage against three LSTM stages)
    as busy predicted its step 1.34-1.37x too slow on 4 processes (2026-11-28)."""
    busiest = max(stage_seconds)
    busy = replicas * (sum(stage_seconds) / busiest if busiest > 0 else len(stage_seconds))
    speed = calibration.speedup(threads)
    return speed / calibration.slowdown(busy), speed / calibration.slowdown(replicas)


def crowded_step_time(crowded: Sequence[float], quiet: Sequence[float], n_microbatches: int) -> float:
    """:func:`~lightning_mp_lstm.planning.plan.step_time` of a pipeline whose processes slow each other only while
    they compute at once: its steady state, ``(m - 1) x max``, at the ``crowded`` seconds per microbatch of each rank;
    its fill and drain, ``sum``, at the ``quiet`` ones (one rank of a replica at a time). Charging the whole step the
    crowded speed predicted the 2-core main job's pp2 with 2 microbatches 1.44x too slow (2026-11-28)."""
    return (n_microbatches - 1) * max(crowded) + sum(quiet)


def advise(model: Any, devices: int | Sequence[int], batch_rows: int, length: int, device: torch.device,
           calibration: Calibration,
           schedule: str = "1F1B", cores: int | None = None, max_microbatches: int = 32,
           time_chunks: Sequence[int] = (2, 4, 8, 16), sharded: bool = False, memory_returned: bool = False,
           only: Collection[tuple[int, int]] | None = None) -> list[Candidate]:
    """Every way to run ``model`` on ``devices`` processes, fastest predicted first.

    Args:
        model: a LightningModule with a pipeline declaration, or its pipeline view (possibly on the meta device).
        devices: processes to use, or several such counts (every candidate of each, one process once).
        batch_rows: sequences per global batch; ``length``: their mean padded length.
        device: where to time blocks (one process's device).
        calibration: from :func:`calibrate`.
        schedule: the pipeline schedule of the pipelined candidates.
        cores: CPU cores to share between the processes (default: the CPU count).
        max_microbatches: the most microbatches considered.
        time_chunks: the chunk counts of the wavefront candidates (at most ``length``; each with 1, 2 or 4 row
            microbatches); empty: none. Block times at the shortest chunk are measured too, and each block's time is
            taken as linear in the length between the two (:class:`~lightning_mp_lstm.planning.plan.ChunkCost`).
        sharded: instead, the candidates whose replicas shard their stages (``shard_replicas=True``): every layout
            with replicas on GPipe or 1F1B and on the wavefront, its blocks timed with freed memory returned as
            those steps run it (:func:`~lightning_mp_lstm.base.allocator.freed_memory_returned`), and sharding's
            collectives in place of the gradients' all-reduce (:func:`shard_seconds`).
        memory_returned: time the blocks with freed memory returned, as the steps of a process whose memory plan
            leaves little room run them (:func:`~lightning_mp_lstm.base.allocator.steady_threshold`).
        only: the ``(replicas, stages)`` pairs to consider (one process is ``(1, 1)``); ``None``: all.

    Raises:
        ValueError: ``device`` is not a CPU (:func:`check_device`).
    """
    check_device(device)
    cores = cores or os.cpu_count() or 1
    model = pipeline_model(model)
    names = list(model.block_names)
    parameters = model.analytic_costs("parameters", 1, length)
    fresh = fresh_gradient_bytes(model, names)
    cache: dict[tuple[int, int], dict[str, float]] = {}
    chunks = sorted({k for k in time_chunks if 1 < k <= length})
    short = -(-length // chunks[-1]) if chunks else length

    def times(rows: int, steps: int = length) -> dict[str, float]:
        if (rows, steps) not in cache:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with freed_memory_returned() if sharded or memory_returned else nullcontext():
                    cache[(rows, steps)] = profile.block_seconds(model, names, rows, steps, device, repeats=3,
                                                                 warmup=1, statistic=min, least=LEAST_SECONDS / 4)
            finally:
                torch.set_num_threads(before)
        return cache[(rows, steps)]

    def wavefront(prefix: str, dp: int, pp: int, rows: int, threads: int) -> Candidate | None:
        """The fastest rows x chunks pair of a ``pp``-stage wavefront pipeline."""
        best: Candidate | None = None
        for m in (m for m in (1, 2, 4) if rows % m == 0 and m <= rows):
            whole, part = times(rows // m), times(rows // m, short)
            partition = partition_blocks(names, whole, pp)
            speeds = pipeline_speeds(calibration, threads, dp,
                                     [sum(whole[b] for b in stage) for stage in partition])
            costs = [[ChunkCost.fit((length, sum(whole[b] for b in stage) / speed + per_microbatch_seconds(stage)),
                                    (short, sum(part[b] for b in stage) / speed + per_microbatch_seconds(stage)))
                      for stage in partition] for speed in speeds]
            for k in chunks:
                steps = -(-length // k)
                transfer = max(2 * _block_bytes(model, stage[0], rows // m, steps) / calibration.bandwidth
                               for stage in partition[1:])
                if memory_returned or sharded:
                    # Returned memory costs a block more at some lengths than at others (the 50,000-word decoder:
                    # 25 % at 25 tokens, nothing at 13), which a line between two lengths misses: each is timed.
                    own = times(rows // m, steps)
                    crowded, quiet = ([sum(own[b] for b in stage) / speed + per_microbatch_seconds(stage) + transfer
                                       for stage in partition] for speed in speeds)
                else:
                    crowded, quiet = ([c.seconds(steps) + transfer for c in kind] for kind in costs)
                seconds = crowded_step_time(crowded, quiet, m * k)
                seconds += max(after_schedule_seconds(stage, dp, pp, threads, m * k, fill_drain=True)
                               for stage in partition)
                seconds += calibration.step_cost(dp, pp, m * k, chunked=True)
                if best is None or seconds < best.predicted_seconds:
                    best = Candidate(f"{prefix} wavefront, m={m} x k={k}", dp, pp, m, tuple(map(tuple, partition)),
                                     threads, seconds, time_chunks=k, sharded=sharded)
        return best

    def per_microbatch_seconds(blocks: Sequence[str]) -> float:
        """What each microbatch's backward of ``blocks`` costs beyond their timing: adding its gradients to those
        their parameters hold, two float32 copies read and one written, 1.5x a copy's traffic (a copy of ``b`` bytes
        takes ``b / (2 x bandwidth)``); and filling their large gradients afresh (:func:`fresh_seconds`)."""
        return 3 * sum(parameters[b] for b in blocks) / calibration.bandwidth + fresh_seconds(blocks)

    def fresh_seconds(blocks: Sequence[str]) -> float:
        """Seconds a backward of ``blocks`` fills their gradients mapped afresh (:func:`fresh_gradient_bytes`) at the
        machine's measured speed; sharded replicas' are in :func:`shard_seconds`, unmeasured ones are free."""
        if sharded or not calibration.first_touch:
            return 0.0
        return sum(fresh[b] for b in blocks) / calibration.first_touch

    def after_schedule_seconds(blocks: Sequence[str], replicas: int, stages: int, threads: int,
                               microbatches: int = 1, fill_drain: bool = False) -> float:
        """Seconds a process holding ``blocks`` spends on their parameters in a step of ``replicas x stages``
        processes: the replicas' collectives (an all-reduce of the gradients, or sharding's gathers and
        reduce-scatter: :func:`shard_seconds`; ``fill_drain``: every forward before every backward) and the
        optimizer step over its parameters (its shard of them, sharded)."""
        processes = replicas * stages
        count = sum(parameters[b] for b in blocks)
        update = calibration.update_cost(count / replicas if sharded else count, threads, processes)
        if replicas == 1:
            return update
        if sharded:
            return update + shard_seconds(4 * count, replicas, gathers(microbatches, fill_drain), calibration,
                                          processes)
        return update + calibration.collective_seconds("all_reduce", 4 * count, replicas, processes)

    def gathers(microbatches: int, fill_drain: bool) -> int:
        """Gathers of a sharded block per step: before each forward (it reshards after it) and before the first
        backward (it stays gathered until the last); under 1F1B a forward between two backwards reshards it, so
        every backward gathers again. GPipe and the wavefront run every forward first."""
        return microbatches + 1 if fill_drain or schedule == "GPipe" or microbatches == 1 else 2 * microbatches

    candidates = [] if sharded or (only is not None and (1, 1) not in only) else [
        Candidate(f"1 process ({cores} threads)", 1, 1, 1, (tuple(names),), cores,
                  sum(times(batch_rows).values()) / calibration.speedup(cores) + fresh_seconds(names)
                  + after_schedule_seconds(names, 1, 1, cores) + calibration.step_cost(1, 1, 1))]
    label = " sharded" if sharded else ""
    counts = sorted({devices} if isinstance(devices, int) else set(devices))
    for processes, pp in ((d, pp) for d in counts for pp in range(1, d + 1)):
        if processes % pp or pp > len(names) or (sharded and processes == pp):
            continue
        if only is not None and (processes // pp, pp) not in only:
            continue
        dp = processes // pp
        threads = max(1, cores // processes)
        speed = calibration.speedup(threads) / calibration.slowdown(processes)
        rows = batch_rows // dp
        if rows < 1:
            continue
        if pp == 1:
            seconds = (sum(times(rows).values()) / speed + fresh_seconds(names)
                       + after_schedule_seconds(names, dp, 1, threads)
                       + calibration.step_cost(dp, 1, 1))
            if dp > 1:
                candidates.append(Candidate(f"dp{dp}{label}", dp, 1, 1, (tuple(names),), threads, seconds,
                                            sharded=sharded))
            continue
        try:
            layout = ParallelLayout(dp, pp, 1, schedule, pp)
            counts = microbatch_candidates(layout, rows, max_microbatches)
        except LayoutError:
            continue
        best: Candidate | None = None
        for m in counts:
            per_block = times(rows // m)
            partition = partition_blocks(names, per_block, pp)
            speeds = pipeline_speeds(calibration, threads, dp, [sum(per_block[b] for b in stage)
                                                                for stage in partition])
            # Each boundary sends activations forward and gradients back once per microbatch.
            transfer = max(2 * _block_bytes(model, stage[0], rows // m, length) / calibration.bandwidth
                           for stage in partition[1:])
            crowded, quiet = ([sum(per_block[b] for b in stage) / v + per_microbatch_seconds(stage) + transfer
                               for stage in partition] for v in speeds)
            seconds = crowded_step_time(crowded, quiet, m)
            seconds += max(after_schedule_seconds(stage, dp, pp, threads, m) for stage in partition)
            seconds += calibration.step_cost(dp, pp, m)
            prefix = f"dp{dp} x pp{pp}{label}" if dp > 1 else f"pp{pp}"
            option = Candidate(f"{prefix} balanced, m={m}", dp, pp, m, tuple(map(tuple, partition)), threads,
                               seconds, sharded=sharded)
            if best is None or option.predicted_seconds < best.predicted_seconds:
                best = option
        if best is not None:
            candidates.append(best)
        if chunks:
            option = wavefront(f"dp{dp} x pp{pp}{label}" if dp > 1 else f"pp{pp}", dp, pp, rows, threads)
            if option is not None:
                candidates.append(option)
    return sorted(candidates, key=lambda c: c.predicted_seconds)


def shard_seconds(nbytes: float, replicas: int, gathers: int, calibration: Calibration,
                  processes: int | None = None) -> float:
    """Seconds sharded replicas spend on a stage's ``nbytes`` of parameters in a step: gathered whole ``gathers``
    times, the gradient reduce-scattered once (:meth:`Calibration.collective_seconds`, in groups of ``replicas``
    while ``processes`` run, default ``replicas``); and every gathered copy and gradient filled in memory mapped
    afresh, twice (FSDP2 copies each out of, or into, its collective's buffer)."""
    moves = gathers + 1
    processes = processes or replicas
    seconds = (gathers * calibration.collective_seconds("all_gather", nbytes, replicas, processes)
               + calibration.collective_seconds("reduce_scatter", nbytes, replicas, processes))
    if calibration.first_touch:
        seconds += 2 * moves * nbytes / calibration.first_touch
    return seconds


def render(candidates: Sequence[Candidate], tokens: float | None = None) -> str:
    """A table of the candidates, fastest first, with the ratio to the fastest (and tokens/s when given)."""
    best = candidates[0].predicted_seconds
    header = "layout                           threads  predicted s/step  x fastest"
    lines = [header + ("  tokens/s" if tokens else "")]
    for c in candidates:
        seconds = c.predicted_seconds
        line = f"{c.name:<32} {c.threads_per_process:>7}  {seconds:>16.4f}  {seconds / best:>9.2f}"
        lines.append(line + (f"  {tokens / seconds:>8,.0f}" if tokens else ""))
    lines.append(f"expected fastest: {candidates[0].name}")
    return "\n".join(lines)
