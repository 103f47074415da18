"""The main job's own steps: how long each takes and how much of it follows the schedule.

Runs ``python train.py`` (the README's main job) with the timeline recording a window of consecutive steps, then
reads the recorded ``timeline/step_s`` and ``timeline/tail`` (the fraction of a step after its schedule's last
span) from the run's ``metrics.csv``. Two numbers come out, each against its goal:

* the median tail (optimizer step, clipping, Lightning's loop): at most 10 % of the step;
* the slowest step of the window against the median step of the same shape (the main job's buckets have
  different lengths): at most 1.5, so nothing stalls a step, reporting included.

    python benchmarks/main_job.py [--first 10] [--steps 200] [train.py overrides ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main", "measure", "summarize"]


def measure(first: int, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """Run the main job recording steps ``first .. first + steps - 1``; their recorded metrics, in step order."""
    with tempfile.TemporaryDirectory() as scratch:
        window = ",".join(str(s) for s in range(first, first + steps))
        command = [sys.executable, "train.py", f"hydra.run.dir={scratch}", f"callbacks.timeline.steps=[{window}]",
                   f"trainer.max_steps={first + steps}", "evaluate=false", *overrides]
        subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rows = []
        with open(Path(scratch) / "logs" / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row.get("timeline/step_s"):
                    rows.append({"step": int(row["step"]), "step_s": float(row["timeline/step_s"]),
                                 "tail": float(row["timeline/tail"]),
                                 "elements": float(row["timeline/batch_elements"]),
                                 "tokens_per_s": float(row["timeline/tokens_per_s"])})
    return sorted(rows, key=lambda r: r["step"])


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Medians, the slowest step against the median of its shape, and the goals of the recorded steps."""
    median = statistics.median
    by_shape: dict[float, list[float]] = {}
    for r in rows:
        by_shape.setdefault(r["elements"], []).append(r["step_s"])
    ratios = [r["step_s"] / median(by_shape[r["elements"]]) for r in rows]
    slowest = max(range(len(rows)), key=ratios.__getitem__)
    tail = median(r["tail"] for r in rows)
    return {"steps": len(rows), "shapes": len(by_shape), "median_step_s": median(r["step_s"] for r in rows),
            "median_tokens_per_s": median(r["tokens_per_s"] for r in rows), "median_tail": tail,
            "max_tail": max(r["tail"] for r in rows), "slowest_step": rows[slowest]["step"],
            "slowest_over_its_shape_median": ratios[slowest],
            "goals": {"median tail <= 0.10": tail <= 0.10,
                      "slowest step / its shape's median <= 1.5": ratios[slowest] <= 1.5}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=10, help="the first recorded step (after warm-up)")
    parser.add_argument("--steps", type=int, default=200, help="how many consecutive steps to record")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args, overrides = parser.parse_known_args(argv)
    summary = summarize(measure(args.first, args.steps, overrides))
    summary["command"] = " ".join(["python benchmarks/main_job.py", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(summary["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
