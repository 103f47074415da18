"""Every benchmark of the project in one command: a JSON file of the numbers and a Markdown page generated from it.

    python benchmarks/run.py                          # full: benchmarks/results.json, docs/results.md, pictures
    python benchmarks/run.py --quick --out DIR        # CI: tiny sizes, every section, about a minute on 2 cores
    python benchmarks/run.py --render docs/results.md [--json benchmarks/results.json]   # page only, no measuring

Sections (each a table; each goal gets a met / missed flag, a missed goal never fails the command):

* ``pipeline_bound``: pp2 step time against its own bound ``(m - 1) x max + sum`` of the stage times, GPipe and
  1F1B at several m;
* ``layouts``: tokens/s of 1 process (both cores), dp2, pp2 (even, balanced, balanced with m=auto) and pp4 on
  PTB for the ``tiny``, ``small`` and ``mxnet_ptb`` models, one global batch for all;
* ``partition_regret``: every contiguous 2-stage split against the ``balanced`` one, in the same run;
* ``bucketing``: real tokens/s and padded-token fraction of the MXNet buckets, ``auto`` and pad-to-longest;
* ``memory``: peak memory per rank (``benchmarks/memory.py``);
* ``strategy_overhead``: ``MPLSTMStrategy`` in ``Trainer.fit`` against a bare pipelining loop
  (``benchmarks/strategy_overhead.py``);
* ``advice``: ``lightning_mp_lstm.advice``'s predicted order of layouts against the measured one.

Times are medians over steps after warm-up (tokens/s: real tokens over the timed steps); ratios compare runs made
in the same invocation; every rank runs one thread unless its row says otherwise. The script checks its JSON
against the schema below (:func:`validate`) and exits with status 2 when it does not hold, 1 on an error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = "lightning_mp_lstm.benchmarks/1"
#: The sections of a result, in page order.
SECTIONS = ("pipeline_bound", "layouts", "partition_regret", "bucketing", "memory", "strategy_overhead", "advice")
DEFAULT_JSON = ROOT / "benchmarks" / "results.json"
DEFAULT_PAGE = ROOT / "docs" / "results.md"
DEFAULT_PICTURES = ROOT / "docs" / "_static" / "results"
MODELS_DIR = ROOT / "conf" / "model"
MXNET_BUCKETS = [8, 16, 24, 32, 60]
CLIP = 0.25  # conf/trainer/default.yaml's gradient_clip_val: the clipping all-reduce is part of a real step
#: ``python train.py data=ptb buckets=mxnet model=M data.batch_size=64 trainer.limit_train_batches=30 layout=L``
#: by hand before this script existed (tokens/s).
EARLIER = {
    "small": {"1 process": 10176, "dp2": 9920, "pp2 even": 5680, "pp2 balanced": 5861, "pp2 balanced, m=auto": 6806},
    "mxnet_ptb": {"1 process": 2591, "dp2": 2266, "pp2 even": 1568, "pp2 balanced": 1760,
                  "pp2 balanced, m=auto": 1978},
}


class SchemaError(ValueError):
    """The results do not have the shape :func:`validate` expects."""


# ----- sizes ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """How big and how long every section runs (:data:`FULL`, :data:`QUICK`)."""

    # pipeline vs its bound: an LSTM model on fixed-shape random batches
    bound_model: dict[str, int] = field(default_factory=lambda: {"vocab": 2000, "embedding_dim": 256,
                                                                 "hidden_size": 256, "num_layers": 4})
    bound_rows: int = 64
    bound_length: int = 35
    bound_m: tuple[int, ...] = (4, 8, 16)
    bound_warmup: int = 3
    bound_steps: int = 10
    # layouts on PTB: conf/model names -> overrides
    layout_models: dict[str, dict[str, Any]] = field(default_factory=lambda: {"tiny": {}, "small": {},
                                                                               "mxnet_ptb": {}})
    layout_batch: int = 64
    layout_warmup: int = 3
    layout_steps: int = 10
    layout_rounds: int = 3
    # partition regret: every contiguous 2-stage split of a model with a few blocks
    regret_model: dict[str, int] = field(default_factory=lambda: {"vocab": 10000, "embedding_dim": 256,
                                                                  "hidden_size": 256, "num_layers": 4})
    regret_rows: int = 64
    regret_length: int = 35
    regret_m: int = 4
    regret_warmup: int = 2
    regret_steps: int = 6
    regret_rounds: int = 2
    # bucketing: one process on PTB
    bucket_model: str = "small"
    bucket_overrides: dict[str, Any] = field(default_factory=dict)
    bucket_warmup: int = 3
    bucket_steps: int = 20
    bucket_auto: tuple[int, ...] = (5, 10)
    # layout advice: the most microbatches a pipeline candidate may have
    advice_max_microbatches: int = 32
    # memory (benchmarks/memory.py)
    memory_hidden: int = 1024
    memory_rows: int = 8
    memory_steps: int = 2
    memory_layouts: dict[str, int] = field(default_factory=lambda: {"1 process": 1, "pp2": 2, "pp4": 4})
    memory_formats: tuple[str, ...] = ("file", "sharded")
    #: measure memory as the first job of the other sections' processes (one-file save only) instead of in
    #: processes of its own
    memory_inline: bool = False
    # strategy overhead (benchmarks/strategy_overhead.py)
    overhead: dict[str, Any] = field(default_factory=dict)
    overhead_steps: int = 30
    overhead_warmup: int = 5
    overhead_rounds: int = 2
    # seconds each group of processes may take
    timeout: float = 1800.0


FULL = Sizes()
_TINY = {"embedding_dim": 16, "hidden_size": 16}
QUICK = Sizes(
    bound_model={"vocab": 64, "embedding_dim": 16, "hidden_size": 16, "num_layers": 2}, bound_rows=16,
    bound_length=8, bound_warmup=1, bound_steps=3,
    layout_models={"tiny": _TINY, "small": _TINY, "mxnet_ptb": _TINY}, layout_batch=64, layout_warmup=1,
    layout_steps=3, layout_rounds=1,
    regret_model={"vocab": 64, "embedding_dim": 16, "hidden_size": 16, "num_layers": 2}, regret_rows=16,
    regret_length=8, regret_m=2, regret_warmup=1, regret_steps=2, regret_rounds=1,
    bucket_overrides=_TINY, bucket_warmup=1, bucket_steps=3, advice_max_microbatches=4,
    memory_hidden=32, memory_rows=4, memory_steps=1, memory_layouts={"1 process": 1, "pp2": 2},
    memory_formats=("file",), memory_inline=True,
    overhead={"vocab": 64, "embed": 16, "hidden": 16, "layers": 2, "rows": 16, "length": 8, "microbatches": 4},
    overhead_steps=4, overhead_warmup=1, overhead_rounds=1,
    timeout=300.0,
)


# ----- what runs on the ranks ------------------------------------------------------------------------------------
def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_mp_lstm"):
        logging.getLogger(name).setLevel(logging.ERROR)


_DATA_CACHE: dict[str, Any] = {}


def _ptb_paths() -> dict[str, str]:
    from tests.helpers import ptb_dir

    ptb = ptb_dir()  # only ptb.valid.txt and ptb.test.txt are needed: train on valid, evaluate on test
    return {"train": str(ptb / "ptb.valid.txt"), "valid": str(ptb / "ptb.test.txt"), "test": str(ptb / "ptb.test.txt")}


def _datamodule(spec: dict[str, Any]) -> Any:
    """The data of a job: PTB with some buckets (one instance per process and setting) or fixed random batches."""
    if spec["kind"] == "fixed":
        return _fixed_data(spec["vocab"], spec["rows"], spec["length"], spec["batches"])
    key = json.dumps(spec, sort_keys=True)
    if key not in _DATA_CACHE:
        from lightning_mp_lstm.data import LMDataModule

        data = LMDataModule(source="ptb", **_ptb_paths(), buckets=spec["buckets"],
                            num_auto_buckets=spec.get("num_buckets") or 5, batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        _DATA_CACHE[key] = data
    return _DATA_CACHE[key]


def _fixed_data(vocab: int, rows: int, length: int, batches: int) -> Any:
    """Random full-length batches of one shape, each data-parallel replica taking its contiguous share."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    class FixedData(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.mean_padded_length, self.vocab_size = rows, float(length), vocab
            self.bucket_lengths = [length]
            g = torch.Generator().manual_seed(0)
            tokens = [torch.randint(1, vocab, (rows, length + 1), generator=g) for _ in range(batches)]
            self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

        def train_dataloader(self) -> DataLoader:
            kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
            replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
            share = rows // replicas
            return DataLoader([(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
                               for x, y in self.batches], batch_size=None)

    return FixedData()


def _model_config(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``conf/model/<name>.yaml`` as keyword arguments of ``LSTMLanguageModel`` (with ``overrides``)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(MODELS_DIR / f"{name}.yaml"))
    assert isinstance(config, dict)
    config.pop("_target_", None)
    return {**config, **overrides}


def _fit_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` with ``MPLSTMStrategy``: when every step started and ended, its real and padded tokens,
    the plan, the stage times measured on their own ranks, and the timeline's recorded steps."""
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

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            self.tokens.append(int(module.pipeline.last_tokens))  # the global batch's real tokens
            self.padded.append(int(batch[0].numel()))

    data = _datamodule(job["data"])
    strategy = MPLSTMStrategy(report_after_steps=job.get("measure_step"), timeout=600.0, **job["strategy"])
    steps = Steps()
    callbacks: list[pl.Callback] = [steps]
    with tempfile.TemporaryDirectory() as scratch:
        timeline = PipelineTimeline(steps=job["timeline"], directory=scratch) if job.get("timeline") else None
        if timeline is not None:
            callbacks.append(timeline)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=job["batches"],
                             max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             gradient_clip_val=CLIP, callbacks=callbacks)
        torch.manual_seed(0)
        with trainer.init_module(empty_init=True):
            model = LSTMLanguageModel(data.vocab_size, **job["model"])
        trainer.fit(model, datamodule=data)
    measured = strategy.measurements
    out = {"starts": steps.starts, "ends": steps.ends, "tokens": steps.tokens, "padded": steps.padded,
           "partition": [list(s) for s in strategy.partition], "m": strategy.layout.n_microbatches,
           "stage_seconds": list(measured.stage_seconds) if measured and measured.stage_seconds else None,
           "records": timeline.records_as_dicts() if timeline is not None else []}
    if job.get("picture") and rank == 0 and timeline is not None and timeline.records:
        record = StepRecord.from_dict(out["records"][-1])
        draw(record, job["picture"])
    if job.get("padding") and rank == 0:
        dataset = data.dataset("train")
        real = sum(dataset.example_length(i) for i in range(len(dataset)))
        padded = sum(dataset.buckets[int(b)] for b in dataset.bucket_indices)
        out["split_padded_fraction"] = 1.0 - real / padded
        out["bucket_lengths"] = list(data.bucket_lengths)
    return out


def _advice_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``advice.calibrate`` and ``advice.advise`` for 2 processes on this machine's cores."""
    import torch

    from lightning_mp_lstm import LSTMLanguageModel
    from lightning_mp_lstm.advice import advise, calibrate

    data = _datamodule(job["data"])
    with torch.device("meta"):
        model = LSTMLanguageModel(data.vocab_size, **job["model"])
    length = max(1, round(data.mean_padded_length))
    cpu = torch.device("cpu")
    cores = job["cores"]
    calibration = calibrate(model, job["rows"], length, cpu, threads=(cores,))
    candidates = advise(model, job["devices"], job["rows"], length, cpu, calibration, schedule="1F1B", cores=cores,
                        max_microbatches=job["max_microbatches"])
    return {"calibration": asdict(calibration), "candidates": [asdict(c) for c in candidates], "length": length}


def _overhead_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import strategy_overhead

    setup = strategy_overhead.Setup(**job["setup"])
    return strategy_overhead.compare(rank, job["steps"], job["warmup"], setup, rounds=job["rounds"])


def _memory_job(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/memory.py``'s measurement on this rank (only meaningful as the first job of fresh processes)."""
    from benchmarks import memory

    with tempfile.TemporaryDirectory() as directory:
        return memory.rank_peaks(rank, world_size, job["args"], directory, "file")


_JOBS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {"fit": _fit_job, "advice": _advice_job,
                                                               "overhead": _overhead_job, "memory": _memory_job}


def _worker(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> list[tuple[Any, float]]:
    _quiet()
    out = []
    for job in jobs:
        started = time.perf_counter()
        out.append((_JOBS[job["kind"]](rank, world_size, job), time.perf_counter() - started))
    return out


def _spawn(world_size: int, jobs: list[dict[str, Any]], timeout: float) -> list[list[tuple[Any, float]]]:
    """Run ``jobs`` one after another on ``world_size`` fresh processes: every rank's ``(result, seconds)`` of
    every job."""
    from tests.helpers import run_ranks

    return run_ranks(_worker, world_size, jobs, timeout=timeout)


# ----- jobs ------------------------------------------------------------------------------------------------------
def _strategy(dp: int = 1, pp: int = 1, threads: int = 1, **options: Any) -> dict[str, Any]:
    return {"data_parallel_size": dp, "pipeline_parallel_size": pp, "num_threads": threads, **options}


def _fixed(sizes_model: dict[str, int], rows: int, length: int, batches: int) -> dict[str, Any]:
    return {"kind": "fixed", "vocab": sizes_model["vocab"], "rows": rows, "length": length, "batches": batches}


def _lstm(sizes_model: dict[str, int]) -> dict[str, Any]:
    return {k: v for k, v in sizes_model.items() if k != "vocab"} | {"optimizer": "sgd", "lr": 0.1}


def _bound_jobs(s: Sizes, picture: Path | None) -> list[dict[str, Any]]:
    """pp2 at every schedule and m: warm-up, one step that times every stage on its rank, then timed steps that the
    timeline records, and one more step (so the last timed step ends where the next one starts)."""
    first = s.bound_warmup + 1
    batches = first + s.bound_steps + 1
    pictured = s.bound_m[len(s.bound_m) // 2]
    return [{"kind": "fit", "section": "pipeline_bound", "schedule": schedule,
             "data": _fixed(s.bound_model, s.bound_rows, s.bound_length, batches), "model": _lstm(s.bound_model),
             "strategy": _strategy(pp=2, schedule=schedule, n_microbatches=m), "batches": batches,
             "measure_step": s.bound_warmup, "timeline": list(range(first, first + s.bound_steps)),
             "picture": str(picture) if picture is not None and schedule == "1F1B" and m == pictured else None}
            for schedule in ("GPipe", "1F1B") for m in s.bound_m]


def _dp2_pp2_job(s: Sizes, picture: Path | None) -> dict[str, Any]:
    """dp2 x pp2 with the bound's model and global batch, as many rows per microbatch as pp2 at the middle m."""
    batches = s.bound_warmup + 2
    m = max(2, s.bound_m[len(s.bound_m) // 2] // 2)
    return {"kind": "fit", "section": "picture", "data": _fixed(s.bound_model, s.bound_rows, s.bound_length, batches),
            "model": _lstm(s.bound_model), "strategy": _strategy(dp=2, pp=2, schedule="1F1B", n_microbatches=m),
            "batches": batches, "timeline": [batches - 1], "picture": str(picture) if picture else None}


LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    # name -> (processes, strategy options)
    "1 process": (1, _strategy(threads=2)),
    "dp2": (2, _strategy(dp=2)),
    "pp2 even": (2, _strategy(pp=2, partition="even")),
    "pp2 balanced": (2, _strategy(pp=2, partition="balanced")),
    "pp2 balanced, m=auto": (2, _strategy(pp=2, partition="balanced", n_microbatches="auto")),
    "pp4 balanced": (4, _strategy(pp=4, partition="balanced")),
}


def _ptb(batch: int, buckets: Any = MXNET_BUCKETS, num_buckets: int | None = None) -> dict[str, Any]:
    return {"kind": "ptb", "buckets": buckets, "num_buckets": num_buckets, "batch_size": batch}


def _layout_jobs(s: Sizes, round_: int) -> dict[int, list[dict[str, Any]]]:
    """One round of every model on every layout, grouped by the number of processes."""
    jobs: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    for model, overrides in s.layout_models.items():
        config = _model_config(model, overrides)
        blocks = config["num_layers"] + 2
        for layout, (world, options) in LAYOUTS.items():
            if options["pipeline_parallel_size"] > blocks:
                continue
            jobs[world].append({"kind": "fit", "section": "layouts", "model_name": model, "layout": layout,
                                "round": round_, "data": _ptb(s.layout_batch), "model": config,
                                "strategy": options, "batches": s.layout_warmup + s.layout_steps,
                                "warmup": s.layout_warmup})
    return jobs


def _two_stage_splits(names: Sequence[str]) -> list[list[list[str]]]:
    return [[list(names[:k]), list(names[k:])] for k in range(1, len(names))]


def _regret_jobs(s: Sizes) -> list[dict[str, Any]]:
    """Every contiguous 2-stage split and the balanced one, each once per round (rounds one after another)."""
    from lightning_mp_lstm.model import block_names

    batches = s.regret_warmup + 1 + s.regret_steps
    settings = [("balanced", "balanced")] + [(_split_name(p), p) for p in
                                            _two_stage_splits(block_names(s.regret_model["num_layers"]))]
    return [{"kind": "fit", "section": "partition_regret", "setting": name, "round": r,
             "data": _fixed(s.regret_model, s.regret_rows, s.regret_length, batches), "model": _lstm(s.regret_model),
             "strategy": _strategy(pp=2, schedule="1F1B", n_microbatches=s.regret_m, partition=partition,
                                   balance_by="time"),
             "batches": batches, "measure_step": s.regret_warmup}
            for r in range(s.regret_rounds) for name, partition in settings]


def _bucket_jobs(s: Sizes) -> list[dict[str, Any]]:
    config = _model_config(s.bucket_model, s.bucket_overrides)
    settings = [("mxnet", _ptb(s.layout_batch))]
    settings += [(f"auto ({k} buckets)", _ptb(s.layout_batch, "auto", k)) for k in s.bucket_auto]
    settings += [("none (pad to longest)", _ptb(s.layout_batch, None))]
    return [{"kind": "fit", "section": "bucketing", "buckets": name, "data": data, "model": config,
             "strategy": _strategy(), "batches": s.bucket_warmup + s.bucket_steps,
             "warmup": s.bucket_warmup, "padding": True} for name, data in settings]


def _advice_jobs(s: Sizes) -> list[dict[str, Any]]:
    return [{"kind": "advice", "section": "advice", "model_name": model, "data": _ptb(s.layout_batch),
             "model": _model_config(model, overrides), "rows": s.layout_batch, "devices": 2, "cores": 2,
             "max_microbatches": s.advice_max_microbatches}
            for model, overrides in s.layout_models.items()]


def _overhead_job_spec(s: Sizes) -> dict[str, Any]:
    return {"kind": "overhead", "section": "strategy_overhead", "setup": s.overhead, "steps": s.overhead_steps,
            "warmup": s.overhead_warmup, "rounds": s.overhead_rounds}


# ----- measuring -------------------------------------------------------------------------------------------------
def _split_name(partition: Sequence[Sequence[str]]) -> str:
    return " | ".join(stage[0] if len(stage) == 1 else f"{stage[0]}..{stage[-1]}" for stage in partition)


def _intervals(result: dict[str, Any], steps: Sequence[int]) -> list[float]:
    """Seconds from the start of each of ``steps`` to the start of the next (the end of the last step)."""
    starts, ends = result["starts"], result["ends"]
    return [(starts[i + 1] if i + 1 < len(starts) else ends[i]) - starts[i] for i in steps if i < len(ends)]


def _tokens_per_s(result: dict[str, Any], warmup: int) -> tuple[float, float, float]:
    """Real tokens per second over the steps after ``warmup`` (their first start to their last end), the mean
    seconds per step and the padded fraction of those steps' batches."""
    starts, ends = result["starts"], result["ends"]
    timed = range(warmup, len(ends))
    if not timed:
        raise RuntimeError(f"no timed steps: {len(ends)} steps ran, {warmup} of them warm-up")
    seconds = ends[-1] - starts[warmup]
    tokens = sum(result["tokens"][i] for i in timed)
    padded = sum(result["padded"][i] for i in timed)
    return tokens / seconds, seconds / len(timed), 1.0 - tokens / padded


def _stage_seconds_in_step(record: Any) -> list[float]:
    """Forward + backward seconds of one microbatch of every stage inside a recorded step (the mean over its
    microbatches)."""
    from lightning_mp_lstm.timeline import COMPUTE

    busy = {s: 0.0 for s in range(record.num_stages)}
    for span in record.spans:
        if span.kind in COMPUTE:
            busy[span.stage] += span.end - span.start
    return [busy[s] / record.n_microbatches for s in range(record.num_stages)]


def _bound(stage_seconds: Sequence[float], m: int) -> float:
    from lightning_mp_lstm.plan import step_time

    return step_time(stage_seconds, m)


def _goal(name: str, value: float, target: float, op: str) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": float(value), "target": float(target), "op": op, "met": bool(met)}


def _section_bound(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    from lightning_mp_lstm.timeline import COMPUTE, StepRecord, predicted_bubble

    rows, goals = [], []
    for job, result in results:
        m = result["m"]
        records = sorted((StepRecord.from_dict(r) for r in result["records"]), key=lambda r: r.step)
        intervals = _intervals(result, [r.step for r in records])
        inside = [_stage_seconds_in_step(r) for r in records]
        bounds = [_bound(t, m) for t in inside]
        isolated = result["stage_seconds"]
        measured = statistics.median(intervals)
        # When the step's last forward or backward ended: what the schedule took, without the optimizer after it.
        compute_end = [max(span.end for span in r.spans if span.kind in COMPUTE) for r in records]
        row = {"schedule": job["schedule"], "m": m, "rows_per_microbatch": s.bound_rows // m,
               "stage_s": [statistics.median(t) for t in zip(*inside)], "bound_s": statistics.median(bounds),
               "measured_s": measured, "ratio": statistics.median(b / t for b, t in zip(bounds, intervals)),
               "compute_end_s": statistics.median(compute_end),
               "schedule_ratio": statistics.median(b / t for b, t in zip(bounds, compute_end)),
               "isolated_stage_s": isolated, "isolated_bound_s": _bound(isolated, m),
               "bubble_measured": statistics.median(r.bubble() for r in records),
               "bubble_predicted": predicted_bubble(job["schedule"], 2, 1, m)}
        row["isolated_ratio"] = row["isolated_bound_s"] / measured
        rows.append(row)
        goals.append(_goal(f"{job['schedule']}, m={m}: bound / measured step", row["ratio"], 0.95, ">="))
    model = s.bound_model
    return {
        "title": "Pipeline against its own bound",
        "setup": (f"pp2 (2 processes x 1 thread), even partition, {model['num_layers']} x LSTM {model['hidden_size']}"
                  f", embedding {model['embedding_dim']}, vocabulary {model['vocab']:,}, random batches of "
                  f"{s.bound_rows} x {s.bound_length}. After {s.bound_warmup} warm-up steps one step times each stage "
                  f"on its own rank in isolation (profile.stage_seconds), then PipelineTimeline records "
                  f"{s.bound_steps} steps: a stage's time is the sum of its forward and backward spans in the step "
                  "over m (one microbatch), the step's bound is (m - 1) x max + sum of those (plan.step_time), the "
                  "measured time is the interval from the step's start to the next step's start (optimizer, "
                  "clipping, Lightning and the recording included). Bound / measured: the median over the "
                  "recorded steps of each step's ratio; the other columns are medians too. 'Compute ends' is when the "
                  "step's last forward or backward ended (the schedule's part of the step, before the optimizer), "
                  "and bound / compute end the ratio without what follows the schedule."),
        "rows": rows, "goals": goals,
    }


def _median_by(values: dict[Any, list[float]]) -> dict[Any, float]:
    return {k: statistics.median(v) for k, v in values.items()}


def _section_layouts(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    tps: dict[tuple[str, str], list[float]] = {}
    step: dict[tuple[str, str], list[float]] = {}
    chosen: dict[tuple[str, str], tuple[list[list[str]], int]] = {}
    for job, result in results:
        key = (job["model_name"], job["layout"])
        rate, seconds, _ = _tokens_per_s(result, job["warmup"])
        tps.setdefault(key, []).append(rate)
        step.setdefault(key, []).append(seconds)
        chosen[key] = (result["partition"], result["m"])
    rows = []
    order = {(model, layout): (i, j) for i, model in enumerate(s.layout_models) for j, layout in enumerate(LAYOUTS)}
    for (model, layout), rates in sorted(tps.items(), key=lambda item: order[item[0]]):
        single = tps[(model, "1 process")]
        ratios = [a / b for a, b in zip(rates, single)]  # each round against the same round's 1 process
        world, options = LAYOUTS[layout]
        partition, m = chosen[(model, layout)]
        rows.append({"model": model, "layout": layout, "processes": world, "threads": options["num_threads"],
                     "m": m, "partition": _split_name(partition), "tokens_per_s": statistics.median(rates),
                     "step_s": statistics.median(step[(model, layout)]), "ratio": statistics.median(ratios),
                     "earlier_tokens_per_s": EARLIER.get(model, {}).get(layout)})
    return {
        "title": "Which layout wins",
        "setup": (f"PTB (train on ptb.valid.txt), MXNet buckets {MXNET_BUCKETS}, global batch {s.layout_batch} "
                  f"sentences for every layout, models from conf/model; 1F1B, gradient clipping {CLIP}; "
                  f"{s.layout_warmup} warm-up steps, then real tokens over the next {s.layout_steps} steps' time, "
                  f"median of {s.layout_rounds} round(s), every layout once per round; ratio: to 1 process in the same "
                  "round. 1 process runs 2 threads, every other process 1 (pp4: 4 processes on the 2 cores). "
                  "'earlier': the hand-made table measured with train.py before this script."),
        "rows": rows, "goals": [],
    }


def _section_regret(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    intervals: dict[str, list[float]] = {}
    stages: dict[str, list[list[float]]] = {}
    split_of: dict[str, str] = {}
    timed = range(s.regret_warmup + 1, s.regret_warmup + 1 + s.regret_steps)
    for job, result in results:
        name = job["setting"]
        intervals.setdefault(name, []).extend(_intervals(result, timed))
        stages.setdefault(name, []).append(result["stage_seconds"])
        split_of[name] = _split_name(result["partition"])
    step = _median_by(intervals)
    best = min(v for k, v in step.items() if k != "balanced")
    rows = []
    for name, seconds in step.items():
        stage_s = [statistics.median(v) for v in zip(*stages[name])]
        rows.append({"setting": name, "split": split_of[name], "step_s": seconds, "stage_s": stage_s,
                     "max_over_mean": max(stage_s) / statistics.mean(stage_s), "ratio_to_best": seconds / best})
    balanced = next(r for r in rows if r["setting"] == "balanced")
    model = s.regret_model
    return {
        "title": "Partition regret",
        "setup": (f"pp2 (2 x 1 thread), 1F1B, m = {s.regret_m}, {model['num_layers']} x LSTM {model['hidden_size']}, "
                  f"embedding {model['embedding_dim']}, vocabulary {model['vocab']:,}, random batches of "
                  f"{s.regret_rows} x {s.regret_length}; every contiguous 2-stage split and partition='balanced' "
                  f"(by measured time), each once per round, {s.regret_rounds} round(s); step: median interval over "
                  f"{s.regret_steps} timed steps per run after {s.regret_warmup} warm-up; stage times: forward + "
                  "backward of one microbatch on its own rank (isolated), median of the rounds."),
        "rows": rows,
        "goals": [_goal("balanced step / best split's step", balanced["ratio_to_best"], 1.05, "<="),
                  _goal("balanced max / mean stage time", balanced["max_over_mean"], 1.10, "<=")],
    }


def _section_bucketing(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    rows = []
    for job, result in results:
        rate, seconds, fraction = _tokens_per_s(result, job["warmup"])
        rows.append({"buckets": job["buckets"], "lengths": result["bucket_lengths"], "real_tokens_per_s": rate,
                     "step_s": seconds, "padded_fraction": result["split_padded_fraction"],
                     "batch_padded_fraction": fraction})
    none = next(r for r in rows if r["buckets"].startswith("none"))
    goals = []
    for row in rows:
        row["speedup"] = row["real_tokens_per_s"] / none["real_tokens_per_s"]
    for row in rows[:2]:  # mxnet and auto with the default number of buckets
        goals.append(_goal(f"{row['buckets']}: real tokens/s over pad-to-longest", row["speedup"], 1.5, ">="))
        goals.append(_goal(f"{row['buckets']}: padded fraction", row["padded_fraction"], 0.10, "<="))
    config = _model_config(s.bucket_model, s.bucket_overrides)
    return {
        "title": "Bucketing",
        "setup": (f"1 process x 1 thread, model {s.bucket_model} ({config['num_layers']} x {config['hidden_size']}), "
                  f"PTB (train on ptb.valid.txt), batch {s.layout_batch} sentences; padded fraction: of the whole "
                  f"training split (and of the timed batches); real tokens/s over {s.bucket_steps} steps after "
                  f"{s.bucket_warmup} warm-up."),
        "rows": rows, "goals": goals,
    }


def _section_memory(results: dict[str, list[dict[str, Any]]], s: Sizes) -> dict[str, Any]:
    single = results["1 process"][0]["training"]
    rows = []
    for layout, ranks in results.items():
        for rank, r in enumerate(ranks):
            blocks = r["blocks"]
            rows.append({"layout": layout, "rank": rank,
                         "blocks": ", ".join(blocks) if len(blocks) < 4 else f"{blocks[0]} .. {blocks[-1]}",
                         "params": int(r["params"]), "floor_mib": r["floor"], "training_mib": r["training"],
                         "file_save_mib": r["file"]["saving"] if "file" in r else None,
                         "sharded_save_mib": r["sharded"]["saving"] if "sharded" in r else None,
                         "ratio": r["training"] / single})
    goals = []
    if "pp4" in results:
        pp4 = [r["training"] for r in results["pp4"]]
        goals.append(_goal("pp4: largest rank / 1 process (training)", max(pp4) / single, 0.60, "<="))
    pipelined = "pp4" if "pp4" in results else "pp2"
    ranks = [r["training"] for r in results[pipelined]]
    goals.append(_goal(f"{pipelined}: rank 0 / largest other rank (training)", ranks[0] / max(ranks[1:]), 1.15, "<="))
    return {
        "title": "Memory per rank",
        "setup": (f"benchmarks/memory.py: peak RSS (MiB) per rank, mxnet_ptb shape (8 layers, embedding 200) with "
                  f"hidden {s.memory_hidden}, PTB batch {s.memory_rows}, {s.memory_steps} steps, Adam, GPipe with m = "
                  f"the number of ranks, one thread per rank; floor: after imports and data; then a checkpoint "
                  f"save ({', '.join(s.memory_formats)}; "
                  + ("the first job of the other sections' fresh processes)." if s.memory_inline else
                     "each format in fresh processes).")),
        "rows": rows, "goals": goals,
    }


def _section_overhead(intervals: dict[str, list[float]], s: Sizes) -> dict[str, Any]:
    from benchmarks.strategy_overhead import Setup, summarize

    summary = summarize(intervals)
    setup = Setup(**s.overhead)
    return {
        "title": "Strategy overhead",
        "setup": (f"benchmarks/strategy_overhead.py: {setup.layers} x LSTM {setup.hidden}, vocabulary {setup.vocab:,}, "
                  f"batch {setup.rows} x {setup.length}, even partition, {setup.schedule} with {setup.microbatches} "
                  f"microbatches on 2 ranks x 1 thread; {s.overhead_rounds} alternating round(s) of {s.overhead_steps} "
                  f"steps each, the first {s.overhead_warmup} of each dropped; steps/s = 1 / median interval."),
        "rows": [{"run": "bare torch.distributed.pipelining loop", "steps_per_s": summary["bare_steps_per_s"],
                  "timed_steps": len(intervals["bare"])},
                 {"run": "MPLSTMStrategy in Trainer.fit", "steps_per_s": summary["strategy_steps_per_s"],
                  "timed_steps": len(intervals["strategy"])}],
        "ratio": summary["ratio"],
        "goals": [_goal("strategy / bare steps per second", summary["ratio"], 0.95, ">=")],
    }


#: advice candidates (data parallel, pipeline parallel) -> the measured layout they stand for
_ADVICE_TO_LAYOUT = {(1, 1): "1 process", (2, 1): "dp2", (1, 2): "pp2 balanced, m=auto"}


def _section_advice(results: list[tuple[dict, dict]], layouts: dict[str, Any]) -> dict[str, Any]:
    measured = {(r["model"], r["layout"]): r for r in layouts["rows"]}
    rows, goals = [], []
    for job, result in results:
        model = job["model_name"]
        candidates = [c for c in result["candidates"]
                      if (c["data_parallel_size"], c["pipeline_parallel_size"]) in _ADVICE_TO_LAYOUT]
        entries = []
        for c in candidates:
            layout = _ADVICE_TO_LAYOUT[(c["data_parallel_size"], c["pipeline_parallel_size"])]
            got = measured.get((model, layout))
            if got is None:
                continue
            entries.append({"model": model, "candidate": c["name"], "layout": layout,
                            "predicted_s": c["predicted_seconds"], "measured_s": got["step_s"],
                            "tokens_per_s": got["tokens_per_s"]})
        if not entries:
            continue
        by_measured = sorted(entries, key=lambda e: -e["tokens_per_s"])
        by_predicted = sorted(entries, key=lambda e: e["predicted_s"])
        for e in entries:
            e["predicted_rank"] = by_predicted.index(e) + 1
            e["measured_rank"] = by_measured.index(e) + 1
        rows.extend(sorted(entries, key=lambda e: e["predicted_rank"]))
        value = by_measured[0]["tokens_per_s"] / by_predicted[0]["tokens_per_s"]
        predicted = by_predicted[0]["layout"]
        goals.append(_goal(f"{model}: measured best / measured speed of the predicted best ({predicted})", value,
                           1.10, "<="))
    return {
        "title": "Layout advice: predicted against measured",
        "setup": ("lightning_mp_lstm.advice: calibrate (thread speed-up at 2 threads, transfer bandwidth) and advise "
                  "for 2 processes on 2 cores, 1F1B, the layouts section's batch and mean padded length, in one "
                  "process before the layouts run; predicted seconds per step against the layouts section's measured "
                  "mean seconds per step (its batches vary in length: compare the order). The pipeline candidate "
                  "(balanced, best predicted m) stands against the measured 'pp2 balanced, m=auto'."),
        "rows": rows, "goals": goals,
    }


def machine() -> dict[str, Any]:
    """The CPU, its cores, the versions and the load (1, 5, 15 minutes) right now."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__, "lightning": lightning.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "load_before": list(os.getloadavg())}


def measure(sizes: Sizes, pictures: Path, only: Sequence[str] = SECTIONS, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Run the benchmarks of ``only`` (section names) with ``sizes``; pictures go to ``pictures``."""
    pictures.mkdir(parents=True, exist_ok=True)
    need_layouts = "layouts" in only or "advice" in only
    pp2_png, dp2_pp2_png = pictures / "timeline_pp2.png", pictures / "timeline_dp2_pp2.png"
    fixed: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    if "strategy_overhead" in only:
        fixed[2].append(_overhead_job_spec(sizes))
    if "pipeline_bound" in only:
        for stale in (pp2_png, dp2_pp2_png):  # only this run's pictures may be listed
            stale.unlink(missing_ok=True)
        fixed[2] += _bound_jobs(sizes, pp2_png)
        fixed[4].append(_dp2_pp2_job(sizes, dp2_pp2_png))
    if "partition_regret" in only:
        fixed[2] += _regret_jobs(sizes)
    if "advice" in only:
        fixed[1] += _advice_jobs(sizes)
    if "bucketing" in only:
        fixed[1] += _bucket_jobs(sizes)
    inline_memory = "memory" in only and sizes.memory_inline
    if inline_memory:
        args = {"hidden": sizes.memory_hidden, "rows": sizes.memory_rows, "steps": sizes.memory_steps}
        for layout, world in sizes.memory_layouts.items():
            fixed[world].insert(0, {"kind": "memory", "section": "memory", "layout": layout, "args": args})
    done: list[tuple[dict[str, Any], Any]] = []
    memory_ranks: dict[str, list[dict[str, Any]]] = {}
    rounds = sizes.layout_rounds if need_layouts else 1
    for r in range(rounds):
        layout_jobs = _layout_jobs(sizes, r) if need_layouts else {1: [], 2: [], 4: []}
        for world in (1, 2, 4):
            jobs = (fixed[world] if r == 0 else []) + layout_jobs[world]
            if not jobs:
                continue
            log(f"  round {r + 1}/{rounds}: {len(jobs)} runs on {world} process(es) ...")
            started = time.perf_counter()
            ranks = _spawn(world, jobs, sizes.timeout)
            spent: dict[str, float] = {}
            for i, job in enumerate(jobs):
                result, seconds = ranks[0][i]
                done.append((job, result))
                if job["kind"] == "memory":
                    memory_ranks[job["layout"]] = [per_rank[i][0] for per_rank in ranks]
                spent[job["section"]] = spent.get(job["section"], 0.0) + seconds
            log(f"    {time.perf_counter() - started:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in spent.items())})")

    def of(section: str) -> list[tuple[dict, Any]]:
        return [(job, result) for job, result in done if job.get("section") == section]

    sections: dict[str, Any] = {}
    if "pipeline_bound" in only:
        sections["pipeline_bound"] = _section_bound(of("pipeline_bound"), sizes)
    if need_layouts:
        layouts = _section_layouts(of("layouts"), sizes)
        if "layouts" in only:
            sections["layouts"] = layouts
        if "advice" in only:
            sections["advice"] = _section_advice(of("advice"), layouts)
    if "partition_regret" in only:
        sections["partition_regret"] = _section_regret(of("partition_regret"), sizes)
    if "bucketing" in only:
        sections["bucketing"] = _section_bucketing(of("bucketing"), sizes)
    if "strategy_overhead" in only:
        sections["strategy_overhead"] = _section_overhead(of("strategy_overhead")[0][1], sizes)
    if "memory" in only:
        if not inline_memory:
            log("  memory (benchmarks/memory.py) ...")
            started = time.perf_counter()
            from benchmarks import memory

            memory_ranks = memory.measure(sizes.memory_hidden, sizes.memory_rows, sizes.memory_steps,
                                          sizes.memory_layouts, sizes.memory_formats, timeout=sizes.timeout)
            log(f"    {time.perf_counter() - started:.0f} s")
        else:
            memory_ranks = {layout: [{**r, "file": r} for r in ranks] for layout, ranks in memory_ranks.items()}
        sections["memory"] = _section_memory(memory_ranks, sizes)
    pictures_written = {}
    for name, path in (("pp2", pp2_png), ("dp2_pp2", dp2_pp2_png)):
        if "pipeline_bound" in only and path.is_file():
            pictures_written[name] = _stored_path(path)
    return {"sections": {k: sections[k] for k in SECTIONS if k in sections}, "pictures": pictures_written}


def _stored_path(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (the JSON stays valid in any checkout)."""
    path = path.resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _resolve_stored(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


# ----- schema ----------------------------------------------------------------------------------------------------
#: Field types of a row of each section: ``str``, ``int``, ``num`` (finite), ``pos`` (finite, > 0), ``frac``
#: (in [0, 1]), ``list[pos]``, ``list[int]``, ``bool``; a trailing ``?`` allows ``null``.
ROW_FIELDS: dict[str, dict[str, str]] = {
    "pipeline_bound": {"schedule": "str", "m": "int", "rows_per_microbatch": "int", "stage_s": "list[pos]",
                       "bound_s": "pos", "isolated_stage_s": "list[pos]", "isolated_bound_s": "pos",
                       "measured_s": "pos", "ratio": "pos", "compute_end_s": "pos", "schedule_ratio": "pos",
                       "isolated_ratio": "pos", "bubble_measured": "num",
                       "bubble_predicted": "frac"},
    "layouts": {"model": "str", "layout": "str", "processes": "int", "threads": "int", "m": "int",
                "partition": "str", "tokens_per_s": "pos", "step_s": "pos", "ratio": "pos",
                "earlier_tokens_per_s": "pos?"},
    "partition_regret": {"setting": "str", "split": "str", "step_s": "pos", "stage_s": "list[pos]",
                         "max_over_mean": "pos", "ratio_to_best": "pos"},
    "bucketing": {"buckets": "str", "lengths": "list[int]", "real_tokens_per_s": "pos", "step_s": "pos",
                  "padded_fraction": "frac", "batch_padded_fraction": "frac", "speedup": "pos"},
    "memory": {"layout": "str", "rank": "int", "blocks": "str", "params": "int", "floor_mib": "pos",
               "training_mib": "pos", "file_save_mib": "pos?", "sharded_save_mib": "pos?", "ratio": "pos"},
    "strategy_overhead": {"run": "str", "steps_per_s": "pos", "timed_steps": "int"},
    "advice": {"model": "str", "candidate": "str", "layout": "str", "predicted_s": "pos", "measured_s": "pos",
               "tokens_per_s": "pos", "predicted_rank": "int", "measured_rank": "int"},
}
_TOP = {"schema": str, "mode": str, "command": str, "date": str, "duration_s": (int, float), "machine": dict,
        "sections": dict, "pictures": dict}
_MACHINE = {"cpu": str, "cores": int, "torch": str, "lightning": str, "python": str, "load_before": list,
            "load_after": list}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_value(kind: str, value: Any) -> bool:
    if kind.endswith("?"):
        return value is None or _check_value(kind[:-1], value)
    if kind.startswith("list["):
        inner = kind[5:-1]
        return isinstance(value, list) and len(value) > 0 and all(_check_value(inner, v) for v in value)
    return {
        "str": lambda v: isinstance(v, str) and v != "",
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "num": _is_number,
        "pos": lambda v: _is_number(v) and v > 0,
        "frac": lambda v: _is_number(v) and 0.0 <= v <= 1.0,
    }[kind](value)


def validate(results: dict[str, Any], sections: Sequence[str] = SECTIONS) -> None:
    """Check ``results`` against the schema: top-level keys and types, the machine, every section of ``sections``
    with a title, a setup text, rows whose fields have the types of :data:`ROW_FIELDS`, and goals
    (``name``, finite ``value`` and ``target``, ``op`` in ``>=``/``<=``, boolean ``met`` that agrees with them).

    Raises:
        SchemaError: listing every problem found.
    """
    problems: list[str] = []
    if not isinstance(results, dict):
        raise SchemaError("results must be a JSON object")
    for key, kind in _TOP.items():
        if not isinstance(results.get(key), kind) or isinstance(results.get(key), bool):
            problems.append(f"top-level {key!r} missing or not {kind}")
    if results.get("schema") != SCHEMA:
        problems.append(f"schema is {results.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in _MACHINE.items():
        if not isinstance((results.get("machine") or {}).get(key), kind):
            problems.append(f"machine.{key} missing or not {kind.__name__}")
    found = results.get("sections") if isinstance(results.get("sections"), dict) else {}
    unknown = set(found) - set(SECTIONS)
    if unknown:
        problems.append(f"unknown sections {sorted(unknown)}")
    for name in sections:
        section = found.get(name)
        if not isinstance(section, dict):
            problems.append(f"section {name!r} missing")
            continue
        for key in ("title", "setup"):
            if not isinstance(section.get(key), str) or not section.get(key):
                problems.append(f"{name}.{key} missing")
        rows = section.get("rows")
        if not isinstance(rows, list) or not rows:
            problems.append(f"{name}.rows missing or empty")
            rows = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(f"{name}.rows[{i}] is not an object")
                continue
            for key, kind in ROW_FIELDS[name].items():
                if key not in row:
                    problems.append(f"{name}.rows[{i}].{key} missing")
                elif not _check_value(kind, row[key]):
                    problems.append(f"{name}.rows[{i}].{key} = {row[key]!r} is not {kind}")
        goals = section.get("goals")
        if not isinstance(goals, list):
            problems.append(f"{name}.goals missing")
            goals = []
        for i, goal in enumerate(goals):
            ok = (isinstance(goal, dict) and isinstance(goal.get("name"), str) and _is_number(goal.get("value"))
                  and _is_number(goal.get("target")) and goal.get("op") in (">=", "<=")
                  and isinstance(goal.get("met"), bool))
            if not ok:
                problems.append(f"{name}.goals[{i}] malformed: {goal!r}")
            elif goal["met"] != (goal["value"] >= goal["target"] if goal["op"] == ">=" else
                                 goal["value"] <= goal["target"]):
                problems.append(f"{name}.goals[{i}] 'met' disagrees with its value and target")
    for key, path in (results.get("pictures") or {}).items():
        if not isinstance(path, str):
            problems.append(f"pictures.{key} is not a path")
    if problems:
        raise SchemaError("results do not match the schema:\n  " + "\n  ".join(problems))


# ----- Markdown --------------------------------------------------------------------------------------------------
def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(value, list):
        return ", ".join(_num(v, digits) for v in value)
    return str(value).replace("|", "\\|")


def _whole(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ms(values: Any) -> str:
    if isinstance(values, list):
        return ", ".join(f"{v * 1e3:.1f}" for v in values)
    return f"{values * 1e3:.1f}"


def _fixed_digits(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def _percent(value: Any) -> str:
    return f"{value:.1%}"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _col(header: str, key: str, fmt: Callable[[Any], str] = _num) -> tuple[str, Callable[[dict[str, Any]], str]]:
    return header, lambda row: fmt(row.get(key))


#: Columns of each section's table: (header, cell of a row).
COLUMNS: dict[str, list[tuple[str, Callable[[dict[str, Any]], str]]]] = {
    "pipeline_bound": [
        _col("schedule", "schedule"), _col("m", "m"), _col("rows per microbatch", "rows_per_microbatch"),
        _col("stage ms (in the pipeline)", "stage_s", _ms), _col("bound ms", "bound_s", _ms),
        _col("measured step ms", "measured_s", _ms), _col("**bound / measured**", "ratio", _fixed_digits(3)),
        _col("compute ends ms", "compute_end_s", _ms), _col("bound / compute end", "schedule_ratio", _fixed_digits(3)),
        _col("stage ms (isolated)", "isolated_stage_s", _ms),
        _col("isolated bound / measured", "isolated_ratio", _fixed_digits(3)),
        _col("bubble measured", "bubble_measured", _percent), _col("bubble predicted", "bubble_predicted", _percent)],
    "layouts": [
        _col("model", "model"), _col("layout", "layout"),
        ("processes x threads", lambda row: f"{row['processes']} x {row['threads']}"), _col("m", "m"),
        _col("partition", "partition"), _col("tokens/s", "tokens_per_s", _whole),
        _col("**x 1 process**", "ratio", _fixed_digits(2)), _col("s/step", "step_s", _fixed_digits(3)),
        _col("earlier tokens/s", "earlier_tokens_per_s", _whole)],
    "partition_regret": [
        _col("setting", "setting"), _col("split", "split"), _col("step s", "step_s", _fixed_digits(3)),
        _col("**x best split**", "ratio_to_best", _fixed_digits(3)), _col("stage ms (isolated)", "stage_s", _ms),
        _col("max / mean", "max_over_mean", _fixed_digits(3))],
    "bucketing": [
        _col("buckets", "buckets"), _col("lengths", "lengths"), _col("padded (split)", "padded_fraction", _percent),
        _col("padded (timed batches)", "batch_padded_fraction", _percent),
        _col("real tokens/s", "real_tokens_per_s", _whole), _col("**x pad to longest**", "speedup", _fixed_digits(2))],
    "memory": [
        _col("layout", "layout"), _col("rank", "rank"), _col("blocks", "blocks"), _col("parameters", "params"),
        _col("floor MiB", "floor_mib", _mib), _col("training MiB", "training_mib", _mib),
        _col("after one-file save", "file_save_mib", _mib), _col("after sharded save", "sharded_save_mib", _mib),
        _col("**training / 1 process**", "ratio", _fixed_digits(2))],
    "strategy_overhead": [
        _col("run", "run"), _col("steps/s", "steps_per_s", _fixed_digits(3)), _col("timed steps", "timed_steps")],
    "advice": [
        _col("model", "model"), _col("candidate", "candidate"), _col("measured as", "layout"),
        _col("predicted s/step", "predicted_s", _fixed_digits(3)), _col("predicted rank", "predicted_rank"),
        _col("measured s/step", "measured_s", _fixed_digits(3)), _col("measured rank", "measured_rank"),
        _col("tokens/s", "tokens_per_s", _whole)],
}


def _table(section: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    columns = COLUMNS[section]
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return lines


def _goal_lines(goals: Sequence[dict[str, Any]]) -> list[str]:
    return [f"- {g['name']}: **{g['value']:.3f}** (goal {g['op']} {g['target']:g}) — "
            f"{'met' if g['met'] else '**missed**'}" for g in goals]


def _note(section: str, rows: Sequence[dict[str, Any]]) -> str:
    """What a section's numbers say beyond its goals (empty when nothing)."""
    if section == "partition_regret":
        balanced = next(r for r in rows if r["setting"] == "balanced")
        splits = [r for r in rows if r["setting"] != "balanced"]
        fastest = min(splits, key=lambda r: r["step_s"])
        evenest = min(splits, key=lambda r: r["max_over_mean"])
        chose = (f"partition='balanced' chose the split that ran fastest ({fastest['split']}), so the step ratio "
                 "compares two runs of the same split (run-to-run noise)" if fastest["split"] == balanced["split"]
                 else f"partition='balanced' chose {balanced['split']}, the fastest run was {fastest['split']}")
        return (f"{chose}. The most even contiguous split measured max / mean {evenest['max_over_mean']:.3f} "
                f"({evenest['split']}) in its own run: whole blocks set how even a split can be.")
    if section == "bucketing":
        within = [r for r in rows if r["padded_fraction"] <= 0.10 and not r["buckets"].startswith("none")]
        if within:
            r = within[0]
            return (f"{r['buckets']} pads {r['padded_fraction']:.1%} of the tokens and runs {r['speedup']:.2f}x "
                    "pad-to-longest: on PTB's sentence lengths the 10 % padding goal needs more buckets than 5.")
    return ""


def _pays(results: dict[str, Any]) -> list[str]:
    """The 'When does pipelining pay' text, its numbers from ``results``."""
    sections = results["sections"]
    lines = ["## When does pipelining pay", ""]
    layouts = sections.get("layouts", {}).get("rows", [])
    facts, slower = [], []
    for model in dict.fromkeys(r["model"] for r in layouts):
        rows = {r["layout"]: r for r in layouts if r["model"] == model}
        pipes = [r for k, r in rows.items() if k.startswith("pp2")]
        if "1 process" in rows and pipes:
            best = max(pipes, key=lambda r: r["tokens_per_s"])
            factor = rows["1 process"]["tokens_per_s"] / best["tokens_per_s"]
            slower.append(factor)
            facts.append(f"{model} {factor:.2f}x the tokens/s of its fastest 2-stage pipeline ({best['layout']})")
    if facts:
        verdict = ("beat the fastest 2-stage pipeline with one thread per rank for every model" if min(slower) > 1
                   else "did not beat the fastest 2-stage pipeline for every model")
        lines.append(f"On this machine ({results['machine']['cores']} cores) one process using both cores {verdict}: "
                     f"{'; '.join(facts)}.")
    bound = sections.get("pipeline_bound", {}).get("rows", [])
    if bound:
        ratios = [r["ratio"] for r in bound]
        schedule = [r["schedule_ratio"] for r in bound]
        if min(ratios) >= 0.95:
            verdict = "The pipeline reaches its own bound at every setting"
        else:
            verdict = (f"The pipeline stays up to {1 - min(ratios):.0%} away from its own bound (goal: within 5 %)"
                       if min(ratios) >= 0.5 else "At these sizes the pipeline is far from its own bound: fixed "
                       "costs per step and per microbatch (communication, Python, Lightning) outweigh the compute")
        lines += ["", f"{verdict}. The bound, (m - 1) x max + sum of the stage times measured inside the same "
                  f"steps, is {min(ratios):.2f} to {max(ratios):.2f} of the measured step; up to the end of the "
                  f"schedule's last backward it is {min(schedule):.2f} to {max(schedule):.2f}, and the rest of a step "
                  "is the optimizer, the global-norm clipping across stages and Lightning's loop. What a pipeline "
                  "cannot do on one CPU is make the cores faster: two single-thread processes share the two cores "
                  "that one two-thread process uses, wait for each other in the fill and the drain, pass activations "
                  "and gradients through memory, and multiply matrices m times smaller than one process running the "
                  "whole batch."]
    memory = sections.get("memory", {}).get("rows", [])
    pp = [r for r in memory if r["layout"].startswith("pp")]
    if pp:
        deepest = max({r["layout"] for r in pp}, key=lambda name: int(name[2:]))
        largest = max(r["ratio"] for r in pp if r["layout"] == deepest)
        lines += ["", f"What a pipeline does buy is memory per process: the largest {deepest} rank peaked at "
                  f"{largest:.2f}x the one-process peak (the memory section's model)."]
    lines += ["", "Pipelining pays when the model does not fit one device's memory (each stage holds only its share "
              "of the parameters, gradients and optimizer state), and when the devices are really separate (GPUs, or "
              "machines), so that the stages compute at the same time instead of taking turns on the same cores. On "
              "one multi-core CPU with a model that fits, one process with all the cores is the layout to beat."]
    lines += ["", "No GPU was available for this run: every row is CPU (gloo). The single-GPU rows and the timeline's "
              "CUDA-event path have not been measured yet."]
    return lines


#: The timeline pictures the page shows under the pipeline section, and their captions.
PICTURES = (("pp2", "A recorded pp2 step (1F1B)"),
            ("dp2_pp2", "A recorded dp2 x pp2 step, both replicas (1F1B, 4 processes on 2 cores)"))


def render(results: dict[str, Any], page: Path | None = None) -> str:
    """The Markdown page of ``results``; picture paths are made relative to ``page``'s directory."""
    m = results["machine"]
    base = page.resolve().parent if page is not None else ROOT
    lines = ["# Results", "",
             f"Every number on this page comes from one run of `{results['command']}` "
             f"({results['mode']} mode, {results['date']}, {results['duration_s'] / 60:.1f} minutes); the page is "
             "generated from that run's JSON (`python benchmarks/run.py --render docs/results.md` rewrites it from "
             "`benchmarks/results.json` without measuring). See [Benchmarks](benchmarks.md) for the individual "
             "scripts and earlier findings. The machine was shared: the load averages below say how busy it was.",
             "",
             "| machine | |", "| --- | --- |",
             f"| CPU | {m['cpu']} |", f"| cores | {m['cores']} |", f"| torch | {m['torch']} |",
             f"| Lightning | {m['lightning']} |", f"| Python | {m['python']} |",
             f"| load average (1, 5, 15 min) before | {', '.join(f'{v:.2f}' for v in m['load_before'])} |",
             f"| load average after | {', '.join(f'{v:.2f}' for v in m['load_after'])} |", "",
             "Goals met: " + ", ".join(f"{sum(g['met'] for g in s['goals'])} of {len(s['goals'])} ({s['title']})"
                                       for s in results["sections"].values() if s["goals"]) + ".", ""]
    pictures = results.get("pictures", {})
    for name in SECTIONS:
        section = results["sections"].get(name)
        if section is None:
            continue
        lines += [f"## {section['title']}", "", section["setup"], ""]
        lines += _table(name, section["rows"])
        if name == "strategy_overhead":
            lines += [f"| **ratio strategy / bare** | **{section['ratio']:.3f}** | |"]
        lines.append("")
        if section["goals"]:
            lines += _goal_lines(section["goals"]) + [""]
        note = _note(name, section["rows"])
        if note:
            lines += [note, ""]
        if name == "pipeline_bound":
            for key, caption in PICTURES:
                if key in pictures:
                    relative = os.path.relpath(_resolve_stored(pictures[key]), base)
                    lines += [f"![{caption}]({Path(relative).as_posix()})", "", f"*{caption}.*", ""]
    lines += _pays(results)
    return "\n".join(lines).rstrip() + "\n"


# ----- command line ----------------------------------------------------------------------------------------------
def _write_page(results: dict[str, Any], page: Path) -> None:
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render(results, page))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json, results.md and the pictures (default: benchmarks/"
                             "results.json, docs/results.md, docs/_static/results/; with --quick a new temporary "
                             "directory)")
    parser.add_argument("--render", type=Path, default=None, metavar="PAGE",
                        help="only write the Markdown page PAGE from --json, measuring nothing")
    parser.add_argument("--json", type=Path, default=None, help="results to render (default benchmarks/results.json)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to measure (default all: {','.join(SECTIONS)})")
    args = parser.parse_args(argv)
    if args.render is not None:
        source = args.json or DEFAULT_JSON
        results = json.loads(source.read_text())
        try:
            validate(results, [s for s in SECTIONS if s in results.get("sections", {})])
        except SchemaError as error:
            print(f"{source}: {error}", file=sys.stderr)
            return 2
        _write_page(results, args.render)
        print(f"wrote {args.render}")
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    out = args.out
    if out is None and args.quick:
        out = Path(tempfile.mkdtemp(prefix="mp_lstm_benchmarks_"))
    json_path, page = (out / "results.json", out / "results.md") if out else (DEFAULT_JSON, DEFAULT_PAGE)
    pictures = out if out else DEFAULT_PICTURES
    sizes = QUICK if args.quick else FULL
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + (
        f" --only {','.join(only)}" if set(only) != set(SECTIONS) else "")
    started = time.perf_counter()
    info = machine()
    print(f"{command}: {info['cpu']}, {info['cores']} cores, load {info['load_before'][0]:.2f}", flush=True)
    measured = measure(sizes, pictures, only, log=lambda line: print(line, flush=True))
    info["load_after"] = list(os.getloadavg())
    results = {"schema": SCHEMA, "mode": "quick" if args.quick else "full", "command": command,
               "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
               "duration_s": time.perf_counter() - started, "machine": info, **measured}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    try:
        validate(results, only)
    except SchemaError as error:
        print(f"{json_path}: {error}", file=sys.stderr)
        return 2
    _write_page(results, page)
    for section in results["sections"].values():
        for goal in section["goals"]:
            print(f"  {'met   ' if goal['met'] else 'MISSED'} {goal['name']}: {goal['value']:.3f} "
                  f"(goal {goal['op']} {goal['target']:g})")
    print(f"wrote {json_path} and {page} in {results['duration_s']:.0f} s; load average now "
          f"{info['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
