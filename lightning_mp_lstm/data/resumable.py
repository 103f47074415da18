"""The DataLoader that saves and restores the training position inside an epoch.

:class:`ResumableDataLoader` wraps a :class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler` and reports,
through ``state_dict``/``load_state_dict`` (which Lightning saves in checkpoints and loads on resume), the
position of the batches the training loop really consumed, not of those its workers fetched ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_mp_lstm.data.sampler import BucketBatchSampler

__all__ = ["ResumableDataLoader"]


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
    """A DataLoader over a :class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler` that resumes inside an epoch.

    Lightning saves ``state_dict()`` of a training DataLoader that has
    ``state_dict``/``load_state_dict`` into the checkpoint and, on resume,
    calls ``load_state_dict`` before creating the iterator; the iterator then
    yields only the epoch's remaining batches while ``len()`` stays the whole
    epoch's, which is what Lightning expects.

    The saved position must be the number of batches the *training loop
    consumed*, not the number produced: DataLoader workers ask the batch
    sampler for batches ahead of time. ``consumed`` reports it (for Lightning
    :class:`~lightning_mp_lstm.data.LMDataModule` passes the fit
    loop's ``batch_progress.current.ready``); without it the loader counts the
    batches its current iterator has returned (plus those skipped when it
    resumed).

    Args:
        dataset: The dataset.
        *args: Passed to :class:`torch.utils.data.DataLoader`.
        consumed: Optional callable returning the number of batches of the
            current epoch the consumer has taken, skipped ones included.
        **kwargs: Passed to :class:`torch.utils.data.DataLoader`; give
            ``batch_sampler`` a :class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler`.
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

    @override
    def __iter__(self) -> Iterator[Any]:
        inner = super().__iter__()
        # Lightning re-creates prediction loaders around a wrapper of the batch sampler: nothing to count then.
        return _CountingIterator(self, inner) if isinstance(self.batch_sampler, BucketBatchSampler) else inner

    def state_dict(self) -> dict[str, Any]:
        """The batch sampler's :meth:`~lightning_mp_lstm.data.sampler.BucketBatchSampler.state_dict` at the
        consumed position."""
        sampler = self._bucket_sampler()
        if self._delivered is not None:
            epoch, start, returned = self._delivered
        else:
            (epoch, start), returned = sampler.position(), 0
        done = int(self.consumed()) if self.consumed is not None else start + returned
        return sampler.state_dict(batches_done=done, epoch=epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the batch sampler at a saved position (see
        :meth:`~lightning_mp_lstm.data.sampler.BucketBatchSampler.load_state_dict`)."""
        self._bucket_sampler().load_state_dict(state_dict)
        self._delivered = None
