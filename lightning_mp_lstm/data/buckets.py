"""Bucket lengths and the bucketed dataset: which bucket a sentence goes to, and how it is padded.

A sentence's length in model tokens is ``len(sentence)`` (``<eos>`` included, see
:mod:`lightning_mp_lstm.data.batch`). :func:`resolve_buckets` turns the ``buckets`` setting into sorted
lengths (:func:`auto_buckets` chooses them to minimise the padding); :class:`BucketedDataset` pads every
sentence to the smallest bucket that holds it and handles sentences longer than the largest bucket, reading the
sentences where they are (an :class:`~lightning_mp_lstm.data.encoded.EncodedSplit`, memory-mapped for a file corpus).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_mp_lstm.base.validation import check_positive_int
from lightning_mp_lstm.data.encoded import EncodedSplit

__all__ = ["LONG_SENTENCE_POLICIES", "OUTLIER_FACTOR", "BucketedDataset", "auto_buckets", "length_cap",
           "resolve_buckets"]

log = logging.getLogger("lightning_mp_lstm.data")

#: Allowed values of ``long_policy``.
LONG_SENTENCE_POLICIES: tuple[str, str, str] = ("split", "truncate", "drop")
#: ``max_length="auto"``: a sentence longer than this many times the 99th percentile of the lengths is an outlier.
OUTLIER_FACTOR = 4


def length_cap(lengths: Sequence[int] | np.ndarray, max_length: int | str | None) -> int | None:
    """The longest bucket that computed buckets (``"auto"``, ``None``) may have; longer sentences are then split (or
    truncated, or dropped) by the long-sentence policy.

    Args:
        lengths: Sentence lengths in model tokens.
        max_length: A positive integer; ``"auto"``: :data:`OUTLIER_FACTOR` x the 99th percentile of ``lengths``
            (nearest lower rank), so one line far longer than the rest (a 100,000-token line among sentences of 30)
            does not set the longest bucket while a corpus's usual tail does; ``None``: no cap.

    Returns:
        The cap, or ``None``.
    """
    if max_length is None:
        return None
    if max_length != "auto":
        return int(check_positive_int("max_bucket_length", max_length, also=("auto",)))
    arr = np.asarray(lengths)
    return OUTLIER_FACTOR * int(np.percentile(arr, 99, method="lower")) if arr.size else None


def auto_buckets(lengths: Sequence[int] | np.ndarray, num_buckets: int) -> list[int]:
    """Choose bucket lengths that minimise the total padding.

    Exact dynamic programming over the distinct lengths: bucket boundaries are
    chosen among observed lengths so that ``sum(bucket_len - len)`` over all
    sentences (each padded to the smallest bucket that holds it) is minimal.
    The largest bucket is always the longest length, so nothing is too long.

    Args:
        lengths: Sentence lengths in model tokens (``<eos>`` included).
        num_buckets: Maximum number of buckets (fewer if there are fewer
            distinct lengths).

    Returns:
        Sorted bucket lengths.

    Raises:
        ValueError: If ``lengths`` is empty or ``num_buckets`` is not a positive integer.
    """
    check_positive_int("num_buckets", num_buckets)
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        raise ValueError("cannot choose buckets for an empty list of lengths")
    values, counts = np.unique(arr, return_counts=True)
    d = values.size
    k = min(num_buckets, d)
    cum_n = np.concatenate([[0], np.cumsum(counts)])
    cum_s = np.concatenate([[0], np.cumsum(counts * values)])
    # cost(i, j): bucket of length values[j] holding values[i..j]
    #   = values[j] * (cum_n[j+1] - cum_n[i]) - (cum_s[j+1] - cum_s[i])
    inf = np.inf
    best = values * cum_n[1:] - cum_s[1:]  # one bucket covering values[0..j]
    choice = np.zeros((k, d), dtype=np.int64)  # start index i of the last bucket
    for b in range(1, k):
        new = np.full(d, inf)
        for j in range(b, d):
            i = np.arange(1, j + 1)  # last bucket covers values[i..j]
            cost = best[i - 1] + values[j] * (cum_n[j + 1] - cum_n[i]) - (cum_s[j + 1] - cum_s[i])
            m = int(np.argmin(cost))
            new[j], choice[b, j] = cost[m], i[m]
        best = new
    # backtrack from the full range with k buckets
    out, j = [], d - 1
    for b in range(k - 1, -1, -1):
        out.append(int(values[j]))
        if b == 0:
            break
        j = int(choice[b, j]) - 1
    return sorted(out)


def resolve_buckets(
    buckets: Sequence[int] | str | None, lengths: Sequence[int] | np.ndarray, num_auto_buckets: int = 5,
    max_length: int | str | None = None,
) -> list[int]:
    """Turn a bucket specification into a sorted list of bucket lengths.

    Args:
        buckets: An explicit list of lengths, ``"auto"`` (see
            :func:`auto_buckets`), or ``None`` for pad-to-max (a single bucket
            of the longest length).
        lengths: Sentence lengths in model tokens (used by ``"auto"``/``None``).
        num_auto_buckets: Number of buckets for ``"auto"``.
        max_length: The cap of ``"auto"``/``None`` buckets (see :func:`length_cap`; default: none).

    Returns:
        Sorted, distinct, positive bucket lengths.

    Raises:
        ValueError: For an invalid specification.
    """
    if buckets is None or isinstance(buckets, str):
        if isinstance(buckets, str) and buckets != "auto":
            raise ValueError(f"buckets must be a list of lengths, 'auto' or None, got {buckets!r}")
        arr = np.asarray(lengths)
        cap = length_cap(arr, max_length)
        if cap is not None:
            arr = np.minimum(arr, cap)  # the longer sentences become pieces of (at most) the cap
        if buckets == "auto":
            return auto_buckets(arr, num_auto_buckets)
        if arr.size == 0:
            raise ValueError("cannot pad to the maximum length of an empty list of lengths")
        return [int(arr.max())]
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < 1:
        raise ValueError(f"bucket lengths must be a non-empty list of positive integers, got {list(buckets)}")
    return out


class BucketedDataset(Dataset):
    """Encoded sentences as fixed-length (bucket-padded) input/target pairs.

    Each example is assigned to the smallest bucket that holds it. Sentences
    longer than the largest bucket are handled by ``long_policy``:

    * ``"split"``: cut into consecutive pieces of at most the largest bucket
      length. Piece ``k``'s input starts with the last target token of piece
      ``k-1`` (the first piece starts with ``bos_id``), so every token is
      predicted exactly once; the recurrent state is *not* carried between
      pieces.
    * ``"truncate"``: keep the first ``max_bucket`` targets (the rest,
      including ``<eos>``, is not predicted).
    * ``"drop"``: leave the sentence out.

    The number of affected sentences is stored in :attr:`num_long` and logged
    on the ``lightning_mp_lstm.data`` logger.

    ``min_bucket_size`` guarantees that every non-empty bucket holds at least
    that many examples (needed so every data-parallel replica gets a share of
    every batch): examples of a too-small bucket are moved to the next larger
    bucket (padded more), and a too-small largest bucket absorbs the next
    smaller one.

    The sentences' ids are read where they are (an
    :class:`~lightning_mp_lstm.data.encoded.EncodedSplit`, possibly
    memory-mapped): lengths come from its offsets, and an example's slice is
    cast to int64 when it is served. Pickling the dataset (a ``DataLoader``
    worker started with ``spawn``) carries the split's path, not its ids.

    Args:
        sentences: Encoded sentences, each ending with the ``<eos>`` id: an
            :class:`~lightning_mp_lstm.data.encoded.EncodedSplit`, or
            sequences of ids.
        buckets: Sorted bucket lengths, or ``None`` for one bucket of the
            longest sentence length.
        long_policy: ``"split"``, ``"truncate"`` or ``"drop"``.
        bos_id: Input id preceding the first token (the ``<eos>`` id).
        min_bucket_size: Minimum number of examples in a non-empty bucket.

    Attributes:
        buckets: Bucket lengths.
        bucket_indices: ``(N,)`` bucket index of every example.
        num_long: Number of sentences longer than the largest bucket.

    Raises:
        ValueError: For an unknown policy, or fewer examples than ``min_bucket_size``.
    """

    def __init__(
        self,
        sentences: EncodedSplit | Sequence[Sequence[int]],
        buckets: Sequence[int] | None = None,
        long_policy: str = "split",
        bos_id: int = 2,
        min_bucket_size: int = 1,
    ) -> None:
        if long_policy not in LONG_SENTENCE_POLICIES:
            raise ValueError(
                f"unknown long-sentence policy {long_policy!r}; allowed: {', '.join(LONG_SENTENCE_POLICIES)}"
            )
        split = sentences if isinstance(sentences, EncodedSplit) else EncodedSplit.from_sequences(sentences)
        lengths = split.lengths()
        if lengths.size and lengths.min() < 1:
            raise ValueError("sentences must not be empty (each ends with <eos>)")
        self.buckets: list[int] = resolve_buckets(None if buckets is None else list(buckets), lengths)
        max_len = self.buckets[-1]
        flat = split.tokens
        starts = np.asarray(split.offsets[:-1], dtype=np.int64)

        long_mask = lengths > max_len
        self.num_long = int(long_mask.sum())
        if self.num_long:
            action = {"split": "split into pieces", "truncate": "truncated", "drop": "dropped"}[long_policy]
            log.warning(
                "%d of %d sentences are longer than the largest bucket (%d tokens) and were %s",
                self.num_long,
                len(split),
                max_len,
                action,
            )
        # Each example: targets = flat[off : off + n], first input token = first[i].
        if long_policy == "split" and self.num_long:
            pieces = np.where(long_mask, -(-lengths // max_len), 1)
            sent_of = np.repeat(np.arange(lengths.size), pieces)
            piece_no = np.arange(sent_of.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            off = starts[sent_of] + piece_no * max_len
            n = np.minimum(lengths[sent_of] - piece_no * max_len, max_len)
            first = np.full(off.size, bos_id, dtype=np.int64)
            later = np.flatnonzero(piece_no)
            first[later] = flat[off[later] - 1]
        else:
            keep = ~long_mask if long_policy == "drop" else np.ones(lengths.size, dtype=bool)
            off = starts[keep]
            n = np.minimum(lengths[keep], max_len)
            first = np.full(off.size, bos_id, dtype=np.int64)
        self._split = split
        self._flat = flat
        self._offsets = off.astype(np.int64)
        self._lengths = n.astype(np.int64)
        self._first = first.astype(np.int64)
        bucket_arr = np.asarray(self.buckets)
        self.bucket_indices: np.ndarray = np.searchsorted(bucket_arr, self._lengths, side="left")
        self._enforce_min_bucket_size(min_bucket_size)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_flat"]  # the split's ids: the split pickles as its path when they are mapped
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._flat = self._split.tokens

    def _enforce_min_bucket_size(self, minimum: int) -> None:
        if minimum <= 1:
            return
        if len(self) < minimum:
            raise ValueError(
                f"dataset has {len(self)} examples, fewer than the required {minimum} "
                "(one per data-parallel replica)"
            )
        counts = np.bincount(self.bucket_indices, minlength=len(self.buckets))
        while True:
            nonempty = np.flatnonzero(counts)
            small = [b for b in nonempty if counts[b] < minimum]
            if not small:
                break
            b = small[0]
            if b != nonempty[-1]:
                dest = nonempty[np.searchsorted(nonempty, b) + 1]
                src = b
            else:  # the largest bucket is too small: it absorbs the next smaller one
                dest, src = b, nonempty[-2]
            self.bucket_indices[self.bucket_indices == src] = dest
            counts[dest] += counts[src]
            counts[src] = 0

    def __len__(self) -> int:
        return int(self._offsets.size)

    def example_length(self, index: int) -> int:
        """Number of real (non-padding) target tokens of example ``index``."""
        return int(self._lengths[index])

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.buckets[int(self.bucket_indices[index])]
        o, n = int(self._offsets[index]), int(self._lengths[index])
        targets = np.zeros(t, dtype=np.int64)
        inputs = np.zeros(t, dtype=np.int64)
        targets[:n] = self._flat[o : o + n]
        inputs[0] = self._first[index]
        inputs[1:n] = targets[: n - 1]
        return torch.from_numpy(inputs), torch.from_numpy(targets)
