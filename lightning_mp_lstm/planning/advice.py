"""Which layout to pick: predicted step times of the candidate layouts for the devices at hand.

From the model's blocks timed on this machine (one thread) and a measured :class:`Calibration` (how much faster
one process runs on several threads, how fast processes exchange bytes), :func:`advise` predicts the seconds per
training step of every way to use ``devices`` processes: one process with all cores, data parallel, pipelines
(each partition balanced by the measured times and the best number of microbatches), wavefront pipelines (the
time axis split into chunks, rows x chunks; :mod:`lightning_mp_lstm.pipeline.wavefront`) and their products, and orders
them. The step-time model is the plan's (:func:`~lightning_mp_lstm.planning.plan.step_time`, over ``m x k`` units for a
wavefront), plus the bytes a layout moves between processes, the gradients a pipeline adds up microbatch by
microbatch, and what a step of the layout's kind costs beyond its blocks (:attr:`Calibration.step_costs`).

The advice is for CPUs: it calibrates CPU threads and a host memory copy, and names candidates by cores. On any
other device :func:`calibrate` and :func:`advise` refuse (:func:`check_device`); measure the layouts there instead
(``python benchmarks/run.py --device cuda``).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp_lstm.base.allocator import freed_memory_returned
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.partition import partition_blocks
from lightning_mp_lstm.planning.plan import ChunkCost, microbatch_candidates

__all__ = ["LEAST_SECONDS", "Calibration", "Candidate", "advise", "calibrate", "check_device", "crowded_step_time",
           "first_touch_bandwidth", "render", "shard_seconds"]

#: Seconds the thread calibration runs the model on one thread at least (a quarter of it for each timed block):
#: more runs of a small model, whose step is milliseconds. On the 2-core box three runs of the main job's model gave
#: thread speed-ups from 1.39 to 1.73 and its blocks 38-52 ms, call to call.
LEAST_SECONDS = 0.5


@dataclass(frozen=True)
class Calibration:
    """What this machine does beyond one thread on one block.

    Attributes:
        thread_speedup: threads -> how much faster the whole model's forward + backward runs than on one thread.
        bandwidth: bytes per second one process moves to another (point-to-point and all-reduce).
        crowding: processes -> how much slower one process's work runs while that many run at once, each on its
            share of the cores, than alone on the same share (memory bandwidth and caches are shared; on 2 cores
            two processes ran an LSTM layer 1.8x slower each than one alone): 1x where not measured.
        step_costs: ``(replicas, stages, microbatches)`` -> seconds a training step of a near-zero model takes in
            that layout: what a step costs beyond its blocks (the loop, the optimizer, collectives, the messages of
            every microbatch; measured by ``lightning_mp_lstm.app.step_cost``); none: 0.
        first_touch: bytes per second a process fills memory freshly mapped for it (a page fault per page): what
            sharded replicas pay for the parameters and gradients they gather whole at every step, each buffer mapped
            afresh (:func:`~lightning_mp_lstm.base.allocator.steady_threshold`); 0: not measured, not charged.
    """

    thread_speedup: tuple[tuple[int, float], ...]
    bandwidth: float
    crowding: tuple[tuple[int, float], ...] = ()
    step_costs: tuple[tuple[tuple[int, int, int], float], ...] = ()
    first_touch: float = 0.0

    def step_cost(self, replicas: int, stages: int, units: int) -> float:
        """Seconds a step of ``replicas`` x ``stages`` processes and ``units`` pieces per replica batch costs beyond
        its blocks: the measured kind's, the pipeline's linear in the pieces between its two measured counts (a
        replicated pipeline adds what replication adds to one process); 0 where the kind was not measured."""
        known = dict(self.step_costs)
        one = known.get((1, 1, 1), 0.0)
        extra = known.get((replicas, 1, 1), one) - one if replicas > 1 else 0.0
        if stages == 1:
            return known.get((replicas, 1, 1), 0.0) if replicas > 1 else one
        few, many = known.get((1, stages, stages)), known.get((1, stages, 4 * stages))
        if few is None:
            return extra
        slope = (many - few) / (3 * stages) if many is not None else 0.0
        return max(0.0, few + slope * (units - stages)) + extra

    def slowdown(self, processes: int) -> float:
        """How much slower each of ``processes`` processes running at once computes (the nearest measured count
        at or below; 1x for one process)."""
        known = dict(self.crowding)
        below = [count for count in known if count <= processes]
        return known[max(below)] if below and processes > 1 else 1.0

    def speedup(self, threads: int) -> float:
        """The best speed-up measured with at most ``threads`` threads (a process can always use fewer: at least
        1x)."""
        known = dict(self.thread_speedup)
        return max([known[t] for t in known if t <= threads] or [1.0])


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


def check_device(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless ``device`` is a CPU: what the advice measures and predicts is CPU-only.

    On a GPU a process's speed does not grow with CPU threads, and processes exchange bytes over NVLink, PCIe or the
    network through NCCL, not through host memory, so predictions from this calibration would be meaningless.
    """
    device = torch.device(device)
    if device.type != "cpu":
        raise ValueError(
            f"lightning_mp_lstm.planning.advice predicts layouts for CPUs only, not for device {str(device)!r}: it "
            "calibrates the speed-up of CPU threads and the bandwidth of a host memory copy, which say nothing about "
            "GPUs (NVLink, PCIe, NCCL). On GPUs measure the layouts instead: python benchmarks/run.py --device cuda "
            "(its layouts section times each layout's training steps on the GPUs)")


def calibrate(model: Any, rows: int, length: int, device: torch.device, threads: Sequence[int] = (),
              bandwidth: float | None = None, processes: Sequence[int] = ()) -> Calibration:
    """Measure the thread speed-up of the whole model (its blocks' forward + backward, the fastest of at least three
    interleaved rounds, more for a small model: :data:`LEAST_SECONDS`) for each count in ``threads`` (default: every
    power of two up to the CPU count), the slowdown of ``processes`` processes running at once (each on its share of
    the cores; :func:`crowding`, an LSTM layer of the model's width) and, unless given, the bytes per second of a
    local copy between processes (estimated from a memory copy of a 64 MiB buffer, halved for the transport).

    Raises:
        ValueError: ``device`` is not a CPU (:func:`check_device`).
    """
    check_device(device)
    blocks = pipeline_model(model)
    counts = sorted(set(threads) or {t for t in (1, 2, 4, 8, 16, 32, 64) if t <= (os.cpu_count() or 1)}) or [1]
    before = torch.get_num_threads()
    seconds: dict[int, float] = {}
    rounds, spent = 0, 0.0  # spent: seconds on one thread so far
    try:
        # Interleaved rounds, the fastest of each count: a busy moment slows a round, not a count. At least 3, and
        # more until one thread ran LEAST_SECONDS (at most MOST_REPEATS): a small model's rounds are milliseconds.
        while rounds < 3 or (spent < LEAST_SECONDS and rounds < profile.MOST_REPEATS):
            rounds += 1
            for count in sorted({1, *counts}):
                torch.set_num_threads(count)
                total = sum(profile.block_seconds(blocks, blocks.block_names, rows, length, device, repeats=1,
                                                  warmup=1).values())
                seconds[count] = min(seconds.get(count, total), total)
                if count == 1:
                    spent += total
    finally:
        torch.set_num_threads(before)
    if bandwidth is None:
        source = torch.empty(64 * 2**20, dtype=torch.uint8)
        target = torch.empty_like(source)
        start = time.perf_counter()
        target.copy_(source)
        bandwidth = source.numel() / max(time.perf_counter() - start, 1e-9) / 2
    cores = os.cpu_count() or 1
    width = max(hidden for _, hidden in blocks.sizes) if getattr(blocks, "sizes", None) else 256
    crowded = tuple((count, crowding(count, max(1, cores // count), width, rows, length))
                    for count in sorted(set(processes)) if count > 1)
    return Calibration(tuple((c, seconds[1] / seconds[c]) for c in counts), float(bandwidth), crowded,
                       first_touch=first_touch_bandwidth())


def first_touch_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second one thread fills a buffer mapped afresh (the median of ``repeats``; a buffer of 64 MiB is
    above glibc's largest mmap threshold, so each one is new pages)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            torch.empty(nbytes, dtype=torch.uint8).fill_(1)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return nbytes / max(statistics.median(times), 1e-9)


def _lstm_seconds(lstm: torch.nn.Module, x: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of a forward + backward of ``lstm`` on ``x`` (after one warm-up)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        lstm(x)[0].sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def crowding(processes: int, threads: int, width: int, rows: int, length: int) -> float:
    """How much slower each of ``processes`` workers on ``threads`` threads computes a one-layer ``width``-wide LSTM
    over ``rows x length`` (forward + backward) while all run at once than one alone: the median of their times over
    the time of one alone.

    The workers are threads of this process: torch runs the LSTM and its backward outside the interpreter's lock,
    each call with its own team of ``threads`` threads, so they share the cores, memory bandwidth and caches as rank
    processes do, and the measurement starts no process.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        workers = [(torch.nn.LSTM(width, width, batch_first=True), torch.randn(rows, length, width))
                   for _ in range(processes)]
        alone = _lstm_seconds(*workers[0])
        barrier, times = threading.Barrier(processes), [0.0] * processes

        def work(index: int) -> None:
            barrier.wait()
            times[index] = _lstm_seconds(*workers[index])

        pool = [threading.Thread(target=work, args=(i,)) for i in range(processes)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        torch.set_num_threads(before)
    return max(1.0, statistics.median(times) / alone)


def _block_bytes(model: Any, name: str, rows: int, length: int) -> int:
    """Bytes of the activation that enters block ``name`` (what crosses a stage boundary before it)."""
    example = model.example_input(name, rows, length, torch.device("meta"))
    return example.numel() * example.element_size()


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

    def wavefront(prefix: str, dp: int, pp: int, rows: int, speeds: tuple[float, float],
                  threads: int) -> Candidate | None:
        """The fastest rows x chunks pair of a ``pp``-stage wavefront pipeline (``speeds``: see
        :func:`crowded_step_time`)."""
        best: Candidate | None = None
        for m in (m for m in (1, 2, 4) if rows % m == 0 and m <= rows):
            whole, part = times(rows // m), times(rows // m, short)
            partition = partition_blocks(names, whole, pp)
            costs = [[ChunkCost.fit((length, sum(whole[b] for b in stage) / speed + accumulate_seconds(stage)),
                                    (short, sum(part[b] for b in stage) / speed + accumulate_seconds(stage)))
                      for stage in partition] for speed in speeds]
            for k in chunks:
                steps = -(-length // k)
                transfer = max(2 * _block_bytes(model, stage[0], rows // m, steps) / calibration.bandwidth
                               for stage in partition[1:])
                if memory_returned or sharded:
                    # Returned memory costs a block more at some lengths than at others (the 50,000-word decoder:
                    # 25 % at 25 tokens, nothing at 13), which a line between two lengths misses: each is timed.
                    own = times(rows // m, steps)
                    crowded, quiet = ([sum(own[b] for b in stage) / speed + accumulate_seconds(stage) + transfer
                                       for stage in partition] for speed in speeds)
                else:
                    crowded, quiet = ([c.seconds(steps) + transfer for c in kind] for kind in costs)
                seconds = crowded_step_time(crowded, quiet, m * k)
                seconds += max(gradient_sync_seconds(stage, dp, m * k, fill_drain=True) for stage in partition)
                seconds += calibration.step_cost(dp, pp, m * k)
                if best is None or seconds < best.predicted_seconds:
                    best = Candidate(f"{prefix} wavefront, m={m} x k={k}", dp, pp, m, tuple(map(tuple, partition)),
                                     threads, seconds, time_chunks=k, sharded=sharded)
        return best

    def accumulate_seconds(blocks: Sequence[str]) -> float:
        """Adding a microbatch's gradients of ``blocks`` to those their parameters hold (every microbatch of a
        pipeline, one by one): two float32 copies read and one written, 1.5x a copy's traffic (a copy of ``b`` bytes
        takes ``b / (2 x bandwidth)``)."""
        return 3 * sum(parameters[b] for b in blocks) / calibration.bandwidth

    def gradient_sync_seconds(blocks: Sequence[str], replicas: int, microbatches: int = 1,
                              fill_drain: bool = False) -> float:
        """Seconds ``replicas`` spend on ``blocks``' gradients in a step: an all-reduce, or sharding's gathers and
        reduce-scatter (:func:`shard_seconds`; ``fill_drain``: every forward before every backward)."""
        if replicas == 1:
            return 0.0
        nbytes = 4 * sum(parameters[b] for b in blocks)
        if sharded:
            return shard_seconds(nbytes, replicas, gathers(microbatches, fill_drain), calibration)
        return 2 * (replicas - 1) / replicas * nbytes / calibration.bandwidth

    def gathers(microbatches: int, fill_drain: bool) -> int:
        """Gathers of a sharded block per step: before each forward (it reshards after it) and before the first
        backward (it stays gathered until the last); under 1F1B a forward between two backwards reshards it, so
        every backward gathers again. GPipe and the wavefront run every forward first."""
        return microbatches + 1 if fill_drain or schedule == "GPipe" or microbatches == 1 else 2 * microbatches

    candidates = [] if sharded or (only is not None and (1, 1) not in only) else [
        Candidate(f"1 process ({cores} threads)", 1, 1, 1, (tuple(names),), cores,
                  sum(times(batch_rows).values()) / calibration.speedup(cores) + calibration.step_cost(1, 1, 1))]
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
        # A pipeline's fill and drain: one rank of each replica computes while its others wait (crowded by the
        # replicas only); in its steady state every process computes at once.
        speeds = (speed, calibration.speedup(threads) / calibration.slowdown(dp))
        rows = batch_rows // dp
        if rows < 1:
            continue
        if pp == 1:
            seconds = (sum(times(rows).values()) / speed + gradient_sync_seconds(names, dp)
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
            # Each boundary sends activations forward and gradients back once per microbatch.
            transfer = max(2 * _block_bytes(model, stage[0], rows // m, length) / calibration.bandwidth
                           for stage in partition[1:])
            crowded, quiet = ([sum(per_block[b] for b in stage) / v + accumulate_seconds(stage) + transfer
                               for stage in partition] for v in speeds)
            seconds = crowded_step_time(crowded, quiet, m)
            seconds += max(gradient_sync_seconds(stage, dp, m) for stage in partition)
            seconds += calibration.step_cost(dp, pp, m)
            prefix = f"dp{dp} x pp{pp}{label}" if dp > 1 else f"pp{pp}"
            option = Candidate(f"{prefix} balanced, m={m}", dp, pp, m, tuple(map(tuple, partition)), threads,
                               seconds, sharded=sharded)
            if best is None or option.predicted_seconds < best.predicted_seconds:
                best = option
        if best is not None:
            candidates.append(best)
        if chunks:
            option = wavefront(f"dp{dp} x pp{pp}{label}" if dp > 1 else f"pp{pp}", dp, pp, rows, speeds, threads)
            if option is not None:
                candidates.append(option)
    return sorted(candidates, key=lambda c: c.predicted_seconds)


def shard_seconds(nbytes: float, replicas: int, gathers: int, calibration: Calibration) -> float:
    """Seconds sharded replicas spend on a stage's ``nbytes`` of parameters in a step: gathered whole ``gathers``
    times, the gradient reduce-scattered once (each moving ``(replicas - 1) / replicas`` of the bytes, where
    replicated ones all-reduce twice that once); and every gathered copy and gradient filled in memory mapped
    afresh, twice (FSDP2 copies each out of, or into, its collective's buffer)."""
    moves = gathers + 1
    seconds = moves * (replicas - 1) / replicas * nbytes / calibration.bandwidth
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
