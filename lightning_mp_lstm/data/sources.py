"""The corpus sources of :class:`~lightning_mp_lstm.data.LMDataModule` and reading one into its three splits.

``source="synthetic"`` samples the splits from a :class:`~lightning_mp_lstm.data.synthetic.SyntheticLanguage`
(:func:`synthetic_sentences`); ``"ptb"``, ``"wikitext"`` and ``"text"`` read files
(:func:`file_sentences`, see :mod:`lightning_mp_lstm.data.corpus`), PTB possibly downloaded into
:func:`ptb_download_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_mp_lstm.data.corpus import SPLITS, read_sentences, resolve_split_paths
from lightning_mp_lstm.data.synthetic import DEFAULT_SPLIT_SIZES, SyntheticLanguage

__all__ = ["SOURCES", "file_sentences", "longest_sentence", "ptb_download_dir", "synthetic_sentences"]

#: Allowed values of ``source``.
SOURCES: tuple[str, ...] = ("synthetic", "ptb", "wikitext", "text")

_DEFAULT_CACHE = "~/.cache/lightning_mp_lstm"
_SPLIT_SIZE_KEYS = {"num_train": "train", "num_valid": "valid", "num_test": "test"}


def ptb_download_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where PTB is downloaded: ``<cache_dir>/ptb`` (default cache ``~/.cache/lightning_mp_lstm``)."""
    return Path(cache_dir or _DEFAULT_CACHE).expanduser() / "ptb"


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


def file_sentences(
    source: str,
    path: str | None,
    train: str | None,
    valid: str | None,
    test: str | None,
    single_file_for_all_splits: bool = False,
) -> dict[str, list[list[str]]]:
    """Every split's sentences, read from the files of a corpus directory ``path`` or explicit split files.

    ``source`` picks the reader's format (``"ptb"``, ``"wikitext"``, else plain ``"text"``); the files are
    found by :func:`~lightning_mp_lstm.data.corpus.resolve_split_paths`.

    Raises:
        CorpusError: If a split's file is missing, empty or not UTF-8 text.
    """
    files = resolve_split_paths(path, train, valid, test, single_file_for_all_splits=single_file_for_all_splits)
    fmt = {"ptb": "ptb", "wikitext": "wikitext"}.get(source, "text")
    return {split: read_sentences(files[split], fmt=fmt) for split in SPLITS}


def longest_sentence(sentences: list[list[str]], files: tuple[Any, ...] | None,
                     single_file_for_all_splits: bool = False) -> tuple[int, str]:
    """The longest of a training split's ``sentences`` (each ending with ``<eos>``): its length and where it is.

    Args:
        sentences: the training split, as read.
        files: ``(path, train, valid, test)`` of a file corpus (the training file's line is then named), or ``None``
            (a synthetic corpus: the sentence's number is).
        single_file_for_all_splits: as given to :func:`file_sentences`.
    """
    if not sentences:
        return 0, "no sentence"
    index = max(range(len(sentences)), key=lambda i: len(sentences[i]))
    if files is None:
        return len(sentences[index]), f"sentence {index + 1} of the training split"
    train = resolve_split_paths(*files, single_file_for_all_splits=single_file_for_all_splits)["train"]
    with open(train, encoding="utf-8") as handle:  # the index-th non-blank line (blank lines hold no sentence)
        seen = -1
        for number, line in enumerate(handle, start=1):
            seen += bool(line.split())
            if seen == index:
                return len(sentences[index]), f"line {number} of {train}"
    return len(sentences[index]), f"sentence {index + 1} of {train}"
