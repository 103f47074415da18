"""The Lightning data module for word-level language modelling with length buckets.

:class:`LMDataModule` ties the data layer together for a trainer: it reads a corpus
(:mod:`~lightning_mp_lstm.data.sources`; files through the token store, :mod:`~lightning_mp_lstm.data.token_store`),
builds the vocabulary, the bucketed datasets or token streams, and hands the trainer sharded, resumable loaders
(:mod:`~lightning_mp_lstm.data.loaders`); its checkpoint state is the vocabulary.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mp_lstm.data.buckets import BucketedDataset, resolve_buckets
from lightning_mp_lstm.data.corpus import SPLITS
from lightning_mp_lstm.data.download import download_ptb
from lightning_mp_lstm.data.encoded import EncodedSplit, unigram_perplexity
from lightning_mp_lstm.data.loaders import STAGE_LOADERS, batch_sampler, data_parallel_layout, resumable_loader
from lightning_mp_lstm.data.options import MODES, check_options
from lightning_mp_lstm.data.sampler import BucketBatchSampler
from lightning_mp_lstm.data.sources import SOURCES, Corpus, ptb_download_dir
from lightning_mp_lstm.data.stream import TokenStream
from lightning_mp_lstm.data.synthetic import SyntheticLanguage
from lightning_mp_lstm.data.vocab import Vocabulary, vocabulary_difference

__all__ = ["MODES", "SOURCES", "LMDataModule"]

log = logging.getLogger("lightning_mp_lstm.data")


class LMDataModule(pl.LightningDataModule):
    """Word-level language-modelling data: corpus reading, vocabulary, buckets, loaders.

    ``setup`` is idempotent and may be called before the trainer exists (for example to learn :attr:`vocab_size`
    before building the model). The vocabulary is built from the training split only, unless one was restored with
    :meth:`load_state_dict` (Lightning does this when resuming from a checkpoint; the restored vocabulary then
    replaces any built one).

    ``batch_size``/``max_tokens`` bound the *global* batch over all data-parallel replicas; each replica gets its
    contiguous share, the layout being read from the trainer's strategy when a loader is made (see
    :mod:`~lightning_mp_lstm.data.loaders` and :class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler`).
    Validation and test data are sharded the same way, without shuffling. With a trainer attached, :meth:`setup`
    builds the batch samplers of the splits its stage uses, so a batch size or token budget that cannot be shared
    by the replicas fails before training starts.

    **Resuming.** The loaders are :class:`~lightning_mp_lstm.data.resumable.ResumableDataLoader`: Lightning saves
    the training position (epoch and global batches consumed, as counted by its fit loop) in every checkpoint and a
    resumed ``fit`` continues with the next batch of the interrupted epoch, also with another number of
    data-parallel replicas; a mid-epoch checkpoint needs the same data, buckets, batch size / token budget and seed.
    This holds for every way of saving, also ``trainer.save_checkpoint`` after ``fit`` returned at ``max_steps``
    inside an epoch, which Lightning records as a finished epoch: when the fit loop asks for the training loader of
    a resumed ``fit``, the data module makes the restored loop state agree with the data position (see
    :mod:`lightning_mp_lstm.data.loop_state`).

    Args:
        source: ``"synthetic"`` (embedded, needs no files), ``"ptb"``, ``"wikitext"`` or ``"text"`` (any line-based
            corpus).
        path: Corpus directory (usual split file names) or a file.
        train: Explicit training file (overrides ``path``).
        valid: Explicit validation file (overrides ``path``).
        test: Explicit test file (overrides ``path``).
        download: ``source="ptb"`` only: download PTB into ``<cache_dir>/ptb`` in :meth:`prepare_data` (used when
            ``path`` is not given).
        cache_dir: Cache root (default ``~/.cache/lightning_mp_lstm``): PTB downloads and the token store of file
            corpora (``<cache_dir>/tokens``, see :mod:`~lightning_mp_lstm.data.token_store`).
        synthetic: ``source="synthetic"`` only: :class:`~lightning_mp_lstm.data.synthetic.SyntheticLanguage`
            keyword arguments plus ``num_train``/``num_valid``/``num_test`` (defaults
            :data:`~lightning_mp_lstm.data.synthetic.DEFAULT_SPLIT_SIZES`); the language ``seed`` defaults to ``seed``.
        min_freq: Minimum training frequency of a vocabulary word.
        max_vocab_size: Maximum vocabulary size including special tokens.
        buckets: Bucket lengths, ``"auto"`` (minimal padding, see :func:`~lightning_mp_lstm.data.buckets.auto_buckets`),
            or ``None`` (pad to the longest sentence).
        num_auto_buckets: Number of buckets for ``"auto"`` (``None``: 5).
        max_bucket_length: Longest bucket of ``"auto"``/``None`` buckets (longer sentences follow the policy below);
            ``"auto"``: 4x the 99th percentile of the lengths (see :func:`~lightning_mp_lstm.data.buckets.length_cap`).
        long_sentence_policy: ``"split"``, ``"truncate"`` or ``"drop"`` for sentences longer than the largest bucket.
        batch_size: Sentences per global training batch.
        max_tokens: Tokens (sentences x bucket length) per global batch.
        eval_batch_size: Sentences per global evaluation batch (default ``batch_size``).
        shuffle: Shuffle training batches every epoch.
        seed: Shuffling seed (and default synthetic language seed).
        num_workers: DataLoader worker processes.
        single_file_for_all_splits: Allow one file ``path`` for every split.
        mode: ``"sentences"`` (bucketed, independent sentences) or ``"stream"``: each split as one token
            stream cut into ``batch_size`` (evaluation: ``eval_batch_size``) contiguous rows, batches being
            consecutive windows of ``bptt`` tokens, in order (see
            :class:`~lightning_mp_lstm.data.stream.TokenStream`; train the model with ``carry_state=True``).
            Buckets, ``max_tokens`` and ``shuffle`` do not apply.
        bptt: ``mode="stream"``: tokens per window.

    Raises:
        ValueError: For an invalid argument combination.
    """

    #: Each data-parallel replica gets its own share of every global batch from this module (the ``mp_lstm``
    #: strategy then does not split the batches it is given).
    shards_data_parallel = True

    def __init__(
        self,
        source: str = "synthetic",
        path: str | None = None,
        train: str | None = None,
        valid: str | None = None,
        test: str | None = None,
        download: bool = False,
        cache_dir: str | None = None,
        synthetic: dict[str, Any] | None = None,
        min_freq: int = 1,
        max_vocab_size: int | None = None,
        buckets: Sequence[int] | str | None = "auto",
        num_auto_buckets: int | None = 5,
        max_bucket_length: int | str | None = "auto",
        long_sentence_policy: str = "split",
        batch_size: int | None = 32,
        max_tokens: int | None = None,
        eval_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        single_file_for_all_splits: bool = False,
        mode: str = "sentences",
        bptt: int = 35,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_options(source=source, path=path, train=train, valid=valid, test=test, download=download,
                      synthetic=synthetic, buckets=buckets, long_sentence_policy=long_sentence_policy,
                      batch_size=batch_size, max_tokens=max_tokens, mode=mode, bptt=bptt,
                      max_bucket_length=max_bucket_length)
        self.source = source
        self.path = path
        self.train_path, self.valid_path, self.test_path = train, valid, test
        self.download = bool(download)
        self.cache_dir = cache_dir
        self.synthetic_options = dict(synthetic or {})
        self.min_freq = min_freq
        self.max_vocab_size = max_vocab_size
        self.buckets = list(buckets) if buckets is not None and not isinstance(buckets, str) else buckets
        self.num_auto_buckets = 5 if num_auto_buckets is None else int(num_auto_buckets)
        self.max_bucket_length = max_bucket_length
        self.long_sentence_policy = long_sentence_policy
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.eval_batch_size = eval_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.single_file_for_all_splits = single_file_for_all_splits
        self.mode = mode
        self.bptt = bptt
        self._streams: dict[tuple[str, int], TokenStream] = {}

        self._corpus: Corpus | None = None
        self._read = False  # every split read once (and logged)
        self._language: SyntheticLanguage | None = None
        self._vocab: Vocabulary | None = None
        self._encoded: dict[str, EncodedSplit] = {}
        self._datasets: dict[tuple[str, int], BucketedDataset] = {}
        self._bucket_lengths: list[int] | None = None
        self._unigram_ppl: float | None = None
        self._checked_samplers: set[tuple] = set()
        #: Number of sentences longer than the largest bucket, per split (filled by the loaders).
        self.long_sentence_counts: dict[str, int] = {}

    # ------------------------------------------------------------ data files
    @override
    def prepare_data(self) -> None:
        """Download PTB when ``download=True`` (called by Lightning on one process per node)."""
        if self.download and self.path is None:
            download_ptb(ptb_download_dir(self.cache_dir))

    def _files(self) -> tuple[Any, ...]:
        path = os.fspath(ptb_download_dir(self.cache_dir)) if self.path is None and self.download else self.path
        return path, self.train_path, self.valid_path, self.test_path

    def _prepare(self) -> tuple[Corpus, Vocabulary]:
        """The corpus (opened once) and the vocabulary (built from the training split unless one was restored)."""
        if self._corpus is None:
            if self.source == "synthetic":
                self._corpus, self._language = Corpus.synthetic(self.synthetic_options, self.seed)
            else:
                self._corpus = Corpus.from_files(*self._files(), self.single_file_for_all_splits, self.cache_dir)
        if self._vocab is None:
            self._set_vocab(self._corpus.vocabulary(min_freq=self.min_freq, max_size=self.max_vocab_size))
        assert self._vocab is not None
        return self._corpus, self._vocab

    def longest_sentence(self) -> tuple[int, str]:
        """The longest training sentence: its length in model tokens (``<eos>`` included) and where it is (``line N
        of <file>`` for a file corpus)."""
        self.setup()
        return self._encode("train").longest()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, stage: str | None = None) -> None:
        """Read the corpus and build the vocabulary (idempotent).

        With a trainer attached, also build the batch samplers of the splits ``stage`` uses (``fit``: train and
        valid; ``validate``: valid; ``test``/``predict``: test) for the trainer's data-parallel layout, so that an
        unusable batch size or token budget (see :class:`~lightning_mp_lstm.data.sampler.BucketBatchSampler`)
        raises here rather than when its loader is first requested. Each check runs once per layout.

        Args:
            stage: Lightning stage (all splits are read once, whatever the stage).

        Raises:
            ValueError: If a sampler of the stage cannot be built.
            CorpusError: If a corpus file is missing, binary, not UTF-8 or empty.
        """
        if not self._read:
            self._prepare()
            sizes = {split: len(self._encode(split)) for split in SPLITS}
            log.info("corpus %s: %s sentences", self.source, ", ".join(f"{s}={n}" for s, n in sizes.items()))
            self._read = True
        if getattr(self, "trainer", None) is not None and stage in STAGE_LOADERS:
            replicas = self._replicas()
            for split, train in STAGE_LOADERS[stage]:
                key = (split, train, replicas[0], replicas[1], tuple(replicas[2] or ()))
                if key not in self._checked_samplers:
                    self._batch_sampler(split, train)
                    self._checked_samplers.add(key)

    def prepare_vocab(self) -> Vocabulary:
        """Run :meth:`setup` if needed and return the vocabulary."""
        self.setup()
        return self.vocab

    def _set_vocab(self, vocab: Vocabulary) -> None:
        if self._vocab is not None and vocab == self._vocab:
            return
        self._vocab = vocab
        self._encoded.clear()
        self._datasets.clear()
        self._streams.clear()
        self._bucket_lengths = None
        self._unigram_ppl = None
        self._checked_samplers.clear()

    def _encode(self, split: str) -> EncodedSplit:
        """``split`` encoded with the current vocabulary (memory-mapped from the token store for a file corpus)."""
        if split not in self._encoded:
            corpus, vocab = self._prepare()
            self._encoded[split] = corpus.encode(split, vocab)
        return self._encoded[split]

    def _buckets(self) -> list[int]:
        """Bucket lengths, derived from the training split for ``"auto"``/``None``."""
        if self._bucket_lengths is None:
            if self.buckets is None or isinstance(self.buckets, str):
                lengths = self._encode("train").lengths()
                cap = self.max_bucket_length
                self._bucket_lengths = resolve_buckets(self.buckets, lengths, self.num_auto_buckets, cap)
            else:
                self._bucket_lengths = resolve_buckets(self.buckets, [], self.num_auto_buckets)
            log.info("bucket lengths: %s", self._bucket_lengths)
        return self._bucket_lengths

    def dataset(self, split: str, min_bucket_size: int = 1) -> BucketedDataset:
        """The bucketed dataset of ``"train"``, ``"valid"`` or ``"test"``.

        Args:
            split: Split name.
            min_bucket_size: Minimum examples per non-empty bucket (the number of data-parallel replicas).

        Returns:
            The (cached) dataset.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        key = (split, min_bucket_size)
        if key not in self._datasets:
            buckets = self._buckets()
            assert self._vocab is not None
            ds = BucketedDataset(
                self._encode(split),
                buckets,
                long_policy=self.long_sentence_policy,
                bos_id=self._vocab.eos_id,
                min_bucket_size=min_bucket_size,
            )
            self.long_sentence_counts[split] = ds.num_long
            self._datasets[key] = ds
        return self._datasets[key]

    # ------------------------------------------------------------ dataloaders
    def _replicas(self) -> tuple[int, int, list[float] | None]:
        """``(num_replicas, rank, replica_weights)`` of the trainer's strategy (see
        :func:`~lightning_mp_lstm.data.loaders.data_parallel_layout`)."""
        return data_parallel_layout(getattr(self, "trainer", None))

    def stream(self, split: str, rows: int) -> TokenStream:
        """``split`` as a token stream of ``rows`` rows (``mode="stream"``)."""
        key = (split, rows)
        if key not in self._streams:
            assert self._vocab is not None
            try:
                self._streams[key] = TokenStream(self._encode(split), self._vocab.eos_id, rows, self.bptt)
            except ValueError as err:
                raise ValueError(f"{split} split: {err}") from err
        return self._streams[key]

    def _batch_sampler(self, split: str, train: bool) -> tuple[BucketedDataset | TokenStream, BucketBatchSampler]:
        """``split``'s dataset and a new batch sampler for the trainer's data-parallel layout (this validates
        the batch size and token budget)."""
        self.setup()
        layout = self._replicas()
        batch_size = self.batch_size if train else (self.eval_batch_size or self.batch_size)
        stream = self.mode == "stream"
        # A stream: one global batch per window ("bucket"), in order, each replica its contiguous rows.
        ds = self.stream(split, batch_size) if stream else self.dataset(split, min_bucket_size=layout[0])
        which = "eval_batch_size" if not train and self.eval_batch_size else "batch_size"
        shuffle = self.shuffle and train and not stream
        return ds, batch_sampler(ds, split, batch_size, which, self.max_tokens, shuffle, self.seed, layout)

    def _loader(self, split: str, train: bool) -> DataLoader:
        """``split``'s resumable loader for the trainer: the training loader also makes a fit loop just restored
        from a checkpoint agree with the data position (see
        :func:`~lightning_mp_lstm.data.loaders.resumable_loader`)."""
        ds, sampler = self._batch_sampler(split, train)
        return resumable_loader(ds, sampler, getattr(self, "trainer", None), train, self.num_workers)

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, bucketed training batches (this replica's share)."""
        return self._loader("train", train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        """Bucketed validation batches in a fixed order."""
        return self._loader("valid", train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """Bucketed test batches in a fixed order."""
        return self._loader("test", train=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        """Same as :meth:`test_dataloader` (prediction runs on the test split)."""
        return self._loader("test", train=False)

    # ------------------------------------------------------------- properties
    @property
    def bucket_lengths(self) -> list[int]:
        """Bucket lengths in tokens (after :meth:`setup`); every batch is padded to one of them (``[bptt]`` in
        stream mode)."""
        return [self.bptt] if self.mode == "stream" else self._buckets()

    @property
    def mean_padded_length(self) -> float:
        """Mean length, in tokens, that a training sentence is padded to (its bucket's length), over the
        training split: the bucket mix that per-step compute follows (after :meth:`setup`); ``bptt`` in stream
        mode."""
        if self.mode == "stream":
            return float(self.bptt)
        self.setup()
        dataset = self.dataset("train", min_bucket_size=self._replicas()[0])
        if not len(dataset):
            return float(self.bucket_lengths[-1])
        return float(np.mean(np.asarray(dataset.buckets)[dataset.bucket_indices]))

    @property
    def vocab(self) -> Vocabulary:
        """The vocabulary (after :meth:`setup` or :meth:`load_state_dict`)."""
        if self._vocab is None:
            raise RuntimeError("the vocabulary is not available yet: call setup() (or prepare_vocab()) first")
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """Number of vocabulary entries (model input/output size)."""
        return len(self.vocab)

    @property
    def language(self) -> SyntheticLanguage | None:
        """The synthetic source language (``source="synthetic"`` after setup), else ``None``."""
        return self._language

    @property
    def entropy_floor(self) -> float | None:
        """Best achievable perplexity ``exp(entropy_rate)`` (synthetic only, else ``None``)."""
        if self.source != "synthetic":
            return None
        self.setup()
        assert self._language is not None
        return math.exp(self._language.entropy_rate())

    @property
    def unigram_perplexity(self) -> float:
        """Perplexity of a unigram baseline.

        Synthetic data: exact, ``exp`` of the source's marginal token entropy. Files: a unigram model estimated on
        the encoded training split (add-one smoothing over the vocabulary, ``<pad>`` excluded) evaluated on the
        encoded validation split.
        """
        if self._unigram_ppl is None:
            self.setup()
            if self._language is not None:
                self._unigram_ppl = math.exp(self._language.unigram_entropy())
            else:
                self._unigram_ppl = unigram_perplexity(self._encode("train"), self._encode("valid"), self.vocab_size)
        return self._unigram_ppl

    # ------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state: the vocabulary (empty before setup)."""
        return {"vocab": self._vocab.state_dict()} if self._vocab is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the vocabulary from a checkpoint; later encoding uses it (the checkpoint's vocabulary is the
        one its model learned, so it replaces one built from the data, with a warning when they differ)."""
        if "vocab" not in state_dict:
            return
        saved = Vocabulary.from_state_dict(state_dict["vocab"])
        difference = vocabulary_difference(saved, self._vocab) if self._vocab is not None else None
        if difference is not None:
            rank_zero_warn(f"LMDataModule: the checkpoint's vocabulary replaces the one built from the training data "
                           f"(checkpoint vs data: {difference}); the data is encoded with the checkpoint's")
        self._set_vocab(saved)

    def stats(self) -> dict[str, Any]:
        """Counts for logging: sentences per split, vocabulary size, buckets, long sentences."""
        self.setup()
        for split in SPLITS:
            self.dataset(split)
        encoded = {split: self._encode(split) for split in SPLITS}
        return {
            "sentences": {s: len(v) for s, v in encoded.items()},
            "tokens": {s: v.num_tokens for s, v in encoded.items()},
            "vocab_size": self.vocab_size,
            "buckets": self._buckets(),
            "long_sentences": dict(self.long_sentence_counts),
        }
