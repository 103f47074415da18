"""Tests for the synthetic hidden-class language."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from lightning_mp_lstm.data.synthetic import SyntheticLanguage, synthetic_splits


@pytest.fixture(scope="module")
def lang() -> SyntheticLanguage:
    return SyntheticLanguage(seed=0)


@pytest.fixture(scope="module")
def sample(lang: SyntheticLanguage) -> list[list[str]]:
    return lang.sample(12000, seed=11)


def _entropy(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_deterministic_by_seed(lang: SyntheticLanguage) -> None:
    again = SyntheticLanguage(seed=0)
    assert again.sample(50, seed=3) == lang.sample(50, seed=3)
    assert lang.sample(50, seed=4) != lang.sample(50, seed=3)
    other = SyntheticLanguage(seed=1)
    assert other.entropy_rate() != lang.entropy_rate()
    assert other.sample(50, seed=3) != lang.sample(50, seed=3)
    a = synthetic_splits(seed=5, num_train=30, num_valid=10, num_test=10)
    b = synthetic_splits(seed=5, num_train=30, num_valid=10, num_test=10)
    assert a == b and [len(x) for x in a] == [30, 10, 10]
    assert a[1] != a[2]


def test_vocabulary_and_sentence_form(lang: SyntheticLanguage, sample: list[list[str]]) -> None:
    assert lang.vocab_size >= 1000
    words = Counter(w for s in sample for w in s[:-1])
    assert len(words) >= 1000 and all(w.startswith("w") and w[1:].isdigit() for w in words)
    assert all(s[-1] == "<eos>" and "<eos>" not in s[:-1] for s in sample)


def test_length_spread_like_natural_text(lang: SyntheticLanguage, sample: list[list[str]]) -> None:
    lengths = np.array([len(s) for s in sample])
    assert lengths.min() >= 3 and lengths.max() <= 60
    assert np.percentile(lengths, 5) <= 8 and np.percentile(lengths, 95) >= 35
    assert lengths.max() >= 55  # long tail reaches the clip
    assert 15 <= lengths.mean() <= 25
    assert lengths.mean() == pytest.approx(lang.expected_length(), rel=0.02)


def test_entropy_rate_matches_monte_carlo(lang: SyntheticLanguage, sample: list[list[str]]) -> None:
    total = sum(lang.log_prob(s) for s in sample)
    tokens = sum(len(s) for s in sample)
    assert -total / tokens == pytest.approx(lang.entropy_rate(), rel=0.02)


def test_unigram_and_bigram_entropy_match_samples(lang: SyntheticLanguage, sample: list[list[str]]) -> None:
    unigram = Counter(t for s in sample for t in s)
    assert _entropy(unigram) == pytest.approx(lang.unigram_entropy(), rel=0.02)
    # The next token depends on the previous word only through its class, so the
    # bigram conditional entropy is H(next | previous class); estimate it by plug-in.
    k = lang.num_classes
    joint: Counter = Counter()
    for s in sample:
        prev = "start"
        for t in s:
            joint[(prev, t)] += 1
            prev = int(t[1:]) % k if t != "<eos>" else None
    marginal: Counter = Counter()
    for (prev, _), c in joint.items():
        marginal[prev] += c
    n = sum(joint.values())
    cond = -sum(c / n * math.log(c / marginal[p]) for (p, _), c in joint.items())
    assert cond == pytest.approx(lang.bigram_entropy(), rel=0.02)


def test_floor_below_bigram_below_unigram(lang: SyntheticLanguage) -> None:
    floor, bigram, unigram = lang.entropy_rate(), lang.bigram_entropy(), lang.unigram_entropy()
    assert floor < bigram < unigram
    # structure beyond one token matters a lot, and the task is far from trivial
    assert math.exp(bigram) > 2 * math.exp(floor)
    assert math.exp(unigram) > 3 * math.exp(floor)


def test_tiny_language_exact_by_enumeration() -> None:
    """Probabilities sum to one and the DP entropy equals brute-force enumeration."""
    tiny = SyntheticLanguage(seed=3, vocab_size=5, num_classes=2, min_length=2, max_length=4, mean_length=2.5)
    words = tiny.words
    probs = []
    lengths = []
    for n in range(1, 4):
        for combo in itertools.product(words, repeat=n):
            s = [*combo, "<eos>"]
            lp = tiny.log_prob(s)
            probs.append(math.exp(lp))
            lengths.append(len(s))
    p = np.array(probs)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    expected_len = float((p * np.array(lengths)).sum())
    assert tiny.expected_length() == pytest.approx(expected_len, rel=1e-9)
    ent = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert tiny.entropy_rate() == pytest.approx(ent / expected_len, rel=1e-9)


def test_log_prob_details(lang: SyntheticLanguage, sample: list[list[str]]) -> None:
    s = sample[0]
    assert sum(lang.token_log_probs(s)) == pytest.approx(lang.log_prob(s))
    assert lang.log_prob(["<eos>"]) == -math.inf  # shorter than min_length
    with pytest.raises(ValueError, match="not part of the synthetic language"):
        lang.log_prob(["cat", "<eos>"])
    with pytest.raises(ValueError, match="must be the last token"):
        lang.log_prob(["w1", "<eos>", "w2", "<eos>"])


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticLanguage(vocab_size=3, num_classes=8)
    with pytest.raises(ValueError, match="min_length"):
        SyntheticLanguage(min_length=1)


def test_a_draw_picks_the_first_word_whose_emission_cdf_exceeds_it_without_a_row_per_sentence() -> None:
    """Sampling searches each class's CDF: comparing every draw with its class's whole CDF made an array of sentences
    x words per class (3.7 GiB for 80,000 sentences of 50,000 words: every process of the autopilot's 4-process
    vocabulary job peaked at 8 GiB before training and the kernel killed one)."""
    import tracemalloc

    big = SyntheticLanguage(seed=0, vocab_size=50_000)
    rng = np.random.default_rng(0)
    classes = rng.integers(0, big.num_classes, 500)
    draws = np.concatenate([rng.random(498), [0.0, 2.0]])  # 2.0: above every CDF, rank 0 as argmax gives
    by_comparison = (big._emission_cdf[classes] > draws[:, None]).argmax(axis=1)
    assert np.array_equal(big._emission_rank(classes, draws), by_comparison)
    tracemalloc.start()
    try:
        big.sample(2_000, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000 * (50_000 // big.num_classes) * 8 / 4, peak  # a quarter of the one comparison's array
