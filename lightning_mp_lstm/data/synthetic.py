"""Embedded synthetic language with an exactly computable entropy rate.

The language is a *hidden-class* language:

* The ``vocab_size`` words ``w0 .. w{V-1}`` are split into ``num_classes`` classes;
  word ``w{i}`` belongs to class ``i % K`` and has rank ``i // K`` inside it.
  Because every word belongs to exactly one class, the class history of a
  sentence can be read off its words, which makes the true conditional
  distribution of the next token computable.
* Classes follow a second-order Markov chain: the next class depends on the two
  previous classes (a start marker fills in at the beginning of a sentence), so
  structure spans more than one token and a bigram model cannot reach the floor.
  Each row of the transition table is drawn from a sparse Dirichlet
  distribution.
* Inside a class, words are emitted with Zipf-like probabilities
  ``p(rank r) ~ 1 / (r + 1) ** zipf_exponent``.
* Before each word the sentence may end. The end probability depends on the
  position (number of words so far, derived from a discretised log-normal
  length distribution) and on the class of the previous word, so sentence
  lengths spread roughly from 3 to 60 tokens like natural text and are clipped
  to ``max_length`` tokens (including ``<eos>``).

Language-model convention (shared with :mod:`lightning_mp_lstm.data.batch`):
a sentence ``[w1 .. wn, <eos>]`` is fed as input ``[<eos>, w1 .. wn]`` with
target ``[w1 .. wn, <eos>]``, so every word and the end of the sentence are
predicted given the full sentence prefix. All entropies below are in nats per
predicted token under this convention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_mp_lstm.base.validation import check_positive_int

__all__ = ["DEFAULT_SPLIT_SIZES", "SyntheticLanguage", "synthetic_splits"]

_EOS = "<eos>"

#: Default number of sentences per split used by :func:`synthetic_splits`.
DEFAULT_SPLIT_SIZES: dict[str, int] = {"train": 80000, "valid": 2000, "test": 2000}


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy (nats) along ``axis``, treating ``0 log 0`` as 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=axis)


def _binary_entropy(h: np.ndarray) -> np.ndarray:
    return _entropy(np.stack([h, 1.0 - h], axis=-1))


def _lognormal_cdf(x: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    z = (np.log(np.maximum(x, 1e-12)) - mu) / (sigma * math.sqrt(2.0))
    return 0.5 * (1.0 + np.array([math.erf(v) for v in z]))


class SyntheticLanguage:
    """A seeded hidden-class language whose entropy rate is known exactly.

    Construction is cheap (a few small numpy tables); nothing is sampled until
    :meth:`sample` is called.

    Args:
        seed: Seed of the language itself (tables of transitions, end hazards).
        vocab_size: Number of distinct words (``<eos>`` not included).
        num_classes: Number of hidden word classes ``K``.
        zipf_exponent: Exponent of the Zipf-like emission inside each class.
        transition_concentration: Dirichlet concentration of each row of the
            second-order class transition table; small values give sparse,
            predictable transitions.
        mean_length: Mean sentence length in tokens (``<eos>`` included) of the
            base length distribution (before the class effect on ending).
        length_sigma: Log-scale spread of the base log-normal length distribution.
        min_length: Minimum sentence length in tokens (``<eos>`` included), >= 2.
        max_length: Maximum sentence length in tokens (``<eos>`` included).
        end_class_strength: Standard deviation of the per-class log-odds
            adjustment of the end-of-sentence probability (0 disables it).

    Raises:
        ValueError: If a parameter is out of range.
    """

    def __init__(
        self,
        seed: int = 0,
        vocab_size: int = 1000,
        num_classes: int = 8,
        zipf_exponent: float = 1.1,
        transition_concentration: float = 0.1,
        mean_length: float = 20.0,
        length_sigma: float = 0.55,
        min_length: int = 3,
        max_length: int = 60,
        end_class_strength: float = 0.5,
    ) -> None:
        check_positive_int("num_classes", num_classes)
        if vocab_size < num_classes:
            raise ValueError(f"vocab_size ({vocab_size}) must be >= num_classes ({num_classes})")
        if not 2 <= min_length <= max_length:
            raise ValueError(f"need 2 <= min_length <= max_length, got {min_length}, {max_length}")
        if transition_concentration <= 0 or zipf_exponent < 0 or mean_length <= 0 or length_sigma <= 0:
            raise ValueError("transition_concentration, mean_length, length_sigma must be > 0, zipf_exponent >= 0")
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self.num_classes = int(num_classes)
        self.zipf_exponent = float(zipf_exponent)
        self.transition_concentration = float(transition_concentration)
        self.mean_length = float(mean_length)
        self.length_sigma = float(length_sigma)
        self.min_length = int(min_length)
        self.max_length = int(max_length)
        self.end_class_strength = float(end_class_strength)
        self._build_tables()
        self._cache: dict[str, float] = {}

    # ------------------------------------------------------------------ tables
    def _build_tables(self) -> None:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x5EED]))
        k, v = self.num_classes, self.vocab_size
        self.words: list[str] = [f"w{i}" for i in range(v)]
        self._word_index = {w: i for i, w in enumerate(self.words)}
        self._word_class = np.arange(v) % k
        # Emission: member j of class c is word c + j*K, Zipf weight by rank j.
        sizes = np.bincount(self._word_class, minlength=k)
        width = int(sizes.max())
        emis = np.zeros((k, width))
        for c in range(k):
            w = 1.0 / np.arange(1, sizes[c] + 1) ** self.zipf_exponent
            emis[c, : sizes[c]] = w / w.sum()
        self._emission = emis  # (K, width): P(rank | class)
        self._emission_cdf = np.cumsum(emis, axis=1)
        self._emission_cdf[:, -1] = 1.0 + 1e-12
        self._emission_entropy = _entropy(emis)  # (K,)
        # Second-order class transitions; index K is the sentence-start marker.
        trans = rng.dirichlet(np.full(k, self.transition_concentration), size=(k + 1) * (k + 1))
        trans = np.maximum(trans, 1e-12)  # keep every event possible (finite log-probs)
        trans /= trans.sum(axis=1, keepdims=True)
        self._trans = trans.reshape(k + 1, k + 1, k)  # [c_{t-2}, c_{t-1}, c_t]
        self._trans_cdf = np.cumsum(self._trans, axis=2)
        self._trans_cdf[..., -1] = 1.0 + 1e-12
        # End-of-sentence hazard by number of words so far (t) and previous class:
        # the hazard of a discretised log-normal length distribution, shifted per
        # class in log-odds space, 0 below min_length and 1 at max_length.
        tokens = np.arange(1, self.max_length + 1)  # sentence length in tokens if it ends after t words
        mu = math.log(self.mean_length) - 0.5 * self.length_sigma**2
        pmf = _lognormal_cdf(tokens + 0.5, mu, self.length_sigma) - _lognormal_cdf(tokens - 0.5, mu, self.length_sigma)
        pmf[tokens < self.min_length] = 0.0
        survival = pmf[::-1].cumsum()[::-1]
        base = np.divide(pmf, survival, out=np.ones_like(pmf), where=survival > 0).clip(0.0, 1.0)
        base[-1] = 1.0  # forced end at max_length tokens
        class_bias = rng.normal(0.0, 1.0, size=k + 1) * self.end_class_strength
        class_bias[k] = 0.0  # no previous word yet
        with np.errstate(divide="ignore"):
            logit = np.log(base) - np.log1p(-base)
        hazard = 1.0 / (1.0 + np.exp(-(logit[:, None] + class_bias[None, :])))
        hazard[base == 0.0, :] = 0.0
        hazard[base == 1.0, :] = 1.0
        self._hazard = hazard  # (max_length, K+1): P(end | t words so far, previous class)

    # --------------------------------------------------------------- sampling
    def sample(self, num_sentences: int, seed: int = 0) -> list[list[str]]:
        """Draw sentences from the language.

        Args:
            num_sentences: Number of sentences to draw.
            seed: Sampling seed; the same ``(language, seed)`` always gives the
                same sentences.

        Returns:
            Sentences as lists of words (``"w123"``), each ending with ``"<eos>"``.
        """
        n = int(num_sentences)
        if n < 0:
            raise ValueError(f"num_sentences must be >= 0, got {num_sentences}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0xD47A, int(seed)]))
        k = self.num_classes
        c2 = np.full(n, k)
        c1 = np.full(n, k)
        active = np.ones(n, dtype=bool)
        out = np.full((n, self.max_length), -1, dtype=np.int64)
        lengths = np.zeros(n, dtype=np.int64)
        for t in range(self.max_length):
            idx = np.flatnonzero(active)
            if idx.size == 0:
                break
            ends = rng.random(idx.size) < self._hazard[t, c1[idx]]
            lengths[idx[ends]] = t
            active[idx[ends]] = False
            idx = idx[~ends]
            if idx.size == 0:
                break
            cdf = self._trans_cdf[c2[idx], c1[idx]]
            cls = (cdf > rng.random(idx.size)[:, None]).argmax(axis=1)
            rank = self._emission_rank(cls, rng.random(idx.size))
            out[idx, t] = cls + rank * k
            c2[idx], c1[idx] = c1[idx], cls
        words = self.words
        return [[words[i] for i in out[s, : lengths[s]]] + [_EOS] for s in range(n)]

    def _emission_rank(self, classes: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """The word of its class each draw picks: the first rank whose emission CDF exceeds it (0 where none does).

        A search per class rather than a comparison of every draw with its class's whole CDF: that made an array of
        sentences x words per class (3.7 GiB for 80,000 sentences of a 50,000-word language, in every process)."""
        width = self._emission_cdf.shape[1]
        rank = np.empty(draws.size, dtype=np.int64)
        for c in np.unique(classes):
            rows = classes == c
            found = np.searchsorted(self._emission_cdf[c], draws[rows], side="right")
            rank[rows] = np.where(found == width, 0, found)
        return rank

    # ------------------------------------------------------------ probability
    def token_log_probs(self, sentence: Sequence[str]) -> list[float]:
        """Exact natural-log probability of each token given the sentence prefix.

        Args:
            sentence: Words of one sentence, normally ending with ``"<eos>"``;
                ``"<eos>"`` may only appear as the last token.

        Returns:
            ``log p(token_i | sentence start, token_1 .. token_{i-1})`` for every
            token; ``-inf`` for impossible events.

        Raises:
            ValueError: For a word that is not in the language or a misplaced ``<eos>``.
        """
        k = self.num_classes
        c2 = c1 = k
        out: list[float] = []
        for t, tok in enumerate(sentence):
            h = self._hazard[t, c1] if t < self.max_length else 1.0
            if tok == _EOS:
                if t != len(sentence) - 1:
                    raise ValueError(f"'<eos>' must be the last token, found at position {t}")
                out.append(math.log(h) if h > 0 else -math.inf)
                continue
            i = self._word_index.get(tok)
            if i is None:
                raise ValueError(f"word {tok!r} is not part of the synthetic language")
            cls, rank = i % k, i // k
            p = (1.0 - h) * self._trans[c2, c1, cls] * self._emission[cls, rank]
            out.append(math.log(p) if p > 0 else -math.inf)
            c2, c1 = c1, cls
        return out

    def log_prob(self, sentence: Sequence[str]) -> float:
        """Exact natural-log probability of a whole sentence.

        This is the sum of :meth:`token_log_probs`, i.e. the log-probability of
        every token (words and the final ``<eos>``) conditioned on the sentence
        start. Divide the sum over a corpus by its number of tokens to get a
        per-token value comparable with :meth:`entropy_rate`.

        Args:
            sentence: Words of one sentence ending with ``"<eos>"``.

        Returns:
            ``log P(sentence)`` in nats (``-inf`` if impossible).
        """
        return float(sum(self.token_log_probs(sentence)))

    # -------------------------------------------------------------- entropies
    def _state_masses(self) -> np.ndarray:
        """``P(reach position t with class history (c2, c1), not yet ended)``, shape ``(T, K+1, K+1)``.

        Every reached state emits exactly one token, so the total mass is the
        expected number of tokens per sentence.
        """
        if not hasattr(self, "_masses"):
            k = self.num_classes
            p = np.zeros((k + 1, k + 1))
            p[k, k] = 1.0
            masses = []
            for t in range(self.max_length):
                masses.append(p)
                go_on = p * (1.0 - self._hazard[t])[None, :]  # (c2, c1)
                p = np.zeros_like(p)
                # (c2, c1) --c--> (c1, c); the start marker is never a next class.
                p[:, :k] = np.einsum("ab,abc->bc", go_on, self._trans)
            self._masses = np.stack(masses)
        return self._masses

    def expected_length(self) -> float:
        """Exact expected sentence length in tokens (``<eos>`` included)."""
        if "len" not in self._cache:
            self._cache["len"] = float(self._state_masses().sum())
        return self._cache["len"]

    def entropy_rate(self) -> float:
        """Exact entropy of the next token given the full sentence prefix.

        Computed by dynamic programming over the distribution of (position,
        previous two classes): ``sum_{t,s} P(t,s) H(next | t,s) / sum_{t,s} P(t,s)``,
        i.e. total entropy divided by expected tokens per sentence. ``exp`` of
        this value is the best perplexity any model can reach (the floor).

        Returns:
            Entropy rate in nats per predicted token.
        """
        if "rate" not in self._cache:
            masses = self._state_masses()
            h = self._hazard[:, None, :]  # (T, 1, c1)
            trans_h = _entropy(self._trans)  # (c2, c1)
            emit_h = self._trans @ self._emission_entropy  # (c2, c1)
            word_h = trans_h + emit_h
            ent = _binary_entropy(h) + (1.0 - h) * word_h[None]
            self._cache["rate"] = float((masses * ent).sum() / masses.sum())
        return self._cache["rate"]

    def _class_marginals(self) -> tuple[np.ndarray, float, np.ndarray]:
        """Expected per-sentence counts of each next-class and of ``<eos>``, by previous class."""
        masses, hazard = self._state_masses(), self._hazard
        total = float(masses.sum())
        go = masses * (1.0 - hazard)[:, None, :]  # (T, c2, c1)
        # joint[c1, c] = expected count of (previous class c1, next class c)
        joint_cls = np.einsum("tab,abc->bc", go, self._trans)
        joint_eos = (masses * hazard[:, None, :]).sum(axis=(0, 1))  # (c1,)
        return joint_cls, total, joint_eos

    def unigram_entropy(self) -> float:
        """Exact entropy of the marginal token distribution (unigram baseline).

        The marginal is the expected count of every token per sentence divided
        by the expected number of tokens, computed exactly (not from samples).

        Returns:
            Entropy in nats per token; ``exp`` of it is the unigram perplexity.
        """
        if "uni" not in self._cache:
            joint_cls, total, joint_eos = self._class_marginals()
            p_cls = joint_cls.sum(axis=0) / total
            p_eos = joint_eos.sum() / total
            ent = _entropy(np.append(p_cls, p_eos)) + float(p_cls @ self._emission_entropy)
            self._cache["uni"] = float(ent)
        return self._cache["uni"]

    def bigram_entropy(self) -> float:
        """Exact conditional entropy of a token given only the previous token.

        The previous token of a sentence's first word is ``<eos>`` (the
        beginning-of-sentence marker). Since a word determines its class and the
        next token depends on the previous word only through that class, this
        is ``H(next token | previous class)``. It is the floor of an ideal bigram
        model and lies between :meth:`entropy_rate` and :meth:`unigram_entropy`.

        Returns:
            Entropy in nats per token.
        """
        if "bi" not in self._cache:
            joint_cls, total, joint_eos = self._class_marginals()
            ent = 0.0
            for c1 in range(self.num_classes + 1):
                row = np.append(joint_cls[c1], joint_eos[c1])
                mass = row.sum()
                if mass <= 0:
                    continue
                q = row / mass
                ent += mass / total * (float(_entropy(q)) + float(q[:-1] @ self._emission_entropy))
            self._cache["bi"] = float(ent)
        return self._cache["bi"]


def synthetic_splits(
    seed: int = 0,
    num_train: int = DEFAULT_SPLIT_SIZES["train"],
    num_valid: int = DEFAULT_SPLIT_SIZES["valid"],
    num_test: int = DEFAULT_SPLIT_SIZES["test"],
    **language_kwargs: object,
) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """Sample train/valid/test splits of the synthetic language.

    The language is ``SyntheticLanguage(seed=seed, **language_kwargs)`` and the
    three splits are drawn with distinct sampling seeds, so they are disjoint
    samples of the same source.

    Args:
        seed: Seed of the language and of the samples.
        num_train: Number of training sentences.
        num_valid: Number of validation sentences.
        num_test: Number of test sentences.
        **language_kwargs: Further :class:`SyntheticLanguage` arguments.

    Returns:
        ``(train, valid, test)`` lists of sentences ending with ``"<eos>"``.
    """
    lang = SyntheticLanguage(seed=seed, **language_kwargs)  # type: ignore[arg-type]
    return (
        lang.sample(num_train, seed=1),
        lang.sample(num_valid, seed=2),
        lang.sample(num_test, seed=3),
    )
