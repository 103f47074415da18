"""The results JSON's schema: what ``benchmarks/run.py`` writes and ``--render`` accepts (:func:`validate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SCHEMA = "lightning_mp_lstm.benchmarks/1"
#: The sections of a result, in page order.
SECTIONS = ("pipeline_bound", "layouts", "partition_regret", "bucketing", "memory", "strategy_overhead", "advice",
            "wavefront")
#: Sections a script of their own measures and adds to the results (``benchmarks/wt103.py --results``): rendered
#: after :data:`SECTIONS` when present, never measured by ``benchmarks/run.py``.
OPTIONAL_SECTIONS = ("wikitext103", "autopilot")


class SchemaError(ValueError):
    """The results do not have the shape :func:`validate` expects."""


#: Field types of a row of each section: ``str``, ``int``, ``num`` (finite), ``pos`` (finite, > 0), ``frac``
#: (in [0, 1]), ``list[pos]``, ``list[int]``, ``bool``; a trailing ``?`` allows ``null``.
ROW_FIELDS: dict[str, dict[str, str]] = {
    "pipeline_bound": {"schedule": "str", "m": "int", "rows_per_microbatch": "int", "stage_s": "list[pos]",
                       "bound_s": "pos", "isolated_stage_s": "list[pos]", "isolated_bound_s": "pos",
                       "measured_s": "pos", "ratio": "pos", "recorded_s": "pos", "compute_end_s": "pos",
                       "schedule_ratio": "pos", "isolated_ratio": "pos", "bubble_measured": "num",
                       "bubble_predicted": "frac", "bare_step_s": "pos?", "bare_ratio": "pos?"},
    "layouts": {"model": "str", "layout": "str", "processes": "int", "threads": "int", "m": "int",
                "partition": "str", "tokens_per_s": "pos", "step_s": "pos", "ratio": "pos",
                "earlier_tokens_per_s": "pos?"},
    "partition_regret": {"setting": "str", "split": "str", "step_s": "pos", "stage_s": "list[pos]",
                         "max_over_mean": "pos", "ratio_to_best": "pos"},
    "bucketing": {"buckets": "str", "lengths": "list[int]", "real_tokens_per_s": "pos", "step_s": "pos",
                  "padded_fraction": "frac", "batch_padded_fraction": "frac", "speedup": "pos"},
    "memory": {"layout": "str", "rank": "int", "blocks": "str", "params": "int", "floor_mib": "num",
               "training_mib": "pos", "predicted_mib": "pos?", "file_save_mib": "pos?", "sharded_save_mib": "pos?",
               "ratio": "pos"},
    "strategy_overhead": {"layout": "str", "schedule": "str", "bare_tokens_per_s": "pos",
                          "strategy_tokens_per_s": "pos", "ratio": "pos", "round_ratios": "str",
                          "pooled_ratio": "pos", "outside_ms": "str", "timed_steps": "int"},
    "advice": {"model": "str", "candidate": "str", "layout": "str", "predicted_s": "pos", "measured_s": "pos",
               "tokens_per_s": "pos", "predicted_rank": "int", "measured_rank": "int",
               "predicted_over_measured": "pos?"},
    "autopilot": {"job": "str", "candidate": "str", "processes": "int", "fits": "bool", "peak_mib": "pos?",
                  "predicted_s": "pos", "predicted_rank": "int", "measured_s": "pos?",
                  "predicted_over_measured": "pos?"},
    "wikitext103": {"run": "str", "command": "str", "exit": "int", "seconds": "pos", "anon_mib": "list[pos]",
                    "hwm_mib": "list[pos]", "predicted_mib": "list[pos]?", "step_s": "pos?"},
    "wavefront": {"variant": "str", "processes": "int", "schedule": "str", "m": "int", "k": "int", "units": "int",
                  "step_s": "pos", "tokens_per_s": "pos", "x_one_process": "pos", "bound_s": "pos?", "ratio": "pos?",
                  "bubble_measured": "num?", "bubble_predicted": "frac?", "peak_mib": "list[pos]",
                  "floor_mib": "list[pos]", "peak_over_gpipe": "pos?"},
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

    Args:
        results: the results, as ``benchmarks/run.py`` writes them in JSON.
        sections: the sections that must be there (others may be, if known).

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
    unknown = set(found) - set(SECTIONS) - set(OPTIONAL_SECTIONS)
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
