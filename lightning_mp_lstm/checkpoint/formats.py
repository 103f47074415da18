"""The two checkpoint formats of ``MPLSTMStrategy(checkpoint_format=...)``, behind one interface.

:class:`FileFormat` (``"file"``): one checkpoint file, gathered on global rank 0 from every pipeline rank, in one
process's key and parameter order: it loads into plain Lightning, ``load_from_checkpoint`` and a user's plain module.
:class:`ShardedFormat` (``"sharded"``): a directory every rank writes its own tensors to
(:mod:`~lightning_mp_lstm.checkpoint.sharded`). Both load either format, whichever wrote what is on disk, into a
model pruned to this process's blocks; the strategy's checkpoint hooks delegate to the format it was given.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from torch import nn
from typing_extensions import override

from lightning_mp_lstm.base.faults import everywhere, gather, point_to_point_group, result_from
from lightning_mp_lstm.checkpoint.files import CheckpointError, check_finite, read_checkpoint
from lightning_mp_lstm.checkpoint.integrity import with_record
from lightning_mp_lstm.checkpoint.sharded import is_sharded, load_sharded, save_sharded
from lightning_mp_lstm.checkpoint.state import (
    ModelNames,
    load_model_state,
    load_optimizer_state,
    merge_optimizer_states,
    model_state,
    name_keyed_optimizer_state,
    optimizer_state,
)

__all__ = ["CheckpointFormat", "FileFormat", "ShardedFormat", "check_one_step", "checkpoint_format",
           "gather_to_rank_zero"]


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer of a ``LightningOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def check_one_step(checkpoint: dict[str, Any], path: Any) -> None:
    """Refuse, on every rank, to write a checkpoint whose parts come from different training steps.

    Each rank contributes its own blocks' tensors; a rank that stopped in the middle of a step (an error raised on
    that rank only, then ``OnExceptionCheckpoint`` or a save in ``on_exception``) holds its blocks as of another step
    than its peers, and a file mixing them would resume as a model no run ever had.

    Raises:
        CheckpointError: naming each rank's epoch and global step.
    """
    steps = gather(lambda: (checkpoint.get("epoch"), checkpoint.get("global_step")))
    if len(set(steps)) > 1:
        at = ", ".join(f"rank {rank} at epoch {epoch}, global step {step}" for rank, (epoch, step) in enumerate(steps))
        raise CheckpointError(
            f"checkpoint {path} was not written: the processes are at different training steps ({at}), so its parts "
            "would mix two steps' weights; a rank stopped in the middle of a step. Resume from the last checkpoint "
            "written before")


class CheckpointFormat:
    """What both formats share: loading whatever is on disk into a pruned model, and removing it.

    ``model_state``, ``optimizer_state`` and ``save`` are each format's own. Every method takes the whole model's
    names (:class:`~lightning_mp_lstm.checkpoint.ModelNames`), recorded before pruning.
    """

    name = ""

    def model_state(self, module: nn.Module, names: ModelNames) -> dict[str, Any]:
        """The model state to save (``LightningModule.state_dict`` replaced)."""
        raise NotImplementedError

    def optimizer_state(self, module: nn.Module, optimizer: Any, names: ModelNames) -> dict[str, Any]:
        """``optimizer``'s state to save, keyed by parameter name."""
        raise NotImplementedError

    def save(self, checkpoint: dict[str, Any], path: Any, io: CheckpointIO, names: ModelNames,
             storage_options: Any = None) -> None:
        """Write ``checkpoint``; every rank calls it, and a failed write fails every rank."""
        raise NotImplementedError

    def load(self, path: Any, module: nn.Module, optimizers: Sequence[Any], io: CheckpointIO,
             weights_only: bool | None, names: ModelNames) -> dict[str, Any]:
        """Read a checkpoint on every rank: a sharded directory (this process's tensors) or one file (all of it); a
        truncated, damaged or foreign one gets a message naming it (:func:`~lightning_mp_lstm.checkpoint.load_sharded`,
        :func:`~lightning_mp_lstm.checkpoint.read_checkpoint`)."""
        if is_sharded(path):
            # Every rank reads its own tensors: a damaged one fails every rank, not only its reader.
            checkpoint = load_sharded(path, module, [_inner(o) for o in optimizers], names.aliases)
            everywhere(lambda: check_finite(checkpoint, f"sharded checkpoint {path}"))
            return checkpoint
        return read_checkpoint(path, load=lambda p: io.load_checkpoint(p, weights_only=weights_only))

    def remove(self, path: Any, io: CheckpointIO) -> None:
        """Remove a checkpoint file or sharded directory (call it on one rank)."""
        if is_sharded(path):
            shutil.rmtree(path)
        else:
            io.remove_checkpoint(path)

    def load_model_state(self, module: nn.Module, checkpoint: dict[str, Any], strict: bool, names: ModelNames) -> None:
        """Load this process's entries of the checkpoint's model state (a whole tensor cut to a ``DTensor``'s
        shard), checked strictly unless ``strict=False``."""
        load_model_state(module, checkpoint["state_dict"], strict=strict, full_keys=names.state_keys)

    def load_optimizer_state(self, module: nn.Module, optimizers: Sequence[Any], checkpoint: dict[str, Any],
                             names: ModelNames) -> None:
        """Load every optimizer's state: name-keyed, or by position (Lightning's one-process strategies, paired with
        the whole model's parameter order)."""
        order = names.parameter_names or [n for n, _ in module.named_parameters()]
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"], strict=True):
            load_optimizer_state(_inner(optimizer), module, name_keyed_optimizer_state(state, order), names.aliases)


class FileFormat(CheckpointFormat):
    """One checkpoint file, gathered on global rank 0 and written there atomically (with the strategy's
    checkpoint IO, by default :class:`~lightning_mp_lstm.checkpoint.AtomicCheckpointIO`), with the checksum of every
    tensor (:func:`~lightning_mp_lstm.checkpoint.integrity.with_record`), compared when it is read.

    Tensor-parallel shards are gathered into whole tensors (torch's ``get_*_state_dict(full_state_dict=True)``),
    then rank 0 receives every other rank's tensors one rank at a time (:func:`gather_to_rank_zero`). Keys and
    each optimizer group's parameters are in one process's order, whatever rank held which block.
    """

    name = "file"

    @override
    def model_state(self, module: nn.Module, names: ModelNames) -> dict[str, Any]:
        """The whole model's state dict on global rank 0 (empty elsewhere)."""
        parts = gather_to_rank_zero(model_state(module, full=True))
        if parts is None:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in (names.state_keys or merged) if k in merged}

    @override
    def optimizer_state(self, module: nn.Module, optimizer: Any, names: ModelNames) -> dict[str, Any]:
        """The whole model's name-keyed optimizer state on global rank 0 (empty elsewhere)."""
        parts = gather_to_rank_zero(optimizer_state(_inner(optimizer), module, names.aliases, full=True))
        return merge_optimizer_states(parts, order=names.parameter_names) if parts is not None else {}

    @override
    def save(self, checkpoint: dict[str, Any], path: Any, io: CheckpointIO, names: ModelNames,
             storage_options: Any = None) -> None:
        result_from(0, lambda: io.save_checkpoint(with_record(checkpoint), path, storage_options=storage_options))


class ShardedFormat(CheckpointFormat):
    """A directory of ``torch.distributed.checkpoint`` files, each rank's own tensors (``DTensor`` shards as they
    are), plus the rest on global rank 0 (:func:`~lightning_mp_lstm.checkpoint.save_sharded`)."""

    name = "sharded"

    @override
    def model_state(self, module: nn.Module, names: ModelNames) -> dict[str, Any]:
        """This process's own tensors (nothing is gathered)."""
        return model_state(module, full=False)

    @override
    def optimizer_state(self, module: nn.Module, optimizer: Any, names: ModelNames) -> dict[str, Any]:
        """This process's name-keyed optimizer state (nothing is gathered)."""
        return optimizer_state(_inner(optimizer), module, names.aliases, full=False)

    @override
    def save(self, checkpoint: dict[str, Any], path: Any, io: CheckpointIO, names: ModelNames,
             storage_options: Any = None) -> None:
        names_only = [{"state": {}, "param_groups": s["param_groups"]} for s in checkpoint["optimizer_states"]]
        every = gather(lambda: names_only)  # every rank's parameter names: the groups list them all
        groups = [merge_optimizer_states([rank[i] for rank in every], order=names.parameter_names)["param_groups"]
                  for i in range(len(names_only))]
        save_sharded(checkpoint, path, groups, on_rank_zero=lambda fn: result_from(0, fn))


FORMATS: dict[str, type[CheckpointFormat]] = {"file": FileFormat, "sharded": ShardedFormat}


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format object of ``checkpoint_format=name`` (``"file"`` or ``"sharded"``, checked by the strategy's
    :class:`~lightning_mp_lstm.strategy.options.ProcessOptions`)."""
    return FORMATS[name]()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def gather_to_rank_zero(local: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Gather one picklable dict per process on global rank 0 (``None`` on the other ranks).

    Tensors travel on CPU, whatever the device, over the rank-to-rank object group (gloo,
    :func:`~lightning_mp_lstm.base.faults.point_to_point_group`); without a process group the list holds ``local`` only.
    Rank 0 receives one rank at a time and unpickles it before the next, so it holds every rank's tensors once plus one
    rank's serialized bytes, not all of them twice (what ``gather_object`` needs).
    """
    local = _to_cpu(local)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    group = point_to_point_group()  # gloo: the bytes stay in host memory whatever the training backend
    if dist.get_rank() != 0:
        dist.send_object_list([local], dst=0, group=group)
        return None
    parts = [local]
    for source in range(1, dist.get_world_size()):
        box: list[Any] = [None]
        dist.recv_object_list(box, src=source, group=group)
        parts.append(box[0])
    return parts
