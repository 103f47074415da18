"""Readers for line-based language-modelling corpora (Penn Treebank, WikiText).

Both formats are read the same way: every non-blank line is one "sentence",
split on whitespace, with ``<eos>`` appended. ``<unk>`` tokens already present
in the files (PTB, WikiText) are kept as they are. WikiText heading lines such
as `` = Title = `` are ordinary text lines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SPLITS", "SPLIT_FILE_NAMES", "CorpusError", "read_sentences", "resolve_split_paths"]

#: The three splits, in order.
SPLITS: tuple[str, str, str] = ("train", "valid", "test")

#: File names looked for (in this order) when a directory is given.
SPLIT_FILE_NAMES: Mapping[str, tuple[str, ...]] = {
    split: (f"ptb.{split}.txt", f"wiki.{split}.tokens", f"{split}.txt") for split in SPLITS
}

_FORMATS = ("auto", "ptb", "wikitext", "text")
_EOS = "<eos>"


class CorpusError(ValueError):
    """A corpus file or directory is missing, empty, binary or not valid UTF-8."""


def _line_of(data: bytes, offset: int) -> int:
    """1-based line number of byte ``offset`` in ``data``."""
    return data.count(b"\n", 0, offset) + 1


def read_sentences(path: str | os.PathLike[str], fmt: str = "auto") -> list[list[str]]:
    """Read a PTB- or WikiText-style file into sentences.

    Every non-blank line becomes one sentence: its whitespace-separated tokens
    followed by ``"<eos>"``. Blank lines are skipped. The formats differ only in
    their usual file names; ``fmt`` is validated but all formats are read with
    the same line-based rule (WikiText headings like `` = Title = `` are text).

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
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise CorpusError(f"corpus file {str(p)!r} {what}")
    data = p.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise CorpusError(
            f"corpus file {str(p)!r} looks binary: NUL byte on line {_line_of(data, nul)} (byte offset {nul})"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"corpus file {str(p)!r} is not valid UTF-8: line {_line_of(data, err.start)} "
            f"(byte offset {err.start}, byte 0x{data[err.start]:02x})"
        ) from None
    # Split on "\n" only: str.splitlines() would also break on characters such as
    # U+2028 or U+0085 that can occur inside WikiText lines.
    sentences = [tokens + [_EOS] for tokens in (line.split() for line in text.split("\n")) if tokens]
    if not sentences:
        raise CorpusError(f"corpus file {str(p)!r} is empty: it contains no tokens")
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
