"""Length bucketing, long-sentence handling, batch sampling and collation.

Language-model convention: an encoded sentence ``[w1 .. wn, <eos>]`` becomes
input ``[<eos>, w1 .. wn]`` and target ``[w1 .. wn, <eos>]`` (the previous
sentence's ``<eos>`` acts as beginning-of-sentence), so its length in model
tokens is ``len(sentence)`` (``<eos>`` included). Batches are padded with id
``0`` (``<pad>``) to the full length of their bucket, so every bucket has one
fixed tensor shape; padded target positions must be ignored by the loss
(``ignore_index=0``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    "LONG_SENTENCE_POLICIES",
    "BucketBatchSampler",
    "BucketedDataset",
    "LMBatch",
    "ResumableDataLoader",
    "auto_buckets",
    "collate_lm",
    "pad_batch_rows",
    "resolve_buckets",
]

log = logging.getLogger("lightning_mp_lstm.data")

#: Allowed values of ``long_policy``.
LONG_SENTENCE_POLICIES: tuple[str, str, str] = ("split", "truncate", "drop")

_PAD_ID = 0


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


def pad_batch_rows(batch: LMBatch, multiple: int) -> LMBatch:
    """Append all-padding rows so that the batch size is a multiple of ``multiple``.

    Padding rows have inputs and targets equal to ``<pad>`` (0), so they add
    nothing to a loss computed with ``ignore_index=0`` (sum over real tokens).

    Args:
        batch: The batch to pad.
        multiple: Required divisor of the batch size (>= 1).

    Returns:
        The padded batch (the same object if no padding is needed).
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    rows = batch.inputs.shape[0]
    extra = -rows % multiple
    if extra == 0:
        return batch
    pad = batch.inputs.new_zeros((extra, *batch.inputs.shape[1:]))
    tpad = batch.targets.new_zeros((extra, *batch.targets.shape[1:]))
    return LMBatch(torch.cat([batch.inputs, pad]), torch.cat([batch.targets, tpad]))


# --------------------------------------------------------------------- buckets
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
        ValueError: If ``lengths`` is empty or ``num_buckets < 1``.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
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
    buckets: Sequence[int] | str | None, lengths: Sequence[int] | np.ndarray, num_auto_buckets: int = 5
) -> list[int]:
    """Turn a bucket specification into a sorted list of bucket lengths.

    Args:
        buckets: An explicit list of lengths, ``"auto"`` (see
            :func:`auto_buckets`), or ``None`` for pad-to-max (a single bucket
            of the longest length).
        lengths: Sentence lengths in model tokens (used by ``"auto"``/``None``).
        num_auto_buckets: Number of buckets for ``"auto"``.

    Returns:
        Sorted, distinct, positive bucket lengths.

    Raises:
        ValueError: For an invalid specification.
    """
    if buckets is None:
        arr = np.asarray(lengths)
        if arr.size == 0:
            raise ValueError("cannot pad to the maximum length of an empty list of lengths")
        return [int(arr.max())]
    if isinstance(buckets, str):
        if buckets != "auto":
            raise ValueError(f"buckets must be a list of lengths, 'auto' or None, got {buckets!r}")
        return auto_buckets(lengths, num_auto_buckets)
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < 1:
        raise ValueError(f"bucket lengths must be a non-empty list of positive integers, got {list(buckets)}")
    return out


# --------------------------------------------------------------------- dataset
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

    Args:
        sentences: Encoded sentences, each ending with the ``<eos>`` id.
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
        sentences: Sequence[Sequence[int]],
        buckets: Sequence[int] | None = None,
        long_policy: str = "split",
        bos_id: int = 2,
        min_bucket_size: int = 1,
    ) -> None:
        if long_policy not in LONG_SENTENCE_POLICIES:
            raise ValueError(
                f"unknown long-sentence policy {long_policy!r}; allowed: {', '.join(LONG_SENTENCE_POLICIES)}"
            )
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        if lengths.size and lengths.min() < 1:
            raise ValueError("sentences must not be empty (each ends with <eos>)")
        self.buckets: list[int] = resolve_buckets(None if buckets is None else list(buckets), lengths)
        max_len = self.buckets[-1]
        flat = (
            np.concatenate([np.asarray(s, dtype=np.int64) for s in sentences])
            if len(sentences)
            else np.zeros(0, dtype=np.int64)
        )
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(sentences) else lengths

        long_mask = lengths > max_len
        self.num_long = int(long_mask.sum())
        if self.num_long:
            action = {"split": "split into pieces", "truncate": "truncated", "drop": "dropped"}[long_policy]
            log.warning(
                "%d of %d sentences are longer than the largest bucket (%d tokens) and were %s",
                self.num_long,
                len(sentences),
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
            first = np.where(piece_no == 0, bos_id, flat[np.maximum(off - 1, 0)])
        else:
            keep = ~long_mask if long_policy == "drop" else np.ones(lengths.size, dtype=bool)
            off = starts[keep]
            n = np.minimum(lengths[keep], max_len)
            first = np.full(off.size, bos_id, dtype=np.int64)
        self._flat = flat
        self._offsets = off.astype(np.int64)
        self._lengths = n.astype(np.int64)
        self._first = first.astype(np.int64)
        bucket_arr = np.asarray(self.buckets)
        self.bucket_indices: np.ndarray = np.searchsorted(bucket_arr, self._lengths, side="left")
        self._enforce_min_bucket_size(min_bucket_size)

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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.buckets[int(self.bucket_indices[index])]
        o, n = int(self._offsets[index]), int(self._lengths[index])
        targets = np.zeros(t, dtype=np.int64)
        inputs = np.zeros(t, dtype=np.int64)
        targets[:n] = self._flat[o : o + n]
        inputs[0] = self._first[index]
        inputs[1:n] = self._flat[o : o + n - 1]
        return torch.from_numpy(inputs), torch.from_numpy(targets)


# --------------------------------------------------------------------- sampler
def _split_counts(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` items proportionally to ``weights`` (largest remainder), each share >= 1.

    Raises:
        ValueError: If ``total`` is smaller than the number of shares (some share would be empty).
    """
    if total < weights.size:
        raise ValueError(f"cannot give each of {weights.size} replicas at least one of {total} sentences")
    quota = total * weights / weights.sum()
    share = np.floor(quota).astype(np.int64)
    rest = total - int(share.sum())
    if rest:
        order = np.argsort(-(quota - share), kind="stable")
        share[order[:rest]] += 1
    # Terminates: while a share is 0 the largest is >= 2 (total >= number of shares), and every step
    # fills one empty share.
    while (share == 0).any():  # give empty replicas one item from the largest share
        share[int(np.argmax(share))] -= 1
        share[int(np.flatnonzero(share == 0)[0])] += 1
    return share


def _sizes_text(n: int, m: int) -> str:
    """The sizes of the ``m`` parts of ``np.array_split`` of ``n`` items, in words."""
    small, big = n // m, n % m
    if not big:
        return f"{m} global batches of {small} sentences"
    return f"{m} global batches ({big} of {small + 1} sentences, {m - big} of {small})"


class BucketBatchSampler(Sampler[list[int]]):
    """Yields batches of dataset indices, every batch drawn from a single bucket.

    **Batch size.** ``batch_size`` (sentences) and/or ``max_tokens`` (sentences
    times bucket length) bound the *global* batch, i.e. the batch over all
    data-parallel replicas together. Within a bucket the examples are spread
    evenly over ``ceil(n / cap)`` batches whose sizes differ by at most one
    (no tiny last batch). The global batches do not depend on ``num_replicas``,
    ``rank`` or ``replica_weights``: every data-parallel size sees the same
    data in the same order.

    **Shuffling.** With ``shuffle=True`` the examples inside each bucket and
    the order of all batches (across buckets) are permuted by a generator
    seeded with ``(seed, epoch)``; call :meth:`set_epoch` before each epoch
    (Lightning does, see :attr:`sampler`).

    **Data-parallel sharding.** Every rank forms the same global batches and
    yields only its own contiguous slice of each, in rank order, so the
    concatenation of the slices of ranks ``0..num_replicas-1`` is the global
    batch; all pipeline stages of one replica (same rank) see the same batch,
    and every replica yields the same number of batches. Slices are equal or,
    with ``replica_weights``, proportional (largest remainder). Every replica
    must get at least one sentence of every batch, so every global batch must
    hold at least ``R = num_replicas`` sentences. Construction checks, for
    every non-empty bucket of ``n`` sentences and per-batch cap ``c``
    (``batch_size``, or ``max_tokens // bucket_length`` if smaller):

    * ``c >= R``;
    * ``n >= R`` (build the dataset with ``min_bucket_size=num_replicas``);
    * the smallest of the bucket's ``m = ceil(n / c)`` global batches,
      ``floor(n / m)``, holds ``>= R`` sentences. For example 3 sentences with
      ``c = 2`` form batches of 2 and 1, which 2 replicas cannot share.

    A cap ``c >= 2R - 1`` (so ``batch_size >= 2 * num_replicas`` certainly)
    always passes the last check when ``n >= R``: write ``n = q c + r`` with
    ``0 <= r < c``. If ``q = 0`` then ``m = 1`` and the batch holds
    ``n >= R``. If ``r = 0`` every batch holds ``c >= R``. Otherwise
    ``m = q + 1`` and ``n - R m = q (c - R) + r - R >= q (R - 1) + 1 - R >= 0``
    because ``c - R >= R - 1``, ``r >= 1`` and ``q >= 1``. (``c = 2R - 2``
    can fail: ``n = 2R - 1`` gives batches of ``R`` and ``R - 1``.)

    **Resuming.** :meth:`state_dict` records the position in the sequence of
    *global* batches, ``(epoch, batches_done)``, with a fingerprint of what
    defines that sequence; :meth:`load_state_dict` makes the next iteration
    start where it stopped, also with another ``num_replicas``, ``rank`` or
    ``replica_weights``. :class:`ResumableDataLoader` exposes it to Lightning.

    Args:
        bucket_indices: Bucket index of every dataset example.
        bucket_lengths: Length of every bucket.
        batch_size: Maximum sentences per global batch.
        max_tokens: Maximum ``sentences * bucket_length`` per global batch.
        shuffle: Shuffle per epoch.
        seed: Shuffling seed.
        num_replicas: Number of data-parallel replicas.
        rank: This replica's rank (``0 <= rank < num_replicas``).
        replica_weights: Optional relative share of every replica.

    Raises:
        ValueError: For inconsistent arguments, or a global batch smaller than
            ``num_replicas`` (the message says which and how to fix it).
    """

    #: Version of the :meth:`state_dict` format.
    STATE_VERSION = 1

    def __init__(
        self,
        bucket_indices: Sequence[int] | np.ndarray,
        bucket_lengths: Sequence[int],
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        replica_weights: Sequence[float] | None = None,
    ) -> None:
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size and/or max_tokens")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas}, {rank}")
        weights = np.ones(num_replicas) if replica_weights is None else np.asarray(replica_weights, dtype=float)
        if weights.shape != (num_replicas,) or not np.all(weights > 0) or not np.all(np.isfinite(weights)):
            raise ValueError(
                f"replica_weights must be {num_replicas} positive numbers (one per replica), got {replica_weights}"
            )
        self.bucket_lengths = [int(b) for b in bucket_lengths]
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.replica_weights = weights
        self.epoch = 0
        idx = np.asarray(bucket_indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self.bucket_lengths)):
            raise ValueError("bucket_indices refer to a bucket that does not exist")
        self._num_examples = int(idx.size)
        self._members = [np.flatnonzero(idx == b) for b in range(len(self.bucket_lengths))]
        self._caps = []
        replicas = self.num_replicas
        origins: list[str] = []
        for b, length in enumerate(self.bucket_lengths):
            cap = batch_size if batch_size is not None else math.inf
            origin = f"batch_size={batch_size}"
            if max_tokens is not None and max_tokens // length < cap:
                cap = max_tokens // length
                origin = f"max_tokens={max_tokens} // {length} tokens"
            n = self._members[b].size
            if n and cap < replicas:
                raise ValueError(
                    f"bucket of length {length} allows only {cap} sentences per global batch "
                    f"(batch_size={batch_size}, max_tokens={max_tokens}); need at least one per replica "
                    f"({replicas})"
                )
            if 0 < n < replicas:
                raise ValueError(
                    f"bucket of length {length} has {n} examples, fewer than the {replicas} replicas; "
                    "build the dataset with min_bucket_size=num_replicas"
                )
            self._caps.append(int(min(cap, max(n, 1))))
            origins.append(origin)
        for b, length in enumerate(self.bucket_lengths):  # after the checks above, as they come first
            n, m, cap = self._members[b].size, self._num_batches(b), self._caps[b]
            if n and n // m < replicas:  # the smallest of the bucket's global batches (see the class docstring)
                need = 2 * replicas - 1
                fix = [f"batch_size >= {need}"] if batch_size is not None else []
                if max_tokens is not None:
                    fix.append(f"max_tokens >= {need} x {length} = {need * length}")
                raise ValueError(
                    f"bucket of length {length} has {n} sentences; at most {int(cap)} sentences per global batch "
                    f"({origins[b]}) split them into {_sizes_text(n, m)}, and a batch of {n // m} cannot give each "
                    f"of the {replicas} replicas a sentence. Global batches do not depend on the number of "
                    f"replicas, so change the cap: one of at least 2 x replicas - 1 = {need} sentences always "
                    f"works ({' and '.join(fix)}; 2 x replicas = {2 * replicas} as well), as does any cap that "
                    f"splits this bucket into batches of at least {replicas}"
                )
        # Position (see state_dict): [epoch, first batch, batches yielded] of the latest iteration, or the
        # loaded position until the next iteration starts; None before either.
        self._cursor: list[int] | None = None
        self._skip = 0  # batches the next iteration skips (set by load_state_dict)
        self._loaded_epoch: int | None = None  # the epoch that _skip belongs to

    @property
    def sampler(self) -> BucketBatchSampler:
        """This sampler itself.

        Lightning's per-epoch hook calls ``set_epoch`` on
        ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler`` (not on
        the batch sampler itself); exposing ``sampler`` makes it reach
        :meth:`set_epoch`.
        """
        return self

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used to seed the shuffling.

        A position restored by :meth:`load_state_dict` is kept only if
        ``epoch`` is the restored epoch; another epoch starts at its first batch.
        """
        self.epoch = int(epoch)
        if self.epoch != self._loaded_epoch:
            self._skip = 0
            self._loaded_epoch = None

    def _num_batches(self, b: int) -> int:
        n = self._members[b].size
        return -(-n // self._caps[b]) if n else 0

    def __len__(self) -> int:
        """Number of batches of a whole epoch (also when resuming inside one)."""
        return sum(self._num_batches(b) for b in range(len(self.bucket_lengths)))

    def global_batches(self) -> list[np.ndarray]:
        """The global batches of the current epoch (identical on every rank)."""
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle else None
        batches: list[np.ndarray] = []
        for b in range(len(self.bucket_lengths)):
            members = self._members[b]
            if members.size == 0:
                continue
            if rng is not None:
                members = rng.permutation(members)
            m = self._num_batches(b)
            batches.extend(np.array_split(members, m))  # sizes differ by at most one
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _share(self, batch: np.ndarray) -> np.ndarray:
        if self.num_replicas == 1:
            return batch
        counts = _split_counts(batch.size, self.replica_weights)
        start = int(counts[: self.rank].sum())
        return batch[start : start + int(counts[self.rank])]

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: nothing runs before the first batch is requested, so a set_epoch between iter() and
        # next() still applies (Lightning creates the training iterator before it calls set_epoch).
        start = self._skip
        self._skip, self._loaded_epoch = 0, None
        cursor = self._cursor = [self.epoch, start, 0]
        for batch in self.global_batches()[start:]:
            cursor[2] += 1
            yield self._share(batch).tolist()

    # ----------------------------------------------------------------- resuming
    def fingerprint(self) -> dict[str, Any]:
        """What defines the sequence of global batches; must match for a mid-epoch resume.

        Returns:
            ``num_examples``, ``bucket_lengths``, ``bucket_sizes`` (examples per
            bucket), ``caps`` (effective sentences per global batch of every
            non-empty bucket, 0 for empty ones), ``shuffle`` and ``seed``
            (``None`` without shuffling, where it plays no role).
        """
        return {
            "num_examples": self._num_examples,
            "bucket_lengths": list(self.bucket_lengths),
            "bucket_sizes": [int(m.size) for m in self._members],
            "caps": [int(c) if m.size else 0 for c, m in zip(self._caps, self._members)],
            "shuffle": self.shuffle,
            "seed": self.seed if self.shuffle else None,
        }

    def position(self) -> tuple[int, int]:
        """``(epoch, first batch)`` of the latest iteration, or the restored position before the next one.

        Before any iteration or restore: ``(epoch, 0)`` of :meth:`set_epoch`.
        """
        if self._cursor is None:
            return self.epoch, self._skip
        return self._cursor[0], self._cursor[1]

    def state_dict(self, batches_done: int | None = None, epoch: int | None = None) -> dict[str, Any]:
        """The position in the sequence of global batches, to resume exactly there.

        Args:
            batches_done: Global batches of ``epoch`` already consumed. Default:
                the batches this sampler has yielded in its latest iteration
                (plus those skipped at its start). A consumer that reads ahead
                (DataLoader workers prefetch batches) must pass what it really
                consumed, as :class:`ResumableDataLoader` does.
            epoch: The epoch ``batches_done`` refers to (default: the epoch of
                the latest iteration, see :meth:`position`).

        Returns:
            ``{"version", "epoch", "batches_done", "num_batches", "fingerprint"}``
            (plain ints, lists and bools; see :meth:`fingerprint`).
            ``batches_done >= num_batches`` means the epoch is finished: the
            next position is the start of epoch ``epoch + 1``.
        """
        cur_epoch, start = self.position()
        if batches_done is None:
            batches_done = start + (self._cursor[2] if self._cursor is not None else 0)
        if batches_done < 0:
            raise ValueError(f"batches_done must be >= 0, got {batches_done}")
        return {
            "version": self.STATE_VERSION,
            "epoch": int(cur_epoch if epoch is None else epoch),
            "batches_done": int(batches_done),
            "num_batches": len(self),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position saved by :meth:`state_dict`.

        The next iteration yields the remaining global batches of the saved
        epoch (this replica's share of each); :meth:`set_epoch` with another
        epoch discards the position. A finished epoch resumes at the start of
        the next one. ``num_replicas``, ``rank`` and ``replica_weights`` may
        differ from the saving sampler's.

        Raises:
            ValueError: For a malformed state, or, when the saved position is
                inside an epoch, a fingerprint (data, buckets, batch size /
                token budget, seed, shuffle) different from this sampler's. A
                position at an epoch boundary is accepted whatever the
                fingerprint: no batch order has to be continued there.
        """
        missing = {"epoch", "batches_done", "fingerprint"} - set(state)
        if missing or state.get("version", self.STATE_VERSION) != self.STATE_VERSION:
            raise ValueError(
                f"not a {type(self).__name__} state (version {self.STATE_VERSION}): "
                f"keys {sorted(state)}, missing {sorted(missing)}"
            )
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if epoch < 0 or done < 0:
            raise ValueError(f"invalid position: epoch {epoch}, batches_done {done}")
        saved, mine = state["fingerprint"], self.fingerprint()
        num_batches = int(state.get("num_batches", len(self)))
        finished = done >= num_batches
        if not finished and done > 0 and saved != mine:
            diffs = "; ".join(
                f"{key}: saved {saved.get(key)!r}, now {mine.get(key)!r}"
                for key in sorted(set(saved) | set(mine))
                if saved.get(key) != mine.get(key)
            )
            raise ValueError(
                f"cannot resume inside epoch {epoch} (after {done} of {num_batches} global batches): the data "
                f"differs from the checkpoint's ({diffs}). Resuming mid-epoch needs the same data, buckets, "
                "batch size / token budget, seed and shuffle; restore those settings, or resume from a checkpoint "
                "saved at the end of an epoch (the number of data-parallel replicas may change)"
            )
        if saved != mine:
            log.info("data position at the start of an epoch restored although the data settings differ")
        self._cursor = [epoch, done, 0]  # what was consumed: position() and state_dict() report it as saved
        self.epoch, self._skip = (epoch + 1, 0) if finished else (epoch, done)
        self._loaded_epoch = self.epoch


class _CountingIterator(Iterator[Any]):
    """Wraps a DataLoader iterator and tells its :class:`ResumableDataLoader` of every batch delivered."""

    def __init__(self, loader: ResumableDataLoader, inner: Iterator[Any]) -> None:
        self._loader = loader
        self._inner = inner
        self._position: list[int] | None = None

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        if self._position is None:  # the sampler's iteration behind this iterator has started by now
            self._position = [*self._loader._bucket_sampler().position(), 0]
        self._position[2] += 1
        self._loader._delivered = self._position
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # anything else is the DataLoader iterator's
        if name == "_inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`BucketBatchSampler` that can resume inside an epoch.

    Lightning saves ``state_dict()`` of a training DataLoader that has
    ``state_dict``/``load_state_dict`` into the checkpoint and, on resume,
    calls ``load_state_dict`` before creating the iterator; the iterator then
    yields only the epoch's remaining batches while ``len()`` stays the whole
    epoch's, which is what Lightning expects.

    The saved position must be the number of batches the *training loop
    consumed*, not the number produced: DataLoader workers ask the batch
    sampler for batches ahead of time. ``consumed`` reports it (for Lightning
    :class:`~lightning_mp_lstm.data.datamodule.LMDataModule` passes the fit
    loop's ``batch_progress.current.ready``); without it the loader counts the
    batches its current iterator has returned (plus those skipped when it
    resumed).

    Args:
        dataset: The dataset.
        *args: Passed to :class:`torch.utils.data.DataLoader`.
        consumed: Optional callable returning the number of batches of the
            current epoch the consumer has taken, skipped ones included.
        **kwargs: Passed to :class:`torch.utils.data.DataLoader`; give
            ``batch_sampler`` a :class:`BucketBatchSampler`.
    """

    def __init__(self, dataset: Dataset, *args: Any, consumed: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.consumed = consumed
        self._delivered: list[int] | None = None  # [epoch, first batch, batches returned] of the latest iterator

    def _bucket_sampler(self) -> BucketBatchSampler:
        sampler = self.batch_sampler
        if not isinstance(sampler, BucketBatchSampler):
            raise TypeError(
                f"{type(self).__name__} saves and restores the position of a BucketBatchSampler, "
                f"but its batch sampler is {type(sampler).__name__}"
            )
        return sampler

    def __iter__(self) -> Iterator[Any]:
        inner = super().__iter__()
        # Lightning re-creates prediction loaders around a wrapper of the batch sampler: nothing to count then.
        return _CountingIterator(self, inner) if isinstance(self.batch_sampler, BucketBatchSampler) else inner

    def state_dict(self) -> dict[str, Any]:
        """The batch sampler's :meth:`~BucketBatchSampler.state_dict` at the consumed position."""
        sampler = self._bucket_sampler()
        if self._delivered is not None:
            epoch, start, returned = self._delivered
        else:
            (epoch, start), returned = sampler.position(), 0
        done = int(self.consumed()) if self.consumed is not None else start + returned
        return sampler.state_dict(batches_done=done, epoch=epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the batch sampler at a saved position (see :meth:`BucketBatchSampler.load_state_dict`)."""
        self._bucket_sampler().load_state_dict(state_dict)
        self._delivered = None
