"""Bring your own LSTM LightningModule: one declaration says which of its submodules are the embedding, the LSTM
stack and the decoder, and which of its own methods compute what runs between them and the loss; ``mp_lstm`` runs
exactly those, split into pipeline stages.

.. code-block:: python

    def configure_pipeline(self):
        return LSTMBlocks(embedding="encoder", lstm="rnns", decoder="decoder",
                          embed="embed", after_lstm="after_lstm", loss="lm_loss", penalty="activation_penalty",
                          time_first=True, carry_state=True)

:class:`LSTMBlocks` is that declaration; the strategy binds it to the module
(:func:`~lightning_mp_lstm.models.binding.pipeline_model`), getting a
:class:`~lightning_mp_lstm.models.contract.PipelineModel`: the blocks ``encoder``, ``rnns.0`` ... ``rnns.{N-1}``,
``decoder`` (a multi-layer ``nn.LSTM`` is split per layer, parameter names unchanged), the module's own glue and loss
methods called where their inputs live, example inputs, costs and initial values for the planner, carried state and
the vocabulary-parallel split. The module itself is not changed until the strategy prunes it to the blocks a process
holds, and it never learns that it is pipelined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = ["LOSSES", "LSTMBlocks", "ModelDeclarationError", "REDUCTIONS", "missing_declaration_message"]

#: The built-in losses a declaration may name: cross-entropy of the decoder's logits, or the negative log-likelihood of
#: their log-softmax (the same number: word_language_model's ``log_softmax`` + ``nll_loss``). Any other string names
#: a method of the module: ``loss(logits, targets)``.
LOSSES = ("cross_entropy", "nll")
#: What the module's loss is averaged over, so that the pipeline's pieces (microbatches, time chunks, replicas) add
#: up to it: the batch's target tokens (``F.cross_entropy``'s default), its sequences (summed over time, then the mean
#: over sequences, as char-rnn trains), or nothing (a sum).
REDUCTIONS = ("token_mean", "sequence_mean", "sum")
DOCS_PAGE = "docs/bring_your_own_model.md"


class ModelDeclarationError(TypeError):
    """A module without a pipeline declaration, or a declaration that does not fit the module."""


@dataclass(frozen=True)
class LSTMBlocks:
    """Which submodules of a LightningModule form its LSTM language model, and which of its methods compute the rest
    of its training step, for the ``mp_lstm`` strategy.

    Return it from the module's ``configure_pipeline()``. Names are attribute paths in the module (``"encoder"``,
    ``"model.rnn"``) or names of its methods. The strategy runs the module's training, validation, test and prediction
    steps through the pipeline out of these pieces: the module's own ``*_step`` methods are not called under
    ``mp_lstm`` (check that the pieces add up to them with ``MPLSTMStrategy(verify=True)``). The methods see tensors
    in the module's own layout (``(T, B, ...)`` with ``time_first``) and run on the process that holds their inputs.

    Attributes:
        embedding: the ``nn.Embedding``.
        lstm: a multi-layer ``nn.LSTM`` (split per layer by the library, parameter names unchanged) or an
            ``nn.ModuleList`` of one-layer LSTMs: ``nn.LSTM`` s, or modules wrapping one (AWD-LSTM's ``WeightDrop``)
            or parametrized ones (``torch.nn.utils.parametrize``), called as the module calls them. Unidirectional,
            no projection.
        decoder: the ``nn.Linear`` from the last LSTM layer to the vocabulary (tying its weight to the embedding's
            needs nothing more: tied weights are found from the parameters; the shape is read from the weight).
        dropout: standard dropout after the embedding (unless ``embed`` is given) and after the last LSTM layer
            (unless ``after_lstm`` is given): the name of an ``nn.Dropout`` submodule (``"drop"``), a rate, or
            ``None``.
        layer_dropout: dropout between LSTM layers (name or rate; unless ``after_lstm`` is given); ``None``: a
            multi-layer ``nn.LSTM`` 's own ``dropout``, none for a ``ModuleList``.
        embed: a method ``embed(tokens) -> x``: what the module computes from the token ids to the first LSTM layer's
            input (embedding dropout, locked dropout on the input, ...). Default: the embedding, then ``dropout``.
        after_lstm: a method ``after_lstm(layer, output) -> x``: what the module does to LSTM layer ``layer`` 's
            output before the next layer or the decoder (locked dropout between layers and on the output, ...).
            Default: ``layer_dropout`` between layers, ``dropout`` after the last.
        loss: ``"cross_entropy"`` (cross-entropy of the logits), ``"nll"`` (the module applies ``log_softmax`` and
            ``nll_loss``: the same value), or a method ``loss(logits, targets)`` returning the loss of the batch it is
            given (or a dict of named terms, summed into the loss and each logged). Averaged as ``reduction`` says.
        reduction: what the loss is averaged over: ``"token_mean"`` (the batch's target tokens, ``ignore_index``
            left out), ``"sequence_mean"`` (summed over time, averaged over sequences) or ``"sum"``; see
            :data:`REDUCTIONS`.
        penalty: a method ``penalty(raw_output, output)`` of the last LSTM layer's output before and after
            ``after_lstm``, added to the training loss (AWD-LSTM's activation regularization on the dropped output
            and temporal activation regularization on the raw one), returning a tensor or a dict of named terms
            (each logged); a mean over the batch (any reduction whose count is proportional to its sequences). It
            applies in training only, as AWD-LSTM applies it.
        ignore_index: a target id that is not a token (padding), left out of the token count (and of the built-in
            losses).
        time_first: batches are ``(inputs, targets)`` with inputs ``(T, B)`` and targets ``(T, B)`` or flat
            ``(T * B,)``, as word_language_model and AWD-LSTM make them; default: ``(B, T)``.
        carry_state: every LSTM layer starts a batch from the ``(h, c)`` its rows ended the previous batch with,
            detached (truncated BPTT over a token stream); reset at every training epoch and evaluation.
        init: ``init(block_name, module)`` sets a block's initial values when the module was built on the meta
            device (``trainer.init_module(empty_init=True)``); default: the module's ``reset_parameters()``, seeded
            per block. Not used for a module built normally.
        loss_chunk_tokens: tokens per slice of the built-in loss, which runs the decoder itself a slice at a time so
            that a batch's logits never exist whole (:mod:`~lightning_mp_lstm.models.decoded_loss`); ``None``: as many
            as 64 MiB of logits hold.
        log_name: the names the strategy logs under; ``{split}`` is train/val/test, ``{metric}`` loss, ppl,
            tokens_per_s_step, tokens_per_s_epoch or a term of ``loss`` / ``penalty`` (``"{split}/{metric}"`` gives
            ``train/loss``).
    """

    embedding: str
    lstm: str
    decoder: str
    dropout: str | float | None = None
    layer_dropout: str | float | None = None
    embed: str | None = None
    after_lstm: str | None = None
    loss: str = "cross_entropy"
    reduction: str = "token_mean"
    penalty: str | None = None
    ignore_index: int | None = None
    time_first: bool = False
    carry_state: bool = False
    init: Callable[[str, nn.Module], None] | None = None
    loss_chunk_tokens: int | None = None
    log_name: str = "{split}_{metric}"

    def __post_init__(self) -> None:
        for field_name in ("embedding", "lstm", "decoder"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ModelDeclarationError(f"LSTMBlocks.{field_name} must name a submodule (an attribute path "
                                            f"such as 'encoder'), got {value!r}")
        for field_name in ("embed", "after_lstm", "penalty", "loss"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value.isidentifier()):
                allowed = f"one of {', '.join(LOSSES)} or " if field_name == "loss" else ""
                raise ModelDeclarationError(f"LSTMBlocks.{field_name} must be {allowed}the name of a method of the "
                                            f"module, got {value!r}")
        if self.reduction not in REDUCTIONS:
            raise ModelDeclarationError(f"LSTMBlocks.reduction must be one of {', '.join(REDUCTIONS)}, got "
                                        f"{self.reduction!r}")
        for field_name in ("dropout", "layer_dropout"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not (value is None or isinstance(value, str)
                                               or (isinstance(value, (int, float)) and 0 <= value < 1)):
                raise ModelDeclarationError(f"LSTMBlocks.{field_name} must name an nn.Dropout submodule or be a rate "
                                            f"in [0, 1), got {value!r}")
        unused = [name for name, value, replaced in (("dropout", self.dropout, self.embed and self.after_lstm),
                                                     ("layer_dropout", self.layer_dropout, self.after_lstm))
                  if value is not None and replaced]
        if unused:
            raise ModelDeclarationError(
                f"LSTMBlocks.{unused[0]}={getattr(self, unused[0])!r} would never run: the declared embed/after_lstm "
                "methods replace it; apply that dropout inside them")
        chunk = self.loss_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ModelDeclarationError(f"LSTMBlocks.loss_chunk_tokens must be a positive integer or None, got "
                                        f"{chunk!r}")
        if "{split}" not in self.log_name or "{metric}" not in self.log_name:
            raise ModelDeclarationError(f"LSTMBlocks.log_name must contain {{split}} and {{metric}}, got "
                                        f"{self.log_name!r}")

    @property
    def hooks(self) -> dict[str, str]:
        """The module's methods the declaration names, by role (``embed``, ``after_lstm``, ``loss``, ``penalty``)."""
        named = {"embed": self.embed, "after_lstm": self.after_lstm, "penalty": self.penalty,
                 "loss": None if self.loss in LOSSES else self.loss}
        return {role: name for role, name in named.items() if name is not None}


def _structure(module: nn.Module) -> dict[str, str]:
    """The attribute paths of ``module``'s first embedding, LSTM stack (an ``nn.LSTM`` or an ``nn.ModuleList`` holding
    LSTMs), decoder (an ``nn.AdaptiveLogSoftmaxWithLoss``, else the last ``nn.Linear``) and dropout, and whether its
    LSTM is time first: what its submodules show, whatever its steps do."""
    found: dict[str, str] = {}
    taken: tuple[str, ...] = ()  # the stack and an adaptive softmax are found whole: their submodules are theirs
    for name, child in module.named_modules():
        if not name or name.startswith(taken):
            continue
        lstms = [m for m in child.modules() if isinstance(m, nn.LSTM)]
        if isinstance(child, nn.Embedding):
            found.setdefault("embedding", name)
        elif "lstm" not in found and lstms and isinstance(child, (nn.LSTM, nn.ModuleList)):
            found["lstm"], taken = name, (*taken, f"{name}.")
            if not lstms[0].batch_first:
                found["time_first"] = "True"
        elif isinstance(child, nn.AdaptiveLogSoftmaxWithLoss):
            found["decoder"], found["adaptive"], taken = name, "True", (*taken, f"{name}.")
        elif isinstance(child, nn.Linear) and "adaptive" not in found:
            found["decoder"] = name  # the last one
        elif isinstance(child, nn.Dropout):
            found.setdefault("dropout", name)
    return found


def missing_declaration_message(module: nn.Module) -> str:
    """What to add to ``module`` so that ``mp_lstm`` can split it: the declaration its submodules show, with its own
    attribute names (time-first batches when its LSTM is not ``batch_first``, its ``nn.Dropout``), and what only its
    author can add: its steps are not read; the numerical check compares them with the declaration."""
    name = type(module).__name__
    found = _structure(module)
    names = {"embedding": "encoder", "lstm": "rnn", "decoder": "decoder", **found}
    decoder = "its adaptive softmax" if found.get("adaptive") else "its last nn.Linear"
    shown = [f"{names[role]} {what}" if role in found else f"no {kind} found ({names[role]!r} stands in)"
             for role, what, kind in (("embedding", "is its nn.Embedding", "nn.Embedding"),
                                      ("lstm", "its LSTM stack", "nn.LSTM"),
                                      ("decoder", decoder, "nn.Linear"))]
    extra = []
    if "dropout" in found:
        extra.append(f'dropout="{names["dropout"]}"')
        shown.append(f"{names['dropout']} an nn.Dropout")
    if found.get("time_first"):
        extra.append("time_first=True")
        shown.append("its LSTM takes (T, B) inputs (batch_first=False)")
    args = "".join(f", {e}" for e in extra)
    return (
        f"mp_lstm needs to know which parts of {name} are the embedding, the LSTM layers and the decoder. Add to "
        f"{name}:\n\n"
        f"    def configure_pipeline(self):\n"
        f'        return LSTMBlocks(embedding="{names["embedding"]}", lstm="{names["lstm"]}", '
        f'decoder="{names["decoder"]}"{args})\n\n'
        f"This comes from the structure of {name} alone, not from its training_step: {', '.join(shown)}. Name in "
        "the declaration whatever else its training_step does: dropouts it draws itself (embed=, after_lstm=), a "
        "regularizer such as AR/TAR (penalty=), state carried across batches (carry_state=True), an NLL loss on "
        'log-probabilities (loss="nll") or a loss of its own (loss=). Import it with `from lightning_mp_lstm import '
        "LSTMBlocks`. The strategy then runs these pieces instead of training_step and, by default "
        f"(MPLSTMStrategy(verify=...)), checks them against {name}'s own training_step numerically at the first "
        f"training batch, stopping with what differs. See {DOCS_PAGE}"
    )
