"""Data layer: corpora, the token store, vocabulary, synthetic language, bucketing and the data module.

Importing this package is cheap: nothing is read, downloaded, tokenized or
generated until a function is called or :meth:`LMDataModule.setup` runs.
"""

from lightning_mp_lstm.data.batch import LMBatch, collate_lm
from lightning_mp_lstm.data.buckets import LONG_SENTENCE_POLICIES, BucketedDataset, auto_buckets, resolve_buckets
from lightning_mp_lstm.data.corpus import CorpusError, read_sentences, resolve_split_paths
from lightning_mp_lstm.data.datamodule import LMDataModule
from lightning_mp_lstm.data.download import PTB_BASE_URL, PTB_SHA256, download_ptb
from lightning_mp_lstm.data.encoded import EncodedSplit
from lightning_mp_lstm.data.resumable import ResumableDataLoader
from lightning_mp_lstm.data.sampler import BucketBatchSampler
from lightning_mp_lstm.data.synthetic import SyntheticLanguage, synthetic_splits
from lightning_mp_lstm.data.token_store import TokenStore
from lightning_mp_lstm.data.vocab import Vocabulary

__all__ = [
    "LONG_SENTENCE_POLICIES",
    "PTB_BASE_URL",
    "PTB_SHA256",
    "BucketBatchSampler",
    "BucketedDataset",
    "CorpusError",
    "EncodedSplit",
    "LMBatch",
    "LMDataModule",
    "ResumableDataLoader",
    "SyntheticLanguage",
    "TokenStore",
    "Vocabulary",
    "auto_buckets",
    "collate_lm",
    "download_ptb",
    "read_sentences",
    "resolve_buckets",
    "resolve_split_paths",
    "synthetic_splits",
]
