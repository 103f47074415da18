"""Strategy overhead: MPLSTMStrategy inside Trainer.fit vs a bare torch.distributed.pipelining loop.

Same model, batch, partition and schedule on 2 CPU ranks (one thread each). Prints steps/s of both and
their ratio: medians over the timed steps after warm-up, two alternating rounds of each.

    python benchmarks/strategy_overhead.py [--steps 30] [--warmup 5]
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
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy  # noqa: E402
from lightning_mp_lstm.model import token_loss_sum  # noqa: E402
from lightning_mp_lstm.partition import even_partition  # noqa: E402
from tests.helpers import run_ranks  # noqa: E402

VOCAB, EMBED, HIDDEN, LAYERS = 2000, 256, 256, 4
ROWS, LENGTH, MICROBATCHES, SCHEDULE = 64, 35, 8, "1F1B"


def _model() -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(VOCAB, EMBED, HIDDEN, LAYERS, optimizer="sgd", lr=0.1)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, VOCAB, (ROWS, LENGTH + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _bare_loop(rank: int, steps: int) -> list[float]:
    """The reference: PipelineStage + schedule + optimizer, nothing else."""
    model = _model()
    stages = even_partition(model.block_names, 2)
    model.keep_blocks(stages[rank])
    stage_module = nn.Sequential(*[module for _, module in model.blocks()])

    class Contiguous(nn.Module):  # same boundary handling the library needs (see REFERENCE.md)
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            from lightning_mp_lstm.pipeline import _ContiguousGrad

            if x.is_floating_point() and x.requires_grad:
                x = _ContiguousGrad.apply(x)
            return self.inner(x).contiguous()

    stage = PipelineStage(Contiguous(stage_module), rank, 2, torch.device("cpu"))
    divisor = torch.tensor(float(ROWS * LENGTH))
    schedule = get_schedule_class(SCHEDULE)(
        stage, MICROBATCHES, loss_fn=lambda out, y: token_loss_sum(out, y) / divisor, scale_grads=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    starts = []
    for inputs, targets in _batches(steps + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses, return_outputs=False)
        optimizer.step()
    # Same measure as for the Trainer: the interval between the starts of consecutive steps.
    return [b - a for a, b in zip(starts, starts[1:])]


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def _strategy_fit(rank: int, steps: int) -> list[float]:
    timer = _StepTimer()
    trainer = pl.Trainer(
        strategy=MPLSTMStrategy(schedule=SCHEDULE, n_microbatches=MICROBATCHES, report_after_steps=None),
        accelerator="cpu", devices=2, max_steps=steps + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, gradient_clip_val=None,
        callbacks=[timer],
    )
    trainer.fit(_model(), train_dataloaders=DataLoader(_batches(steps + 1), batch_size=None))
    return [b - a for a, b in zip(timer.starts, timer.starts[1:])]


def _worker(rank: int, world_size: int, steps: int, warmup: int) -> dict[str, list[float]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out: dict[str, list[float]] = {"bare": [], "strategy": []}
    for _ in range(2):  # alternate to spread any drift of the machine over both
        out["bare"] += _bare_loop(rank, steps)[warmup:]
        dist.barrier()
        out["strategy"] += _strategy_fit(rank, steps)[warmup:]
        dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    result = run_ranks(_worker, 2, args.steps, args.warmup, timeout=1200)[0]
    bare = 1.0 / statistics.median(result["bare"])
    strategy = 1.0 / statistics.median(result["strategy"])
    print(f"model: {LAYERS} x LSTM {HIDDEN}, vocab {VOCAB}, batch {ROWS} x {LENGTH}, {MICROBATCHES} microbatches, "
          f"{SCHEDULE}, 2 CPU ranks x 1 thread; {2 * (args.steps - args.warmup)} timed steps each")
    print(f"bare pipelining loop : {bare:.3f} steps/s")
    print(f"MPLSTMStrategy fit   : {strategy:.3f} steps/s")
    print(f"ratio strategy/bare  : {strategy / bare:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
