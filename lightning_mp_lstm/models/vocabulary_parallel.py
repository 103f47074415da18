"""The vocabulary layers of a declared module split over processes (tensor parallel), with torch's tensor-parallel API:
the embedding row-wise, the decoder column-wise with its logits left sharded for ``loss_parallel``.
:class:`VocabularyParallel` is mixed into
:class:`~lightning_mp_lstm.models.language_model_blocks.LanguageModelBlocks`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["VocabularyParallel"]


class VocabularyParallel:
    """The tensor-parallel members of the pipeline contract, over the declaration, the vocabulary size, the tied
    weights and the declared methods of the class it is mixed into."""

    declaration: Any
    vocab_size: int
    _ties: dict[str, str]
    _templates: dict[str, nn.Module]
    _hooks: dict[str, Any]
    _get: Callable[[str], nn.Module | None]

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
        decoder = self._templates[self.declaration.decoder]
        if size > 1 and isinstance(decoder, nn.AdaptiveLogSoftmaxWithLoss):
            raise ValueError(f"tensor_parallel_size={size} splits the decoder's columns over processes; an adaptive "
                             "softmax has no such matrix (its head and clusters are small): use tensor_parallel_size=1 "
                             "with it, or a full softmax (model.softmax=full)")
        hooks = sorted(set(self._hooks) & {"embed", "loss"})
        if size > 1 and hooks:
            raise ValueError(f"tensor_parallel_size={size} splits the embedding and the decoder's logits, which the "
                             f"module's own {' and '.join(hooks)} method would see whole; use tensor_parallel_size=1, "
                             "or the built-in embedding and loss (no embed=, loss='cross_entropy' or 'nll')")
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
        if decoder is not None and isinstance(getattr(decoder, "weight", None), DTensor):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()
