"""The pipeline blocks of an LSTM language model: views onto a user's own modules, never copies.

A block maps one tensor to one tensor, batch first: the embedding (token ids -> vectors, then dropout), one LSTM
layer (vectors -> vectors, carrying ``(h, c)`` across batches when asked), the decoder (vectors -> logits). The
blocks are not registered on the user's module, so its parameter names never change; a multi-layer ``nn.LSTM``
is split into layers by :class:`LayerwiseLSTM`, which holds the very same parameters under the very same names
(``rnn.weight_ih_l2``), so a process can keep only some of the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_mp_lstm.models.objective import to_user_layout

__all__ = ["DecoderBlock", "EmbeddingBlock", "LSTMLayerBlock", "LayerwiseLSTM", "TimeChunk", "lstm_layer_names",
           "plain_lstm", "run_lstm_module", "single_lstm"]


def lstm_layer_names(layer: int) -> list[str]:
    """The parameter names ``nn.LSTM`` gives layer ``layer`` (unidirectional, with biases, no projection)."""
    return [f"weight_ih_l{layer}", f"weight_hh_l{layer}", f"bias_ih_l{layer}", f"bias_hh_l{layer}"]


def _lstm_sizes(layer: int, input_size: int, hidden_size: int) -> list[tuple[int, ...]]:
    width = input_size if layer == 0 else hidden_size
    return [(4 * hidden_size, width), (4 * hidden_size, hidden_size), (4 * hidden_size,), (4 * hidden_size,)]


class LayerwiseLSTM(nn.Module):
    """A multi-layer ``nn.LSTM`` taken apart by layer, with the parameter names ``nn.LSTM`` gives them.

    It replaces the user's ``nn.LSTM`` attribute (same parameters, same names, nothing copied); removing layers
    (:meth:`keep_layers`) never renames the others, so checkpoints of any layout load into the plain module.

    Args:
        lstm: the ``nn.LSTM`` to take apart (unidirectional, with biases, no projection).
    """

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.num_layers = lstm.input_size, lstm.hidden_size, lstm.num_layers
        self.dropout = float(lstm.dropout)  # between layers, in training, as nn.LSTM applies it
        self.batch_first = lstm.batch_first
        for layer in range(self.num_layers):
            for name in lstm_layer_names(layer):
                self.register_parameter(name, getattr(lstm, name))

    def layers(self) -> list[int]:
        """The layers present (in order)."""
        return [k for k in range(self.num_layers) if hasattr(self, f"weight_ih_l{k}")]

    def layer_parameters(self, layer: int) -> list[torch.Tensor]:
        return [getattr(self, name) for name in lstm_layer_names(layer)]

    def keep_layers(self, layers: Iterable[int]) -> None:
        """Remove every other layer's parameters."""
        kept = set(layers)
        for layer in self.layers():
            if layer not in kept:
                for name in lstm_layer_names(layer):
                    delattr(self, name)

    def set_layer(self, layer: int, values: list[torch.Tensor]) -> None:
        """Give layer ``layer`` these tensors as its parameters (materializing a layer built on meta)."""
        for name, value in zip(lstm_layer_names(layer), values, strict=True):
            setattr(self, name, nn.Parameter(value))

    def new_layer(self, layer: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh tensors for layer ``layer``, initialized as ``nn.LSTM.reset_parameters`` does (global generator)."""
        bound = 1.0 / self.hidden_size**0.5
        return [torch.empty(size, device=device).uniform_(-bound, bound)
                for size in _lstm_sizes(layer, self.input_size, self.hidden_size)]

    @override
    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, layers held={self.layers()}"


def without_autocast(x: torch.Tensor) -> Any:
    """A context in which autocast is off on ``x``'s device.

    Under autocast, torch's rule for cuDNN RNNs runs them in float16 whatever dtype was asked for, and mixed
    precision in this library has no loss scaling: LSTM layers always run in their weights' dtype (float32 under
    ``bf16-mixed``, bfloat16 under ``bf16-true``) while the vocabulary layers follow autocast.
    """
    device = x.device.type
    if device == "meta":  # autocast has no meta device (a model's shapes being probed)
        return nullcontext()
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext()


def run_lstm_layer(weights: list[torch.Tensor], x: torch.Tensor, state: Any, training: bool) -> tuple[Any, Any]:
    """One batch-first LSTM layer over ``x`` (B, T, in) from ``state`` (``(h, c)`` or ``None``): what ``nn.LSTM``
    computes for one layer (the same kernel, cuDNN on GPUs), in the weights' dtype with autocast off."""
    with without_autocast(x):
        x = x.to(weights[0].dtype)
        if state is None:
            zeros = x.new_zeros(1, x.shape[0], weights[1].shape[1])
            state = (zeros, zeros)
        out, h, c = torch._VF.lstm(x, tuple(t.to(x.dtype) for t in state), weights, True, 1, 0.0, training, False,
                                   True)
    return out, (h, c)


def single_lstm(module: nn.Module) -> nn.LSTM | None:
    """The one ``nn.LSTM`` a layer module is or wraps (AWD-LSTM's ``WeightDrop``, a parametrized ``nn.LSTM``), or
    ``None`` when it holds none or several."""
    found = [m for m in module.modules() if isinstance(m, nn.LSTM)]
    return found[0] if len(found) == 1 else None


def plain_lstm(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.LSTM`` as torch makes it (no subclass, parametrization or hook): its weights can
    be run directly, batch first, without calling it."""
    return (type(module) is nn.LSTM and not module._forward_hooks and not module._forward_pre_hooks
            and not getattr(module, "parametrizations", None))


def run_lstm_module(module: nn.Module, batch_first: bool, x: torch.Tensor, state: Any) -> tuple[Any, Any]:
    """Call a user's one-layer LSTM module (or its wrapper) on a batch-first ``x`` from ``state``, as the module is
    called in its own code (in its own layout, its weights' dtype, autocast off); the output comes back batch first.

    Raises:
        TypeError: the module does not return ``(output, (h, c))`` as ``nn.LSTM`` does.
    """
    with without_autocast(x):
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), x.dtype)
        inputs = x.to(dtype) if batch_first else x.to(dtype).transpose(0, 1)
        result = module(inputs, None if state is None else tuple(t.to(dtype) for t in state))
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple) and len(result[1]) == 2):
        raise TypeError(f"{type(module).__name__} must return (output, (h, c)) as nn.LSTM does, got "
                        f"{type(result).__name__}")
    out, (h, c) = result
    return (out if batch_first else out.transpose(0, 1)), (h, c)


def _from_user_layout(x: torch.Tensor, time_first: bool) -> torch.Tensor:
    return x.transpose(0, 1) if time_first else x


class EmbeddingBlock(nn.Module):
    """Token ids -> the first LSTM layer's input: the module's own ``embed`` method (in the module's layout), or the
    embedding, then dropout (if declared).

    Dropout runs after the embedding module's call, hooks included: a vocabulary-parallel (row-wise) embedding
    all-reduces its output in a hook, and dropout must see the sum.
    """

    def __init__(self, embedding: nn.Module, dropout: nn.Module | None, embed: Callable[..., Any] | None = None,
                 time_first: bool = False) -> None:
        super().__init__()
        self.embedding = embedding
        self.dropout = dropout
        self.embed = embed
        self.time_first = time_first

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return _from_user_layout(self.embed(to_user_layout(tokens, self.time_first)), self.time_first)
        x = self.embedding(tokens)
        return _dropped(self.dropout, x, self.time_first)


@dataclass
class TimeChunk:
    """The recurrent state of one LSTM layer around one chunk of the time axis (wavefront pipelining).

    Attributes:
        initial: the ``(h, c)`` the chunk starts from: the previous chunk's final state (a leaf that requires grad
            in training, so its ``.grad`` after this chunk's backward is the previous chunk's state gradient);
            ``None`` for the first chunk (the state carried across batches, or zeros).
        index: which chunk of the batch this is; ``count``: how many chunks it has.
        final: set by the layer: the ``(h, c)`` it ended with, still in the autograd graph.
    """

    initial: tuple[torch.Tensor, torch.Tensor] | None = None
    index: int = 0
    count: int = 1
    final: tuple[torch.Tensor, torch.Tensor] | None = None


class LSTMLayerBlock(nn.Module):
    """One LSTM layer, batch first, contiguous output, then what the module does between layers: its ``after_lstm``
    method (in its layout) or dropout (between layers, or after the last one).

    The layer runs either from its weights (:meth:`set_weights`: a layer of a multi-layer ``nn.LSTM``, or a plain
    one-layer ``nn.LSTM``; the same tensors the user's module holds, registered on the block too, so a pipeline stage
    sees exactly the parameters of its own blocks) or by calling the user's layer module (:meth:`set_module`: a
    wrapper such as AWD-LSTM's ``WeightDrop`` or a parametrized ``nn.LSTM``, which must run its own code). With a
    ``slot`` set (see :meth:`~lightning_mp_lstm.models.language_model_blocks.LanguageModelBlocks.microbatch_context`) it
    starts from the ``(h, c)`` it kept for that slot and keeps the final one, detached: truncated backpropagation
    through time across batches. With a ``time_chunk`` set (:class:`TimeChunk`, by
    :meth:`~lightning_mp_lstm.pipeline.stages.StageModule.forward_chunk`) it starts from the chunk's initial state
    instead (when it has one) and reports its final state with its graph: exact backpropagation through time across
    chunks of one batch. The last layer hands its outputs to the module's penalty (``objective``).

    Args:
        dropout: applied to the layer's output in training (``None``: none), when there is no ``after``.
        after: the module's ``after_lstm(layer, output)`` method, or ``None``.
        layer: the layer's index in the stack (what ``after`` is called with).
        time_first: the module's tensors are ``(T, B, ...)``.
        objective: the module's :class:`~lightning_mp_lstm.models.objective.Objective`, on the last layer when the
            module declares a penalty.
    """

    _NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

    def __init__(self, dropout: nn.Module | None, after: Callable[..., Any] | None = None, layer: int = 0,
                 time_first: bool = False, objective: Any = None) -> None:
        super().__init__()
        self.dropout = dropout
        self.after, self.layer, self.time_first, self.objective = after, layer, time_first, objective
        self.lstm: nn.Module | None = None
        self.batch_first = True
        self.slot: tuple[str, int] | None = None
        self.carried: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.time_chunk: TimeChunk | None = None

    def set_weights(self, weights: list[torch.Tensor]) -> None:
        """Run with these ``[w_ih, w_hh, b_ih, b_hh]`` (the user's parameters, not copies)."""
        for name, weight in zip(self._NAMES, weights, strict=True):
            if self._parameters.get(name) is not weight:
                self.register_parameter(name, weight)

    def set_module(self, module: nn.Module, batch_first: bool) -> None:
        """Run by calling ``module`` (the user's layer, its own code) with inputs in its layout (``batch_first``)."""
        self.lstm, self.batch_first = module, batch_first

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunk = self.time_chunk
        state = chunk.initial if chunk is not None else None
        if state is None and self.slot is not None:
            state = self.carried.get(self.slot)
        if state is not None and state[0].shape[1] != x.shape[0]:
            raise ValueError(
                f"carry_state: a batch of {x.shape[0]} rows follows one of {state[0].shape[1]} rows in the same "
                "stream; carried state needs a constant number of rows (e.g. LMDataModule(mode='stream'))"
            )
        if self.lstm is not None:
            out, (h, c) = run_lstm_module(self.lstm, self.batch_first, x, state)
        else:
            weights = [self._parameters[name] for name in self._NAMES]
            out, (h, c) = run_lstm_layer(weights, x, state, self.training and torch.is_grad_enabled())
        if chunk is not None:
            chunk.final = (h, c)
        if self.slot is not None:  # a later time chunk of the batch overwrites it: the last chunk's state is kept
            self.carried[self.slot] = (h.detach(), c.detach())
        raw = out
        if self.after is not None:
            out = _from_user_layout(self.after(self.layer, to_user_layout(raw, self.time_first)), self.time_first)
        elif self.dropout is not None:
            out = _dropped(self.dropout, raw, self.time_first)
        if self.objective is not None and self.training:
            self.objective.add_penalty(raw, out, chunk.index if chunk is not None else 0,
                                       chunk.count if chunk is not None else 1)
        return out.contiguous()


class DecoderBlock(nn.Module):
    """Vectors -> logits over the vocabulary (optionally after dropout, when no LSTM layer precedes it).

    With ``decodes_in_loss`` the block hands on its (dropped-out) inputs and the loss runs ``decoder`` on them a slice
    of tokens at a time (:mod:`~lightning_mp_lstm.models.decoded_loss`); the decoder's parameters stay this block's.
    """

    def __init__(self, decoder: nn.Module, dropout: nn.Module | None = None, decodes_in_loss: bool = False) -> None:
        super().__init__()
        self.decoder = decoder
        self.dropout = dropout
        self.decodes_in_loss = decodes_in_loss

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x) if self.dropout is not None else x
        return x if self.decodes_in_loss else self.decoder(x)


def _dropped(dropout: nn.Module | None, x: torch.Tensor, time_first: bool) -> torch.Tensor:
    """``dropout`` of the rows-first ``x``, drawn in the module's layout: the mask is the one-process step's shape
    (what the numerical check replays), and the result stays rows first."""
    if dropout is None:
        return x
    if not time_first:
        return dropout(x)
    return _from_user_layout(dropout(to_user_layout(x, time_first)), time_first).contiguous()  # sent to a stage


def dropout_module(value: nn.Module | float | None) -> nn.Module | None:
    """A dropout module from a declared module or rate (``None`` or 0: no dropout)."""
    if value is None or isinstance(value, nn.Module):
        return value
    return nn.Dropout(float(value)) if float(value) > 0 else None
