"""A split as one continuous token stream, for truncated backpropagation through time.

As in PyTorch's ``word_language_model`` and AWD-LSTM: the sentences (each ending with ``<eos>``) are
concatenated after one leading ``<eos>``, the stream is cut into ``rows`` contiguous rows of equal length, and
batches are consecutive windows of ``bptt`` tokens of every row; the model carries each row's recurrent state
from one window to the next (``LSTMLanguageModel(carry_state=True)``).

Each example is one row of one window; window ``k`` is "bucket" ``k`` of length ``len(window k)``, so the
:class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler` (one global batch per window, no shuffling) shards
rows over data-parallel replicas and saves and restores the position exactly as it does for sentences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_mp_lstm.base.validation import check_positive_int
from lightning_mp_lstm.data.encoded import EncodedSplit

__all__ = ["TokenStream"]


class TokenStream(Dataset):
    """Windows of a token stream cut into rows.

    The stream ``[eos] + tokens`` is never built: position ``p > 0`` of it is ``tokens[p - 1]`` of the split
    (possibly memory-mapped), and a window's slice is cast to int64 when it is served.

    Args:
        sentences: encoded sentences, each ending with ``<eos>``: an
            :class:`~lightning_mp_lstm.data.encoded.EncodedSplit`, or sequences of ids.
        eos_id: id of ``<eos>`` (the stream's first input).
        rows: number of contiguous rows (the global batch size).
        bptt: tokens per window (the last window of an epoch may be shorter).

    Raises:
        ValueError: for ``rows`` or ``bptt`` not a positive integer, or a stream too short for one window of
            ``rows`` rows.
    """

    def __init__(self, sentences: EncodedSplit | Sequence[Sequence[int]], eos_id: int, rows: int, bptt: int) -> None:
        check_positive_int("rows", rows)
        check_positive_int("bptt", bptt)
        split = sentences if isinstance(sentences, EncodedSplit) else EncodedSplit.from_sequences(sentences)
        size = 1 + split.num_tokens
        columns = size // rows
        if columns < 2:
            raise ValueError(
                f"the stream has {size} tokens, too few for {rows} rows of at least 2 tokens; use a smaller "
                "batch size"
            )
        self.rows, self.bptt = rows, bptt
        self._split, self._eos_id, self._columns = split, int(eos_id), columns
        starts = range(0, columns - 1, bptt)
        #: Length of every window (tokens per row); the last may be shorter.
        self.buckets = [min(bptt, columns - 1 - start) for start in starts]
        self._starts = list(starts)
        #: The window ("bucket") of every example (``index = window * rows + row``).
        self.bucket_indices = np.repeat(np.arange(len(self.buckets)), rows)

    @property
    def data(self) -> np.ndarray:
        """The stream as a ``(rows, columns)`` int64 matrix (made on each access: a copy of the split's ids, for
        inspecting small streams; batches never use it)."""
        return self._positions(0, self.rows * self._columns).reshape(self.rows, self._columns)

    def _positions(self, start: int, count: int) -> np.ndarray:
        """Positions ``start .. start + count - 1`` of the stream ``[eos] + tokens``, as int64."""
        tokens = self._split.tokens
        if start > 0:
            return tokens[start - 1 : start - 1 + count].astype(np.int64)
        out = np.empty(count, dtype=np.int64)
        out[0] = self._eos_id
        out[1:] = tokens[: count - 1]
        return out

    def __len__(self) -> int:
        return int(self.bucket_indices.size)

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window, row = divmod(int(index), self.rows)
        start, length = self._starts[window], self.buckets[window]
        tokens = torch.from_numpy(self._positions(row * self._columns + start, length + 1))
        return tokens[:-1], tokens[1:]

    @property
    def num_tokens(self) -> int:
        """Target tokens of one epoch (every window of every row)."""
        return int(sum(self.buckets)) * self.rows
