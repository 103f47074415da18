"""The process groups of one process's place in the ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroups", "copy_from_first", "shared"]


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of this process's place in the mesh: its pipeline, its stage's replicas, its stage's
    tensor-parallel shards (each may have one member)."""

    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup
    tensor_parallel: dist.ProcessGroup

    @classmethod
    def of(cls, mesh: DeviceMesh) -> ProcessGroups:
        """The groups of a ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh."""
        return cls(*(mesh[name].get_group() for name in ("pipeline_parallel", "data_parallel", "tensor_parallel")))


def shared(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has other members than this process."""
    return dist.get_world_size(group) > 1


def copy_from_first(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Give every member of ``group`` its first member's values of ``tensors`` (the same tensors, in the same order, on
    every member), in place: one broadcast each."""
    if not shared(group):
        return
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.detach(), group=group, group_src=0)
