"""One checkpoint file: written atomically (:class:`AtomicCheckpointIO`), read with a clear error for a damaged
file (:func:`read_checkpoint`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "CheckpointError", "read_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model: the message says which file or tensor."""


def read_checkpoint(path: str | os.PathLike, load: Any = None, model_state: bool = True) -> dict[str, Any]:
    """Load a checkpoint file, with a message that names the file when it is truncated or not a checkpoint.

    Args:
        path: the file (local or any fsspec URL).
        load: the reader, e.g. a ``CheckpointIO``'s ``load_checkpoint``; default: Lightning's, onto the CPU.
        model_state: require a ``state_dict`` (not for the metadata file of a sharded checkpoint).

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: the file exists but is not a complete checkpoint.
    """
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = load(path) if load is not None else lightning_load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001  (torch gives EOFError, KeyError, RuntimeError, OSError...)
        size = fs.size(path)
        raise CheckpointError(
            f"checkpoint {path} ({size:,} bytes) cannot be read: it is truncated or not a checkpoint "
            f"({type(error).__name__}: {error or 'end of file'}); a run killed while saving leaves the previous "
            "file intact, so resume from that one"
        ) from error
    if not isinstance(checkpoint, dict) or (model_state and "state_dict" not in checkpoint):
        raise CheckpointError(f"{path} holds no model state ('state_dict'): it is not a Lightning checkpoint")
    return checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing local files atomically in their own directory.

    The file is written to a hidden temporary file next to the target, flushed to disk, then renamed over
    it: a run killed at any moment leaves either the previous file or the new one, never a mix.
    (Lightning's default writes the temporary file in the system's temporary directory and moves it; when
    that is another file system the move is a copy, which a kill can interrupt.) Remote paths
    (``s3://``...) use Lightning's writer.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        fs = get_filesystem(path)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            super().save_checkpoint(checkpoint, path)
            return
        from lightning_mp_lstm import checkpoint as package  # its _serialize: tests replace it to fail a write

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a writer that was killed
            stale.unlink(missing_ok=True)
        temporary = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(temporary, "wb") as handle:
                package._serialize(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)


def _serialize(checkpoint: dict[str, Any], handle: Any) -> None:
    """Write ``checkpoint`` to the open file ``handle`` (re-exported by the package, where tests replace it)."""
    torch.save(checkpoint, handle)
