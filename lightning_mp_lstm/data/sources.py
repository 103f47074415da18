"""The corpus sources of :class:`~lightning_mp_lstm.data.LMDataModule` and their three splits, encoded.

``source="synthetic"`` samples the splits from a :class:`~lightning_mp_lstm.data.synthetic.SyntheticLanguage`
(:func:`synthetic_sentences`) and encodes them in memory; ``"ptb"``, ``"wikitext"`` and ``"text"`` read files
(see :mod:`lightning_mp_lstm.data.corpus`) through the token store (:mod:`~lightning_mp_lstm.data.token_store`),
PTB possibly downloaded into :func:`ptb_download_dir`. A :class:`Corpus` is either, for the data module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_mp_lstm.data.corpus import SPLITS, resolve_split_paths
from lightning_mp_lstm.data.encoded import EncodedSplit
from lightning_mp_lstm.data.synthetic import DEFAULT_SPLIT_SIZES, SyntheticLanguage
from lightning_mp_lstm.data.token_store import DEFAULT_CACHE_DIR, TokenStore
from lightning_mp_lstm.data.vocab import Vocabulary

__all__ = ["SOURCES", "Corpus", "ptb_download_dir", "synthetic_sentences"]

#: Allowed values of ``source``.
SOURCES: tuple[str, ...] = ("synthetic", "ptb", "wikitext", "text")

_SPLIT_SIZE_KEYS = {"num_train": "train", "num_valid": "valid", "num_test": "test"}


def ptb_download_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where PTB is downloaded: ``<cache_dir>/ptb`` (default cache ``~/.cache/lightning_mp_lstm``)."""
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "ptb"


def synthetic_sentences(options: dict[str, Any], seed: int) -> tuple[SyntheticLanguage, dict[str, list[list[str]]]]:
    """The synthetic language and its train/valid/test sentences.

    Args:
        options: :class:`~lightning_mp_lstm.data.synthetic.SyntheticLanguage` keyword arguments plus
            ``num_train``/``num_valid``/``num_test`` (defaults
            :data:`~lightning_mp_lstm.data.synthetic.DEFAULT_SPLIT_SIZES`).
        seed: The language's seed unless ``options`` gives one.

    Returns:
        The language, and the sentences of train, valid and test (sampled with seeds 1, 2 and 3).
    """
    opts = dict(options)
    sizes = {split: int(opts.pop(key, DEFAULT_SPLIT_SIZES[split])) for key, split in _SPLIT_SIZE_KEYS.items()}
    opts.setdefault("seed", seed)
    language = SyntheticLanguage(**opts)
    return language, {split: language.sample(sizes[split], seed=i + 1) for i, split in enumerate(SPLITS)}


class Corpus:
    """A corpus's three splits: the vocabulary its training split gives, and every split encoded with a vocabulary.

    A file corpus goes through the token store (:class:`~lightning_mp_lstm.data.token_store.TokenStore`): each file
    is tokenized once into memory-mapped ids and cached. A synthetic corpus keeps its sampled sentences and encodes
    them in memory, into the same :class:`~lightning_mp_lstm.data.encoded.EncodedSplit` form. Make one with
    :meth:`synthetic` or :meth:`from_files`.

    Args:
        files: The split files of a file corpus (``None``: synthetic).
        sentences: The sentences of a synthetic corpus's splits (``None``: files).
        store: The token store of a file corpus.
    """

    def __init__(self, files: dict[str, Path] | None = None, sentences: dict[str, list[list[str]]] | None = None,
                 store: TokenStore | None = None) -> None:
        if (files is None) == (sentences is None) or (files is not None and store is None):
            raise ValueError("a corpus is either files with a token store or sentences")
        self.files, self.sentences, self.store = files, sentences, store

    @classmethod
    def synthetic(cls, options: dict[str, Any], seed: int) -> tuple[Corpus, SyntheticLanguage]:
        """The synthetic language's corpus (see :func:`synthetic_sentences`) and the language."""
        language, sentences = synthetic_sentences(options, seed)
        return cls(sentences=sentences), language

    @classmethod
    def from_files(cls, path: str | None, train: str | None, valid: str | None, test: str | None,
                   single_file_for_all_splits: bool = False, cache_dir: str | os.PathLike[str] | None = None
                   ) -> Corpus:
        """The files of a corpus directory ``path`` or explicit split files (found by
        :func:`~lightning_mp_lstm.data.corpus.resolve_split_paths`), tokenized into the token store under
        ``cache_dir`` (default ``~/.cache/lightning_mp_lstm``).

        Raises:
            CorpusError: If a split's file cannot be found.
        """
        files = resolve_split_paths(path, train, valid, test, single_file_for_all_splits=single_file_for_all_splits)
        return cls(files=files, store=TokenStore(cache_dir))

    def vocabulary(self, min_freq: int = 1, max_size: int | None = None) -> Vocabulary:
        """The training split's vocabulary (see :meth:`~lightning_mp_lstm.data.vocab.Vocabulary.build`).

        Raises:
            CorpusError: If the training file is binary, not UTF-8 or empty.
        """
        if self.sentences is not None:
            return Vocabulary.build(self.sentences["train"], min_freq=min_freq, max_size=max_size)
        assert self.files is not None and self.store is not None
        return self.store.vocabulary(self.files["train"], min_freq=min_freq, max_size=max_size)

    def encode(self, split: str, vocab: Vocabulary) -> EncodedSplit:
        """``split`` encoded with ``vocab`` (memory-mapped for a file corpus; its longest sentence names a line).

        Raises:
            CorpusError: If the split's file is binary, not UTF-8 or empty.
        """
        if self.sentences is not None:
            return EncodedSplit.from_sentences(self.sentences[split], vocab)
        assert self.files is not None and self.store is not None
        return self.store.split(self.files[split], vocab)
