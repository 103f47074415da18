"""Copies of a declared module's blocks that the module itself does not hold: initial values of blocks built on the
meta device, throw-away blocks for timing, and blocks of fake tensors for counting what a forward saves.

:class:`BlockCopies` is mixed into :class:`~lightning_mp_lstm.models.language_model_blocks.LanguageModelBlocks`: each
copy is made from the declared modules' shapes (meta copies taken when the declaration is bound), so it needs no
block of this process, and its values depend on the block's name and the model's seed only.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_mp_lstm.models.blocks import (
    DecoderBlock,
    EmbeddingBlock,
    LayerwiseLSTM,
    LSTMLayerBlock,
    lstm_layer_names,
    plain_lstm,
    single_lstm,
)
from lightning_mp_lstm.models.declaration import LSTMBlocks
from lightning_mp_lstm.models.shapes import fake_parameters, meta_copy

__all__ = ["BlockCopies"]


class BlockCopies:
    """The contract's copies of blocks (``materialize_blocks``, ``build_block``) and ``probe_block``, over the
    declaration and the helpers of the class it is mixed into."""

    declaration: LSTMBlocks
    seed: int
    stacked: bool
    sizes: list[tuple[int, int]]
    block_names: list[str]
    decodes_in_loss: bool
    _ties: dict[str, str]
    _templates: dict[str, nn.Module]
    _hooks: dict[str, Any]
    _dropout: nn.Module | None
    _get: Callable[[str], nn.Module | None]
    _stack: Callable[[], Any]
    _layer_present: Callable[[int], bool]
    _layer_weights: Callable[[int], list[torch.Tensor]]
    _layer_block: Callable[[int], LSTMLayerBlock]

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
            elif self.stacked:
                width, hidden = self.sizes[self.block_names.index(name) - 1]
                module = nn.LSTM(width, hidden, batch_first=True)
            else:  # the user's layer module (a wrapper or parametrization included), reset as torch builds it
                module = copy.deepcopy(self._layer_template(self.block_names.index(name) - 1))
                module.to_empty(device="cpu")
                for part in module.modules():
                    if callable(getattr(part, "reset_parameters", None)):
                        part.reset_parameters()
            if d.init is not None:
                d.init(name, module)
        return module

    def _layer_template(self, layer: int) -> nn.Module:
        module = self._stack()[layer]
        if module is None:
            raise KeyError(f"layer {layer} of {self.declaration.lstm} is not on this process")
        return module

    def _template(self, name: str) -> nn.Module:
        return self._templates[name]

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
                stack = self._stack()
                if not self.stacked:  # the user's layer module: the fresh copy has its very parameter names
                    fresh = dict(self._fresh(name).named_parameters())
                    stack[layer].to_empty(device=device)
                    targets = dict(stack[layer].named_parameters())
                else:
                    fresh = dict(zip(lstm_layer_names(0), self._fresh(name).parameters(), strict=True))
                    if isinstance(stack, LayerwiseLSTM):
                        stack.set_layer(layer, [torch.empty_like(t, device=device) for t in fresh.values()])
                    elif stack.weight_ih_l0.is_meta:
                        stack.to_empty(device=device)  # every layer at once; each gets its values below
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
            return EmbeddingBlock(module, self._dropout, self._hooks.get("embed"), d.time_first)
        if name == d.decoder:
            return DecoderBlock(module, decodes_in_loss=self.decodes_in_loss)
        block = self._layer_block(self.block_names.index(name) - 1)
        block.objective = None  # a throw-away copy, timed alone: no penalty bookkeeping
        if self.stacked or plain_lstm(module):
            block.set_weights(list(module.parameters()))
        else:
            block.set_module(module, single_lstm(module).batch_first)
        return block

    def probe_block(self, name: str, mode: FakeTensorMode, device: torch.device) -> nn.Module:
        """Block ``name`` whose parameters are ``mode`` 's fake tensors on ``device``: what its forward would allocate
        and save can be counted without allocating any of it (nor needing the block on this process)."""
        d = self.declaration
        if name in (d.embedding, d.decoder):
            module = fake_parameters(meta_copy(self._template(name)), mode, device)
            if name == d.embedding:
                return EmbeddingBlock(module, self._dropout, self._hooks.get("embed"), d.time_first)
            return DecoderBlock(module, decodes_in_loss=self.decodes_in_loss)
        layer = self.block_names.index(name) - 1
        block = self._layer_block(layer)
        block.objective = None  # a throw-away copy: no penalty bookkeeping
        own = None if self.stacked or not self._layer_present(layer) else self._stack()[layer]
        if own is None or plain_lstm(own):
            with torch.device("meta"):
                lstm = nn.LSTM(*self.sizes[layer], batch_first=True)
            block.set_weights(list(fake_parameters(lstm, mode, device).parameters()))
        else:
            module = fake_parameters(meta_copy(own), mode, device)
            block.set_module(module, single_lstm(module).batch_first)
        return block
