"""The sharded checkpoint format: a directory in which every rank writes its own tensors with
``torch.distributed.checkpoint`` (DCP); nothing is gathered on one rank, and it loads on any layout.

Global rank 0 writes everything but the tensors (epoch, loops, callbacks, the optimizers' name-keyed
``param_groups``) to :data:`SHARDED_METADATA`. :func:`consolidate` turns a directory into one ordinary file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mp_lstm.checkpoint.files import AtomicCheckpointIO, CheckpointError, read_checkpoint

__all__ = ["SHARDED_METADATA", "consolidate", "is_sharded", "load_sharded", "save_sharded"]

#: The file of a sharded checkpoint directory that holds everything but the tensors (written by global rank 0).
SHARDED_METADATA = "lightning.pt"


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
    :data:`SHARDED_METADATA`. The directory is written under a temporary name and then renamed over ``path``, so the
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
        AtomicCheckpointIO().save_checkpoint(meta, partial / SHARDED_METADATA)
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(partial, target)
        shutil.rmtree(old, ignore_errors=True)

    on_rank_zero(prepare)
    dcp.save(_tensors(checkpoint), checkpoint_id=str(partial))
    on_rank_zero(finish)


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
        CheckpointError: the directory is not a complete sharded checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(path)
    meta = read_checkpoint(directory / SHARDED_METADATA, model_state=False) if is_sharded(directory) else None
    if meta is None:
        raise CheckpointError(f"{directory} is not a sharded checkpoint: it has no {SHARDED_METADATA}")
    try:
        stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except Exception as error:  # noqa: BLE001  (a damaged directory)
        raise CheckpointError(f"sharded checkpoint {directory} cannot be read: {error}") from error
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
    ``LSTMLanguageModel.load_from_checkpoint`` or one process); written atomically."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = Path(path)
    meta = read_checkpoint(directory / SHARDED_METADATA, model_state=False)
    scratch = Path(output).parent / f".{Path(output).name}.tensors-{uuid.uuid4().hex[:8]}"
    try:
        dcp_to_torch_save(str(directory), str(scratch))
        tensors = torch.load(scratch, map_location="cpu", weights_only=False)
    finally:
        scratch.unlink(missing_ok=True)
    AtomicCheckpointIO().save_checkpoint(_assemble(meta, tensors), output)
