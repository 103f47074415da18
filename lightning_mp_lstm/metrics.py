"""What a language model logs: the training loss and tokens per second per step, and for evaluation the loss over
all target tokens of the split and its perplexity.

:class:`LanguageModelMetrics` logs them through ``LightningModule.log`` under names like ``train/loss`` or
``val_ppl``; the ``mp_lstm`` strategy uses it for the batches it runs, and :class:`~lightning_mp_lstm.LSTMLanguageModel`
for its own steps, so a model logs the same names with or without the strategy. Evaluation values accumulate on the
device (no host synchronization per batch) in :class:`TokenMean` metrics.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torchmetrics import Metric
from typing_extensions import override

__all__ = ["LanguageModelMetrics", "TokenMean", "perplexity"]


def perplexity(loss: float) -> float:
    """``exp(loss)`` guarded against overflow."""
    return math.exp(min(loss, 700.0))


class TokenMean(Metric):
    """The mean of per-batch mean losses weighted by their token counts: the mean over every token (``exp=True``:
    its exponential, the perplexity). Every process passes the global batch's values, so nothing is synchronized."""

    full_state_update = False

    def __init__(self, exp: bool = False) -> None:
        super().__init__(sync_on_compute=False)
        self.exp = exp
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, mean: torch.Tensor, tokens: torch.Tensor) -> None:
        self.total += mean.detach().to(torch.float64) * tokens
        self.count += tokens

    @override
    def compute(self) -> torch.Tensor:
        mean = (self.total / self.count.clamp(min=1)).to(torch.float32)
        return mean.clamp(max=700.0).exp() if self.exp else mean


class LanguageModelMetrics:
    """Logs a language model's loss, training speed and evaluation perplexity.

    Args:
        name: the logged names, with ``{split}`` (train, val, test) and ``{metric}`` (loss, ppl, tokens_per_s).
    """

    def __init__(self, name: str = "{split}/{metric}") -> None:
        self.name = name
        self._means: dict[tuple[str, str], TokenMean] = {}
        self._last_step: float | None = None

    def start_epoch(self) -> None:
        """A training epoch starts: the first step's interval would include the epoch's set-up."""
        self._last_step = None

    def log(self, module: Any, split: str, loss: torch.Tensor, tokens: torch.Tensor, rows: int) -> None:
        """Log a batch's mean token loss ``loss`` over ``tokens`` target tokens (``rows`` sequences).

        Training: the loss per step (and tokens per second from the second step of an epoch). Evaluation: the
        split's loss and perplexity over all its tokens, at the end of the epoch.
        """
        if split == "train":
            module.log(self.name.format(split=split, metric="loss"), loss, prog_bar=True, batch_size=rows)
            now = time.perf_counter()
            if self._last_step is not None:
                speed = tokens.float() / (now - self._last_step)
                module.log(self.name.format(split=split, metric="tokens_per_s"), speed, on_step=True, on_epoch=True,
                           prog_bar=True, batch_size=rows)
            self._last_step = now
            return
        for metric in ("loss", "ppl"):
            key = (split, metric)
            if key not in self._means:
                self._means[key] = TokenMean(exp=metric == "ppl")
            mean = self._means[key].to(loss.device)
            mean.update(loss, tokens)
            name = self.name.format(split=split, metric=metric)
            module.log(name, mean, on_step=False, on_epoch=True, prog_bar=split == "val",
                       metric_attribute=f"_lm_metrics_{split}_{metric}")
