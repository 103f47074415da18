"""The loaders :class:`~lightning_mp_lstm.data.LMDataModule` gives a trainer: sharded over its replicas, resumable.

The data-parallel layout is read from the trainer's strategy when a loader is made
(:func:`data_parallel_layout`); :func:`batch_sampler` builds a split's
:class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler` for it, which checks that every replica gets a share
of every global batch (:data:`STAGE_LOADERS` says which samplers a Lightning stage needs, so that
``LMDataModule.setup`` can check them before training starts); :func:`resumable_loader` wraps dataset and
sampler in a :class:`~lightning_mp_lstm.data.resumable.ResumableDataLoader` tied to the trainer's fit loop, so
that the saved position is what the loop consumed and a resumed ``fit`` continues where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset

from lightning_mp_lstm.data.batch import collate_lm
from lightning_mp_lstm.data.loop_state import align_restored_fit_loop
from lightning_mp_lstm.data.resumable import ResumableDataLoader
from lightning_mp_lstm.data.sampler import BucketBatchSampler

__all__ = ["STAGE_LOADERS", "batch_sampler", "data_parallel_layout", "resumable_loader"]

#: The ``(split, train)`` loaders a Lightning stage uses, whose samplers ``LMDataModule.setup`` checks.
STAGE_LOADERS: dict[str, tuple[tuple[str, bool], ...]] = {
    "fit": (("train", True), ("valid", False)),
    "validate": (("valid", False),),
    "test": (("test", False),),
    "predict": (("test", False),),
}


def data_parallel_layout(trainer: Any) -> tuple[int, int, list[float] | None]:
    """``(num_replicas, rank, replica_weights)`` of ``trainer``'s strategy.

    Read from ``trainer.strategy.distributed_sampler_kwargs`` (``num_replicas``/``rank``; absent or ``None``
    means one replica) and the optional ``trainer.strategy.data_parallel_weights``. Without a trainer: one
    replica, rank 0, no weights.
    """
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
    num_replicas, rank = 1, 0
    if kwargs:
        num_replicas = int(kwargs.get("num_replicas", 1))
        rank = int(kwargs.get("rank", 0))
    weights = getattr(strategy, "data_parallel_weights", None) if strategy is not None else None
    return num_replicas, rank, (list(weights) if weights is not None else None)


def batch_sampler(
    dataset: Any,
    split: str,
    batch_size: int | None,
    batch_size_name: str,
    max_tokens: int | None,
    shuffle: bool,
    seed: int,
    layout: tuple[int, int, Sequence[float] | None],
) -> BucketBatchSampler:
    """A new batch sampler of ``split``'s dataset (bucketed sentences or a token stream) for ``layout``.

    Args:
        dataset: The split's dataset: ``bucket_indices`` and ``buckets`` define the global batches.
        split: The split's name, for the message.
        batch_size: Sentences (stream: rows) per global batch, or ``None``.
        batch_size_name: The option ``batch_size`` came from (``batch_size`` or ``eval_batch_size``), for the
            message.
        max_tokens: Tokens per global batch, or ``None``.
        shuffle: Shuffle every epoch.
        seed: Shuffling seed.
        layout: ``(num_replicas, rank, replica_weights)``, see :func:`data_parallel_layout`.

    Raises:
        ValueError: If the sampler cannot be built (e.g. a global batch some replica gets no share of); the
            message starts with the split and the settings that matter.
    """
    num_replicas, rank, weights = layout
    try:
        return BucketBatchSampler(
            dataset.bucket_indices,
            dataset.buckets,
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            replica_weights=weights,
        )
    except ValueError as err:
        settings = [f"{batch_size_name}={batch_size}"] if batch_size is not None else []
        if max_tokens is not None:
            settings.append(f"max_tokens={max_tokens}")
        raise ValueError(f"{split} split ({', '.join(settings)}): {err}") from err



def resumable_loader(
    dataset: Dataset, sampler: BucketBatchSampler, trainer: Any, train: bool, num_workers: int
) -> ResumableDataLoader:
    """``dataset``'s loader over ``sampler``, set to the epoch it will serve and tied to ``trainer``'s fit loop.

    For the training loader of a trainer with a fit loop, the fit loop just restored from a checkpoint is first
    made to agree with the data position (:func:`~lightning_mp_lstm.data.loop_state.align_restored_fit_loop`),
    and the loader saves the number of batches the loop consumed (``batch_progress.current.ready``) rather than
    those its workers fetched ahead.
    """
    consumed: Callable[[], int] | None = None
    if trainer is not None:
        fit_loop = getattr(trainer, "fit_loop", None)
        if train and fit_loop is not None:
            # Lightning asks for the training loader of a resumed fit after restoring its loops and before it
            # loads the loader's saved position and resets them: make the loops agree with that position.
            align_restored_fit_loop(fit_loop)
            # The epoch this loader will serve. When resuming from a checkpoint saved at the end of epoch e,
            # trainer.current_epoch is still e while Lightning creates the loader (it advances later), and
            # with DataLoader workers the iterator Lightning creates right away would shuffle with it.
            sampler.set_epoch(fit_loop.epoch_progress.current.processed)

            def consumed() -> int:  # batches of the current epoch the training loop has taken
                return trainer.fit_loop.epoch_loop.batch_progress.current.ready

        else:
            sampler.set_epoch(trainer.current_epoch)
    return ResumableDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_lm,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        consumed=consumed,
    )
