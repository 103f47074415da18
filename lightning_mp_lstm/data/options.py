"""The check of :class:`~lightning_mp_lstm.data.LMDataModule`'s options, run when it is made.

:func:`check_options` refuses a value outside its allowed set and a combination that cannot work (a token
stream with a token budget, a synthetic corpus with files, a file corpus without any), before anything is read,
with a message that names the option and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_mp_lstm.base.validation import check_positive_int
from lightning_mp_lstm.data.buckets import LONG_SENTENCE_POLICIES
from lightning_mp_lstm.data.sources import SOURCES

__all__ = ["MODES", "check_options"]

#: How batches are formed: bucketed independent sentences, or windows of one continuous token stream.
MODES: tuple[str, ...] = ("sentences", "stream")


def check_options(
    *,
    source: str,
    path: str | None,
    train: str | None,
    valid: str | None,
    test: str | None,
    download: bool,
    synthetic: dict[str, Any] | None,
    buckets: Sequence[int] | str | None,
    long_sentence_policy: str,
    max_bucket_length: int | str | None = "auto",
    batch_size: int | None,
    max_tokens: int | None,
    mode: str,
    bptt: int,
) -> None:
    """Raise ``ValueError`` for the first invalid option or combination (arguments as ``LMDataModule``'s)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    check_positive_int("bptt", bptt)
    if mode == "stream" and (batch_size is None or max_tokens is not None):
        raise ValueError(
            f"mode='stream' cuts the stream into batch_size rows: give batch_size and no max_tokens "
            f"(got batch_size={batch_size}, max_tokens={max_tokens})"
        )
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; expected one of {', '.join(SOURCES)}")
    if long_sentence_policy not in LONG_SENTENCE_POLICIES:
        raise ValueError(
            f"unknown long_sentence_policy {long_sentence_policy!r}; allowed: {', '.join(LONG_SENTENCE_POLICIES)}"
        )
    if batch_size is None and max_tokens is None:
        raise ValueError("give batch_size and/or max_tokens")
    if isinstance(buckets, str) and buckets != "auto":
        raise ValueError(f"buckets must be a list of lengths, 'auto' or None, got {buckets!r}")
    if max_bucket_length is not None:
        check_positive_int("max_bucket_length", max_bucket_length, also=("auto",))
    if synthetic and source != "synthetic":
        raise ValueError(f"'synthetic' options given but source is {source!r}")
    files = path or train or valid or test or download
    if source == "synthetic" and files:
        raise ValueError("source='synthetic' takes no files; set source to 'ptb', 'wikitext' or 'text'")
    if source != "synthetic" and not files:
        raise ValueError(f"source={source!r} needs a path (directory), explicit train/valid/test files or download")
    if download and source != "ptb":
        raise ValueError("download=True is only available for source='ptb'")
