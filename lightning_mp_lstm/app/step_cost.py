"""What a training step costs on this machine beyond its blocks' computation, for each kind of layout: measured once
by short runs of a near-zero model, and kept in a cache file.

A step under ``mp_lstm`` is more than the blocks' forward and backward: Lightning's loop, the strategy's batch
handling and metrics, the optimizer step, the collectives between processes and the messages of every microbatch;
and processes that share the cores slow each other. With a model of a few thousand parameters the blocks cost almost
nothing, so a run's seconds per step are that cost. :func:`step_costs` runs each kind (one process; ``n``
replicas; an ``n``-stage pipeline with ``n`` and with ``4n`` microbatches) for a few dozen steps, each in its own
``python -m lightning_mp_lstm.app.step_cost --trial`` (the strategy launches its rank processes as for any script),
and keeps what it found per machine (host, cores, torch and this package's version) in :data:`CACHE_FILE`: only the
first ``layout=auto`` run on a machine pays for it (about 10 s per kind on 2 cores; a busy machine's costs come out
too high: measure again on a quiet one with the command below). The autopilot adds the cost of each candidate's kind
to its predicted step (:meth:`~lightning_mp_lstm.planning.calibration.Calibration.step_cost`).

The trial of ``n`` replicas also times the collectives replicas run on their gradients, as the processes of a job
run them (:data:`COLLECTIVES`: the all-reduce of replicated gradients, the gathers and reduce-scatters of sharded
ones), for every group size ``r`` that divides ``n``, all ``n / r`` groups at once: seconds per byte of the whole
tensor, kept under ``(collective, n, r)``. A memory copy's speed says little of them: on the 2-core box gloo
all-reduced MXNet's 16 M gradients over 4 processes in 238 ms where a copy's speed predicted 24 ms, and its
reduce-scatter of a tensor took 2x its all-reduce (2026-11-29).

    python -m lightning_mp_lstm.app.step_cost --processes 2     # measure again, keep and print the costs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mp_lstm.strategy.launcher import LAUNCH_ENV

__all__ = ["CACHE_FILE", "COLLECTIVES", "collective_keys", "step_costs", "trial_kinds"]

#: Steps of a trial, and how many of them are warm-up.
TRIAL_STEPS, TRIAL_WARMUP = 40, 10

#: The collectives a replicas trial times: the replicated gradients' all-reduce (16 gradients posted at once, as
#: :func:`~lightning_mp_lstm.pipeline.gradients.all_reduce_gradients` posts them), and a sharded block's gather and
#: reduce-scatter (one tensor each, as FSDP2 runs them per block).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

#: Bytes of the whole tensor each collective is timed on.
COLLECTIVE_BYTES = 32 * 2**20


def collective_keys(processes: int) -> list[tuple[str, int, int]]:
    """``(collective, processes, replicas)`` of every collective a trial of ``processes`` replicas times: each group
    size from 2 that divides ``processes``."""
    sizes = [r for r in range(2, processes + 1) if processes % r == 0]
    return [(name, processes, r) for r in sizes for name in COLLECTIVES]


def trial_kinds(processes: Sequence[int]) -> list[tuple[int, ...]]:
    """``(replicas, stages, microbatches)`` of every trial for these process counts: one process, and for each
    count ``n`` > 1 ``n`` replicas, an ``n``-stage pipeline with ``n`` and ``4n`` microbatches, and an ``n``-stage
    wavefront of ``4n`` units, ``2n`` row microbatches x 2 time chunks (``(1, n, 4n, 2)``).

    The wavefront's units cost more than a pipeline's microbatches: on the 2-core box a near-zero model's pp2 step
    took 15 ms with 2 units either way, 33 ms with 8 microbatches and 44 ms with 4 x 2 units (41 ms with 2 x 4; 34 ms
    with 8 x 1), each chunk carrying its recurrent state to the next as a leaf whose gradient the backward returns
    (2026-11-29)."""
    kinds: list[tuple[int, ...]] = [(1, 1, 1)]
    for n in sorted(set(processes)):
        if n > 1:
            kinds += [(n, 1, 1), (1, n, n), (1, n, 4 * n), (1, n, 4 * n, 2)]
    return kinds


#: Where the measured costs are kept, per machine.
CACHE_FILE = "~/.cache/lightning_mp_lstm/step_costs.json"


def _cache_file() -> Path:
    return Path(os.path.expanduser(CACHE_FILE))


def _machine() -> str:
    import torch

    import lightning_mp_lstm

    return (f"{platform.node()}|{os.cpu_count()}|torch {torch.__version__}|"
            f"lightning_mp_lstm {lightning_mp_lstm.__version__}")


def _run_trial(replicas: int, stages: int, microbatches: int, chunks: int = 1) -> dict[tuple[Any, ...], float] | None:
    """What one trial measured, in a process of its own: its seconds per step under its kind (``chunks`` > 1: a
    wavefront of ``microbatches`` units in that many time chunks), and its collectives' seconds per byte
    (:func:`collective_keys`); ``None``: it failed (a line says so)."""
    kind = (replicas, stages, microbatches, *((chunks,) if chunks > 1 else ()))
    command = [sys.executable, "-m", "lightning_mp_lstm.app.step_cost", "--trial", *map(str, kind)]
    # A fresh job of its own: none of the launching job's rendezvous settings.
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    except subprocess.TimeoutExpired:
        print(f"mp_lstm: the step-cost trial {replicas} x {stages} (m={microbatches}) took over 300 s; left out")
        return None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            found = json.loads(line)
            return {kind: float(found["step_s"]),
                    **{tuple(json.loads(key)): float(value) for key, value in found.get("collectives", {}).items()}}
    print(f"mp_lstm: the step-cost trial {replicas} x {stages} (m={microbatches}) failed (exit {done.returncode}); "
          f"left out: {done.stderr.strip().splitlines()[-1:] or ''}")
    return None


def step_costs(processes: Sequence[int], again: bool = False) -> dict[tuple[Any, ...], float]:
    """This machine's step costs for these process counts, ``(replicas, stages, microbatches) -> seconds per
    step``, and its replicas' collectives, ``(collective, processes, replicas) -> seconds per byte``: from the
    cache, measured (and kept) where missing, or all measured ``again``."""
    path, machine = _cache_file(), _machine()
    cached, known = _read_cache(path), {}
    try:
        known = {} if again else {tuple(json.loads(k)): float(v) for k, v in cached.get(machine, {}).items()}
    except (AttributeError, TypeError, ValueError) as error:
        print(f"mp_lstm: the step costs kept in {path} for this machine are unreadable ({error}); measuring again")
        cached.pop(machine, None)
    wanted = _wanted(processes)
    missing = [kind for kind in trial_kinds(processes)
               if kind not in known or any(key not in known for key in collective_keys(kind[0]) if kind[1] == 1)]
    if missing:
        started = time.perf_counter()
        print(f"mp_lstm: measuring what a step costs beyond its blocks on this machine ({len(missing)} short runs "
              f"of a near-zero model, once; kept in {path})", flush=True)
        for kind in missing:
            measured = _run_trial(*kind)
            if measured is not None:
                known.update(measured)
        print(f"mp_lstm: step costs measured in {time.perf_counter() - started:.0f} s", flush=True)
        cached[machine] = {json.dumps(list(k)): v for k, v in known.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(cached, indent=1))
            os.replace(temporary, path)
        except OSError as error:
            print(f"mp_lstm: could not keep the step costs in {path}: {error}")
    return {key: known[key] for key in wanted if key in known}


def _wanted(processes: Sequence[int]) -> list[tuple[Any, ...]]:
    """Every entry the autopilot uses for these process counts: the step kinds and the replicas' collectives."""
    return [*trial_kinds(processes), *(key for n in sorted(set(processes)) if n > 1 for key in collective_keys(n))]


def _read_cache(path: Path) -> dict[str, Any]:
    """The kept step costs (``{}`` where there are none; a damaged file is said and measured again)."""
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        print(f"mp_lstm: the step costs kept in {path} are unreadable ({error}); measuring again")
        return {}
    if not isinstance(cached, dict):
        print(f"mp_lstm: the step costs kept in {path} are not a JSON object; measuring again")
        return {}
    return cached


def _trial(replicas: int, stages: int, microbatches: int, chunks: int = 1) -> None:
    """One trial: a near-zero model on a fixed batch shape, ``TRIAL_STEPS`` steps (``chunks`` > 1: on the wavefront,
    ``microbatches`` units in that many time chunks); global rank 0 prints the median seconds between the starts of
    consecutive steps after the warm-up, as JSON."""
    import lightning.pytorch as pl

    from lightning_mp_lstm import LSTMLanguageModel
    from lightning_mp_lstm.app import console
    from lightning_mp_lstm.data import LMDataModule
    from lightning_mp_lstm.strategy.strategy import MPLSTMStrategy

    console.quiet()
    starts: list[float] = []
    collectives: dict[str, float] = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            if replicas > 1 and stages == 1:
                collectives.update({json.dumps(list(key)): seconds
                                    for key, seconds in _collective_seconds(replicas).items()})

    data = LMDataModule(source="synthetic", synthetic={"num_train": 4000, "num_valid": 40, "num_test": 40,
                                                       "vocab_size": 50}, buckets=[20], batch_size=32)
    data.prepare_data()
    data.setup("fit")
    model = LSTMLanguageModel(data.vocab_size, embedding_dim=8, hidden_size=8, num_layers=2)
    wavefront = {"schedule": "Wavefront", "time_chunks": chunks} if chunks > 1 else {}
    strategy = MPLSTMStrategy(data_parallel_size=replicas, pipeline_parallel_size=stages,
                              n_microbatches=microbatches // chunks, verify=False, report_after_steps=None,
                              **wavefront)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=replicas * stages, max_steps=TRIAL_STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[Clock()])
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        gaps = [b - a for a, b in zip(starts[TRIAL_WARMUP:], starts[TRIAL_WARMUP + 1:])]
        print(json.dumps({"step_s": statistics.median(gaps), "collectives": collectives}), flush=True)
    strategy.shutdown()


def _collective_seconds(processes: int, repeats: int = 4) -> dict[tuple[str, int, int], float]:
    """Seconds per byte of each of :data:`COLLECTIVES` in groups of every size that divides ``processes`` (the
    default group's processes, all groups at once): the median of ``repeats`` after one warm-up."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from lightning_mp_lstm.pipeline.gradients import all_reduce_gradients

    rank, found = dist.get_rank(), {}
    for name, _, size in collective_keys(processes):
        if name == COLLECTIVES[0]:  # the groups of this size, made by every process in the same order
            groups = [dist.new_group(list(range(first, first + size))) for first in range(0, processes, size)]
            group = groups[rank // size]
        whole = torch.ones(COLLECTIVE_BYTES // 4)
        shard = torch.ones(whole.numel() // size)
        gradients = [SimpleNamespace(grad=piece) for piece in whole.chunk(16)]
        run = {"all_reduce": lambda: all_reduce_gradients(gradients, group),
               "all_gather": lambda: dist.all_gather_single(whole, shard, group=group),
               "reduce_scatter": lambda: dist.reduce_scatter_single(shard, whole, group=group)}[name]
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        found[(name, processes, size)] = statistics.median(times[1:]) / COLLECTIVE_BYTES
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[os.cpu_count() or 1])
    parser.add_argument("--trial", type=int, nargs="+", metavar="N",
                        help="replicas, stages, microbatches (and time chunks: a wavefront)")
    args = parser.parse_args(argv)
    if args.trial:
        _trial(*args.trial)
        return 0
    costs = step_costs(args.processes, again=True)
    for key, seconds in costs.items():
        if key[0] in COLLECTIVES:
            name, processes, replicas = key
            print(f"{name} in groups of {replicas} of {processes} processes: {seconds * 2**30:.3f} s per GiB")
        else:
            replicas, stages, microbatches, *chunks = key
            pieces = f"{microbatches} wavefront units in {chunks[0]} time chunks" if chunks else \
                f"{microbatches} microbatch(es)"
            print(f"{replicas} replica(s) x {stages} stage(s), {pieces}: {seconds * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
