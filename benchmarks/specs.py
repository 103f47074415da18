"""The jobs each section of ``benchmarks/run.py`` runs, from its :class:`~benchmarks.sizes.Sizes`.

Every job names its ``section``; :mod:`benchmarks.jobs` runs it on the ranks and :mod:`benchmarks.sections` reduces
the results of a section's jobs to its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import model_config
from benchmarks.sizes import LAYOUTS, MXNET_BUCKETS, Sizes, strategy_options


def split_name(partition: Sequence[Sequence[str]]) -> str:
    """A partition as the tables show it, e.g. ``embedding..lstm.1 | lstm.2..decoder``."""
    return " | ".join(stage[0] if len(stage) == 1 else f"{stage[0]}..{stage[-1]}" for stage in partition)


def _fixed(model: dict[str, int], rows: int, length: int, batches: int) -> dict[str, Any]:
    return {"kind": "fixed", "vocab_size": model["vocab_size"], "rows": rows, "length": length, "batches": batches}


def _lstm(model: dict[str, int]) -> dict[str, Any]:
    """``LSTMLanguageModel`` keyword arguments after the vocabulary size (which the data gives)."""
    return {k: v for k, v in model.items() if k != "vocab_size"} | {"optimizer": "sgd", "lr": 0.1}


def _ptb(batch: int, buckets: Any = MXNET_BUCKETS, num_buckets: int | None = None) -> dict[str, Any]:
    return {"kind": "ptb", "buckets": buckets, "num_buckets": num_buckets, "batch_size": batch}


def bound_jobs(s: Sizes, picture: Path | None, bare: bool = True) -> list[dict[str, Any]]:
    """pp2 at every schedule and m: warm-up, one step that times every stage on its rank, then timed steps of which
    the timeline records every other one (the bound: the stage times inside a recorded step; the measured step: the
    step after it, which no recording slows), and one more step (so the last timed step ends where the next one
    starts). With ``bare`` each is followed by the hand-written pipelining loop of ``benchmarks/overhead.py`` on the
    same model, batch, split, schedule and m, for as many steps (a CPU loop: not on CUDA)."""
    first = s.bound_warmup + 1
    batches = first + 2 * s.bound_steps + 1
    pictured = s.bound_m[len(s.bound_m) // 2]
    out: list[dict[str, Any]] = []
    for schedule in ("GPipe", "1F1B"):
        for m in s.bound_m:
            out.append({"kind": "fit", "section": "pipeline_bound", "schedule": schedule,
                        "data": _fixed(s.bound_model, s.bound_rows, s.bound_length, batches),
                        "model": _lstm(s.bound_model),
                        "strategy": strategy_options(pp=2, schedule=schedule, n_microbatches=m), "batches": batches,
                        "measure_step": s.bound_warmup, "timeline": list(range(first, first + 2 * s.bound_steps, 2)),
                        "picture": str(picture) if picture is not None and schedule == "1F1B" and m == pictured
                        else None})
            if bare:
                out.append({"kind": "bare", "section": "pipeline_bound", "schedule": schedule, "m": m,
                            "steps": batches,
                            "setup": {**s.bound_model, "rows": s.bound_rows, "length": s.bound_length,
                                      "microbatches": m, "schedule": schedule, "layout": "pp2"}})
    return out


def dp2_pp2_job(s: Sizes, picture: Path | None) -> dict[str, Any]:
    """dp2 x pp2 with the bound's model and global batch, as many rows per microbatch as pp2 at the middle m."""
    batches = s.bound_warmup + 2
    m = max(2, s.bound_m[len(s.bound_m) // 2] // 2)
    return {"kind": "fit", "section": "picture", "data": _fixed(s.bound_model, s.bound_rows, s.bound_length, batches),
            "model": _lstm(s.bound_model),
            "strategy": strategy_options(dp=2, pp=2, schedule="1F1B", n_microbatches=m),
            "batches": batches, "timeline": [batches - 1], "picture": str(picture) if picture else None}


def wavefront_jobs(s: Sizes, picture: Path | None) -> list[tuple[int, dict[str, Any]]]:
    """One process, then per pipeline depth GPipe at every m, the wavefront at every k and every rows x chunks
    pair, with their number of processes; each runs in fresh processes (its peak memory is its own). Pipelines
    record their timed steps (the bound) and the wavefront of depth 2 at ``wave_picture_k`` draws its last one."""
    first = s.wave_warmup
    batches = first + s.wave_steps + 1  # one more step: the last timed step ends where the next one starts
    data, model = _fixed(s.wave_model, s.wave_rows, s.wave_length, batches), _lstm(s.wave_model)

    def job(variant: str, pp: int, strategy: dict[str, Any], draw: bool = False) -> dict[str, Any]:
        return {"kind": "fit", "section": "wavefront", "variant": variant, "pp": pp, "data": data, "model": model,
                "strategy": strategy, "batches": batches, "warmup": first, "memory": True,
                "timeline": list(range(first, first + s.wave_steps)) if pp > 1 else None,
                "picture": str(picture) if draw and picture is not None else None}

    out = [(1, job("1 process", 1, strategy_options(threads=2)))]
    for pp, runs in s.wave_runs.items():
        out += [(pp, job(f"pp{pp} GPipe, m={m}", pp, strategy_options(pp=pp, schedule="GPipe", n_microbatches=m)))
                for m in runs["m"]]
        out += [(pp, job(f"pp{pp} wavefront, k={k}", pp, strategy_options(pp=pp, schedule="Wavefront",
                                                                          n_microbatches=1, time_chunks=k),
                         draw=pp == 2 and k == s.wave_picture_k)) for k in runs["k"]]
        out += [(pp, job(f"pp{pp} wavefront, m={m} x k={k}", pp, strategy_options(
            pp=pp, schedule="Wavefront", n_microbatches=m, time_chunks=k))) for m, k in runs["mk"]]
    return out


def layout_jobs(s: Sizes, round_: int) -> dict[int, list[dict[str, Any]]]:
    """One round of every model on every layout, grouped by the number of processes."""
    jobs: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    for model, overrides in s.layout_models.items():
        config = model_config(model, overrides)
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


def regret_jobs(s: Sizes) -> list[dict[str, Any]]:
    """Every contiguous 2-stage split and the balanced one, each once per round (rounds one after another)."""
    from lightning_mp_lstm.models.lstm_language_model import block_names

    batches = s.regret_warmup + 1 + s.regret_steps
    settings = [("balanced", "balanced")] + [(split_name(p), p) for p in
                                            _two_stage_splits(block_names(s.regret_model["num_layers"]))]
    return [{"kind": "fit", "section": "partition_regret", "setting": name, "round": r,
             "data": _fixed(s.regret_model, s.regret_rows, s.regret_length, batches), "model": _lstm(s.regret_model),
             "strategy": strategy_options(pp=2, schedule="1F1B", n_microbatches=s.regret_m, partition=partition,
                                          balance_by="time"),
             "batches": batches, "measure_step": s.regret_warmup}
            for r in range(s.regret_rounds) for name, partition in settings]


def bucket_jobs(s: Sizes) -> list[dict[str, Any]]:
    """One process on PTB with the MXNet buckets, ``auto`` buckets of each count, and no buckets."""
    config = model_config(s.bucket_model, s.bucket_overrides)
    settings = [("mxnet", _ptb(s.layout_batch))]
    settings += [(f"auto ({k} buckets)", _ptb(s.layout_batch, "auto", k)) for k in s.bucket_auto]
    settings += [("none (pad to longest)", _ptb(s.layout_batch, None))]
    return [{"kind": "fit", "section": "bucketing", "buckets": name, "data": data, "model": config,
             "strategy": strategy_options(), "batches": s.bucket_warmup + s.bucket_steps,
             "warmup": s.bucket_warmup, "padding": True} for name, data in settings]


def advice_jobs(s: Sizes) -> list[dict[str, Any]]:
    """The advice for 2 processes on 2 cores for every model of the layouts section, with its batch."""
    return [{"kind": "advice", "section": "advice", "model_name": model, "data": _ptb(s.layout_batch),
             "model": model_config(model, overrides), "rows": s.layout_batch, "devices": 2, "cores": 2,
             "max_microbatches": s.advice_max_microbatches}
            for model, overrides in s.layout_models.items()]


def overhead_jobs(s: Sizes) -> list[tuple[int, dict[str, Any]]]:
    """The strategy-overhead comparisons (``benchmarks/overhead.py``), one per layout and schedule, with their
    number of processes."""
    from benchmarks.overhead import LAYOUTS

    return [(2 * LAYOUTS[layout], {"kind": "overhead", "section": "strategy_overhead",
                                   "setup": {**s.overhead, "layout": layout, "schedule": schedule},
                                   "steps": s.overhead_steps, "warmup": s.overhead_warmup, "rounds": s.overhead_rounds})
            for layout in s.overhead_layouts for schedule in s.overhead_schedules]


def memory_jobs(s: Sizes) -> list[tuple[int, dict[str, Any]]]:
    """The memory measurement of every layout with its number of processes (it must run first in them)."""
    args = {"hidden_size": s.memory_hidden, "rows": s.memory_rows, "steps": s.memory_steps}
    return [(world, {"kind": "memory", "section": "memory", "layout": layout, "args": args})
            for layout, world in s.memory_layouts.items()]
