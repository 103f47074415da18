"""What runs on the ranks of ``benchmarks/run.py``: several jobs one after another in the same fresh processes.

A job is a dictionary (:mod:`benchmarks.specs` writes them; ``run.py`` adds its ``device``, ``cpu`` or ``cuda``)
whose ``kind`` picks what a rank runs: ``fit`` (one
``Trainer.fit`` with ``MPLSTMStrategy``), ``advice`` (``lightning_mp_lstm.planning.advice``), ``overhead``
(``benchmarks/overhead.py``), ``bare`` (its hand-written loop alone) or ``memory`` (``benchmarks/memory.py``).
Only public library names are used.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from benchmarks.common import ptb_paths, quiet
from benchmarks.sizes import CLIP

_DATA_CACHE: dict[str, Any] = {}


def _datamodule(spec: dict[str, Any]) -> Any:
    """The data of a job: PTB with some buckets (one instance per process and setting) or fixed random batches."""
    if spec["kind"] == "fixed":
        return _fixed_data(spec["vocab_size"], spec["rows"], spec["length"], spec["batches"])
    key = json.dumps(spec, sort_keys=True)
    if key not in _DATA_CACHE:
        from lightning_mp_lstm.data import LMDataModule

        data = LMDataModule(source="ptb", **ptb_paths(), buckets=spec["buckets"],
                            num_auto_buckets=spec.get("num_buckets") or 5, batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        _DATA_CACHE[key] = data
    return _DATA_CACHE[key]


def _fixed_data(vocab_size: int, rows: int, length: int, batches: int) -> Any:
    """Random full-length batches of one shape, each data-parallel replica taking its contiguous share."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    class FixedData(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.mean_padded_length, self.vocab_size = rows, float(length), vocab_size
            self.bucket_lengths = [length]
            g = torch.Generator().manual_seed(0)
            tokens = [torch.randint(1, vocab_size, (rows, length + 1), generator=g) for _ in range(batches)]
            self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

        def train_dataloader(self) -> DataLoader:
            kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
            replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
            share = rows // replicas
            return DataLoader([(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
                               for x, y in self.batches], batch_size=None)

    return FixedData()


def _peak_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fit_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` with ``MPLSTMStrategy``.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        job: ``data``, ``model`` (keyword arguments), ``strategy`` (options), ``batches`` (steps); optionally
            ``measure_step`` (when the strategy times the stages), ``timeline`` (steps to record), ``picture``
            (where rank 0 draws the last recorded step), ``padding`` (report the split's padded fraction) and
            ``memory`` (report this process's peak RSS before and after training: the job must be the first in
            fresh processes, since a peak never goes down).

    Returns:
        When every step started and ended; the real (non-padding target) and padded tokens of this rank's
        batches and the data-parallel replica they belong to (:func:`merge` makes them global); the partition,
        the number of microbatches and of time chunks, the stage times measured on their own ranks and the
        timeline's records; with ``memory``, ``floor_mib`` and ``peak_mib``.
    """
    import lightning.pytorch as pl
    import torch

    from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
    from lightning_mp_lstm.timeline import PipelineTimeline, StepRecord, draw

    class Steps(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.tokens: list[int] = []
            self.padded: list[int] = []
            self.replica = 0

        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
            self.replica = int(kwargs.get("rank", 0))

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            self.tokens.append(int((batch[1] != 0).sum()))  # padding is token id 0
            self.padded.append(int(batch[0].numel()))

    data = _datamodule(job["data"])
    floor = _peak_mib()
    strategy = MPLSTMStrategy(report_after_steps=job.get("measure_step"), timeout=600.0, **job["strategy"])
    steps = Steps()
    callbacks: list[pl.Callback] = [steps]
    with tempfile.TemporaryDirectory() as scratch:
        timeline = PipelineTimeline(steps=job["timeline"], directory=scratch) if job.get("timeline") else None
        if timeline is not None:
            callbacks.append(timeline)
        trainer = pl.Trainer(strategy=strategy, accelerator=job.get("device", "cpu"), devices=world_size,
                             max_steps=job["batches"],
                             max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             gradient_clip_val=CLIP, callbacks=callbacks)
        torch.manual_seed(0)
        with trainer.init_module(empty_init=True):
            model = LSTMLanguageModel(data.vocab_size, **job["model"])
        trainer.fit(model, datamodule=data)
    measured = strategy.measurements
    out = {"starts": steps.starts, "ends": steps.ends, "tokens": steps.tokens, "padded": steps.padded,
           "replica": steps.replica, "partition": [list(s) for s in strategy.partition],
           "m": strategy.layout.n_microbatches, "time_chunks": strategy.layout.time_chunks,
           "stage_seconds": list(measured.stage_seconds) if measured and measured.stage_seconds else None,
           "records": timeline.records_as_dicts() if timeline is not None else []}
    if job.get("picture") and rank == 0 and timeline is not None and timeline.records:
        record = StepRecord.from_dict(out["records"][-1])
        draw(record, job["picture"])
    if job.get("memory"):
        out["floor_mib"], out["peak_mib"] = floor, _peak_mib()
    if job.get("padding") and rank == 0:
        dataset = data.dataset("train")
        real = sum(dataset.example_length(i) for i in range(len(dataset)))
        padded = sum(dataset.buckets[int(b)] for b in dataset.bucket_indices)
        out["split_padded_fraction"] = 1.0 - real / padded
        out["bucket_lengths"] = list(data.bucket_lengths)
    return out


def advice_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``calibration.calibrate`` and ``advice.advise`` for ``job["devices"]`` processes on ``job["cores"]`` cores.

    Returns:
        The calibration, the candidates (as dictionaries) and the padded length they were predicted for.
    """
    import torch

    from lightning_mp_lstm import LSTMLanguageModel
    from lightning_mp_lstm.app.autopilot import candidate_threads
    from lightning_mp_lstm.planning.advice import advise
    from lightning_mp_lstm.planning.calibration import calibrate

    data = _datamodule(job["data"])
    with torch.device("meta"):
        model = LSTMLanguageModel(data.vocab_size, **job["model"])
    length = max(1, round(data.mean_padded_length))
    cpu = torch.device("cpu")
    cores = job["cores"]
    calibration = calibrate(model, job["rows"], length, cpu, threads=candidate_threads(cores, [job["devices"]]),
                            processes=(job["devices"],))
    candidates = advise(model, job["devices"], job["rows"], length, cpu, calibration, schedule="1F1B", cores=cores,
                        max_microbatches=job["max_microbatches"], time_chunks=())  # no wavefront row to compare with
    return {"calibration": asdict(calibration), "candidates": [asdict(c) for c in candidates], "length": length}


def overhead_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/overhead.py``'s comparison on this rank of the job's layout.

    Returns:
        The step intervals of the bare loop and of the strategy and this rank's time outside the schedule
        (:func:`overhead.compare`).
    """
    from benchmarks import overhead

    setup = overhead.Setup(**job["setup"])
    return overhead.compare(rank, job["steps"], job["warmup"], setup, rounds=job["rounds"])


def bare_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/overhead.py``'s hand-written pipelining loop alone (no Lightning, no checks, no recording) on
    this rank of ``job["setup"]``'s layout, ``job["steps"]`` steps (a CPU loop). Starts the default gloo group when
    none runs.

    Returns:
        ``intervals``: seconds between the starts of consecutive steps; ``schedule``: seconds in ``schedule.step``.
    """
    from benchmarks import overhead

    overhead.start_rank()
    return overhead.bare_loop(rank, job["steps"], overhead.Setup(**job["setup"]))


def memory_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/memory.py``'s measurement on this rank; only meaningful as the first job of fresh processes
    (a process's peak memory never goes down).

    Returns:
        This rank's peaks and blocks (:func:`memory.rank_peaks`, one-file save).
    """
    from benchmarks import memory

    with tempfile.TemporaryDirectory() as directory:
        return memory.rank_peaks(rank, world_size, job["args"], directory, "file", job.get("device", "cpu"))


JOBS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {"fit": fit_job, "advice": advice_job,
                                                              "overhead": overhead_job, "memory": memory_job,
                                                              "bare": bare_job}


def worker(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> list[tuple[Any, float]]:
    """Run ``jobs`` one after another on this rank.

    Returns:
        ``(result, seconds)`` of every job.
    """
    quiet()
    out = []
    for job in jobs:
        started = time.perf_counter()
        out.append((JOBS[job["kind"]](rank, world_size, job), time.perf_counter() - started))
    return out


def spawn(world_size: int, jobs: list[dict[str, Any]], timeout: float,
          start_method: str = "spawn") -> list[list[tuple[Any, float]]]:
    """Run ``jobs`` one after another on ``world_size`` fresh processes.

    Args:
        world_size: the number of processes.
        jobs: what they run, in order.
        timeout: seconds all of them may take together.
        start_method: ``"spawn"`` (each rank imports torch and Lightning itself, as a launched rank does) or
            ``"forkserver"`` (ranks forked from a server that imported them once: seconds less per group).

    Returns:
        Every rank's ``(result, seconds)`` of every job (``[rank][job]``).
    """
    from lightning_mp_lstm.base.testing import run_ranks

    return run_ranks(worker, world_size, jobs, timeout=timeout, start_method=start_method)


def merge(job: dict[str, Any], per_rank: list[Any]) -> Any:
    """One result of a job from every rank's.

    Args:
        job: the job.
        per_rank: its result on every rank.

    Returns:
        Rank 0's result; for a ``fit`` job with its ``tokens`` and ``padded`` those of the global batch: summed
        over the data-parallel replicas (every rank of a replica loads the same batch), and with ``memory`` every
        rank's ``peak_mib`` and ``floor_mib`` (lists by rank).
    """
    first = per_rank[0]
    if job["kind"] == "overhead":  # every rank's time outside the schedule
        return {**first, "outside": [(r["bare_outside"], r["strategy_outside"]) for r in per_rank]}
    if job["kind"] != "fit":
        return first
    replicas = {r["replica"]: r for r in reversed(per_rank)}  # the lowest rank of each replica
    if job.get("memory"):  # every rank's own peak
        first = {**first, "peak_mib": [r["peak_mib"] for r in per_rank],
                 "floor_mib": [r["floor_mib"] for r in per_rank]}
    return {**first, "tokens": [sum(step) for step in zip(*(r["tokens"] for r in replicas.values()))],
            "padded": [sum(step) for step in zip(*(r["padded"] for r in replicas.values()))]}
