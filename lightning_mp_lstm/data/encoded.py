"""A split's sentences as token ids: one flat array and an offsets index, in memory or memory-mapped.

Every split the data module uses takes this form (:class:`EncodedSplit`), whether its ids were encoded in memory
(the synthetic language's sentences, sampled in memory) or memory-mapped from the token store's files
(:mod:`~lightning_mp_lstm.data.token_store`): the datasets (:class:`~lightning_mp_lstm.data.buckets.BucketedDataset`,
:class:`~lightning_mp_lstm.data.stream.TokenStream`) read sentence lengths from the offsets and slice the ids they
serve, so no Python object per token is ever made and no int64 copy of a split is ever held.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_mp_lstm.data.vocab import Vocabulary

__all__ = ["EncodedSplit", "token_dtype", "unigram_perplexity"]

#: Tokens handled at a time by whole-split computations (counts, perplexity): bounded temporary memory.
TOKENS_PER_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest id type of a vocabulary: ``uint16`` when its ids fit, else ``int32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


class EncodedSplit:
    """Encoded sentences: sentence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (each ends with ``<eos>``).

    Args:
        tokens: Every sentence's ids, concatenated (1-D integer array or memory map).
        offsets: ``(n + 1,)`` int64 start of every sentence, then the number of tokens.
        line_numbers: ``(n,)`` 1-based line of every sentence in its file, or ``None`` (not read from a file).
        source: The file the split was read from, for messages (``None``: none).
        directory: The token store's directory the arrays are mapped from (``None``: in memory); a split with one
            pickles as that path and maps the files again when unpickled, never copying the ids.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, line_numbers: np.ndarray | None = None,
                 source: str | None = None, directory: str | Path | None = None) -> None:
        if offsets.ndim != 1 or offsets.size < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != tokens.size:
            raise ValueError(f"offsets must start at 0 and end at the {tokens.size} tokens")
        if line_numbers is not None and line_numbers.size != offsets.size - 1:
            raise ValueError(f"{line_numbers.size} line numbers for {offsets.size - 1} sentences")
        self.tokens = tokens
        self.offsets = offsets
        self.line_numbers = line_numbers
        self.source = source
        self.directory = None if directory is None else Path(directory)

    @classmethod
    def from_sequences(cls, sentences: Sequence[Sequence[int]]) -> EncodedSplit:
        """In-memory int64 split of already encoded sentences."""
        lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
        tokens = np.fromiter(itertools.chain.from_iterable(sentences), dtype=np.int64, count=int(lengths.sum()))
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @classmethod
    def from_sentences(cls, sentences: Sequence[Sequence[str]], vocab: Vocabulary) -> EncodedSplit:
        """Encode tokenized sentences (each ending with ``"<eos>"``) in memory, in the vocabulary's id type."""
        lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
        words = itertools.chain.from_iterable(sentences)
        tokens = np.fromiter(map(vocab.ids().__getitem__, words), dtype=token_dtype(len(vocab)),
                             count=int(lengths.sum()))
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @classmethod
    def open(cls, directory: str | Path, dtype: str, num_sentences: int, num_tokens: int,
             source: str | None = None) -> EncodedSplit:
        """Map a split stored by the token store (``tokens.bin``, ``offsets.bin``, ``lines.bin`` in ``directory``)
        read-only; nothing is read until it is used."""
        directory = Path(directory)

        def mapped(name: str, kind: Any, count: int) -> np.ndarray:
            return np.memmap(directory / name, dtype=kind, mode="r", shape=(count,)) if count else np.zeros(0, kind)

        return cls(mapped("tokens.bin", np.dtype(dtype), num_tokens),
                   mapped("offsets.bin", np.int64, num_sentences + 1), mapped("lines.bin", np.int64, num_sentences),
                   source=source, directory=directory)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.directory is None:
            return super().__reduce__()
        return (EncodedSplit.open, (str(self.directory), self.tokens.dtype.str, len(self), self.num_tokens,
                                    self.source))

    def __len__(self) -> int:
        return int(self.offsets.size) - 1

    def __repr__(self) -> str:
        where = f", mapped from {str(self.directory)!r}" if self.directory is not None else ""
        return f"EncodedSplit({len(self):,} sentences, {self.num_tokens:,} tokens, {self.tokens.dtype}{where})"

    @property
    def num_tokens(self) -> int:
        """Tokens of all sentences, ``<eos>`` included."""
        return int(self.tokens.size)

    def lengths(self) -> np.ndarray:
        """``(n,)`` int64 length of every sentence, ``<eos>`` included."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def sentence(self, index: int) -> np.ndarray:
        """Sentence ``index``'s ids (int64)."""
        return self.tokens[int(self.offsets[index]):int(self.offsets[index + 1])].astype(np.int64)

    def chunks(self, size: int = TOKENS_PER_CHUNK) -> Iterator[np.ndarray]:
        """The ids, ``size`` at a time: views of :attr:`tokens` in memory; read from the file of a mapped split (a
        pass over the whole map would count every page of it in this process's resident memory)."""
        if self.directory is None:
            for start in range(0, self.num_tokens, size):
                yield self.tokens[start:start + size]
            return
        with open(self.directory / "tokens.bin", "rb") as stored:
            for start in range(0, self.num_tokens, size):
                yield np.fromfile(stored, dtype=self.tokens.dtype, count=min(size, self.num_tokens - start))

    def longest(self) -> tuple[int, str]:
        """The longest sentence (the first of equal ones): its length and where it is (``line N of <file>`` when
        read from a file, else ``sentence N of the training split``)."""
        if not len(self):
            return 0, "no sentence"
        index = int(np.argmax(self.lengths()))
        length = int(self.offsets[index + 1] - self.offsets[index])
        if self.line_numbers is None or self.source is None:
            return length, f"sentence {index + 1} of the training split"
        return length, f"line {int(self.line_numbers[index])} of {self.source}"


def unigram_perplexity(train: EncodedSplit, valid: EncodedSplit, vocab_size: int) -> float:
    """Perplexity on ``valid`` of a unigram model estimated on ``train`` (add-one smoothing over the vocabulary,
    ``<pad>`` excluded), counting ``TOKENS_PER_CHUNK`` ids at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in train.chunks():
        counts += np.bincount(chunk, minlength=vocab_size)
    smoothed = counts.astype(float) + 1.0
    smoothed[0] = 0.0
    logp = np.log(smoothed / smoothed.sum(), where=smoothed > 0, out=np.full(vocab_size, -np.inf))
    if valid.num_tokens <= TOKENS_PER_CHUNK:  # the whole split at once: numpy's pairwise mean, as before
        return float(np.exp(-logp[np.asarray(valid.tokens)].mean()))
    total = math.fsum(float(logp[chunk].sum()) for chunk in valid.chunks())
    return float(np.exp(-total / valid.num_tokens))
