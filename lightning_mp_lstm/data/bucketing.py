"""The former home of the batch, bucket, sampler and loader classes, kept as an import path.

The names moved, each to the module of its job: :mod:`~lightning_mp_lstm.data.batch` (``LMBatch``,
``collate_lm``), :mod:`~lightning_mp_lstm.data.buckets` (``auto_buckets``, ``resolve_buckets``,
``BucketedDataset``, ``LONG_SENTENCE_POLICIES``), :mod:`~lightning_mp_lstm.data.sampler`
(``BucketBatchSampler``) and :mod:`~lightning_mp_lstm.data.resumable` (``ResumableDataLoader``). Import them
from :mod:`lightning_mp_lstm.data` or from those modules; this one only re-exports them.
"""

from __future__ import annotations

from lightning_mp_lstm.data.batch import LMBatch, collate_lm
from lightning_mp_lstm.data.buckets import LONG_SENTENCE_POLICIES, BucketedDataset, auto_buckets, resolve_buckets
from lightning_mp_lstm.data.resumable import ResumableDataLoader
from lightning_mp_lstm.data.sampler import BucketBatchSampler

__all__ = [
    "LONG_SENTENCE_POLICIES",
    "BucketBatchSampler",
    "BucketedDataset",
    "LMBatch",
    "ResumableDataLoader",
    "auto_buckets",
    "collate_lm",
    "resolve_buckets",
]
