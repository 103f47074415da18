"""Each section's table of ``benchmarks/run.py``: its jobs' results reduced to rows, goals and the setup text.

Every ``section_*`` function takes ``(job, result)`` pairs of its section (rank 0's result, with the global batch's
tokens: :func:`benchmarks.jobs.merge`) and returns the section as the results JSON holds it (``title``, ``setup``,
``rows``, ``goals``; :mod:`benchmarks.schema` checks it).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import ROOT, model_config
from benchmarks.sizes import CLIP, LAYOUTS, MXNET_BUCKETS, Sizes
from benchmarks.specs import split_name

#: Tokens/s measured by hand before ``benchmarks/run.py`` existed (the layouts table's 'earlier' column).
EARLIER = ROOT / "benchmarks" / "earlier.json"


def _earlier() -> dict[str, dict[str, int]]:
    return json.loads(EARLIER.read_text())["tokens_per_s"]


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
    from lightning_mp_lstm.planning.plan import step_time

    return step_time(stage_seconds, m)


def _goal(name: str, value: float, target: float, op: str) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": float(value), "target": float(target), "op": op, "met": bool(met)}


def section_bound(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """pp2 against its own bound ``(m - 1) x max + sum`` of the stage times recorded inside the same run, and the
    hand-written pipelining loop against the same bound.

    Args:
        results: the ``pipeline_bound`` jobs and their results: a ``fit`` per schedule and m, each followed by its
            ``bare`` loop on CPU.
        s: the sizes they ran with.

    Returns:
        The section: a row per schedule and m, the goal bound / measured >= 0.95 for each.
    """
    from lightning_mp_lstm.timeline import COMPUTE, StepRecord, predicted_bubble

    bare = {(job["schedule"], job["m"]): result for job, result in results if job["kind"] == "bare"}
    rows, goals = [], []
    for job, result in ((j, r) for j, r in results if j["kind"] == "fit"):
        m = result["m"]
        records = sorted((StepRecord.from_dict(r) for r in result["records"]), key=lambda r: r.step)
        recorded = _intervals(result, [r.step for r in records])
        # The step after each recorded one: the same shapes, and no recording's clock-aligning barrier at its start
        # or gathering of every rank's spans at its end (about 5 ms a step at these sizes).
        intervals = _intervals(result, [r.step + 1 for r in records])
        inside = [_stage_seconds_in_step(r) for r in records]
        bounds = [_bound(t, m) for t in inside]
        isolated = result["stage_seconds"]
        measured = statistics.median(intervals)
        # When the step's last forward or backward ended: what the schedule took, without the optimizer after it.
        compute_end = [max(span.end for span in r.spans if span.kind in COMPUTE) for r in records]
        row = {"schedule": job["schedule"], "m": m, "rows_per_microbatch": s.bound_rows // m,
               "stage_s": [statistics.median(t) for t in zip(*inside)], "bound_s": statistics.median(bounds),
               "measured_s": measured, "ratio": statistics.median(b / t for b, t in zip(bounds, intervals)),
               "recorded_s": statistics.median(recorded),
               "compute_end_s": statistics.median(compute_end),
               "schedule_ratio": statistics.median(b / t for b, t in zip(bounds, compute_end)),
               "isolated_stage_s": isolated, "isolated_bound_s": _bound(isolated, m),
               "bubble_measured": statistics.median(r.bubble() for r in records),
               "bubble_predicted": predicted_bubble(job["schedule"], 2, 1, m), "bare_step_s": None,
               "bare_ratio": None}
        row["isolated_ratio"] = row["isolated_bound_s"] / measured
        loop = bare.get((job["schedule"], m))
        if loop is not None:
            timed = loop["intervals"][s.bound_warmup + 1:]
            row["bare_step_s"] = statistics.median(timed)
            row["bare_ratio"] = row["bound_s"] / row["bare_step_s"]
        rows.append(row)
        goals.append(_goal(f"{job['schedule']}, m={m}: bound / measured step", row["ratio"], 0.95, ">="))
    model = s.bound_model
    return {
        "title": "Pipeline against its own bound",
        "setup": (f"pp2 (2 processes x 1 thread), even partition, {model['num_layers']} x LSTM {model['hidden_size']}"
                  f", embedding {model['embedding_dim']}, vocabulary {model['vocab_size']:,}, random batches of "
                  f"{s.bound_rows} x {s.bound_length}, SGD. After {s.bound_warmup} warm-up steps one step times each "
                  f"stage on its own rank in isolation (profile.stage_seconds), then {2 * s.bound_steps} timed steps "
                  f"of which PipelineTimeline records every other one ({s.bound_steps}): a stage's time is the sum of "
                  "its forward, loss (the last stage's) and backward spans in a recorded step over m (one microbatch), "
                  "the step's bound is (m - 1) x max + sum of those (plan.step_time), the measured step is the "
                  "interval from the start of the step after it (same shapes, not recorded) to the next step's start "
                  "(optimizer, clipping and Lightning included). Bound / measured: the median over the pairs of each "
                  "pair's ratio; the other columns are medians too. 'Recorded step' is the interval of the recorded "
                  "steps themselves: the recording's barrier and gathering of spans included. 'Compute ends' is when "
                  "a recorded step's last forward or backward ended (the schedule's part of the step, before the "
                  "optimizer), and bound / compute end the ratio without what follows the schedule. 'Bare loop' "
                  "(CPU only): benchmarks/overhead.py's hand-written torch.distributed.pipelining loop (no Lightning, "
                  "no clipping, no checks) on the same model, batch, split, schedule and m, run right after, as many "
                  "steps; its median step after the same warm-up, and the same bound over it."),
        "rows": rows, "goals": goals,
    }


def _median_by(values: dict[Any, list[float]]) -> dict[Any, float]:
    return {k: statistics.median(v) for k, v in values.items()}


def section_layouts(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """Tokens/s of every model on every layout, and their ratio to 1 process in the same round.

    Args:
        results: the ``layouts`` jobs and their results (every round).
        s: the sizes they ran with.

    Returns:
        The section: a row per model and layout (medians over the rounds), beside the earlier hand-made numbers
        (:data:`EARLIER`); no goals.
    """
    earlier = _earlier()
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
                     "m": m, "partition": split_name(partition), "tokens_per_s": statistics.median(rates),
                     "step_s": statistics.median(step[(model, layout)]), "ratio": statistics.median(ratios),
                     "earlier_tokens_per_s": earlier.get(model, {}).get(layout)})
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


def section_regret(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """Every contiguous 2-stage split against ``partition='balanced'``.

    Args:
        results: the ``partition_regret`` jobs and their results (every round).
        s: the sizes they ran with.

    Returns:
        The section: a row per setting; goals: balanced within 5 % of the best split's step, and its stage times
        within 10 % of even (max / mean).
    """
    intervals: dict[str, list[float]] = {}
    stages: dict[str, list[list[float]]] = {}
    split_of: dict[str, str] = {}
    timed = range(s.regret_warmup + 1, s.regret_warmup + 1 + s.regret_steps)
    for job, result in results:
        name = job["setting"]
        intervals.setdefault(name, []).extend(_intervals(result, timed))
        stages.setdefault(name, []).append(result["stage_seconds"])
        split_of[name] = split_name(result["partition"])
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
                  f"embedding {model['embedding_dim']}, vocabulary {model['vocab_size']:,}, random batches of "
                  f"{s.regret_rows} x {s.regret_length}; every contiguous 2-stage split and partition='balanced' "
                  f"(by measured time), each once per round, {s.regret_rounds} round(s); step: median interval over "
                  f"{s.regret_steps} timed steps per run after {s.regret_warmup} warm-up; stage times: forward + "
                  "backward of one microbatch on its own rank (isolated), median of the rounds."),
        "rows": rows,
        "goals": [_goal("balanced step / best split's step", balanced["ratio_to_best"], 1.05, "<="),
                  _goal("balanced max / mean stage time", balanced["max_over_mean"], 1.10, "<=")],
    }


def section_bucketing(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """Real tokens/s and padded fraction of each bucket setting against padding to the longest sentence.

    Args:
        results: the ``bucketing`` jobs and their results; the MXNet and the first ``auto`` setting come first.
        s: the sizes they ran with.

    Returns:
        The section: a row per setting; goals for the first two: 1.5x pad-to-longest, at most 10 % padding.
    """
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
    config = model_config(s.bucket_model, s.bucket_overrides)
    return {
        "title": "Bucketing",
        "setup": (f"1 process x 1 thread, model {s.bucket_model} ({config['num_layers']} x {config['hidden_size']}), "
                  f"PTB (train on ptb.valid.txt), batch {s.layout_batch} sentences; padded fraction: of the whole "
                  f"training split (and of the timed batches); real tokens/s over {s.bucket_steps} steps after "
                  f"{s.bucket_warmup} warm-up."),
        "rows": rows, "goals": goals,
    }


def section_memory(results: dict[str, list[dict[str, Any]]], s: Sizes) -> dict[str, Any]:
    """Peak memory of every rank of every layout against one process.

    Args:
        results: every layout's per-rank peaks (``benchmarks/memory.py``'s :func:`measure`).
        s: the sizes they ran with.

    Returns:
        The section: a row per layout and rank; goals: the largest pp4 rank at most 0.6x one process (with pp4),
        rank 0 at most 1.15x the largest other rank.
    """
    single = results["1 process"][0]["training"]
    floor = results["1 process"][0]["floor"]
    rows = []
    for layout, ranks in results.items():
        for rank, r in enumerate(ranks):
            blocks = r["blocks"]
            rows.append({"layout": layout, "rank": rank,
                         "blocks": ", ".join(blocks) if len(blocks) < 4 else f"{blocks[0]} .. {blocks[-1]}",
                         "params": int(r["params"]), "floor_mib": r["floor"], "training_mib": r["training"],
                         "predicted_mib": r.get("predicted"),
                         "file_save_mib": r["file"]["saving"] if "file" in r else None,
                         "sharded_save_mib": r["sharded"]["saving"] if "sharded" in r else None,
                         "ratio": r["training"] / single})
    goals = []
    if "pp4" in results:
        pp4 = [r["training"] for r in results["pp4"]]
        goals.append(_goal("pp4: largest rank / 1 process (training)", max(pp4) / single, 0.40, "<="))
        goals.append(_goal("pp4: largest rank / 1 process, each beyond the floor of imports and data",
                           (max(pp4) - floor) / (single - floor), 0.40, "<="))
    pipelined = "pp4" if "pp4" in results else "pp2"
    ranks = [r["training"] for r in results[pipelined]]
    goals.append(_goal(f"{pipelined}: rank 0 / largest other rank (training)", ranks[0] / max(ranks[1:]), 1.15, "<="))
    errors = [abs(r["predicted"] / r["training"] - 1) for ranks in results.values() for r in ranks
              if r.get("predicted")]
    if errors:
        goals.append(_goal("memory plan: largest |predicted / measured - 1| of any rank", max(errors), 0.20, "<="))
    return {
        "title": "Memory per rank",
        "setup": (f"benchmarks/memory.py: peak RSS (MiB) per rank, mxnet_ptb shape (8 layers, embedding 200) with "
                  f"hidden {s.memory_hidden}, PTB batch {s.memory_rows}, {s.memory_steps} steps, Adam, GPipe with m = "
                  f"the number of ranks, partition balanced by memory, one thread per rank; floor: after imports and "
                  f"data; predicted: the strategy's memory plan (MPLSTMStrategy.memory); then a checkpoint "
                  f"save ({', '.join(s.memory_formats)}; "
                  + ("the first job of the other sections' fresh processes)." if s.memory_inline else
                     "each format in fresh processes).")),
        "rows": rows, "goals": goals,
    }


def section_overhead(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """Tokens/s of ``MPLSTMStrategy`` in ``Trainer.fit`` against a bare pipelining loop, per layout and schedule,
    with every rank's time outside the schedule.

    Args:
        results: every comparison's job and merged result (``benchmarks/overhead.py``'s :func:`compare`).
        s: the sizes they ran with.

    Returns:
        The section: a row per layout and schedule; the goal strategy / bare >= ``overhead.GOAL`` for each.
    """
    from benchmarks.overhead import GOAL, Setup, summarize

    rows, goals = [], []
    for job, result in results:
        setup, summary = Setup(**job["setup"]), summarize(result)
        outside = "; ".join(
            f"r{rank} {1e3 * bare:.1f} / {1e3 * (mine['before'] + mine['after']):.1f} "
            f"({1e3 * mine['before']:.1f} + {1e3 * mine['after']:.1f})"
            for rank, (bare, mine) in enumerate(result["outside"]))
        rows.append({"layout": setup.layout, "schedule": setup.schedule,
                     "bare_tokens_per_s": summary["bare_tokens_per_s"],
                     "strategy_tokens_per_s": summary["strategy_tokens_per_s"], "ratio": summary["ratio"],
                     "round_ratios": ", ".join(f"{r:.3f}" for r in summary["round_ratios"]),
                     "pooled_ratio": summary["pooled_ratio"], "outside_ms": outside,
                     "timed_steps": len(result["strategy"])})
        goals.append(_goal(f"{setup.layout} {setup.schedule}: mp_lstm / bare tokens per second", summary["ratio"],
                           GOAL, ">="))
    setup = Setup(**results[0][0]["setup"])
    return {
        "title": "Strategy overhead",
        "setup": (f"benchmarks/overhead.py: {setup.num_layers} x LSTM {setup.hidden_size}, vocabulary "
                  f"{setup.vocab_size:,}, global batch {setup.rows} x {setup.length}, even partition, "
                  f"{setup.microbatches} microbatches per replica, 1 thread per rank; {s.overhead_rounds} interleaved "
                  f"round(s) of {s.overhead_steps} steps of each (bare first in even rounds, mp_lstm first in odd "
                  f"ones), the first {s.overhead_warmup} of each dropped; "
                  "tokens/s = global tokens per step / median interval of all rounds' steps; mp_lstm / bare (the "
                  "goal's): the median over rounds of each round's ratio (a round's two runs are neighbours in time), "
                  "every round's beside it, and the ratio of the pooled tokens/s. Outside the schedule, per rank: "
                  "bare / mp_lstm ms per step (mp_lstm's before its first span + after its last, from the timeline "
                  "of a separate recorded run)."),
        "rows": rows,
        "goals": goals,
    }


#: advice candidates (data parallel, pipeline parallel) -> the measured layout they stand for
_ADVICE_TO_LAYOUT = {(1, 1): "1 process", (2, 1): "dp2", (1, 2): "pp2 balanced, m=auto"}


def section_advice(results: list[tuple[dict, dict]], layouts: dict[str, Any]) -> dict[str, Any]:
    """``lightning_mp_lstm.planning.advice``'s predicted order of layouts against the measured one.

    Args:
        results: the ``advice`` jobs and their results (one per model).
        layouts: the layouts section (:func:`section_layouts`), whose measured rows the candidates stand for.

    Returns:
        The section: a row per model and candidate with both ranks; for each model the goal: the measured best
        at most 1.10x the measured speed of the predicted best.
    """
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
            e["predicted_over_measured"] = e["predicted_s"] / e["measured_s"]
        worst = max(entries, key=lambda e: abs(e["predicted_over_measured"] - 1))
        goals.append(_goal(f"{model}: the worst prediction's error ({worst['candidate']})",
                           abs(worst["predicted_over_measured"] - 1), 0.25, "<="))
        rows.extend(sorted(entries, key=lambda e: e["predicted_rank"]))
        value = by_measured[0]["tokens_per_s"] / by_predicted[0]["tokens_per_s"]
        predicted = by_predicted[0]["layout"]
        goals.append(_goal(f"{model}: measured best / measured speed of the predicted best ({predicted})", value,
                           1.10, "<="))
    return {
        "title": "Layout advice: predicted against measured",
        "setup": ("lightning_mp_lstm.planning.advice: calibrate (thread speed-up at 2 threads, transfer bandwidth) "
                  "and advise for 2 processes on 2 cores, 1F1B, the layouts section's batch and mean padded length, "
                  "in one process before the layouts run; predicted seconds per step against the layouts section's "
                  "measured mean seconds per step (its batches vary in length: compare the order). The pipeline "
                  "candidate (balanced, best predicted m) stands against the measured 'pp2 balanced, m=auto'."),
        "rows": rows, "goals": goals,
    }


def _wavefront_row(job: dict[str, Any], result: dict[str, Any], s: Sizes) -> dict[str, Any]:
    """One run of the wavefront section: its step, tokens/s, bound (pipelines) and every rank's peak memory."""
    from lightning_mp_lstm.planning.plan import step_time
    from lightning_mp_lstm.timeline import COMPUTE, StepRecord, predicted_bubble

    timed = range(job["warmup"], job["warmup"] + s.wave_steps)
    intervals = _intervals(result, timed)
    step = statistics.median(intervals)
    tokens = statistics.median(result["tokens"][i] for i in timed)
    schedule = job["strategy"].get("schedule", "-") if job["pp"] > 1 else "-"
    m, k = result["m"], result["time_chunks"]
    row = {"variant": job["variant"], "processes": job["pp"], "schedule": schedule, "m": m, "k": k, "units": m * k,
           "step_s": step, "tokens_per_s": tokens / step, "bound_s": None, "ratio": None, "bubble_measured": None,
           "bubble_predicted": None, "peak_mib": result["peak_mib"], "floor_mib": result["floor_mib"]}
    if result["records"]:
        records = sorted((StepRecord.from_dict(r) for r in result["records"]), key=lambda r: r.step)
        spans = _intervals(result, [r.step for r in records])
        bounds = []
        for record in records:
            busy = {stage: 0.0 for stage in range(record.num_stages)}
            for span in record.spans:
                if span.kind in COMPUTE:
                    busy[span.stage] += span.end - span.start
            bounds.append(step_time([busy[stage] / (m * k) for stage in sorted(busy)], m * k))
        row.update(bound_s=statistics.median(bounds),
                   ratio=statistics.median(b / t for b, t in zip(bounds, spans)),
                   bubble_measured=statistics.median(r.bubble() for r in records),
                   bubble_predicted=predicted_bubble(schedule, job["pp"], 1, m * k))
    return row


def section_wavefront(results: list[tuple[dict, dict]], s: Sizes) -> dict[str, Any]:
    """Time chunks against row microbatches: one process, GPipe (batch split) at every m, the wavefront at every k
    and rows x chunks, one model and global batch, each in fresh processes.

    Args:
        results: the ``wavefront`` jobs and their results (with every rank's peak memory).
        s: the sizes they ran with.

    Returns:
        The section: a row per run (ratios to one process and, for memory, to the same depth's fastest GPipe);
        goals per pipeline depth: the fastest wavefront (rows whole) at least the fastest GPipe's tokens/s, its
        bound / measured step >= 0.9, its largest rank's peak memory at most that GPipe's.
    """
    rows = [_wavefront_row(job, result, s) for job, result in results]
    single = next(r for r in rows if r["processes"] == 1)
    goals = []
    for row in rows:
        row["x_one_process"] = row["tokens_per_s"] / single["tokens_per_s"]
    for pp in sorted({r["processes"] for r in rows if r["processes"] > 1}):
        gpipe = max((r for r in rows if r["processes"] == pp and r["schedule"] == "GPipe"),
                    key=lambda r: r["tokens_per_s"])
        wave = max((r for r in rows if r["processes"] == pp and r["schedule"] == "Wavefront" and r["m"] == 1),
                   key=lambda r: r["tokens_per_s"])
        for row in rows:
            if row["processes"] == pp:
                row["peak_over_gpipe"] = max(row["peak_mib"]) / max(gpipe["peak_mib"])
        goals += [
            _goal(f"pp{pp}: wavefront (best k={wave['k']}) / GPipe (best m={gpipe['m']}) tokens/s",
                  wave["tokens_per_s"] / gpipe["tokens_per_s"], 1.0, ">="),
            _goal(f"pp{pp} wavefront k={wave['k']}: bound / measured step", wave["ratio"], 0.9, ">="),
            _goal(f"pp{pp} wavefront k={wave['k']}: largest rank's peak memory / GPipe m={gpipe['m']}'s",
                  wave["peak_over_gpipe"], 1.0, "<=")]
    single["peak_over_gpipe"] = None
    model = s.wave_model
    mxnet = " (mxnet_ptb's depth and embedding)" if (model["num_layers"], model["embedding_dim"]) == (8, 200) else ""
    skipped = "" if 4 in s.wave_runs else (
        " pp4 is not run: 4 single-thread processes on this machine's 2 cores take turns on them, so its step "
        "times would measure the oversubscription, not the schedule.")
    return {
        "title": "Wavefront: time chunks against row microbatches",
        "setup": (f"{model['num_layers']} x LSTM {model['hidden_size']}, embedding {model['embedding_dim']}, "
                  f"vocabulary {model['vocab_size']:,}{mxnet}, random batches of {s.wave_rows} x "
                  f"{s.wave_length}, even partition, SGD, gradient clipping {CLIP}; the same global batch for every "
                  "run. 1 process runs 2 threads, a pipeline 1 thread per process; GPipe splits the rows into m "
                  "microbatches, the wavefront (schedule='Wavefront') the time axis into k chunks (m x k: both). "
                  + ("Each run in fresh processes: " if s.wave_fresh else "")
                  + f"{s.wave_warmup} warm-up steps, then {s.wave_steps} timed steps recorded by "
                  "PipelineTimeline; step: the median interval from a step's start to the next one's; bound: (units "
                  "- 1) x max + sum of the stages' forward + backward time per unit inside the same step, units = m x "
                  "k; bound / measured: the median of each step's ratio. Peak memory: each rank's peak RSS after "
                  "training (MiB; the floor after imports and data is in the JSON); peak / GPipe: the largest rank's "
                  "against the fastest GPipe of the same depth"
                  + (". " if s.wave_fresh else " (quick mode: the runs share their processes, so a peak is the "
                     "largest so far, not the run's own). ") + skipped.strip()).strip(),
        "rows": rows, "goals": goals,
    }
