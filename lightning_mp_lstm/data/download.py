"""Download of the Penn Treebank (Mikolov preprocessing) with checksum verification."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

from lightning_mp_lstm.data.corpus import SPLITS, CorpusError

__all__ = ["PTB_BASE_URL", "PTB_SHA256", "download_ptb"]

log = logging.getLogger("lightning_mp_lstm.data")

#: Default location of ``ptb.{train,valid,test}.txt``.
PTB_BASE_URL = "https://raw.githubusercontent.com/tomsercu/lstm/master/data/"

#: Known SHA-256 digests of the PTB files. The training file has no entry
#: here (its digest was not verified for this library); pass it through the
#: ``sha256`` argument of :func:`download_ptb` to have it checked.
PTB_SHA256: Mapping[str, str] = {
    "valid": "6d1b028ab2267ddceed1ad3cb67d9aadf438b8c7ed74baf5b1182488f6b18231",
    "test": "91a2fa938d84baddaa05a3d67a5698924847eca8a4e7faa1518f3fd11c3d6d73",
}

_CHUNK = 1 << 20


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(url: str, dest: Path, timeout: float) -> tuple[Path, str]:
    """Stream ``url`` into a temporary file next to ``dest``.

    Returns:
        The temporary file (renamed onto ``dest`` by the caller once verified)
        and its SHA-256 hex digest.
    """
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
            for chunk in iter(lambda: resp.read(_CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError, ValueError) as err:
        tmp.unlink(missing_ok=True)
        reason = getattr(err, "reason", err)
        raise CorpusError(f"could not download {url}: {reason}") from err
    return tmp, digest.hexdigest()


def download_ptb(
    cache_dir: str | os.PathLike[str],
    base_url: str = PTB_BASE_URL,
    splits: Iterable[str] = SPLITS,
    sha256: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download ``ptb.{split}.txt`` files into ``cache_dir`` and verify them.

    Files already in the cache are re-verified and only downloaded again when
    their checksum is wrong. Downloads go to a temporary file in ``cache_dir``
    that is renamed into place only after its checksum matched, so an
    interrupted download never leaves a truncated ``ptb.*.txt`` behind.

    Checksums come from :data:`PTB_SHA256` updated with ``sha256`` (user
    values win). A split without a known checksum is accepted unverified with
    a logged warning.

    Args:
        cache_dir: Directory to download into (created if needed).
        base_url: URL prefix the file names are appended to; ``file://`` URLs
            work too.
        splits: Which splits to fetch.
        sha256: Extra or overriding ``{split: hex digest}`` values.
        timeout: Network timeout in seconds.

    Returns:
        ``cache_dir`` as a :class:`~pathlib.Path` (usable as a corpus directory).

    Raises:
        CorpusError: If a file cannot be downloaded (names the URL) or its
            checksum does not match (names the URL, expected and actual digest).
        ValueError: For an unknown split name.
    """
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    expected_all = dict(PTB_SHA256)
    expected_all.update({k: v.lower() for k, v in (sha256 or {}).items()})
    if not base_url.endswith("/"):
        base_url += "/"
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        name = f"ptb.{split}.txt"
        dest = root / name
        url = base_url + name
        expected = expected_all.get(split)
        if dest.is_file():
            if expected is None:
                log.warning("no known SHA-256 for %s; using the cached file %s unverified", name, dest)
                continue
            got = _sha256_file(dest)
            if got == expected:
                log.debug("cached %s verified", dest)
                continue
            log.warning("cached %s has SHA-256 %s, expected %s; downloading it again", dest, got, expected)
        log.info("downloading %s", url)
        tmp, got = _fetch(url, dest, timeout)
        if expected is None:
            log.warning("no known SHA-256 for %s; accepting %s unverified (SHA-256 %s)", name, url, got)
        elif got != expected:
            tmp.unlink(missing_ok=True)
            raise CorpusError(f"checksum mismatch for {url}: expected SHA-256 {expected}, got {got}")
        os.replace(tmp, dest)
    return root
