"""Layout-independent checkpoints: parameters and optimizer state keyed by parameter name.

Every process holds only its own blocks. On save, rank 0 gathers every process's tensors into one
state dict with the full model's parameter names, so a checkpoint written by any layout loads into
any other (one process included). On load, each process takes the entries of its own parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "gather_to_rank_zero",
    "load_local_optimizer_state",
    "merge_optimizer_states",
    "local_model_state",
    "optimizer_state_by_name",
]


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

    Tensors travel on CPU, whatever the device; without a process group the list holds ``local`` only.
    """
    local = _to_cpu(local)
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    world = dist.get_world_size()
    out: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(local, out, dst=0)
    return out


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with parameter indices replaced by ``module``'s parameter names."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    index_to_name = {i: name_of[id(p)] for i, p in enumerate(params)}
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [index_to_name[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def merge_optimizer_states(
    states: Iterable[dict[str, Any]], block_names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Merge per-process name-keyed optimizer states (same groups everywhere) into one.

    Args:
        states: one name-keyed state per process (see :func:`optimizer_state_by_name`).
        block_names: the full model's blocks in model order. Each group's parameters are then listed in
            model order (stable within a block), whatever process held which block: a plain optimizer
            over the full model pairs saved and live parameters by position, so a layout whose processes
            hold non-contiguous blocks (interleaved, V-shaped) would otherwise mix up their state.
    """
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in states:
        merged["state"].update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            seen = set(merged["param_groups"][i]["params"])
            merged["param_groups"][i]["params"] += [n for n in group["params"] if n not in seen]
    if block_names is not None:
        blocks = list(block_names)

        def block_index(name: str) -> int:
            return next((i for i, b in enumerate(blocks) if name == b or name.startswith(b + ".")), len(blocks))

        for group in merged["param_groups"]:
            group["params"] = sorted(group["params"], key=block_index)
    return merged


def load_local_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, state: Mapping[str, Any]
) -> None:
    """Load a name-keyed optimizer state into an optimizer over a subset of ``module``'s parameters.

    Raises:
        KeyError: the checkpoint lacks state for a parameter this process holds.
    """
    name_of = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = [name_of[id(p)] for p in params]
    groups_by_name = {n: i for i, g in enumerate(state["param_groups"]) for n in g["params"]}
    missing = [n for n in names if n not in groups_by_name]
    if missing:
        raise KeyError(f"the checkpoint's optimizer state has no entry for parameters {missing}")
    index = {n: i for i, n in enumerate(names)}
    local_groups = []
    for group in optimizer.param_groups:
        saved = state["param_groups"][groups_by_name[name_of[id(group["params"][0])]]]
        local_groups.append({**saved, "params": [index[name_of[id(p)]] for p in group["params"]]})
    local_state = {index[n]: s for n, s in state["state"].items() if n in index}
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def local_model_state(module: nn.Module, full_state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``full_state`` that belong to ``module`` (a pruned model).

    Raises:
        KeyError: a parameter or buffer of ``module`` is missing from ``full_state``.
    """
    wanted = module.state_dict().keys()
    missing = [k for k in wanted if k not in full_state]
    if missing:
        raise KeyError(f"the checkpoint has no entry for {missing}; it holds {sorted(full_state)[:20]}...")
    return {k: full_state[k] for k in wanted}
