"""Word vocabulary with fixed special tokens."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_mp_lstm.base.validation import check_positive_int

__all__ = ["EOS", "PAD", "UNK", "Vocabulary", "check_vocabulary_options"]

PAD = "<pad>"
UNK = "<unk>"
EOS = "<eos>"
_SPECIALS = (PAD, UNK, EOS)
_STATE_VERSION = 1


class Vocabulary:
    """Bidirectional token <-> id mapping.

    Ids ``0``, ``1`` and ``2`` are always ``<pad>``, ``<unk>`` and ``<eos>``;
    the remaining words follow in order of decreasing training frequency, ties
    broken alphabetically, so a vocabulary built from the same data is always
    identical. Words not in the vocabulary are encoded as ``<unk>``.

    Args:
        tokens: The full id -> token table, starting with ``<pad>``, ``<unk>``,
            ``<eos>``. Use :meth:`build` to create one from sentences.

    Raises:
        ValueError: If the table does not start with the special tokens or has duplicates.
    """

    pad_id: int = 0
    unk_id: int = 1
    eos_id: int = 2

    def __init__(self, tokens: Sequence[str]) -> None:
        tokens = list(tokens)
        if tuple(tokens[:3]) != _SPECIALS:
            raise ValueError(f"a vocabulary must start with {list(_SPECIALS)}, got {tokens[:3]}")
        index = {t: i for i, t in enumerate(tokens)}
        if len(index) != len(tokens):
            dup = next(t for t, c in Counter(tokens).items() if c > 1)
            raise ValueError(f"duplicate token {dup!r} in vocabulary")
        self._itos = tokens
        self._stoi = index

    @classmethod
    def build(
        cls, sentences: Iterable[Sequence[str]], min_freq: int = 1, max_size: int | None = None
    ) -> Vocabulary:
        """Build a vocabulary from (training) sentences.

        Special tokens in the data are not counted (they always have their
        fixed ids).

        Args:
            sentences: Tokenised sentences, normally the training split only.
            min_freq: Words seen fewer times become ``<unk>``.
            max_size: Maximum total size *including* the 3 special tokens
                (``None``: unlimited); the most frequent words are kept.

        Returns:
            The vocabulary.

        Raises:
            ValueError: If ``min_freq`` is not a positive integer or ``max_size < 3``.
        """
        counts: Counter[str] = Counter()
        for sentence in sentences:
            counts.update(sentence)
        return cls.from_counts(counts, min_freq=min_freq, max_size=max_size)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_freq: int = 1, max_size: int | None = None) -> Vocabulary:
        """Build a vocabulary from word counts (of the training split): :meth:`build` without the sentences.

        Args:
            counts: Occurrences of every word; the special tokens' counts are ignored.
            min_freq: Words counted fewer times become ``<unk>``.
            max_size: Maximum total size *including* the 3 special tokens (``None``: unlimited).

        Returns:
            The vocabulary :meth:`build` gives for sentences with these counts.

        Raises:
            ValueError: If ``min_freq`` is not a positive integer or ``max_size < 3``.
        """
        check_vocabulary_options(min_freq, max_size)
        words = sorted((w for w, c in counts.items() if c >= min_freq and w not in _SPECIALS),
                       key=lambda w: (-counts[w], w))
        if max_size is not None:
            words = words[: max_size - len(_SPECIALS)]
        return cls([*_SPECIALS, *words])

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self._itos == other._itos

    def __hash__(self) -> int:
        return hash(tuple(self._itos))

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)})"

    @property
    def tokens(self) -> list[str]:
        """A copy of the id -> token table."""
        return list(self._itos)

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the id -> token table: equal vocabularies, and only they, share it (the token store keys
        a split encoded with this vocabulary by it)."""
        if getattr(self, "_digest", None) is None:
            table = json.dumps(self._itos, ensure_ascii=False).encode("utf-8", "surrogatepass")
            self._digest = hashlib.sha256(table).hexdigest()
        return self._digest

    def ids(self) -> dict[str, int]:
        """The token -> id table as a dict that answers ``unk_id`` for a word it lacks (``ids[word]``, without
        the ``get`` call per token that :meth:`encode` makes: ``map(ids.__getitem__, words)`` runs in C)."""
        return _Ids(self._stoi)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Map tokens to ids, unknown tokens to ``unk_id``."""
        get, unk = self._stoi.get, self.unk_id
        return [get(t, unk) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Map ids back to tokens.

        Raises:
            IndexError: For an id outside ``[0, len(self))``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._itos):
                raise IndexError(f"token id {i} out of range for a vocabulary of size {len(self)}")
            out.append(self._itos[i])
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain, picklable state (``{"version": 1, "tokens": [...]}``)."""
        return {"version": _STATE_VERSION, "tokens": list(self._itos)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Vocabulary:
        """Recreate a vocabulary saved with :meth:`state_dict`.

        Raises:
            ValueError: If the state is not a vocabulary state.
        """
        if "tokens" not in state:
            raise ValueError("not a vocabulary state: missing 'tokens'")
        version = state.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported vocabulary state version {version}")
        return cls(state["tokens"])


def check_vocabulary_options(min_freq: int, max_size: int | None) -> None:
    """Raise ``ValueError`` unless ``min_freq`` is a positive integer and ``max_size`` is ``None`` or at least 3 (the
    special tokens), as :meth:`Vocabulary.build` needs."""
    check_positive_int("min_freq", min_freq)
    if max_size is not None and max_size < len(_SPECIALS):
        raise ValueError(f"max_size must be >= {len(_SPECIALS)} (the special tokens), got {max_size}")


class _Ids(dict):
    """A token -> id dict whose missing words are ``<unk>``."""

    def __missing__(self, token: str) -> int:
        return Vocabulary.unk_id


def vocabulary_difference(ours: Vocabulary, theirs: Vocabulary) -> str | None:
    """How two vocabularies differ, for a message (``None`` when they are equal).

    Returns:
        e.g. ``"10,000 words vs 6,021 words; first difference at id 4: 'the' vs 'a'"``.
    """
    if ours == theirs:
        return None
    a, b = ours.tokens, theirs.tokens
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def word(tokens: list[str]) -> str:
        return repr(tokens[index]) if index < len(tokens) else "(none)"

    return f"{len(a):,} words vs {len(b):,} words; first difference at id {index}: {word(a)} vs {word(b)}"
