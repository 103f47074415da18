"""The batch type of the data layer and the collation that forms it.

Language-model convention: an encoded sentence ``[w1 .. wn, <eos>]`` becomes
input ``[<eos>, w1 .. wn]`` and target ``[w1 .. wn, <eos>]`` (the previous
sentence's ``<eos>`` acts as beginning-of-sentence), so its length in model
tokens is ``len(sentence)`` (``<eos>`` included). Batches are padded with id
``0`` (``<pad>``) to the full length of their bucket, so every bucket has one
fixed tensor shape; padded target positions must be ignored by the loss
(``ignore_index=0``). Rows a pipeline needs to fill a batch are added by the
model (``pad_rows``), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["LMBatch", "collate_lm"]


class LMBatch(NamedTuple):
    """A batch of language-model examples.

    Lightning moves NamedTuples of tensors to the device field by field.

    Attributes:
        inputs: ``(B, T)`` int64 token ids, ``<pad>`` (0) padded.
        targets: ``(B, T)`` int64 next-token ids, ``<pad>`` (0) padded; padded
            positions must not count in the loss.
    """

    inputs: torch.Tensor
    targets: torch.Tensor


def collate_lm(items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> LMBatch:
    """Stack ``(inputs, targets)`` examples of equal (bucket) length into an :class:`LMBatch`."""
    inputs, targets = zip(*items)
    return LMBatch(torch.stack(inputs), torch.stack(targets))
