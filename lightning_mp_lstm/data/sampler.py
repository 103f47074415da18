"""The batch sampler: global batches from single buckets, their data-parallel shares, and the resume position.

:class:`BucketBatchSampler` forms the epoch's global batches (each from one bucket, bounded by a batch size
and/or a token budget, shuffled per epoch), gives every data-parallel replica its contiguous share of each,
and saves and restores its position in the sequence of global batches so that training resumes inside an
epoch (see :doc:`/data` for why every replica can always be given a share).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler
from typing_extensions import override

from lightning_mp_lstm.base.validation import check_positive_int

__all__ = ["BucketBatchSampler"]

log = logging.getLogger("lightning_mp_lstm.data")


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
    always passes the last check when ``n >= R`` (proved in :doc:`/data`,
    "Batches and sharding"); ``c = 2R - 2`` can fail.

    **Resuming.** :meth:`state_dict` records the position in the sequence of
    *global* batches, ``(epoch, batches_done)``, with a fingerprint of what
    defines that sequence; :meth:`load_state_dict` makes the next iteration
    start where it stopped, also with another ``num_replicas``, ``rank`` or
    ``replica_weights``. :class:`~lightning_mp_lstm.data.resumable.ResumableDataLoader` exposes it to
    Lightning.

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
        if batch_size is not None:
            check_positive_int("batch_size", batch_size)
        check_positive_int("num_replicas", num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank {rank} of num_replicas {num_replicas}")
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

    @override
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
                consumed, as
                :class:`~lightning_mp_lstm.data.resumable.ResumableDataLoader` does.
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
