"""A hand-written ``torch.distributed.pipelining`` training loop: the reference the strategy's overhead is measured
against (``benchmarks/strategy_overhead.py``) and the "bare pipelining loop" row of ``benchmarks/when_to_use.py``.

One ``PipelineStage`` per rank of 2 holding an even half of ``LSTMLanguageModel``'s blocks, a schedule with
``scale_grads=False`` and a loss divided by the batch's tokens, SGD; nothing else (no Lightning, no checks, no
logging). Run it inside a 2-process gloo group (``lightning_mp_lstm.testing.run_ranks``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402

from lightning_mp_lstm import LSTMLanguageModel  # noqa: E402
from lightning_mp_lstm.models.binding import pipeline_model  # noqa: E402
from lightning_mp_lstm.models.lstm_language_model import token_loss_sum  # noqa: E402
from lightning_mp_lstm.planning.partition import even_partition  # noqa: E402

__all__ = ["Contiguous", "ContiguousGrad", "Setup", "bare_loop", "batches", "model_of"]


@dataclass(frozen=True)
class Setup:
    """The model, batch and pipeline both runs share (defaults: the numbers in docs/benchmarks.md).

    The model's fields are ``LSTMLanguageModel``'s keyword arguments, as in ``benchmarks/sizes.py``.
    """

    vocab_size: int = 2000
    embedding_dim: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    rows: int = 64
    length: int = 35
    microbatches: int = 8
    schedule: str = "1F1B"


def model_of(setup: Setup) -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel(setup.vocab_size, setup.embedding_dim, setup.hidden_size, setup.num_layers,
                             optimizer="sgd", lr=0.1)


def batches(n: int, setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, setup.vocab_size, (setup.rows, setup.length + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: gloo sends no views, and the gradient of a
    batch-first LSTM's input is a transposed one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Contiguous(nn.Module):
    """A stage whose output and input gradient are contiguous: the boundary handling the library's stages do too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = ContiguousGrad.apply(x)
        return self.inner(x).contiguous()


def bare_loop(rank: int, steps: int, setup: Setup) -> list[float]:
    """The reference on ``rank`` of 2: PipelineStage + schedule + optimizer, nothing else.

    Returns:
        The intervals between the starts of consecutive steps (seconds), ``steps`` of them.
    """
    model = model_of(setup)
    blocks = pipeline_model(model)  # the model's blocks, as the strategy splits them
    stages = even_partition(blocks.block_names, 2)
    blocks.keep_blocks(stages[rank])
    stage_module = nn.Sequential(*[module for _, module in blocks.blocks()])

    stage = PipelineStage(Contiguous(stage_module), rank, 2, torch.device("cpu"))
    divisor = torch.tensor(float(setup.rows * setup.length))
    schedule = get_schedule_class(setup.schedule)(
        stage, setup.microbatches, loss_fn=lambda out, y: token_loss_sum(out, y) / divisor, scale_grads=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    starts = []
    for inputs, targets in batches(steps + 1, setup):
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
