"""Layout-independent checkpoints: parameters and optimizer state keyed by parameter name.

Every process holds only its own blocks. On save, rank 0 gathers every process's tensors into one
state dict with the full model's parameter names, so a checkpoint written by any layout loads into
any other (one process included). On load, each process takes the entries of its own parameters.
Checkpoints written by Lightning's one-process strategies (optimizer state keyed by position) load too.

Files are written atomically (:class:`AtomicCheckpointIO`) and read with a clear error for a damaged file
(:func:`read_checkpoint`). The sharded format (:func:`save_sharded`, :func:`load_sharded`) is a directory in
which every rank writes its own tensors with ``torch.distributed.checkpoint``: nothing is gathered on one rank,
and it loads on any layout; :func:`consolidate` turns it into one ordinary file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_mp_lstm.faults import point_to_point_group

__all__ = [
    "SHARDED_METADATA",
    "AtomicCheckpointIO",
    "CheckpointError",
    "consolidate",
    "is_sharded",
    "load_sharded",
    "save_sharded",
    "full_tensors",
    "gather_to_rank_zero",
    "shard_like_parameters",
    "load_local_optimizer_state",
    "local_model_state",
    "merge_optimizer_states",
    "name_keyed_optimizer_state",
    "optimizer_state_by_name",
    "read_checkpoint",
]


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

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        fs = get_filesystem(path)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            super().save_checkpoint(checkpoint, path)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a writer that was killed
            stale.unlink(missing_ok=True)
        temporary = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(temporary, "wb") as handle:
                _serialize(checkpoint, handle)
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
    torch.save(checkpoint, handle)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def full_tensors(obj: Any) -> Any:
    """``obj`` with every ``DTensor`` (a tensor-parallel shard) replaced by the whole tensor it is part of.

    A collective over each DTensor's mesh: every process of it must call this with the same structure (the
    shards of one stage hold the same names in the same order).
    """
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def shard_like_parameters(values: Mapping[str, Any], module: nn.Module, aliases: Mapping[str, str] | None = None,
                          state: bool = False) -> dict[str, Any]:
    """Whole tensors saved by name -> this process's shards, wherever ``module``'s tensor of that name is a DTensor.

    Args:
        values: name -> tensor (``state=False``: a model state) or name -> dict of tensors (``state=True``: the
            optimizer state of each parameter; only the entries shaped like the parameter, e.g. Adam's moments,
            are sharded, a scalar ``step`` stays as it is).
        module: this process's (tensor-parallel) part of the model.
        aliases: see :func:`parameter_names`.
        state: whether ``values`` holds optimizer state.

    No communication: every process cuts its own slice from the whole tensor it read.
    """
    aliases = aliases or {}
    if state:
        like = {aliases.get(n, n): p for n, p in module.named_parameters() if isinstance(p, DTensor)}
    else:
        like = {n: t for n, t in module.state_dict().items() if isinstance(t, DTensor)}

    def shard(value: Any, target: DTensor) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == target.shape:
            return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements,
                                     src_data_rank=None)
        return value

    out = dict(values)
    for name, target in like.items():
        if name not in out:
            continue
        value = out[name]
        out[name] = {k: shard(v, target) for k, v in value.items()} if state else shard(value, target)
    return out


def gather_to_rank_zero(local: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Gather one picklable dict per process on global rank 0 (``None`` on the other ranks).

    Tensors travel on CPU, whatever the device; without a process group the list holds ``local`` only. Rank 0
    receives one rank at a time and unpickles it before the next, so it holds every rank's tensors once plus
    one rank's serialized bytes, not all of them twice (what ``gather_object`` needs).
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


def parameter_names(module: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[int, str]:
    """``id(parameter) -> name`` of ``module``'s parameters; a tied weight's copy under its first name
    (``aliases``: see :func:`~lightning_mp_lstm.tied.shared_parameter_aliases`)."""
    aliases = aliases or {}
    return {id(p): aliases.get(n, n) for n, p in module.named_parameters()}


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, module: nn.Module, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with parameter indices replaced by ``module``'s parameter names (a tied
    weight's copy under its first name, see :func:`parameter_names`)."""
    name_of = parameter_names(module, aliases)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    index_to_name = {i: name_of[id(p)] for i, p in enumerate(params)}
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [index_to_name[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def merge_optimizer_states(states: Iterable[dict[str, Any]], order: Sequence[str] | None = None) -> dict[str, Any]:
    """Merge per-process name-keyed optimizer states (same groups everywhere) into one.

    Args:
        states: one name-keyed state per process (see :func:`optimizer_state_by_name`).
        order: the whole model's parameter names in one process's order (``named_parameters()``). Each group's
            parameters are then listed in that order, whatever process held which block: a plain optimizer over
            the whole model pairs saved and live parameters by position, so a layout whose processes hold
            non-contiguous blocks (interleaved, V-shaped) would otherwise mix up their state.
    """
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in states:
        merged["state"].update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            seen = set(merged["param_groups"][i]["params"])
            merged["param_groups"][i]["params"] += [n for n in group["params"] if n not in seen]
    if order is not None:
        position = {name: i for i, name in enumerate(order)}
        for group in merged["param_groups"]:
            group["params"] = sorted(group["params"], key=lambda name: position.get(name, len(position)))
    return merged


def name_keyed_optimizer_state(state: Mapping[str, Any], parameter_names: Sequence[str]) -> dict[str, Any]:
    """A positional optimizer state (what ``optimizer.state_dict()`` gives, saved by a one-process strategy)
    keyed by parameter name instead.

    Args:
        state: an optimizer state dict; returned unchanged when it is already keyed by name.
        parameter_names: the names of the full model's parameters in the order the optimizer held them
            (``named_parameters()`` order, which ``configure_optimizers`` over ``self.parameters()`` keeps).

    Raises:
        CheckpointError: the state lists another number of parameters than ``parameter_names``.
    """
    positions = [i for group in state["param_groups"] for i in group["params"]]
    if not positions or not all(isinstance(i, int) for i in positions):
        return dict(state)
    if sorted(positions) != list(range(len(parameter_names))):
        raise CheckpointError(
            f"the checkpoint's optimizer state is keyed by position (written by a one-process strategy) and "
            f"lists {len(positions)} parameters, but the model has {len(parameter_names)}: they cannot be paired "
            "by name; resume with the model the checkpoint was written for"
        )
    return {
        "state": {parameter_names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [parameter_names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def load_local_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, state: Mapping[str, Any],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Load a name-keyed optimizer state into an optimizer over a subset of ``module``'s parameters (a tied
    weight's copy gets the state saved under its first name, see :func:`parameter_names`).

    Raises:
        KeyError: the checkpoint lacks state for a parameter this process holds.
    """
    name_of = parameter_names(module, aliases)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = [name_of[id(p)] for p in params]
    groups_by_name = {n: i for i, g in enumerate(state["param_groups"]) for n in g["params"]}
    missing = [n for n in names if n not in groups_by_name]
    if missing:
        raise CheckpointError(f"the checkpoint's optimizer state has no entry for parameters {missing}")
    index = {n: i for i, n in enumerate(names)}
    local_groups = []
    for group in optimizer.param_groups:
        saved = state["param_groups"][groups_by_name[name_of[id(group["params"][0])]]]
        local_groups.append({**saved, "params": [index[name_of[id(p)]] for p in group["params"]]})
    local_state = {index[n]: s for n, s in state["state"].items() if n in index}
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def local_model_state(
    module: nn.Module, full_state: Mapping[str, Any], strict: bool = True, full_keys: Iterable[str] | None = None
) -> dict[str, Any]:
    """The entries of ``full_state`` that belong to ``module`` (a pruned model), checked against it.

    Args:
        module: this process's part of the model.
        full_state: the checkpoint's model state (every block).
        strict: raise for entries the model lacks (``full_keys``) or the checkpoint lacks; otherwise skip them.
        full_keys: the state-dict keys of the whole, unpruned model (for the unexpected-entry check).

    Raises:
        CheckpointError: with ``strict``, a missing or unexpected entry; always, a tensor whose shape differs
            from the model's (the message names the tensor and both shapes).
    """
    own = module.state_dict()
    missing = [k for k in own if k not in full_state]
    unexpected = sorted(set(full_state) - set(full_keys)) if full_keys is not None else []
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint does not fit the model: missing {missing or 'nothing'}, unexpected "
            f"{unexpected or 'nothing'}; load with strict=False (LightningModule.strict_loading = False) to skip them"
        )
    for key, value in own.items():
        if key in full_state and tuple(full_state[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"the checkpoint's {key} has shape {tuple(full_state[key].shape)} but the model's has shape "
                f"{tuple(value.shape)}: the checkpoint is of a different model size (or vocabulary)"
            )
    return {k: full_state[k] for k in own if k in full_state}


# ----- sharded checkpoints ---------------------------------------------------------------------------------
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


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, param_groups: list[list[dict[str, Any]]],
                 on_rank_zero: Any) -> None:
    """Write ``checkpoint`` (this rank's name-keyed tensors) as a sharded checkpoint directory; every rank calls it.

    Every rank writes its own tensors with ``torch.distributed.checkpoint`` (tensors replicated over data-parallel
    replicas are written once). Global rank 0 writes the rest (epoch, loops, callbacks, the optimizers'
    ``param_groups``, which list every parameter by name) to :data:`SHARDED_METADATA`. The directory is written
    under a temporary name and then renamed over ``path``, so the previous checkpoint stays whole until the new
    one is.

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


def load_sharded(
    path: str | os.PathLike, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Read a sharded checkpoint directory: everything but the tensors, and the tensors of ``model``'s parameters
    (this process's blocks) and of their optimizer state. Returns a Lightning checkpoint dictionary with this
    process's tensors only; every rank calls it.

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
    template: dict[str, Any] = {"model": {k: torch.empty_like(v, device="cpu") for k, v in model.state_dict().items()
                                          if f"model.{k}" in stored}}
    names = list(parameter_names(model, aliases).values())
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
        template[f"optimizer.{i}"] = state
    dcp.load(template, checkpoint_id=str(directory))
    checkpoint = dict(meta)
    groups = checkpoint.pop("param_groups")
    checkpoint["state_dict"] = template["model"]
    checkpoint["optimizer_states"] = [{"state": template[f"optimizer.{i}"], "param_groups": groups[i]}
                                      for i in range(len(optimizers))]
    return checkpoint


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
    checkpoint = dict(meta)
    groups = checkpoint.pop("param_groups")
    checkpoint["state_dict"] = tensors["model"]
    checkpoint["optimizer_states"] = [{"state": tensors.get(f"optimizer.{i}", {}), "param_groups": groups[i]}
                                      for i in range(len(groups))]
    AtomicCheckpointIO().save_checkpoint(checkpoint, output)

