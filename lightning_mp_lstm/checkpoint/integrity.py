"""A checkpoint's integrity: CRC-32 checksums recorded when it is written, compared when it is read.

A file damaged on disk or in a copy (flipped bits that leave every number finite) loads and trains on without them:
torch's reader does not check the CRC-32 its zip writer records for each entry. Here:

- one file: the checksum of every model and optimizer tensor is stored in the checkpoint itself, under
  :data:`INTEGRITY_KEY` (:func:`with_record`; :func:`damaged_tensors` names those that differ), and the entries that
  are not tensors (the pickled rest: epoch, loops, hyperparameters, vocabulary) are checked against the CRC-32 of
  the zip entry they were written to (:func:`damaged_entries`);
- a sharded directory: the checksum of every block ``torch.distributed.checkpoint`` wrote (one tensor, shard or
  object each) and of its ``.metadata`` file, stored in the directory's metadata file (:func:`block_checksums`,
  :func:`damaged_blocks`).

A checkpoint without a record (written before this module, or by Lightning's own strategies) is read as before:
nothing is compared, so nothing is refused. A checkpoint changed on purpose after it was written (loaded, edited,
saved again with ``torch.save``) keeps its old record: delete its :data:`INTEGRITY_KEY` entry, or store
:func:`with_record` of it.

This module computes and compares; the readers (:mod:`~lightning_mp_lstm.checkpoint.files`,
:mod:`~lightning_mp_lstm.checkpoint.sharded`) raise, naming what was damaged.
"""

from __future__ import annotations

import os
import re
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["INTEGRITY_KEY", "block_checksums", "checkpoint_tensors", "damaged_blocks", "damaged_entries",
           "damaged_tensors", "file_checksum", "tensor_checksum", "with_record"]

#: The checkpoint entry that holds its integrity record: ``{"algorithm": "crc32", "tensors": {name: checksum}}``
#: (one file), ``{"algorithm": "crc32", "blocks": {block: checksum}, "metadata": checksum}`` (sharded directory).
INTEGRITY_KEY = "mp_lstm_integrity"
ALGORITHM = "crc32"
#: The zip entries of torch's format that hold a tensor's storage (``<archive>/data/<key>``): the record covers them.
_STORAGE_ENTRY = re.compile(r"(^|/)data/[^/]+$")
_CHUNK = 1 << 24


def checkpoint_tensors(checkpoint: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of every model and optimizer-state entry of a Lightning checkpoint dictionary, named as the
    messages name them (``lstm.0.weight_hh_l0``, ``optimizer 0 state 'exp_avg' of lstm.0.weight_hh_l0``)."""
    yield from checkpoint.get("state_dict", {}).items()
    for i, optimizer in enumerate(checkpoint.get("optimizer_states", [])):
        for parameter, entries in (optimizer.get("state", {}) if isinstance(optimizer, dict) else {}).items():
            for key, value in entries.items():
                yield f"optimizer {i} state {key!r} of {parameter}", value


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of ``tensor``'s elements in order (the bytes of a contiguous CPU copy): the same for a tensor however
    it is stored (a view of a larger storage, another device)."""
    value = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def _checksums(checkpoint: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, int]:
    """The checksum of every model and optimizer tensor of ``checkpoint`` (of ``names`` only, if given); a tensor
    whose bytes cannot be read as such (sparse, quantized, on the meta device) has none."""
    wanted = set(names) if names is not None else None
    out = {}
    for name, value in checkpoint_tensors(checkpoint):
        if (wanted is None or name in wanted) and isinstance(value, torch.Tensor) and value.layout == torch.strided \
                and value.device.type != "meta":
            try:
                out[name] = tensor_checksum(value)
            except (RuntimeError, TypeError):
                continue
    return out


def with_record(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (a Lightning checkpoint dictionary of whole tensors) with its integrity record: the checksum
    of every model and optimizer tensor."""
    return {**checkpoint, INTEGRITY_KEY: {"algorithm": ALGORITHM, "tensors": _checksums(checkpoint)}}


def damaged_tensors(checkpoint: Mapping[str, Any]) -> tuple[list[str], int] | None:
    """The tensors of ``checkpoint`` whose checksum differs from its record, and how many were compared; ``None``
    when it holds no record. Tensors the record does not list, or that are gone, are not compared (a checkpoint
    trimmed on purpose, its optimizer state dropped, stays readable)."""
    record = checkpoint.get(INTEGRITY_KEY)
    if not isinstance(record, Mapping) or record.get("algorithm") != ALGORITHM:
        return None
    expected = record.get("tensors", {})
    found = _checksums(checkpoint, expected)
    return [name for name, checksum in found.items() if checksum != expected[name]], len(found)


def damaged_entries(path: str | os.PathLike) -> list[str]:
    """The entries of a checkpoint file in torch's zip format, other than tensor storages, whose bytes differ from
    the CRC-32 the writer recorded for them (``archive/data.pkl``: the pickled structure). Empty for a file that is
    not a readable zip (the loader reports it), and for entries written without a checksum (recorded as 0)."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, ValueError):
        return []
    damaged = []
    with archive:
        for info in archive.infolist():
            if info.CRC == 0 or _STORAGE_ENTRY.search(info.filename):
                continue
            try:
                archive.read(info)  # zipfile compares the CRC-32 at the end of the entry
            except zipfile.BadZipFile:
                damaged.append(info.filename)
            except (OSError, EOFError, ValueError, zlib.error):
                return damaged  # a truncated file: the loader reports it
    return damaged


def file_checksum(path: str | os.PathLike, offset: int = 0, length: int | None = None) -> int:
    """CRC-32 of ``length`` bytes of the file at ``path`` from ``offset`` (``None``: to its end), read in chunks."""
    crc = 0
    with open(path, "rb") as handle:
        handle.seek(offset)
        left = length
        while left is None or left > 0:
            chunk = handle.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            left = None if left is None else left - len(chunk)
    return crc


def _blocks(storage: Mapping[Any, Any]) -> dict[str, list[tuple[str, Any]]]:
    """``{file: [(block key, storage info), ...]}`` of a ``torch.distributed.checkpoint`` directory's
    ``storage_data`` (each block: a file, an offset and a length; its key ``<file>:<offset>:<length>``)."""
    files: dict[str, list[tuple[str, Any]]] = {}
    for index, info in storage.items():
        key = f"{info.relative_path}:{info.offset}:{info.length}"
        files.setdefault(info.relative_path, []).append((key, index))
    return files


def _share(names: Iterable[str], share: tuple[int, int]) -> list[str]:
    """This process's share of ``names`` (sorted): every ``count``-th from ``index``, ``share = (index, count)``."""
    index, count = share
    return sorted(names)[index::count]


def block_checksums(directory: str | os.PathLike, storage: Mapping[Any, Any],
                    share: tuple[int, int] = (0, 1)) -> dict[str, int]:
    """The checksum of every block of this process's share of the files of a ``torch.distributed.checkpoint``
    directory (``storage``: its metadata's ``storage_data``); the shares of every process together cover them all."""
    files = _blocks(storage)
    out: dict[str, int] = {}
    for name in _share(files, share):
        for key, _ in files[name]:
            _, offset, length = key.rsplit(":", 2)
            out[key] = file_checksum(Path(directory, name), int(offset), int(length))
    return out


def damaged_blocks(directory: str | os.PathLike, storage: Mapping[Any, Any], record: Mapping[str, int],
                   share: tuple[int, int] = (0, 1)) -> tuple[list[str], int]:
    """The entries (``model.lstm.0.weight_hh_l0``, ``optimizer.0.decoder.bias.exp_avg``; a shard's offset added,
    and the file) whose blocks in this process's share of the files differ from ``record``, and how many blocks were
    compared. A file that is gone or too short counts as damaged."""
    files = _blocks(storage)
    damaged, compared = [], 0
    for name in _share(files, share):
        for key, index in files[name]:
            if key not in record:
                continue
            compared += 1
            _, offset, length = key.rsplit(":", 2)
            try:
                path = Path(directory, name)
                whole = path.stat().st_size >= int(offset) + int(length)
                same = whole and file_checksum(path, int(offset), int(length)) == record[key]
            except OSError:
                same = False
            if not same:
                shard = f" (shard at {tuple(index.offset)})" if index.offset is not None and any(index.offset) else ""
                damaged.append(f"{index.fqn}{shard} in {name}")
    return damaged, compared
