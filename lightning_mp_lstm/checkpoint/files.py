"""One checkpoint file: written atomically (:class:`AtomicCheckpointIO`), read with a clear error for a damaged
file (:func:`read_checkpoint`: one that cannot be read, whose bytes differ from its integrity record, or that holds
a NaN)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mp_lstm.checkpoint.integrity import INTEGRITY_KEY, checkpoint_tensors, damaged_entries, damaged_tensors

__all__ = ["AtomicCheckpointIO", "CheckpointError", "check_finite", "check_integrity", "read_checkpoint"]

#: What a damaged checkpoint's message ends with.
DAMAGED_HINT = ("it was damaged after it was written (on disk or in a copy): resume from an earlier checkpoint, or "
                "from another copy of this one")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model: the message says which file or tensor."""


def read_checkpoint(path: str | os.PathLike, load: Any = None, model_state: bool = True) -> dict[str, Any]:
    """Load a checkpoint file, with a message that names the file when it is truncated, damaged or not a checkpoint.

    Args:
        path: the file (local or any fsspec URL).
        load: the reader, e.g. a ``CheckpointIO``'s ``load_checkpoint``; default: :class:`AtomicCheckpointIO`'s, onto
            the CPU (a local file memory-mapped).
        model_state: require a ``state_dict`` (not for the metadata file of a sharded checkpoint).

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: the file exists but is not a complete checkpoint; a part of it differs from the checksum
            recorded when it was written (:func:`check_integrity`; a local file's pickled structure is checked
            before it is unpickled); or a model or optimizer tensor in it holds a NaN or an infinity
            (:func:`check_finite`).
    """
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if _is_local(fs) and Path(path).is_file():
        damaged = damaged_entries(path)
        if damaged:
            raise CheckpointError(
                f"checkpoint {path} is damaged: the bytes of {', '.join(damaged)} (everything but the tensors: epoch, "
                f"loops, hyperparameters, vocabulary) differ from the CRC-32 recorded when it was written; "
                f"{DAMAGED_HINT}"
            )
    try:
        checkpoint = load(path) if load is not None else AtomicCheckpointIO().load_checkpoint(
            path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001  (torch gives EOFError, KeyError, RuntimeError, OSError...)
        size = fs.size(path)
        raise CheckpointError(
            f"checkpoint {path} ({size:,} bytes) cannot be read: it is truncated or not a checkpoint "
            f"({type(error).__name__}: {error or 'end of file'}); a run killed while saving leaves the previous "
            "file intact, so resume from that one"
        ) from error
    if not isinstance(checkpoint, dict) or (model_state and "state_dict" not in checkpoint):
        raise CheckpointError(f"{path} holds no model state ('state_dict'): it is not a Lightning checkpoint")
    if model_state:
        check_integrity(checkpoint, f"checkpoint {path}")
        check_finite(checkpoint, f"checkpoint {path}")
    return checkpoint


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def check_integrity(checkpoint: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint whose model or optimizer tensors differ from the checksums recorded when it was written
    (:func:`~lightning_mp_lstm.checkpoint.integrity.with_record`); one without a record passes.

    Raises:
        CheckpointError: naming every damaged tensor (the first 10, and how many more).
    """
    found = damaged_tensors(checkpoint)
    if not found or not found[0]:
        return
    damaged, compared = found
    listed = ", ".join(damaged[:10]) + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
    raise CheckpointError(
        f"{source} is damaged: {len(damaged)} of its {compared} tensors differ from the CRC-32 checksums recorded "
        f"when it was written: {listed}; {DAMAGED_HINT} (a file changed on purpose: delete its "
        f"{INTEGRITY_KEY!r} entry)"
    )


def check_finite(checkpoint: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint whose model or optimizer tensors hold a NaN or an infinity: a damaged file (a flipped
    bit) or a run saved after it diverged would otherwise load and fail steps later as a NaN loss.

    Raises:
        CheckpointError: naming the first such tensor and how many of its values are not finite.
    """
    for name, value in checkpoint_tensors(checkpoint):
        value = value.to_local() if isinstance(value, DTensor) else value  # this process's shard: no collective
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(
                f"{source} holds non-finite values: {name} has {bad:,} NaN or infinite value(s) of {value.numel():,}; "
                "the file is damaged or was saved after training diverged: resume from an earlier checkpoint"
            )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing local files atomically in their own directory, reading them mapped.

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
        if not _is_local(get_filesystem(path)):
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


    @override
    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """A local file memory-mapped (``torch.load(mmap=True)``): a process reads the pages of the tensors it takes
        (its own blocks' and their optimizer state), not the whole model; other paths as Lightning reads them."""
        if not _is_local(get_filesystem(path)):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)


def _serialize(checkpoint: dict[str, Any], handle: Any) -> None:
    """Write ``checkpoint`` to the open file ``handle`` (re-exported by the package, where tests replace it)."""
    torch.save(checkpoint, handle)
