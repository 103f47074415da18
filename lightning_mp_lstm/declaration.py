"""Bring your own LSTM LightningModule: one declaration says which of its submodules are the embedding, the LSTM
stack and the decoder, and ``mp_lstm`` derives everything else from them.

.. code-block:: python

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", dropout="drop")

:class:`LSTMBlocks` is that declaration; the strategy binds it to the module (:func:`pipeline_model`), getting a
:class:`~lightning_mp_lstm.contract.PipelineModel`: the blocks ``encoder``, ``rnn.0`` ... ``rnn.{N-1}``,
``decoder`` (a multi-layer ``nn.LSTM`` is split per layer, parameter names unchanged), the loss, example inputs,
costs and initial values for the planner, carried state and the vocabulary-parallel split. The module itself is
not changed until the strategy prunes it to the blocks a process holds, and it never learns that it is pipelined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_mp_lstm.contract import PipelineModel, check_model

__all__ = ["LOSSES", "LSTMBlocks", "ModelDeclarationError", "pipeline_model"]

#: The losses a declaration may name: cross-entropy of the decoder's logits, or the negative log-likelihood of their
#: log-softmax (the same number: word_language_model's ``log_softmax`` + ``nll_loss``).
LOSSES = ("cross_entropy", "nll")
DOCS_PAGE = "docs/bring_your_own_model.md"


class ModelDeclarationError(TypeError):
    """A module without a pipeline declaration, or a declaration that does not fit the module."""


@dataclass(frozen=True)
class LSTMBlocks:
    """Which submodules of a LightningModule form its LSTM language model, for the ``mp_lstm`` strategy.

    Return it from the module's ``configure_pipeline()``. Names are attribute paths in the module (``"encoder"``,
    ``"model.rnn"``). The strategy then runs the module's training, validation, test and prediction steps itself,
    through the pipeline (the module's own ``*_step`` methods are not called under ``mp_lstm``), and logs the loss.

    Attributes:
        embedding: the ``nn.Embedding``.
        lstm: a multi-layer ``nn.LSTM`` (split per layer by the library, parameter names unchanged) or an
            ``nn.ModuleList`` of one-layer ``nn.LSTM`` s (AWD-LSTM). Unidirectional, no projection.
        decoder: the ``nn.Linear`` from the last LSTM layer to the vocabulary (tying its weight to the embedding's
            needs nothing more: tied weights are found from the parameters).
        dropout: dropout after the embedding and after the last LSTM layer: the name of an ``nn.Dropout`` submodule
            (``"drop"``), a rate, or ``None``.
        layer_dropout: dropout between LSTM layers (name or rate); ``None``: a multi-layer ``nn.LSTM`` 's own
            ``dropout``, none for a ``ModuleList``.
        loss: ``"cross_entropy"`` (the module's loss is cross-entropy of the logits) or ``"nll"`` (it applies
            ``log_softmax`` and ``nll_loss``): the same value, the mean over the batch's target tokens.
        ignore_index: a target id that is not a token (padding), left out of the loss and of the token count.
        time_first: batches are ``(inputs, targets)`` with inputs ``(T, B)`` and targets ``(T, B)`` or flat
            ``(T * B,)``, as word_language_model and AWD-LSTM make them; default: ``(B, T)``.
        carry_state: every LSTM layer starts a batch from the ``(h, c)`` its rows ended the previous batch with,
            detached (truncated BPTT over a token stream); reset at every training epoch and evaluation.
        init: ``init(block_name, module)`` sets a block's initial values when the module was built on the meta
            device (``trainer.init_module(empty_init=True)``); default: the module's ``reset_parameters()``, seeded
            per block. Not used for a module built normally.
        log_name: the names the strategy logs under; ``{split}`` is train/val/test, ``{metric}`` loss, ppl or
            tokens_per_s (``"{split}/{metric}"`` gives ``train/loss``, ``val/ppl``).
    """

    embedding: str
    lstm: str
    decoder: str
    dropout: str | float | None = None
    layer_dropout: str | float | None = None
    loss: str = "cross_entropy"
    ignore_index: int | None = None
    time_first: bool = False
    carry_state: bool = False
    init: Callable[[str, nn.Module], None] | None = None
    log_name: str = "{split}_{metric}"

    def __post_init__(self) -> None:
        for field_name in ("embedding", "lstm", "decoder"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ModelDeclarationError(f"LSTMBlocks.{field_name} must name a submodule (an attribute path "
                                            f"such as 'encoder'), got {value!r}")
        if self.loss not in LOSSES:
            raise ModelDeclarationError(f"LSTMBlocks.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        for field_name in ("dropout", "layer_dropout"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not (value is None or isinstance(value, str)
                                               or (isinstance(value, (int, float)) and 0 <= value < 1)):
                raise ModelDeclarationError(f"LSTMBlocks.{field_name} must name an nn.Dropout submodule or be a rate "
                                            f"in [0, 1), got {value!r}")
        if "{split}" not in self.log_name or "{metric}" not in self.log_name:
            raise ModelDeclarationError(f"LSTMBlocks.log_name must contain {{split}} and {{metric}}, got "
                                        f"{self.log_name!r}")

    def bind(self, module: nn.Module, seed: int | None = None) -> PipelineModel:
        """The pipeline view of ``module`` (checks that the named submodules exist and have the right kinds).

        Args:
            module: the LightningModule (or any ``nn.Module``) the names refer to.
            seed: the seed of the per-block initial values of a module built on meta (default: torch's initial
                seed, which ``seed_everything`` sets on every rank).
        """
        from lightning_mp_lstm.language_model import LanguageModelBlocks

        return LanguageModelBlocks(module, self, torch.initial_seed() if seed is None else seed)


def _guess(module: nn.Module) -> dict[str, str]:
    """The attribute paths of ``module``'s first embedding, LSTM stack, linear layer and dropout, for the message."""
    found: dict[str, str] = {}
    for name, child in module.named_modules():
        if not name:
            continue
        if isinstance(child, nn.Embedding):
            found.setdefault("embedding", name)
        elif isinstance(child, nn.LSTM) or (isinstance(child, nn.ModuleList) and child
                                            and all(isinstance(c, nn.LSTM) for c in child)):
            found.setdefault("lstm", name)  # a ModuleList of LSTMs comes before its members
        elif isinstance(child, nn.Linear):
            found["decoder"] = name  # the last one
        elif isinstance(child, nn.Dropout):
            found.setdefault("dropout", name)
    return found


def missing_declaration_message(module: nn.Module) -> str:
    """What to add to ``module`` so that ``mp_lstm`` can split it: a two-line example with its own attribute names."""
    names = {"embedding": "encoder", "lstm": "rnn", "decoder": "decoder", **_guess(module)}
    dropout = f', dropout="{names["dropout"]}"' if "dropout" in names else ""
    return (
        f"mp_lstm needs to know which parts of {type(module).__name__} are the embedding, the LSTM layers and the "
        f"decoder. Add to {type(module).__name__}:\n\n"
        f"    def configure_pipeline(self):\n"
        f'        return LSTMBlocks(embedding="{names["embedding"]}", lstm="{names["lstm"]}", '
        f'decoder="{names["decoder"]}"{dropout})\n\n'
        f"(from lightning_mp_lstm import LSTMBlocks; say time_first=True for (T, B) batches, carry_state=True to keep "
        f"the hidden state across batches). The strategy then runs the steps itself; see {DOCS_PAGE}"
    )


def pipeline_model(module: nn.Module, seed: int | None = None) -> PipelineModel:
    """The pipeline view of ``module``: its ``configure_pipeline()`` declaration bound to it, or the
    :class:`~lightning_mp_lstm.contract.PipelineModel` that method returns for a custom model (a pipeline view is
    returned as it is).

    Raises:
        ModelDeclarationError: ``module`` has no ``configure_pipeline()`` (the message shows the two lines to add),
            or its declaration does not fit it.
    """
    configure = getattr(module, "configure_pipeline", None)
    if configure is None:
        if isinstance(module, PipelineModel):
            return module  # already a pipeline view
        raise ModelDeclarationError(missing_declaration_message(module))
    declared = configure()
    if isinstance(declared, LSTMBlocks):
        return declared.bind(module, seed)
    try:
        check_model(declared)
    except TypeError as error:
        raise ModelDeclarationError(
            f"{type(module).__name__}.configure_pipeline() must return LSTMBlocks(...) or an object implementing "
            f"lightning_mp_lstm.contract.PipelineModel; {error}"
        ) from None
    return declared
