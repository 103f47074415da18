"""The token store: every corpus file tokenized once into memory-mapped token ids, cached on disk.

The shape of fairseq's and Megatron's indexed datasets. A split is stored as ``tokens.bin`` (its ids, ``<eos>``
after every sentence: ``uint16`` when the vocabulary fits, else ``int32``), ``offsets.bin`` (int64 start of every
sentence, then the number of tokens) and ``lines.bin`` (int64 1-based line of every sentence in its file, for
messages that name a line); the data module maps them with numpy
(:class:`~lightning_mp_lstm.data.encoded.EncodedSplit`), so a process holds no token in its own memory and the
corpus is limited by disk, not memory.

Everything lives under ``<cache_dir>/tokens/``, one directory per entry, named by a key:

* ``vocab-<key>/vocab.json``: the vocabulary of a training file, keyed by the file's content (SHA-256),
  ``min_freq``, ``max_vocab_size`` and :data:`FORMAT`;
* ``split-<key>/``: a file encoded with a vocabulary, keyed by the file's content, the vocabulary's
  :attr:`~lightning_mp_lstm.data.vocab.Vocabulary.digest` and :data:`FORMAT`, so a vocabulary restored from a
  checkpoint encodes with its own ids and a changed corpus is tokenized again.

Each entry's ``meta.json`` records the size and CRC-32 of its files; they are checked whenever the entry is opened,
and an entry that fails (a truncated or altered file, a missing or unreadable ``meta.json``) is rebuilt with a
warning on the ``lightning_mp_lstm.data`` logger, never used. An entry is built in a temporary directory beside it
and renamed into place; processes that open a new corpus together (the ranks of one ``torchrun``) take a file lock
(``fcntl.flock``) per entry: one builds, the others wait and then map what it built.

Building a training file's vocabulary reads the file once: each chunk of lines is split with ``str.split`` and
mapped to provisional ids (a dict lookup per token, in C), the vocabulary is built from their counts
(``numpy.bincount``), and the training split is those ids mapped to the vocabulary's; validation and test files are
encoded with the vocabulary in one pass each.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_mp_lstm.data.corpus import CorpusError, check_corpus_file, empty_error, read_chunks
from lightning_mp_lstm.data.encoded import TOKENS_PER_CHUNK, EncodedSplit, token_dtype
from lightning_mp_lstm.data.vocab import EOS, PAD, UNK, Vocabulary, check_vocabulary_options

__all__ = ["DEFAULT_CACHE_DIR", "FORMAT", "TokenStore", "file_checksum", "file_sha256"]

log = logging.getLogger("lightning_mp_lstm.data")

#: Version of the stored layout; part of every key, so a new layout never reads an old one.
FORMAT = 1
#: The cache root when none is given (``LMDataModule(cache_dir=None)``).
DEFAULT_CACHE_DIR = "~/.cache/lightning_mp_lstm"
_BUFFER = 1 << 24
_SPLIT_FILES = ("tokens.bin", "offsets.bin", "lines.bin")


def _read_blocks(path: Path) -> Iterator[memoryview]:
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            yield view[:size]


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's content, read 16 MiB at a time (the key of its token-store entries)."""
    digest = hashlib.sha256()
    for block in _read_blocks(Path(path)):
        digest.update(block)
    return digest.hexdigest()


def file_checksum(path: str | os.PathLike[str]) -> int:
    """CRC-32 of a file's content: the fast check of a token-store file when it is opened."""
    crc = 0
    for block in _read_blocks(Path(path)):
        crc = zlib.crc32(block, crc)
    return crc


def _key(kind: str, *parts: Any) -> str:
    return f"{kind}-" + hashlib.sha256(json.dumps([FORMAT, kind, *parts]).encode()).hexdigest()[:40]


class _Missing(Exception):
    """The entry does not exist."""


class _Damaged(Exception):
    """The entry exists but fails its checks (the message says how)."""


def _verify(directory: Path) -> dict[str, Any]:
    """The entry's meta, once its files have the recorded sizes and checksums.

    Raises:
        _Missing: If there is no entry.
        _Damaged: If ``meta.json`` is missing, unreadable or not this format's, or a file is missing, of another
            size or fails its checksum.
    """
    if not directory.is_dir():
        raise _Missing
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Damaged("meta.json is missing") from None
    except (OSError, ValueError) as err:
        raise _Damaged(f"meta.json is unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != directory.name:
        raise _Damaged(f"meta.json is not format {FORMAT}'s record of this entry")
    try:
        for name, record in meta["files"].items():
            try:
                size = (directory / name).stat().st_size
            except FileNotFoundError:
                raise _Damaged(f"{name} is missing") from None
            if size != record["bytes"]:
                raise _Damaged(f"{name} has {size:,} bytes, meta.json records {record['bytes']:,}")
            if file_checksum(directory / name) != record["crc32"]:
                raise _Damaged(f"{name} does not match its checksum: a byte changed")
    except (KeyError, TypeError, AttributeError) as err:
        raise _Damaged(f"meta.json lacks a file's record ({err!r})") from None
    return meta


class _FirstSeen(dict):
    """Word -> provisional id, in order of first appearance (a new word gets the next id)."""

    def __missing__(self, word: str) -> int:
        self[word] = index = len(self)
        return index


def _tokenize(path: Path, ids: dict[str, int], dtype: np.dtype, eos_id: int, out: Path, tokens_name: str,
              sha256: str) -> tuple[int, int]:
    """One streaming pass over ``path``: every non-blank line's ids (``ids[word]``) and ``eos_id`` appended to
    ``out / tokens_name``, the sentences' offsets to ``offsets.bin`` and their line numbers to ``lines.bin``.

    Returns:
        The numbers of sentences and of tokens.

    Raises:
        CorpusError: For a binary, non-UTF-8 or empty file, or one whose content is no longer ``sha256``.
    """
    digest, sentences, total = hashlib.sha256(), 0, 0
    with open(out / tokens_name, "wb") as tokens, open(out / "offsets.bin", "wb") as offsets, \
            open(out / "lines.bin", "wb") as lines:
        np.zeros(1, dtype=np.int64).tofile(offsets)
        for chunk in read_chunks(path, on_bytes=digest.update):
            per_line = list(map(str.split, chunk.text.split("\n")))
            counts = np.fromiter(map(len, per_line), dtype=np.int64, count=len(per_line))
            nonblank = np.flatnonzero(counts)
            if not nonblank.size:
                continue
            words = np.fromiter(map(ids.__getitem__, itertools.chain.from_iterable(per_line)), dtype=dtype,
                                count=int(counts.sum()))
            del per_line
            ends = np.cumsum(counts[nonblank] + 1)
            encoded = np.full(int(ends[-1]), eos_id, dtype=dtype)
            is_word = np.ones(encoded.size, dtype=bool)
            is_word[ends - 1] = False
            encoded[is_word] = words
            encoded.tofile(tokens)
            (total + ends).tofile(offsets)
            (chunk.first_line + nonblank).astype(np.int64).tofile(lines)
            sentences, total = sentences + int(nonblank.size), total + int(encoded.size)
    if not sentences:
        raise empty_error(path)
    if digest.hexdigest() != sha256:
        raise CorpusError(f"corpus file {str(path)!r} changed while it was being read; run again")
    return sentences, total


def _chunks_of(path: Path, dtype: Any) -> Iterator[np.ndarray]:
    """The ids of a file, read (not mapped: no page of it stays in the process) ``TOKENS_PER_CHUNK`` at a time."""
    with open(path, "rb") as handle:
        while (chunk := np.fromfile(handle, dtype=dtype, count=TOKENS_PER_CHUNK)).size:
            yield chunk


class TokenStore:
    """Tokenized corpus files under ``<cache_dir>/tokens`` (see the module's description).

    When that directory cannot be written, the entries are built in a temporary directory of this process (removed
    when it exits), with a warning.

    Args:
        cache_dir: The cache root (``None``: :data:`DEFAULT_CACHE_DIR`).
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.requested = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "tokens"
        self._root: Path | None = None
        self._digests: dict[tuple, str] = {}

    @property
    def root(self) -> Path:
        """The directory that holds the entries (created on first use)."""
        if self._root is None:
            try:
                self.requested.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryFile(dir=self.requested).close()
                self._root = self.requested
            except OSError as err:
                self._root = Path(tempfile.mkdtemp(prefix="lightning_mp_lstm-tokens-"))
                atexit.register(shutil.rmtree, self._root, True)
                log.warning("cannot write the token cache in %s (%s): tokenizing into %s, for this process only "
                            "(set cache_dir to a writable directory to keep it)", self.requested, err, self._root)
        return self._root

    def digest(self, path: str | os.PathLike[str]) -> str:
        """SHA-256 of a corpus file (remembered while its size, modification time and inode stay the same).

        Raises:
            CorpusError: If the file does not exist or is a directory.
        """
        p = check_corpus_file(path)
        stat = p.stat()
        memo = (str(p.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
        if memo not in self._digests:
            self._digests[memo] = file_sha256(p)
        return self._digests[memo]

    def vocabulary(self, train: str | os.PathLike[str], min_freq: int = 1, max_size: int | None = None
                   ) -> Vocabulary:
        """The vocabulary of a training file (built by
        :meth:`~lightning_mp_lstm.data.vocab.Vocabulary.from_counts` from its words' counts, so it is the one
        :meth:`~lightning_mp_lstm.data.vocab.Vocabulary.build` gives for its sentences); building it also stores
        the file encoded with it.

        Raises:
            CorpusError: For a missing, binary, non-UTF-8 or empty file.
            ValueError: For invalid ``min_freq`` or ``max_size``.
        """
        check_vocabulary_options(min_freq, max_size)
        path = check_corpus_file(train)
        sha256 = self.digest(path)
        key = _key("vocab", sha256, min_freq, max_size)
        self._entry(key, path, lambda out: self._build_vocabulary(out, path, sha256, min_freq, max_size))
        return Vocabulary(json.loads((self.root / key / "vocab.json").read_text(encoding="utf-8")))

    def split(self, path: str | os.PathLike[str], vocab: Vocabulary) -> EncodedSplit:
        """A corpus file encoded with ``vocab``, memory-mapped (its messages name ``path``).

        Raises:
            CorpusError: For a missing, binary, non-UTF-8 or empty file.
        """
        p = check_corpus_file(path)
        sha256 = self.digest(p)
        key = _key("split", sha256, vocab.digest)
        meta = self._entry(key, p, lambda out: self._build_split(out, p, sha256, vocab))
        return EncodedSplit.open(self.root / key, meta["dtype"], meta["num_sentences"], meta["num_tokens"],
                                 source=str(path))

    # ----------------------------------------------------------------------------------------------- entries
    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold the entry's file lock (another process that holds it is waited for)."""
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process to build the token cache %s", self.root / key)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _entry(self, key: str, source: Path, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """The meta of entry ``key``, built first (``build(directory)`` writes its files and returns its meta)
        when it is missing or damaged."""
        directory = self.root / key
        try:
            return _verify(directory)
        except (_Missing, _Damaged):
            pass  # decided under the lock: another process may be building it right now
        with self._locked(key):
            try:
                return _verify(directory)
            except _Missing:
                pass
            except _Damaged as damage:
                log.warning("the token cache %s of %s is damaged (%s): rebuilding it", directory, source, damage)
                trash = Path(tempfile.mkdtemp(prefix=f".trash-{key}-", dir=self.root))
                os.replace(directory, trash / key)
                shutil.rmtree(trash, ignore_errors=True)
            for leftover in self.root.glob(f".tmp-{key}-*"):  # of a process that died building it
                shutil.rmtree(leftover, ignore_errors=True)
            building = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
            try:
                start = time.perf_counter()
                meta = {"format": FORMAT, "key": key, **build(building)}
                meta["files"] = {p.name: {"bytes": p.stat().st_size, "crc32": file_checksum(p)}
                                 for p in sorted(building.iterdir())}
                (building / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
                os.replace(building, directory)
            finally:
                shutil.rmtree(building, ignore_errors=True)
            log.info("token cache: %s (%s) built from %s in %.1f s", directory, meta["kind"], source,
                     time.perf_counter() - start)
            return meta

    def _build_split(self, out: Path, path: Path, sha256: str, vocab: Vocabulary) -> dict[str, Any]:
        dtype = token_dtype(len(vocab))
        sentences, tokens = _tokenize(path, vocab.ids(), dtype, vocab.eos_id, out, "tokens.bin", sha256)
        return _split_meta(path, sha256, vocab, dtype, sentences, tokens)

    def _build_vocabulary(self, out: Path, path: Path, sha256: str, min_freq: int, max_size: int | None
                          ) -> dict[str, Any]:
        provisional = _FirstSeen({PAD: 0, UNK: 1, EOS: 2})
        sentences, tokens = _tokenize(path, provisional, np.dtype(np.uint32), 2, out, "provisional.bin", sha256)
        counts = np.zeros(len(provisional), dtype=np.int64)
        for chunk in _chunks_of(out / "provisional.bin", np.uint32):
            counts += np.bincount(chunk, minlength=counts.size)
        words = list(provisional)
        del provisional
        vocab = Vocabulary.from_counts(dict(zip(words, counts.tolist())), min_freq=min_freq, max_size=max_size)
        (out / "vocab.json").write_text(json.dumps(vocab.tokens, ensure_ascii=False), encoding="utf-8")

        def encoded(split: Path) -> dict[str, Any]:  # the provisional ids mapped to the vocabulary's
            dtype = token_dtype(len(vocab))
            to_vocab = np.fromiter(map(vocab.ids().__getitem__, words), dtype=dtype, count=len(words))
            with open(split / "tokens.bin", "wb") as handle:
                for chunk in _chunks_of(out / "provisional.bin", np.uint32):
                    to_vocab[chunk].tofile(handle)
            for name in _SPLIT_FILES[1:]:
                os.replace(out / name, split / name)
            return _split_meta(path, sha256, vocab, dtype, sentences, tokens)

        self._entry(_key("split", sha256, vocab.digest), path, encoded)
        for name in ("provisional.bin", *_SPLIT_FILES[1:]):
            (out / name).unlink(missing_ok=True)
        return {"kind": "vocabulary", "source": str(path), "source_sha256": sha256, "min_freq": min_freq,
                "max_vocab_size": max_size, "size": len(vocab), "vocab_sha256": vocab.digest}


def _split_meta(path: Path, sha256: str, vocab: Vocabulary, dtype: np.dtype, sentences: int, tokens: int
                ) -> dict[str, Any]:
    return {"kind": "split", "source": str(path), "source_sha256": sha256, "vocab_sha256": vocab.digest,
            "vocab_size": len(vocab), "dtype": dtype.str, "num_sentences": sentences, "num_tokens": tokens}
