"""Readers for line-based language-modelling corpora (Penn Treebank, WikiText).

Both formats are read the same way: every non-blank line is one "sentence",
split on whitespace, with ``<eos>`` appended. ``<unk>`` tokens already present
in the files (PTB, WikiText) are kept as they are. WikiText heading lines such
as `` = Title = `` are ordinary text lines.

A file is read in binary chunks of whole lines (:func:`read_chunks`, about
:data:`CHUNK_BYTES` each), so a corpus of any size streams through in bounded
memory: the token store (:mod:`~lightning_mp_lstm.data.token_store`) tokenizes
it chunk by chunk, :func:`read_sentences` collects the chunks of a small file.
Lines end at ``b"\\n"`` only, so a chunk never ends inside a UTF-8 character or
between ``\\r`` and ``\\n``, and every chunk decodes and splits exactly as the
whole file would.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, NamedTuple

__all__ = ["CHUNK_BYTES", "SPLITS", "SPLIT_FILE_NAMES", "Chunk", "CorpusError", "check_corpus_file",
           "empty_error", "read_chunks", "read_sentences", "resolve_split_paths"]

#: The three splits, in order.
SPLITS: tuple[str, str, str] = ("train", "valid", "test")

#: File names looked for (in this order) when a directory is given.
SPLIT_FILE_NAMES: Mapping[str, tuple[str, ...]] = {
    split: (f"ptb.{split}.txt", f"wiki.{split}.tokens", f"{split}.txt") for split in SPLITS
}

#: Bytes read at a time by :func:`read_chunks` (a chunk is then cut after its last line end).
CHUNK_BYTES = 2 << 20

_FORMATS = ("auto", "ptb", "wikitext", "text")
_EOS = "<eos>"


class CorpusError(ValueError):
    """A corpus file or directory is missing, empty, binary or not valid UTF-8."""


class Chunk(NamedTuple):
    """Whole lines of a corpus file, decoded.

    Attributes:
        text: The lines, each ending with ``"\\n"`` except perhaps the file's last.
        first_line: 1-based line number of the chunk's first line in the file.
    """

    text: str
    first_line: int


def check_corpus_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path`, if it is a file.

    Raises:
        CorpusError: If it does not exist or is a directory.
    """
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise CorpusError(f"corpus file {str(p)!r} {what}")
    return p


def _binary_error(path: Path, line: int, offset: int) -> CorpusError:
    return CorpusError(f"corpus file {str(path)!r} looks binary: NUL byte on line {line} (byte offset {offset})")


def _first_nul(path: Path) -> CorpusError | None:
    """The error of the file's first NUL byte, if it has one."""
    offset, line = 0, 1
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            nul = block.find(b"\x00")
            if nul >= 0:
                return _binary_error(path, line + block.count(b"\n", 0, nul), offset + nul)
            offset, line = offset + len(block), line + block.count(b"\n")
    return None


def _raw_chunks(handle: BinaryIO) -> Iterator[bytes]:
    """Whole lines of a binary file, about :data:`CHUNK_BYTES` at a time (a longer line is one chunk)."""
    pending: list[bytes] = []  # the start of a line that no block read so far ends
    while block := handle.read(CHUNK_BYTES):
        cut = block.rfind(b"\n") + 1
        if not cut:
            pending.append(block)
            continue
        yield b"".join([*pending, block[:cut]]) if pending else block[:cut]
        pending = [block[cut:]] if cut < len(block) else []
    if pending:
        yield b"".join(pending)


def read_chunks(path: str | os.PathLike[str], on_bytes: Callable[[bytes], object] | None = None) -> Iterator[Chunk]:
    """Decode a UTF-8 corpus file in chunks of whole lines.

    The checks are the whole file's: a NUL byte anywhere is reported before invalid UTF-8 (a UTF-16 file, whose
    ASCII characters hold NUL bytes, is called binary), each naming the line and byte offset of the first bad
    byte in the file.

    Args:
        path: The file.
        on_bytes: Called with every chunk's bytes before it is decoded (e.g. a digest's ``update``).

    Yields:
        The file's chunks (:class:`Chunk`), in order.

    Raises:
        CorpusError: If the file does not exist, is a directory, contains a NUL byte or is not valid UTF-8 (raised
            when the generator reaches the chunk that holds the bad byte).
    """
    p = check_corpus_file(path)
    offset, line = 0, 1
    with open(p, "rb") as handle:
        for data in _raw_chunks(handle):
            if on_bytes is not None:
                on_bytes(data)
            nul = data.find(b"\x00")
            if nul >= 0:
                raise _binary_error(p, line + data.count(b"\n", 0, nul), offset + nul)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                binary = _first_nul(p)
                if binary is not None:  # a NUL byte later in the file: the file is binary, as a whole read says
                    raise binary from None
                bad_line = line + data.count(b"\n", 0, err.start)
                raise CorpusError(
                    f"corpus file {str(p)!r} is not valid UTF-8: line {bad_line} "
                    f"(byte offset {offset + err.start}, byte 0x{data[err.start]:02x})"
                ) from None
            yield Chunk(text, line)
            offset, line = offset + len(data), line + data.count(b"\n")


def empty_error(path: str | os.PathLike[str]) -> CorpusError:
    """The error of a corpus file without a single token."""
    return CorpusError(f"corpus file {str(path)!r} is empty: it contains no tokens")


def read_sentences(path: str | os.PathLike[str], fmt: str = "auto") -> list[list[str]]:
    """Read a PTB- or WikiText-style file into sentences.

    Every non-blank line becomes one sentence: its whitespace-separated tokens
    followed by ``"<eos>"``. Blank lines are skipped. The formats differ only in
    their usual file names; ``fmt`` is validated but all formats are read with
    the same line-based rule (WikiText headings like `` = Title = `` are text).
    The sentences are Python lists: for a large corpus use the token store
    (:mod:`~lightning_mp_lstm.data.token_store`), which never holds them.

    Args:
        path: The file to read (UTF-8 text).
        fmt: ``"auto"``, ``"ptb"``, ``"wikitext"`` or ``"text"``.

    Returns:
        The sentences, each a list of tokens ending with ``"<eos>"``.

    Raises:
        CorpusError: If the file does not exist, contains NUL bytes (binary),
            is not valid UTF-8 (the message names the line of the first bad
            byte) or contains no tokens.
        ValueError: If ``fmt`` is unknown.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"unknown corpus format {fmt!r}; expected one of {', '.join(_FORMATS)}")
    sentences: list[list[str]] = []
    for chunk in read_chunks(path):
        # Split on "\n" only: str.splitlines() would also break on characters such as
        # U+2028 or U+0085 that can occur inside WikiText lines.
        sentences += [tokens + [_EOS] for tokens in map(str.split, chunk.text.split("\n")) if tokens]
    if not sentences:
        raise empty_error(path)
    return sentences


def resolve_split_paths(
    path: str | os.PathLike[str] | None = None,
    train: str | os.PathLike[str] | None = None,
    valid: str | os.PathLike[str] | None = None,
    test: str | os.PathLike[str] | None = None,
    *,
    single_file_for_all_splits: bool = False,
) -> dict[str, Path]:
    """Find the train/valid/test files of a corpus.

    ``path`` is normally a directory holding files with the usual split names
    (see :data:`SPLIT_FILE_NAMES`: ``ptb.{split}.txt``, ``wiki.{split}.tokens``
    or ``{split}.txt``, tried in that order). Explicit ``train``/``valid``/``test``
    file paths override what the directory provides, and may be given without
    ``path``.

    A single *file* given as ``path`` is used for every split that has no
    explicit path only when ``single_file_for_all_splits=True`` (handy for quick
    experiments, but the validation data then overlaps the training data);
    otherwise it is an error.

    Args:
        path: A corpus directory, or a file (see above), or ``None``.
        train: Explicit training file.
        valid: Explicit validation file.
        test: Explicit test file.
        single_file_for_all_splits: Allow ``path`` to be one file used for all splits.

    Returns:
        ``{"train": Path, "valid": Path, "test": Path}``.

    Raises:
        CorpusError: If a named path does not exist, or a split cannot be found
            (the message names the directory and the file names looked for).
    """
    explicit = {"train": train, "valid": valid, "test": test}
    base: Path | None = Path(path) if path is not None else None
    if base is not None and not base.exists():
        raise CorpusError(f"corpus path {str(base)!r} does not exist")
    if base is not None and base.is_file() and not single_file_for_all_splits:
        if any(explicit[s] is None for s in SPLITS):
            raise CorpusError(
                f"corpus path {str(base)!r} is a file, not a directory; pass a directory with "
                "train/valid/test files, explicit train/valid/test paths, or "
                "single_file_for_all_splits=True to use this one file for every split"
            )
    resolved: dict[str, Path] = {}
    for split in SPLITS:
        given = explicit[split]
        if given is not None:
            p = Path(given)
            if not p.is_file():
                what = "is a directory, not a file" if p.is_dir() else "does not exist"
                raise CorpusError(f"{split} file {str(p)!r} {what}")
            resolved[split] = p
        elif base is None:
            raise CorpusError(
                f"no file for the {split} split: give a corpus directory (path) or an explicit {split} path"
            )
        elif base.is_file():
            resolved[split] = base
        else:
            names = SPLIT_FILE_NAMES[split]
            found = next((base / n for n in names if (base / n).is_file()), None)
            if found is None:
                raise CorpusError(
                    f"missing {split} split in corpus directory {str(base)!r}: looked for {', '.join(names)}"
                )
            resolved[split] = found
    return resolved
