"""Strategy overhead: MPLSTMStrategy inside Trainer.fit vs a bare torch.distributed.pipelining loop.

The bare loop is ``benchmarks/overhead.py``'s.

Same model, batch, partition and schedule on 2 CPU ranks (one thread each). Prints steps/s of both and
their ratio: medians over the timed steps after warm-up, two alternating rounds of each.

    python benchmarks/strategy_overhead.py [--steps 30] [--warmup 5]

``benchmarks/run.py`` imports :func:`compare` (inside its own ranks) and :func:`summarize`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.overhead import Setup, bare_loop, batches, model_of  # noqa: E402
from lightning_mp_lstm import MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def _strategy_fit(rank: int, steps: int, setup: Setup) -> list[float]:
    timer = _StepTimer()
    trainer = pl.Trainer(
        strategy=MPLSTMStrategy(schedule=setup.schedule, n_microbatches=setup.microbatches, report_after_steps=None,
                                num_threads=1),
        accelerator="cpu", devices=2, max_steps=steps + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, gradient_clip_val=None,
        callbacks=[timer],
    )
    trainer.fit(model_of(setup), train_dataloaders=DataLoader(batches(steps + 1, setup), batch_size=None))
    return [b - a for a, b in zip(timer.starts, timer.starts[1:])]


def compare(rank: int, steps: int, warmup: int, setup: Setup = Setup(), rounds: int = 2) -> dict[str, list[float]]:
    """Step intervals (seconds) of the bare loop and of the strategy on this rank, after ``warmup`` steps of each
    run, ``rounds`` alternating runs of each. Call it on both ranks of a 2-process world (the default process
    group is started when there is none)."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out: dict[str, list[float]] = {"bare": [], "strategy": []}
    for _ in range(rounds):  # alternate to spread any drift of the machine over both
        out["bare"] += bare_loop(rank, steps, setup)[warmup:]
        dist.barrier()
        out["strategy"] += _strategy_fit(rank, steps, setup)[warmup:]
        dist.barrier()
    return out


def summarize(intervals: dict[str, list[float]]) -> dict[str, float]:
    """Steps/s of both (1 / median interval) and their ratio strategy / bare."""
    bare = 1.0 / statistics.median(intervals["bare"])
    strategy = 1.0 / statistics.median(intervals["strategy"])
    return {"bare_steps_per_s": bare, "strategy_steps_per_s": strategy, "ratio": strategy / bare}


def _worker(rank: int, world_size: int, steps: int, warmup: int) -> dict[str, list[float]]:
    warnings.filterwarnings("ignore")
    return compare(rank, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    summary = summarize(run_ranks(_worker, 2, args.steps, args.warmup, timeout=1200)[0])
    s = Setup()
    print(f"model: {s.num_layers} x LSTM {s.hidden_size}, vocab {s.vocab_size}, batch {s.rows} x {s.length}, "
          f"{s.microbatches} microbatches, {s.schedule}, 2 CPU ranks x 1 thread; {2 * (args.steps - args.warmup)} "
          "timed steps each")
    print(f"bare pipelining loop : {summary['bare_steps_per_s']:.3f} steps/s")
    print(f"MPLSTMStrategy fit   : {summary['strategy_steps_per_s']:.3f} steps/s")
    print(f"ratio strategy/bare  : {summary['ratio']:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
