"""Tests for the vocabulary."""

from __future__ import annotations

import pickle

import pytest

from lightning_mp_lstm.data.vocab import Vocabulary

SENTENCES = [
    ["the", "cat", "sat", "<eos>"],
    ["the", "dog", "sat", "<unk>", "<eos>"],
    ["a", "cat", "the", "<eos>"],
]


def test_special_ids_and_frequency_order() -> None:
    v = Vocabulary.build(SENTENCES)
    assert (v.pad_id, v.unk_id, v.eos_id) == (0, 1, 2)
    # the:3, cat:2, sat:2, a:1, dog:1 -> frequency desc, then alphabetical
    assert v.tokens == ["<pad>", "<unk>", "<eos>", "the", "cat", "sat", "a", "dog"]
    assert len(v) == 8
    assert "<unk>" in v and "cow" not in v


def test_encode_decode_and_unseen_words() -> None:
    v = Vocabulary.build(SENTENCES)
    assert v.encode(["the", "cow", "sat", "<eos>"]) == [3, 1, 5, 2]
    assert v.decode([3, 1, 5, 2]) == ["the", "<unk>", "sat", "<eos>"]
    with pytest.raises(IndexError, match="out of range"):
        v.decode([99])


def test_min_freq_and_max_size() -> None:
    v = Vocabulary.build(SENTENCES, min_freq=2)
    assert v.tokens == ["<pad>", "<unk>", "<eos>", "the", "cat", "sat"]
    assert v.encode(["dog"]) == [1]
    small = Vocabulary.build(SENTENCES, max_size=5)
    assert small.tokens == ["<pad>", "<unk>", "<eos>", "the", "cat"]
    assert Vocabulary.build(SENTENCES, max_size=3).tokens == ["<pad>", "<unk>", "<eos>"]
    with pytest.raises(ValueError, match="max_size"):
        Vocabulary.build(SENTENCES, max_size=2)
    with pytest.raises(ValueError, match="min_freq"):
        Vocabulary.build(SENTENCES, min_freq=0)


def test_deterministic_regardless_of_sentence_order() -> None:
    assert Vocabulary.build(SENTENCES) == Vocabulary.build(list(reversed(SENTENCES)))


def test_state_dict_roundtrip_is_plain_and_picklable() -> None:
    v = Vocabulary.build(SENTENCES)
    state = v.state_dict()
    assert set(state) == {"version", "tokens"} and all(isinstance(t, str) for t in state["tokens"])
    restored = Vocabulary.from_state_dict(pickle.loads(pickle.dumps(state)))
    assert restored == v and restored.encode(["dog", "zebra"]) == v.encode(["dog", "zebra"])
    state["tokens"].append("mutated")  # the state is a copy
    assert len(v) == 8


def test_invalid_tables_rejected() -> None:
    with pytest.raises(ValueError, match="must start with"):
        Vocabulary(["a", "<pad>", "<unk>", "<eos>"])
    with pytest.raises(ValueError, match="duplicate token 'a'"):
        Vocabulary(["<pad>", "<unk>", "<eos>", "a", "a"])
    with pytest.raises(ValueError, match="missing 'tokens'"):
        Vocabulary.from_state_dict({})
