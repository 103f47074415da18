"""The main job's own steps: how long each takes and how much of it follows the schedule.

Runs ``python train.py`` (the README's main job) with the timeline recording a window of consecutive steps, then
reads the recorded ``timeline/step_s`` and ``timeline/tail`` (the fraction of a step after its schedule's last
span) from the run's ``metrics.csv``. Two numbers come out, each against its goal:

* the median tail (optimizer step, clipping, Lightning's loop): at most 10 % of the step;
* the slowest step of the window against the median step of the same shape (the main job's buckets have
  different lengths): at most 1.5, so nothing stalls a step, reporting included. A shape's first step of the run
  builds its stages and schedule (MXNet's executor per bucket) and is warm-up: it is reported apart
  (``first_of_shape``), not counted, and the steps before the window are recorded only to know which those are.

Beside them, what the machine alone does to a step (``bare_loop``), in the layout the main job ran (``python
train.py`` runs what ``layout=auto`` picks: one process on the 2-core box): the bare ``torch.distributed.pipelining``
loop of ``benchmarks/overhead.py`` for a 2-stage pipeline, or for one process a plain loop of the whole model
(:func:`single_loop`; its "schedule" is the forward and backward pass), with no Lightning, no reporting and no checks,
on the main job's model sizes, schedule and most common batch shape, as many steps, in the same invocation. Its
slowest step over its median is the noise floor of the stall check on this machine; its time outside
``schedule.step`` is the floor of the tail: it does what the main job does after its schedule and nothing else (the
clip by the global gradient norm, 0.25, and a fused Adam step). A third goal: the main job's median tail at most 5
points above the floor's (issue 44), over the main job's steps of the floor's shape (:func:`against_floor`).

Where the job ran one process, how much of its excess over the floor is Lightning's own: :func:`three_loops` times
the step outside its forward and backward pass three ways on the floor's model and batches, in rounds: the bare
loop, the module's own ``training_step`` under a plain ``Trainer`` (what any Lightning user's step costs), and the
same under ``mp_lstm``.

    python benchmarks/main_job.py [--first 10] [--steps 200] [--no-bare-loop] [train.py overrides ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402

from benchmarks.overhead import Setup, bare_loop, batches, model_of, optimizer_of, start_rank  # noqa: E402
from benchmarks.step_parts import timed  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum  # noqa: E402

__all__ = ["BARE_SETUP", "LOOPS", "against_floor", "bare_floor", "lightning_loop", "main", "measure", "ran_layout",
           "single_loop", "summarize", "three_loops"]

#: The main job's model (conf/model/tiny.yaml, the synthetic data's 1000 words), batch size, schedule, most common
#: batch length (20 tokens: the middle bucket), optimizer (Adam, lr 0.005) and clip (conf/trainer: 0.25), for the
#: bare loop.
BARE_SETUP = Setup(vocab_size=1000, embedding_dim=128, hidden_size=128, num_layers=2, rows=32, length=20,
                   microbatches=4, schedule="1F1B", optimizer="adam", lr=0.005, clip=0.25)


def measure(first: int, steps: int, overrides: list[str], printed: list[str] | None = None) -> list[dict[str, float]]:
    """Run the main job recording steps ``0 .. first + steps - 1``; their recorded metrics, in step order. What the
    run printed is echoed, and kept in ``printed`` when one is given."""
    with tempfile.TemporaryDirectory() as scratch:
        window = ",".join(str(s) for s in range(first + steps))
        command = [sys.executable, "train.py", f"hydra.run.dir={scratch}", f"callbacks.timeline.steps=[{window}]",
                   f"trainer.max_steps={first + steps}", "evaluate=false", *overrides]
        with subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as run:
            assert run.stdout is not None
            for line in run.stdout:
                print(line, end="", flush=True)
                if printed is not None:
                    printed.append(line)
        if run.returncode:
            raise subprocess.CalledProcessError(run.returncode, command)
        rows = []
        with open(Path(scratch) / "logs" / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row.get("timeline/step_s"):
                    rows.append({"step": int(row["step"]), "step_s": float(row["timeline/step_s"]),
                                 "tail": float(row["timeline/tail"]),
                                 "elements": float(row["timeline/batch_elements"]),
                                 "tokens_per_s": float(row["timeline/tokens_per_s"])})
    return sorted(rows, key=lambda r: r["step"])


def summarize(rows: list[dict[str, float]], first: int = 0) -> dict[str, Any]:
    """Medians, the slowest step against the median of its shape, and the goals of the steps from ``first`` on,
    each shape's first step of ``rows`` left out (reported as ``first_of_shape``: step -> its time over its shape's
    median)."""
    median = statistics.median
    seen: set[float] = set()
    window, first_of_shape = [], []
    for r in rows:
        new_shape = r["elements"] not in seen
        seen.add(r["elements"])
        if r["step"] >= first:
            (first_of_shape if new_shape else window).append(r)
    by_shape: dict[float, list[float]] = {}
    for r in window:
        by_shape.setdefault(r["elements"], []).append(r["step_s"])
    ratios = [r["step_s"] / median(by_shape[r["elements"]]) for r in window]
    slowest = max(range(len(window)), key=ratios.__getitem__)
    tail = median(r["tail"] for r in window)
    shapes = {elements: {"steps": len(times), "median_step_s": median(times),
                         "median_tail": median(r["tail"] for r in window if r["elements"] == elements),
                         "median_tail_s": median(r["tail"] * r["step_s"] for r in window if r["elements"] == elements)}
              for elements, times in sorted(by_shape.items())}
    return {"steps": len(window), "shapes": len(by_shape), "median_step_s": median(r["step_s"] for r in window),
            "median_tokens_per_s": median(r["tokens_per_s"] for r in window), "median_tail": tail,
            "max_tail": max(r["tail"] for r in window), "by_shape": shapes, "slowest_step": window[slowest]["step"],
            "slowest_over_its_shape_median": ratios[slowest],
            "first_of_shape": {r["step"]: r["step_s"] / median(by_shape[r["elements"]])
                               for r in first_of_shape if r["elements"] in by_shape},
            "goals": {"median tail <= 0.10": tail <= 0.10,
                      "slowest step / its shape's median <= 1.5": ratios[slowest] <= 1.5}}


def ran_layout(printed: list[str]) -> str | None:
    """The layout a ``train.py`` run printed (``mp_lstm: ParallelLayout(...)``) as the bare loop's: ``"single"``,
    ``"pp2"`` or ``"dp2_pp2"``; ``None`` for one the bare loops do not have."""
    for line in printed:
        found = re.search(r"ParallelLayout\(data_parallel_size=(\d+), pipeline_parallel_size=(\d+), .*"
                          r"tensor_parallel_size=(\d+)", line)
        if found:
            return {("1", "1", "1"): "single", ("1", "2", "1"): "pp2", ("2", "2", "1"): "dp2_pp2"}.get(found.groups())
    return None


def single_loop(steps: int, setup: Setup) -> dict[str, list[float]]:
    """One process's bare loop: the whole model's forward pass, loss and backward pass (its ``schedule`` seconds),
    then the clip by the gradient norm and the optimizer step, on as many threads as the strategy gives one process
    (every core). Returns what :func:`benchmarks.overhead.bare_loop` returns, for ``steps`` steps."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = model_of(setup)
    parameters = list(model.parameters())
    optimizer = optimizer_of(setup, parameters)
    divisor = float(setup.rows * setup.length)
    starts, in_schedule, norms = [], [], []
    for inputs, targets in batches(steps + 1, setup):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        began = time.perf_counter()
        logits, _ = model(inputs)
        (token_loss_sum(logits, targets) / divisor).backward()
        in_schedule.append(time.perf_counter() - began)
        if setup.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(parameters, setup.clip)))
        optimizer.step()
    return {"intervals": [b - a for a, b in zip(starts, starts[1:])], "schedule": in_schedule[:-1], "norms": norms}


class _StepClock(pl.Callback):
    """Each training batch's start, its backward pass's seconds (Lightning's ``on_before_backward`` to
    ``on_after_backward``), and what :func:`benchmarks.step_parts.timed` timed (``schedule``)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.backward: list[float] = []
        self.schedule: list[float] = []
        self._began = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_before_backward(self, *args: Any) -> None:
        self._began = time.perf_counter()

    def on_after_backward(self, *args: Any) -> None:
        self.backward.append(time.perf_counter() - self._began)


def lightning_loop(steps: int, setup: Setup, strategy: str = "plain") -> dict[str, list[float]]:
    """The bare loop's model and batches trained by a ``Trainer`` in one process on every core, with no logger,
    checkpoint, progress bar or other callback: what Lightning's loop adds to :func:`single_loop`'s step, and what
    the strategy adds to Lightning's. Either way the step is the module's own ``training_step`` (forward, loss,
    ``self.log`` of the loss), the clip by the gradient norm and the optimizer step; on the CPU, as that loop is.

    Args:
        strategy: ``"plain"``: Lightning's own strategy; the ``schedule`` seconds are the module's forward and loss
            (``LSTMLanguageModel._loss``, clocked) and Lightning's backward pass. ``"mp_lstm"``: the strategy in one
            process (``layout=single``, as the autopilot picks on the 2-core box); the ``schedule`` seconds are its
            schedule's ``step``.

    Returns:
        What :func:`single_loop` returns (no norms).
    """
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torch.utils.data import DataLoader

    from lightning_mp_lstm import MPLSTMStrategy

    torch.set_num_threads(os.cpu_count() or 1)
    model = model_of(setup)
    clock = _StepClock()
    owner, name = (model, "_loss") if strategy == "plain" else (PipelineScheduleSingle, "step")
    original = getattr(owner, name)
    setattr(owner, name, timed(original, clock.schedule))
    chosen: Any = "auto" if strategy == "plain" else MPLSTMStrategy(
        pipeline_parallel_size=1, data_parallel_size=1, n_microbatches=1, report_after_steps=None)
    trainer = pl.Trainer(strategy=chosen, accelerator="cpu", devices=1, max_steps=steps + 1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=setup.clip, callbacks=[clock])
    try:
        trainer.fit(model, train_dataloaders=DataLoader(batches(steps + 1, setup), batch_size=None))
    finally:
        setattr(owner, name, original)
    in_schedule = clock.schedule if strategy != "plain" else [f + b for f, b in zip(clock.schedule, clock.backward)]
    in_schedule = in_schedule[-(steps + 1):]  # the strategy's check of the declaration runs a step of its own first
    return {"intervals": [b - a for a, b in zip(clock.starts, clock.starts[1:])], "schedule": in_schedule[:-1],
            "norms": []}


def _bare_worker(rank: int, world_size: int, steps: int, setup: Setup) -> dict[str, list[float]]:
    import torch.distributed as dist

    start_rank()
    try:
        return bare_loop(rank, steps, setup)
    finally:
        dist.destroy_process_group()


def bare_floor(first: int, steps: int, setup: Setup = BARE_SETUP, layout: str = "pp2") -> dict[str, float]:
    """The bare loop's steps ``first .. first + steps - 1`` on this machine in ``layout`` (``"single"``: one
    process, :func:`single_loop`; else rank 0 of the pipeline, which ends each step last): median step, slowest over
    median, and the median fraction of a step outside ``schedule.step``."""
    if layout == "single":
        result = single_loop(first + steps, setup)
    else:
        setup = replace(setup, layout=layout)
        result = run_ranks(_bare_worker, setup.world_size, first + steps, setup, timeout=600)[0]
    return _floor(result, first, layout, setup)


#: The loops :func:`three_loops` compares, by name: the bare loop, plain Lightning, the strategy under Lightning.
LOOPS = ("bare", "plain", "mp_lstm")


def three_loops(first: int, steps: int, rounds: int = 3, setup: Setup = BARE_SETUP) -> dict[str, Any]:
    """The step's time outside its schedule (the forward and backward pass) in one process, three ways on the same
    model and batches: :func:`single_loop` (``bare``), :func:`lightning_loop` with Lightning's own strategy
    (``plain``) and with ``mp_lstm`` (``mp_lstm``), ``rounds`` rounds of each, the order rotating from round to
    round. Per loop: each round's median milliseconds and share of a step outside the schedule, and their medians;
    then what Lightning adds to the bare loop and what the strategy adds to Lightning, in points of a step and in
    milliseconds (medians over rounds)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LOOPS}
    for round_ in range(rounds):
        for name in LOOPS[round_ % 3:] + LOOPS[:round_ % 3]:
            result = single_loop(first + steps, setup) if name == "bare" else lightning_loop(first + steps, setup,
                                                                                             name)
            runs[name].append(_floor(result, first, "single", setup))
    out: dict[str, Any] = {}
    for name, floors in runs.items():
        out[name] = {"outside_ms": [1e3 * f["median_outside_s"] for f in floors],
                     "outside_points": [100 * f["median_outside_schedule"] for f in floors],
                     "step_ms": [1e3 * f["median_step_s"] for f in floors]}
        out[name].update({f"median_{k}": statistics.median(v) for k, v in list(out[name].items())})
    for upper, lower in (("plain", "bare"), ("mp_lstm", "plain")):
        for unit in ("points", "ms"):
            out[f"{upper}_over_{lower}_{unit}"] = (out[upper][f"median_outside_{unit}"]
                                                   - out[lower][f"median_outside_{unit}"])
    return out


def _floor(result: dict[str, list[float]], first: int, layout: str, setup: Setup) -> dict[str, Any]:
    intervals, in_schedule = result["intervals"][first:], result["schedule"][first:]
    median = statistics.median(intervals)
    return {"median_step_s": median, "slowest_over_median": max(intervals) / median,
            "median_outside_schedule": statistics.median((i - s) / i for i, s in zip(intervals, in_schedule)),
            "median_outside_s": statistics.median(i - s for i, s in zip(intervals, in_schedule)),
            "layout": layout, "setup": asdict(setup)}


def against_floor(summary: dict[str, Any], floor: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """The main job's tail against the bare loop's, in points of a step and in milliseconds. The bare loop runs one
    batch shape (``setup``'s rows x length) and a tail's share of a step depends on the step's length (its
    milliseconds hardly do), so the goal compares the main job's steps of that shape (``tail_over_floor_points``);
    the median over the job's whole bucket mix is kept beside it (``mix_tail_over_floor_points``), and used where
    no step had the floor's shape."""
    floor_tail = floor["median_outside_schedule"]
    mix = 100 * (summary["median_tail"] - floor_tail)
    same = summary["by_shape"].get(float(setup.rows * setup.length))
    if same is None:
        return {"tail_over_floor_points": mix, "mix_tail_over_floor_points": mix, "floor_shape_steps": 0}
    return {"tail_over_floor_points": 100 * (same["median_tail"] - floor_tail), "mix_tail_over_floor_points": mix,
            "floor_shape_steps": same["steps"],
            "tail_ms_at_floor_shape": 1e3 * same["median_tail_s"], "floor_tail_ms": 1e3 * floor["median_outside_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=10, help="the first recorded step (after warm-up)")
    parser.add_argument("--steps", type=int, default=200, help="how many consecutive steps to record")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    parser.add_argument("--no-bare-loop", action="store_true", help="leave the bare loop's noise floor out")
    args, overrides = parser.parse_known_args(argv)
    printed: list[str] = []
    summary = summarize(measure(args.first, args.steps, overrides, printed), args.first)
    layout = ran_layout(printed)
    if not args.no_bare_loop and layout is None:
        print("main_job: no bare loop for the layout the run printed; the floor is left out", flush=True)
    elif not args.no_bare_loop:
        summary["bare_loop"] = bare_floor(args.first, args.steps, layout=layout)
        summary.update(against_floor(summary, summary["bare_loop"], BARE_SETUP))
        summary["goals"]["median tail within 5 points of the bare loop's"] = summary["tail_over_floor_points"] <= 5
        if layout == "single":  # what Lightning itself adds outside the schedule, and what the strategy adds to it
            summary["three_loops"] = three_loops(args.first, args.steps)
    summary["command"] = " ".join(["python benchmarks/main_job.py", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(summary["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
