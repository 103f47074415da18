"""What this machine does beyond one thread on one block, measured for the layout advice
(:func:`~lightning_mp_lstm.planning.advice.advise`).

:func:`calibrate` measures, for a model, how much faster its blocks run on more threads, how much processes running
at once slow each other (:func:`crowding`), what its optimizer step costs per parameter (:func:`time_update`) and how
fast a process fills fresh memory; the machine's per-step costs and its replicas' collectives are measured by short
runs of the strategy (``lightning_mp_lstm.app.step_cost``) and added to the :class:`Calibration`. CPUs only
(:func:`check_device`).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import profile

__all__ = ["CROWDING_ROUNDS", "LEAST_SECONDS", "Calibration", "calibrate", "check_device", "copy_bandwidth",
           "crowding", "first_touch_bandwidth", "time_update"]

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
            every microbatch; measured by ``lightning_mp_lstm.app.step_cost``); ``(1, stages, units, 2)``: a
            wavefront of ``units`` in 2 time chunks; none: 0.
        first_touch: bytes per second a process fills memory freshly mapped for it (a page fault per page): what
            sharded replicas pay for the parameters and gradients they gather whole at every step, each buffer mapped
            afresh (:func:`~lightning_mp_lstm.base.allocator.steady_threshold`); 0: not measured, not charged.
        collectives: ``(collective, processes, replicas)`` -> seconds per byte of the whole tensor of an
            ``all_reduce``, ``all_gather`` or ``reduce_scatter`` in groups of ``replicas`` while ``processes`` run
            (measured by ``lightning_mp_lstm.app.step_cost``); where not measured, a ring over :attr:`bandwidth`.
        update_seconds: threads -> seconds per parameter of one process's optimizer step (and gradient clipping,
            where the run clips) on that many threads (:func:`time_update`); none: not charged. On the 2-core
            box MXNet's 16 M parameters took 20-24 ms alone and 61 ms each in 4 processes at once.
    """

    thread_speedup: tuple[tuple[int, float], ...]
    bandwidth: float
    crowding: tuple[tuple[int, float], ...] = ()
    step_costs: tuple[tuple[tuple[int, ...], float], ...] = ()
    first_touch: float = 0.0
    collectives: tuple[tuple[tuple[str, int, int], float], ...] = ()
    update_seconds: tuple[tuple[int, float], ...] = ()

    def collective_seconds(self, name: str, nbytes: float, replicas: int, processes: int) -> float:
        """Seconds of collective ``name`` on a tensor of ``nbytes`` in a group of ``replicas`` while ``processes``
        run: measured, or measured with ``replicas`` processes only, or a ring over :attr:`bandwidth` (an
        all-reduce moves ``2 (r - 1) / r`` of the bytes, a gather or reduce-scatter half that)."""
        if replicas == 1:
            return 0.0
        known = dict(self.collectives)
        per_byte = known.get((name, processes, replicas), known.get((name, replicas, replicas)))
        if per_byte is not None:
            return nbytes * per_byte
        share = (2 if name == "all_reduce" else 1) * (replicas - 1) / replicas
        return share * nbytes / self.bandwidth

    def update_cost(self, parameters: float, threads: int, processes: int) -> float:
        """Seconds one of ``processes`` processes on ``threads`` threads spends stepping its optimizer over
        ``parameters`` (slowed as its computation is: :meth:`slowdown`); 0 where not measured."""
        known = dict(self.update_seconds)
        if not known:
            return 0.0
        below = [count for count in known if count <= threads]
        per_parameter = known[max(below)] if below else known[min(known)]
        return parameters * per_parameter * self.slowdown(processes)

    def step_cost(self, replicas: int, stages: int, units: int, chunked: bool = False) -> float:
        """Seconds a step of ``replicas`` x ``stages`` processes and ``units`` pieces per replica batch costs beyond
        its blocks: the measured kind's, the pipeline's linear in the pieces between its two measured counts (a
        replicated pipeline adds what replication adds to one process); 0 where the kind was not measured. A
        wavefront whose units are time chunks (``chunked``) grows by its own measured line from the pipeline's
        fewest pieces (the two cost the same at ``stages`` pieces), the pipeline's where it was not measured."""
        known = dict(self.step_costs)
        one = known.get((1, 1, 1), 0.0)
        extra = known.get((replicas, 1, 1), one) - one if replicas > 1 else 0.0
        if stages == 1:
            return known.get((replicas, 1, 1), 0.0) if replicas > 1 else one
        few, many = known.get((1, stages, stages)), known.get((1, stages, 4 * stages))
        if chunked:
            many = known.get((1, stages, 4 * stages, 2), many)
        if few is None:
            return extra
        slope = (many - few) / (3 * stages) if many is not None else 0.0
        return max(0.0, few + slope * (units - stages)) + extra

    def slowdown(self, processes: float) -> float:
        """How much slower each of ``processes`` processes running at once computes: 1x for one, the measured
        factor at a measured count, a line between the two measured counts around any other (a pipeline's busy
        processes need not be a whole number: :func:`pipeline_speeds`), the largest measured one's beyond it."""
        known = {1: 1.0, **dict(self.crowding)}
        if processes <= 1:
            return 1.0
        low = max(count for count in known if count <= processes)
        above = [count for count in known if count >= processes]
        if not above:
            return known[low]
        high = min(above)
        if high == low:
            return known[low]
        return known[low] + (known[high] - known[low]) * (processes - low) / (high - low)

    def speedup(self, threads: int) -> float:
        """The best speed-up measured with at most ``threads`` threads (a process can always use fewer: at least
        1x)."""
        known = dict(self.thread_speedup)
        return max([known[t] for t in known if t <= threads] or [1.0])

    def summary(self) -> str:
        """One line of what was measured, for the ranking's table: two rankings of a job can be told apart by it.
        Thread speed-ups, crowding, transfer and first-touch speeds, and the optimizer step per million parameters."""
        parts = [", ".join(f"{t} threads {s:.2f}x" for t, s in sorted(self.thread_speedup)) or "threads not measured",
                 "crowding " + (", ".join(f"{p} at once {s:.2f}x" for p, s in self.crowding) or "not measured"),
                 f"transfer {self.bandwidth / 1e9:.1f} GB/s",
                 f"first touch {self.first_touch / 1e9:.1f} GB/s" if self.first_touch else "first touch not measured"]
        if self.update_seconds:
            parts.append("optimizer " + ", ".join(f"{1e9 * s:.1f} ms per M parameters on {t}"
                                                  for t, s in self.update_seconds))
        return "; ".join(parts)


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
              bandwidth: float | None = None, processes: Sequence[int] = (),
              optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
              clip: bool = False) -> Calibration:
    """Measure the thread speed-up of the whole model (its blocks' forward + backward, the fastest of at least three
    interleaved rounds, more for a small model: :data:`LEAST_SECONDS`) for each count in ``threads`` (default: every
    power of two up to the CPU count), the slowdown of ``processes`` processes running at once (each on its share of
    the cores; :func:`crowding`, the model's blocks on each one's share of the rows), the optimizer step per
    parameter on each count (:func:`time_update`: ``optimizer`` makes the model's optimizer over a list of tensors,
    plain SGD where ``None``; ``clip``: the run clips the gradients' norm too) and, unless given, the bytes per second
    of a local copy between processes (:func:`copy_bandwidth` of a 64 MiB buffer, halved for the transport).

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
        bandwidth = copy_bandwidth() / 2
    cores = os.cpu_count() or 1
    crowded = tuple((count, crowding(count, max(1, cores // count), blocks, max(1, rows // count), length))
                    for count in sorted(set(processes)) if count > 1)
    updates = tuple((count, time_update(optimizer, clip, count)) for count in counts)
    return Calibration(tuple((c, seconds[1] / seconds[c]) for c in counts), float(bandwidth), crowded,
                       first_touch=first_touch_bandwidth(), update_seconds=updates)


def time_update(optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None, clip: bool,
                   threads: int, parameters: int = 8 * 2**20, repeats: int = 3) -> float:
    """Seconds per parameter of an optimizer step (after the gradients' norm is clipped, with ``clip``) over
    ``parameters`` float32 parameters in 8 tensors on ``threads`` threads: the median of ``repeats`` after one
    warm-up (which makes the optimizer's state). ``optimizer`` makes it over a list of tensors (``None``: SGD).

    32 MiB of parameters, more than a CPU's caches hold: the step reads and writes memory as a model's does.
    """
    make = optimizer or (lambda tensors: torch.optim.SGD(tensors, lr=0.1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = [torch.zeros(parameters // 8, requires_grad=True) for _ in range(8)]
        for tensor in tensors:
            tensor.grad = torch.full_like(tensor, 1e-3)
        stepper = make(tensors)

        def step() -> None:
            if clip:
                torch.nn.utils.clip_grad_norm_(tensors, 1.0)
            stepper.step()

        seconds = _median_seconds(step, repeats, warmup=1)
    finally:
        torch.set_num_threads(before)
    return seconds / parameters


def copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second this process copies between two buffers it already holds (the median of ``repeats``).

    Both are filled first: a copy into memory mapped afresh pays a page fault per page (:func:`first_touch_bandwidth`)
    and one out of untouched memory reads the kernel's shared zero page. Timed on the fresh buffer, one copy as before
    2026-11-29, it came out 1.0 or 4.0 GB/s on the 2-core box, call to call, as the pages came small or huge; the
    gradients a pipeline adds up live in memory already held (a 51 MB add: 7.5 ms, 4 GB/s by this measure).
    """
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = source.clone()
    return nbytes / max(_median_seconds(lambda: target.copy_(source), repeats), 1e-9)


def first_touch_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second one thread fills a buffer mapped afresh (the median of ``repeats``; a buffer of 64 MiB is
    above glibc's largest mmap threshold, so each one is new pages)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _median_seconds(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1), repeats)
    finally:
        torch.set_num_threads(before)
    return nbytes / max(seconds, 1e-9)


def _median_seconds(run: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """The median of ``repeats`` timed calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain_seconds(blocks: Any, rows: int, length: int) -> float:
    """Seconds of a forward + backward of every block of ``blocks`` (a fresh copy of each) on ``rows x length``."""
    return sum(profile.block_seconds(blocks, blocks.block_names, rows, length, torch.device("cpu"), repeats=2,
                                     warmup=1).values())


#: Rounds of :func:`crowding`, each one alone and all at once: one round on the 2-core box gave 1.00 and 1.11 for two
#: workers called twice in a row, 1.56 and 2.14 for four (four real processes: 1.77), and the same candidate's
#: prediction moved 16 % between two rankings minutes apart (2026-11-29).
CROWDING_ROUNDS = 3


def crowding(processes: int, threads: int, model: Any, rows: int, length: int,
             rounds: int = CROWDING_ROUNDS) -> float:
    """How much slower each of ``processes`` workers on ``threads`` threads computes the forward + backward of
    ``model``'s blocks over ``rows x length`` while all run at once than one alone: in each of ``rounds`` rounds the
    median of their times over the time of one alone, just before; the median of the rounds.

    The model's own blocks at a replica's share of the rows, as a rank runs them, not a stand-in (until 2026-11-29 an
    LSTM layer of the model's width on the whole batch, which leaves out a decoder's logits streaming through
    memory). On the 2-core box MXNet's 8 x 400 model measured 1.12-1.14x for two workers and 1.98-2.26x for four;
    four rank processes running its blocks measured 2.36x.

    The workers are threads of this process: torch runs the blocks' operations and their backward outside the
    interpreter's lock, each with its own team of ``threads`` threads, so they share the cores, memory bandwidth and
    caches as rank processes do, and the measurement starts no process.
    """
    blocks = pipeline_model(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    ratios = []
    try:
        with torch.random.fork_rng():  # the workers' timings fork and restore it at once
            for _ in range(max(1, rounds)):
                alone = _chain_seconds(blocks, rows, length)
                barrier, times = threading.Barrier(processes), [0.0] * processes

                def work(index: int, barrier: threading.Barrier = barrier, times: list[float] = times) -> None:
                    barrier.wait()
                    times[index] = _chain_seconds(blocks, rows, length)

                pool = [threading.Thread(target=work, args=(i,)) for i in range(processes)]
                for thread in pool:
                    thread.start()
                for thread in pool:
                    thread.join()
                ratios.append(statistics.median(times) / alone)
    finally:
        torch.set_num_threads(before)
    return max(1.0, statistics.median(ratios))
