"""A user's LSTM language model seen as pipeline blocks: :class:`LanguageModelBlocks`, what
:func:`~lightning_mp_lstm.models.binding.bind` returns.

It implements :class:`~lightning_mp_lstm.models.contract.PipelineModel` from the declared modules alone: block names
from their attribute paths, pruning without renaming, initial values of meta-built blocks seeded per block, example
inputs and analytic costs from the modules' shapes, the token loss, batches in the user's layout (time-first
included), carried ``(h, c)`` per microbatch, and the vocabulary-parallel split of the embedding and decoder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mp_lstm.models import costs
from lightning_mp_lstm.models.batch_layout import check_time_axis, rows_first
from lightning_mp_lstm.models.block_copies import BlockCopies
from lightning_mp_lstm.models.blocks import (
    DecoderBlock,
    EmbeddingBlock,
    LayerwiseLSTM,
    LSTMLayerBlock,
    dropout_module,
    lstm_layer_names,
    plain_lstm,
    single_lstm,
)
from lightning_mp_lstm.models.carried_state import CarriedState
from lightning_mp_lstm.models.declaration import LSTMBlocks, ModelDeclarationError
from lightning_mp_lstm.models.decoded_loss import (
    adaptive_clusters,
    chunk_tokens,
    decoded_predictions,
    decoder_sizes,
    is_adaptive,
    logits_per_token,
)
from lightning_mp_lstm.models.objective import Objective
from lightning_mp_lstm.models.shapes import meta_copy
from lightning_mp_lstm.models.vocabulary_parallel import VocabularyParallel

__all__ = ["LanguageModelBlocks", "prediction_from_logits"]

_NO_TARGET = -100  # what the loss skips when the declaration names no ignore_index (cross_entropy's default)


def prediction_from_logits(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = 0) -> dict[str, Any]:
    """(B, T, V) logits and (B, T) targets -> per-token target log-probabilities, next-token ids and the mask."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    mask = targets != ignore_index
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"log_probs": picked.masked_fill(~mask, 0.0), "next_token": log_probs.argmax(-1), "mask": mask}


def _parent(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (module.get_submodule(parent) if parent else module), name


class LanguageModelBlocks(BlockCopies, CarriedState, VocabularyParallel):
    """The pipeline blocks of a module declared with :class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`.

    Args:
        module: the user's module (pruned in place by :meth:`keep_blocks`, nothing else is changed).
        declaration: which submodules are which.
        seed: seed of the per-block initial values of blocks built on the meta device.

    Raises:
        ModelDeclarationError: a named submodule is missing or of the wrong kind.
    """

    def __init__(self, module: nn.Module, declaration: LSTMBlocks, seed: int) -> None:
        self.module, self.declaration, self.seed = module, declaration, int(seed)
        d = declaration
        embedding, lstm, decoder = (self._find(d.embedding, "an nn.Embedding", nn.Embedding),
                                    self._find(d.lstm, "an nn.LSTM or an nn.ModuleList of LSTM layers", nn.Module),
                                    self._find(d.decoder, "an nn.Linear or an nn.AdaptiveLogSoftmaxWithLoss",
                                               (nn.Linear, nn.AdaptiveLogSoftmaxWithLoss)))
        self.stacked = isinstance(lstm, (nn.LSTM, LayerwiseLSTM))  # one multi-layer module, else a ModuleList
        if not self.stacked and not isinstance(lstm, nn.ModuleList):
            raise ModelDeclarationError(f"LSTMBlocks.lstm={d.lstm!r} must be an nn.LSTM or an nn.ModuleList of "
                                        f"one-layer LSTMs, got {type(lstm).__name__}")
        self.sizes = self._layer_sizes(lstm)
        self.vocab_size, self.decoder_in = decoder_sizes(decoder)
        self.embedding_dim = embedding.embedding_dim
        if self.decoder_in != self.sizes[-1][1] or self.sizes[0][0] != self.embedding_dim:
            raise ModelDeclarationError(
                f"the declared blocks do not chain: embedding width {self.embedding_dim} -> LSTM layer sizes "
                f"{self.sizes} -> decoder input {self.decoder_in} ({type(decoder).__name__} of "
                f"{self.vocab_size} words)")
        self.block_names = [d.embedding, *(f"{d.lstm}.{k}" for k in range(len(self.sizes))), d.decoder]
        self.ignore_index = d.ignore_index if d.ignore_index is not None else _NO_TARGET
        self.log_name = d.log_name
        self.reduction = d.reduction
        self._hooks = {role: self._method(role, name) for role, name in d.hooks.items()}
        #: The built-in loss runs the decoder itself, a slice of tokens at a time: the decoder block hands it its
        #: inputs, and a batch's logits never exist whole (:mod:`~lightning_mp_lstm.models.decoded_loss`). A loss
        #: method of the module's own takes the logits.
        self.decodes_in_loss = "loss" not in self._hooks
        if is_adaptive(decoder) and not self.decodes_in_loss:
            raise ModelDeclarationError(f"LSTMBlocks.loss={d.loss!r}: {d.decoder!r} is an adaptive softmax, which "
                                        "computes its own loss from the targets and has no logits to give a loss "
                                        "method; declare loss='cross_entropy'")
        self.objective = Objective(self._hooks.get("loss"), self._hooks.get("penalty"), d.reduction,
                                   self.ignore_index, d.time_first, d.hooks,
                                   decoder=(lambda: self._get(d.decoder)) if self.decodes_in_loss else None,
                                   slice_tokens=d.loss_chunk_tokens)
        # What the embedding and the decoder look like, without their values: for a copy of a block this process
        # does not hold (timing, probing, initial values of a meta-built block).
        self._templates = {path: self._shape_of(module) for path, module in ((d.embedding, embedding),
                                                                             (d.decoder, decoder))}
        self._dropout = self._dropout_of(d.dropout)
        inner = d.layer_dropout if d.layer_dropout is not None else (lstm.dropout if self.stacked else None)
        self._layer_dropout = self._dropout_of(inner)
        #: The dropout a multi-layer ``nn.LSTM`` applies between its layers inside torch's kernel (none declared).
        self.kernel_dropout = self._layer_dropout if d.layer_dropout is None and self.stacked else None
        self._layers: dict[int, LSTMLayerBlock] = {}
        self._checked_layout = False
        # Whether the decoder's weight is the embedding's: its copy on a process without the embedding starts as
        # the embedding does.
        self._ties = {d.decoder: d.embedding} if getattr(decoder, "weight", None) is embedding.weight else {}

    def _shape_of(self, module: nn.Module) -> nn.Module:
        try:
            return meta_copy(module)
        except (RuntimeError, TypeError):  # a module deepcopy refuses: a stand-in of its kind and size
            with torch.device("meta"):
                if isinstance(module, nn.Embedding):
                    return nn.Embedding(self.vocab_size, self.embedding_dim)
                if is_adaptive(module):
                    return nn.AdaptiveLogSoftmaxWithLoss(module.in_features, module.n_classes, module.cutoffs[:-1],
                                                         module.div_value, module.head_bias)
                return nn.Linear(self.decoder_in, self.vocab_size)

    def _layer_sizes(self, lstm: nn.Module) -> list[tuple[int, int]]:
        """``(input, hidden)`` of every layer, checking the kinds: unidirectional LSTMs with biases, no projection;
        a ``ModuleList`` of one-layer LSTMs or modules wrapping one."""
        path = self.declaration.lstm
        if self.stacked:
            inner = [lstm] if isinstance(lstm, nn.LSTM) else []
        else:
            inner = [single_lstm(layer) for layer in lstm]
            for k, (layer, found) in enumerate(zip(lstm, inner)):
                if found is None:
                    raise ModelDeclarationError(
                        f"{path}.{k} ({type(layer).__name__}) must be an nn.LSTM or a module wrapping exactly one "
                        f"(as AWD-LSTM's WeightDrop does); it holds "
                        f"{sum(isinstance(m, nn.LSTM) for m in layer.modules())}")
                if found.num_layers != 1:
                    raise ModelDeclarationError(f"{path}: every LSTM of a ModuleList must have one layer (got "
                                                f"num_layers={found.num_layers}); or name one multi-layer nn.LSTM")
        for found in inner:
            if found.bidirectional or found.proj_size or not found.bias:
                raise ModelDeclarationError(f"{path}: mp_lstm splits unidirectional LSTMs with biases and no "
                                            "projection (bidirectional=False, proj_size=0, bias=True)")
        if self.stacked:
            return [(lstm.input_size if k == 0 else lstm.hidden_size, lstm.hidden_size)
                    for k in range(lstm.num_layers)]
        return [(found.input_size, found.hidden_size) for found in inner]

    def _method(self, role: str, name: str) -> Any:
        method = getattr(self.module, name, None)
        if not callable(method) or isinstance(method, nn.Module):
            methods = sorted(n for n in dir(type(self.module)) if not n.startswith("_")
                             and callable(getattr(type(self.module), n, None)) and n not in dir(nn.Module))
            raise ModelDeclarationError(f"LSTMBlocks.{role}={name!r}: {type(self.module).__name__} has no method "
                                        f"{name!r}; its own methods: {methods}")
        return method

    # ----- finding and replacing the user's modules -------------------------------------------------------
    def _find(self, path: str, kind: str, cls: type | tuple[type, ...]) -> nn.Module:
        try:
            found = self.module.get_submodule(path)
        except AttributeError:
            children = [name for name, _ in self.module.named_children()]
            raise ModelDeclarationError(f"{type(self.module).__name__} has no submodule {path!r} (declared as "
                                        f"{kind}); its submodules: {children}") from None
        if not isinstance(found, cls):
            raise ModelDeclarationError(f"{path!r} must be {kind}, got {type(found).__name__}")
        return found

    def _dropout_of(self, value: str | float | None) -> nn.Module | None:
        if isinstance(value, str):
            return self._find(value, "an nn.Dropout", nn.Module)
        return dropout_module(value)

    def _get(self, path: str) -> nn.Module | None:
        parent, name = _parent(self.module, path)
        return getattr(parent, name)

    def _set(self, path: str, value: nn.Module | None) -> None:
        parent, name = _parent(self.module, path)
        setattr(parent, name, value)

    def _stack(self) -> LayerwiseLSTM | nn.ModuleList:
        return self._get(self.declaration.lstm)

    def _layer_weights(self, layer: int) -> list[torch.Tensor]:
        """The layer's parameters: ``[w_ih, w_hh, b_ih, b_hh]`` of a layer run from its weights, else every
        parameter of the user's layer module."""
        stack = self._stack()
        if self.stacked:
            return [getattr(stack, name) for name in lstm_layer_names(layer)]
        if plain_lstm(stack[layer]):
            return [getattr(stack[layer], name) for name in lstm_layer_names(0)]
        return list(stack[layer].parameters())

    def _layerwise(self) -> LayerwiseLSTM:
        """The stacked LSTM as a :class:`LayerwiseLSTM` (replacing the user's ``nn.LSTM``: same parameters and
        names)."""
        stack = self._stack()
        if not isinstance(stack, LayerwiseLSTM):
            stack = LayerwiseLSTM(stack)
            self._set(self.declaration.lstm, stack)
        return stack

    def _layer_present(self, layer: int) -> bool:
        stack = self._stack()
        if self.stacked:
            return hasattr(stack, f"weight_ih_l{layer}")
        return stack[layer] is not None

    # ----- the contract: blocks -----------------------------------------------------------------------------
    def _block(self, name: str) -> nn.Module | None:
        d = self.declaration
        if name == d.embedding:
            module = self._get(name)
            return (EmbeddingBlock(module, self._dropout, self._hooks.get("embed"), d.time_first)
                    if module is not None else None)
        if name == d.decoder:
            module = self._get(name)
            return DecoderBlock(module, decodes_in_loss=self.decodes_in_loss) if module is not None else None
        layer = self.block_names.index(name) - 1
        if not self._layer_present(layer):
            return None
        block = self._layers.get(layer)
        if block is None:
            block = self._layer_block(layer)
            self._layers[layer] = block
        stack = self._stack()
        if self.stacked or plain_lstm(stack[layer]):
            block.set_weights(self._layer_weights(layer))  # the current parameters (materializing replaces them)
        else:
            block.set_module(stack[layer], single_lstm(stack[layer]).batch_first)
        return block

    def _layer_block(self, layer: int) -> LSTMLayerBlock:
        last = layer == len(self.sizes) - 1
        penalty = self.objective if last and "penalty" in self._hooks else None
        return LSTMLayerBlock(self._dropout if last else self._layer_dropout, self._hooks.get("after_lstm"), layer,
                              self.declaration.time_first, penalty)

    def blocks(self, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
        """The present blocks (optionally only ``names``), in model order.

        Raises:
            KeyError: a named block is not on this process.
        """
        present = [(n, b) for n in self.block_names if (names is None or n in names) for b in [self._block(n)]
                   if b is not None]
        if names is not None:
            missing = sorted(set(names) - {n for n, _ in present})
            if missing:
                raise KeyError(f"blocks {missing} are not on this process; present: {[n for n, _ in present]}")
        return present

    def keep_blocks(self, names: Sequence[str]) -> None:
        """Remove every other block from the module; the kept parameters keep their names."""
        unknown = sorted(set(names) - set(self.block_names))
        if unknown:
            raise KeyError(f"unknown block names {unknown}; valid: {self.block_names}")
        d = self.declaration
        for path in (d.embedding, d.decoder):
            if path not in names:
                self._set(path, None)
        kept = [self.block_names.index(n) - 1 for n in names if n not in (d.embedding, d.decoder)]
        stack = self._stack()
        if self.stacked:
            if len(kept) < len(self.sizes) or isinstance(stack, LayerwiseLSTM):  # nn.LSTM cannot lose layers
                stack = self._layerwise()
                stack.keep_layers(kept)
        else:
            for layer in range(len(self.sizes)):
                if layer not in kept:
                    stack[layer] = None

    def example_input(self, name: str, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Token ids for the embedding, activations of the right width for the other blocks."""
        if name == self.declaration.embedding:
            return torch.randint(0, self.vocab_size, (rows, length), device=device)
        width = self.decoder_in if name == self.declaration.decoder else self.sizes[self.block_names.index(name) - 1][0]
        return torch.randn(rows, length, width, device=device)

    def example_targets(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Target ids as a corpus draws them: Zipf's law over ids ordered by frequency (the probability of id ``k``
        about ``1 / (k + 1)``). An adaptive softmax's cost depends on it: uniform ids would put three quarters of
        WikiText-103's tokens in its rarest cluster, where a corpus puts a tenth."""
        spread = torch.rand(rows, length, device=device) * math.log(self.vocab_size + 1)
        return (spread.exp().long() - 1).clamp_(0, self.vocab_size - 1)

    def analytic_costs(self, kind: str, rows: int, length: int) -> dict[str, float]:
        """``"flops"`` of a ``rows x length`` batch, ``"memory"`` bytes (parameters, gradients, Adam-sized optimizer
        state) or ``"parameters"`` of every block, from the modules' sizes."""
        hidden = tuple(h for _, h in self.sizes)
        shape = costs.ModelShape(self.vocab_size, self.embedding_dim, hidden[0], len(hidden),
                                 bool(self._ties), layer_hidden_sizes=hidden)
        if kind == "flops":
            values = costs.flop_costs(shape, rows, [length])
        elif kind == "memory":
            values = costs.memory_costs(shape)
        elif kind == "parameters":
            values = {k: float(v) for k, v in costs.parameter_counts(shape).items()}
        else:
            raise ValueError(f"unknown cost kind {kind!r}; allowed: flops, memory, parameters")
        values = dict(zip(self.block_names, values.values(), strict=True))
        adaptive = self._templates[self.declaration.decoder]
        if is_adaptive(adaptive):  # its head scores every token, each cluster only the tokens it holds
            parameters = float(sum(p.numel() for p in adaptive.parameters()))
            per_token = adaptive.head.weight.numel() + sum(share * width * (self.decoder_in + words)
                                                           for share, words, width in adaptive_clusters(adaptive))
            values[self.declaration.decoder] = {"flops": 3 * 2 * rows * length * per_token,
                                                "memory": 16.0 * parameters}.get(kind, parameters)
        return values

    # ----- what the memory plan reads (lightning_mp_lstm.planning.memory) -------------------------------------
    @property
    def logits_width(self) -> int:
        """Logits per token the loss computes (:func:`~lightning_mp_lstm.models.decoded_loss.logits_per_token`)."""
        return int(logits_per_token(self._templates[self.declaration.decoder]))

    @property
    def loss_slice_tokens(self) -> int | None:
        """Tokens per slice of the loss's logits; ``None``: the module's own loss takes a microbatch's whole."""
        if not self.decodes_in_loss:
            return None
        return self.declaration.loss_chunk_tokens or chunk_tokens(self._templates[self.declaration.decoder])

    @property
    def tied_numel(self) -> int:
        """Elements of the matrix the decoder shares with the embedding (0: untied)."""
        return self.vocab_size * self.decoder_in if self._ties else 0

    # ----- the contract: batches, loss, predictions --------------------------------------------------------
    def prepare_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of a batch, rows first ``(B, T)``, whatever layout the declaration says
        (:func:`~lightning_mp_lstm.models.batch_layout.rows_first`; the first batch's time axis is checked too)."""
        inputs, targets = rows_first(batch[0], batch[1], self.declaration.time_first)
        if not self._checked_layout:
            self._checked_layout = True
            shown = (inputs.t(), targets.t()) if self.declaration.time_first else (inputs, targets)
            check_time_axis(*shown, self.declaration.time_first, self.ignore_index)
        return inputs, targets

    def batch_weights(self, targets: torch.Tensor) -> torch.Tensor:
        """``[target tokens, sequences]`` of a replica's real rows (``ignore_index`` left out of the tokens)."""
        return self.objective.batch_weights(targets)

    def start_batch(self, counts: torch.Tensor, microbatch_rows: Sequence[int], accumulation: int) -> None:
        """See :meth:`~lightning_mp_lstm.models.objective.Objective.start_batch`."""
        self.objective.start_batch(counts, microbatch_rows, accumulation)

    def microbatch_loss(self, outputs: Any, targets: torch.Tensor, microbatch: int | None = None,
                        block: nn.Module | None = None) -> torch.Tensor:
        """Microbatch ``microbatch`` 's piece of the batch loss: the declared loss, scaled by its reduction
        (vocabulary-sharded logits: with ``loss_parallel``); ``None``: the microbatch's own loss, for timing.
        ``block``: the decoder block that gave ``outputs`` when it is not the module's own (a copy being timed)."""
        decoder = getattr(block, "decoder", None) if block is not None else None
        return self.objective.microbatch_loss(outputs, targets, microbatch, decoder)

    def finish_batch(self) -> dict[str, torch.Tensor]:
        """This process's pieces of the batch's loss (``"loss"``) and of its named terms."""
        return self.objective.finish_batch()

    @property
    def loss_blocks(self) -> list[str]:
        """The blocks whose stages compute pieces of the loss: the decoder's, and the last LSTM layer's with a
        penalty."""
        return [self.block_names[-1], *([self.block_names[-2]] if "penalty" in self._hooks else [])]

    @property
    def term_names(self) -> list[str] | None:
        """The names :meth:`finish_batch` reports, when known before running the module's methods."""
        return self.objective.static_terms

    def pad_rows(self, inputs: torch.Tensor, targets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` more rows whose targets are all ignored."""
        return (torch.cat([inputs, inputs.new_zeros((rows, *inputs.shape[1:]))]),
                torch.cat([targets, targets.new_full((rows, *targets.shape[1:]), self.ignore_index)]))

    def predictions(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token target log-probabilities, the most likely next tokens and the target mask (B, T)."""
        if self.decodes_in_loss:
            return decoded_predictions(outputs, self._get(self.declaration.decoder), targets, self.ignore_index,
                                       self.declaration.loss_chunk_tokens)
        if isinstance(outputs, DTensor):
            outputs = outputs.full_tensor()  # prediction needs every word
        return prediction_from_logits(outputs, targets, self.ignore_index)

    def restore_layout(self, result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Prediction tensors in the batches' own layout (``(T, B)`` for time-first batches)."""
        return {k: v.t().contiguous() for k, v in result.items()} if self.declaration.time_first else result
