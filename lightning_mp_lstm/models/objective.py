"""A module's training objective split over the pipeline's pieces, so that the pieces add up to its own loss.

The pipeline computes a batch's loss in pieces: each microbatch of rows (and, with wavefront pipelining, each chunk of
its time axis) on the last stage, on every data-parallel replica, and the penalty on the last LSTM layer's outputs
(AWD-LSTM's AR and TAR) on whichever stage holds that layer. :class:`Objective` scales every piece so that their sum
is the loss the module computes on the whole batch: a piece of a loss averaged over target tokens weighs its tokens
over the batch's, one averaged over sequences its sequences over the batch's, a sum weighs 1. The module's own loss
method sees only the real rows of a piece (never the rows added to split a ragged batch evenly) in the module's own
layout, and the penalty sees the whole time axis of its rows (the chunks of a wavefront microbatch are joined first),
so terms that couple time steps (TAR) stay exact.

The penalty's gradient joins the backward pass without a second backward: the penalty is computed on detached
copies of the layer's outputs, its gradient with respect to them (only through the penalty itself) is taken at once,
and hooks on the outputs add it when the pipeline's backward reaches them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_mp_lstm.models.decoded_loss import decoded_cross_entropy, token_cross_entropy

__all__ = ["DECLARED_LOSS", "Objective", "to_user_layout", "token_cross_entropy"]

#: The term a training batch reports beside a penalty: the declared loss alone (not a name a module's dict can give:
#: the metrics use it and do not log it under this name).
DECLARED_LOSS = "(declared loss)"


def to_user_layout(tensor: torch.Tensor, time_first: bool) -> torch.Tensor:
    """A rows-first ``(B, T, ...)`` tensor as the module sees its batches: ``(T, B, ...)`` with ``time_first`` (a
    view; the pipeline's tensors are rows first)."""
    return tensor.transpose(0, 1) if time_first else tensor


def _terms(value: Any, default: str, method: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {default: value}
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        if "loss" in value:
            raise ValueError(f"{method} returned a term named 'loss', the name of the total; name its terms otherwise")
        return {str(k): v for k, v in value.items()}
    raise TypeError(f"{method} must return a scalar tensor or a dict of named scalar tensors, got "
                    f"{type(value).__name__}")


class Objective:
    """The loss of one declared module, piece by piece.

    Args:
        loss: the module's loss method ``(logits, targets) -> loss or {term: value}``, or ``None`` for the built-in
            cross-entropy.
        penalty: the module's penalty method ``(raw_output, output) -> value or {term: value}``, or ``None``.
        reduction: ``"token_mean"``, ``"sequence_mean"`` or ``"sum"`` (what ``loss`` averages over).
        ignore_index: the target id that is not a token.
        time_first: the module's tensors are ``(T, B, ...)``.
        names: the module's method names (for messages).
        decoder: where the built-in loss finds the decoder when the last block hands it the decoder's inputs rather
            than logits (:func:`~lightning_mp_lstm.models.decoded_loss.decoded_cross_entropy`: the logits never exist
            whole); ``None``: the last block's outputs are the logits.
        slice_tokens: tokens per slice of that loss (``None``: as many as 64 MiB of logits hold).

    Attributes:
        microbatch: the row microbatch whose forward runs now (set by the model's ``microbatch_context``; ``None``
            outside a stage forward and while torch infers shapes).
    """

    def __init__(self, loss: Callable[..., Any] | None, penalty: Callable[..., Any] | None, reduction: str,
                 ignore_index: int, time_first: bool, names: dict[str, str],
                 decoder: Callable[[], nn.Module | None] | None = None, slice_tokens: int | None = None) -> None:
        self.loss, self.penalty, self.reduction = loss, penalty, reduction
        self.decoder, self.slice_tokens = decoder, slice_tokens
        self.ignore_index, self.time_first, self.names = ignore_index, time_first, names
        self.microbatch: int | None = None
        self._counts: torch.Tensor | None = None
        self._microbatch_rows: Sequence[int] = ()
        self._accumulation = 1
        self._terms: dict[str, torch.Tensor] = {}
        self._chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def static_terms(self) -> list[str] | None:
        """The term names every batch reports, when known without running the module's methods."""
        return ["loss"] if self.loss is None and self.penalty is None else None

    # ----- a batch ---------------------------------------------------------------------------------------------
    def batch_weights(self, targets: torch.Tensor) -> torch.Tensor:
        """``[target tokens, sequences]`` of a replica's real rows (the engine sums them over replicas)."""
        tokens = (targets != self.ignore_index).sum()
        # Filled on the device: a tensor made from a host number is a copy that waits for the device (CUDA).
        return torch.stack([tokens, torch.full_like(tokens, targets.shape[0])])

    def start_batch(self, counts: torch.Tensor, microbatch_rows: Sequence[int], accumulation: int) -> None:
        """A batch starts: its global ``[tokens, sequences]``, the real rows of each microbatch, the batches
        accumulated per optimizer step."""
        self._counts, self._microbatch_rows, self._accumulation = counts, microbatch_rows, accumulation
        self._terms, self._chunks = {}, {}

    def finish_batch(self) -> dict[str, torch.Tensor]:
        """This process's pieces of the batch loss and of its terms, summed (detached): ``{"loss": ...}`` and one entry
        per named term of the loss and penalty methods."""
        terms, self._terms = self._terms, {}
        return terms

    def _record(self, terms: dict[str, torch.Tensor], scale: torch.Tensor | float) -> torch.Tensor:
        total = None
        for name, value in terms.items():
            scaled = value * scale
            total = scaled if total is None else total + scaled
            if name != "loss":
                self._add(name, scaled)
        assert total is not None
        self._add("loss", total)
        return total

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        self._terms[name] = self._terms[name] + value if name in self._terms else value

    def _normalizer(self) -> torch.Tensor:
        assert self._counts is not None, "start_batch() first"
        count = {"token_mean": self._counts[0], "sequence_mean": self._counts[1]}.get(self.reduction)
        scale = count.clamp(min=1) if count is not None else torch.ones((), device=self._counts.device)
        return scale * self._accumulation

    def _rows(self, microbatch: int) -> int:
        return int(self._microbatch_rows[microbatch]) if microbatch < len(self._microbatch_rows) else 0

    # ----- the loss, on the last stage ----------------------------------------------------------------------------
    def microbatch_loss(self, logits: Any, targets: torch.Tensor, microbatch: int | None = None,
                        decoder: nn.Module | None = None) -> torch.Tensor:
        """Microbatch ``microbatch`` 's piece of the batch loss (``None``: the piece's loss as the module computes
        it, unscaled, for timing); the piece of each term is kept for :meth:`finish_batch`. ``logits`` are the
        decoder's inputs when the objective decodes them itself (``decoder``: another copy of the decoder than the
        module's, a throw-away one being timed)."""
        if self.loss is None:
            summed = self._builtin(logits, targets, decoder)
            if microbatch is None:
                return summed
            normalizer = self._normalizer()
            return self._declared(self._record({"loss": summed}, 1.0 / normalizer.to(summed.dtype)))
        real = logits.shape[0] if microbatch is None else self._rows(microbatch)
        if real == 0:  # only rows added to split the batch: nothing of the module's loss
            return logits.sum() * 0
        logits, targets = logits[:real], targets[:real]
        shown = to_user_layout(logits, self.time_first)
        value = self.loss(shown.contiguous() if self.time_first else shown,
                          to_user_layout(targets, self.time_first).contiguous())
        terms = _terms(value, "loss", self.names.get("loss", "loss"))
        if microbatch is None:
            return sum(terms.values())
        weight = {"token_mean": (targets != self.ignore_index).sum(), "sequence_mean": real}.get(self.reduction, 1)
        dtype = next(iter(terms.values())).dtype
        weight = (weight.to(torch.float64) if isinstance(weight, torch.Tensor)
                  else torch.full((), weight, dtype=torch.float64, device=logits.device))  # no host-to-device copy
        return self._declared(self._record(terms, (weight / self._normalizer().double()).to(dtype)))

    def _declared(self, total: torch.Tensor) -> torch.Tensor:
        """Keep the declared loss's piece apart from the penalty's where a penalty is added to it (in training)."""
        if self.penalty is not None and torch.is_grad_enabled():
            self._add(DECLARED_LOSS, total)
        return total

    def _builtin(self, outputs: Any, targets: torch.Tensor, decoder: nn.Module | None = None) -> torch.Tensor:
        if self.decoder is None:
            return token_cross_entropy(outputs, targets, self.ignore_index)
        return decoded_cross_entropy(outputs, decoder if decoder is not None else self.decoder(), targets,
                                     self.ignore_index, self.slice_tokens)

    # ----- the penalty, where the last LSTM layer runs ---------------------------------------------------------------
    def add_penalty(self, raw: torch.Tensor, output: torch.Tensor, chunk: int = 0, chunks: int = 1) -> None:
        """The penalty of the last LSTM layer's rows-first outputs before (``raw``) and after ``after_lstm``
        (``output``) of the running microbatch, in training: its gradient is added to theirs when the backward pass
        reaches them. With time chunks (``chunk`` of ``chunks``), the chunks are kept until the last one."""
        microbatch = self.microbatch
        if self.penalty is None or microbatch is None or not (torch.is_grad_enabled() and output.requires_grad):
            return
        parts = self._chunks.setdefault(microbatch, [])
        parts.append((raw, output))
        if chunk < chunks - 1:
            return
        del self._chunks[microbatch]
        real = self._rows(microbatch)
        if real == 0:
            return
        tensors = [t for pair in parts for t in pair]
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        raw_all = torch.cat(leaves[0::2], dim=1)[:real]
        output_all = torch.cat(leaves[1::2], dim=1)[:real]
        value = self.penalty(to_user_layout(raw_all, self.time_first), to_user_layout(output_all, self.time_first))
        terms = _terms(value, "penalty", self.names.get("penalty", "penalty"))
        dtype = next(iter(terms.values())).dtype
        assert self._counts is not None, "start_batch() first"
        scale = (real / (self._counts[1].clamp(min=1).double() * self._accumulation)).to(dtype)
        total = self._record(terms, scale)
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        for tensor, grad in zip(tensors, grads, strict=True):
            if grad is not None and tensor.requires_grad:
                tensor.register_hook(lambda g, extra=grad: g + extra)
