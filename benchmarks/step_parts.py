"""Where a training step of ``python train.py`` spends its time outside the schedule, part by part.

Runs ``train.py`` in this process with a clock around each named part of a step (the library's training step, its
schedule, the loss terms' sum, the finite check, the clip; Lightning's ``LightningModule.log``, the optimizer step
with its closure, the loop's step; torch's ``zero_grad`` and fused Adam kernel), then prints each part's median
per call and its calls per step, over the steps after the first ``--first``. What is left of the optimizer step once
the training step, ``zero_grad``, the gradients' hand-over, the clip and the kernel are taken out is Lightning's
closure and hooks. ``benchmarks/main_job.py`` measures the tail as a whole against the bare loop's; this says which
part of it is whose.

    python benchmarks/step_parts.py [--first 20] [train.py overrides ...]   # default: trainer.max_steps=210
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["PARTS", "clocked", "main", "summarize", "timed"]

#: label -> (module, attribute path) of each clocked part, in the order a step runs them.
PARTS: dict[str, tuple[str, str]] = {
    "loop step (Lightning's advance)": ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.advance"),
    "optimizer step, closure included": ("lightning_mp_lstm.strategy.precision", "PipelinePrecision.optimizer_step"),
    "training step": ("lightning_mp_lstm.strategy.pipeline_run", "PipelineRun.train"),
    "forward and backward": ("lightning_mp_lstm.pipeline.engine", "PipelineEngine.forward_backward"),
    "loss terms summed": ("lightning_mp_lstm.pipeline.engine", "PipelineEngine._reduce_terms"),
    "finite check of the loss": ("lightning_mp_lstm.pipeline.engine", "PipelineEngine.check_finite"),
    "metrics logged (the library's)": ("lightning_mp_lstm.models.metrics", "LanguageModelMetrics.log"),
    "LightningModule.log": ("lightning.pytorch.core.module", "LightningModule.log"),
    "zero_grad": ("torch.optim.optimizer", "Optimizer.zero_grad"),
    "gradients handed to backward": ("lightning_mp_lstm.strategy.precision", "PipelinePrecision.backward"),
    "clip by the global norm": ("lightning_mp_lstm.pipeline.engine", "PipelineEngine.clip_grad_norm_"),
    "Adam kernel (fused)": ("torch.optim.adam", "_fused_adam"),
}


def clocked(parts: dict[str, tuple[str, str]] = PARTS) -> dict[str, list[float]]:
    """Put a clock around every part (in place, for the rest of this process); returns label -> seconds of each
    call, filled as they run."""
    seconds: dict[str, list[float]] = {label: [] for label in parts}
    for label, (module_name, path) in parts.items():
        owner: Any = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for attribute in outer:
            owner = getattr(owner, attribute)
        setattr(owner, name, timed(getattr(owner, name), seconds[label]))
    return seconds


def timed(function: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``function``, appending the seconds of each call to ``into``."""

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    return timed_call


def summarize(seconds: dict[str, list[float]], steps: int, first: int) -> list[dict[str, Any]]:
    """Each part's median seconds per call and calls per step over the calls after the first ``first`` steps'
    (the calls are spread evenly over the steps), and the closure's rest."""
    rows = []
    for label, calls in seconds.items():
        per_step = len(calls) / steps if steps else 0.0
        kept = calls[round(first * per_step):] or calls
        rows.append({"part": label, "calls_per_step": per_step,
                     "median_ms": 1e3 * statistics.median(kept) if kept else None})
    by = {r["part"]: r for r in rows}
    taken = ["training step", "zero_grad", "gradients handed to backward", "clip by the global norm",
             "Adam kernel (fused)"]
    if all(by[label]["median_ms"] is not None for label in ["optimizer step, closure included", *taken]):
        rest = by["optimizer step, closure included"]["median_ms"] - sum(
            by[label]["median_ms"] * by[label]["calls_per_step"] for label in taken)
        rows.append({"part": "Lightning's closure and hooks (the rest of the optimizer step)", "calls_per_step": 1.0,
                     "median_ms": rest})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=20, help="steps left out as warm-up")
    args, overrides = parser.parse_known_args(argv)
    if not any(o.startswith("trainer.max_steps=") for o in overrides):
        overrides.append("trainer.max_steps=210")
    seconds = clocked()
    sys.argv = [str(ROOT / "train.py"), *overrides]
    sys.path.insert(0, str(ROOT))
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as stopped:
        if stopped.code:
            raise
    steps = len(seconds["loop step (Lightning's advance)"])
    print(f"step_parts: {steps} steps, the first {args.first} left out; median ms per call x calls per step")
    for row in summarize(seconds, steps, args.first):
        median = "-" if row["median_ms"] is None else f"{row['median_ms']:8.3f}"
        print(f"  {row['part']:<66} {median} x {row['calls_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
