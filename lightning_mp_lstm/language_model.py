"""A user's LSTM language model seen as pipeline blocks: :class:`LanguageModelBlocks`, what
:meth:`~lightning_mp_lstm.declaration.LSTMBlocks.bind` returns.

It implements :class:`~lightning_mp_lstm.contract.PipelineModel` from the declared modules alone: block names from
their attribute paths, pruning without renaming, initial values of meta-built blocks seeded per block, example
inputs and analytic costs from the modules' shapes, the token loss, batches in the user's layout (time-first
included), carried ``(h, c)`` per microbatch, and the vocabulary-parallel split of the embedding and decoder.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mp_lstm import costs
from lightning_mp_lstm.batch_layout import check_time_axis, rows_first
from lightning_mp_lstm.blocks import (
    DecoderBlock,
    EmbeddingBlock,
    LayerwiseLSTM,
    LSTMLayerBlock,
    dropout_module,
    lstm_layer_names,
    token_cross_entropy,
)
from lightning_mp_lstm.declaration import LSTMBlocks, ModelDeclarationError

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


class LanguageModelBlocks:
    """The pipeline blocks of a module declared with :class:`~lightning_mp_lstm.declaration.LSTMBlocks`.

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
                                    self._find(d.lstm, "an nn.LSTM or an nn.ModuleList of nn.LSTM", nn.Module),
                                    self._find(d.decoder, "an nn.Linear", nn.Linear))
        self.stacked = isinstance(lstm, (nn.LSTM, LayerwiseLSTM))  # one multi-layer module, else a ModuleList
        layers = [lstm] if self.stacked else list(lstm) if isinstance(lstm, nn.ModuleList) else []
        if not layers or not all(isinstance(x, (nn.LSTM, LayerwiseLSTM)) or x is None for x in layers):
            raise ModelDeclarationError(f"LSTMBlocks.lstm={d.lstm!r} must be an nn.LSTM or an nn.ModuleList of "
                                        f"one-layer nn.LSTM, got {type(lstm).__name__}")
        for layer in layers:
            if isinstance(layer, nn.LSTM) and (layer.bidirectional or layer.proj_size or not layer.bias):
                raise ModelDeclarationError(f"{d.lstm}: mp_lstm splits unidirectional LSTMs with biases and no "
                                            "projection (bidirectional=False, proj_size=0, bias=True)")
            if not self.stacked and isinstance(layer, nn.LSTM) and layer.num_layers != 1:
                raise ModelDeclarationError(f"{d.lstm}: every LSTM of a ModuleList must have one layer (got "
                                            f"num_layers={layer.num_layers}); or name one multi-layer nn.LSTM")
        if self.stacked:
            self.sizes = [(lstm.input_size if k == 0 else lstm.hidden_size, lstm.hidden_size)
                          for k in range(lstm.num_layers)]
        else:
            self.sizes = [(x.input_size, x.hidden_size) for x in layers]
        self.vocab_size, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.decoder_in = decoder.in_features
        if self.decoder_in != self.sizes[-1][1] or self.sizes[0][0] != self.embedding_dim:
            raise ModelDeclarationError(
                f"the declared blocks do not chain: embedding width {self.embedding_dim} -> LSTM layer sizes "
                f"{self.sizes} -> decoder input {self.decoder_in}")
        self.block_names = [d.embedding, *(f"{d.lstm}.{k}" for k in range(len(self.sizes))), d.decoder]
        self.ignore_index = d.ignore_index if d.ignore_index is not None else _NO_TARGET
        self.log_name = d.log_name
        self._dropout = self._dropout_of(d.dropout)
        inner = d.layer_dropout if d.layer_dropout is not None else (lstm.dropout if self.stacked else None)
        self._layer_dropout = self._dropout_of(inner)
        self._layers: dict[int, LSTMLayerBlock] = {}
        self._checked_layout = False
        # Whether the decoder's weight is the embedding's: its copy on a process without the embedding starts as
        # the embedding does.
        self._ties = {d.decoder: d.embedding} if decoder.weight is embedding.weight else {}

    # ----- finding and replacing the user's modules -------------------------------------------------------
    def _find(self, path: str, kind: str, cls: type) -> nn.Module:
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
        stack = self._stack()
        if self.stacked:
            return [getattr(stack, name) for name in lstm_layer_names(layer)]
        return [getattr(stack[layer], name) for name in lstm_layer_names(0)]

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
            return EmbeddingBlock(module, self._dropout) if module is not None else None
        if name == d.decoder:
            module = self._get(name)
            return DecoderBlock(module) if module is not None else None
        layer = self.block_names.index(name) - 1
        if not self._layer_present(layer):
            return None
        block = self._layers.get(layer)
        last = layer == len(self.sizes) - 1
        if block is None:
            block = LSTMLayerBlock(self._dropout if last else self._layer_dropout)
            self._layers[layer] = block
        block.set_weights(self._layer_weights(layer))  # the current parameters (materializing replaces them)
        return block

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

    # ----- the contract: initial values and throw-away copies ------------------------------------------------
    def _block_seed(self, name: str) -> int:
        return (self.seed ^ zlib.crc32(name.encode())) % 2**63

    @contextmanager
    def _seeded(self, name: str) -> Iterator[None]:
        # The CPU generator only (materialized on the CPU, then moved): no accelerator generator is reseeded.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self._block_seed(name))
            yield

    def _fresh(self, name: str) -> nn.Module:
        """Block ``name``'s module with its initial values, on the CPU: an ``nn.Embedding``, a one-layer
        ``nn.LSTM`` or the ``nn.Linear``, of the declared modules' sizes and kinds."""
        d = self.declaration
        with self._seeded(name), torch.device("cpu"):
            if name in (d.embedding, d.decoder):
                module = copy.deepcopy(self._template(name))
                module.to_empty(device="cpu")
                module.reset_parameters()
            else:
                width, hidden = self.sizes[self.block_names.index(name) - 1]
                module = nn.LSTM(width, hidden, batch_first=True)
            if d.init is not None:
                d.init(name, module)
        return module

    def _template(self, name: str) -> nn.Module:
        module = self._get(name)
        if module is None:  # pruned: a stand-in of the declared size (its values are set afresh)
            d = self.declaration
            with torch.device("meta"):
                module = (nn.Embedding(self.vocab_size, self.embedding_dim) if name == d.embedding
                          else nn.Linear(self.decoder_in, self.vocab_size))
        return module

    def materialize_blocks(self, names: Sequence[str], device: torch.device) -> None:
        """Give the blocks ``names`` still on the meta device their initial values, on ``device`` (each depends on
        the seed and the block's name only, so every layout starts from the same values)."""
        d = self.declaration
        meta = [n for n in names if any(t.is_meta for t in self._block_tensors(n))]
        for name in meta:
            if name in (d.embedding, d.decoder):
                module = self._get(name)
                fresh = dict(self._fresh(name).named_parameters())
                if name in self._ties:  # the decoder's copy of the tied weight starts as the embedding does
                    fresh["weight"] = self._fresh(self._ties[name]).weight
                module.to_empty(device=device)
                targets = dict(module.named_parameters())
            else:
                layer = self.block_names.index(name) - 1
                fresh = dict(zip(lstm_layer_names(0), self._fresh(name).parameters(), strict=True))
                stack = self._stack()
                if isinstance(stack, LayerwiseLSTM):
                    stack.set_layer(layer, [torch.empty_like(t, device=device) for t in fresh.values()])
                elif self.stacked:
                    if stack.weight_ih_l0.is_meta:
                        stack.to_empty(device=device)  # every layer at once; each gets its values below
                else:
                    stack[layer].to_empty(device=device)
                targets = dict(zip(lstm_layer_names(0), self._layer_weights(layer), strict=True))
            with torch.no_grad():
                for key, target in targets.items():
                    target.copy_(fresh[key])
        if self._ties:
            embedding, decoder = self._get(d.embedding), self._get(d.decoder)
            if embedding is not None and decoder is not None:
                decoder.weight = embedding.weight

    def _block_tensors(self, name: str) -> list[torch.Tensor]:
        if name in (self.declaration.embedding, self.declaration.decoder):
            module = self._get(name)
            return list(module.parameters()) if module is not None else []
        layer = self.block_names.index(name) - 1
        return self._layer_weights(layer) if self._layer_present(layer) else []

    def build_block(self, name: str, device: torch.device) -> nn.Module:
        """A new block ``name`` on ``device`` (for timing; the global random state is left alone)."""
        module = self._fresh(name).to(device)
        d = self.declaration
        if name == d.embedding:
            return EmbeddingBlock(module, self._dropout)
        if name == d.decoder:
            return DecoderBlock(module)
        block = LSTMLayerBlock(self._dropout if name == self.block_names[-2] else self._layer_dropout)
        block.set_weights(list(module.parameters()))
        return block

    def example_input(self, name: str, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Token ids for the embedding, activations of the right width for the other blocks."""
        if name == self.declaration.embedding:
            return torch.randint(0, self.vocab_size, (rows, length), device=device)
        width = self.decoder_in if name == self.declaration.decoder else self.sizes[self.block_names.index(name) - 1][0]
        return torch.randn(rows, length, width, device=device)

    def example_targets(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (rows, length), device=device)

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
        return dict(zip(self.block_names, values.values(), strict=True))

    # ----- the contract: batches, loss, predictions --------------------------------------------------------
    def prepare_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of a batch, rows first ``(B, T)``, whatever layout the declaration says
        (:func:`~lightning_mp_lstm.batch_layout.rows_first`; the first batch's time axis is checked too)."""
        inputs, targets = rows_first(batch[0], batch[1], self.declaration.time_first)
        if not self._checked_layout:
            self._checked_layout = True
            shown = (inputs.t(), targets.t()) if self.declaration.time_first else (inputs, targets)
            check_time_axis(*shown, self.declaration.time_first, self.ignore_index)
        return inputs, targets

    def microbatch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the target tokens (vocabulary-sharded logits: with ``loss_parallel``)."""
        if isinstance(outputs, DTensor):
            logits = outputs.flatten(0, 1).float()
            target = DTensor.from_local(targets.flatten(), outputs.device_mesh, [Replicate()], run_check=False)
            loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")
            return loss.to_local() if isinstance(loss, DTensor) else loss
        return token_cross_entropy(outputs, targets, self.ignore_index)

    def loss_weight(self, targets: torch.Tensor) -> torch.Tensor:
        """The number of target tokens (``ignore_index`` left out)."""
        return (targets != self.ignore_index).sum()

    def pad_rows(self, inputs: torch.Tensor, targets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` more rows whose targets are all ignored."""
        return (torch.cat([inputs, inputs.new_zeros((rows, *inputs.shape[1:]))]),
                torch.cat([targets, targets.new_full((rows, *targets.shape[1:]), self.ignore_index)]))

    def predictions(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token target log-probabilities, the most likely next tokens and the target mask (B, T)."""
        if isinstance(outputs, DTensor):
            outputs = outputs.full_tensor()  # prediction needs every word
        return prediction_from_logits(outputs, targets, self.ignore_index)

    def restore_layout(self, result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Prediction tensors in the batches' own layout (``(T, B)`` for time-first batches)."""
        return {k: v.t().contiguous() for k, v in result.items()} if self.declaration.time_first else result

    # ----- carried state -----------------------------------------------------------------------------------
    @contextmanager
    def microbatch_context(self, microbatch: int | None) -> Iterator[None]:
        """Around every stage forward: with ``carry_state``, the LSTM layers read and keep microbatch
        ``microbatch`` 's state (training and evaluation apart); ``None`` (shape inference) keeps nothing."""
        if not self.declaration.carry_state or microbatch is None:
            yield
            return
        training = any(block.training for block in self._layers.values())
        layers = [self._layers[k] for k in self._layers if self._layer_present(k)]
        for layer in layers:
            layer.slot = ("train" if training else "eval", int(microbatch))
        try:
            yield
        finally:
            for layer in layers:
                layer.slot = None

    def reset_state(self, mode: str) -> None:
        """Forget the carried state of ``"train"`` or ``"eval"`` (a new epoch, a new evaluation)."""
        for block in self._layers.values():
            for slot in [k for k in block.carried if k[0] == mode]:
                del block.carried[slot]

    # ----- tensor parallel -----------------------------------------------------------------------------------
    def check_tensor_parallel(self, size: int) -> None:
        """Raise ``ValueError`` unless the vocabulary layers can be split over ``size`` processes."""
        if size > 1 and self.vocab_size % size:
            nearest = -(-self.vocab_size // size) * size
            divisors = [k for k in range(1, min(self.vocab_size, 64) + 1) if self.vocab_size % k == 0]
            raise ValueError(
                f"tensor_parallel_size={size} splits the vocabulary into equal shards, but vocab_size="
                f"{self.vocab_size} is not a multiple of {size}; use a tensor_parallel_size that divides it "
                f"({divisors}) or pad the vocabulary to {nearest} words (LSTMLanguageModel's "
                "pad_vocab_to_multiple_of; model.pad_vocab_to_multiple_of for train.py)")
        if size > 1 and self._ties:
            raise ValueError(f"tensor_parallel_size={size} does not split tied embedding and decoder weights; untie "
                             "them or use tensor_parallel_size=1")

    def tensor_parallel_blocks(self) -> list[str]:
        """The blocks :meth:`parallelize_vocabulary` splits: the embedding and the decoder."""
        return [self.declaration.embedding, self.declaration.decoder]

    def parallelize_vocabulary(self, mesh: DeviceMesh) -> None:
        """Split the embedding row-wise and the decoder column-wise over ``mesh`` with torch's tensor-parallel API
        (the decoder's logits stay sharded for ``loss_parallel``). Idempotent."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.check_tensor_parallel(mesh.size())
        if mesh.size() == 1:
            return
        d = self.declaration
        decoder, embedding = self._get(d.decoder), self._get(d.embedding)
        if decoder is not None and not isinstance(decoder.weight, DTensor):
            parallelize_module(decoder, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        if embedding is not None and not isinstance(embedding.weight, DTensor):
            parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                output_layouts=Replicate()))

    def loss_context(self) -> AbstractContextManager[Any]:
        """``loss_parallel`` when the decoder is split (around the loss's forward and backward)."""
        decoder = self._get(self.declaration.decoder)
        if decoder is not None and isinstance(decoder.weight, DTensor):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()
