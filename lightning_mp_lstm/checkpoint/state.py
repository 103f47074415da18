"""Model and optimizer state keyed by parameter name, for a model pruned to one process's blocks.

Names (FQNs), whole tensors of tensor-parallel ``DTensor`` parameters, and the pairing of a name-keyed state with
an optimizer over some of the parameters come from torch's ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_*``, what Lightning's ``ModelParallelStrategy``
uses). What is ours: a tied weight's copies (one parameter under two names, on two processes) saved once under
the first name; per-process states merged in one process's parameter order; positional states (Lightning's
one-process strategies) keyed by name; and strict checks with messages that name the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_mp_lstm.checkpoint.files import CheckpointError
from lightning_mp_lstm.pipeline.tied import shared_parameter_aliases

__all__ = [
    "ModelNames",
    "load_model_state",
    "load_optimizer_state",
    "local_model_state",
    "merge_optimizer_states",
    "model_state",
    "name_keyed_optimizer_state",
    "optimizer_state",
    "with_aliases",
]

#: What a strict load that found missing or unexpected tensors suggests.
STRICT_HINT = "load with strict=False (LightningModule.strict_loading = False) to skip them"
#: Optimizer settings that choose a kernel, not the update: a process keeps its own when it loads a checkpoint.
_KERNEL_KEYS = ("fused", "foreach")


@dataclass(frozen=True)
class ModelNames:
    """The whole model's names, recorded before it is pruned to a process's blocks: what a checkpoint holds.

    Attributes:
        state_keys: its ``state_dict()`` keys in order; ``None``: not recorded (the keys at hand are used).
        parameter_names: its ``named_parameters()`` names in order (the order a one-process optimizer holds them);
            ``None``: not recorded.
        aliases: every further name of a tied weight -> its first name
            (:func:`~lightning_mp_lstm.pipeline.tied.shared_parameter_aliases`).
    """

    state_keys: Sequence[str] | None = None
    parameter_names: Sequence[str] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, module: nn.Module) -> ModelNames:
        """The names of ``module`` as it is now (whole; meta tensors are fine)."""
        return cls(list(module.state_dict()), [name for name, _ in module.named_parameters()],
                   shared_parameter_aliases(module))


def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """``module``'s state dict (torch's ``get_model_state_dict``); ``full``: tensor-parallel ``DTensor`` entries as
    whole tensors (a collective over each one's mesh), else as they are."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full))


def optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, aliases: Mapping[str, str] | None = None, full: bool = True
) -> dict[str, Any]:
    """``optimizer``'s state keyed by ``module``'s parameter names (torch's ``get_optimizer_state_dict``), a tied
    weight's copy under its first name (``aliases``: see :class:`ModelNames`).

    Args:
        optimizer: an optimizer over (some of) ``module``'s parameters.
        module: this process's part of the model (other blocks absent; names unchanged).
        aliases: every further name of a tied weight -> its first name.
        full: ``DTensor`` state as whole tensors (a collective over each one's mesh), else as the local shards.
    """
    aliases = aliases or {}
    if optimizer.state:
        state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=full))
    else:
        # torch's get_optimizer_state_dict first creates the state of a stateless optimizer by a step with learning
        # rate 0 (its _init_optim_state): Adam's step count of the live run would start at 1, not 0. So an
        # optimizer without state (before its first step, or SGD without momentum) is keyed here.
        name = {id(p): n for n, p in module.named_parameters()}
        position = [name[id(p)] for group in optimizer.param_groups for p in group["params"]]
        state = {"state": {}, "param_groups": [{**g, "params": [position[i] for i in g["params"]]}
                                               for g in optimizer.state_dict()["param_groups"]]}
    return {
        "state": {aliases.get(n, n): s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [aliases.get(n, n) for n in g["params"]]} for g in state["param_groups"]],
    }


def merge_optimizer_states(states: Iterable[dict[str, Any]], order: Sequence[str] | None = None) -> dict[str, Any]:
    """Merge per-process name-keyed optimizer states (same groups everywhere) into one.

    Args:
        states: one name-keyed state per process (see :func:`optimizer_state`).
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


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, state: Mapping[str, Any],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Load a name-keyed optimizer state (of the whole model, or more) into an optimizer over some of ``module``'s
    parameters with torch's ``set_optimizer_state_dict``: each parameter gets the state saved under its name (a
    tied weight's copy: under its first name), and a whole tensor saved for a ``DTensor`` parameter is cut to
    this process's shard. Parameters the state lists without state (never stepped) start without state.

    Raises:
        CheckpointError: a parameter this process holds is in none of the checkpoint's groups.
    """
    aliases = aliases or {}
    entries = dict(state["state"])
    # The kernel choice (fused, foreach) is how this process computes the update, not training state: a checkpoint
    # of another layout (sharded parameters take no fused kernels) or of an earlier version keeps this optimizer's.
    kernels = [{k: g[k] for k in _KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    groups = [{**g, "params": list(g["params"]), **kernels[min(i, len(kernels) - 1)]}
              for i, g in enumerate(state["param_groups"])]
    names = [n for n, _ in module.named_parameters()]
    for name in names:  # a tied weight's copy that this process knows by a further name only
        first = aliases.get(name)
        if first is not None:
            if first in entries:
                entries[name] = entries[first]
            for group in groups:
                if first in group["params"]:
                    group["params"].append(name)
    name_of = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    listed = {n for group in groups for n in group["params"]}
    missing = [name_of[id(p)] for p in params if name_of[id(p)] not in listed]
    if missing:
        raise CheckpointError(f"the checkpoint's optimizer state has no entry for parameters {missing}")
    if not entries:
        # torch takes a state without entries for a positional one (its _split_optim_state_dict tests
        # all(isinstance(k, int) for k in state), true of none) and loads the whole model's groups into the pruned
        # optimizer's; so the groups of a state-less checkpoint (SGD, or saved before the first step) are cut here.
        group_of = {n: g for g in groups for n in g["params"]}
        optimizer.load_state_dict({"state": {}, "param_groups": [
            {**group_of[name_of[id(g["params"][0])]], "params": [name_of[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]})
        return
    # full_state_dict=True cuts whole tensors into DTensor shards; torch needs state tensors to do it (it asserts on
    # an optimizer without any, such as SGD without momentum). strict=False: a parameter without saved state
    # (never stepped) starts without state, as with optimizer.load_state_dict.
    whole = any(isinstance(p, DTensor) for p in params) and any(
        isinstance(v, torch.Tensor) and v.dim() > 0 for s in entries.values() for v in s.values())
    set_optimizer_state_dict(module, optimizer, {"state": entries, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=whole, strict=False))


def local_model_state(
    module: nn.Module, full_state: Mapping[str, Any], strict: bool = True, full_keys: Iterable[str] | None = None,
    source: str = "the checkpoint", hint: str = STRICT_HINT,
) -> dict[str, Any]:
    """The entries of ``full_state`` that belong to ``module`` (a pruned model), checked against it.

    Args:
        module: this process's part of the model.
        full_state: the checkpoint's model state (every block).
        strict: raise for entries the model lacks (``full_keys``) or the checkpoint lacks; otherwise skip them.
        full_keys: the state-dict keys of the whole, unpruned model (for the unexpected-entry check).
        source: how the messages name the checkpoint.
        hint: what the missing/unexpected message suggests.

    Raises:
        CheckpointError: with ``strict``, a missing or unexpected entry; always, a tensor whose shape differs
            from the model's (the message names the tensor and both shapes).
    """
    own = module.state_dict()
    missing = [k for k in own if k not in full_state]
    unexpected = sorted(set(full_state) - set(full_keys)) if full_keys is not None else []
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{source} does not fit the model: missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'}; "
            f"{hint}"
        )
    for key, value in own.items():
        if key in full_state and tuple(full_state[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{_possessive(source)} {key} has shape {tuple(full_state[key].shape)} but the model's has shape "
                f"{tuple(value.shape)}: the checkpoint is of a different model size (or vocabulary)"
            )
    return {k: full_state[k] for k in own if k in full_state}


def _possessive(source: str) -> str:
    return f"{source}'s" if source == "the checkpoint" else f"{source}:"


def load_model_state(
    module: nn.Module, full_state: Mapping[str, Any], strict: bool = True, full_keys: Iterable[str] | None = None
) -> None:
    """Load the entries of ``full_state`` that belong to ``module`` (checked by :func:`local_model_state`) with
    torch's ``set_model_state_dict``: a whole tensor saved for a ``DTensor`` is cut to this process's shard."""
    own = local_model_state(module, full_state, strict=strict, full_keys=full_keys)
    if own:  # (torch refuses an empty state; strict=False may leave nothing of this process's to load)
        set_model_state_dict(module, own, options=StateDictOptions(full_state_dict=True, strict=strict))


def with_aliases(state: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """``state`` with each tied weight's further names filled in from its first name where the state lacks them
    (a tied weight saved once, under its first name)."""
    out = dict(state)
    for name, first in aliases.items():
        if name not in out and first in out:
            out[name] = out[first]
    return out
