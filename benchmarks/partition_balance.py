"""Partition and microbatch choice on MXNet's example model: even vs mxnet2 vs balanced2, auto vs fixed m.

The ``mxnet_ptb`` model (8 x LSTM 400, embedding 200) with a 10,000-word vocabulary on 2 CPU ranks (one
thread each), 1F1B. For each setting: steps/s (median interval between step starts after warm-up) and
the stage times measured on each rank (forward + backward of each stage in isolation, after the first
steps) with their max/mean.

    python benchmarks/partition_balance.py [--rows 256] [--m 8] [--no-sweep] [--steps 6] [--warmup 2] [--rounds 2]

The three partitions run at the same m. The default, 8 microbatches of a 256-sentence batch (32 sentences
per microbatch; m = 8 is also balanced2's fastest m for that batch), is a regime where the partition
matters: the decoder's 10,000-way matrix product and softmax cost about three LSTM layers, so the even
split is lopsided. With 8 sentences per microbatch (``--rows 64 --m 8``) the decoder costs about two layers
and moving one whole layer gains less, while the 1F1B fill and drain, which every split pays, stays (see
docs/benchmarks.md for every setting we ran). balanced2 then runs at every other m in 2, 4, 8, 16 and at
``auto`` (``--no-sweep`` skips those). even and mxnet2 are the same split of this model; the goal compares
balanced2 with the slower of the two, and the ratio over their pooled steps and the ratio in each round are
printed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.base.testing import run_ranks  # noqa: E402
from lightning_mp_lstm.planning.plan import step_time  # noqa: E402

VOCAB, LENGTH = 10_000, 35
MXNET2 = [["embedding", "lstm.0", "lstm.1", "lstm.2", "lstm.3"], ["lstm.4", "lstm.5", "lstm.6", "lstm.7", "decoder"]]
PARTITIONS = {"even": "even", "mxnet2": MXNET2, "balanced2": "balanced"}
FIXED_M = (2, 4, 8, 16)


def _settings(m: int, sweep: bool) -> dict[str, dict]:
    """The three partitions at the same ``m``, then balanced2 at every other fixed m and at ``auto``."""
    settings = {f"{name} (m={m})": {"partition": p, "n_microbatches": m} for name, p in PARTITIONS.items()}
    if sweep:
        others = [k for k in FIXED_M if k != m]
        settings.update({f"balanced2, m={k}": {"partition": "balanced", "n_microbatches": k} for k in others})
        settings["balanced2, m=auto"] = {"partition": "balanced", "n_microbatches": "auto"}
    return settings


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def _data(n: int, rows: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, VOCAB, (rows, LENGTH + 1), generator=g) for _ in range(n)]
    return DataLoader([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens], batch_size=None)


class _Data(pl.LightningDataModule):
    bucket_lengths = [LENGTH]
    mean_padded_length = LENGTH

    def __init__(self, n: int, rows: int) -> None:
        super().__init__()
        self.n = n
        self.batch_size = rows

    def train_dataloader(self) -> DataLoader:
        return _data(self.n, self.batch_size)


def _fit_once(options: dict, rows: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = LSTMLanguageModel(VOCAB, embedding_dim=200, hidden_size=400, num_layers=8, optimizer="sgd", lr=0.1)
    timer = _StepTimer()
    strategy = MPLSTMStrategy(schedule="1F1B", balance_by="time", report_after_steps=warmup, **options)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps + warmup + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[timer],
    )
    trainer.fit(model, datamodule=_Data(steps + warmup + 1, rows))
    # Skip the warm-up steps and the step that measured the stage times.
    intervals = [b - a for a, b in zip(timer.starts, timer.starts[1:])][warmup + 1:]
    return {
        "intervals": intervals,
        "stage_times": list(strategy.measurements.stage_seconds),
        "partition": strategy.partition,
        "m": strategy.layout.n_microbatches,
        "predictions": dict(strategy.plan.predictions) if strategy.plan.predictions else None,
    }


def _worker(
    rank: int, world_size: int, rows: int, m: int, sweep: bool, steps: int, warmup: int, rounds: int
) -> dict[str, dict]:
    """Every setting once per round, rounds one after another, so drift of the machine hits all alike."""
    warnings.filterwarnings("ignore")
    settings = _settings(m, sweep)
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, options in settings.items():
            runs[name].append(_fit_once(options, rows, steps, warmup))
    results = {}
    for name, per_round in runs.items():
        stage_times = [statistics.median(ts) for ts in zip(*(r["stage_times"] for r in per_round))]
        intervals = [t for r in per_round for t in r["intervals"]]
        results[name] = {
            "intervals": intervals,
            "round_steps_per_s": [1.0 / statistics.median(r["intervals"]) for r in per_round],
            "steps_per_s": 1.0 / statistics.median(intervals),
            "stage_times": stage_times,
            "partition": per_round[-1]["partition"],
            "m": [r["m"] for r in per_round],
            "predictions": per_round[-1]["predictions"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="sentences per batch")
    parser.add_argument("--m", type=int, default=8, help="microbatches for the partition comparison")
    parser.add_argument("--no-sweep", action="store_true", help="only the three partitions, no m sweep")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sweep = not args.no_sweep
    results = run_ranks(_worker, 2, args.rows, args.m, sweep, args.steps, args.warmup, args.rounds, timeout=5400)[0]
    m = args.m
    print(f"mxnet_ptb (8 x 400, emb 200), vocab {VOCAB}, batch {args.rows} x {LENGTH}, 1F1B, "
          "2 CPU ranks x 1 thread")
    print(f"{'setting':<20} {'m':>3} {'steps/s':>8} {'stage times (s)':>22} {'max/mean':>9}  partition")
    for name, r in results.items():
        times = r["stage_times"]
        split = " | ".join(f"{s[0]}..{s[-1]}" for s in r["partition"])
        chosen = "/".join(str(x) for x in sorted(set(r["m"])))
        print(f"{name:<20} {chosen:>3} {r['steps_per_s']:>8.3f} {str([round(t, 3) for t in times]):>22} "
              f"{max(times) / statistics.mean(times):>9.3f}  {split}")
    balanced = results[f"balanced2 (m={m})"]
    slower = min(results[f"even (m={m})"], results[f"mxnet2 (m={m})"], key=lambda r: r["steps_per_s"])
    print(f"balanced2 speed-up over the slower of even/mxnet2 at m={m}: "
          f"{balanced['steps_per_s'] / slower['steps_per_s']:.3f} (goal >= 1.15)")
    # even and mxnet2 are one split here, so their steps are pooled for a less noisy reference.
    pooled = statistics.median(results[f"even (m={m})"]["intervals"] + results[f"mxnet2 (m={m})"]["intervals"])
    print(f"  over even and mxnet2 pooled: {balanced['steps_per_s'] * pooled:.3f}")
    per_round = [
        b / min(e, x)
        for e, x, b in zip(*(results[f"{name} (m={m})"]["round_steps_per_s"] for name in PARTITIONS))
    ]
    print(f"  per round: {', '.join(f'{r:.3f}' for r in per_round)}")
    # What the 1F1B step model predicts from the measured stage times, and its bound: a perfect split
    # (every stage at the mean) of the slower run's work.
    slow_step = step_time(slower["stage_times"], m)
    perfect = [statistics.mean(slower["stage_times"])] * len(slower["stage_times"])
    print(f"  predicted from measured stage times: "
          f"{slow_step / step_time(balanced['stage_times'], m):.3f}; "
          f"a perfect split: {slow_step / step_time(perfect, m):.3f}")
    if args.no_sweep:
        return
    fixed = {k: v["steps_per_s"] for k, v in results.items() if k.startswith("balanced2") and "auto" not in k}
    auto = results["balanced2, m=auto"]
    predicted = {k: round(t, 3) for k, t in auto["predictions"].items()}
    print(f"auto chose m={auto['m']} (per round); predicted s/step of the last round {predicted}")
    print(f"auto / best fixed m: {auto['steps_per_s'] / max(fixed.values()):.3f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
