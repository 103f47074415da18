"""Tests for corpus reading, split resolution and the PTB download."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import pytest

from lightning_mp_lstm.data.corpus import CorpusError, read_sentences, resolve_split_paths
from lightning_mp_lstm.data.download import PTB_SHA256, download_ptb


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------- reading
def test_read_real_ptb_valid(ptb: Path) -> None:
    sentences = read_sentences(ptb / "ptb.valid.txt")
    lines = [ln for ln in (ptb / "ptb.valid.txt").read_text().split("\n") if ln.strip()]
    assert len(sentences) == len(lines) == 3370
    assert sentences[0] == [*lines[0].split(), "<eos>"]
    assert all(s[-1] == "<eos>" and "<eos>" not in s[:-1] for s in sentences)
    tokens = {t for s in sentences for t in s}
    assert "<unk>" in tokens and "N" in tokens
    assert sum(map(len, sentences)) == 73760  # 70390 words + 3370 <eos>


def test_read_ptb_style_blank_lines_and_unk(tmp_path: Path) -> None:
    f = _write(tmp_path / "ptb.train.txt", " the <unk> cat sat \n\n   \n N years ago \r\n")
    assert read_sentences(f, fmt="ptb") == [
        ["the", "<unk>", "cat", "sat", "<eos>"],
        ["N", "years", "ago", "<eos>"],
    ]


def test_read_wikitext_heading_is_text(tmp_path: Path) -> None:
    text = " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles \n\n = = Gameplay = = \n"
    f = _write(tmp_path / "wiki.train.tokens", text)
    assert read_sentences(f, fmt="wikitext") == [
        ["=", "Valkyria", "Chronicles", "III", "=", "<eos>"],
        ["Senjō", "no", "Valkyria", "3", ":", "<unk>", "Chronicles", "<eos>"],
        ["=", "=", "Gameplay", "=", "=", "<eos>"],
    ]


def test_line_separator_characters_do_not_split_lines(tmp_path: Path) -> None:
    # U+2028 / U+0085 separate tokens (str.split) but never start a new sentence
    f = _write(tmp_path / "t.txt", "a\u2028b c\x85d\n")
    assert read_sentences(f) == [["a", "b", "c", "d", "<eos>"]]


def test_unknown_format_rejected(tmp_path: Path) -> None:
    f = _write(tmp_path / "t.txt", "a\n")
    with pytest.raises(ValueError, match="unknown corpus format 'csv'"):
        read_sentences(f, fmt="csv")


# ------------------------------------------------------------------ errors
def test_empty_file_error_names_file(tmp_path: Path) -> None:
    f = _write(tmp_path / "empty.txt", " \n\n \t \n")
    with pytest.raises(CorpusError, match=r"empty\.txt.*is empty: it contains no tokens"):
        read_sentences(f)


def test_binary_file_error_names_line(tmp_path: Path) -> None:
    f = _write(tmp_path / "model.bin", b"fine line\nsecond\nbad\x00\x01\x02\n")
    with pytest.raises(CorpusError, match=r"model\.bin.*looks binary: NUL byte on line 3") as err:
        read_sentences(f)
    assert isinstance(err.value, ValueError)


def test_non_utf8_error_names_first_bad_line(tmp_path: Path) -> None:
    f = _write(tmp_path / "latin1.txt", "ok line\nstill ok é\n".encode() + "caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt.*not valid UTF-8: line 3 .*byte 0xe9"):
        read_sentences(f)


def test_missing_file_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"nope\.txt.*does not exist"):
        read_sentences(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match="is a directory"):
        read_sentences(tmp_path)


# --------------------------------------------------------- split resolution
@pytest.mark.parametrize(
    "names",
    [
        ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
        ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
        ("train.txt", "valid.txt", "test.txt"),
    ],
)
def test_resolve_directory(tmp_path: Path, names: tuple[str, str, str]) -> None:
    for n in names:
        _write(tmp_path / n, "a b\n")
    paths = resolve_split_paths(tmp_path)
    assert paths == {split: tmp_path / n for split, n in zip(("train", "valid", "test"), names)}


def test_resolve_explicit_overrides_directory(tmp_path: Path) -> None:
    for n in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        _write(tmp_path / "d" / n, "a\n")
    other = _write(tmp_path / "other.txt", "b\n")
    paths = resolve_split_paths(tmp_path / "d", test=other)
    assert paths["test"] == other and paths["train"] == tmp_path / "d" / "ptb.train.txt"
    only = resolve_split_paths(train=other, valid=other, test=other)
    assert set(only.values()) == {other}


def test_resolve_missing_split_names_path_and_candidates(tmp_path: Path) -> None:
    _write(tmp_path / "ptb.train.txt", "a\n")
    _write(tmp_path / "ptb.valid.txt", "a\n")
    with pytest.raises(CorpusError) as err:
        resolve_split_paths(tmp_path)
    msg = str(err.value)
    assert "missing test split" in msg and str(tmp_path) in msg
    assert "ptb.test.txt" in msg and "wiki.test.tokens" in msg and "test.txt" in msg


def test_resolve_single_file_needs_opt_in(tmp_path: Path) -> None:
    f = _write(tmp_path / "all.txt", "a\n")
    with pytest.raises(CorpusError, match="is a file, not a directory"):
        resolve_split_paths(f)
    assert resolve_split_paths(f, single_file_for_all_splits=True) == {"train": f, "valid": f, "test": f}


def test_resolve_nonexistent_and_missing_inputs(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        resolve_split_paths(tmp_path / "missing_dir")
    with pytest.raises(CorpusError, match=r"valid file .*nothere\.txt.* does not exist"):
        resolve_split_paths(train=_write(tmp_path / "t.txt", "a\n"), valid=tmp_path / "nothere.txt")
    with pytest.raises(CorpusError, match="no file for the train split"):
        resolve_split_paths()


# ---------------------------------------------------------------- download
@pytest.fixture
def remote(ptb: Path, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A file:// "server" holding the shared PTB valid/test files (valid doubles as train)."""
    srv = tmp_path / "server"
    srv.mkdir()
    shutil.copy(ptb / "ptb.valid.txt", srv / "ptb.train.txt")
    shutil.copy(ptb / "ptb.valid.txt", srv / "ptb.valid.txt")
    shutil.copy(ptb / "ptb.test.txt", srv / "ptb.test.txt")
    train_hash = hashlib.sha256((srv / "ptb.train.txt").read_bytes()).hexdigest()
    return srv.as_uri() + "/", {"train": train_hash}


def test_download_via_file_url(tmp_path: Path, remote: tuple[str, dict[str, str]]) -> None:
    url, hashes = remote
    out = download_ptb(tmp_path / "cache", base_url=url, sha256=hashes)
    assert out == tmp_path / "cache"
    assert sorted(p.name for p in out.iterdir()) == ["ptb.test.txt", "ptb.train.txt", "ptb.valid.txt"]
    for split in ("valid", "test"):
        assert hashlib.sha256((out / f"ptb.{split}.txt").read_bytes()).hexdigest() == PTB_SHA256[split]
    # cached files are re-verified, not downloaded again: works with the server gone
    shutil.rmtree(url.removeprefix("file://"))
    assert download_ptb(out, base_url=url, sha256=hashes) == out
    assert resolve_split_paths(out)["train"] == out / "ptb.train.txt"


def test_download_corrupt_cache_is_replaced(tmp_path: Path, remote: tuple[str, dict[str, str]]) -> None:
    url, _ = remote
    cache = tmp_path / "cache"
    _write(cache / "ptb.valid.txt", "corrupted\n")
    download_ptb(cache, base_url=url, splits=("valid",))
    assert hashlib.sha256((cache / "ptb.valid.txt").read_bytes()).hexdigest() == PTB_SHA256["valid"]


def test_download_checksum_mismatch(tmp_path: Path, remote: tuple[str, dict[str, str]]) -> None:
    url, _ = remote
    wrong = "0" * 64
    with pytest.raises(CorpusError) as err:
        download_ptb(tmp_path / "cache", base_url=url, splits=("train",), sha256={"train": wrong})
    msg = str(err.value)
    assert "checksum mismatch" in msg and url + "ptb.train.txt" in msg and wrong in msg
    assert PTB_SHA256["valid"] in msg  # got: the train copy is the valid file
    assert list((tmp_path / "cache").iterdir()) == []  # no partial or unverified file left


def test_download_missing_remote_file(tmp_path: Path) -> None:
    url = (tmp_path / "empty_server").as_uri() + "/"
    with pytest.raises(CorpusError, match=r"could not download .*empty_server/ptb\.valid\.txt"):
        download_ptb(tmp_path / "cache", base_url=url, splits=("valid",))
    assert list((tmp_path / "cache").iterdir()) == []


def test_download_without_known_hash_warns(
    tmp_path: Path, remote: tuple[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = remote
    with caplog.at_level(logging.WARNING, logger="lightning_mp_lstm.data"):
        download_ptb(tmp_path / "cache", base_url=url, splits=("train",))
    assert (tmp_path / "cache" / "ptb.train.txt").is_file()
    assert any("no known SHA-256 for ptb.train.txt" in r.getMessage() for r in caplog.records)
