"""What a language model logs: the training loss per step and its tokens per second, and for evaluation the loss
over all target tokens of the split and its perplexity.

:class:`LanguageModelMetrics` logs them through ``LightningModule.log`` under names like ``train/loss`` or
``val_ppl``; the ``mp_lstm`` strategy uses it for the batches it runs, and :class:`~lightning_mp_lstm.LSTMLanguageModel`
for its own steps, so a model logs the same names with or without the strategy. Evaluation values accumulate on the
device (no host synchronization per batch) in :class:`TokenMean` metrics.

A ``LightningModule.log`` call costs about half a millisecond of the host's time (Lightning's bookkeeping), a step of
every rank: the loss is logged every step (the progress bar, callbacks and loggers read it), the speed only where
Lightning hands on-step values to its loggers (every ``log_every_n_steps``), at an epoch's last batch and at the run's
last step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torchmetrics import MeanMetric, Metric
from typing_extensions import override

from lightning_mp_lstm.models.objective import DECLARED_LOSS

__all__ = ["SPEED_METRICS", "LanguageModelMetrics", "TokenMean", "perplexity", "train_quantities"]

#: The training speed's metric names (``{metric}`` of :class:`LanguageModelMetrics`' names): the last steps' and the
#: epoch's mean, in target tokens per second.
SPEED_METRICS = ("tokens_per_s_step", "tokens_per_s_epoch")


def perplexity(loss: float) -> float:
    """``exp(loss)`` guarded against overflow."""
    return math.exp(min(loss, 700.0))


def train_quantities(loss: torch.Tensor, terms: dict[str, torch.Tensor], weights: torch.Tensor | None,
                     reduction: str, ppl: bool = True) -> dict[str, torch.Tensor]:
    """What a training batch can log, by metric name: ``loss``, the objective optimized (the declared loss and its
    penalty); each named term; and where they differ from ``loss``, ``declared_loss`` (the declared loss without the
    penalty, as ``reduction`` averages it) and ``loss_per_token`` (the declared loss per target token); ``ppl``, its
    exponential. ``declared_loss`` and ``ppl`` are logged only under a module's own names for them
    (:meth:`LanguageModelMetrics.log_as`).

    Args:
        weights: the global batch's ``[tokens, sequences]`` (``None``: no per-token value).
        ppl: compute ``ppl`` too.
    """
    terms = dict(terms)
    declared = terms.pop(DECLARED_LOSS, None)
    values = {"loss": loss, **terms}
    if declared is not None:
        values["declared_loss"] = declared
    base = loss if declared is None else declared
    per_token = base
    if weights is not None and weights.numel() > 1 and (declared is not None or reduction != "token_mean"):
        per = {"token_mean": weights[0], "sequence_mean": weights[1]}.get(reduction, torch.ones_like(weights[0]))
        per_token = values["loss_per_token"] = base * per.to(base.dtype) / weights[0].clamp(min=1).to(base.dtype)
    if ppl and (reduction == "token_mean" or "loss_per_token" in values):
        values["ppl"] = per_token.clamp(max=700.0).exp()
    return values


class TokenMean(Metric):
    """A weighted mean of per-batch values: ``sum(value * weight) / sum(count)`` (``count`` defaults to the weight),
    or its exponential (``exp=True``). With the batches' mean token losses weighted by their token counts it is the
    mean over every token, and its exponential the perplexity. Every process passes the global batch's values, so
    nothing is synchronized."""

    full_state_update = False

    def __init__(self, exp: bool = False) -> None:
        super().__init__(sync_on_compute=False)
        self.exp = exp
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, mean: torch.Tensor, weight: torch.Tensor, count: torch.Tensor | None = None) -> None:
        # Out of place: states made under an evaluation's inference mode (``Trainer.validate``) are inference
        # tensors, which a fit's validation (run without it) may not update in place.
        self.total = self.total + mean.detach().to(torch.float64) * weight
        self.count = self.count + (weight if count is None else count)

    @override
    def compute(self) -> torch.Tensor:
        mean = (self.total / self.count.clamp(min=1)).to(torch.float32)
        return mean.clamp(max=700.0).exp() if self.exp else mean


class LanguageModelMetrics:
    """Logs a language model's loss (and the named terms of a module's own loss), training speed and evaluation
    perplexity.

    Args:
        name: the logged names, with ``{split}`` (train, val, test) and ``{metric}`` (loss, ppl, tokens_per_s_step,
            tokens_per_s_epoch, or a term's name).
        reduction: what the loss averages over (``"token_mean"``, ``"sequence_mean"``, ``"sum"``): evaluation
            batches are weighted by it, and perplexity is the exponential of the loss per target token.
        train_flags: logged name -> ``on_step`` / ``on_epoch`` for the training loss and terms (a module's own
            ``training_step`` logs them so, as the numerical check of its declaration records: :meth:`log_as`);
            default: every step only.
    """

    def __init__(self, name: str = "{split}/{metric}", reduction: str = "token_mean",
                 train_flags: dict[str, dict[str, bool]] | None = None) -> None:
        self.name, self.reduction = name, reduction
        self.train_flags = dict(train_flags or {})
        self.train_names: dict[str, list[str]] = {}
        self._means: dict[tuple, Metric] = {}
        self._last_step: float | None = None
        self._tokens: torch.Tensor | None = None  # since the speed was last logged
        self._seconds = 0.0
        self._speeds: list[torch.Tensor] = []  # each step's since the speed was last logged

    def log_as(self, names: dict[str, list[str]], flags: dict[str, dict[str, bool]]) -> None:
        """Log training quantities under a module's own names (``quantity -> names``: what its ``training_step``
        logs under those names, as the numerical check found) with its ``on_step`` / ``on_epoch`` (by name); a
        quantity whose name a module gives to another (the objective, when the module's ``train_loss`` is the
        cross-entropy alone) is logged as ``objective``."""
        self.train_flags.update(flags)
        taken = {name for given in names.values() for name in given}
        self.train_names.update({quantity: list(given) for quantity, given in names.items()})
        for quantity in ("loss", "loss_per_token"):
            own = self.name.format(split="train", metric=quantity)
            if own in taken and quantity not in names:
                self.train_names[quantity] = [self.name.format(
                    split="train", metric="objective" if quantity == "loss" else "pipeline_loss_per_token")]

    def start_epoch(self) -> None:
        """A training epoch starts: the first step's interval would include the epoch's set-up."""
        self._last_step, self._tokens, self._seconds, self._speeds = None, None, 0.0, []

    def _metric(self, key: tuple[str, str], device: torch.device, make: Any) -> Any:
        metric = self._means.get(key)
        if metric is None:
            metric = self._means[key] = make().to(device)
        elif metric.device != device:  # moving a metric walks its states: not on every step
            metric = self._means[key] = metric.to(device)
        return metric

    def log(self, module: Any, split: str, loss: torch.Tensor, tokens: torch.Tensor, rows: int,
            weights: torch.Tensor | None = None, terms: dict[str, torch.Tensor] | None = None,
            rows_are_global: bool = True, dataloader_idx: int = 0) -> None:
        """Log a batch's loss ``loss`` over ``tokens`` target tokens (``rows`` sequences), and its named ``terms``.

        Training: the loss and terms per step (or as :attr:`train_flags` says); tokens per second from the second
        step of an epoch, as ``tokens_per_s_step`` (the tokens over the seconds since it was last logged) and
        ``tokens_per_s_epoch`` (the mean of the epoch's steps), logged at Lightning's logging steps only (see the
        module's docstring). Evaluation: the split's loss, terms and perplexity over all its batches, at the end of
        the epoch.

        Args:
            rows: the batch's size as Lightning infers it (its first tensor's first dimension).
            weights: the global batch's ``[tokens, sequences]`` (``None``: ``tokens`` and ``rows``).
            rows_are_global: ``rows`` is the global batch's (every replica given all of it); else a replica's share,
                and an epoch's mean weighs each step by the global batch's sequences.
            dataloader_idx: which of an evaluation's dataloaders the batch is from: each has its own means (Lightning
                logs them under names ending ``/dataloader_idx_{i}`` when there are several).
        """
        terms = terms or {}
        if split == "train":
            quantities = train_quantities(loss, terms, weights, self.reduction, ppl="ppl" in self.train_names)
            for metric, value in quantities.items():
                if metric in ("declared_loss", "ppl") and metric not in self.train_names:
                    continue  # logged only under a module's own name for it
                for name in self.train_names.get(metric) or [self.name.format(split=split, metric=metric)]:
                    flags = self.train_flags.get(name, {})
                    # An epoch's mean weighs each step by the global batch's size, as one process's Lightning infers
                    # it (a share's global count is read on the host only then).
                    share = (flags.get("on_epoch") and not rows_are_global and weights is not None
                             and weights.numel() > 1)
                    size = int(weights[1]) if share else rows
                    module.log(name, value, prog_bar=name == self.name.format(split=split, metric="loss"),
                               batch_size=size, **flags)
            self._log_speed(module, tokens)
            return
        sequences = weights[1] if weights is not None else torch.full((), rows, device=loss.device)
        weight = {"token_mean": tokens, "sequence_mean": sequences}.get(self.reduction, torch.ones_like(tokens))
        loader = f"_{dataloader_idx}" if dataloader_idx else ""
        for metric, value, count in (("loss", loss, None), ("ppl", loss, tokens),
                                     *((term, value, None) for term, value in terms.items())):
            mean = self._metric((split, metric, dataloader_idx), loss.device,
                                lambda m=metric: TokenMean(exp=m == "ppl"))
            mean.update(value, weight, count)
            module.log(self.name.format(split=split, metric=metric), mean, on_step=False, on_epoch=True,
                       prog_bar=split == "val" and metric in ("loss", "ppl"),
                       metric_attribute=f"_lm_metrics_{split}_{metric}{loader}")

    def _log_speed(self, module: Any, tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        last, self._last_step = self._last_step, now
        if last is None:
            return
        seconds = now - last
        # The epoch's mean is of every step, logged or not; the steps' speeds reach its metric at logging steps (a
        # metric's update costs more than the step's speed, and its NaN check reads the device).
        self._speeds.append(tokens.float() / seconds)
        self._tokens = tokens if self._tokens is None else self._tokens + tokens
        self._seconds += seconds
        if not _logging_step(getattr(module, "_trainer", None)):
            return
        speed = self._metric(("train", "tokens_per_s"), tokens.device,
                             lambda: MeanMetric(sync_on_compute=False, nan_strategy="ignore"))
        speed.update(torch.stack(self._speeds))
        self._speeds = []
        steps, epoch = (self.name.format(split="train", metric=metric) for metric in SPEED_METRICS)
        module.log(steps, self._tokens.float() / self._seconds, prog_bar=True, batch_size=1)
        module.log(epoch, speed, on_step=False, on_epoch=True, metric_attribute="_lm_metrics_train_tokens_per_s")
        self._tokens, self._seconds = None, 0.0


def _logging_step(trainer: Any) -> bool:
    """Whether Lightning hands this training step's on-step values to its loggers (its ``log_every_n_steps``), the
    step is its epoch's last or the run's last (``max_steps``); always without a trainer."""
    if trainer is None:
        return True
    step = trainer.global_step + 1
    every = trainer.log_every_n_steps
    return bool((every > 0 and step % every == 0) or trainer.is_last_batch or trainer.should_stop
                or 0 < trainer.max_steps <= step)
