"""The sharded checkpoint format: a directory in which every rank writes its own tensors with
``torch.distributed.checkpoint`` (DCP); nothing is gathered on one rank, and it loads on any layout.

Global rank 0 writes everything but the tensors (epoch, loops, callbacks, the optimizers' name-keyed
``param_groups``) to :data:`SHARDED_METADATA`, with the checksum of every block the ranks wrote and of DCP's
``.metadata`` (:mod:`~lightning_mp_lstm.checkpoint.integrity`): a damaged directory is refused when it is read, naming
the damaged entries. :func:`consolidate` turns a directory into one ordinary file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mp_lstm.base.faults import everywhere, gather
from lightning_mp_lstm.checkpoint.files import DAMAGED_HINT, AtomicCheckpointIO, CheckpointError, read_checkpoint
from lightning_mp_lstm.checkpoint.integrity import (
    ALGORITHM,
    INTEGRITY_KEY,
    block_checksums,
    damaged_blocks,
    file_checksum,
    with_record,
)

__all__ = ["SHARDED_METADATA", "consolidate", "is_sharded", "load_sharded", "read_sharded", "save_sharded"]

#: The file of a sharded checkpoint directory that holds everything but the tensors (written by global rank 0).
SHARDED_METADATA = "lightning.pt"
#: ``torch.distributed.checkpoint``'s own metadata file in the directory (which block holds which tensor).
DCP_METADATA = ".metadata"


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    return Path(path).is_dir() and (Path(path) / SHARDED_METADATA).is_file()


def _tensors(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    out = {"model": dict(checkpoint["state_dict"])}
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        out[f"optimizer.{i}"] = dict(state["state"])
    return out


def _assemble(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A Lightning checkpoint dictionary from a directory's metadata and (some of) its tensors."""
    checkpoint = dict(meta)
    checkpoint.pop(INTEGRITY_KEY, None)  # the directory's blocks: checked when it was read
    groups = checkpoint.pop("param_groups")
    checkpoint["state_dict"] = tensors["model"]
    checkpoint["optimizer_states"] = [{"state": tensors.get(f"optimizer.{i}", {}), "param_groups": g}
                                      for i, g in enumerate(groups)]
    return checkpoint


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, param_groups: list[list[dict[str, Any]]],
                 on_rank_zero: Any) -> None:
    """Write ``checkpoint`` (this rank's name-keyed tensors) as a sharded checkpoint directory; every rank calls it.

    Every rank writes its own tensors with ``torch.distributed.checkpoint`` (tensors replicated over data-parallel
    replicas are written once; tensor-parallel ``DTensor`` shards as they are). Global rank 0 writes the rest
    (epoch, loops, callbacks, the optimizers' ``param_groups``, which list every parameter by name) to
    :data:`SHARDED_METADATA`, with the checksums of every block: each rank reads back its share of the files and
    checksums their blocks. The directory is written under a temporary name and then renamed over ``path``, so the
    previous checkpoint stays whole until the new one is.

    Args:
        checkpoint: Lightning's checkpoint dictionary, with this rank's ``state_dict`` and name-keyed
            ``optimizer_states``.
        path: the directory to write.
        param_groups: for every optimizer, its merged, name-keyed ``param_groups`` (from every rank).
        on_rank_zero: runs a function on global rank 0 and gives its outcome (an exception too) to every rank.
    """
    import torch.distributed.checkpoint as dcp

    target = Path(path)
    partial = target.parent / f".{target.name}.partial"

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # left by a writer that was killed
        partial.mkdir(parents=True)

    def finish() -> None:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["param_groups"] = param_groups
        meta[INTEGRITY_KEY] = {"algorithm": ALGORITHM, "blocks": blocks,
                               "metadata": file_checksum(partial / DCP_METADATA)}
        AtomicCheckpointIO().save_checkpoint(meta, partial / SHARDED_METADATA)
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(partial, target)
        shutil.rmtree(old, ignore_errors=True)

    on_rank_zero(prepare)
    dcp.save(_tensors(checkpoint), checkpoint_id=str(partial))
    # dcp.save returns once every rank wrote and the coordinator wrote .metadata.
    storage = dcp.FileSystemReader(str(partial)).read_metadata().storage_data
    blocks = {k: v for part in gather(lambda: block_checksums(partial, storage, _share())) for k, v in part.items()}
    on_rank_zero(finish)


def _share() -> tuple[int, int]:
    """``(rank, world size)``: which of the directory's files this process checksums (every world-size-th)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _read_checked(directory: Path, every_block: bool) -> tuple[dict[str, Any], Any]:
    """A sharded directory's metadata file and DCP's metadata, each checked against its record, and the blocks of
    this process's share of the files (``every_block``: all of them); a directory without a record (written before
    checksums were recorded) is read unchecked.

    Raises:
        CheckpointError: not a sharded checkpoint, unreadable, or damaged (naming every damaged entry, the first 10).
    """
    import torch.distributed.checkpoint as dcp

    meta = read_checkpoint(directory / SHARDED_METADATA, model_state=False) if is_sharded(directory) else None
    if meta is None:
        raise CheckpointError(f"{directory} is not a sharded checkpoint: it has no {SHARDED_METADATA}")
    record = meta.get(INTEGRITY_KEY)
    record = record if isinstance(record, dict) and record.get("algorithm") == ALGORITHM else None
    source = f"sharded checkpoint {directory}"
    if record is not None and (directory / DCP_METADATA).is_file() and \
            file_checksum(directory / DCP_METADATA) != record.get("metadata"):
        raise CheckpointError(f"{source} is damaged: its {DCP_METADATA} (which file holds which tensor) differs "
                              f"from the CRC-32 recorded when it was written; {DAMAGED_HINT}")
    try:
        stored = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # noqa: BLE001  (a damaged directory)
        raise CheckpointError(f"{source} cannot be read: {error}") from error
    if record is not None:
        def check() -> None:
            damaged, compared = damaged_blocks(directory, stored.storage_data, record.get("blocks", {}),
                                               (0, 1) if every_block else _share())
            if damaged:
                listed = ", ".join(damaged[:10]) + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
                raise CheckpointError(
                    f"{source} is damaged: {len(damaged)} of the {compared} blocks checked differ from the CRC-32 "
                    f"checksums recorded when they were written: {listed}; {DAMAGED_HINT}")

        if every_block:
            check()
        else:  # each rank checks its share of the files: a damaged one fails every rank, not only its reader
            everywhere(check)
    return meta, stored


def read_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint directory as a Lightning checkpoint dictionary whose model entries are meta tensors of the
    stored shapes (no optimizer state): to check a model against it before anything is loaded. Every block is checked
    against the checksums recorded when it was written.

    Raises:
        CheckpointError: not a complete sharded checkpoint, or a damaged one.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta, stored = _read_checked(Path(path), every_block=True)
    prefix = "model."
    shapes = {key[len(prefix):]: torch.empty(info.size, dtype=info.properties.dtype, device="meta")
              for key, info in stored.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(info, TensorStorageMetadata)}
    checkpoint = _assemble(meta, {"model": shapes})
    checkpoint["optimizer_states"] = []
    return checkpoint


def _empty_like(value: torch.Tensor) -> torch.Tensor:
    """A template to read ``value``'s entry into: a ``DTensor`` keeps its device (its mesh's: a CPU local tensor
    on a CUDA mesh is not a valid DTensor), a plain tensor is read onto the CPU."""
    return torch.empty_like(value) if isinstance(value, DTensor) else torch.empty_like(value, device="cpu")


def load_sharded(
    path: str | os.PathLike, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Read a sharded checkpoint directory: everything but the tensors, and the tensors of ``model``'s parameters
    (this process's blocks) and of their optimizer state. Returns a Lightning checkpoint dictionary with this
    process's tensors only (model entries as ``model`` holds them: shards of its ``DTensor`` parameters; optimizer
    state as whole tensors); every rank calls it.

    The optimizer entries to read are the ones the directory holds for this process's parameters (a tied weight's
    copy under its first name, see :class:`~lightning_mp_lstm.checkpoint.ModelNames`), not a template from the live
    optimizer: a checkpoint written before the first step (or with SGD) holds none, and torch would create the live
    optimizer's state first by a step.

    Raises:
        CheckpointError: the directory is not a complete sharded checkpoint, or its blocks differ from the checksums
            recorded when they were written (each rank checks its share of the files; every rank raises).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(path)
    meta, metadata = _read_checked(directory, every_block=False)
    stored = metadata.state_dict_metadata
    tensors: dict[str, Any] = {"model": {k: _empty_like(v) for k, v in model.state_dict().items()
                                         if f"model.{k}" in stored}}
    aliases = aliases or {}
    names = [aliases.get(n, n) for n, _ in model.named_parameters()]
    for i, _ in enumerate(optimizers):
        prefix = f"optimizer.{i}."
        state: dict[str, dict[str, Any]] = {}
        for key, info in stored.items():
            if not key.startswith(prefix) or not isinstance(info, TensorStorageMetadata):
                continue
            rest = key[len(prefix):]
            name = next((n for n in names if rest.startswith(n + ".")), None)
            if name is not None:
                state.setdefault(name, {})[rest[len(name) + 1:]] = torch.empty(info.size, dtype=info.properties.dtype)
        tensors[f"optimizer.{i}"] = state
    dcp.load(tensors, checkpoint_id=str(directory))
    return _assemble(meta, tensors)


def consolidate(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Turn a sharded checkpoint directory into one ordinary checkpoint file (for plain Lightning,
    ``LSTMLanguageModel.load_from_checkpoint`` or one process); written atomically, with the checksum of every tensor.

    Raises:
        CheckpointError: the directory is not a complete sharded checkpoint, or a damaged one.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = Path(path)
    meta, _ = _read_checked(directory, every_block=True)
    scratch = Path(output).parent / f".{Path(output).name}.tensors-{uuid.uuid4().hex[:8]}"
    try:
        dcp_to_torch_save(str(directory), str(scratch))
        tensors = torch.load(scratch, map_location="cpu", weights_only=False)
    finally:
        scratch.unlink(missing_ok=True)
    AtomicCheckpointIO().save_checkpoint(with_record(_assemble(meta, tensors)), output)
