"""The token store (issue 43): corpus files tokenized once into memory-mapped ids, cached, checked and shared.

The ids, the vocabulary and the batches equal what the data layer computed before it had a store (the old way is
computed here, from Python lists); the cache is reused, keyed by content and vocabulary options, rebuilt with a
warning when damaged, built once when two processes open a new corpus together; bad files keep their messages; a
memory-mapped split pickles as its path.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
from pathlib import Path

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from lightning_mp_lstm.data import LMDataModule, Vocabulary, corpus, token_store
from lightning_mp_lstm.data.buckets import BucketedDataset
from lightning_mp_lstm.data.corpus import CorpusError, read_chunks, read_sentences
from lightning_mp_lstm.data.encoded import EncodedSplit
from lightning_mp_lstm.data.stream import TokenStream
from lightning_mp_lstm.data.token_store import TokenStore

#: WikiText's layout in small: headings are text, blank lines hold no sentence, "\r\n", multi-byte characters, a
#: line separator inside a line (U+2028 separates tokens, never lines), no final newline.
WIKI = (" \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles \n\n = = Gameplay = = \n"
        " the game 's <unk> is 日本 and é \r\n a\u2028b c\x85d \n\n\n the end , of the <unk> game \n the last line")


@pytest.fixture
def wiki(tmp_path: Path) -> dict[str, Path]:
    """A WikiText-style directory: train, valid and test files."""
    files = {split: tmp_path / "wiki" / f"wiki.{split}.tokens" for split in ("train", "valid", "test")}
    files["train"].parent.mkdir()
    files["train"].write_bytes(WIKI.encode())
    files["valid"].write_bytes(" \n the game is new \n = = Plot = = \n".encode())
    files["test"].write_bytes(" the <unk> of Valkyria \n".encode())
    return files


def _old_encoding(path: Path, vocab: Vocabulary) -> list[list[int]]:
    return [vocab.encode(s) for s in read_sentences(path)]


def _built(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("token cache: ")]


# ----- round trip ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("min_freq", "max_size"), [(1, None), (2, None), (1, 9)])
def test_vocabulary_and_ids_equal_the_old_encoding(wiki, ptb, tmp_path, min_freq, max_size):
    store = TokenStore(tmp_path / "cache")
    for train in (wiki["train"], ptb / "ptb.valid.txt"):
        vocab = store.vocabulary(train, min_freq=min_freq, max_size=max_size)
        assert vocab == Vocabulary.build(read_sentences(train), min_freq=min_freq, max_size=max_size)
        for path in (train, wiki["valid"], ptb / "ptb.test.txt"):
            split = store.split(path, vocab)
            old = _old_encoding(path, vocab)
            assert len(split) == len(old) and split.lengths().tolist() == list(map(len, old))
            assert split.tokens.dtype == np.uint16 and isinstance(split.tokens, np.memmap)
            assert split.tokens.tolist() == [i for s in old for i in s]


def test_line_numbers_name_the_lines_of_the_file(wiki, tmp_path):
    split = TokenStore(tmp_path).split(wiki["train"], Vocabulary.build(read_sentences(wiki["train"])))
    lines = WIKI.split("\n")
    assert split.line_numbers.tolist() == [n + 1 for n, line in enumerate(lines) if line.split()]
    assert split.longest() == (9, f"line 7 of {wiki['train']}")
    assert EncodedSplit.from_sequences([[3, 2], [4, 5, 2]]).longest() == (3, "sentence 2 of the training split")


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 8, 13, 4096])
def test_chunks_of_whole_lines_read_as_the_whole_file(wiki, monkeypatch, chunk_bytes):
    """Whatever the chunk size, a chunk ends after a line: a multi-byte character or "\\r\\n" is never cut."""
    monkeypatch.setattr(corpus, "CHUNK_BYTES", chunk_bytes)
    chunks = list(read_chunks(wiki["train"]))
    assert "".join(c.text for c in chunks) == WIKI
    assert all(c.text.endswith("\n") for c in chunks[:-1])
    assert [c.first_line for c in chunks] == [1 + "".join(x.text for x in chunks[:i]).count("\n")
                                              for i in range(len(chunks))]
    whole = [[*line.split(), "<eos>"] for line in WIKI.split("\n") if line.split()]
    assert read_sentences(wiki["train"]) == whole


def _whole_file(path: Path) -> list[list[str]] | str:
    """How the data layer read a file before it read chunks: the sentences, or the error's message."""
    data = path.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        return f"looks binary: NUL byte on line {line} (byte offset {nul})"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return f"is not valid UTF-8: line {line} (byte offset {err.start}, byte 0x{data[err.start]:02x})"
    sentences = [tokens + ["<eos>"] for tokens in (line.split() for line in text.split("\n")) if tokens]
    return sentences or "is empty: it contains no tokens"


#: Text: words, spaces, line ends, multi-byte characters, Unicode whitespace (U+2028, U+0085, U+001C), a BOM.
TEXT = [b"a", b"bc ", b" ", b"\n", b"\r\n", "é".encode(), "日".encode(), "\u2028".encode(), b"\t", "\x85".encode(),
        "\ufeff".encode(), b"\x1c"]
#: And what makes a file bad: a NUL byte, bytes that are no UTF-8 or only part of a character.
BYTES = [*TEXT, b"\x00", b"\xe9", b"\xff", b"\xc3", b"\xa9", b"\x85"]


@hypothesis.settings(max_examples=300, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(pieces=st.lists(st.sampled_from(TEXT), max_size=40) | st.lists(st.sampled_from(BYTES), max_size=40),
                  chunk_bytes=st.integers(1, 20))
def test_reading_in_chunks_gives_the_whole_file_s_sentences_and_errors(tmp_path, pieces, chunk_bytes):
    data = b"".join(pieces)
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    expected = _whole_file(path)
    chunks = corpus.CHUNK_BYTES
    corpus.CHUNK_BYTES = chunk_bytes
    try:
        if isinstance(expected, str):
            with pytest.raises(CorpusError) as err:
                read_sentences(path)
            assert str(err.value) == f"corpus file {str(path)!r} {expected}"
        else:
            assert read_sentences(path) == expected
    finally:
        corpus.CHUNK_BYTES = chunks


# ----- bad input -------------------------------------------------------------------------------------------------
BAD = {
    "binary": (b"fine line\nsecond\nbad\x00\x01\x02\n", r"looks binary: NUL byte on line 3 \(byte offset 20\)"),
    "latin1": ("ok line\nstill ok é\n".encode() + "caf\xe9 au lait\n".encode("latin-1"),
               r"not valid UTF-8: line 3 \(byte offset 23, byte 0xe9\)"),
    "utf16": ("the cat\nsat\n".encode("utf-16"), r"looks binary: NUL byte on line 1 \(byte offset 3\)"),
    "bad UTF-8, then a NUL": (b"caf\xe9\n" + b"ok\n" * 40 + b"x\x00\n", r"looks binary: NUL byte on line 42"),
    "empty": (b" \n\n \t \n", r"is empty: it contains no tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_keep_their_messages_in_the_store(case, tmp_path, monkeypatch):
    data, message = BAD[case]
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 7)  # the bad byte in a later chunk: lines and offsets of the file
    path = tmp_path / f"{case}.txt"
    path.write_bytes(data)
    with pytest.raises(CorpusError, match=message):
        read_sentences(path)
    with pytest.raises(CorpusError, match=message):
        TokenStore(tmp_path / "cache").vocabulary(path)
    with pytest.raises(CorpusError, match=message):
        TokenStore(tmp_path / "cache").split(path, Vocabulary.build([["a"]]))
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir() if not p.name.endswith(".lock")) == []


def test_missing_files_and_directories_keep_their_messages(tmp_path):
    store = TokenStore(tmp_path / "cache")
    with pytest.raises(CorpusError, match=r"nope\.txt.*does not exist"):
        store.vocabulary(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match="is a directory, not a file"):
        store.split(tmp_path, Vocabulary.build([["a"]]))


def test_a_file_that_changes_while_it_is_read_is_not_cached(wiki, tmp_path, monkeypatch):
    store = TokenStore(tmp_path / "cache")
    monkeypatch.setattr(store, "digest", lambda path: "0" * 64)  # what the file held when its key was computed
    with pytest.raises(CorpusError, match="changed while it was being read"):
        store.vocabulary(wiki["train"])
    assert [p.name for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()] == []


# ----- the cache -------------------------------------------------------------------------------------------------
def test_the_cache_is_reused_and_keyed_by_content_and_vocabulary_options(wiki, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_mp_lstm.data")
    cache = tmp_path / "cache"

    def setup(**kwargs) -> LMDataModule:
        data = LMDataModule(source="wikitext", path=str(wiki["train"].parent), cache_dir=str(cache), **kwargs)
        data.setup("fit")
        return data

    first = setup()
    assert len(_built(caplog)) == 4  # the vocabulary, and the three files encoded with it
    entries = {p.name: p.stat().st_mtime_ns for p in (cache / "tokens").iterdir()}
    caplog.clear()
    again = setup()
    assert _built(caplog) == [] and again.vocab == first.vocab
    assert {p.name: p.stat().st_mtime_ns for p in (cache / "tokens").iterdir()} == entries
    setup(min_freq=2)  # another vocabulary: every file encoded again with its ids
    assert [m.split(" (")[1].split(")")[0] for m in _built(caplog)] == ["split", "vocabulary", "split", "split"]
    caplog.clear()
    wiki["valid"].write_text(" the valid split changed \n")
    changed = setup()
    assert len(_built(caplog)) == 1 and changed.stats()["sentences"]["valid"] == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "no meta.json", "unreadable meta.json",
                                    "meta.json of another format", "missing file"])
def test_a_damaged_cache_is_rebuilt_with_a_warning(damage, wiki, tmp_path, caplog):
    store = TokenStore(tmp_path / "cache")
    vocab = store.vocabulary(wiki["train"])
    entry = store.split(wiki["train"], vocab).directory
    tokens, meta = entry / "tokens.bin", entry / "meta.json"
    if damage == "truncated":
        os.truncate(tokens, tokens.stat().st_size - 2)
    elif damage == "flipped byte":
        data = bytearray(tokens.read_bytes())
        data[5] ^= 0x01
        tokens.write_bytes(bytes(data))
    elif damage == "no meta.json":
        meta.unlink()
    elif damage == "unreadable meta.json":
        meta.unlink()
        meta.mkdir()
    elif damage == "meta.json of another format":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 0}))
    else:
        (entry / "lines.bin").unlink()
    caplog.set_level(logging.INFO, logger="lightning_mp_lstm.data")
    split = TokenStore(tmp_path / "cache").split(wiki["train"], vocab)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"the token cache {entry} of {wiki['train']} is damaged" in warnings[0]
    assert warnings[0].endswith(": rebuilding it") and len(_built(caplog)) == 1
    assert split.tokens.tolist() == [i for s in _old_encoding(wiki["train"], vocab) for i in s]
    caplog.clear()
    TokenStore(tmp_path / "cache").split(wiki["train"], vocab)
    assert caplog.records == []  # rebuilt for good


def test_a_cache_directory_that_cannot_be_written_falls_back_to_a_temporary_one(wiki, tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="lightning_mp_lstm.data"):
        store = TokenStore(blocked)
        vocab = store.vocabulary(wiki["train"])
    assert f"cannot write the token cache in {blocked / 'tokens'}" in caplog.text
    assert store.root.is_dir() and not str(store.root).startswith(str(blocked))
    assert vocab == Vocabulary.build(read_sentences(wiki["train"]))


def _open_in_a_process(cache: str, train: str, start, results) -> None:
    from lightning_mp_lstm.data.token_store import TokenStore

    start.wait()  # both processes open the new corpus at once
    store = TokenStore(cache)
    vocab = store.vocabulary(train)
    split = store.split(train, vocab)
    results.put((os.getpid(), vocab.digest, str(split.directory), split.tokens.tolist()))


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_two_processes_opening_a_new_corpus_build_it_once(wiki, tmp_path, monkeypatch):
    real = token_store._tokenize
    built = tmp_path / "built"

    def slow(path, *args):  # inherited by the forked processes: one builds, the other must wait for its lock
        with open(built, "a") as handle:
            handle.write(f"{os.getpid()} {Path(path).name}\n")
        import time

        time.sleep(0.5)
        return real(path, *args)

    monkeypatch.setattr(token_store, "_tokenize", slow)
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=_open_in_a_process, args=(str(tmp_path / "cache"), str(wiki["train"]),
                                                                  start, results)) for _ in range(2)]
    for process in processes:
        process.start()
    got = [results.get(timeout=50) for _ in processes]
    for process in processes:
        process.join(10)
        assert process.exitcode == 0
    assert got[0][1:] == got[1][1:] and got[0][0] != got[1][0]
    assert len(built.read_text().splitlines()) == 1  # one pass over the training file, by one of them
    assert not list((tmp_path / "cache" / "tokens").glob(".tmp-*"))


def test_a_memory_mapped_split_pickles_as_its_path(wiki, tmp_path):
    store = TokenStore(tmp_path / "cache")
    split = store.split(wiki["train"], store.vocabulary(wiki["train"]))
    data = pickle.dumps(split)
    assert len(data) < 600 and b"Valkyria" not in data
    copy = pickle.loads(data)
    assert isinstance(copy.tokens, np.memmap) and copy.directory == split.directory
    assert np.array_equal(copy.tokens, split.tokens) and np.array_equal(copy.offsets, split.offsets)
    assert copy.longest() == split.longest()
    dataset = BucketedDataset(split, [4, 8])
    restored = pickle.loads(pickle.dumps(dataset))
    assert "_flat" not in dataset.__getstate__() and isinstance(restored._flat, np.memmap)
    assert all(torch.equal(a, b) for i in range(len(dataset)) for a, b in zip(dataset[i], restored[i]))


# ----- the datasets ----------------------------------------------------------------------------------------------
class _OldBucketedDataset:
    """``BucketedDataset`` as it was before the token store (lists of ids concatenated into int64)."""

    def __init__(self, sentences, buckets, long_policy, bos_id, min_bucket_size):
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        new = BucketedDataset([[bos_id]], buckets)
        self.buckets = new.buckets
        max_len = self.buckets[-1]
        flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in sentences])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        long_mask = lengths > max_len
        self.num_long = int(long_mask.sum())
        if long_policy == "split" and self.num_long:
            pieces = np.where(long_mask, -(-lengths // max_len), 1)
            sent_of = np.repeat(np.arange(lengths.size), pieces)
            piece_no = np.arange(sent_of.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            off = starts[sent_of] + piece_no * max_len
            n = np.minimum(lengths[sent_of] - piece_no * max_len, max_len)
            first = np.where(piece_no == 0, bos_id, flat[np.maximum(off - 1, 0)])
        else:
            keep = ~long_mask if long_policy == "drop" else np.ones(lengths.size, dtype=bool)
            off, n = starts[keep], np.minimum(lengths[keep], max_len)
            first = np.full(off.size, bos_id, dtype=np.int64)
        self._flat, self._offsets, self._lengths, self._first = flat, off, n, first
        self.bucket_indices = np.searchsorted(np.asarray(self.buckets), n, side="left")
        new._offsets, new.bucket_indices = off, self.bucket_indices  # the same enforcement code, unchanged
        new._enforce_min_bucket_size(min_bucket_size)

    def __getitem__(self, index):
        t = self.buckets[int(self.bucket_indices[index])]
        o, n = int(self._offsets[index]), int(self._lengths[index])
        targets, inputs = np.zeros(t, dtype=np.int64), np.zeros(t, dtype=np.int64)
        targets[:n] = self._flat[o : o + n]
        inputs[0] = self._first[index]
        inputs[1:n] = self._flat[o : o + n - 1]
        return torch.from_numpy(inputs), torch.from_numpy(targets)


def _old_stream_rows(sentences, eos_id, rows):
    stream = np.concatenate([np.asarray([eos_id], dtype=np.int64), *(np.asarray(s, dtype=np.int64) for s in sentences)])
    columns = stream.size // rows
    return stream[: rows * columns].reshape(rows, columns)


@pytest.mark.parametrize(("policy", "buckets", "min_size"), [("split", [8, 16, 24, 32, 60], 1), ("split", [5, 12], 3),
                                                              ("truncate", [8, 30], 2), ("drop", [10, 20, 40], 1)])
def test_bucketed_batches_equal_the_old_implementation_on_ptb(ptb, tmp_path, policy, buckets, min_size):
    train = ptb / "ptb.valid.txt"
    store = TokenStore(tmp_path / "cache")
    vocab = store.vocabulary(train)
    new = BucketedDataset(store.split(train, vocab), buckets, long_policy=policy, bos_id=vocab.eos_id,
                          min_bucket_size=min_size)
    old = _OldBucketedDataset(_old_encoding(train, vocab), buckets, policy, vocab.eos_id, min_size)
    assert new.buckets == old.buckets and new.num_long == old.num_long and new.num_long > 0
    assert np.array_equal(new.bucket_indices, old.bucket_indices) and len(new) == old._offsets.size
    for index in range(len(new)):
        got, expected = new[index], old[index]
        assert got[0].dtype == got[1].dtype == torch.int64
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), index
        assert new.example_length(index) == int(old._lengths[index])


@pytest.mark.parametrize("rows", [1, 7, 20])
def test_stream_windows_equal_the_old_implementation(ptb, tmp_path, rows):
    train = ptb / "ptb.valid.txt"
    store = TokenStore(tmp_path / "cache")
    vocab = store.vocabulary(train)
    stream = TokenStream(store.split(train, vocab), vocab.eos_id, rows, bptt=35)
    old = _old_stream_rows(_old_encoding(train, vocab), vocab.eos_id, rows)
    assert np.array_equal(stream.data, old)
    for index in range(len(stream)):
        window, row = divmod(index, rows)
        start, length = stream._starts[window], stream.buckets[window]
        tokens = old[row, start : start + length + 1]
        inputs, targets = stream[index]
        assert inputs.tolist() == tokens[:-1].tolist() and targets.tolist() == tokens[1:].tolist()


def test_the_data_module_on_files_and_on_synthetic_data_serves_the_old_batches(ptb, tmp_path):
    """Loaders, stream mode, the unigram baseline and a restored vocabulary, against the old way's numbers."""
    files = {"train": str(ptb / "ptb.valid.txt"), "valid": str(ptb / "ptb.test.txt"), "test": str(ptb / "ptb.test.txt")}
    data = LMDataModule(source="ptb", **files, cache_dir=str(tmp_path / "cache"), batch_size=64, buckets="auto")
    data.setup("fit")
    vocab = data.vocab
    train, valid = _old_encoding(Path(files["train"]), vocab), _old_encoding(Path(files["valid"]), vocab)
    old = _OldBucketedDataset(train, data.bucket_lengths, "split", vocab.eos_id, 1)
    assert data.train_dataloader().dataset.buckets == old.buckets
    indices = list(data.train_dataloader().batch_sampler)
    for batch, index in zip(data.train_dataloader(), indices, strict=True):
        assert torch.equal(batch.inputs, torch.stack([old[i][0] for i in index]))
        assert torch.equal(batch.targets, torch.stack([old[i][1] for i in index]))
    counts = np.bincount(np.concatenate([np.asarray(s) for s in train]), minlength=len(vocab)).astype(float) + 1.0
    counts[0] = 0.0
    logp = np.log(counts / counts.sum(), where=counts > 0, out=np.full(len(vocab), -np.inf))
    assert data.unigram_perplexity == float(np.exp(-logp[np.concatenate([np.asarray(s) for s in valid])].mean()))
    assert data.stats()["tokens"] == {"train": 73760, "valid": 82430, "test": 82430}
    assert data.longest_sentence() == (75, f"line 1021 of {files['train']}")
    # a checkpoint's smaller vocabulary: the splits are encoded again, with its ids
    small = Vocabulary.build(read_sentences(files["train"]), max_size=100)
    with pytest.warns(UserWarning, match="the checkpoint's vocabulary replaces the one built"):
        data.load_state_dict({"vocab": small.state_dict()})
    assert max(int(b.targets.max()) for b in data.train_dataloader()) < 100
    stream = LMDataModule(source="ptb", **files, cache_dir=str(tmp_path / "cache"), mode="stream", batch_size=10)
    stream.setup("fit")
    rows = _old_stream_rows(train, vocab.eos_id, 10)
    first = next(iter(stream.train_dataloader()))
    assert first.inputs.tolist() == rows[:, :35].tolist() and first.targets.tolist() == rows[:, 1:36].tolist()
    synthetic = LMDataModule(synthetic={"num_train": 300, "num_valid": 50, "num_test": 50}, batch_size=16)
    synthetic.setup("fit")
    sentences = synthetic._corpus.sentences["train"]
    old = _OldBucketedDataset([synthetic.vocab.encode(s) for s in sentences], synthetic.bucket_lengths, "split", 2, 1)
    new = synthetic.dataset("train")
    assert new._flat.dtype == np.uint16 and not isinstance(new._flat, np.memmap)
    assert all(torch.equal(a, b) for i in range(len(new)) for a, b in zip(new[i], old[i]))


def test_a_vocabulary_restored_before_setup_encodes_with_its_own_ids(wiki, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning_mp_lstm.data")
    restored = Vocabulary(["<pad>", "<unk>", "<eos>", "the", "<extra>", "game"])
    data = LMDataModule(source="wikitext", path=str(wiki["train"].parent), cache_dir=str(tmp_path / "cache"))
    data.load_state_dict({"vocab": restored.state_dict()})
    data.setup("fit")
    assert data.vocab == restored and "(vocabulary)" not in caplog.text  # the training file was not counted
    assert data._encode("valid").tokens.tolist() == [i for s in _old_encoding(wiki["valid"], restored) for i in s]


def test_the_wikitext_shaped_corpus_is_deterministic_and_has_wikitext_s_layout(tmp_path):
    from benchmarks.wikitext_shaped import TEST_TOKENS, VALID_TOKENS, generate

    first, again = generate(tmp_path / "a", train_tokens=30_000, seed=1), generate(tmp_path / "b", 30_000, seed=1)
    assert all(first[split].read_bytes() == again[split].read_bytes() for split in first)
    text = first["train"].read_text()
    assert [len(first[s].read_text().split()) for s in first] == [30_000, VALID_TOKENS, TEST_TOKENS]
    lines = text.split("\n")
    headings = [line for line in lines if line.startswith(" = ")]
    assert headings and all(line.endswith(" = ") for line in headings) and lines.count(" ") > len(headings)
    assert all(20 <= len(line.split()) <= 200 for line in lines[:-3] if line.split() and line not in headings)
    data = LMDataModule(source="wikitext", path=str(tmp_path / "a"), cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    assert "<unk>" in text and data.vocab_size == len({*text.split()} - {"<unk>"}) + 3
