"""Every process of one data-parallel replica must load the same batch: the pipeline's first stage reads its inputs
and its last stage its targets, each from the batch its own process loaded.

Lightning seeds a loader's worker processes by global rank (``seed_everything(workers=True)``), as data parallelism
wants; here it would give each stage's workers their own random draws, and a random transform in the data pipeline
would pair one batch's inputs with another's targets, without an error. :func:`seed_workers_by_replica` seeds them by
replica instead, and :func:`check_same_batch` compares what the processes of each replica loaded at the first batch
of every training epoch and of every evaluation (one small collective each), so a transform that draws per process in
any other way stops the run at its first step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function

from lightning_mp_lstm.base.faults import gather

__all__ = ["batch_fingerprint", "check_same_batch", "seed_workers_by_replica"]


def seed_workers_by_replica(dataloader: object, replica: int) -> None:
    """Give ``dataloader`` Lightning's worker seeding by ``replica`` (its data-parallel rank) where Lightning would
    add it by global rank: when ``seed_everything(workers=True)`` asked for it and the loader has no
    ``worker_init_fn`` of its own."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=replica)  # type: ignore[attr-defined]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def batch_fingerprint(batch: Any) -> list[Any]:
    """Shapes and position-weighted sums of every tensor of ``batch``: equal for equal batches, and two batches that
    differ in a value, its place or a shape differ in it (one read from the device for the whole batch)."""
    tensors = list(_tensors(batch))
    shapes = [tuple(t.shape) for t in tensors]
    sums = []
    for t in tensors:
        flat = t.detach().flatten()
        weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
        if flat.is_floating_point() or flat.is_complex():
            sums.append((flat.double() * weights).sum())
        else:
            sums.append((flat.long() * weights).sum().double())
    values = torch.stack(sums).tolist() if sums else []
    return [shapes, values]


def check_same_batch(batch: Any, replica: int, where: str) -> None:
    """Compare ``batch`` with what every other process of this replica loaded (a collective on every rank).

    Raises:
        ValueError: on every rank, when two processes of one replica loaded different batches, naming them.
    """
    everyone = gather(lambda: (replica, batch_fingerprint(batch)))
    first: dict[int, tuple[int, list[Any]]] = {}
    for rank, (rank_replica, fingerprint) in enumerate(everyone):
        seen = first.setdefault(rank_replica, (rank, fingerprint))
        if seen[1] != fingerprint:
            raise ValueError(
                f"the processes of data-parallel replica {rank_replica} loaded different batches at {where} "
                f"(global ranks {seen[0]} and {rank}): every pipeline stage and tensor-parallel shard of a replica "
                "must see the same batch (the first stage reads its inputs, the last its targets). A random "
                "transform in the data pipeline that draws per process does this, e.g. a DataLoader worker_init_fn "
                "or a generator seeded by global rank; seed it by data-parallel rank "
                "(trainer.strategy.distributed_sampler_kwargs['rank']) or by nothing, or draw in a method the "
                "pipeline declaration names")
